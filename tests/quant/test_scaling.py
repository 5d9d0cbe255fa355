"""scaling.py's functions called directly, against their docstrings' contracts.

The casts reach these functions for every recipe, but only with the arguments the casts pass;
this file also covers the defaults, the edges the docstrings name (empty tensors, another
device, torch's default dtype set to float64, e8m0's exponent range, stochastic rounding's
ties) and the error messages. Expected values are written from the definitions (float64
Python arithmetic, powers of two), not from the functions under test.
"""

from __future__ import annotations

import contextlib
import math
import pathlib

import pytest
import torch
from helpers import load_script

from f8tensor.quant import scaling

E4M3, E5M2, E8M0 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


# ----------------------------------------------------------------------------- amax


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_amax_shapes_dtype_and_device(device):
    """fp32, on ``x``'s device, reduced to 0-dim or kept as size 1 along the axis; an empty
    ``x`` gives zeros of that shape. ``meta`` stands for every device other than the CPU
    (their reduction takes another branch), and for torch's default dtype set to float64."""
    with _default_dtype(torch.float64):
        for shape in ((4, 6), (0, 6), (4, 0)):
            x = torch.randn(shape, dtype=torch.bfloat16).to(device)
            for axis, expected in ((None, ()), (0, (1, shape[1])), (1, (shape[0], 1)), (-1, (shape[0], 1))):
                got = scaling.tensor_amax(x, axis)
                assert got.shape == expected and got.dtype == torch.float32 and got.device.type == device
            for block in ((1, 4), (2, 0), (0, 0)):
                got = scaling.block_amax(x, block)
                sizes = tuple(1 if b == 0 else -(-s // b) for s, b in zip(shape, block))
                assert got.shape == sizes and got.dtype == torch.float32 and got.device.type == device


def test_abs_max_of_an_empty_tensor_is_fp32_zeros():
    """``abs_max`` and ``block_abs_max`` keep ``x``'s dtype, except for an empty ``x``: fp32
    zeros of the reduced shape, also with torch's default dtype set to float64."""
    with _default_dtype(torch.float64):
        for x in (torch.empty(0, 6, dtype=torch.bfloat16), torch.empty(4, 0, dtype=torch.float16)):
            for axis in (None, 0, 1):
                got = scaling.abs_max(x, axis)
                assert got.dtype == torch.float32 and not got.any()
            got = scaling.block_abs_max(x, (1, 2))
            assert got.dtype == torch.float32 and not got.any()
        # A non-empty x keeps its own dtype (exact: min and max are).
        x = torch.tensor([[1.0, -7.0], [-0.5, 2.0]], dtype=torch.bfloat16)
        assert scaling.abs_max(x).dtype == torch.bfloat16 and scaling.abs_max(x).item() == 7.0
        assert scaling.block_abs_max(x, (1, 2)).tolist() == [[7.0], [2.0]]


def test_amax_values_from_the_definition():
    x = torch.tensor([[1.0, -7.0, 3.0], [-0.5, 2.0, 6.0]], dtype=torch.bfloat16)
    assert scaling.tensor_amax(x).item() == 7.0
    assert scaling.tensor_amax(x, 0).tolist() == [[1.0, 7.0, 6.0]]
    assert scaling.tensor_amax(x, 1).tolist() == [[7.0], [6.0]]
    assert scaling.tensor_amax(torch.empty(0, 3), 1).shape == (0, 1)
    assert scaling.block_amax(x, (1, 2)).tolist() == [[7.0, 3.0], [2.0, 6.0]]


def test_amax_to_scale_defaults_and_guards():
    """Not rounded by default; an amax of 0 gives max / 2**-100 (rounded down to a power
    of two when asked); inf, -inf and NaN give NaN, rounded or not."""
    amax = torch.tensor([3.0, 0.0, float("inf"), -float("inf"), float("nan")])
    plain = scaling.amax_to_scale(amax, E4M3)
    assert plain[0].item() == torch.tensor(448.0 / 3.0).item()
    assert plain[1].item() == torch.tensor(448.0 * 2.0**100).item()
    pow2 = scaling.amax_to_scale(amax, E4M3, round_pow2=True)
    assert pow2[:2].tolist() == [128.0, 2.0 ** math.floor(math.log2(448.0 * 2.0**100))]
    for scale in (plain, pow2):
        assert scale.dtype == torch.float32 and torch.isnan(scale[2:]).all()


def test_block_amax_refuses_a_block_of_another_rank():
    with pytest.raises(ValueError, match=r"^block \(1, 2\) has 2 entries for a 3-dim tensor$"):
        scaling.block_amax(torch.zeros(2, 3, 4), (1, 2))


# ----------------------------------------------------------------------------- e8m0 scales


def test_e8m0_scale_default_mode_is_rceil():
    amax = torch.tensor([1.0, 3.0, 500.0])
    assert torch.equal(
        scaling.amax_to_e8m0_scale(amax, E4M3).float(), scaling.amax_to_e8m0_scale(amax, E4M3, "rceil").float()
    )
    # rceil: 2**floor(log2(448 / amax)); floor: 2**(8 - floor(log2(amax))): they differ here.
    assert scaling.amax_to_e8m0_scale(amax, E4M3).float().tolist() == [256.0, 128.0, 0.5]
    assert scaling.amax_to_e8m0_scale(amax, E4M3, "floor").float().tolist() == [256.0, 128.0, 1.0]


def test_e8m0_scale_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match=r"^e8m0 scale mode must be one of \('rceil', 'floor'\); got 'ceil'$"):
        scaling.amax_to_e8m0_scale(torch.tensor([1.0]), E4M3, "ceil")


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_e8m0_scale_exponent_is_clamped_to_the_e8m0_range(mode):
    """Exponents past e8m0's [-127, 127] are clamped (a float64 amax reaches them: an fp32
    one, at least 2**-100 after the EPS clamp and below 2**128, does not)."""
    amax = torch.tensor([1e300, 2.0**-100, 2.0**126], dtype=torch.float64)
    got = scaling.amax_to_e8m0_scale(amax, E4M3, mode).float()
    assert got[0].item() == 2.0**-127
    expected_small = 2.0 ** math.floor(math.log2(448 / 2.0**-100)) if mode == "rceil" else 2.0 ** (8 + 100)
    assert got[1].item() == expected_small
    assert got[2].item() == 2.0**-118  # rceil: 2**floor(log2(448 / 2**126)); floor: 2**(8 - 126)


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_e8m0_scale_in_fp32_is_the_e8m0_values(mode):
    """``dtype=torch.float32``: the same powers of two; a non-finite amax's NaN positive, as
    e8m0's NaN reads back (its payload aside)."""
    amax = torch.tensor([1.0, 3.0, 500.0, 2.0**-100, 0.0, float("inf"), float("nan")])
    got = scaling.amax_to_e8m0_scale(amax, E4M3, mode, torch.float32)
    e8m0 = scaling.amax_to_e8m0_scale(amax, E4M3, mode)
    assert got.dtype == torch.float32 and e8m0.dtype == torch.float8_e8m0fnu
    nan = e8m0.float().isnan()
    assert nan.tolist() == [False] * 5 + [True] * 2 and torch.equal(got.isnan(), nan)
    assert not got.signbit().any() and torch.equal(got[~nan], e8m0.float()[~nan])


# ----------------------------------------------------------------------------- delayed scaling


def test_delayed_scale_defaults_and_refusal():
    """Defaults: the window's largest amax, no margin, no power-of-two rounding."""
    history = torch.tensor([3.0, 5.0, 0.0])
    assert scaling.delayed_scale(history, E4M3).item() == torch.tensor(448.0 / 5.0, dtype=torch.float32).item()
    assert scaling.delayed_scale(history, E4M3, reduction="most_recent").item() == torch.tensor(448.0 / 3.0).item()
    assert scaling.delayed_scale(history, E4M3, margin=2).item() == torch.tensor(448.0 / 20.0).item()
    assert scaling.delayed_scale(history, E4M3, round_pow2=True).item() == 64.0  # 89.6 rounded down
    with pytest.raises(ValueError, match=r"^reduction must be one of \('max', 'most_recent'\); got 'mean'$"):
        scaling.delayed_scale(history, E4M3, reduction="mean")


def test_dynamic_scale_default_is_not_rounded():
    x = torch.tensor([3.0, -1.0])
    assert scaling.dynamic_scale(x, E4M3).item() == torch.tensor(448.0 / 3.0).item()
    assert scaling.dynamic_scale(x, E4M3, round_pow2=True).item() == 128.0


def test_dynamic_scale_along_an_axis_is_one_scale_per_row():
    x = torch.tensor([[3.0, -1.0], [0.5, -2.0]])
    expected = torch.tensor([[448.0 / 3.0], [448.0 / 2.0]])
    assert torch.equal(scaling.dynamic_scale(x, E4M3, axiswise_dim=-1), expected)


# ----------------------------------------------------------------------------- segments


@pytest.mark.parametrize("rows_per_chunk", [None, 1, 3])
def test_segment_amax_from_the_definition(rows_per_chunk):
    """max |x| per (segment, column), 0 for an empty segment; the same bits for any chunking
    the lengths allow (the default: rows one at a time, any lengths)."""
    lengths = [3, 0, 6, 3] if rows_per_chunk == 3 else [1, 0, 5, 2, 4]
    x = torch.randn(sum(lengths), 5, dtype=torch.bfloat16) * 4
    expected, start = [], 0
    for n in lengths:
        expected.append(x[start : start + n].float().abs().amax(0) if n else torch.zeros(5))
        start += n
    kwargs = {} if rows_per_chunk is None else {"rows_per_chunk": rows_per_chunk}
    got = scaling.segment_amax(x, torch.tensor(lengths), **kwargs)
    assert got.dtype == torch.float32 and torch.equal(got, torch.stack(expected))


# ----------------------------------------------------------------------------- stochastic rounding


def test_stochastic_round_with_given_draws_rounds_up_below_the_fraction():
    """Up exactly when the draw is below the distance to the lower neighbour (in spacings):
    a value on the grid never moves, a draw equal to the fraction rounds down."""
    x = torch.tensor([1.0, 1.0625, 1.0625, 1.09375, 1.09375, -1.0625, 448.0])  # e4m3 spacing 0.125 at 1
    u = torch.tensor([0.0, 0.5, 0.4999, 0.75, 0.7, 0.25, 0.0])
    got = scaling.stochastic_round(x, E4M3, uniform=u)
    assert got.tolist() == [1.0, 1.0, 1.125, 1.0, 1.125, -1.0, 448.0]


def test_stochastic_round_draws_follow_the_logical_order_and_are_fp32():
    """The same seed gives the same result for a transposed tensor as for its contiguous
    copy, and whatever torch's default dtype (the draws are fp32, in logical order)."""
    x = torch.randn(64, 48) * 3
    xt = x.t()
    results = []
    for make in (lambda: xt, lambda: xt.contiguous()):
        torch.manual_seed(3)
        results.append(scaling.stochastic_round(make(), E5M2))
    assert torch.equal(results[0], results[1])
    with_gen = []
    for dtype in (torch.float32, torch.float64):
        with _default_dtype(dtype):
            with_gen.append(scaling.stochastic_round(x, E5M2, torch.Generator().manual_seed(5)))
    assert torch.equal(with_gen[0], with_gen[1]) and with_gen[0].dtype == torch.float32


def test_stochastic_round_stays_on_the_input_device():
    x = torch.randn(4, 8, device="meta")
    assert scaling.stochastic_round(x, E4M3, torch.Generator()).device.type == "meta"


# ----------------------------------------------------------------------------- materialized


def test_materialized_is_the_tensor_itself_in_eager_mode():
    t = torch.randn(4, 6).t()
    assert scaling.materialized(t) is t


def test_materialized_under_tracing_lays_a_plain_tensor_out_where_computed(monkeypatch):
    """Traced by torch.compile (the path it takes, run here eagerly): a view in standard
    strides of ``t`` (made contiguous first), or in the strides the caller names; a
    subclass (a Float8Tensor, a Parameter) is returned as it is."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    t = torch.randn(3, 4, 5).permute(2, 0, 1)
    got = scaling.materialized(t)
    assert torch.equal(got, t) and got.stride() == (12, 4, 1)
    cm = torch.empty(5, 3).t()  # a column-major buffer of shape (3, 5)
    cm.copy_(torch.randn(3, 5))
    got = scaling.materialized(cm, stride=(1, 3))
    assert torch.equal(got, cm) and got.stride() == (1, 3) and got.data_ptr() == cm.data_ptr()
    param = torch.nn.Parameter(torch.randn(4, 6).t())
    assert scaling.materialized(param) is param


def test_amax_to_scale_traced_holds_no_nan_constant_and_is_materialized(monkeypatch):
    """Traced (run here eagerly): no NaN scalar (NaN != NaN: equal casts of one input would
    not merge into one), eager's bits (+NaN for a non-finite amax, as the Triton kernels
    write), and the scale laid out where computed (as_strided)."""
    bench = load_script(pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_eager_overhead.py")
    amax = torch.tensor([0.0, 3.5, 1e-30, math.inf, -math.inf, math.nan])
    eager = scaling.amax_to_scale(amax, E4M3)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with bench.DispatchOpCounter() as mode:
        traced = scaling.amax_to_scale(amax, E4M3)
    assert "nan_to_num" not in mode.ops and "as_strided" in mode.ops
    assert torch.equal(traced.view(torch.int32), eager.view(torch.int32))  # bits, NaN's sign included


def test_expand_block_scale_of_a_tensorwise_scale_broadcasts():
    # A 0-dim scale with the tensorwise block: nothing to expand (tutorial 08 reads it so).
    from f8tensor.quant.scaling import expand_block_scale
    from f8tensor.tensor import Float8Tensor

    x = torch.randn(32, 64)
    x8 = Float8Tensor.from_hp(x)
    expanded = expand_block_scale(x8._scale, x8._block, tuple(x.shape))
    assert torch.equal(torch.broadcast_to(expanded, x.shape), torch.broadcast_to(x8._scale.float(), x.shape))
