"""The Float8Tensor op table: matrix products (handed to ``gemm.py``), layout ops on data and scale.

Every handler has the signature ``handler(func, types, args, kwargs)`` and is registered
with ``Float8Tensor.implements``. View-like handlers rebuild through
``Float8Tensor._replace`` and return through ``return_and_correct_aliasing``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing

from f8tensor.formats import FLOAT8_DTYPES, check_hp_dtype
from f8tensor.gemm import _matmul, _requantize, float8_mm
from f8tensor.tensor import Float8Tensor, cast_to_float8, dequantize

__all__ = ["float8_mm"]

aten = torch.ops.aten
implements = Float8Tensor.implements


def _is_f8(x: object) -> bool:
    return isinstance(x, Float8Tensor)


# ===================================================================== matrix products
# The products themselves (routes, CUDA rules, padding) live in gemm.py; the handlers
# here only unpack aten's arguments.


@implements([aten.mm.default])
def _mm(func, types, args, kwargs):
    a, b = args
    return _matmul(a, b)


@implements([aten.addmm.default])
def _addmm(func, types, args, kwargs):
    bias, a, b = args
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    if _is_f8(bias):
        raise NotImplementedError("addmm with a Float8Tensor bias/input is not supported; pass it in high precision")
    if beta == 1 and alpha == 1:
        return _matmul(a, b, bias=bias)
    out = _matmul(a, b)
    if alpha != 1:
        out = out * alpha
    # torch semantics: with beta == 0 the input is ignored entirely (NaN in it included).
    return out if beta == 0 else out + beta * bias.to(out.dtype)


@implements([aten.bmm.default])
def _bmm(func, types, args, kwargs):
    a, b = args
    batch = a.shape[0]
    # x @ w.t() with a non-contiguous 3D x reaches here as bmm(x, w.t().expand(B, K, N)):
    # the same matrix for every batch entry, so it folds into one 2D product.
    if b.stride(0) == 0:
        out = _matmul(_flatten_batch(a), _batch_item(b, 0))
        return out.view(batch, a.shape[1], b.shape[2])
    return torch.stack([_matmul(_batch_item(a, i), _batch_item(b, i)) for i in range(batch)])


def _flatten_batch(x: torch.Tensor) -> torch.Tensor:
    """(B, M, K) -> (B*M, K), copying only when the layout demands it."""
    if not _is_f8(x):
        return x.reshape(-1, x.shape[-1])
    if x._axiswise_dim not in (None, 2):
        x = _requantize(x, 2)
    data = x._data.reshape(-1, x.shape[-1])
    scale = x._scale if x._axiswise_dim is None else x._scale.reshape(-1, 1)
    return x._replace(data=data, scale=scale, axiswise_dim=None if x._axiswise_dim is None else 1)


def _batch_item(x: torch.Tensor, i: int) -> torch.Tensor:
    if not _is_f8(x):
        return x[i]
    scale = x._scale if x._axiswise_dim is None else x._scale[i if x._scale.shape[0] > 1 else 0]
    axis = None if x._axiswise_dim is None else x._axiswise_dim - 1
    if axis == -1:  # scale was reduced over the batch dim: re-derive along K instead
        return _requantize(x._replace(data=x._data[i], scale=x._scale[0]), 1)
    return x._replace(data=x._data[i], scale=scale, axiswise_dim=axis)


# ===================================================================== layout ops


def _view_result(func, args, kwargs, out):
    return return_and_correct_aliasing(func, args, kwargs, out)


def _swap_axis(axis: int | None, d0: int, d1: int) -> int | None:
    if axis == d0:
        return d1
    if axis == d1:
        return d0
    return axis


@implements([aten.t.default])
def _t(func, types, args, kwargs):
    (x,) = args
    out = x._replace(
        data=x._data.t(),
        scale=x._scale if x._scale.dim() < 2 else x._scale.t(),
        axiswise_dim=_swap_axis(x._axiswise_dim, 0, 1) if x.dim() == 2 else x._axiswise_dim,
    )
    return _view_result(func, args, kwargs, out)


@implements([aten.transpose.int])
def _transpose(func, types, args, kwargs):
    x, d0, d1 = args
    d0, d1 = d0 % max(x.dim(), 1), d1 % max(x.dim(), 1)
    scale = x._scale if x._axiswise_dim is None else x._scale.transpose(d0, d1)
    out = x._replace(data=x._data.transpose(d0, d1), scale=scale, axiswise_dim=_swap_axis(x._axiswise_dim, d0, d1))
    return _view_result(func, args, kwargs, out)


@implements([aten.permute.default])
def _permute(func, types, args, kwargs):
    x, dims = args
    dims = [d % x.dim() for d in dims]
    scale = x._scale if x._axiswise_dim is None else x._scale.permute(dims)
    axis = None if x._axiswise_dim is None else dims.index(x._axiswise_dim)
    out = x._replace(data=x._data.permute(dims), scale=scale, axiswise_dim=axis)
    return _view_result(func, args, kwargs, out)


def _reshaped_scale(x: Float8Tensor, new_shape: torch.Size) -> tuple[torch.Tensor, int | None]:
    """The scale for ``x`` reshaped to ``new_shape``, when one exists."""
    if x._axiswise_dim is None:
        return x._scale, None
    if tuple(new_shape) == tuple(x.shape):
        return x._scale, x._axiswise_dim
    last = x.dim() - 1
    if x._axiswise_dim == last and len(new_shape) >= 1 and new_shape[-1] == x.shape[-1]:
        # Rows keep their length, so each row keeps its own scale: (B, S, 1) <-> (B*S, 1).
        return x._scale.reshape(*new_shape[:-1], 1), len(new_shape) - 1
    raise NotImplementedError(
        f"cannot reshape a Float8Tensor of shape {tuple(x.shape)} scaled along dim {x._axiswise_dim} "
        f"to {tuple(new_shape)}: elements with different scales would share a row. Only reshapes "
        f"that keep the last dimension are supported for rowwise scales; call .to_hp() first."
    )


@implements([aten.view.default, aten._unsafe_view.default, aten.reshape.default])
def _view(func, types, args, kwargs):
    x, size = args[0], args[1]
    data = func(x._data, size)
    scale, axis = _reshaped_scale(x, data.shape)
    out = x._replace(data=data, scale=scale, axiswise_dim=axis)
    return _view_result(func, args, kwargs, out)


@implements([aten.expand.default])
def _expand(func, types, args, kwargs):
    x, size = args[0], args[1]
    data = x._data.expand(size)
    if x._axiswise_dim is None:
        out = x._replace(data=data)
    else:
        axis = x._axiswise_dim + (data.dim() - x.dim())
        scale_shape = list(data.shape)
        scale_shape[axis] = 1
        out = x._replace(data=data, scale=x._scale.expand(scale_shape), axiswise_dim=axis)
    return _view_result(func, args, kwargs, out)


def _as_permutation(
    x: Float8Tensor, size: Sequence[int], stride: Sequence[int], offset: int | None
) -> list[int] | None:
    """``perm`` with ``x._data.permute(perm)`` laid out as (size, stride, offset), or None."""
    if len(size) != x.dim() or (offset is not None and offset != x.storage_offset()):
        return None
    old = [(x.shape[j], x.stride(j)) for j in range(x.dim())]
    perm: list[int] = []
    for i, layout in enumerate(zip(size, stride)):
        # Prefer the same dim, so dims that look alike (size 1) keep their order.
        candidates = [i] + [j for j in range(x.dim()) if j != i]
        match = next((j for j in candidates if j not in perm and old[j] == layout), None)
        if match is None:
            return None
        perm.append(match)
    return perm


@implements([aten.as_strided.default])
def _as_strided(func, types, args, kwargs):
    """Re-striding the FP8 bytes in place.

    torch.compile calls it to rebuild a graph output that aliases a graph input (a compiled
    function returning ``w8.t()`` or ``w8.detach()``). Tensorwise: any layout, the one scale
    applies to every byte. Axiswise: only layouts that permute the tensor's own dims at the
    same storage offset (detach, t, transpose, permute); the scale is permuted alongside.
    """
    x, size, stride = args[0], args[1], args[2]
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
    data = func(x._data, size, stride, offset)
    if x._axiswise_dim is None:
        return _view_result(func, args, kwargs, x._replace(data=data))
    perm = _as_permutation(x, size, stride, offset)
    if perm is None:
        raise NotImplementedError(
            f"as_strided of a Float8Tensor scaled along dim {x._axiswise_dim} is only supported "
            f"as a permutation of its dims; got size={tuple(size)}, stride={tuple(stride)}, "
            f"storage_offset={offset} for shape {tuple(x.shape)}, stride {x.stride()}. Call .to_hp() first."
        )
    out = x._replace(data=data, scale=x._scale.permute(perm), axiswise_dim=perm.index(x._axiswise_dim))
    return _view_result(func, args, kwargs, out)


@implements([aten.detach.default, aten.alias.default])
def _detach(func, types, args, kwargs):
    (x,) = args
    return _view_result(func, args, kwargs, x._replace(data=func(x._data), scale=func(x._scale)))


@implements([aten.clone.default])
def _clone(func, types, args, kwargs):
    (x,) = args
    return x._replace(data=func(x._data, **kwargs), scale=x._scale.clone())


def _scale_varies_along(x: Float8Tensor, dim: int) -> bool:
    """Whether ``x`` has one scale per index along ``dim``.

    Decided from the metadata, not from ``_scale.shape[dim] == 1``: a one-row piece of a
    rowwise tensor also has a size-1 scale along ``dim``, yet its scale is its own.
    """
    return x._axiswise_dim is not None and dim != x._axiswise_dim


def _split_scale(x: Float8Tensor, dim: int, pieces: Sequence[torch.Tensor], split) -> list[torch.Tensor]:
    """Scales for pieces of ``x`` cut along ``dim``: shared when constant along ``dim``."""
    if not _scale_varies_along(x, dim):
        return [x._scale] * len(pieces)
    return list(split(x._scale))


@implements([aten.split.Tensor, aten.split_with_sizes.default])
def _split(func, types, args, kwargs):
    x, sizes = args[0], args[1]
    dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % x.dim()
    datas = func(x._data, sizes, dim)
    scales = _split_scale(x, dim, datas, lambda s: func(s, sizes, dim))
    out = [x._replace(data=d, scale=s) for d, s in zip(datas, scales)]
    return _view_result(func, args, kwargs, out)


@implements([aten.slice.Tensor])
def _slice(func, types, args, kwargs):
    x = args[0]
    rest = list(args[1:])
    dim = (rest[0] if rest else kwargs.get("dim", 0)) % x.dim()
    data = func(x._data, *rest, **kwargs)
    (scale,) = _split_scale(x, dim, [data], lambda s: [func(s, *rest, **kwargs)])
    return _view_result(func, args, kwargs, x._replace(data=data, scale=scale))


@implements([aten.cat.default])
def _cat(func, types, args, kwargs):
    tensors = list(args[0])
    first = tensors[0]
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % first.dim()
    for t in tensors:
        if not _is_f8(t):
            raise TypeError("cat of Float8Tensors with plain tensors is not supported; call .to_hp() first")
        same_meta = (t._data.dtype, t._orig_dtype, t._axiswise_dim, t._gemm) == (
            first._data.dtype,
            first._orig_dtype,
            first._axiswise_dim,
            first._gemm,
        )
        if not same_meta:
            raise ValueError("cat needs Float8Tensors of one float8 dtype, original dtype, granularity and GemmConfig")
    data = torch.cat([t._data for t in tensors], dim)
    if _scale_varies_along(first, dim):
        return first._replace(data=data, scale=torch.cat([t._scale for t in tensors], dim))
    # The scale is constant along `dim`: every piece must carry the same one.
    for t in tensors[1:]:
        if t._scale is not first._scale and not torch.equal(t._scale, first._scale):
            raise ValueError(
                "cat of Float8Tensors with different scales along the cat dimension cannot be "
                "represented without re-quantizing; call .to_hp() and cast again"
            )
    return first._replace(data=data)


@implements([aten._to_copy.default])
def _to_copy(func, types, args, kwargs):
    (x,) = args
    kwargs = dict(kwargs)
    dtype = kwargs.pop("dtype", None)
    if dtype is not None and dtype != x._orig_dtype:
        if dtype in FLOAT8_DTYPES:
            raise TypeError(
                f"Float8Tensor.to({dtype}) is ambiguous: to change the FP8 format, call "
                f".to_hp() and Float8Tensor.from_hp(..., {dtype})"
            )
        # Changing the outer dtype changes what the data stands for (model.to(bf16)),
        # not the FP8 bytes.
        check_hp_dtype(dtype, "Float8Tensor.to dtype")
    kwargs.pop("memory_format", None)
    data = func(x._data, **kwargs)
    scale = func(x._scale, **kwargs)
    return x._replace(data=data, scale=scale, orig_dtype=dtype or x._orig_dtype)


@implements([aten.copy_.default])
def _copy_(func, types, args, kwargs):
    dst, src = args[0], args[1]
    if dst.shape != src.shape:
        raise RuntimeError(f"copy_ between shapes {tuple(src.shape)} and {tuple(dst.shape)}")
    if not _is_f8(dst):
        dst.copy_(dequantize(src, dst.dtype))
        return dst
    if _is_f8(src):
        if (src._data.dtype, src._axiswise_dim) != (dst._data.dtype, dst._axiswise_dim):
            raise ValueError("copy_ between Float8Tensors needs one float8 dtype and one granularity")
    else:
        # A plain source (e.g. load_state_dict into an FP8 weight): cast it afresh with a
        # dynamic scale in the destination's format, then write data and scale in place.
        src = cast_to_float8(src.to(dst._orig_dtype), dst._data.dtype, axiswise_dim=dst._axiswise_dim)
    if src._scale is not dst._scale and _scale_shared_beyond(dst):
        raise NotImplementedError(
            f"copy_ into a view of shape {tuple(dst.shape)} of a Float8Tensor of shape {tuple(dst._base.shape)} "
            f"would change the scale it shares with elements outside the view. Copy into the whole "
            f"tensor, or call .to_hp(), update, and cast again with Float8Tensor.from_hp."
        )
    dst._data.copy_(src._data)
    dst._scale.copy_(src._scale)
    return dst


def _scale_shared_beyond(dst: Float8Tensor) -> bool:
    """Whether ``dst`` is a view whose scale also covers elements outside it.

    Tensorwise: any view with fewer elements than its base. Axiswise: a view whose rows are
    shorter than the base's (cut along the scaled axis); row slices own their scale rows.
    """
    base = dst._base
    if not _is_f8(base):
        return False
    if dst._axiswise_dim is None or base._axiswise_dim is None:
        return dst.numel() != base.numel()
    return dst.shape[dst._axiswise_dim] != base.shape[base._axiswise_dim]


@implements([aten.empty_like.default])
def _empty_like(func, types, args, kwargs):
    x = args[0]
    kwargs = dict(kwargs)
    dtype = kwargs.pop("dtype", None) or x._orig_dtype
    check_hp_dtype(dtype, "empty_like dtype")
    kwargs.pop("memory_format", None)
    return x._replace(data=func(x._data, **kwargs), scale=func(x._scale, **kwargs), orig_dtype=dtype)


@implements([aten.is_same_size.default])
def _is_same_size(func, types, args, kwargs):
    return args[0].shape == args[1].shape

