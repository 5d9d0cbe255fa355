"""Tests that kill mutants the rest of the suite let survive (CONTRIBUTING.md, "Mutation testing").

Each test states the mutant class it is for. Expected values are written from the format
and block definitions, not from the functions under test.
"""

from __future__ import annotations

import pytest
import torch
from helpers import dtype_name

from f8tensor.quant import formats
from f8tensor.quant.formats import FLOAT8_DTYPES, FORMATS, Float8Format

# ------------------------------------------------------------ formats: the import-time tables
#
# FORMATS and the saturation bounds are computed when f8tensor is imported, before a mutant
# is switched on, so tests that read the tables cannot see a mutant of the builders. These
# call the builders themselves.

# (exponent bits, mantissa bits, max, smallest normal, has inf, has -0), from the OCP FP8
# spec (e4m3fn, e5m2) and the fnuz variants (exponent bias one larger, no -0, no inf).
_DEFINITION = {
    torch.float8_e4m3fn: (4, 3, 448.0, 2.0**-6, False, True),
    torch.float8_e5m2: (5, 2, 57344.0, 2.0**-14, True, True),
    torch.float8_e4m3fnuz: (4, 3, 240.0, 2.0**-7, False, False),
    torch.float8_e5m2fnuz: (5, 2, 57344.0, 2.0**-15, False, False),
}


@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_describe_builds_the_format_from_its_definition(float8_dtype):
    e, m, fmax, normal, has_inf, neg_zero = _DEFINITION[float8_dtype]
    expected = Float8Format(
        dtype=float8_dtype,
        exponent_bits=e,
        mantissa_bits=m,
        max=fmax,
        smallest_normal=normal,
        smallest_subnormal=normal * 2.0**-m,
        eps=2.0**-m,
        has_inf=has_inf,
        has_negative_zero=neg_zero,
    )
    built = formats._describe(float8_dtype, e, m)
    assert built == expected
    assert all(type(getattr(built, f)) is type(getattr(expected, f)) for f in ("max", "eps", "has_inf"))
    assert FORMATS[float8_dtype] == expected


# The largest fp32 magnitude that rounds to max rather than past it: the tie between max and
# the next (missing) value, max + ulp/2, when max's mantissa is even (ties go down), else the
# fp32 number just below the tie (fp32 spacing there: 2**-16 below 256, 2**-8 below 65536).
_BOUNDS = {
    torch.float8_e4m3fn: 464.0,
    torch.float8_e5m2: 61440.0 - 2.0**-8,
    torch.float8_e4m3fnuz: 248.0 - 2.0**-16,
    torch.float8_e5m2fnuz: 61440.0 - 2.0**-8,
}


@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_saturation_bound_from_the_top_binade(float8_dtype):
    bound = formats._saturation_bound(FORMATS[float8_dtype])
    assert bound == _BOUNDS[float8_dtype]
    assert formats.saturation_bound(float8_dtype) == _BOUNDS[float8_dtype]
    # The bound itself rounds to max (not past it) in torch's own conversion.
    at = torch.tensor([bound], dtype=torch.float32)
    assert at.to(float8_dtype).float().item() == FORMATS[float8_dtype].max


@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_saturation_bound_is_an_fp32_number_whatever_the_default_dtype(float8_dtype):
    """The bound is fp32's neighbour of the tie (the products it is compared with are
    fp32), also when torch's default dtype is float64 at import time."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        bound = formats._saturation_bound(FORMATS[float8_dtype])
    finally:
        torch.set_default_dtype(previous)
    assert bound == _BOUNDS[float8_dtype]


# ------------------------------------------------------------ formats: the saturating cast


@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_saturated_cast_clamps_both_ends(float8_dtype, inplace):
    """Both branches clamp both ends to the finite max (a missing bound gives NaN or inf:
    torch's own conversion does not saturate); only ``inplace`` writes into ``x``."""
    fmax = FORMATS[float8_dtype].max
    x = torch.tensor([-4 * fmax, -fmax, 0.5, fmax, 4 * fmax], dtype=torch.float32)
    before = x.clone()
    # The copy case through the default: a caller that does not ask for inplace keeps its x.
    out = formats.saturated_cast(x, float8_dtype, inplace=True) if inplace else formats.saturated_cast(x, float8_dtype)
    assert out.dtype == float8_dtype
    assert out.float().tolist() == [-fmax, -fmax, 0.5, fmax, fmax]
    if inplace:
        assert x.tolist() == [-fmax, -fmax, 0.5, fmax, fmax]
    else:
        assert torch.equal(x, before)


def test_check_hp_dtype_names_the_input_by_default():
    with pytest.raises(TypeError, match=r"^input must have a high-precision floating dtype \(torch.bfloat16"):
        formats.check_hp_dtype(torch.int8)


# ------------------------------------------------------------ specs: the block predicates


@pytest.mark.parametrize(
    "block, expected",
    [
        ((), None),  # tensorwise
        ((0, 0), 1),  # one scale kept with the tensor's rank: the last dim
        ((0, 0, 0), 2),
        ((1, 0), 1),  # rowwise on an (M, K) operand contracted over K
        ((0, 1), 0),
        ((1, 1, 0), 2),
        ((128, 0), None),  # a true block with a whole-dim entry: not axiswise
        ((1, 128), None),
        ((128, 128), None),
    ],
)
def test_axiswise_dim_from_the_block_definition(block, expected):
    from f8tensor.quant.specs import axiswise_dim

    assert axiswise_dim(block) == expected
