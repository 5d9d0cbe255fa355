"""The reference casts' telemetry, scale rule and way back, checked against their definitions.

``kernels.reference.cast_with_stats`` is the cast every telemetry buffer reads; the module
tests (tests/nn/test_telemetry.py) check it through whole training steps, which are
too slow to run against each mutant of the reference casts. These call it directly, with
inputs placed on the edges the definitions name (the saturation bound, half the smallest
subnormal, one outlier per row or block), and expected values computed here in float64 from
the format numbers (OCP FP8; the fnuz variants), never from the functions under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import dtype_name

from f8tensor.kernels import reference
from f8tensor.quant.formats import E8M0, FLOAT8_DTYPES
from f8tensor.quant.specs import CastSpec

E4M3 = torch.float8_e4m3fn
FIELDS = {name: i for i, name in enumerate(reference.CAST_STATS_FIELDS)}

# (max, smallest subnormal) of each format, and the largest fp32 magnitude that still rounds
# to max (not past it): max + ulp/2 when max's mantissa is even (the tie rounds down), else
# the fp32 number just below that tie.
_MAX = {
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
    torch.float8_e4m3fnuz: 240.0,
    torch.float8_e5m2fnuz: 57344.0,
}
_SUBNORMAL = {
    torch.float8_e4m3fn: 2.0**-9,
    torch.float8_e5m2: 2.0**-16,
    torch.float8_e4m3fnuz: 2.0**-10,
    torch.float8_e5m2fnuz: 2.0**-17,
}
_BOUND = {
    torch.float8_e4m3fn: 464.0,
    torch.float8_e5m2: 61440.0 - 2.0**-8,
    torch.float8_e4m3fnuz: 248.0 - 2.0**-16,
    torch.float8_e5m2fnuz: 61440.0 - 2.0**-8,
}


def _above(x: float) -> float:
    """The next fp32 number above ``x``."""
    return float(torch.nextafter(torch.tensor(x), torch.tensor(math.inf)))


def _log2(x: float) -> pytest.approx:
    """log2 of ``x`` to within a few float64 ulps (libm's and torch's scalar and vectorized
    log2 differ in the last bit; a wrong product or scale moves the headroom by far more)."""
    return pytest.approx(math.log2(x), rel=1e-14, abs=1e-15)


def _stats(vector: torch.Tensor) -> dict[str, float]:
    assert vector.dtype == torch.float64 and vector.shape == (len(FIELDS),)
    return {name: vector[i].item() for name, i in FIELDS.items()}


@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=dtype_name)
def test_counts_at_the_saturation_bound_and_half_the_smallest_subnormal(float8_dtype):
    """A unit scale, so each value is its own scaled magnitude: saturated are exactly the
    values past the bound (the bound itself and max are not), flushed are exactly the
    non-zero values at most half the smallest subnormal (zero is not)."""
    fmax, sub, bound = _MAX[float8_dtype], _SUBNORMAL[float8_dtype], _BOUND[float8_dtype]
    values = [
        fmax,
        -fmax,
        bound,
        -bound,  # not saturated
        _above(bound),
        -2 * fmax,
        3 * fmax,  # saturated: 3
        0.0,
        sub,
        -sub,
        _above(sub / 2),  # not flushed
        sub / 2,
        -sub / 2,
        sub / 8,
        -(2.0**-120),  # flushed: 4
        1.0,
        -3.0,
    ]
    hp = torch.tensor(values, dtype=torch.float32)
    unit = torch.tensor(1.0)
    data, scale, vector = reference.cast_with_stats(hp, CastSpec(float8_dtype), unit)
    s = _stats(vector)
    assert (s["saturated_count"], s["underflow_count"], s["numel"]) == (3.0, 4.0, float(len(values)))
    assert s["amax"] == 3 * fmax
    assert s["scale"] == 1.0
    # The largest scaled magnitude is 3 * max: log2(max / (3 * max)) = -log2(3).
    assert s["headroom_log2"] == _log2(1 / 3)
    # The same cast as `cast`: data and scale bit for bit.
    data_ref, scale_ref = reference.cast(hp, CastSpec(float8_dtype), unit)
    assert torch.equal(data.view(torch.uint8), data_ref.view(torch.uint8))
    assert scale is unit and scale_ref is unit
    # Saturated values are clamped to +-max; flushed ones are zero.
    assert data.float()[4:7].tolist() == [fmax, -fmax, fmax]
    assert data.float()[11:15].abs().tolist() == [0.0, 0.0, 0.0, 0.0]


def test_nan_is_neither_saturated_nor_flushed():
    hp = torch.tensor([float("nan"), 1000.0, 2.0**-11, 1.0])
    _, _, vector = reference.cast_with_stats(hp, CastSpec(E4M3), torch.tensor(1.0))
    s = _stats(vector)
    assert (s["saturated_count"], s["underflow_count"], s["numel"]) == (1.0, 1.0, 4.0)
    assert math.isnan(s["amax"])


def _rows_with_one_outlier(rows: int, cols: int) -> torch.Tensor:
    """Row r: small values and one outlier of 2**r at column 7 * r (mod cols); so each row,
    each 1x32 block along a row and each column has its own amax."""
    gen = torch.Generator().manual_seed(43)
    x = torch.rand(rows, cols, generator=gen) * 0.25 + 0.01
    for r in range(rows):
        x[r, (7 * r) % cols] = -(2.0**r) if r % 2 else 2.0**r
    return x


def _blocks_of(x: torch.Tensor, block: tuple[int, ...]) -> list[torch.Tensor]:
    """The elements of each block of a 2D ``x`` (0: the whole dim; partial edge blocks)."""
    (rows, cols), (br, bc) = x.shape, block
    br, bc = br or rows, bc or cols
    return [x[i : i + br, j : j + bc] for i in range(0, rows, br) for j in range(0, cols, bc)]


# (spec, the block each scale covers); the spec's block is what the cast reads.
_SPECS = {
    "tensorwise": (CastSpec(E4M3), (0, 0)),
    "rows": (CastSpec(E4M3, (1, 0)), (1, 0)),
    "columns": (CastSpec(E4M3, (0, 1)), (0, 1)),
    "1x32": (CastSpec(E4M3, (1, 32)), (1, 32)),
    "32x1": (CastSpec(E4M3, (32, 1)), (32, 1)),
    "mx_1x32": (CastSpec(E4M3, (1, 32), E8M0), (1, 32)),
    "e5m2_rows_pow2": (CastSpec(torch.float8_e5m2, (1, 0), power_of_2=True), (1, 0)),
    "mx_rows": (CastSpec(E4M3, (1, 0), E8M0), (1, 0)),
    "one_scale_2d": (CastSpec(E4M3, (0, 0)), (0, 0)),
}


@pytest.mark.parametrize("hp_dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
@pytest.mark.parametrize("name", list(_SPECS))
def test_dynamic_stats_per_granularity(name, hp_dtype):
    """Dynamic scales: the reported amax is the tensor's, the scale the smallest block
    scale (the block holding the amax), the headroom log2(max / max |hp * scale|) over the
    fp32 products the cast rounds; nothing saturates (a dynamic scale maps each block's
    amax onto max) and nothing here is small enough to flush."""
    spec, block = _SPECS[name]
    hp = _rows_with_one_outlier(8, 80).to(hp_dtype)
    data, scale, vector = reference.cast_with_stats(hp, spec)
    data_ref, scale_ref = reference.cast(hp, spec)
    assert torch.equal(data.view(torch.uint8), data_ref.view(torch.uint8))
    assert torch.equal(scale.float(), scale_ref.float()) and scale.dtype == scale_ref.dtype
    fmax = _MAX[spec.float8_dtype]
    # The scale of each block, from the definition: max / amax (float64, rounded once to
    # fp32; rounded down to a power of two when asked); MX: 2**floor(log2(max / amax)).
    blocks = _blocks_of(hp.double(), block)
    scales = []
    for b in blocks:
        s = fmax / b.abs().max().item()
        if spec.scale_dtype == E8M0 or spec.power_of_2:
            s = 2.0 ** math.floor(math.log2(s))
        scales.append(float(torch.tensor(s, dtype=torch.float32)))
    assert sorted(scale.float().flatten().tolist()) == sorted(scales)
    products = [(b.float() * s).abs().max().item() for b, s in zip(_blocks_of(hp, block), scales)]
    s = _stats(vector)
    assert (s["saturated_count"], s["underflow_count"], s["numel"]) == (0.0, 0.0, 640.0)
    assert s["amax"] == 2.0**7
    assert s["scale"] == min(scales)
    assert s["headroom_log2"] == _log2(fmax / max(products))


def test_power_of_two_scales_leave_headroom():
    """A scale rounded down to a power of two leaves the amax below max: the headroom is
    log2(max / (amax * scale)) > 0, here with amax 3 (scale 448/3 -> 128, 3 * 128 = 384)."""
    hp = torch.tensor([[3.0, -1.0], [0.5, 2.0]])
    _, scale, vector = reference.cast_with_stats(hp, CastSpec(E4M3, power_of_2=True))
    assert scale.item() == 128.0
    assert _stats(vector)["headroom_log2"] == _log2(448.0 / 384.0)


def test_a_given_tensorwise_amax_is_reported_instead_of_measuring():
    """With a given scale, a tensorwise cast reports the amax the caller measured (an FSDP
    shard reports its whole tensor's); it is not read again from ``hp``."""
    hp = torch.tensor([[1.0, -2.0], [0.5, 0.25]])
    whole = torch.tensor(6.0)
    _, _, vector = reference.cast_with_stats(hp, CastSpec(E4M3), torch.tensor(32.0), amax=whole)
    s = _stats(vector)
    assert s["amax"] == 6.0
    assert s["headroom_log2"] == _log2(448.0 / (6.0 * 32.0))


def test_a_given_amax_is_ignored_by_a_rowwise_cast():
    """Only tensorwise casts take the caller's amax: a rowwise one measures its rows."""
    hp = torch.tensor([[1.0, -2.0], [0.5, 0.25]])
    given_scale = torch.tensor([[100.0], [400.0]])
    _, scale, vector = reference.cast_with_stats(hp, CastSpec(E4M3, (1, 0)), given_scale, amax=torch.tensor(6.0))
    s = _stats(vector)
    assert scale is given_scale
    assert s["amax"] == 2.0
    assert s["scale"] == 100.0
    assert s["headroom_log2"] == _log2(448.0 / 200.0)


@pytest.mark.parametrize("name", ["tensorwise", "rows", "1x32", "mx_1x32"])
def test_a_given_scale_is_used_as_is(name):
    """A given scale is used as is (including one that saturates: 2x the dynamic one here):
    the counts are those of its products."""
    spec, _ = _SPECS[name]
    hp = _rows_with_one_outlier(8, 64)
    _, dynamic = reference.cast(hp, spec)
    given = dynamic.float() * 2
    if spec.scale_dtype == E8M0:
        given = given.to(E8M0)
    data, scale, vector = reference.cast_with_stats(hp, spec, given)
    assert scale is given
    expanded = given.float()
    if spec.block and max(spec.block) > 1:
        expanded = expanded.repeat_interleave(32, dim=1)
    products = hp * expanded
    assert torch.equal(data.float(), products.clamp(-448, 448).to(E4M3).float())
    s = _stats(vector)
    # Each block's amax lands on 2 * 448 = 896, past the bound 464: at least one saturated
    # element per block, counted element by element on the products.
    assert s["saturated_count"] == float((products.abs() > 464.0).sum())
    assert s["saturated_count"] > 0
    assert s["scale"] == given.float().min().item()
    assert s["headroom_log2"] == _log2(448.0 / products.abs().max().item())


@pytest.mark.parametrize("name", list(_SPECS))
def test_empty_tensor_stats(name):
    """An empty tensor (an empty FSDP shard): zero counts and amax, NaN scale and headroom."""
    spec, _ = _SPECS[name]
    _, _, vector = reference.cast_with_stats(torch.empty(0, 64), spec)
    s = _stats(vector)
    assert [s[k] for k in ("saturated_count", "underflow_count", "numel", "amax")] == [0.0, 0.0, 0.0, 0.0]
    assert math.isnan(s["scale"]) and math.isnan(s["headroom_log2"])


def test_stochastic_rounding_stats_are_those_of_the_products():
    """A stochastic cast reports the counts of its fp32 products (as round-to-nearest
    would), and its data is a neighbour of each product on the FP8 grid."""
    hp = torch.tensor([[1000.0, 1.0625, 2.0**-11, 0.0]])
    spec = CastSpec(E4M3, rounding="stochastic")
    gen = torch.Generator().manual_seed(0)
    data, _, vector = reference.cast_with_stats(hp, spec, torch.tensor(1.0), generator=gen)
    s = _stats(vector)
    assert (s["saturated_count"], s["underflow_count"]) == (1.0, 1.0)
    assert data.float()[0, 0].item() == 448.0
    assert data.float()[0, 1].item() in (1.0, 1.125)


def test_stochastic_rounding_with_given_draws():
    """Draws given instead of a generator (a counter-based hash of each position): the data
    are the stochastic rounding of the scaled values with exactly those draws; values past
    the range saturate (infinities included), as round-to-nearest's do."""
    hp = torch.tensor([[1.0625, 1.0625, 1000.0, -1000.0, float("inf"), -float("inf")]])
    u = torch.tensor([[0.25, 0.75, 0.5, 0.5, 0.5, 0.5]])
    spec = CastSpec(E4M3, rounding="stochastic")
    data, _ = reference.cast(hp, spec, torch.tensor(1.0), uniform=u)
    assert data.float().tolist() == [[1.125, 1.0, 448.0, -448.0, 448.0, -448.0]]
    nearest, _ = reference.cast(hp, CastSpec(E4M3), torch.tensor(1.0))
    assert data.float()[0, 2:].tolist() == nearest.float()[0, 2:].tolist()
    # 64 ties 1.0625 (half a spacing above 1.0): up exactly where the draw is below 0.5. Draws
    # of the default generator instead would match this pattern with probability 2**-64.
    ties = torch.full((2, 32), 1.0625)
    u = ((torch.arange(64) * 37 % 64).float() / 64).reshape(2, 32)
    data, _ = reference.cast(ties, spec, torch.tensor(1.0), uniform=u)
    assert torch.equal(data.float(), torch.where(u < 0.5, 1.125, 1.0))


def test_a_bf16_input_is_scaled_in_fp32_before_the_fp8_rounding():
    """``data = saturate(hp.float() * scale)``: 1.0 * (1.0625 + 2**-20) lies above the tie
    1.0625 between e4m3's 1.0 and 1.125, so it rounds to 1.125; rounding the product to
    bf16 first (1.0625, the tie) would give 1.0 (ties to even)."""
    scale = torch.tensor(1.0625 + 2.0**-20)
    hp = torch.ones(2, 2, dtype=torch.bfloat16)
    data, _ = reference.cast(hp, CastSpec(E4M3), scale)
    assert data.float().unique().tolist() == [1.125]
    # A 0-dim input too, and its data stays 0-dim.
    data0, _ = reference.cast(torch.tensor(1.0, dtype=torch.bfloat16), CastSpec(E4M3), scale)
    assert data0.shape == () and data0.float().item() == 1.125


# ------------------------------------------------------------------------ block_scale


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_block_scale_e8m0_from_the_mx_definition(mode):
    """MX (OCP v1.0): rceil X = 2**ceil(log2(amax / 448)), floor X = 2**(floor(log2(amax)) - 8);
    the scale is 1 / X, stored as e8m0."""
    amax = torch.tensor([1.0, 3.0, 448.0, 500.0, 0.01])
    got = reference.block_scale(amax, CastSpec(E4M3, (1, 32), E8M0, mode))
    assert got.dtype == E8M0
    if mode == "rceil":
        expected = [2.0 ** -math.ceil(math.log2(a / 448.0)) for a in amax.tolist()]
    else:
        expected = [2.0 ** -(math.floor(math.log2(a)) - 8) for a in amax.tolist()]
    assert got.float().tolist() == expected


@pytest.mark.parametrize("power_of_2", [False, True])
def test_block_scale_fp32_from_the_definition(power_of_2):
    """fp32 block scales: max / amax (float64, rounded once to fp32), rounded down to a
    power of two when the spec asks."""
    amax = torch.tensor([1.0, 3.0, 448.0, 500.0, 0.01])
    got = reference.block_scale(amax, CastSpec(torch.float8_e5m2, (1, 128), power_of_2=power_of_2))
    assert got.dtype == torch.float32
    expected = [57344.0 / a for a in amax.double().tolist()]
    if power_of_2:
        expected = [2.0 ** math.floor(math.log2(s)) for s in expected]
    assert got.tolist() == torch.tensor(expected, dtype=torch.float32).tolist()


# ------------------------------------------------------------------------ dequantize


def test_dequantize_expands_block_scales_over_partial_blocks():
    """data / scale per block: a (3, 80) tensor in 1x32 blocks (a partial last block of 16)."""
    data = torch.full((3, 80), 2.0).to(E4M3)
    scale = torch.tensor([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0], [0.5, 0.25, 64.0]])
    out = reference.dequantize(data, scale, (1, 32), torch.float32)
    expected = torch.cat(
        [
            torch.full((3, 32), 2.0) / scale[:, :1],
            torch.full((3, 32), 2.0) / scale[:, 1:2],
            torch.full((3, 16), 2.0) / scale[:, 2:],
        ],
        dim=1,
    )
    assert torch.equal(out, expected)


