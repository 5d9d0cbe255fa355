"""FP8 expert weights: the three GEMMs of a mixture-of-experts layer in FP8, model code untouched.

Hugging Face MoE models keep their experts as 3D parameters, ``gate_up_proj`` (E, 2I, H) and
``down_proj`` (E, H, I), and multiply them in one of three ways: a Python loop of
``F.linear(x, w[e])``, ``torch.bmm`` over gathered per-token weights, or
``torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)`` over tokens sorted by expert.
:class:`Float8ExpertWeight` is the parameter that makes all three run in FP8: it behaves
like the plain tensor it wraps (indexing, views, optimizer steps, ``copy_``, checkpoints),
and its ``__torch_function__`` routes ``F.linear``, ``torch.bmm``, ``torch._grouped_mm`` /
``F.grouped_mm`` and transformers' grouped fallback op to autograd Functions whose forward
and both backward GEMMs are FP8 (:func:`f8tensor.gemm.scaled_grouped_mm`).

Scaling, per :class:`~f8tensor.config.Float8LinearConfig` (``input``, ``weight``,
``grad_output`` granularities; recipes ``tensorwise`` and ``rowwise``):

- weights: tensorwise = one scale per expert; rowwise = one scale per expert row of the
  stored (E, N, K) weight (per output feature, constant along the contraction dim K); the
  input-gradient GEMM contracts over N and re-casts the weight along N (per expert column).
- activations and gradients: tensorwise = one scale per tensor; rowwise = one per token
  row. The weight-gradient GEMM contracts over each expert's tokens: rowwise scales there
  are per (expert, feature), measured over that expert's tokens only.
- all three grouped/batched GEMMs take e4m3 operands, ``grad_output`` included, because
  ``torch._scaled_grouped_mm`` multiplies no e5m2 (the tensorwise recipe's e5m2 gradients
  apply to the loop path, which runs through ``Float8Linear``'s GEMMs).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from f8tensor.config import CastConfig, Float8LinearConfig
from f8tensor.formats import HP_DTYPES, saturated_cast
from f8tensor.gemm import scaled_grouped_mm
from f8tensor.linear import _Float8LinearFn
from f8tensor.scaling import amax_to_scale

__all__ = ["Float8ExpertWeight", "convert_experts_to_float8", "float8_grouped_mm"]

logger = logging.getLogger("f8tensor")
aten = torch.ops.aten

_E4M3 = torch.float8_e4m3fn
_ALIGN = 16
# What the grouped kernel writes (its only output dtype); results are cast to the model's dtype.
_KERNEL_OUT = torch.bfloat16


# ===================================================================== casts


def _amax(t: torch.Tensor, dims: tuple[int, ...] | None) -> torch.Tensor:
    """max |t| in fp32 over ``dims`` (keepdim), or over everything (0-dim) for ``None``."""
    if t.numel() == 0:
        shape = () if dims is None else tuple(1 if i in dims else s for i, s in enumerate(t.shape))
        return t.new_zeros(shape, dtype=torch.float32)
    if dims is None:
        return t.abs().amax().to(torch.float32)
    return t.abs().amax(dim=dims, keepdim=True).to(torch.float32)


def _cast(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # Deliberate upcast: the product the FP8 rounding sees is formed in fp32.
    return saturated_cast(t.float() * scale, _E4M3)


def _quantize(t: torch.Tensor, dims: tuple[int, ...] | None, cast: CastConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 data, scale) with one scale per slice reduced over ``dims`` (all dims for None)."""
    scale = amax_to_scale(_amax(t, dims), _E4M3, round_pow2=cast.power_of_2_scale)
    return _cast(t, scale), scale


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same values with the last two dims stored column-major (an FP8 copy if needed)."""
    if t.stride(-2) == 1 and t.stride(-1) >= max(1, t.shape[-2]):
        return t
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


def _inv(scale: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Dequantization factors in the (contiguous) shape the kernel takes."""
    return scale.reciprocal().expand(shape).contiguous() if scale.dim() == 0 else scale.reciprocal().reshape(shape).contiguous()


