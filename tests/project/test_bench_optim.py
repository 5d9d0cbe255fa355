"""benchmarks/bench_optim.py at a tiny size: the table, the byte targets, torchao's rows."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_optim


@pytest.fixture(scope="module")
def rows():
    # Without the compiled rows (each compiles inductor C++ on its first step: tens of seconds).
    rows, numel = bench_optim.run(layers=2, width=256, steps=1, rounds=1, compiled=False)
    assert numel == 2 * 256 * 256
    return {r.name: r for r in rows}


def test_state_and_persistent_bytes_meet_the_targets(rows):
    # Measured: FP8 2.0625 (1 + 1 bytes + 2 fp32 scales per 256-element row of two 128-blocks),
    # bf16 4.0; persistent 12 (torch), 6.0625 (bf16 + remainder + FP8), 8.0 (bf16 states).
    assert rows["torch AdamW (foreach)"].state_bpp == 8.0
    assert rows["torch AdamW (foreach)"].persistent_bpp == 12.0
    assert rows["f8tensor AdamW fp32 states, torch ops"].persistent_bpp == 12.0
    assert rows["f8tensor AdamW FP8 states, torch ops"].state_bpp <= 2.2
    assert rows["f8tensor AdamW FP8 states, torch ops"].state_bpp == 2 + 8 / 128
    assert rows["f8tensor AdamW bf16 states, torch ops"].state_bpp <= 4.1
    assert rows["f8tensor bf16 + remainder, FP8 states, torch ops"].persistent_bpp <= 6.2
    assert rows["f8tensor bf16 + remainder, bf16 states, torch ops"].persistent_bpp <= 8.2
    assert all(r.step_ms > 0 and r.first_s > 0 for r in rows.values() if r.note != bench_optim.NOT_INSTALLED)
    assert not any(name.endswith(", compiled") for name in rows)


def test_compiled_rows_follow_each_torch_ops_row():
    names = [c.name for c in bench_optim.configs()]
    ours = [n for n in names if n.startswith("f8tensor")]
    assert len(ours) == 10
    assert all(
        a.endswith(", torch ops") and b == a.replace(", torch ops", ", compiled") for a, b in zip(ours[::2], ours[1::2])
    )


def test_torchao_rows_say_not_installed_without_torchao(rows):
    if importlib.util.find_spec("torchao") is not None:
        pytest.skip("torchao is installed: its rows are measured")
    for name in ("torchao AdamWFp8", "torchao AdamW8bit"):
        assert rows[name].note == bench_optim.NOT_INSTALLED and rows[name].step_ms is None


def test_quick_command_prints_the_table(capsys):
    assert bench_optim.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "step ms (CPU)" in out and "first step s" in out and "f8tensor bf16 + remainder, FP8 states" in out
    assert ", compiled" not in out  # --quick leaves the compiled rows out
    assert "6.0625" in out


def test_bad_flag_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench_optim.main(["--layers", "0"])
    assert "--layers must be a positive integer" in capsys.readouterr().err


def test_quality_trains_the_demo_per_optimizer_and_seed(capsys):
    # Two seeds of the tiny demo GPT, 4 steps: one final loss per optimizer and seed, the
    # table's mean over them; torchao's row says "not installed" without torchao.
    finals = bench_optim.quality([0, 1], 4, "tiny")
    measured = {n: v for n, v in finals.items() if v}
    assert set(measured) >= {"torch AdamW (fp32 states)", "f8tensor AdamW, FP8 states"}
    assert all(len(v) == 2 and all(3.0 < x < 7.0 for x in v) for v in measured.values()), measured
    # The same model, data and steps: the two optimizers start from the same loss.
    a, b = finals["torch AdamW (fp32 states)"], finals["f8tensor AdamW, FP8 states"]
    assert all(abs(x - y) / x < 0.02 for x, y in zip(a, b)), (a, b)
    table = bench_optim.format_quality(finals, [0, 1])
    assert "seed 1" in table and "+0.00%" in table.splitlines()[2]
    if importlib.util.find_spec("torchao") is None:
        assert bench_optim.NOT_INSTALLED in table.splitlines()[-1]


def test_quality_flags_are_checked(capsys):
    for argv, message in (
        (["--quality", "a,b"], "comma-separated integer seeds"),
        (["--quality", "0", "--train-steps", "1"], "at least 2"),
    ):
        with pytest.raises(SystemExit):
            bench_optim.main(argv)
        assert message in capsys.readouterr().err
