"""benchmarks/bench_e2e_graphs.py at a tiny size: the per-recipe table of a model whose blocks
are compiled one by one (compiles, graph breaks, host reads, the block's graphs)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_e2e_graphs as B


def _table(out: str) -> dict[str, list[str]]:
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) > 1:
            rows[cells[0]] = cells[1:]
    return rows


def test_tensorwise_table(capsys):
    B.main(["--device", "cpu", "--size", "quick", "--layers", "2", "--recipes", "tensorwise", "--steps", "1"])
    rows = _table(capsys.readouterr().out)
    assert rows["frames"] == ["1"]  # both blocks and every step share one compile
    assert rows["graph breaks"] == ["0"]
    assert rows["recompiles"] == ["0"]
    assert rows["host reads"] == ["0"]
    assert rows["fw FP8 products"] == ["7"] and rows["bw FP8 products"] == ["14"]
    # One per-tensor amax per distinct operand: 4 block inputs (q, k and v share one) and 7
    # weights in forward, 7 grad_outputs in backward.
    assert rows["fw full-tensor reductions"] == ["11"] and rows["bw full-tensor reductions"] == ["7"]


@pytest.mark.parametrize(
    "name, family",
    [
        ("triton_red_fused_aminmax_0", "inductor reduction"),
        ("triton_per_fused_amax_3", "inductor reduction"),
        ("triton_poi_fused__to_copy_clamp_1", "inductor pointwise"),
        ("sm90_xmma_gemm_e4m3e4m3_bf16", "gemm"),
        ("nvjet_qqtst_128x256_64x4_1x2_h_bz_coopA_TNT", "gemm"),
        ("pytorch_flash::flash_fwd_kernel", "attention"),
        ("void at::native::vectorized_elementwise_kernel", "other"),
    ],
)
def test_kernel_families(name, family):
    assert B.kernel_family(name) == family