@pytest.mark.parametrize("block", [(1, 2), (2, 1), (2, 2)])
def test_dequantize_expands_two_element_blocks(block):
    """Blocks of two along a dim repeat each scale twice there (a (5, 6) tensor: an odd
    row count gives a partial last block of rows)."""
    data = torch.full((5, 6), 2.0).to(E4M3)
    rows, cols = -(-5 // block[0]), -(-6 // block[1])
    scale = 2.0 ** torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    expected = 2.0 / scale.repeat_interleave(block[0], 0)[:5].repeat_interleave(block[1], 1)[:, :6]
    assert torch.equal(reference.dequantize(data, scale, block, torch.float32), expected)


def test_dequantize_reads_e8m0_scales_as_their_powers_of_two():
    """An e8m0 scale (per tensor or per row: no block to expand) is read as the power of two
    it stores."""
    data = torch.tensor([[3.0, -1.5], [448.0, 0.5]]).to(E4M3)
    for scale, block in ((torch.tensor(2.0**-3).to(E8M0), (0, 0)), (torch.tensor([[0.5], [4.0]]).to(E8M0), (1, 0))):
        out = reference.dequantize(data, scale, block, torch.float32)
        assert torch.equal(out, data.float() / scale.float())


def test_dequantize_saturates_to_the_output_dtype_and_keeps_nan_and_inf():
    """The way back clamps to the output dtype's finite range (448 / 2**-8 = 114688 is past
    fp16's 65504); NaN stays NaN, and an infinity in e5m2 data stays infinite."""
    data = torch.tensor([448.0, -448.0, 1.0, float("nan")]).to(E4M3)
    out = reference.dequantize(data, torch.tensor(2.0**-8), (0,), torch.float16)
    assert out.dtype == torch.float16
    assert out[:3].tolist() == [65504.0, -65504.0, 256.0] and math.isnan(out[3].item())
    inf_data = torch.tensor([float("inf"), -float("inf"), 2.0]).to(torch.float8_e5m2)
    out = reference.dequantize(inf_data, torch.tensor(0.5), (0,), torch.bfloat16)
    assert out.tolist() == [float("inf"), -float("inf"), 4.0]


# ------------------------------------------------------------------------ devices and dtypes


@pytest.mark.parametrize("name", list(_SPECS))
def test_stats_live_on_the_input_device_whatever_the_default_dtype(name):
    """The vector is float64 on ``hp``'s device, an empty ``hp`` included (``meta`` stands
    for any device other than the CPU), also with torch's default dtype set to float64."""
    spec, _ = _SPECS[name]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for shape in ((4, 64), (0, 64)):
            data, scale, vector = reference.cast_with_stats(torch.ones(shape, device="meta"), spec)
            assert vector.device.type == "meta" and vector.dtype == torch.float64 and vector.shape == (6,)
            assert data.device.type == "meta" and data.dtype == spec.float8_dtype
            assert scale.dtype == spec.scale_dtype
    finally:
        torch.set_default_dtype(previous)


def test_stochastic_stats_cast_draws_from_the_given_generator():
    """The same generator state gives the same bytes as ``cast`` (not torch's global one)."""
    hp = torch.randn(64, 64) * 10
    spec = CastSpec(E4M3, (1, 0), rounding="stochastic")
    torch.manual_seed(1)
    data, _, _ = reference.cast_with_stats(hp, spec, generator=torch.Generator().manual_seed(7))
    torch.manual_seed(2)
    data_ref, _ = reference.cast(hp, spec, generator=torch.Generator().manual_seed(7))
    assert torch.equal(data.view(torch.uint8), data_ref.view(torch.uint8))
