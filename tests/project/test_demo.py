"""The main job, ``python -m f8tensor.demo``: a tiny end-to-end run, and its command line."""

from __future__ import annotations

import copy
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import demo_table

import f8tensor
import f8tensor.stats
from f8tensor import Float8LinearConfig, convert_to_float8_training, demo

ALL_RUNS = ["bf16", *f8tensor.RECIPES]


def _run_demo(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    # Import the f8tensor this test imported, whatever is installed.
    root = str(Path(f8tensor.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "f8tensor.demo", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        # A hang guard, not a speed check: the run takes ~20 s alone, several minutes on a
        # loaded 2-core machine with a CUDA wheel's torch (the version matrix).
        timeout=900,
        check=False,
    )


def test_tiny_run_prints_a_row_per_run_and_writes_the_png(tmp_path):
    png = tmp_path / "curves" / "loss.png"
    proc = _run_demo(tmp_path, "--size", "tiny", "--steps", "6", "--recipes", "all", "--out", str(png))
    assert proc.returncode == 0, proc.stderr
    rows = demo_table(proc.stdout)
    assert list(rows) == ALL_RUNS
    for name, cells in rows.items():
        assert math.isfinite(float(cells["loss"])) and 0 < float(cells["loss"]) < 10, (name, cells)
        assert math.isfinite(float(cells["tok/s"])) and float(cells["tok/s"]) > 0, (name, cells)
        assert float(cells["act. MiB"]) > 0, (name, cells)
        assert cells["sat."] in ("-", "n/a") or cells["sat."].endswith("%"), (name, cells)
    assert rows["tensorwise"]["loss vs bf16"].endswith("%") and rows["tensorwise"]["tok/s vs bf16"].endswith("x")
    # The optimizer state is the same in every run: said once under the table, no column.
    assert "opt. MiB" not in rows["bf16"]
    assert re.search(r"^opt\. MiB +\d+\.\d\d in every run", proc.stdout, re.MULTILINE)
    # The table and its notes fit 80 columns, with the longest run names.
    report = proc.stdout[proc.stdout.index("\nrun ") + 1 : proc.stdout.index("loss curves:")]
    assert max(map(len, report.splitlines())) <= 80, report
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"loss curves: {png}" in proc.stdout
    assert "step 6/6" in proc.stderr  # progress, as plain lines: stderr is not a terminal here
    # The act. MiB measurement starts no profiler, whose start and stop lines went to
    # stderr, a pair per run ("USDT:... profiler_start").
    noise = [line for line in proc.stderr.splitlines() if "USDT" in line or "profiler" in line]
    assert noise == [], noise


def _fails_with(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        demo.main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_unknown_recipe_lists_the_allowed_ones(capsys):
    err = _fails_with(capsys, ["--recipes", "bf16,fastest"])
    assert "unknown recipe 'fastest'" in err
    assert "bf16, tensorwise, rowwise, rowwise_with_gw_hp, delayed" in err


def test_default_runs_one_recipe_per_kind_of_scale():
    # The default (a newcomer's first run) skips the slow-on-CPU FP4 recipes; 'all' is every run.
    parser = demo.build_parser()
    default = demo._parse_runs(parser, parser.parse_args([]).recipes)
    assert default == ["bf16", "tensorwise", "rowwise", "delayed", "blockwise"]
    assert demo._parse_runs(parser, "all") == ALL_RUNS


def test_a_recipe_listed_twice_is_refused(capsys):
    assert "tensorwise more than once" in _fails_with(capsys, ["--recipes", "tensorwise,bf16,tensorwise"])


def test_empty_recipe_list_is_refused(capsys):
    assert "--recipes is empty" in _fails_with(capsys, ["--recipes", ","])


@pytest.mark.parametrize("flag", ["--steps", "--batch-size", "--seq-len", "--threads"])
def test_non_positive_counts_are_refused(capsys, flag):
    assert "must be a positive integer, got 0" in _fails_with(capsys, [flag, "0"])


def test_non_integer_steps_are_refused(capsys):
    assert "expected a positive integer, got 'ten'" in _fails_with(capsys, ["--steps", "ten"])


def test_unknown_size_is_refused(capsys):
    assert "invalid choice: 'huge'" in _fails_with(capsys, ["--size", "huge"])


def test_out_must_be_a_png(capsys):
    assert "--out must name a .png file" in _fails_with(capsys, ["--out", "curves.jpg"])


def test_seq_len_longer_than_the_corpus_is_refused(capsys):
    assert "longer than the corpus" in _fails_with(capsys, ["--seq-len", "10000000", "--size", "tiny"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without CUDA")
def test_cuda_without_cuda_says_so(capsys):
    err = _fails_with(capsys, ["--device", "cuda"])
    assert "--device cuda: PyTorch sees no CUDA device" in err


def test_saved_activations_count_fp8_inputs_as_one_byte():
    """tensorwise saves each linear's input in FP8 (1 byte/element) where bf16 saves 2."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    fp8 = convert_to_float8_training(copy.deepcopy(mlp), config=Float8LinearConfig.from_recipe("tensorwise"))
    x, y = torch.randn(4, 32, 64), torch.randint(0, 64, (4, 32))
    amp = torch.autocast("cpu", dtype=torch.bfloat16)
    saved = demo.saved_activation_bytes(mlp, x, y, amp) - demo.saved_activation_bytes(fp8, x, y, amp)
    # One byte less per element of both linears' inputs (64 and 256 per token), plus
    # a few bytes of scales on the FP8 side; the weights are never counted.
    tokens = 4 * 32
    assert tokens * (64 + 256) - 64 <= saved <= tokens * (64 + 256)


def test_the_demo_model_saves_less_in_fp8():
    size = demo.SIZES["tiny"]
    torch.manual_seed(0)
    model = demo.GPT(size)
    fp8 = convert_to_float8_training(
        copy.deepcopy(model),
        config=Float8LinearConfig.from_recipe("tensorwise"),
        module_filter_fn=demo.keep_lm_head_in_high_precision,
    )
    x = torch.randint(0, 256, (2, size.seq_len))
    amp = torch.autocast("cpu", dtype=torch.bfloat16)
    assert demo.saved_activation_bytes(fp8, x, x, amp) < demo.saved_activation_bytes(model, x, x, amp)


def test_saturation_rate_is_none_without_telemetry(monkeypatch):
    monkeypatch.delattr(f8tensor.stats, "float8_stats", raising=False)
    probes = []
    assert demo._saturation_rate(torch.nn.Linear(16, 16), lambda: probes.append(1)) is None
    assert probes == []  # no extra step without telemetry to read


def test_saturation_rate_averages_the_saturated_fractions_of_one_probe_step(monkeypatch):
    events = []
    stats = {
        "blocks.0.mlp.fc1/input/saturated_frac": 0.25,
        "blocks.0.mlp.fc1/input/underflow_frac": 0.5,
        "blocks.0.mlp.fc1/weight/saturated_frac": 0.0,
        "blocks.0.mlp.fc2/grad_output/saturated_frac": 0.05,
        "blocks.0.mlp.fc2/weight/saturated_frac": math.nan,  # a role not measured: ignored
    }
    monkeypatch.setattr(f8tensor.stats, "enable_float8_stats", lambda m: events.append("on"), raising=False)
    monkeypatch.setattr(f8tensor.stats, "float8_stats", lambda m: events.append("read") or stats, raising=False)
    rate = demo._saturation_rate(torch.nn.Linear(16, 16), lambda: events.append("step"))
    assert rate == pytest.approx(0.1)
    assert events == ["on", "step", "read"]


def test_each_recipe_has_one_colour_in_both_panels(tmp_path, monkeypatch):
    figure = pytest.importorskip("matplotlib.figure")
    saved = []
    monkeypatch.setattr(figure.Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    results = [
        demo.RunResult(name, [5.0 - 0.1 * i - 0.01 * k for i in range(10)], 1.0, 0, None, 1.0)
        for k, name in enumerate(["bf16", "tensorwise", "rowwise"])
    ]
    assert demo.plot_losses(results, tmp_path / "x.png", "t")
    left, right = saved[0].axes[:2]
    colours = [
        {line.get_label(): line.get_color() for line in ax.get_lines() if not line.get_label().startswith("_")}
        for ax in (left, right)
    ]
    assert set(colours[1]) == {"tensorwise", "rowwise"}
    assert all(colours[0][name] == colour for name, colour in colours[1].items())


# --- threads: one on a CPU unless asked ---------------------------------------------


@pytest.fixture
def threads_seen(monkeypatch, tmp_path):
    """Runs the demo's main with a stub for training; returns the torch threads each run saw."""
    seen: list[int] = []

    def train_run(name, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return demo.RunResult(name, [2.0, 1.0], 100.0, 1, None, 0.1, 1)

    monkeypatch.setattr(demo, "train_run", train_run)
    monkeypatch.chdir(tmp_path)  # the PNG goes to ./out
    previous = torch.get_num_threads()
    torch.set_num_threads(2)  # as torch's default on a 2-core machine
    yield seen
    torch.set_num_threads(previous)


def _main(*argv: str) -> None:
    assert demo.main(["--device", "cpu", "--size", "tiny", "--steps", "2", "--recipes", "bf16,tensorwise", *argv]) == 0


def test_a_cpu_run_uses_one_thread_by_default(threads_seen, monkeypatch, capsys):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    _main()
    assert threads_seen == [1, 1]
    out = capsys.readouterr().out
    assert "device  cpu (1 thread)," in out
    assert "1 CPU thread (--threads N for more)" in " ".join(out.split())
    assert torch.get_num_threads() == 2  # the caller's count, back after the run


def test_threads_flag_sets_the_cpu_threads(threads_seen, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the flag wins over the environment
    _main("--threads", "3")
    assert threads_seen == [3, 3]
    assert "device  cpu (3 threads)," in capsys.readouterr().out


def test_omp_num_threads_is_left_to_torch(threads_seen, monkeypatch):
    # torch reads OMP_NUM_THREADS when it starts: the demo keeps the count it set (2 here).
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    _main()
    assert threads_seen == [2, 2]


@pytest.mark.parametrize(
    ("requested", "environ", "expected"),
    [
        (None, {}, 1),
        (None, {"OMP_NUM_THREADS": ""}, 1),
        (None, {"OMP_NUM_THREADS": "4"}, None),
        (2, {"OMP_NUM_THREADS": "4"}, 2),
    ],
)
def test_cpu_threads(requested, environ, expected):
    assert demo.cpu_threads(requested, environ) == expected
