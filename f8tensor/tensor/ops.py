"""The Float8Tensor op table, layout ops on data and scale (the matrix products are in
:mod:`f8tensor.tensor.product_ops`, which registers them in the same table).

Every handler has the signature ``handler(func, types, args, kwargs)`` and is registered
with ``Float8Tensor.implements``, called after the ``def`` (not as a decorator) so that the
handlers are plain module functions a mutation tool can rewrite (mutmut skips decorated
functions; see README.md, "Mutation testing"). The product handlers only unpack aten's arguments (and,
for ``bmm``, pick the batch layout); ``gemm`` makes the products. View-like handlers
rebuild through ``Float8Tensor._replace`` and return through ``return_and_correct_aliasing``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from f8tensor.compat import return_and_correct_aliasing, view_base
from f8tensor.quant.formats import FLOAT8_DTYPES, check_hp_dtype
from f8tensor.quant.specs import CastSpec, axiswise_dim, layout_block, varies_along
from f8tensor.tensor.float8 import Float8Tensor, dequantize, is_float8, to_float8

__all__: list[str] = []

aten = torch.ops.aten
implements = Float8Tensor.implements
_is_f8 = is_float8


def _tensorwise(x: Float8Tensor) -> bool:
    return x._scale.dim() == 0  # a 0-dim scale: tensorwise


# ===================================================================== layout ops
#
# Every layout op keeps ``_block`` and ``_scale`` consistent with ``_data`` (see the
# Float8Tensor docstring): a dim keeps its block entry wherever it goes, the scale moves
# with it, and a view that would cut a block (e.g. a slice starting inside a 128-block)
# raises instead of silently mislabelling scales.


def _with_defaults(args: Sequence, defaults: Sequence) -> tuple:
    """``args`` completed with the defaults of the trailing arguments left out.

    aten hands a handler every argument before its schema's ``*`` positionally, dropping
    trailing ones left at their defaults (``kwargs`` holds keyword-only ones only): a
    handler reads its positional arguments from ``args`` alone."""
    return (*args, *defaults[len(args) :])


def _view_result(func, args, kwargs, out):
    if torch.is_inference_mode_enabled() and not args[0].is_inference():
        # A view of a normal tensor is a normal tensor, in inference mode too (it shares
        # its base's version counter). A wrapper built here would be an inference tensor,
        # which PyTorch refuses to give a version counter ("Cannot set version_counter
        # for inference tensor"): rebuild it as a normal one.
        with torch.inference_mode(False):
            out = [o._replace() for o in out] if isinstance(out, list) else out._replace()
            return return_and_correct_aliasing(func, args, kwargs, out)
    return return_and_correct_aliasing(func, args, kwargs, out)


def _describe_scaling(x: Float8Tensor) -> str:
    return f"with block {x._block}" if x.is_blockwise else f"scaled along dim {axiswise_dim(x._scale_block)}"


def _permuted(x: Float8Tensor, data: torch.Tensor, perm: Sequence[int]) -> Float8Tensor:
    """``x`` with ``data`` (its data permuted by ``perm``): block and scale follow."""
    block = tuple(x._block[p] for p in perm)
    scale = x._scale if _tensorwise(x) else x._scale.permute(list(perm))
    return x._replace(data=data, scale=scale, block=block)


def _t(func, types, args, kwargs):
    (x,) = args
    perm = [1, 0] if x.dim() == 2 else list(range(x.dim()))
    return _view_result(func, args, kwargs, _permuted(x, x._data.t(), perm))


implements([aten.t.default])(_t)


def _transpose(func, types, args, kwargs):
    x, d0, d1 = args
    d0, d1 = d0 % max(x.dim(), 1), d1 % max(x.dim(), 1)
    perm = list(range(x.dim()))
    if x.dim():
        perm[d0], perm[d1] = perm[d1], perm[d0]
    return _view_result(func, args, kwargs, _permuted(x, x._data.transpose(d0, d1), perm))


implements([aten.transpose.int])(_transpose)


def _permute(func, types, args, kwargs):
    x, dims = args
    dims = [d % x.dim() for d in dims]
    return _view_result(func, args, kwargs, _permuted(x, x._data.permute(dims), dims))


implements([aten.permute.default])(_permute)


def _reshaped_meta(x: Float8Tensor, new_shape: Sequence[int]) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Scale and block for ``x`` reshaped to ``new_shape``, when they exist.

    The trailing dims both shapes share keep their blocks and scales; the leading dims
    before them may be merged or split when their blocks are all 1 (one scale per index:
    ``(B, S, K) <-> (B*S, K)`` for rowwise, 1x128 and MX activations) or all 0 (shared).
    Anything else would put elements with different scales into one block: refused.
    """
    new_shape = tuple(new_shape)
    old_shape = tuple(x.shape)
    if _tensorwise(x):
        return x._scale, layout_block((), len(new_shape))
    if new_shape == old_shape:
        return x._scale, x._block
    common = 0
    while common < min(len(old_shape), len(new_shape)) and old_shape[-1 - common] == new_shape[-1 - common]:
        common += 1
    n_old, n_new = len(old_shape) - common, len(new_shape) - common
    # Size-1 dims hold one scale whatever their block says.
    lead = {b for b, size in zip(x._block[:n_old], old_shape[:n_old]) if size != 1}
    if lead <= {1}:
        prefix_block, prefix_scale = (1,) * n_new, new_shape[:n_new]
    elif lead == {0}:
        prefix_block, prefix_scale = (0,) * n_new, (1,) * n_new
    else:
        raise NotImplementedError(
            f"cannot reshape a Float8Tensor of shape {old_shape} with block {x._block} to {new_shape}: "
            f"elements with different scales would share a block. Only reshapes that keep the last "
            f"dimension are supported (they may merge or split the leading dims when their blocks are "
            f"all 1 or all 0); call .to_hp() first."
        )
    scale = x._scale.reshape(*prefix_scale, *x._scale.shape[n_old:])
    return scale, prefix_block + x._block[n_old:]


