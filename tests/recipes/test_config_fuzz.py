"""Every field of the training config, fuzzed with hypothesis: a config is either refused
at construction with an error that names the field, or it trains (forward and backward of
a tiny Float8Linear, finite, with FP8 accuracy). Never accepted-then-crashing, never
finite garbage.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

from f8tensor import BlockGranularity, CastConfig, Float8Linear, Float8LinearConfig, gemm
from f8tensor.config import DelayedScalingConfig
from tests.helpers import assert_sqnr

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny GEMMs: threads only add waiting

F8 = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
E8M0 = torch.float8_e8m0fnu
# Odd values next to the valid ones: wrong types, out-of-range numbers, wrong dtypes.
JUNK = st.sampled_from([None, "x", 1.5, -1, True, torch.float16, torch.int8, object()])


def sometimes_junk(valid):
    """Mostly ``valid`` (which holds edge values too), one draw in eight from JUNK."""
    return st.one_of(*[valid] * 7, JUNK)


blocks = st.tuples(
    st.sampled_from([0, 1, 2, 16, 32, 128, 2**40, -1]), st.sampled_from([0, 1, 16, 32, 64, 128, 2**40, -3])
)
granularities = st.one_of(
    st.sampled_from(["tensorwise", "rowwise", "columnwise", "axiswise"]),
    st.builds(
        BlockGranularity,
        blocks,
        st.sampled_from([torch.float32, E8M0, torch.float16]),
        st.sampled_from(["rceil", "floor", "ceil"]),
    ),
    blocks,
    JUNK,
)
valid_granularities = st.one_of(
    st.sampled_from(["tensorwise", "rowwise"]),
    st.builds(
        BlockGranularity,
        st.tuples(st.sampled_from([0, 1, 16, 128, 2**40]), st.sampled_from([0, 1, 16, 32, 128, 2**40])),
        st.sampled_from([torch.float32, E8M0]),
        st.sampled_from(["rceil", "floor"]),
    ),
)
valid_cast_kwargs = st.one_of(
    st.fixed_dictionaries(
        {"granularity": valid_granularities},
        optional={
            "dtype": st.sampled_from(F8),
            "power_of_2_scale": st.booleans(),
            "rounding": st.sampled_from(["nearest", "stochastic"]),
        },
    ),
    st.fixed_dictionaries(
        {"scaling": st.just("delayed")},
        optional={"dtype": st.sampled_from(F8), "power_of_2_scale": st.booleans()},
    ),
)
wild_cast_kwargs = st.fixed_dictionaries(
    {},
    optional={
        "dtype": sometimes_junk(st.sampled_from(F8)),
        "granularity": granularities,
        "scaling": sometimes_junk(st.sampled_from(["dynamic", "delayed", "static"])),
        "power_of_2_scale": sometimes_junk(st.booleans()),
        "rounding": sometimes_junk(st.sampled_from(["nearest", "stochastic", "up"])),
    },
)
# Mostly configs that should train (every field's edges included), some wild ones.
cast_kwargs = st.one_of(*[valid_cast_kwargs] * 5, wild_cast_kwargs)
delayed_kwargs = st.fixed_dictionaries(
    {},
    optional={
        "history_len": sometimes_junk(st.sampled_from([1, 2, 16, 1024, 1025, 0, -1])),
        "reduction": sometimes_junk(st.sampled_from(["max", "most_recent", "mean"])),
        "margin": sometimes_junk(st.sampled_from([0, 1, 4, 14, 40, -1])),
    },
)
BOOL_FIELDS = ("weight_grad_in_hp", "pad_inner_dim", "use_fast_accum", "enable_fsdp_float8_all_gather", "collect_stats", "emulate")
linear_bools = st.fixed_dictionaries({}, optional={f: sometimes_junk(st.booleans()) for f in BOOL_FIELDS})

REFUSALS = (TypeError, ValueError)


def _build(kind, **kwargs):
    """The config, or the error it was refused with (which must name a field or value)."""
    try:
        return kind(**kwargs), None
    except REFUSALS as e:
        assert str(e), f"{kind.__name__}({kwargs}) refused without a message"
        event(f"refused by {kind.__name__}")
        return None, e


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# Operand formats no GEMM refuses: never two e5m2 operands in one product (forward input x
# weight, grad_input grad_output x weight, grad_weight grad_output x input unless that one
# runs in high precision). The fn family: CPU's _scaled_mm has no fnuz kernels.
_FORMATS = [(E4M3, E4M3, E4M3), (E4M3, E4M3, E5M2), (E4M3, E5M2, E4M3), (E5M2, E4M3, E4M3)]
_FORMATS_GW_HP = [*_FORMATS, (E5M2, E4M3, E5M2)]
_VALID_BOOL_FIELDS = ("pad_inner_dim", "use_fast_accum", "enable_fsdp_float8_all_gather", "collect_stats", "emulate")


@st.composite
def valid_linear_configs(draw):
    """A Float8LinearConfig that is valid by construction: every field drawn from its legal
    values (edges included), the operand formats from the legal combinations."""
    flags = draw(st.fixed_dictionaries({}, optional={f: st.booleans() for f in _VALID_BOOL_FIELDS}))
    gw_hp = draw(st.booleans())
    dtypes = draw(st.sampled_from(_FORMATS_GW_HP if gw_hp else _FORMATS))
    casts = []
    for dtype in dtypes:
        if draw(st.booleans()):
            casts.append(CastConfig(dtype, scaling="delayed", power_of_2_scale=draw(st.booleans())))
        else:
            casts.append(
                CastConfig(
                    dtype,
                    draw(valid_granularities),
                    power_of_2_scale=draw(st.booleans()),
                    rounding=draw(st.sampled_from(["nearest", "stochastic"])),
                )
            )
    delayed = DelayedScalingConfig(
        history_len=draw(st.sampled_from([1, 2, 16, 1024])),
        reduction=draw(st.sampled_from(["max", "most_recent"])),
        margin=draw(st.sampled_from([0, 1, 4])),
    )
    return Float8LinearConfig(
        input=casts[0], weight=casts[1], grad_output=casts[2], delayed=delayed, weight_grad_in_hp=gw_hp, **flags
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=valid_linear_configs(), seed=st.integers(0, 2**16))
def test_every_valid_config_trains(config, seed):
    torch.manual_seed(seed)
    lin = nn.Linear(64, 32)
    layer = Float8Linear.from_float(copy.deepcopy(lin), config)
    _check_trains(lin, layer, config)


def _check_trains(lin, layer, config):
    x = torch.randn(16, 64)
    xr, xf = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_ref = lin(xr)
    y = layer(xf)
    g = torch.randn_like(y_ref)
    y_ref.backward(g)
    y.backward(g)
    for what, ref, got in (("y", y_ref, y), ("grad_x", xr.grad, xf.grad), ("grad_w", lin.weight.grad, layer.weight.grad)):
        assert torch.isfinite(got).all(), f"{what} not finite for {config}"
        # Two e5m2 operands in one GEMM are refused; the worst accepted pair (e5m2 x e4m3,
        # power-of-two scales, a block as large as the tensor) stays above 14 dB here.
        assert_sqnr(ref, got, FUZZ_MIN_DB, f"{what} {config}")
    # A valid config whose products no CUDA kernel takes (blocks of another shape on one
    # operand, a tensorwise operand times a block-scaled one) is refused by CUDA at the call,
    # with a message; on CPU it trains on the reference path and the rules check records each
    # such call with that message. Both are answers here: drain the records, each a message.
    check = gemm.rules_check_installed()
    if check is not None:
        for record in check.take():
            assert record.startswith("torch.") and len(record) > 40, record


FUZZ_MIN_DB = 14.0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    inp=cast_kwargs,
    wgt=cast_kwargs,
    grad=cast_kwargs,
    delayed=delayed_kwargs,
    flags=linear_bools,
    seed=st.integers(0, 2**16),
)
def test_every_config_is_refused_or_trains(inp, wgt, grad, delayed, flags, seed):
    casts = []
    for kwargs in (inp, wgt, grad):
        cfg, err = _build(CastConfig, **kwargs)
        if err is not None:
            return
        casts.append(cfg)
    dcfg, err = _build(DelayedScalingConfig, **delayed)
    if err is not None:
        return
    config, err = _build(Float8LinearConfig, input=casts[0], weight=casts[1], grad_output=casts[2], delayed=dcfg, **flags)
    if err is not None:
        return
    torch.manual_seed(seed)
    lin = nn.Linear(64, 32)
    try:
        layer = Float8Linear.from_float(copy.deepcopy(lin), config)
    except REFUSALS as e:  # e.g. dims a recipe cannot take: refused at the swap, with a message
        assert str(e)
        return
    event("trained")
    _check_trains(lin, layer, config)