def _check_contraction(k: int, what: str) -> None:
    if k % _ALIGN:
        raise ValueError(
            f"FP8 expert GEMM ({what}): the contraction dim must be a multiple of {_ALIGN} "
            f"(torch._scaled_grouped_mm's stride rule); got {k}"
        )


# ===================================================================== grouped GEMMs (2D x 3D, offs)


def _grouped_fwd(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, x_cast: CastConfig, w_cast: CastConfig):
    """FP8 ``x (M, K) @ w[g] (K, N)`` per group: returns out (bf16) and the casts."""
    m, k = x.shape
    g, _, n = w.shape
    _check_contraction(k, "forward")
    x8, xs = _quantize(x, (1,) if x_cast.rowwise else None, x_cast)
    # weights: per expert (tensorwise) or per expert and output feature (rowwise), constant along K
    w8, ws = _quantize(w, (1,) if w_cast.rowwise else (1, 2), w_cast)
    ws_inv = ws.reciprocal().expand(g, 1, n).reshape(g, n).contiguous()
    out = scaled_grouped_mm(x8, _col_major(w8), _inv(xs, (m,)), ws_inv, offs, _KERNEL_OUT)
    return out, x8, xs, ws


def _pad_groups(offs: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Row positions that give every group a multiple of 16 rows (for grouping along K).

    Returns ``dest`` (M,): where each row goes; ``padded_offs`` (G,) int32; the padded row
    count P (a static bound, so no host sync and no recompilation when counts change).
    Rows past ``offs[-1]`` (tokens routed to no local expert) go to the last row, beyond
    every group: the kernel never reads them.
    """
    g = offs.shape[0]
    o = offs.to(torch.int64)
    sizes = torch.diff(o, prepend=o.new_zeros(1))
    padded_sizes = (sizes + _ALIGN - 1) // _ALIGN * _ALIGN
    padded_offs = torch.cumsum(padded_sizes, 0)
    rows = torch.arange(m, device=offs.device)
    gid = torch.searchsorted(o, rows, right=True)
    gid_c = gid.clamp(max=g - 1)
    p = (m + _ALIGN - 1) // _ALIGN * _ALIGN + _ALIGN * g + _ALIGN
    dest = (padded_offs - padded_sizes)[gid_c] + rows - (o - sizes)[gid_c]
    dest = torch.where(gid < g, dest, p - 1)
    return dest, padded_offs.to(torch.int32), p


def _scatter_rows(t: torch.Tensor, dest: torch.Tensor, p: int) -> torch.Tensor:
    """``t`` (M, C) placed at rows ``dest`` of a zero (P, C) tensor (FP8 through its bytes)."""
    if t.dtype.itemsize == 1 and t.dtype.is_floating_point:
        raw = t.view(torch.uint8).new_zeros(p, t.shape[1]).index_copy_(0, dest, t.view(torch.uint8))
        return raw.view(t.dtype)
    return t.new_zeros(p, t.shape[1]).index_copy_(0, dest, t)


def _group_quantize(t: torch.Tensor, offs: torch.Tensor, g: int, cast: CastConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, C) rows grouped by ``offs``: FP8 data and a (G, C) scale (rowwise: per group and column).

    Tensorwise: one scale for the tensor, broadcast to (G, C).
    """
    p, c = t.shape
    if not cast.rowwise:
        data, scale = _quantize(t, None, cast)
        return data, scale.expand(g, c)
    gid = torch.searchsorted(offs.to(torch.int64), torch.arange(p, device=t.device), right=True)  # G: no group
    mag = t.abs().float()
    amax = mag.new_zeros(g + 1, c).scatter_reduce_(0, gid[:, None].expand(p, c), mag, "amax")
    scale = amax_to_scale(amax, _E4M3, round_pow2=cast.power_of_2_scale)
    data = _cast(t, scale[gid])
    return data, scale[:g]


def _grouped_wgrad(x, grad: torch.Tensor, offs: torch.Tensor, g: int, x_cast: CastConfig, go_cast: CastConfig):
    """FP8 ``x[group].t() @ grad[group]`` per group: (G, K, N), in bf16.

    ``x``: the high-precision input, or ``(x8, scale)`` saved by a tensorwise forward (the
    same bytes the forward multiplied: no second cast, half the saved bytes of bf16).
    """
    m = grad.shape[0]
    dest, poffs, p = _pad_groups(offs, m)
    gp = _scatter_rows(grad, dest, p)
    if isinstance(x, tuple):
        x8, scale = x
        x8, xs = _scatter_rows(x8, dest, p), scale.expand(g, x8.shape[1])
    else:
        x8, xs = _group_quantize(_scatter_rows(x, dest, p), poffs, g, x_cast)  # (P, K), (G, K)
    g8, gs = _group_quantize(gp, poffs, g, go_cast)  # (P, N), (G, N)
    a = x8.t().contiguous()  # (K, P) row-major
    b = _col_major(g8)  # (P, N) column-major
    return scaled_grouped_mm(a, b, xs.reciprocal().reshape(-1).contiguous(), gs.reciprocal().reshape(-1).contiguous(), poffs, _KERNEL_OUT)


class _GroupedMMFn(torch.autograd.Function):
    """``y = grouped_mm(x, w, offs)`` with x (M, K) sorted by expert and w (G, K, N), all GEMMs FP8.

    Saved for backward: w (the parameter's own view: no extra memory), offs, for a
    tensorwise weight its per-expert scales (backward re-casts the very same bytes), and x:
    with a tensorwise input its FP8 bytes and scale (the weight-gradient GEMM takes them as
    they are), else in high precision (re-cast per expert group there).
    """

    @staticmethod
    def forward(ctx, x, w, offs, config):  # type: ignore[override]
        out, x8, xs, ws = _grouped_fwd(x, w, offs, config.input, config.weight)
        keep_fp8_x = not config.input.rowwise and not config.weight_grad_in_hp
        ctx.save_for_backward(
            None if keep_fp8_x else x, x8 if keep_fp8_x else None, xs if keep_fp8_x else None,
            w, offs, None if config.weight.rowwise else ws,
        )
        ctx.config = config
        ctx.x_meta = (x.shape, x.dtype)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, x8, xs, w, offs, ws = ctx.saved_tensors
        x_shape, x_dtype = ctx.x_meta
        config: Float8LinearConfig = ctx.config
        g, k, n = w.shape
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            _check_contraction(n, "input gradient")
            g8, gs = _quantize(grad, (1,) if config.grad_output.rowwise else None, config.grad_output)
            wt = w.transpose(-2, -1)  # (G, N, K): contraction over N
            if ws is None:  # rowwise: per expert and input feature, constant along N
                wt8, wts = _quantize(wt, (1,), config.weight)
            else:
                wt8, wts = _cast(wt, ws.transpose(-2, -1)), ws.transpose(-2, -1)
            wts_inv = wts.reciprocal().expand(g, 1, k).reshape(g, k).contiguous()
            grad_x = scaled_grouped_mm(g8, _col_major(wt8), _inv(gs, (x_shape[0],)), wts_inv, offs, _KERNEL_OUT)
            grad_x = grad_x.to(x_dtype)
        if ctx.needs_input_grad[1]:
            if config.weight_grad_in_hp:
                dest, poffs, p = _pad_groups(offs, x.shape[0])
                xp, gp = _scatter_rows(x, dest, p), _scatter_rows(grad.to(x.dtype), dest, p)
                grad_w = torch._grouped_mm(xp.t().contiguous(), gp, offs=poffs)
            else:
                grad_w = _grouped_wgrad((x8, xs) if x is None else x, grad, offs, g, config.input, config.grad_output)
            grad_w = grad_w.to(w.dtype)
        return grad_x, grad_w, None, None


# ===================================================================== batched GEMMs (bmm)


def _bmm_fp8(a: torch.Tensor, b: torch.Tensor, a_dims, b_dims, a_cast: CastConfig, b_cast: CastConfig) -> torch.Tensor:
    """FP8 ``a (B, M, K) @ b (B, K, N)``; scales reduced over ``a_dims`` / ``b_dims`` (K included)."""
    bsz, m, k = a.shape
    n = b.shape[2]
    pad = (-k) % _ALIGN  # only the weight-gradient GEMM of one-token batches needs it (K = M = 1)
    if pad:
        a = torch.nn.functional.pad(a, (0, pad))
        b = torch.nn.functional.pad(b, (0, 0, 0, pad))
    a8, as_ = _quantize(a, a_dims, a_cast)
    b8, bs = _quantize(b, b_dims, b_cast)
    a_inv = _inv(as_, (bsz, m)) if as_.dim() == 0 else as_.reciprocal().reshape(bsz, m).contiguous()
    b_inv = _inv(bs, (bsz, n)) if bs.dim() == 0 else bs.reciprocal().expand(bsz, 1, n).reshape(bsz, n).contiguous()
    return scaled_grouped_mm(a8.contiguous(), _col_major(b8), a_inv, b_inv, None, _KERNEL_OUT)


class _ExpertBmmFn(torch.autograd.Function):
    """``x (B, M, K) @ w (B, K, N)`` where w holds one expert matrix per batch entry, all GEMMs FP8.

    Weight scales: per batch entry (tensorwise; a gathered expert keeps its expert's
    amax) or per entry and output column (rowwise). Activation scales: per tensor or per row.
    """

    @staticmethod
    def forward(ctx, x, w, config):  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.config = config
        xd = (2,) if config.input.rowwise else None
        wd = (1,) if config.weight.rowwise else (1, 2)
        _check_contraction(x.shape[2], "batched forward")
        return _bmm_fp8(x, w, xd, wd, config.input, config.weight).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, w = ctx.saved_tensors
        c: Float8LinearConfig = ctx.config
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # grad (B, M, N) @ w^T (B, N, K): contraction over N
            _check_contraction(w.shape[2], "batched input gradient")
            gd = (2,) if c.grad_output.rowwise else None
            wd = (1,) if c.weight.rowwise else (1, 2)
            grad_x = _bmm_fp8(grad, w.transpose(1, 2), gd, wd, c.grad_output, c.weight).to(x.dtype)
        if ctx.needs_input_grad[1]:  # x^T (B, K, M) @ grad (B, M, N): contraction over M
            xd = (2,) if c.input.rowwise else None
            gd = (1,) if c.grad_output.rowwise else None
            grad_w = _bmm_fp8(x.transpose(1, 2), grad, xd, gd, c.input, c.grad_output).to(w.dtype)
        return grad_x, grad_w, None


# ===================================================================== the parameter wrapper


class _Unwrap(torch.autograd.Function):
    """The plain tensor inside a :class:`Float8ExpertWeight`, with the gradient passed through."""

    @staticmethod
    def forward(ctx, w):  # type: ignore[override]
        return w._hp.view_as(w._hp)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad


def _plain(t: Any) -> Any:
    return _Unwrap.apply(t) if isinstance(t, Float8ExpertWeight) else t


def _route_grouped_mm(args: tuple, kwargs: dict) -> torch.Tensor:
    names = ("mat_a", "mat_b", "offs", "bias", "out_dtype")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    a, w, offs = bound["mat_a"], bound["mat_b"], bound.get("offs")
    if isinstance(a, Float8ExpertWeight) or not isinstance(w, Float8ExpertWeight) or a.dim() != 2 or w.dim() != 3 or offs is None:
        raise NotImplementedError(
            "FP8 expert weights take part in grouped_mm as mat_b, 3D (experts, K, N), with a 2D mat_a "
            f"and offs; got mat_a {tuple(a.shape)}, mat_b {tuple(w.shape)}, offs={'None' if offs is None else 'given'}"
        )
    if bound.get("bias") is not None:
        raise NotImplementedError("FP8 grouped_mm with bias is not supported (torch._scaled_grouped_mm takes none)")
    out_dtype = bound.get("out_dtype")
    y = float8_grouped_mm(a, w, offs)
    return y if out_dtype is None else y.to(out_dtype)


def _route_hf_fallback(args: tuple, kwargs: dict) -> torch.Tensor:
    bound = dict(zip(("input", "weight", "offs"), args))
    bound.update(kwargs)
    return float8_grouped_mm(bound["input"], bound["weight"], bound["offs"])


def _route_bmm(args: tuple, kwargs: dict) -> torch.Tensor:
    a, b = (list(args) + [kwargs.get("mat2")])[:2] if len(args) < 2 else args[:2]
    config = (b if isinstance(b, Float8ExpertWeight) else a)._config
    if isinstance(a, Float8ExpertWeight) and isinstance(b, Float8ExpertWeight):
        raise NotImplementedError("bmm of two FP8 expert weights is not an expert GEMM")
    if isinstance(b, Float8ExpertWeight):
        return _ExpertBmmFn.apply(a, _Unwrap.apply(b), config)
    # weight on the left (HF's default layout: w (B, N, K) @ x (B, K, 1)): transpose the product
    return _ExpertBmmFn.apply(b.transpose(1, 2), _Unwrap.apply(a).transpose(1, 2), config).transpose(1, 2)


def _route_linear(args: tuple, kwargs: dict) -> torch.Tensor:
    bound = dict(zip(("input", "weight", "bias"), args))
    bound.update(kwargs)
    x, w, bias = bound["input"], bound["weight"], bound.get("bias")
    if not isinstance(w, Float8ExpertWeight) or w.dim() != 2 or isinstance(x, Float8ExpertWeight):
        raise NotImplementedError(f"F.linear with an FP8 expert weight needs one expert's 2D matrix as weight; got {tuple(w.shape)}")
    # One expert's matrix: exactly Float8Linear's three GEMMs (and its recipe, e5m2 gradients included).
    return _Float8LinearFn.apply(x, _Unwrap.apply(w), _plain(bias), w._config, None, None)


def _route_matmul(args: tuple, kwargs: dict) -> torch.Tensor:
    a, b = args[0], args[1] if len(args) > 1 else kwargs["other"]
    if isinstance(b, Float8ExpertWeight) and not isinstance(a, Float8ExpertWeight):
        if b.dim() == 2:  # x @ w[e].t()
            return _route_linear((a, b.transpose(0, 1)), {})
        if b.dim() == 3 and a.dim() == 3:
            return _route_bmm((a, b), {})
    if isinstance(a, Float8ExpertWeight) and not isinstance(b, Float8ExpertWeight) and a.dim() == 3 and b.dim() == 3:
        return _route_bmm((a, b), {})
    raise NotImplementedError(
        f"matmul with an FP8 expert weight supports x @ w[e].t() and batched 3D x 3D products; got "
        f"{tuple(a.shape)} @ {tuple(b.shape)}"
    )


_ROUTES: dict[Any, Callable[[tuple, dict], torch.Tensor]] = {
    torch._grouped_mm: _route_grouped_mm,
    torch.bmm: _route_bmm,
    torch.Tensor.bmm: _route_bmm,
    torch.nn.functional.linear: _route_linear,
    torch.matmul: _route_matmul,
    torch.Tensor.matmul: _route_matmul,
    torch.Tensor.__matmul__: _route_matmul,
}
if hasattr(torch.nn.functional, "grouped_mm"):
    _ROUTES[torch.nn.functional.grouped_mm] = _route_grouped_mm


def _is_transformers_op(func: Any) -> bool:
    if isinstance(func, torch._ops.OpOverloadPacket):
        return func._qualified_op_name.startswith("transformers::")
    return isinstance(func, torch._ops.OpOverload) and func.namespace == "transformers"


def _register_hf_fallback() -> None:
    """transformers' compile-friendly grouped fallback op, when transformers registered it."""
    try:
        op = torch.ops.transformers.grouped_mm_fallback
    except (AttributeError, RuntimeError):
        return
    _ROUTES[op] = _route_hf_fallback
    _ROUTES[op.default] = _route_hf_fallback


# Matrix products that reach dispatch (below the routes above) would run in high precision:
# refused, never silently upcast.
_GEMMS = frozenset(
    {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten._grouped_mm.default}
)

# Ops whose result is still (a piece of) the weight: views, indexing of experts, copies.
_KEEP = frozenset(
    {
        aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
        aten.as_strided.default, aten.slice.Tensor, aten.select.int, aten.index.Tensor,
        aten.transpose.int, aten.t.default, aten.permute.default, aten.expand.default,
        aten.unsqueeze.default, aten.squeeze.dim, aten.split.Tensor, aten.split_with_sizes.default,
        aten.unbind.int, aten.clone.default, aten._to_copy.default, aten.empty_like.default,
        aten.new_empty.default, aten.new_zeros.default, aten._pin_memory.default,
    }
)


class Float8ExpertWeight(torch.Tensor):
    """A high-precision expert weight whose matrix products run in FP8.

    Fields: ``_hp``, the plain bf16/fp16/fp32 tensor (E, N, K), or a view/piece of it;
    ``_config``, the :class:`Float8LinearConfig` its GEMMs follow (tensorwise or rowwise
    granularities, dynamic scaling). Every op behaves as on ``_hp``; views, expert
    selection and copies stay wrapped so that the product they reach (``F.linear``,
    ``bmm``, ``grouped_mm``) knows to run in FP8. Serialized as the plain tensor.
    """

    _hp: torch.Tensor
    _config: Float8LinearConfig

    @staticmethod
    def __new__(cls, hp: torch.Tensor, config: Float8LinearConfig) -> Float8ExpertWeight:
        if isinstance(hp, Float8ExpertWeight):
            raise TypeError("Float8ExpertWeight wraps a plain high-precision tensor; got a Float8ExpertWeight")
        if hp.dtype not in HP_DTYPES:
            raise TypeError(f"Float8ExpertWeight wraps a bf16, fp16 or fp32 tensor; got {hp.dtype}")
        self = torch.Tensor._make_wrapper_subclass(
            cls, hp.shape, strides=hp.stride(), storage_offset=hp.storage_offset(), dtype=hp.dtype,
            layout=hp.layout, device=hp.device, requires_grad=hp.requires_grad,
        )
        self._hp = hp
        self._config = config
        return self

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Float8ExpertWeight({self._hp!r})"

    def __reduce_ex__(self, protocol):  # type: ignore[override]
        hp = self._hp
        if isinstance(self, nn.Parameter):
            hp = nn.Parameter(hp, requires_grad=self.requires_grad)
        return hp.__reduce_ex__(protocol)

    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        return ["_hp"], (self._config,)

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: tuple, outer_size: Any, outer_stride: Any) -> Float8ExpertWeight:
        return Float8ExpertWeight(inner["_hp"], *meta)

    # ----------------------------------------------------------------- FSDP2 extension
    # High-precision all-gather (in mp_policy.param_dtype): the gathered weight is wrapped
    # again, so the unsharded experts still multiply in FP8. Here rather than in fsdp.py:
    # plain methods FSDP2 looks up on the parameter, needing nothing from torch.distributed.

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        hp = self._hp
        if mp_policy.param_dtype is not None and hp.dtype != mp_policy.param_dtype:
            hp = hp.to(mp_policy.param_dtype)
        # FSDP pads every shard along dim 0 to the size of the first (ceil(rows / world)).
        rows = -(-outer_size[0] // mesh.size())
        if hp.shape[0] < rows:
            hp = torch.nn.functional.pad(hp, [0, 0] * (hp.dim() - 1) + [0, rows - hp.shape[0]])
        return (hp.contiguous(),), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (data,) = all_gather_outputs
        if out is not None:  # the gathered values already sit in out's storage
            return None
        return Float8ExpertWeight(data, self._config), (data,)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        route = _ROUTES.get(func)
        if route is None and _is_transformers_op(func):
            _register_hf_fallback()  # weights wrapped by hand, not by the converter
            route = _ROUTES.get(func)
        if route is not None:
            return route(args, kwargs or {})
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func in _GEMMS or func.namespace == "transformers":
            raise NotImplementedError(
                f"{func} with an FP8 expert weight would run in high precision. Expert weights multiply "
                f"through F.linear(x, w[e]), torch.bmm, torch.matmul or torch._grouped_mm / F.grouped_mm; "
                f"use w._hp for a high-precision product."
            )
        wrapped: dict[int, Float8ExpertWeight] = {}

        def unwrap(w: Float8ExpertWeight) -> torch.Tensor:
            wrapped.setdefault(id(w._hp), w)
            return w._hp

        kwargs = kwargs or {}
        out = func(*tree_map_only(cls, unwrap, args), **tree_map_only(cls, unwrap, kwargs))
        first = next(iter(wrapped.values()))
        keep = func in _KEEP

        def rewrap(t: torch.Tensor) -> torch.Tensor:
            same = wrapped.get(id(t))
            if same is not None and same._hp is t:
                return same  # an in-place op returns its (wrapped) argument
            if keep and t.dtype in HP_DTYPES:
                return cls(t, first._config)
            return t

        return tree_map_only(torch.Tensor, rewrap, out)


def float8_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, config: Float8LinearConfig | None = None) -> torch.Tensor:
    """``torch._grouped_mm(x, w, offs=offs)`` in FP8, differentiable in ``x`` and ``w``.

    ``x`` (M, K): tokens sorted by expert; ``w`` (G, K, N): a plain tensor or a
    :class:`Float8ExpertWeight` (then its config is used); ``offs`` (G,): cumulative token
    counts (int32 or int64; groups may be empty or of any size). ``config``: the recipe
    for a plain ``w`` (default: tensorwise).
    """
    if isinstance(w, Float8ExpertWeight):
        config = w._config if config is None else config
        w = _Unwrap.apply(w)
    elif config is None:
        config = Float8LinearConfig()
    if x.dim() != 2 or w.dim() != 3 or offs.dim() != 1 or offs.shape[0] != w.shape[0] or x.shape[1] != w.shape[1]:
        raise ValueError(
            f"float8_grouped_mm: expected x (M, K), w (G, K, N), offs (G,); got {tuple(x.shape)}, {tuple(w.shape)}, {tuple(offs.shape)}"
        )
    if offs.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"float8_grouped_mm: offs must be int32 or int64; got {offs.dtype}")
    return _GroupedMMFn.apply(x.to(w.dtype), w, offs.to(torch.int32), config)