def _view(func, types, args, kwargs):
    x, size = args[0], args[1]
    data = func(x._data, size)
    scale, block = _reshaped_meta(x, data.shape)
    out = x._replace(data=data, scale=scale, block=block)
    return _view_result(func, args, kwargs, out)


implements([aten.view.default, aten._unsafe_view.default, aten.reshape.default])(_view)


def _unsqueeze(func, types, args, kwargs):
    x, dim = args
    dim = dim % (x.dim() + 1)
    data = x._data.unsqueeze(dim)
    if _tensorwise(x):
        return _view_result(func, args, kwargs, x._replace(data=data, block=layout_block((), data.dim())))
    # A new size-1 dim holds one scale whatever its block: 1, as for a leading batch dim.
    block = x._block[:dim] + (1,) + x._block[dim:]
    return _view_result(func, args, kwargs, x._replace(data=data, scale=x._scale.unsqueeze(dim), block=block))


implements([aten.unsqueeze.default])(_unsqueeze)


def _expand(func, types, args, kwargs):
    x, size = args[0], args[1]
    data = x._data.expand(size)
    lead = data.dim() - x.dim()
    if _tensorwise(x):
        return _view_result(func, args, kwargs, x._replace(data=data, block=layout_block((), data.dim())))
    # New leading dims and expanded size-1 dims get one scale per index (block 1), the
    # scale expanded alongside (stride 0, no copy); other dims keep block and scale.
    block, scale_shape = [1] * lead, list(data.shape[:lead])
    for d, (b, old, new) in enumerate(zip(x._block, x.shape, data.shape[lead:])):
        if old == 1 and new != 1 and b != 0:
            block.append(1)
            scale_shape.append(new)
        else:
            block.append(b)
            scale_shape.append(x._scale.shape[d])
    out = x._replace(data=data, scale=x._scale.expand(scale_shape), block=tuple(block))
    return _view_result(func, args, kwargs, out)


implements([aten.expand.default])(_expand)


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


