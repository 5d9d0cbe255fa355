"""Edges of the casts, devices and checkpoints: values near the dtype's max, explicit
scales, indexing, non-finite weights, mixed devices, delayed state at load, expanded and
sliced tensors saved, partial loads, huge and whole-dimension blocks, crafted pickles and
recovery after a fault; each over its class of inputs (dtypes, granularities, devices,
recipes).

Every test runs on CPU; accuracy is SQNR in dB with the threshold in the test.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

from f8tensor import (
    BlockGranularity,
    CastConfig,
    Float8Linear,
    Float8LinearConfig,
    Float8Tensor,
    MX_1x32,
    MX_1x32_FLOOR,
)
from tests.helpers import assert_sqnr, dtype_name
from tests.linear_utils import RECIPE_NAMES, fp8_linear

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny GEMMs: threads only add waiting

F8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
HP = (torch.float16, torch.bfloat16, torch.float32)
E8M0 = torch.float8_e8m0fnu

# Granularities of from_hp, each as (name, granularity argument).
GRANULARITIES = [
    ("tensorwise", "tensorwise"),
    ("rowwise", "rowwise"),
    ("1x128", (1, 128)),
    ("128x128", (128, 128)),
    ("mx_rceil", MX_1x32),
    ("mx_floor", MX_1x32_FLOOR),
]
NON_TENSORWISE = GRANULARITIES[1:]


def _roundtrip(obj, **load_kwargs):
    buf = io.BytesIO()
    torch.save(obj, buf)
    size = buf.tell()
    buf.seek(0)
    return torch.load(buf, **load_kwargs), size


# ===================================================================== item 1


@pytest.mark.parametrize("hp_dtype", HP, ids=dtype_name)
@pytest.mark.parametrize("f8", F8, ids=dtype_name)
@pytest.mark.parametrize(
    "gran,pow2",
    [("tensorwise", True), ("rowwise", True), ((1, 32), True), (MX_1x32, False), (MX_1x32_FLOOR, False)],
    ids=["tensorwise_pow2", "rowwise_pow2", "1x32_pow2", "mx_rceil", "mx_floor"],
)
def test_finite_values_near_the_dtype_max_never_dequantize_to_inf(hp_dtype, f8, gran, pow2):
    # Every value within a few percent of the dtype's max: the FP8 rounding of a
    # power-of-two-scaled value can round the mantissa up into the next binade.
    top = torch.finfo(hp_dtype).max
    fractions = torch.tensor([1.0, 0.999, 0.99, 0.985, 0.97, 0.95, 0.5, 1e-3], dtype=torch.float64)
    row = torch.cat([fractions, -fractions]) * top
    x = row.to(hp_dtype).repeat(4, 2)  # (4, 32): one MX block per row
    assert torch.isfinite(x).all()
    x8 = Float8Tensor.from_hp(x, f8, granularity=gran, power_of_2_scale=pow2)
    back = x8.to_hp()
    assert back.dtype == hp_dtype
    assert torch.isfinite(back).all(), f"finite input came back non-finite: {back[~torch.isfinite(back)][:4]}"
    # Measured 31.8 dB everywhere but the MX floor rule, which clips the top of a block by up
    # to 2x (19.3-26.4 dB).
    assert_sqnr(x.double(), back.double(), 17.0 if gran is MX_1x32_FLOOR else 29.0, "near-max values")


@pytest.mark.parametrize("hp_dtype", HP, ids=dtype_name)
def test_to_hp_with_an_explicit_scale_saturates_instead_of_overflowing(hp_dtype):
    # A user scale (a power of two, the largest that keeps the dtype's max within e4m3's
    # range) whose FP8 rounding lands above the dtype's max: data / scale saturates to the
    # dtype's max (as the cast saturates to the format's), never inf.
    top = torch.finfo(hp_dtype).max
    scale = 2.0 ** math.floor(math.log2(448.0 / top))
    x = torch.full((4, 8), top, dtype=hp_dtype)
    x8 = Float8Tensor.from_hp(x, torch.float8_e4m3fn, scale=scale)
    back = x8.to_hp()
    assert torch.isfinite(back).all()
    assert torch.all(back == top)
    # NaN stays NaN and inf becomes NaN: clamping must not turn them finite.
    y = x.clone()
    y[0, 0], y[1, 1] = float("nan"), float("inf")
    back = Float8Tensor.from_hp(y, torch.float8_e4m3fn, scale=1.0).to_hp()
    assert torch.isnan(back[0, 0]) and torch.isnan(back[1, 1])


# ===================================================================== item 2


@pytest.mark.parametrize("name,gran", GRANULARITIES, ids=[g[0] for g in GRANULARITIES])
@pytest.mark.parametrize("view", ["as_is", "expanded"])
def test_an_explicit_scale_is_copied_not_aliased(name, gran, view):
    x = torch.randn(256, 256)
    ref = Float8Tensor.from_hp(x, torch.float8_e4m3fn, granularity=gran)
    base = ref._scale.clone()
    given = base
    if view == "expanded":  # a view of another tensor: writing to that base must not matter either
        given = base.reshape(1).expand(1)[0] if base.dim() == 0 else base[:1].expand_as(base)
    x8 = Float8Tensor.from_hp(x, torch.float8_e4m3fn, granularity=gran, scale=given)
    before = x8.to_hp().clone()
    assert x8._scale.untyped_storage().data_ptr() != given.untyped_storage().data_ptr()
    if base.dtype == E8M0:
        base.view(torch.uint8).add_(1)
    else:
        base.mul_(2.0)
    torch.testing.assert_close(x8.to_hp(), before, rtol=0, atol=0)


# ===================================================================== item 3


@pytest.mark.parametrize("name,gran", NON_TENSORWISE + [("tensorwise", "tensorwise")], ids=lambda v: str(v))
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_negative_indices_pick_the_scale_of_their_own_row(name, gran, device):
    x = torch.randn(200, 256) * torch.logspace(-3, 3, 200)[:, None]  # every block row its own scale
    w8 = Float8Tensor.from_hp(x.to(device), torch.float8_e4m3fn, granularity=gran)
    ids = torch.tensor([-100, -1, -200, 5, 199, -129], device=device)
    got = w8[ids]
    assert got.shape == (6, 256)
    if device == "meta":
        return
    pos = torch.tensor([100, 199, 0, 5, 199, 71])
    assert_sqnr(x[pos], got.to_hp(), 28.0, f"{name} negative ids")  # measured 31.2-32.3 dB
    torch.testing.assert_close(got.to_hp(), w8.to_hp()[pos], rtol=0, atol=0)


@pytest.mark.parametrize("name,gran", GRANULARITIES, ids=[g[0] for g in GRANULARITIES])
def test_out_of_range_indices_are_refused_with_the_range(name, gran):
    w8 = Float8Tensor.from_hp(torch.randn(200, 256), torch.float8_e4m3fn, granularity=gran)
    for bad in ([200], [-201], [3, -400]):
        with pytest.raises(IndexError, match=r"\[-200, 200\)"):
            w8[torch.tensor(bad)]
    # select (an int index) wrapped -300 around to row 100 before.
    for dim, bad in ((0, -300), (0, 200), (1, 256), (1, -257)):
        with pytest.raises(IndexError, match=rf"\[-{w8.shape[dim]}, {w8.shape[dim]}\)"):
            w8.select(dim, bad)
    torch.testing.assert_close(w8.select(1, -1).to_hp(), w8.to_hp()[:, 255], rtol=0, atol=0)


# ===================================================================== item 5


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
def test_a_non_finite_weight_never_gives_a_finite_gradient(recipe, bad):
    torch.manual_seed(0)
    layer = fp8_linear(nn.Linear(64, 64), recipe)
    with torch.no_grad():
        layer.weight[3, 5] = bad
    x = torch.randn(16, 64, requires_grad=True)
    y = layer(x)
    y.backward(torch.randn_like(y))
    # Row 3 of W feeds output 3 of every token and column 5 of x's gradient: at least
    # those, through W, are no longer numbers.
    assert not torch.isfinite(y[:, 3]).any(), f"{recipe}: output finite"
    assert not torch.isfinite(x.grad[:, 5]).any(), f"{recipe}: grad_input finite"


# ===================================================================== item 6


@pytest.mark.parametrize("name,gran", GRANULARITIES, ids=[g[0] for g in GRANULARITIES])
@pytest.mark.parametrize("where", ["fp8_on_meta", "fp8_on_cpu"])
def test_mixed_devices_in_a_product_are_refused_naming_both(name, gran, where):
    w = torch.randn(64, 64)
    x = torch.randn(16, 64)
    if where == "fp8_on_meta":
        w8, other = Float8Tensor.from_hp(w.to("meta"), granularity=gran), x
    else:
        w8, other = Float8Tensor.from_hp(w, granularity=gran), x.to("meta")
    with pytest.raises((ValueError, RuntimeError), match=r"(?s)(cpu.*meta|meta.*cpu)"):
        other @ w8.t()
    with pytest.raises((ValueError, RuntimeError), match=r"(?s)(cpu.*meta|meta.*cpu)"):
        torch.mm(w8, other.t())


@pytest.mark.parametrize("op", ["bmm", "matmul", "grouped_mm"])
@pytest.mark.parametrize("gran", ["tensorwise", "rowwise"])
def test_mixed_devices_in_batched_and_grouped_products_are_refused(op, gran):
    w8 = Float8Tensor.from_hp(torch.randn(4, 32, 64).to("meta"), granularity=gran)
    x3, x2 = torch.randn(4, 16, 32), torch.randn(16, 32)
    offs = torch.tensor([4, 8, 12, 16], dtype=torch.int32)
    call = {
        "bmm": lambda: torch.bmm(x3, w8),
        "matmul": lambda: x3 @ w8,
        "grouped_mm": lambda: torch._grouped_mm(x2, w8, offs=offs),
    }[op]
    with pytest.raises(ValueError, match=r"(?s)cpu.*meta"):
        call()


# ===================================================================== item 7


@pytest.mark.parametrize(
    "bad", [float("inf"), float("-inf"), float("nan"), -1.0], ids=["inf", "-inf", "nan", "negative"]
)
@pytest.mark.parametrize(
    "buffer", ["amax_history_input", "amax_history_weight", "amax_history_grad_output", "scale_input", "scale_weight"]
)
def test_a_poisoned_delayed_state_is_refused_at_load(bad, buffer):
    layer = fp8_linear(nn.Linear(32, 32), "delayed")
    sd = copy.deepcopy(layer.state_dict())
    sd[buffer].view(-1)[0] = bad
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(ValueError, match=buffer):
        layer.load_state_dict(sd)
    for k, v in layer.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, equal_nan=True)


def test_zero_history_entries_still_load():
    # 0 is a legitimate history entry (an empty history, an all-zero tensor): the load keeps
    # it as given and the layer still trains from it.
    torch.manual_seed(0)
    layer = fp8_linear(nn.Linear(32, 32), "delayed")
    sd = copy.deepcopy(layer.state_dict())
    sd["amax_history_input"].zero_()
    sd["amax_history_weight"].view(-1)[1:] = 0.0
    sd["amax_history_weight"].view(-1)[0] = 3.0
    layer.load_state_dict(sd)
    for k, v in layer.state_dict().items():
        assert torch.equal(v, sd[k]), k
    x = torch.randn(8, 32, requires_grad=True)
    layer(x).sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(layer.weight.grad).all()
    for name in ("amax_history_input", "amax_history_weight", "scale_input", "scale_weight"):
        assert torch.isfinite(getattr(layer, name)).all(), name


# ===================================================================== items 8, 9


def _expanded(name, gran):
    x = torch.randn(1, 256)
    return Float8Tensor.from_hp(x, granularity=gran).expand(4, 256)


@pytest.mark.parametrize("name,gran", GRANULARITIES, ids=[g[0] for g in GRANULARITIES])
@pytest.mark.parametrize("weights_only", [True, False])
def test_an_expanded_tensor_saves_and_loads_back(name, gran, weights_only):
    x8 = _expanded(name, gran)
    back, _ = _roundtrip(x8, weights_only=weights_only)
    torch.testing.assert_close(back.to_hp(), x8.to_hp(), rtol=0, atol=0)


@pytest.mark.parametrize("name,gran", NON_TENSORWISE, ids=[g[0] for g in NON_TENSORWISE])
def test_a_cast_with_an_expanded_scale_saves_and_loads_back(name, gran):
    x = torch.randn(4, 256)
    full = Float8Tensor.from_hp(x, granularity=gran)._scale
    s = full[:1].expand_as(full)  # every row the first row's scales, through a zero stride
    x8 = Float8Tensor.from_hp(x, granularity=gran, scale=s)
    back, _ = _roundtrip(x8, weights_only=True)
    torch.testing.assert_close(back.to_hp(), x8.to_hp(), rtol=0, atol=0)


@pytest.mark.parametrize(
    "name,gran",
    NON_TENSORWISE + [("1x1", (1, 1))],
    ids=[g[0] for g in NON_TENSORWISE] + ["1x1"],
)
def test_a_slice_saves_only_its_own_scales(name, gran):
    x8 = Float8Tensor.from_hp(torch.randn(1024, 256), granularity=gran)
    piece = x8[128:144]
    back, size = _roundtrip(piece, weights_only=True)
    torch.testing.assert_close(back.to_hp(), piece.to_hp(), rtol=0, atol=0)
    own = piece._data.numel() + piece._scale.numel() * piece._scale.element_size()
    # The payload and its scales, plus pickling overhead (a few KB at most).
    assert size <= own + 4096, f"{name}: {size} bytes saved for {own} bytes of payload and scales"


# ===================================================================== item 10


def _delayed_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    from f8tensor import convert_to_float8_training

    model = convert_to_float8_training(model, config=Float8LinearConfig.from_recipe("delayed"))
    for _ in range(3):
        model(torch.randn(8, 32)).sum().backward()
    return model


def test_a_partial_load_leaves_what_is_missing_untouched_and_reports_it():
    model = _delayed_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    w = torch.randn(32, 32)
    result = model.load_state_dict({"0.weight": w}, strict=False)
    after = model.state_dict()
    torch.testing.assert_close(after["0.weight"], w, rtol=0, atol=0)
    # Layer 2 is not named: untouched, and its keys reported missing.
    for k, v in before.items():
        if k.startswith("2."):
            torch.testing.assert_close(after[k], v, rtol=0, atol=0, msg=f"{k} changed")
    assert {"2.weight", "2.bias", "2.amax_history_input", "2.scale_weight"} <= set(result.missing_keys)
    # Layer 0's weight was replaced by a high-precision one without delayed state: the state
    # that described the old weight starts fresh (the plain nn.Linear checkpoint rule).
    assert torch.all(model[0].amax_history_weight == 0) and torch.all(model[0].scale_weight == 1)
    torch.testing.assert_close(after["0.bias"], before["0.bias"], rtol=0, atol=0)


def test_a_partial_load_with_some_delayed_state_reports_the_rest_missing():
    model = _delayed_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sd = {"0.weight": torch.randn(32, 32), "0.amax_history_weight": torch.full((16,), 2.0)}
    result = model.load_state_dict(sd, strict=False)
    assert "0.amax_history_input" in result.missing_keys and "0.scale_weight" in result.missing_keys
    torch.testing.assert_close(model[0].amax_history_input, before["0.amax_history_input"], rtol=0, atol=0)


def test_a_plain_linear_checkpoint_into_a_delayed_layer_starts_its_state_fresh():
    model = _delayed_model()
    plain = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    result = model.load_state_dict(plain.state_dict())  # strict: no missing keys
    assert not result.missing_keys
    for i in (0, 2):
        assert torch.all(model[i].amax_history_input == 0)
        assert torch.all(model[i].scale_weight == 1)


# ===================================================================== item 14


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_compile_dynamic_true_forward_and_backward(recipe):
    torch._dynamo.reset()
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    eager = fp8_linear(lin, recipe)
    compiled_layer = fp8_linear(lin, recipe)
    compiled = torch.compile(compiled_layer, backend="aot_eager", dynamic=True)
    for tokens in (16, 48):
        x = torch.randn(tokens, 64)
        xe, xc = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ye, yc = eager(xe), compiled(xc)
        g = torch.randn_like(ye)
        ye.backward(g)
        yc.backward(g)
        # aot_eager runs eager's kernels on symbolic shapes: bit for bit the same numbers
        # (measured: all 36 results of the 6 recipes bit-identical).
        assert torch.equal(ye, yc), f"{recipe} y tokens={tokens}"
        assert torch.equal(xe.grad, xc.grad), f"{recipe} grad_x tokens={tokens}"
        assert torch.equal(eager.weight.grad, compiled_layer.weight.grad), f"{recipe} grad_w tokens={tokens}"


# ===================================================================== item 15


@pytest.mark.parametrize("block", [(1, 2**46), (1, 4096), (2**40, 2**40), (4096, 1)], ids=str)
def test_a_block_larger_than_the_tensor_is_one_partial_block(block):
    x = torch.randn(4, 64)
    x8 = Float8Tensor.from_hp(x, granularity=block)
    ref = Float8Tensor.from_hp(x, granularity=tuple(min(b, s) for b, s in zip(block, x.shape)))
    torch.testing.assert_close(x8.to_hp(), ref.to_hp(), rtol=0, atol=0)
    assert x8._data.numel() == x.numel()


def test_a_cast_config_with_a_huge_block_trains(_cuda_rules_check):
    cfg = Float8LinearConfig(
        input=CastConfig(torch.float8_e4m3fn, BlockGranularity((1, 2**46))),
        weight=CastConfig(torch.float8_e4m3fn, BlockGranularity((2**20, 2**46))),
        grad_output=CastConfig(torch.float8_e5m2, BlockGranularity((1, 2**46))),
    )
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    layer = Float8Linear.from_float(copy.deepcopy(lin), cfg)
    x = torch.randn(16, 64, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert_sqnr(lin(x), y, 25.0, "huge-block forward")
    if _cuda_rules_check is not None:
        # Blocks longer than the tensor are no CUDA kernel's blocks: the reference path runs,
        # and the rules check records the three products as refused on CUDA.
        refused = _cuda_rules_check.take()
        assert len(refused) == 3 and all("no CUDA kernel" in r for r in refused), refused


def test_a_crafted_checkpoint_with_a_huge_block_is_refused_or_sane():
    x8 = Float8Tensor.from_hp(torch.randn(4, 64), granularity=(1, 64))
    fields = x8._serial_fields()
    fields["block"] = (1, 2**62)
    from f8tensor.tensor import _rebuild_float8_tensor

    out = _rebuild_float8_tensor(2, fields)  # one partial block per row: the same tensor
    torch.testing.assert_close(out.to_hp(), x8.to_hp(), rtol=0, atol=0)
    fields["block"] = (1, 2**64)
    with pytest.raises(ValueError, match="block"):
        _rebuild_float8_tensor(2, fields)


# ===================================================================== item 16


# Measured SQNR (dB), x @ w8.t() vs the fp32 product / the layer's output and gradients vs
# nn.Linear's, seed 0, e4m3 everywhere: a 0 in a block means "the whole dimension", so
# (1, 0) is rowwise, (0, 0) tensorwise, (0, 32) 32-wide column blocks over all rows,
# (0, 1) one scale per column. One scale per column is the worst: 26.5 (product), 23.6
# (grad_x, floor); every other block >= 30.5 (product), >= 24.7 (layer, floor).
_E8M0_PRODUCT_MIN_DB = {(0, 1): 24.0}  # measured 26.5-27.1
_E8M0_PRODUCT_DEFAULT_MIN_DB = 28.0  # measured 30.5-31.7
_E8M0_LAYER_MIN_DB = 21.0  # measured 23.6-29.6 over output, grad_x, grad_w


@pytest.mark.parametrize("block", [(1, 0), (0, 0), (0, 1), (0, 32)], ids=str)
@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_an_e8m0_granularity_with_a_whole_dimension_block_trains(block, mode, _cuda_rules_check):
    # A 0 block size is "the whole dimension", also with an e8m0 scale: accepted, and the
    # numbers are those of the corresponding FP8 recipe. (0, 32) blocks (32 columns shared by
    # every row) are no CUDA kernel's: they run on the reference path, and the rules check
    # records each of the four products (one direct, the layer's three) as refused on CUDA.
    torch.manual_seed(0)
    gran = BlockGranularity(block, E8M0, mode)
    x = torch.randn(16, 64)
    x8 = Float8Tensor.from_hp(x, granularity=gran)
    w8 = Float8Tensor.from_hp(torch.randn(32, 64), granularity=gran)
    assert x8._scale.dtype == E8M0 and w8._scale.dtype == E8M0
    min_db = _E8M0_PRODUCT_MIN_DB.get(block, _E8M0_PRODUCT_DEFAULT_MIN_DB)
    assert_sqnr(x @ w8.to_hp().t(), x8 @ w8.t(), min_db, f"{block} {mode} e8m0 product")
    cfg = CastConfig(torch.float8_e4m3fn, gran)
    lin = nn.Linear(64, 32)
    layer = Float8Linear.from_float(copy.deepcopy(lin), Float8LinearConfig(input=cfg, weight=cfg, grad_output=cfg))
    x_ref, x_f8 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    g = torch.randn(16, 32)
    y_ref = lin(x_ref)
    y_ref.backward(g)
    y = layer(x_f8)
    y.backward(g)
    assert_sqnr(y_ref, y, _E8M0_LAYER_MIN_DB, f"{block} {mode} output")
    assert_sqnr(x_ref.grad, x_f8.grad, _E8M0_LAYER_MIN_DB, f"{block} {mode} grad_x")
    assert_sqnr(lin.weight.grad, layer.weight.grad, _E8M0_LAYER_MIN_DB, f"{block} {mode} grad_w")
    if _cuda_rules_check is not None:
        refused = _cuda_rules_check.take()
        if block == (0, 32):
            assert len(refused) == 4 and all("no CUDA kernel" in r for r in refused), refused
        else:
            assert refused == [], refused


# ===================================================================== Also: safe globals


class _CraftedFloat8:
    """Pickles as a call of the Float8Tensor class with unchecked fields: a (3,) scale for a
    tensorwise (4, 8) tensor; ``newobj`` through NEWOBJ (``cls.__new__(cls, *args)``),
    otherwise through REDUCE (``cls(*args)``)."""

    def __init__(self, newobj: bool) -> None:
        self.newobj = newobj

    @property
    def __class__(self):  # the pickler checks NEWOBJ's class against the object's
        return Float8Tensor if self.newobj else _CraftedFloat8

    def __reduce_ex__(self, protocol):
        import copyreg

        args = (torch.zeros(4, 8, dtype=torch.float8_e4m3fn), torch.ones(3), torch.float32)
        return (copyreg.__newobj__, (Float8Tensor, *args)) if self.newobj else (Float8Tensor, args)


@pytest.mark.parametrize("opcode", ["NEWOBJ", "REDUCE"])
def test_a_user_allowlisting_float8tensor_does_not_reopen_unchecked_construction(opcode):
    x8 = Float8Tensor.from_hp(torch.randn(4, 8))
    buf = io.BytesIO()
    torch.save(_CraftedFloat8(opcode == "NEWOBJ"), buf)
    with torch.serialization.safe_globals([Float8Tensor]):
        back, _ = _roundtrip(x8, weights_only=True)  # the safe path still works
        torch.testing.assert_close(back.to_hp(), x8.to_hp(), rtol=0, atol=0)
        buf.seek(0)
        with pytest.raises(Exception, match=r"scale|never constructed"):
            torch.load(buf, weights_only=True)


# ===================================================================== Also: recovery after a fault


def test_delayed_scaling_recovers_after_a_fault_when_weights_and_optimizer_are_restored():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    from f8tensor import convert_to_float8_training

    def make():
        m = convert_to_float8_training(copy.deepcopy(base), config=Float8LinearConfig.from_recipe("delayed"))
        return m, torch.optim.SGD(m.parameters(), lr=0.01)

    data = [torch.randn(8, 32) for _ in range(8)]
    clean, opt = make()
    for i, x in enumerate(data):
        opt.zero_grad()
        clean(x).square().mean().backward()
        opt.step()
    faulty, opt2 = make()
    ckpt = None
    for i, x in enumerate(data):
        if i == 4:
            ckpt = (copy.deepcopy(faulty.state_dict()), copy.deepcopy(opt2.state_dict()))
            # A fault: an inf batch, stepped (the weights are poisoned), then a restore.
            opt2.zero_grad()
            faulty(torch.full_like(x, float("inf"))).square().mean().backward()
            opt2.step()
            faulty.load_state_dict(ckpt[0])
            opt2.load_state_dict(ckpt[1])
        opt2.zero_grad()
        faulty(x).square().mean().backward()
        opt2.step()
    for (k, a), b in zip(clean.state_dict().items(), faulty.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=f"{k} differs from the uninterrupted run")