# ===================================================================== the converter


def _expert_params(module: nn.Module):
    """(module, fqn prefix, name, param) for every 3D parameter (num_experts, ., .) of an experts module."""
    for mod_fqn, mod in module.named_modules():
        n = getattr(mod, "num_experts", None)
        if not isinstance(n, int) or isinstance(n, bool):
            continue
        for name, p in mod.named_parameters(recurse=False):
            if p.dim() == 3 and p.shape[0] == n:
                yield mod, mod_fqn, name, p


def convert_experts_to_float8(
    module: nn.Module,
    config: Float8LinearConfig,
    experts_filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> list[str]:
    """Wrap every expert weight of ``module`` as a :class:`Float8ExpertWeight`, in place.

    An expert weight is a 3D parameter whose first dim is its module's ``num_experts``
    (how transformers' experts modules store them). Routers and gates (2D) are never
    touched. ``experts_filter_fn(experts_module, param_fqn) -> bool`` chooses which
    convert. Weights whose last two dims are not multiples of 16 stay high precision
    (logged). Returns the converted parameter names.
    """
    if config.any_delayed:
        logger.warning("f8tensor: expert weights left in high precision: delayed scaling is not supported for experts")
        return []
    _register_hf_fallback()
    converted: list[str] = []
    for mod, mod_fqn, name, p in list(_expert_params(module)):
        fqn = f"{mod_fqn}.{name}" if mod_fqn else name
        if isinstance(p, Float8ExpertWeight):
            continue
        if experts_filter_fn is not None and not experts_filter_fn(mod, fqn):
            continue
        if p.shape[1] % _ALIGN or p.shape[2] % _ALIGN:
            logger.warning(
                "f8tensor: left %s %s in high precision: FP8 expert GEMMs need its last two dims to be multiples of %d",
                fqn, tuple(p.shape), _ALIGN,
            )
            continue
        setattr(mod, name, nn.Parameter(Float8ExpertWeight(p.data, config), requires_grad=p.requires_grad))
        converted.append(fqn)
    if converted:
        logger.info("f8tensor: %d expert weights run in FP8: %s", len(converted), ", ".join(converted))
    return converted