def _as_strided(func, types, args, kwargs):
    """Re-striding the FP8 bytes in place.

    torch.compile calls it to rebuild a graph output that aliases a graph input (a compiled
    function returning ``w8.t()`` or ``w8.detach()``). Tensorwise: any layout, the one scale
    applies to every byte. Other blocks: only layouts that permute the tensor's own dims at
    the same storage offset (detach, t, transpose, permute); block and scale are permuted alongside.
    """
    x, size, stride, offset = _with_defaults(args, (None, None, None, None))
    data = func(x._data, size, stride, offset)
    if _tensorwise(x):
        return _view_result(func, args, kwargs, x._replace(data=data, block=layout_block((), data.dim())))
    perm = _as_permutation(x, size, stride, offset)
    if perm is None:
        raise NotImplementedError(
            f"as_strided of a Float8Tensor {_describe_scaling(x)} is only supported "
            f"as a permutation of its dims; got size={tuple(size)}, stride={tuple(stride)}, "
            f"storage_offset={offset} for shape {tuple(x.shape)}, stride {x.stride()}. Call .to_hp() first."
        )
    return _view_result(func, args, kwargs, _permuted(x, data, perm))


implements([aten.as_strided.default])(_as_strided)


def _detach(func, types, args, kwargs):
    (x,) = args
    return _view_result(func, args, kwargs, x._replace(data=func(x._data), scale=func(x._scale)))


implements([aten.detach.default, aten.alias.default])(_detach)


def _clone(func, types, args, kwargs):
    (x,) = args
    return x._replace(data=func(x._data, **kwargs), scale=x._scale.clone())


implements([aten.clone.default])(_clone)


def _scale_varies_along(x: Float8Tensor, dim: int) -> bool:
    """Whether ``x`` has more than one scale along ``dim`` (block entry > 0).

    Decided from the metadata, not from ``_scale.shape[dim] == 1``: a one-row piece of a
    rowwise tensor also has a size-1 scale along ``dim``, yet its scale is its own.
    """
    return varies_along(x._scale_block, dim)


def _piece_scale(x: Float8Tensor, dim: int, start: int, stop: int, step: int = 1) -> torch.Tensor:
    """The scale of the elements ``start:stop:step`` of ``x`` along ``dim``.

    Block 0 (or tensorwise): the shared scale. Block 1: the same slice of the scale. Block
    ``b > 1``: the piece must start on a block boundary with step 1 (it may end inside a
    block: that becomes its partial last block); its scales are those of the blocks it touches.
    """
    if not _scale_varies_along(x, dim):
        return x._scale
    b = x._block[dim]
    if b == 1:
        return x._scale[(slice(None),) * dim + (slice(start, stop, step),)]
    if step != 1 or start % b:
        raise NotImplementedError(
            f"this view of a Float8Tensor with block {x._block} would cut a block along dim {dim}: "
            f"elements {start}:{stop}:{step} do not start on a multiple of {b} with step 1. "
            f"Cut at multiples of {b}, or call .to_hp() first."
        )
    first, last = start // b, -(-stop // b)
    return x._scale.narrow(dim, first, max(last - first, 0))


def _check_pieces_cat(tensors: Sequence[Float8Tensor], dim: int) -> None:
    b = tensors[0]._block[dim]
    if b > 1:
        for t in tensors[:-1]:
            if t.shape[dim] % b:
                raise ValueError(
                    f"cat along dim {dim} of Float8Tensors with block {tensors[0]._block}: every piece but "
                    f"the last must hold whole blocks (a multiple of {b}); got size {t.shape[dim]}"
                )


def _split(func, types, args, kwargs):
    x, sizes, dim = _with_defaults(args, (None, None, 0))
    dim = dim % x.dim()
    datas = func(x._data, sizes, dim)
    out, start = [], 0
    for d in datas:
        stop = start + d.shape[dim]
        out.append(x._replace(data=d, scale=_piece_scale(x, dim, start, stop)))
        start = stop
    return _view_result(func, args, kwargs, out)


implements([aten.split.Tensor, aten.split_with_sizes.default])(_split)


