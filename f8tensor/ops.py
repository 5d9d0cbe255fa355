"""The Float8Tensor op table: matrix products to ``torch._scaled_mm``, layout ops on data and scale.

Every handler has the signature ``handler(func, types, args, kwargs)`` and is registered
with ``Float8Tensor.implements``. View-like handlers rebuild through
``Float8Tensor._replace`` and return through ``return_and_correct_aliasing``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing

from f8tensor.config import DEFAULT_GEMM, GemmConfig
from f8tensor.formats import FLOAT8_DTYPES, check_hp_dtype, e4m3_like
from f8tensor.tensor import Float8Tensor, cast_to_float8, check_scale_values, dequantize, scale_from_number

__all__ = ["float8_mm"]

aten = torch.ops.aten
implements = Float8Tensor.implements

# torch._scaled_mm (cuBLASLt) needs K and N to be multiples of 16. The rule is enforced on
# every device, CPU included, so that code tested on CPU runs unchanged on a GPU.
_ALIGN = 16


def _is_f8(x: object) -> bool:
    return isinstance(x, Float8Tensor)


# ===================================================================== matrix products


def float8_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    out_scale: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """``a @ b`` (2D) on FP8 tensor cores, with an explicit output dtype.

    At least one operand is a Float8Tensor; a plain one is cast on the fly (dynamic
    scale, the other operand's granularity). ``out_dtype``: bf16, fp16 or fp32 are
    written straight from the fp32 accumulator (default: ``a``'s original dtype). An FP8
    ``out_dtype`` needs ``out_scale`` and returns a Float8Tensor with that scale; the
    product is saturated into range, never overflowed; a non-finite one (an inf in
    ``bias``) becomes NaN, never the format's max.
    """
    out_scale = _check_float8_mm_args(a, b, bias, out_dtype, out_scale)
    if out_scale is not None:
        orig = a._orig_dtype if _is_f8(a) else a.dtype
        # Accumulate and add the bias in fp32, then one saturating cast: the only rounding
        # to FP8 is the one asked for. The clamp would turn an inf into the format's max:
        # keep it non-finite (NaN, the one non-finite value all four formats have).
        acc = _matmul(a, b, bias=bias, out_dtype=torch.float32)
        acc = torch.where(torch.isinf(acc), torch.nan, acc)
        return cast_to_float8(acc, out_dtype, scale=out_scale, orig_dtype=orig)
    return _matmul(a, b, bias=bias, out_dtype=out_dtype)


def _check_float8_mm_args(a, b, bias, out_dtype, out_scale) -> torch.Tensor | None:
    """float8_mm's arguments, checked at its entry; returns the 0-dim fp32 out_scale (FP8 output) or None."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"float8_mm: {name} must be a tensor; got {type(t).__name__}")
    if not (_is_f8(a) or _is_f8(b)):
        raise TypeError("float8_mm needs at least one Float8Tensor operand; use torch.mm for plain tensors")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or _is_f8(bias):
            raise TypeError(f"float8_mm: bias must be None or a high-precision tensor; got {type(bias).__name__}")
        check_hp_dtype(bias.dtype, "float8_mm bias")
    if out_dtype is not None and out_dtype not in FLOAT8_DTYPES:
        check_hp_dtype(out_dtype, "out_dtype")
    if out_dtype not in FLOAT8_DTYPES:
        if out_scale is not None:
            raise ValueError("out_scale is only meaningful with an FP8 out_dtype")
        return None
    if out_scale is None:
        raise ValueError(f"an FP8 out_dtype ({out_dtype}) needs out_scale (the scale of the output)")
    device = (a if _is_f8(a) else b).device
    if not isinstance(out_scale, torch.Tensor):
        return scale_from_number(out_scale, "float8_mm out_scale", device)
    if out_scale.dtype != torch.float32:
        raise TypeError(f"float8_mm out_scale must be a float or a float32 tensor; got dtype {out_scale.dtype}")
    if out_scale.numel() != 1:
        raise ValueError(f"float8_mm out_scale must be one number (a tensor of 1 element); got shape {tuple(out_scale.shape)}")
    if out_scale.device != device:
        raise ValueError(f"float8_mm out_scale is on {out_scale.device}, the operands on {device}")
    return check_scale_values(out_scale.reshape(()), "float8_mm out_scale")


def _matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The one place that calls ``torch._scaled_mm``. ``a``: (M, K), ``b``: (K, N)."""
    if a.dim() != 2 or b.dim() != 2:
        raise RuntimeError(f"FP8 mm expects 2D operands; got {tuple(a.shape)} and {tuple(b.shape)}")
    a8, b8 = _as_float8_operands(a, b)
    _check_operand_dtypes(a8._data.dtype, b8._data.dtype)
    gemm = _merged_gemm(a8._gemm, b8._gemm)
    (m, k), (k2, n) = a8.shape, b8.shape
    if k != k2:
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({m}x{k} and {k2}x{n})")
    if out_dtype is None:
        out_dtype = gemm.out_dtype or a8._orig_dtype

    # Layouts cuBLASLt takes: A row-major, B column-major. FP8 copies are 1 byte/element.
    a_data = a8._data if a8._data.is_contiguous() else a8._data.contiguous()
    b_data = b8._data if b8._data.t().is_contiguous() else b8._data.t().contiguous().t()
    a_inv, b_inv = _inverse_scales(a8, b8, m, n)

    pad_k, pad_n = (-k) % _ALIGN, (-n) % _ALIGN
    if pad_k or pad_n:
        if not gemm.pad_inner_dim:
            raise ValueError(
                f"FP8 matmul needs the inner dimension K and the output dimension N to be multiples "
                f"of {_ALIGN} (torch._scaled_mm's rule); got ({m}x{k}) @ ({k}x{n}). Use such shapes, or "
                f"ask for zero padding with GemmConfig(pad_inner_dim=True)."
            )
        a_data = _pad_bytes(a_data, 0, pad_k)
        b_data = _pad_bytes(b_data.t(), pad_n, pad_k).t()
        if b_inv.dim():
            b_inv = torch.nn.functional.pad(b_inv, (0, pad_n), value=1.0)

    fuse_bias = (
        bias is not None
        and not pad_n
        and bias.dim() == 1
        and bias.dtype == out_dtype
        and out_dtype in (torch.bfloat16, torch.float16)
    )
    out = torch._scaled_mm(
        a_data,
        b_data,
        scale_a=a_inv,
        scale_b=b_inv,
        bias=bias if fuse_bias else None,
        out_dtype=out_dtype,
        use_fast_accum=gemm.use_fast_accum,
    )
    if pad_n:
        out = out[:, :n].contiguous()
    if bias is not None and not fuse_bias:
        out = out + bias.to(out_dtype)
    return out


def _as_float8_operands(a: torch.Tensor, b: torch.Tensor) -> tuple[Float8Tensor, Float8Tensor]:
    """Both operands as Float8Tensors whose scales are constant along K.

    A plain operand is cast with a dynamic scale, in the e4m3 format of the other
    operand's family (cuBLASLt refuses e5m2 x e5m2) and with its granularity. An operand
    whose scale varies along K (e.g. a rowwise weight used in ``grad @ w``) is
    re-quantized along the other axis: one extra rounding, but the product stays in FP8.
    """
    ref = a if _is_f8(a) else b
    if not _is_f8(ref):
        raise TypeError("FP8 mm needs at least one Float8Tensor operand")
    rowwise = ref._axiswise_dim is not None
    if not _is_f8(a):
        a = _cast_plain(a, ref, 1 if rowwise else None)
    if not _is_f8(b):
        b = _cast_plain(b, ref, 0 if rowwise else None)
    if a._axiswise_dim not in (None, 1):
        a = _requantize(a, 1)
    if b._axiswise_dim not in (None, 0):
        b = _requantize(b, 0)
    return a, b


def _cast_plain(x: torch.Tensor, ref: Float8Tensor, axiswise_dim: int | None) -> Float8Tensor:
    check_hp_dtype(x.dtype, "the plain operand of an FP8 matmul")
    return cast_to_float8(x, e4m3_like(ref._data.dtype), axiswise_dim=axiswise_dim, gemm=ref._gemm)


def _requantize(f8: Float8Tensor, axiswise_dim: int) -> Float8Tensor:
    # Deliberate upcast to fp32 between the two roundings, not to the original dtype.
    return cast_to_float8(
        dequantize(f8, torch.float32), f8._data.dtype, axiswise_dim=axiswise_dim, gemm=f8._gemm, orig_dtype=f8._orig_dtype
    )


def _check_operand_dtypes(a: torch.dtype, b: torch.dtype) -> None:
    # cuBLASLt's rules, enforced on every device (CPU kernels would accept these), so a
    # model that runs on CPU runs unchanged on a GPU.
    if "e5m2" in str(a) and "e5m2" in str(b):
        raise ValueError(
            f"FP8 matmul of two e5m2 operands ({a} x {b}) is not supported by torch._scaled_mm on "
            f"GPUs; cast one operand to e4m3"
        )
    if ("fnuz" in str(a)) != ("fnuz" in str(b)):
        raise ValueError(f"FP8 matmul operands must both be fnuz formats or neither; got {a} x {b}")


def _merged_gemm(a: GemmConfig, b: GemmConfig) -> GemmConfig:
    if a == b or b == DEFAULT_GEMM:
        return a
    if a == DEFAULT_GEMM:
        return b
    raise ValueError(f"the operands of an FP8 matmul carry different GemmConfigs: {a} and {b}")


def _inverse_scales(a8: Float8Tensor, b8: Float8Tensor, m: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantization factors in the shapes ``_scaled_mm`` takes.

    Tensorwise x tensorwise: two 0-dim tensors. Otherwise both rowwise, (M, 1) and (1, N):
    ``_scaled_mm`` does not mix granularities, so a tensorwise side is broadcast.
    """
    a_inv, b_inv = a8._scale.reciprocal(), b8._scale.reciprocal()
    if a_inv.dim() == 0 and b_inv.dim() == 0:
        return a_inv, b_inv
    a_inv = a_inv.reshape(-1, 1).expand(m, 1).contiguous()
    b_inv = b_inv.reshape(1, -1).expand(1, n).contiguous()
    return a_inv, b_inv


def _pad_bytes(x: torch.Tensor, pad_rows: int, pad_cols: int) -> torch.Tensor:
    # Pad through uint8: constant_pad_nd has no FP8 kernels, and the zero byte is +0.0 in
    # all four formats (0x80 would be NaN in the fnuz ones).
    raw = torch.nn.functional.pad(x.contiguous().view(torch.uint8), (0, pad_cols, 0, pad_rows))
    return raw.view(x.dtype)


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

