"""The vocabulary (``specs.py``): block predicates, the keyword spelling of a cast, and the
validation of block granularities and GEMM configs, against the definitions in its
docstrings. Messages are checked whole: what was wrong and what is allowed."""

from __future__ import annotations

import re

import pytest
import torch

from f8tensor.quant import specs
from f8tensor.quant.specs import BlockGranularity, CastSpec, GemmConfig, Granularity

E4M3, E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu


def _full(message: str) -> str:
    return "^" + re.escape(message) + "$"


@pytest.mark.parametrize(
    "block, dim, expected",
    [
        ((1, 0), None, True),
        ((1, 0), 1, True),
        ((1, 0), -1, True),
        ((1, 0), 0, False),
        ((0, 1, 1), 0, True),
        ((0, 1, 1), -3, True),
        ((0, 1, 1), 1, False),
        ((0, 0), 1, True),  # one scale, kept with the rank: along the last dim
        ((0, 0), 0, False),
        ((), None, False),
        ((1, 128), None, False),
        ((128, 0), 1, False),
    ],
)
def test_is_axiswise(block, dim, expected):
    assert specs.is_axiswise(block, dim) is expected


def test_keyword_spec_from_the_keyword_spellings():
    """``block`` (a full per-dim block) wins; else ``axiswise_dim`` (0 at that dim, 1
    elsewhere; counted from the end when negative); else tensorwise ``()``. Every other
    field is passed through."""
    fields = (True, E8M0, "floor", "stochastic")
    assert specs.keyword_spec(3, E4M3, None, None, *fields) == CastSpec(E4M3, (), *fields[1:3], True, "stochastic")
    assert specs.keyword_spec(3, E4M3, 1, None, *fields) == CastSpec(E4M3, (1, 0, 1), E8M0, "floor", True, "stochastic")
    assert specs.keyword_spec(3, E4M3, -1, None, *fields).block == (1, 1, 0)
    assert specs.keyword_spec(2, E4M3, 0, (1, 32), *fields).block == (1, 32)
    plain = specs.keyword_spec(2, E4M3, None, None, False, torch.float32, "rceil", "nearest")
    assert plain == CastSpec(E4M3) and plain.power_of_2 is False and plain.rounding == "nearest"


def test_block_granularity_validation_in_full():
    shape = "a block shape is a non-empty tuple of ints in [0, 2**63) (0: the whole dim; an entry larger than its dim is one partial block); got "
    for block in ([1, 128], (), (True, 128), (1.5, 128), (1, 2**63), (-1, 128), "1x128"):
        with pytest.raises(ValueError, match=_full(shape + repr(block))):
            BlockGranularity(block).validated()  # type: ignore[arg-type]
    assert BlockGranularity((0, 2**63 - 1)).validated().block == (0, 2**63 - 1)
    with pytest.raises(
        ValueError,
        match=_full(
            "BlockGranularity.scale_dtype must be one of (torch.float32, torch.float8_e8m0fnu) (or float8_e4m3fn for "
            "NVFP4 blocks); got torch.bfloat16"
        ),
    ):
        BlockGranularity((1, 32), torch.bfloat16).validated()
    with pytest.raises(
        ValueError, match=_full("BlockGranularity.scale_mode must be one of ('rceil', 'floor'); got 'ceil'")
    ):
        BlockGranularity((1, 32), E8M0, "ceil").validated()
    with pytest.raises(ValueError, match=_full("block (1, 1, 128) needs a tensor with at least 3 dims; got 2")):
        BlockGranularity((1, 1, 128)).full_block(2)
    assert BlockGranularity((1, 128)).full_block(4) == (1, 1, 1, 128)


def test_granularity_parsing_refusals_in_full():
    with pytest.raises(TypeError, match=_full("a block shape is a tuple, not a list; got [1, 128]")):
        specs.parse_granularity([1, 128])
    every = (
        "granularity must be one of 'tensorwise', 'rowwise', 'BLOCK_1x128', 'BLOCK_128x128', 'MX_1x32', "
        "'MX_1x32_FLOOR', 'NVFP4_1x16', 'NVFP4_16x16', 'MXFP4_1x32' (a name, or the f8tensor constant of that "
        "name), a BlockGranularity, or a block tuple such as (1, 128); got 'columnwise'"
    )
    with pytest.raises(ValueError, match=_full(every)):
        specs.parse_granularity("columnwise")
    assert specs.parse_granularity("rowwise") is Granularity.ROWWISE
    assert specs.parse_granularity((1, 32)) == BlockGranularity((1, 32))


def test_gemm_config_validation_in_full():
    allowed = "torch.bfloat16, torch.float16, torch.float32"
    with pytest.raises(
        ValueError, match=_full(f"GemmConfig.out_dtype must be None or one of {allowed}; got torch.int32")
    ):
        GemmConfig(out_dtype=torch.int32).validated()
    with pytest.raises(
        ValueError,
        match=_full(
            f"GemmConfig.out_dtype must be None or one of {allowed}; got torch.float8_e4m3fn (for an FP8 output pass "
            "out_dtype and out_scale to f8tensor.float8_mm)"
        ),
    ):
        GemmConfig(out_dtype=E4M3).validated()
    for field in ("use_fast_accum", "pad_inner_dim", "emulate"):
        with pytest.raises(TypeError, match=_full(f"GemmConfig.{field} must be a bool; got 1")):
            GemmConfig(**{field: 1}).validated()  # type: ignore[arg-type]
    ok = GemmConfig(torch.bfloat16, True, True, True)
    assert ok.validated() is ok


def test_every_named_granularity_parses_and_is_listed_in_the_error():
    # The error is written from the table the parser reads: each name it lists parses, by
    # name and as the constant of that name.
    with pytest.raises(ValueError, match=r"granularity must be one of") as refused:
        specs.parse_granularity("MX1x32")
    for name, granularity in specs.GRANULARITY_NAMES.items():
        assert repr(name) in str(refused.value)
        assert specs.parse_granularity(name) == granularity
        constant = getattr(specs, name, None)
        assert specs.parse_granularity(constant if constant is not None else granularity) == granularity
    blocks = {name for name in specs.__all__ if isinstance(getattr(specs, name), BlockGranularity)}
    assert blocks <= set(specs.GRANULARITY_NAMES)  # every public block constant is named
