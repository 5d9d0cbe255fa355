"""Crafted checkpoints: ``torch.load(weights_only=True)`` validates every Float8Tensor field.

Today's format (version 2: plain fields with the per-dim block, rebuilt by
``f8tensor.tensor._rebuild_float8_tensor``) loads; each test crafts one bad field and expects a
clear error naming it. The pre-release formats 0 (a wrapper whose attributes ``__setstate__``
restored) and 1 (``axiswise_dim`` and a 3-field GemmConfig) are refused with the git tag that
still reads them.
"""

from __future__ import annotations

import collections
import copyreg
import io
import pathlib

import pytest
import torch

from f8tensor import BLOCK_1x128, BlockGranularity, Float8Tensor, MX_1x32
from f8tensor.quant.formats import E8M0
from f8tensor.tensor import _SERIAL_VERSION, _rebuild_float8_tensor
from f8tensor.tensor.validation import LEGACY_TAG

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "data" / "float8_tensor_v0.pt"


def _load(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


class _Crafted:
    """Pickles as whatever ``reduce`` says: a hand-written checkpoint entry."""

    def __init__(self, reduce):
        self.reduce = reduce

    def __reduce_ex__(self, protocol):
        return self.reduce


def _fields(version=_SERIAL_VERSION, source=None, **changes):
    granularity = changes.pop("granularity", "tensorwise")
    x8 = Float8Tensor.from_hp(torch.randn(4, 16), granularity=granularity) if source is None else source
    fields = x8._serial_fields()
    if version == 1:  # what the (retired) version-1 writer stored
        fields["axiswise_dim"] = x8._axiswise_dim
        del fields["block"], fields["scale_dtype"]
        fields["gemm"] = fields["gemm"][:3]
    fields.update(changes)
    return fields


def _new_format(version=_SERIAL_VERSION, source=None, **changes):
    return _Crafted((_rebuild_float8_tensor, (version, _fields(version, source, **changes))))


# ----------------------------------------------------------------------------- valid forms


def test_pre_release_checkpoints_are_refused_naming_the_tag_that_reads_them():
    # tests/data/float8_tensor_v0.pt was written by f8tensor before __reduce_ex__ existed
    # (format 0); version 1 payloads by the writer before per-dim blocks.
    tag = LEGACY_TAG
    with pytest.raises(Exception, match=rf"pre-release format .* git tag '{tag}'"):
        torch.load(FIXTURE, weights_only=True)
    with pytest.raises(Exception, match=rf"pre-release format .* git tag '{tag}'"):
        _load(_new_format(version=1))
    with pytest.raises(ValueError, match=rf"git tag '{tag}'"):
        torch.load(FIXTURE, weights_only=False)


@pytest.mark.parametrize("form, granularity", [("new", "tensorwise"), ("new", "rowwise")])
def test_hand_written_valid_forms_load(form, granularity):
    # Each valid form loads back the tensor that was written: the same FP8 bytes, scale bits,
    # metadata, and so the same high-precision values.
    x8 = Float8Tensor.from_hp(torch.randn(4, 16) * torch.logspace(-2, 2, 4).unsqueeze(1), granularity=granularity)
    crafted = {
        "new": lambda: _new_format(source=x8),
    }[form]()
    got = _load(crafted)
    assert type(got) is Float8Tensor
    assert (got.shape, got.dtype, got.float8_dtype) == (x8.shape, x8.dtype, x8.float8_dtype)
    assert torch.equal(got._data.view(torch.uint8), x8._data.view(torch.uint8))
    assert got._scale.shape == x8._scale.shape and torch.equal(
        got._scale.view(torch.int32), x8._scale.view(torch.int32)
    )
    assert (got._orig_dtype, got._block, got._gemm) == (x8._orig_dtype, x8._block, x8._gemm)
    assert torch.equal(got.to_hp(), x8.to_hp())


def test_a_nan_scale_loads_and_reads_nan():
    # What a cast of a tensor holding inf produces: legitimate, and never finite garbage.
    x8 = _load(_new_format(scale=torch.tensor(float("nan"))))
    assert torch.isnan(x8.to_hp()).all()


# ----------------------------------------------------------------------------- one crafted field each

# One field each, in today's format.
NEW = [
    (
        "gemm_out_dtype_int64",
        {"gemm": (torch.int64, False, False, False)},
        ValueError,
        r"GemmConfig.out_dtype must be None or one of",
    ),
    (
        "gemm_out_dtype_string",
        {"gemm": ("float32", False, False, False)},
        TypeError,
        r"GemmConfig.out_dtype must be None or a torch.dtype",
    ),
    (
        "gemm_flag_not_bool",
        {"gemm": (None, "yes", False, False)},
        TypeError,
        r"GemmConfig.use_fast_accum must be a bool",
    ),
    ("gemm_wrong_arity", {"gemm": (None, False)}, ValueError, r"'gemm' must be a tuple"),
    ("scale_negative", {"scale": torch.tensor(-1.0)}, ValueError, r"Float8Tensor scale must hold positive finite"),
    ("scale_inf", {"scale": torch.tensor(float("inf"))}, ValueError, r"Float8Tensor scale must hold positive finite"),
    ("scale_zero", {"scale": torch.tensor(0.0)}, ValueError, r"Float8Tensor scale must hold positive finite"),
    ("scale_subnormal", {"scale": torch.tensor(1e-40)}, ValueError, r"Float8Tensor scale must hold positive finite"),
    (
        "scale_int",
        {"scale": torch.tensor(3)},
        TypeError,
        r"a torch.float32 scale is stored as a torch.float32 tensor; got torch.int64",
    ),
    (
        "scale_float64",
        {"scale": torch.tensor(3.0, dtype=torch.float64)},
        TypeError,
        r"a torch.float32 scale is stored as a torch.float32 tensor; got torch.float64",
    ),
    ("scale_not_a_tensor", {"scale": 3.0}, TypeError, r"scale must be a plain torch.Tensor"),
    (
        "scale_shape_tensorwise",
        {"scale": torch.ones(4, 1)},
        ValueError,
        r"must have shape \(1, 1\) or \(\) \(tensorwise\)",
    ),
    (
        "scale_shape_rowwise",
        {"granularity": "rowwise", "scale": torch.ones(2, 1)},
        ValueError,
        r"must have shape \(4, 1\)",
    ),
    (
        "scale_zero_stride",
        {"granularity": "rowwise", "scale": torch.ones(1, 1).expand(4, 1)},
        ValueError,
        r"zero or overlapping strides",
    ),
    (
        "orig_dtype_int64",
        {"orig_dtype": torch.int64},
        TypeError,
        r"orig_dtype must have a high-precision floating dtype",
    ),
    (
        "orig_dtype_string",
        {"orig_dtype": "float32"},
        TypeError,
        r"orig_dtype must have a high-precision floating dtype",
    ),
    ("data_not_uint8", {"data": torch.zeros(4, 16)}, TypeError, r"'data' must be a uint8 tensor"),
    ("float8_dtype_int8", {"float8_dtype": torch.int8}, TypeError, r"'float8_dtype' must be one of"),
    (
        "data_zero_stride",
        {"data": torch.zeros(1, dtype=torch.uint8).as_strided((2**17, 2**17), (0, 0))},
        ValueError,
        r"must not repeat elements through zero or overlapping strides",
    ),
    ("extra_field", {"to_hp": collections.OrderedDict}, ValueError, r"fields must be exactly"),
    ("requires_grad_not_bool", {"requires_grad": "yes"}, TypeError, r"'requires_grad' must be a bool"),
    ("is_param_not_bool", {"is_param": 1}, TypeError, r"'is_param' must be a bool"),
]


@pytest.mark.parametrize("changes, error, message", [c[1:] for c in NEW], ids=[c[0] for c in NEW])
def test_crafted_field_is_refused(changes, error, message):
    entry = _new_format(**changes)
    # weights_only loading reports the error as an UnpicklingError carrying our message;
    # the rebuild itself raises the precise type.
    with pytest.raises(Exception, match=message):
        _load(entry)
    fields = _fields(**changes)
    with pytest.raises(error, match=message):
        _rebuild_float8_tensor(_SERIAL_VERSION, fields)


def _e8m0_codes(*shape):
    """An e8m0 scale as a version-2 checkpoint stores it: uint8 codes (127: 2**0)."""
    return torch.full(shape, 127, dtype=torch.uint8)


# Version 2 payloads: the per-dim block against the data and the scale.
NEW_V2 = [
    ("block_list", {"block": [0, 0]}, TypeError, r"block must be a tuple of ints"),
    ("block_bool", {"block": (True, 0)}, TypeError, r"block must be a tuple of ints"),
    ("block_float", {"block": (1.0, 0)}, TypeError, r"block must be a tuple of ints"),
    (
        "block_negative",
        {"granularity": "rowwise", "block": (-1, 0)},
        ValueError,
        r"block entries must be in \[0, 2\*\*63\)",
    ),
    ("block_wrong_ndim", {"block": (0,)}, ValueError, r"one entry per dim of data of shape \(4, 16\)"),
    ("block_missing", {"block": None}, TypeError, r"block must be a tuple of ints"),
    (
        "block_scale_shape_mismatch",
        {"granularity": BLOCK_1x128, "block": (1, 8)},
        ValueError,
        r"a block \(1, 8\) scale for data of shape \(4, 16\) must have shape \(4, 2\); got \(4, 1\)",
    ),
    ("rowwise_scale_for_a_block", {"granularity": "rowwise", "block": (2, 8)}, ValueError, r"must have shape \(2, 2\)"),
    (
        "tensorwise_scale_with_a_block",
        {"block": (1, 0)},
        ValueError,
        r"a 0-dim \(tensorwise\) scale needs an all-0 block",
    ),
    (
        "e8m0_tensorwise_scale",
        {"scale": _e8m0_codes(), "scale_dtype": E8M0},
        TypeError,
        r"a tensorwise Float8Tensor has a float32 scale",
    ),
    (
        "e8m0_scale_wrong_shape",
        {"granularity": MX_1x32, "scale": _e8m0_codes(4, 2)},
        ValueError,
        r"must have shape \(4, 1\)",
    ),
    (
        "e8m0_scale_not_as_codes",
        {"granularity": MX_1x32, "scale": torch.ones(4, 1).to(E8M0)},
        TypeError,
        r"a torch.float8_e8m0fnu scale is stored as a torch.uint8 tensor",
    ),
    (
        "fp32_scale_dtype_with_codes",
        {"granularity": MX_1x32, "scale_dtype": torch.float32},
        TypeError,
        r"a torch.float32 scale is stored as a torch.float32 tensor; got torch.uint8",
    ),
    ("scale_dtype_float16", {"scale_dtype": torch.float16}, TypeError, r"'scale_dtype' must be one of"),
    ("scale_dtype_string", {"scale_dtype": "float32"}, TypeError, r"'scale_dtype' must be one of"),
    (
        "scale_float16",
        {"granularity": BLOCK_1x128, "scale": torch.ones(4, 1, dtype=torch.float16), "scale_dtype": torch.float16},
        TypeError,
        r"'scale_dtype' must be one of",
    ),
    (
        "block_scale_negative",
        {"granularity": BLOCK_1x128, "scale": -torch.ones(4, 1)},
        ValueError,
        r"Float8Tensor scale must hold positive finite",
    ),
    ("gemm_v1_arity", {"gemm": (None, False, False)}, ValueError, r"'gemm' must be a tuple"),
    ("gemm_emulate_not_bool", {"gemm": (None, False, False, 1)}, TypeError, r"GemmConfig.emulate must be a bool"),
    ("v1_axiswise_dim_field", {"axiswise_dim": None}, ValueError, r"fields must be exactly"),
]


@pytest.mark.parametrize("changes, error, message", [c[1:] for c in NEW_V2], ids=[c[0] for c in NEW_V2])
def test_crafted_block_field_is_refused(changes, error, message):
    with pytest.raises(Exception, match=message):
        _load(_new_format(**changes))
    with pytest.raises(error, match=message):
        _rebuild_float8_tensor(_SERIAL_VERSION, _fields(**changes))


def test_e8m0_scale_on_a_non_mx_block_loads():
    # BlockGranularity pairs e8m0 with any block, so a checkpoint may too.
    want = Float8Tensor.from_hp(torch.randn(4, 200), granularity=BlockGranularity((1, 128), E8M0))
    got = _load(want)
    assert got._scale.dtype == E8M0 and got._block == (1, 128)
    assert torch.equal(got.to_hp(), want.to_hp())


def test_a_nan_e8m0_scale_loads_and_reads_nan():
    # 0xFF, e8m0's only non-finite code: its block reads back NaN, never finite garbage.
    x8 = Float8Tensor.from_hp(torch.randn(4, 64), granularity=MX_1x32)
    scale = x8._scale.view(torch.uint8).clone()
    scale[1, 0] = 0xFF
    got = _load(_Crafted((_rebuild_float8_tensor, (_SERIAL_VERSION, {**x8._serial_fields(), "scale": scale}))))
    hp = got.to_hp()
    assert torch.isnan(hp[1, :32]).all()
    assert torch.isfinite(hp[:, 32:]).all() and torch.isfinite(hp[0]).all()


def test_unknown_format_version_is_refused():
    for version in (0, 3, "2", 2.0):
        with pytest.raises(Exception, match=r"Float8Tensor checkpoint format .* is not supported"):
            _load(_Crafted((_rebuild_float8_tensor, (version, _fields()))))


def test_direct_construction_from_a_checkpoint_is_refused():
    # pickle's NEWOBJ would call Float8Tensor.__new__ with any arguments, skipping the checks.
    x8 = Float8Tensor.from_hp(torch.randn(4, 16))

    class NewObj(_Crafted):
        __class__ = property(lambda self: Float8Tensor)  # what the pickler checks for NEWOBJ

    entry = NewObj((copyreg.__newobj__, (Float8Tensor, torch.zeros(4, 16), x8._scale, torch.float32)))
    with pytest.raises(Exception, match=r"a Float8Tensor is loaded through its validating rebuild"):
        _load(entry)


def test_a_wrapper_whose_fields_were_never_restored_fails_clearly():
    args = (Float8Tensor, torch.float32, (4, 16), (16, 1), 0, torch.strided, torch.device("cpu"), False)
    hollow = _load(_Crafted((torch._utils._rebuild_wrapper_subclass, args)))
    with pytest.raises(RuntimeError, match=r"used before its fields were restored"):
        hollow + 1
