"""The floor ``benchmarks/bench_compile_counts.py`` measures bytes outside the GEMMs
against: written from its definition here, and the same per-linear rule as
``bench_cast_traffic`` where both define it."""

from __future__ import annotations

import importlib
import pathlib
import sys

import pytest
from helpers import load_script

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    return load_script(BENCH / "bench_compile_counts.py")


def test_moe_floor_from_the_definition(bench):
    experts, tokens, k, n = bench.MOE_SHAPE
    # tensorwise: x and grad_y read twice (bf16: 2 bytes) + two FP8 layouts; W read three times
    # (twice in forward, once more in backward) + one layout each time.
    x, w, g = tokens * k, experts * n * k, tokens * n
    assert bench.floor_bytes("moe", "tensorwise") == (2 * 2 + 2) * x + (3 * 2 + 2) * w + (2 * 2 + 2) * g
    # rowwise with the weight gradient in bf16: x and grad_y read once, one (row) layout.
    assert bench.floor_bytes("moe", "rowwise_with_gw_hp") == 3 * x + 8 * w + 3 * g


def test_llama_floor_counts_a_shared_input_once(bench):
    cfg = bench.BLOCK_CONFIG
    t, d, kv, f = cfg.batch * cfg.seq, cfg.dim, cfg.kv_heads * cfg.head_dim, cfg.ffn
    inputs = t * d + t * d + t * d + t * f  # wq/wk/wv's x, wo's, w1/w3's x, w2's: 4, not 7
    weights = d * d + 2 * d * kv + d * d + 3 * d * f
    grads = t * d + 2 * t * kv + t * d + 2 * t * f + t * d
    assert bench.floor_bytes("llama", "delayed") == 4 * inputs + 6 * weights + 4 * grads


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise", "rowwise_with_gw_hp"])
def test_one_linear_floor_is_bench_cast_traffics(bench, recipe):
    sys.path.insert(0, str(BENCH))  # imported, not loaded: its dataclasses need their module
    try:
        traffic = importlib.import_module("bench_cast_traffic")
    finally:
        sys.path.remove(str(BENCH))
    s = traffic.Shape(batch=1, seq=3, k=5, n=7)  # X = 15, W = 35, G = 21: every coefficient shows
    x, w, g = bench.FLOOR_PER_ELEMENT[recipe]
    assert traffic.floor_bytes(recipe, s) == x * s.m * s.k + w * s.n * s.k + g * s.m * s.n
