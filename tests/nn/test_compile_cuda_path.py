"""Every recipe's compiled block, traced by dynamo along its CUDA path on a CPU: no graph
break, one graph across token counts, no host read (a CUDA graph can capture the step).

``benchmarks/bench_compile_counts.py``'s ``cuda_trace``: fake CUDA tensors, the capability
query patched (sm90; sm100 for MX) and ``torch.version.cuda`` set, so the capability and
build checks and every product's CUDA branch run as on an H100. The trace runs in a fresh
process: it registers a no-op CUDA device guard there (a CPU build has none).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from f8tensor import compat
from f8tensor.compat import cpu_compiler

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed", "blockwise", "mxfp8")
#: FP8 kernel calls per block (7 linears): 3 per linear (forward, grad input, grad weight);
#: rowwise_with_gw_hp computes grad weight in high precision.
FP8_KERNELS = {recipe: 14 if recipe == "rowwise_with_gw_hp" else 21 for recipe in RECIPES}
#: Dynamo's guards along the CUDA path, at most (torch 2.13, as measured): each below 2x
#: bf16's. A count above its budget fails; a drop lowers the budget in the same commit.
#: Blockwise and MXFP8 were 910 and 793 (the F.scaled_mm enums, the build read per product,
#: F.pad), every recipe 33 to 54 more (the fused casts' module reached when traced).
CUDA_GUARDS = {
    "bf16": 169,
    "tensorwise": 297,
    "rowwise": 303,
    "rowwise_with_gw_hp": 297,
    "delayed": 329,
    "blockwise": 327,
    "mxfp8": 327,
}

_SCRIPT = r"""
import json, sys
from unittest import mock
import torch
sys.path.insert(0, "tests")
from helpers import load_script
import pathlib
bench = load_script(pathlib.Path("benchmarks/bench_compile_counts.py"))
out = {"bf16": bench.cuda_trace(bench.C.Variant("bf16", ""))}
for recipe in sys.argv[1:]:
    out[recipe] = bench.cuda_trace(bench.C.Variant("f8tensor", recipe))
for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
    variant = bench.C.Variant("f8tensor", recipe)
    out["moe " + recipe] = bench.cuda_trace(variant, tokens=(512, 256), workload="moe")

# The trace sees what only the CUDA branch does: a graph break in the block-scaled kernel
# call, a data-dependent branch before a dense one.
import f8tensor.gemm.blocks as blocks, f8tensor.gemm.dense as dense

def broken(*args, **kwargs):
    torch._dynamo.graph_break()
    return original_block(*args, **kwargs)

def branching(*args, **kwargs):
    if bool((args[2] > 0).all()):
        return original_dense(*args, **kwargs)
    return original_dense(*args, **kwargs)

def attempt(name, recipe):
    try:
        out[name] = bench.cuda_trace(bench.C.Variant("f8tensor", recipe))
    except Exception as error:  # torch 2.11: the frame after a break in a product fails to trace
        out[name] = {"error": f"{type(error).__name__}: {error}"[:2000]}

original_block, original_dense = blocks.block_scaled_mm, dense.scaled_mm
with mock.patch.object(blocks, "block_scaled_mm", broken):
    attempt("blockwise, a break in the kernel call", "blockwise")
with mock.patch.object(dense, "scaled_mm", branching):
    attempt("tensorwise, a branch on a scale", "tensorwise")
print(json.dumps(out))
"""

# Slow (tests/conftest.py's SLOW_TESTS): about two minutes on 2 cores.
pytestmark = pytest.mark.skipif(
    cpu_compiler() is None, reason="the no-op CUDA device guard is built with a C++ compiler"
)


@pytest.fixture(scope="module")
def traced() -> dict[str, dict[str, int]]:
    env = dict(os.environ, F8TENSOR_CHECK_CUDA_RULES="0", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT, *RECIPES],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("recipe", RECIPES)
def test_cuda_path_compiles_to_one_graph_without_host_reads(traced, recipe):
    found = traced[recipe]
    assert found["breaks"] == 0 and found["graphs"] == 1, found
    assert found["host_reads"] == 0 and found["host_tensors"] == 0, found
    # The CUDA branch was traced: each product is an FP8 kernel call, not the CPU reference.
    assert found["fp8_kernels"] == FP8_KERNELS[recipe], found


#: The MoE grouped step's (4 experts, 512 then 256 rows; bf16: 17). Were 341 and 367 for
#: tensorwise and rowwise, the kernel's availability read per product; then 287, 313, 244,
#: before its traced calls gave every argument and read the grouped rule as one constant.
MOE_CUDA_GUARDS = {"tensorwise": 223, "rowwise": 251, "rowwise_with_gw_hp": 196}


@pytest.mark.parametrize("recipe", MOE_CUDA_GUARDS)
def test_moe_step_cuda_path_compiles_to_one_graph_without_host_reads(traced, recipe):
    found = traced["moe " + recipe]
    assert found["breaks"] == 0 and found["graphs"] == 1, found
    assert found["host_reads"] == 0 and found["host_tensors"] == 0, found
    # The grouped kernel, not the reference: forward, grad input, grad weight (bf16 with gw_hp).
    assert found["fp8_kernels"] == (2 if recipe == "rowwise_with_gw_hp" else 3), found
    if compat.TORCH_VERSION == (2, 13):  # the budgets are torch 2.13's counts
        assert found["guards"] <= MOE_CUDA_GUARDS[recipe], found


@pytest.mark.skipif(compat.TORCH_VERSION != (2, 13), reason="the budgets are torch 2.13's counts")
@pytest.mark.parametrize("variant", CUDA_GUARDS)
def test_cuda_path_guards_within_budget(traced, variant):
    # Each guard is checked on every call of the compiled block: host time per step.
    assert traced[variant]["guards"] <= CUDA_GUARDS[variant], traced[variant]
    assert CUDA_GUARDS[variant] <= 2 * CUDA_GUARDS["bf16"]


def test_the_trace_sees_breaks_only_the_cuda_branch_has(traced):
    broken = traced["blockwise, a break in the kernel call"]
    if compat.TORCH_VERSION < (2, 12) and "error" in broken:  # seen too: 2.11 fails the next frame
        assert "SymNodeVariable() is not a constant" in broken["error"], broken
    else:
        assert broken.get("breaks", 0) >= 1, broken
    branched = traced["tensorwise, a branch on a scale"]
    assert branched["breaks"] >= 1 and branched["host_reads"] >= 1, branched
