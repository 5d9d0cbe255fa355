"""Smoke tests of the benchmark scripts: each runs in its tiny mode (``--quick``, eager) and
writes a CSV with the expected rows and finite numbers, with torchao (when installed) and
without (``F8TENSOR_BENCH_NO_TORCHAO=1``: the column is skipped with a note)."""

from __future__ import annotations

import csv
import importlib.util
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from f8tensor import compat

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
F8_RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed"]
AO_RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None

with_and_without_torchao = pytest.mark.parametrize(
    "torchao",
    [
        pytest.param(True, marks=pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed")),
        False,
    ],
    ids=["torchao", "no-torchao"],
)


def run_script(name: str, *args: str, torchao: bool, tmp_path: pathlib.Path) -> tuple[str, list[dict]]:
    """Run ``benchmarks/<name>`` on CPU, return its stdout and the rows of its CSV."""
    out_csv = tmp_path / f"{name}.csv"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.pop("F8TENSOR_BENCH_NO_TORCHAO", None)
    if not torchao:
        env["F8TENSOR_BENCH_NO_TORCHAO"] = "1"
    cmd = [sys.executable, str(BENCH / name), "--device", "cpu", "--quick", "--csv", str(out_csv), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    with open(out_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    # Every table is self-describing: it starts with the environment.
    for line in ("- command: python", "- torch:", "- f8tensor commit:", "- cpu:"):
        assert line in proc.stdout
    if not torchao:
        assert "torchao column skipped (F8TENSOR_BENCH_NO_TORCHAO is set)" in proc.stdout
    return proc.stdout, rows


def finite(row: dict, *keys: str) -> None:
    for key in keys:
        value = float(row[key])
        assert math.isfinite(value) and value > 0, (key, row)


def expected_variants(torchao: bool) -> list[tuple[str, str]]:
    return (
        [("bf16", "-")]
        + [("f8tensor", r) for r in F8_RECIPES]
        + ([("torchao", r) for r in AO_RECIPES] if torchao else [])
    )


@with_and_without_torchao
def test_bench_linear(torchao, tmp_path):
    stdout, rows = run_script("bench_linear.py", "--modes", "eager", torchao=torchao, tmp_path=tmp_path)
    linear = [r for r in rows if r["table"] == "linear"]
    gemm = [r for r in rows if r["table"] == "gemm"]
    assert [(r["library"], r["recipe"]) for r in linear] == expected_variants(torchao)
    assert {(r["M"], r["K"], r["N"], r["mode"]) for r in linear} == {("64", "64", "128", "eager")}
    for r in linear:
        finite(r, "ms", "speedup_vs_bf16")
        if r["library"] != "bf16":
            finite(r, "gemm_ceiling", "fraction_of_ceiling")
            ratio = float(r["speedup_vs_bf16"]) / float(r["gemm_ceiling"])
            assert float(r["fraction_of_ceiling"]) == pytest.approx(ratio)
    assert float(linear[0]["speedup_vs_bf16"]) == 1.0
    assert [r["gemm"] for r in gemm] == ["forward", "grad_input", "grad_weight"]
    for r in gemm:
        finite(r, "bf16_ms", "tensorwise_ms", "rowwise_ms", "tensorwise_speedup", "rowwise_speedup")
    assert "| f8tensor tensorwise | eager |" in stdout
    assert ("| torchao rowwise | eager |" in stdout) == torchao


def test_bench_linear_compiled(tmp_path):
    # One compiled configuration each for bf16 and f8tensor: the compiled path runs end to end.
    _, rows = run_script(
        "bench_linear.py",
        "--modes",
        "compiled",
        "--recipes",
        "tensorwise",
        "--no-gemm",
        "--shapes",
        "32x64x64",
        torchao=False,
        tmp_path=tmp_path,
    )
    assert [(r["library"], r["recipe"], r["mode"]) for r in rows] == [
        ("bf16", "-", "compiled"),
        ("f8tensor", "tensorwise", "compiled"),
    ]
    for r in rows:
        finite(r, "ms", "speedup_vs_bf16")


@with_and_without_torchao
def test_bench_memory(torchao, tmp_path):
    _, rows = run_script("bench_memory.py", "--modes", "eager", torchao=torchao, tmp_path=tmp_path)
    linear = {r["layer"]: r for r in rows if r["table"] == "linear"}
    names = ["nn.Linear"] + F8_RECIPES + ([f"torchao {r}" for r in AO_RECIPES] if torchao else [])
    assert list(linear) == names
    elements = 2 * 16 * 64  # the --quick input (2, 16, 64)
    assert int(linear["nn.Linear"]["saved_bytes"]) == 2 * elements
    assert int(linear["tensorwise"]["saved_bytes"]) == elements + 8  # FP8 input + two fp32 scales
    for r in linear.values():
        finite(r, "peak_bytes", "peak_no_gemm_scratch_bytes", "resident_bytes")
        assert int(r["peak_no_gemm_scratch_bytes"]) <= int(r["peak_bytes"])
    model = [r for r in rows if r["table"] == "model"]
    assert [(r["library"], r["recipe"]) for r in model] == expected_variants(torchao)
    for r in model:
        finite(r, "saved_bytes", "resident_bytes", "peak_bytes")
        assert int(r["peak_bytes"]) > int(r["resident_bytes"])


@with_and_without_torchao
def test_bench_e2e(torchao, tmp_path):
    _, rows = run_script("bench_e2e.py", "--modes", "eager", torchao=torchao, tmp_path=tmp_path)
    assert [(r["library"], r["recipe"]) for r in rows] == expected_variants(torchao)
    for r in rows:
        assert r["mode"] == "eager" and r["steps"] == "6" and r["timed_steps"] == "3"
        assert r["finite"] == "True"
        finite(r, "tokens_per_s", "step_ms", "peak_mib", "first_loss", "final_loss", "speedup_vs_bf16")
    # Same weights and batches: every configuration starts from the same loss, about ln(vocab).
    first = [float(r["first_loss"]) for r in rows]
    assert max(first) - min(first) < 0.01
    assert first[0] == pytest.approx(math.log(256), abs=0.1)


@with_and_without_torchao
def test_bench_eager_overhead(torchao, tmp_path):
    stdout, rows = run_script("bench_eager_overhead.py", torchao=torchao, tmp_path=tmp_path)
    recipes = ["tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed", "blockwise", "mxfp8"]
    expected = (
        [("bf16", "-", "64"), ("bf16", "-", "128")]
        + [("f8tensor", r, "128" if r in ("blockwise", "mxfp8") else "64") for r in recipes]
        + ([("torchao", r, "64") for r in AO_RECIPES] if torchao else [])
        + [("f8tensor+reuse", r, "128" if r in ("blockwise", "mxfp8") else "64") for r in recipes if r != "delayed"]
    )
    assert [(r["library"], r["recipe"], r["K"]) for r in rows] == expected
    for r in rows:
        finite(r, "dispatch_ops", "leaf_ops", "kernels", "host_us", "vs_bf16")
        assert int(r["kernels"]) <= int(r["leaf_ops"])
    by = {(r["library"], r["recipe"]): r for r in rows}
    # An FP8 step runs more than nn.Linear's (casts and scales around the same three GEMMs).
    assert int(by["f8tensor", "tensorwise"]["dispatch_ops"]) > int(by["bf16", "-"]["dispatch_ops"])
    # A later micro-batch inside reuse_weight_casts skips the weight's casts.
    for r in recipes:
        if r != "delayed":
            assert int(by["f8tensor+reuse", r]["dispatch_ops"]) < int(by["f8tensor", r]["dispatch_ops"]), r
    assert "| tensorwise |" in stdout
    assert ("| tensorwise | " + by["f8tensor", "tensorwise"]["dispatch_ops"] + " | n/a |" in stdout) != torchao


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), BENCH / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("bench_linear.py", ["--recipes", "fastest"], "--recipes: unknown value 'fastest'"),
        ("bench_linear.py", ["--torchao-recipes", "delayed"], "--torchao-recipes: unknown value 'delayed'"),
        ("bench_linear.py", ["--shapes", "64x60x128"], "K and N must be positive multiples of 16"),
        ("bench_linear.py", ["--shapes", "huge"], "neither a preset"),
        ("bench_linear.py", ["--modes", "jit"], "--modes: unknown value 'jit'"),
        ("bench_e2e.py", ["--steps", "3", "--warmup", "2"], "--steps >= warmup + 1 + rounds"),
        ("bench_e2e.py", ["--size", "7b"], "invalid choice: '7b'"),
        ("bench_memory.py", ["--in-features", "100"], "multiples of 16"),
    ],
)
def test_bad_flags_are_refused(script, args, message, capsys):
    module = _load(script)
    with pytest.raises(SystemExit) as exc:
        module.main(["--device", "cpu", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_progress_bar(tmp_path):
    common = _load("_common.py")
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        bar = common.Progress(3, "demo", stream=f)
        for what in ("a", "b", "c"):
            bar.update(what)
        bar.close()
    lines = log.read_text().splitlines()
    assert [line.split(" ")[1] for line in lines] == ["[1/3]", "[2/3]", "[3/3]"]  # plain lines off a terminal


def test_bench_moe(tmp_path):
    stdout, rows = run_script("bench_moe.py", torchao=False, tmp_path=tmp_path)
    impls = ["grouped_mm", "batched_mm", "eager"]
    recipes = ["bf16", "tensorwise", "rowwise", "rowwise_with_gw_hp"]  # delayed: not for experts
    assert [(r["impl"], r["recipe"]) for r in rows] == [(i, r) for i in impls for r in recipes]
    for r in rows:
        finite(r, "ms", "speedup_vs_bf16", "saved_bytes", "saved_vs_bf16")
    grouped = {r["recipe"]: int(r["saved_bytes"]) for r in rows if r["impl"] == "grouped_mm"}
    # tensorwise keeps the FP8 tokens (1 byte each) for the weight gradient instead of bf16 ones
    assert grouped["tensorwise"] < grouped["bf16"]
    assert "| grouped_mm | tensorwise |" in stdout


def test_bench_cast_traffic(tmp_path):
    # Reads inductor's generated code of one compiled training step per recipe. The casts
    # of rowwise_with_gw_hp are a subset of rowwise's, so three recipes cover every kernel.
    stdout, rows = run_script(
        "bench_cast_traffic.py", "--recipes", "tensorwise,rowwise,delayed", torchao=False, tmp_path=tmp_path
    )
    assert [r["recipe"] for r in rows] == ["tensorwise", "rowwise", "delayed"]
    m, k, n = 32, 64, 128  # the --quick shape: x (2, 16, 64), Linear(64 -> 128)
    for r in rows:
        assert (int(r["M"]), int(r["K"]), int(r["N"])) == (m, k, n)
        # No float64 arithmetic inside any loop over a full-size tensor: scales are computed
        # once (a double per element made the column-scaled casts several times slower).
        assert int(r["fp64_loops"]) == 0, r
        assert int(r["gemms"]) == 3 and int(r["other_externs"]) == 0
        finite(r, "total_bytes", "floor_bytes", "kernels_fwd", "kernels_bwd", "eager_kernels_step")
        assert int(r["total_bytes"]) >= int(float(r["floor_bytes"]))
    tw = rows[0]
    # Tensorwise at its floor (scalars aside): two passes over x and grad_y (amax, then one
    # cast writing both FP8 layouts), three over W (amax and cast; the backward re-cast).
    assert int(tw["total_bytes"]) - int(float(tw["floor_bytes"])) < 64
    assert (int(tw["passes_x"]), int(tw["passes_W"]), int(tw["passes_grad_y"])) == (2, 3, 2)
    # Saved for backward: the FP8 input (1 byte/element) and fp32 scales, compiled as eager.
    assert m * k <= int(tw["saved_bytes_compiled"]) <= m * k + 16
    dl = rows[2]
    # Delayed at its floor, aside from the per-row amax partials (two bf16 per row of x,
    # grad_y and W, written then read: 8 bytes a row) and the scalars: the state's two fp32
    # buffers, the histories (3, 16) and the step's scales with the per-call record that lets
    # a checkpointed forward re-cast with its own scales (2 + 8 x 3), read by several passes.
    # The reading charges a kernel the whole buffer it is passed, so a pass that reads one
    # history row counts all three (192 bytes): 2,096 bytes of scalars measured (1,352 when
    # each part was a buffer of its own, against an allowance of 1,536). One pass over x and grad_y (the scale comes from the
    # history, the amax is taken in the cast's pass), two over W (forward cast; backward
    # re-cast, which also measures its amax). Before: 2 / 3 / 2 passes.
    assert int(dl["total_bytes"]) - int(float(dl["floor_bytes"])) <= 8 * (2 * m + n) + 2096, dl
    assert (int(dl["passes_x"]), int(dl["passes_W"]), int(dl["passes_grad_y"])) == (1, 2, 1)
    assert "| f8tensor | tensorwise |" in stdout


@pytest.mark.skipif(
    not compat.HAS_CPU_ROWWISE_SCALED_MM,
    reason=f"torch {torch.__version__}'s CPU has no rowwise _scaled_mm: the rowwise GEMMs run as the per-tensor "
    "kernel plus an fp32 scaling pass, whose full-size bytes are above the floor",
)
def test_bench_cast_traffic_loop_fusion_at_the_floor(tmp_path):
    # With the CPU back end's vectorization off, the passes are the loop fusion inductor's
    # scheduler decides: rowwise and rowwise_with_gw_hp move exactly their floors' bytes of
    # full-size tensors (a row's amax, scale and casts share one loop; the column cast rides
    # along the row pass). The rowwise backward GEMMs write bf16 straight from the kernel:
    # the post-scale route's read and write of the product would add full-size bytes.
    stdout, rows = run_script(
        "bench_cast_traffic.py",
        "--recipes",
        "rowwise,rowwise_with_gw_hp",
        "--scalar-codegen",
        torchao=False,
        tmp_path=tmp_path,
    )
    assert "scalar CPU code generation" in stdout
    for r in rows:
        assert r["codegen"] == "scalar"
        assert int(r["full_size_bytes"]) == int(float(r["floor_bytes"])), r
        assert int(r["fp64_loops"]) == 0, r
    rw, hp = rows
    assert (int(rw["passes_x"]), int(rw["passes_W"]), int(rw["passes_grad_y"])) == (2, 3, 2)
    assert (int(hp["passes_x"]), int(hp["passes_W"]), int(hp["passes_grad_y"])) == (1, 3, 1)


_REUSE_CODE = """cpp_fused_k_0 = async_compile.cpp_pybinding(['at::BFloat16*'], r'''
extern "C" void kernel(at::BFloat16* in_out_ptr0)
{
    for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(4096L); x0+=static_cast<int64_t>(1L))
    {
        auto tmp0 = in_out_ptr0[x0];
        in_out_ptr0[x0] = tmp0 * tmp0;
    }
}
''')
    def call(self, args):
        arg0_1, = args
        buf2 = empty_strided_cpu((64, 64), (64, 1), torch.bfloat16)
        extern_kernels.mm(arg0_1, arg0_1, out=buf2)
        buf3 = buf2; del buf2  # reuse
        cpp_fused_k_0(buf3)
        return (buf3, )

runner = Runner(partitions=[])
    arg0_1 = rand_strided((64, 64), (64, 1), device='cpu', dtype=torch.bfloat16)
"""


def test_cast_traffic_counts_reused_buffers():
    # Inductor reuses a dead buffer's storage (``buf3 = buf2; del buf2  # reuse``), e.g. for
    # an in-place pass over a GEMM's output: that pass reads and writes the whole buffer.
    graph = _load_bench_cast_traffic().parse_graph_code(_REUSE_CODE, 4096)
    assert graph.gemms == ["mm"] and len(graph.passes) == 1
    assert graph.read_bytes == graph.written_bytes == 64 * 64 * 2


def _load_bench_cast_traffic():
    # Registered in sys.modules while it loads: its dataclasses look their module up there.
    spec = importlib.util.spec_from_file_location("bench_cast_traffic", BENCH / "bench_cast_traffic.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_cast_traffic_finds_per_element_float64():
    # The check the benchmark (and the test above) relies on, on two hand-written kernels
    # in the shape inductor emits: a double computed per element is flagged, a double
    # computed once per scale (outside the element loop) is not.
    module = _load_bench_cast_traffic()
    header = "cpp_fused_k_0 = async_compile.cpp_pybinding(['const at::BFloat16*', 'const float*', 'float*'], r'''\n"
    call = (
        "    def call(self, args):\n        arg0_1, arg1_1 = args\n        buf0 = empty_strided_cpu((64, 64), (64, 1), torch.float32)\n"
        "        cpp_fused_k_0(arg0_1, arg1_1, buf0)\n        return (buf0, )\n\nrunner = Runner(partitions=[])\n"
        "    arg0_1 = rand_strided((64, 64), (64, 1), device='cpu', dtype=torch.bfloat16)\n"
        "    arg1_1 = rand_strided((64, ), (1, ), device='cpu', dtype=torch.float32)\n"
    )
    per_element = (
        'extern "C" void kernel(const at::BFloat16* in_ptr0, const float* in_ptr1, float* out_ptr0)\n{\n'
        "    for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(4096L); x0+=static_cast<int64_t>(1L))\n"
        "    {\n        auto tmp0 = in_ptr0[x0];\n        auto tmp1 = c10::convert<double>(in_ptr1[x0 % 64]);\n"
        "        out_ptr0[x0] = static_cast<float>(tmp0) * static_cast<float>(448.0 / tmp1);\n    }\n}\n'''\n"
    )
    per_scale = (
        'extern "C" void kernel(const at::BFloat16* in_ptr0, const float* in_ptr1, float* out_ptr0)\n{\n'
        "    for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(64L); x0+=static_cast<int64_t>(1L))\n"
        "    {\n        auto tmp1 = static_cast<float>(448.0 / c10::convert<double>(in_ptr1[x0]));\n"
        "        for(int64_t x1=static_cast<int64_t>(0L); x1<static_cast<int64_t>(64L); x1+=static_cast<int64_t>(1L))\n"
        "        {\n            out_ptr0[x1 + 64L*x0] = static_cast<float>(in_ptr0[x1 + 64L*x0]) * tmp1;\n        }\n    }\n}\n'''\n"
    )
    bad = module.parse_graph_code(header + per_element + call, element_threshold=4096)
    good = module.parse_graph_code(header + per_scale + call, element_threshold=4096)
    assert [p.fp64_per_element for p in bad.passes] == [True]
    assert [p.fp64_per_element for p in good.passes] == [False]
    # One pass each: x (8 KiB bf16) and the scales read, the fp32 output written.
    for graph in (bad, good):
        assert (graph.read_bytes, graph.written_bytes) == (64 * 64 * 2 + 64 * 4, 64 * 64 * 4)


def test_bench_routes(tmp_path):
    # Both routes of a precise rowwise product, eager and compiled, timed and compared.
    stdout, rows = run_script("bench_routes.py", torchao=False, tmp_path=tmp_path)
    assert [(r["mode"], r["route"]) for r in rows] == [
        ("eager", "kernel"),
        ("eager", "postscale"),
        ("compiled", "kernel"),
        ("compiled", "postscale"),
    ]
    for r in rows:
        assert (int(r["M"]), int(r["K"]), int(r["N"])) == (64, 64, 32)
        finite(r, "ms", "vs_kernel")
        # The same product either way: one extra bf16 rounding at most (~48 dB), exact on CPU.
        assert float(r["sqnr_vs_kernel_db"]) > 45.0, r
    assert "CPU (no FP8 matrix units" in stdout


def test_bench_comm(tmp_path):
    # FP8 all-gather halves FSDP2's bf16 weight all-gather (biases and norms stay bf16); the
    # sequence-parallel input gather moves 1 byte per element instead of 2 (its backward
    # all-gather of grad_output stays bf16: 3/4 of the bf16 bytes in all).
    _, rows = run_script("bench_comm.py", "--recipes", "tensorwise", torchao=False, tmp_path=tmp_path)
    got = {(r["parallelism"], r["recipe"], r["collective"]): r for r in rows}
    assert 0.45 < float(got[("fsdp", "tensorwise", "all_gather")]["vs_bf16"]) < 0.6
    assert float(got[("tp", "tensorwise", "all_gather")]["vs_bf16"]) == 0.75
    assert got[("fsdp", "tensorwise", "reduce_scatter")]["bytes"] == got[("fsdp", "bf16", "reduce_scatter")]["bytes"]
