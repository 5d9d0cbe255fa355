"""Every field of the training config, fuzzed with hypothesis: a valid config trains (forward
and backward of a tiny Float8Linear, finite, with FP8 accuracy), and a config with one bad
field, or two fields that contradict each other, is refused at construction by the class
that owns the field, with an error that names it. Never accepted-then-crashing, never
finite garbage, never a valid config refused.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

from f8tensor import BlockGranularity, CastConfig, Float8Linear, Float8LinearConfig, gemm
from f8tensor.quant.config import DelayedScalingConfig
from tests.helpers import assert_sqnr

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny GEMMs: threads only add waiting

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
E4M3FNUZ, E5M2FNUZ = torch.float8_e4m3fnuz, torch.float8_e5m2fnuz
E8M0 = torch.float8_e8m0fnu
ROLES = ("input", "weight", "grad_output")

valid_granularities = st.one_of(
    st.sampled_from(["tensorwise", "rowwise"]),
    st.builds(
        BlockGranularity,
        st.tuples(st.sampled_from([0, 1, 16, 128, 2**40]), st.sampled_from([0, 1, 16, 32, 128, 2**40])),
        st.sampled_from([torch.float32, E8M0]),
        st.sampled_from(["rceil", "floor"]),
    ),
)

# Operand formats no GEMM refuses: never two e5m2 operands in one product (forward input x
# weight, grad_input grad_output x weight, grad_weight grad_output x input unless that one
# runs in high precision), all from one family (fn here; the fnuz family maps each entry).
_FORMATS = [(E4M3, E4M3, E4M3), (E4M3, E4M3, E5M2), (E4M3, E5M2, E4M3), (E5M2, E4M3, E4M3)]
_FORMATS_GW_HP = [*_FORMATS, (E5M2, E4M3, E5M2)]
_FNUZ = {E4M3: E4M3FNUZ, E5M2: E5M2FNUZ}
BOOL_FIELDS = (
    "weight_grad_in_hp",
    "pad_inner_dim",
    "use_fast_accum",
    "enable_fsdp_float8_all_gather",
    "collect_stats",
    "emulate",
)


@st.composite
def valid_config_fields(draw):
    """The constructor arguments of a valid Float8LinearConfig, every field drawn from its
    legal values (edges included), the operand formats from the legal combinations:
    ``{"input": {...}, "weight": {...}, "grad_output": {...}`` (CastConfig's),
    ``"delayed": {...}`` (DelayedScalingConfig's), ``"linear": {...}`` (the flags)}."""
    optional_flags = {f: st.booleans() for f in BOOL_FIELDS if f != "weight_grad_in_hp"}
    linear = draw(st.fixed_dictionaries({}, optional=optional_flags))
    linear["weight_grad_in_hp"] = draw(st.booleans())
    dtypes = draw(st.sampled_from(_FORMATS_GW_HP if linear["weight_grad_in_hp"] else _FORMATS))
    if draw(st.booleans()):
        dtypes = tuple(_FNUZ[d] for d in dtypes)
    fields = {"linear": linear}
    for role, dtype in zip(ROLES, dtypes):
        if draw(st.booleans()):
            fields[role] = {"dtype": dtype, "scaling": "delayed", "power_of_2_scale": draw(st.booleans())}
        else:
            fields[role] = {
                "dtype": dtype,
                "granularity": draw(valid_granularities),
                "power_of_2_scale": draw(st.booleans()),
                "rounding": draw(st.sampled_from(["nearest", "stochastic"])),
            }
    fields["delayed"] = {
        "history_len": draw(st.sampled_from([1, 2, 16, 1024])),
        "reduction": draw(st.sampled_from(["max", "most_recent"])),
        "margin": draw(st.sampled_from([0, 1, 4])),
    }
    return fields


def build_config(fields) -> Float8LinearConfig:
    casts = {role: CastConfig(**fields[role]) for role in ROLES}
    return Float8LinearConfig(**casts, delayed=DelayedScalingConfig(**fields["delayed"]), **fields["linear"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fields=valid_config_fields(), seed=st.integers(0, 2**16))
def test_every_valid_config_trains(fields, seed):
    config = build_config(fields)
    event("fnuz" if fields["input"]["dtype"] in (E4M3FNUZ, E5M2FNUZ) else "fn")
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
    for what, ref, got in (
        ("y", y_ref, y),
        ("grad_x", xr.grad, xf.grad),
        ("grad_w", lin.weight.grad, layer.weight.grad),
    ):
        assert torch.isfinite(got).all(), f"{what} not finite for {config}"
        assert_sqnr(ref, got, FUZZ_MIN_DB, f"{what} {config}")
    # A valid config whose products no CUDA kernel takes (blocks of another shape on one
    # operand, a tensorwise operand times a block-scaled one) is refused by CUDA at the call,
    # with a message; on CPU it trains on the reference path and the rules check records each
    # such call with that message. Both are answers here: drain the records, each a message.
    check = gemm.rules_check_installed()
    if check is not None:
        for record in check.take():
            assert record.startswith("torch.") and len(record) > 40, record


# Two e5m2 operands in one GEMM are refused; the worst accepted configs (an e5m2 input with
# stochastic rounding times a delayed weight cast with margin 4, at its first step) measured
# 16.1 dB at worst over 1,500 and 5,000 drawn configs (fn and fnuz), and this test draws new
# ones each run: the bar sits 2 dB under.
FUZZ_MIN_DB = 14.0


# Values each field refuses, whatever the other fields hold: wrong types, out-of-range
# numbers, unknown names. (``True`` is an int to Python: the int fields refuse it too.)
_JUNK = [None, "x", 1.5, object()]
BAD_FIELDS = {
    "CastConfig": {
        "dtype": [*_JUNK, torch.float16, torch.int8, E8M0],
        "granularity": [*_JUNK, "columnwise", "axiswise", (-1, 1), (0, -3), (1, 2**70)],
        "scaling": [*_JUNK, "static", True],
        "power_of_2_scale": [*_JUNK, 0, 1, -1],
        "rounding": [*_JUNK, "up", True],
    },
    "DelayedScalingConfig": {
        "history_len": [*_JUNK, 0, -1, 1025, 2**40, True],
        "reduction": [*_JUNK, "mean"],
        "margin": [*_JUNK, -1, 31, True],
    },
    "Float8LinearConfig": {f: [*_JUNK, 0, 1, -1] for f in BOOL_FIELDS},
}
# What the refusal of a bad field says: the field's name (a granularity's error says what it
# got: the allowed names, or a block shape).
_NAMED = {"granularity": r"granularity must be one of|a block shape"}


@st.composite
def config_fields_with_one_defect(draw):
    """``(fields, where, pattern)``: the constructor arguments of a valid config (see
    :func:`valid_config_fields`) with one defect, the part whose constructor must refuse it
    (a role's CastConfig, ``"delayed"``, or ``"linear"``: Float8LinearConfig) and what its
    error must say. A defect is one field's bad value, or valid fields that contradict each
    other (operands of two FP8 families, two e5m2 operands in the forward GEMM, a delayed
    e4m3fn cast with a margin beyond 14)."""
    fields = draw(valid_config_fields())
    kind = draw(st.sampled_from(["field", "field", "field", "family", "e5m2_pair", "margin"]))
    if kind == "field":
        owner = draw(st.sampled_from(sorted(BAD_FIELDS)))
        name = draw(st.sampled_from(sorted(BAD_FIELDS[owner])))
        where = {"CastConfig": draw(st.sampled_from(ROLES)), "DelayedScalingConfig": "delayed"}.get(owner, "linear")
        fields[where][name] = draw(st.sampled_from(BAD_FIELDS[owner][name]))
        return fields, where, _NAMED.get(name, re.escape(name))
    if kind == "family":  # one operand of the other family
        role = draw(st.sampled_from(ROLES))
        swap = {E4M3: E4M3FNUZ, E5M2: E5M2FNUZ, E4M3FNUZ: E4M3, E5M2FNUZ: E5M2}
        fields[role]["dtype"] = swap[fields[role]["dtype"]]
        return fields, "linear", r"one FP8 family, fn \(e4m3fn, e5m2\) or fnuz"
    if kind == "e5m2_pair":
        fnuz = fields["input"]["dtype"] in (E4M3FNUZ, E5M2FNUZ)
        fields["input"]["dtype"] = fields["weight"]["dtype"] = E5M2FNUZ if fnuz else E5M2
        return fields, "linear", r"forward \(input x weight\) GEMM would multiply two e5m2"
    # A delayed e4m3fn input (its margin: at most 14), the other operands in the fn family
    # and the forward GEMM legal.
    fields["input"] = {"dtype": E4M3, "scaling": "delayed"}
    for role in ("weight", "grad_output"):
        fields[role]["dtype"] = {E4M3FNUZ: E4M3, E5M2FNUZ: E5M2}.get(fields[role]["dtype"], fields[role]["dtype"])
    fields["weight"]["dtype"] = E4M3
    fields["delayed"]["margin"] = draw(st.integers(15, 30))
    return fields, "linear", r"margin=\d+ would scale the input's amax below the smallest normal"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=config_fields_with_one_defect())
def test_a_defect_is_refused_by_its_owner_naming_it(case):
    """The constructor that owns the defect refuses it, with an error that names the field;
    every other part of the config (valid arguments) builds."""
    fields, where, pattern = case
    event(f"refused by {where}")
    casts = {role: CastConfig(**fields[role]) for role in ROLES if role != where}
    if where in ROLES:
        with pytest.raises((TypeError, ValueError), match=pattern):
            CastConfig(**fields[where])
        return
    if where == "delayed":
        with pytest.raises((TypeError, ValueError), match=pattern):
            DelayedScalingConfig(**fields["delayed"])
        return
    delayed = DelayedScalingConfig(**fields["delayed"])
    with pytest.raises((TypeError, ValueError), match=pattern):
        Float8LinearConfig(**casts, delayed=delayed, **fields["linear"])