def _slice(func, types, args, kwargs):
    x, dim, start, end, step = _with_defaults(args, (None, 0, None, None, 1))
    dim = dim % x.dim()
    data = func(x._data, *args[1:])
    # Clamped to the dim as Python clamps a slice (the same for every step aten allows: >= 1).
    start, end = slice(start, end).indices(x.shape[dim])[:2]
    scale = _piece_scale(x, dim, start, max(end, start), step)
    return _view_result(func, args, kwargs, x._replace(data=data, scale=scale))


implements([aten.slice.Tensor])(_slice)


def _selected(x: Float8Tensor, dim: int, index: int) -> Float8Tensor:
    """``x`` indexed at ``index`` along ``dim`` (the dim drops out of data, block and scale)."""
    dim = dim % x.dim()
    index = _normalized_index(index, x.shape[dim], dim)
    data = x._data.select(dim, index)
    block = x._block[:dim] + x._block[dim + 1 :]
    if _tensorwise(x):
        return x._replace(data=data, block=block)
    b = x._block[dim]
    return x._replace(data=data, scale=x._scale.select(dim, 0 if b == 0 else index // b), block=block)


def _select(func, types, args, kwargs):
    x, dim, index = args
    return _view_result(func, args, kwargs, _selected(x, dim, index))


implements([aten.select.int])(_select)


def _index(func, types, args, kwargs):
    """``w8[ids]``: experts gathered along dim 0 by a 1D integer tensor (a copy, with their scales)."""
    x, indices = args
    if (
        len(indices) != 1
        or indices[0] is None
        or indices[0].dtype not in (torch.int64, torch.int32)
        or indices[0].dim() != 1
    ):
        raise NotImplementedError(
            "Float8Tensor supports indexing with one 1D integer tensor along dim 0 (w8[ids]); call .to_hp() first"
        )
    (ids,) = indices
    ids = _normalized_ids(ids, x.shape[0])
    data = x._data.view(torch.uint8)[ids].view(x._data.dtype)  # gather through bytes: no FP8 index kernel needed
    b = x._block[0]  # x has a dim 0 (it is indexed along it): its block has an entry there
    if _tensorwise(x) or b == 0:
        return x._replace(data=data)
    # Each gathered row keeps its own scale row: blocks of b rows become blocks of one.
    block = (1,) + tuple(x._block[1:])
    return x._replace(data=data, scale=x._scale[ids // b], block=block)


implements([aten.index.Tensor])(_index)


# Index normalization, once for every index op: a negative index counts from the end
# (-1 is the last), anything outside [-size, size) is refused. The data and every scale
# lookup then read the same non-negative positions (a block index is ``i // b``, which
# floors a negative ``i`` into the wrong block).


def _normalized_index(index: int, size: int, dim: int) -> int:
    if not -size <= index < size:
        raise IndexError(f"index {index} is out of range for dim {dim} of size {size}: allowed [-{size}, {size})")
    return index + size if index < 0 else index


def _normalized_ids(ids: torch.Tensor, size: int) -> torch.Tensor:
    """``ids`` (a 1D integer tensor) with negative entries counted from the end.

    The range is checked eagerly on CPU; elsewhere (a GPU, or under torch.compile) not
    read on the host: no sync on the hot path. There the gather of the data with the
    normalized ids still asserts in device code on an index out of [0, size); an index
    below ``-size`` is sent to ``size`` first (aten's gather would wrap it once more).
    """
    if ids.device.type == "cpu" and not torch.compiler.is_compiling():
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < -size or hi >= size:
                bad = lo if lo < -size else hi
                raise IndexError(f"index {bad} is out of range for dim 0 of size {size}: allowed [-{size}, {size})")
        return torch.where(ids < 0, ids + size, ids)
    return torch.where(ids < 0, torch.where(ids < -size, size, ids + size), ids)


def _cat(func, types, args, kwargs):
    tensors, dim = _with_defaults(args, (None, 0))
    first = tensors[0]
    dim = dim % first.dim()
    for t in tensors:
        if not _is_f8(t):
            raise TypeError("cat of Float8Tensors with plain tensors is not supported; call .to_hp() first")
        same_meta = (t._data.dtype, t._orig_dtype, t._block, t._scale.dtype, t._scale.dim(), t._gemm) == (
            first._data.dtype,
            first._orig_dtype,
            first._block,
            first._scale.dtype,
            first._scale.dim(),
            first._gemm,
        )
        if not same_meta:
            raise ValueError(
                "cat needs Float8Tensors of one float8 dtype, original dtype, block, scale dtype and GemmConfig"
            )
    data = torch.cat([t._data for t in tensors], dim)
    if _scale_varies_along(first, dim):
        _check_pieces_cat(tensors, dim)
        return first._replace(data=data, scale=torch.cat([t._scale for t in tensors], dim))
    # The scale is constant along `dim`: every piece must carry the same one.
    for t in tensors[1:]:
        if t._scale is not first._scale and not torch.equal(t._scale, first._scale):
            raise ValueError(
                "cat of Float8Tensors with different scales along the cat dimension cannot be "
                "represented without re-quantizing; call .to_hp() and cast again"
            )
    return first._replace(data=data)


implements([aten.cat.default])(_cat)


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


implements([aten._to_copy.default])(_to_copy)


def _copy_(func, types, args, kwargs):
    dst, src = args[0], args[1]
    if dst.shape != src.shape:
        raise RuntimeError(f"copy_ between shapes {tuple(src.shape)} and {tuple(dst.shape)}")
    if not _is_f8(dst):
        dst.copy_(dequantize(src, dst.dtype))
        return dst
    if _is_f8(src):
        if (src._data.dtype, src._block, src._scale.dtype) != (dst._data.dtype, dst._block, dst._scale.dtype):
            raise ValueError("copy_ between Float8Tensors needs one float8 dtype and one granularity (block)")
    else:
        # A plain source (e.g. load_state_dict into an FP8 weight): cast it afresh with a
        # dynamic scale in the destination's format, then write data and scale in place.
        src = to_float8(src.to(dst._orig_dtype), CastSpec(dst._data.dtype, dst._scale_block, dst._scale.dtype))
    if src._scale is not dst._scale and _scale_shared_beyond(dst):
        raise NotImplementedError(
            # _scale_shared_beyond is True only for a view: view_base is not None here.
            f"copy_ into a view of shape {tuple(dst.shape)} of a Float8Tensor of shape {tuple(view_base(dst).shape)} "  # type: ignore[union-attr]
            f"would change the scale it shares with elements outside the view. Copy into the whole "
            f"tensor, or call .to_hp(), update, and cast again with Float8Tensor.from_hp."
        )
    dst._data.copy_(src._data)
    dst._scale.copy_(src._scale)
    dst._inv_scale = None  # a new scale, in place: no cached inverse describes it
    return dst


implements([aten.copy_.default])(_copy_)


def _scale_shared_beyond(dst: Float8Tensor) -> bool:
    """Whether ``dst`` is a view whose scale also covers elements outside it.

    Tensorwise: any view with fewer elements than its base. Other blocks (same ndim as the
    base): a view cut along a dim whose block is not 1 (rows of a rowwise tensor own their
    scale rows; a 128-block or a whole-dim scale is shared). Otherwise: conservatively yes.
    """
    base = view_base(dst)
    if not _is_f8(base):
        return False
    if _tensorwise(dst) or _tensorwise(base) or dst.dim() != base.dim():
        return dst.numel() != base.numel()
    return any(b != 1 and ds != bs for b, ds, bs in zip(dst._block, dst.shape, base.shape))


def _empty_like(func, types, args, kwargs):
    x = args[0]
    kwargs = dict(kwargs)
    dtype = kwargs.pop("dtype", None) or x._orig_dtype
    check_hp_dtype(dtype, "empty_like dtype")
    kwargs.pop("memory_format", None)
    return x._replace(data=func(x._data, **kwargs), scale=func(x._scale, **kwargs), orig_dtype=dtype)


implements([aten.empty_like.default])(_empty_like)


def _is_same_size(func, types, args, kwargs):
    return args[0].shape == args[1].shape


implements([aten.is_same_size.default])(_is_same_size)
