"""FP8 expert weights: the three GEMMs of a mixture-of-experts layer in FP8, model code untouched.

Hugging Face MoE models keep their experts as 3D parameters, ``gate_up_proj`` (E, 2I, H) and
``down_proj`` (E, H, I), and multiply them in one of three ways: a Python loop of
``F.linear(x, w[e])``, ``torch.bmm`` over gathered per-token weights, or
``torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)`` over tokens sorted by expert.
:class:`Float8ExpertWeight` is the parameter that makes all three run in FP8: it behaves
like the plain tensor it wraps (indexing, views, optimizer steps, ``copy_``, checkpoints),
and its ``__torch_function__`` routes ``F.linear``, ``torch.bmm``, ``torch._grouped_mm`` /
``F.grouped_mm`` and transformers' grouped fallback op to autograd Functions whose forward
and both backward GEMMs are FP8, through gemm's front doors for grouped and batched
products (:func:`f8tensor.gemm.grouped_mm`, :func:`f8tensor.gemm.batched_mm`).

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

Every cast is the library's one cast (``tensor.to_float8`` / ``kernels.cast``) with a
:class:`~f8tensor.config.CastSpec` from :meth:`CastConfig.operand_spec` (:func:`_spec`).

Block granularities (``blockwise``: 1x128 activations and gradients, 128x128 weights;
``mxfp8``: 1x32 e8m0) and stochastic rounding: the grouped kernel takes one fp32 scale per
row of ``a`` and per column of ``b`` (:class:`~f8tensor.gemm.rules.GroupedMMRule`, torch
2.11-2.14), so no grouped or batched kernel takes these scales. Such a recipe runs its
experts as a per-expert loop of ``Float8Linear``'s own three GEMMs (:func:`_expert_loop`):
the same casts, bytes and block-scaled products as a dense ``Float8Linear`` with that
recipe, legal ``F.scaled_mm`` calls where the block rules allow them (sm90, 1x128 by
128x128) and the emulated reference product elsewhere, decided by the block rules
(:func:`expert_path` names the path; the converter reports it). The grouped loop reads the
group sizes on the host (one sync per product; under ``torch.compile`` a graph break).

Layer: above ``linear_autograd`` (beside ``linear``); imports ``linear_autograd``, ``weights``, ``gemm``,
``tensor``, ``kernels``, ``scaling``, ``config``, ``compat``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import nn

from f8tensor import compat, kernels
from f8tensor.compat import GROUPED_MM_FUNCTIONS, is_op_of_namespace
from f8tensor.compat import grouped_mm as hp_grouped_mm
from f8tensor.config import CastConfig, CastSpec, Float8LinearConfig, is_tensorwise
from f8tensor.gemm import batched_mm, grouped_mm, scaled_grouped_mm
from f8tensor.gemm.grouped import KERNEL_OUT, grouped_kernel_available, validate_grouped_mm_args
from f8tensor.gemm.operands import col_major, kernel_scale, row_major
from f8tensor.gemm.rules import ALIGN, CudaBuild, block_rule_for
from f8tensor.linear_autograd import LinearArgs
from f8tensor.linear_autograd import QuantizedLinearFn as _QuantizedLinearFn  # the routes look it up here
from f8tensor.scaling import amax_to_scale, group_amax
from f8tensor.tensor import to_float8
from f8tensor.weights import RecipeWeight

__all__ = ["Float8ExpertWeight", "convert_experts_to_float8", "expert_path", "float8_grouped_mm", "per_expert_loop"]

logger = logging.getLogger("f8tensor")
aten = torch.ops.aten


# ===================================================================== casts


def _spec(cast: CastConfig, contracted_dim: int, *, ndim: int = 2, per_expert: bool = False) -> CastSpec:
    """The cast of one operand of a grouped/batched expert GEMM contracted over
    ``contracted_dim``: e4m3 (what the grouped kernel multiplies, grad_output included),
    round-to-nearest, the scales of :meth:`CastConfig.operand_spec` (``per_expert``: a
    weight, one scale set per expert). Block recipes never get here (:func:`per_expert_loop`)."""
    if cast.blockwise:
        raise ValueError(f"block-scaled expert GEMMs run per expert (per_expert_loop); got {cast}")
    spec = cast.operand_spec(contracted_dim, ndim=ndim, per_expert=per_expert)
    return spec._replace(float8_dtype=torch.float8_e4m3fn, rounding="nearest")


def per_expert_loop(config: Float8LinearConfig) -> bool:
    """Whether ``config``'s expert GEMMs run as a per-expert loop of ``Float8Linear``'s GEMMs:
    block scales or stochastic rounding on any operand, which the grouped kernel's one fp32
    scale per row / column cannot express (see the module docstring). Otherwise they run
    as one grouped (or batched) FP8 product.

    Example:
        >>> from f8tensor import Float8LinearConfig
        >>> from f8tensor.moe import per_expert_loop
        >>> per_expert_loop(Float8LinearConfig.from_recipe("rowwise"))
        False
        >>> per_expert_loop(Float8LinearConfig.from_recipe("blockwise"))
        True
    """
    return any(c.blockwise or c.rounding != "nearest" for c in (config.input, config.weight, config.grad_output))


def expert_path(config: Float8LinearConfig, device: torch.device | str) -> str:
    """The path ``config``'s expert GEMMs take on ``device``, in words (the line
    :func:`~f8tensor.convert_to_float8_training` logs): the grouped FP8 kernel, its emulation,
    or a per-expert loop (see :func:`per_expert_loop`) with or without a block-scaled kernel.
    ``device``: a ``torch.device`` or its name.

    Raises:
        RuntimeError: ``device`` is not a device name torch knows.

    Example:
        >>> from f8tensor import Float8LinearConfig
        >>> from f8tensor.moe import expert_path
        >>> expert_path(Float8LinearConfig.from_recipe("tensorwise"), "cpu")
        'grouped FP8 product, emulated (no grouped kernel on this device)'
    """
    device = torch.device(device)
    if not per_expert_loop(config):
        if grouped_kernel_available(device):
            return "grouped FP8 kernel (torch._scaled_grouped_mm)"
        return "grouped FP8 product, emulated (no grouped kernel on this device)"
    reason = "no grouped kernel takes block scales or stochastic rounding"
    if device.type == "cuda" and not config.emulate and _block_kernel_here(config, device):
        return f"per-expert loop of block-scaled F.scaled_mm ({reason})"
    return f"per-expert loop of the emulated block-scaled product ({reason}; no block-scaled kernel here)"


def _block_kernel_here(config: Float8LinearConfig, device: torch.device) -> bool:
    """Whether the forward's block-scaled product has a kernel on ``device`` (the block rules)."""
    a = config.input.operand_spec(1)
    b = config.weight.operand_spec(1)
    rule = block_rule_for(a.block, b.block, a.scale_dtype) if a.scale_dtype == b.scale_dtype else None
    if rule is None:
        return False
    cuda = cast("tuple[int, int]", tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2]))
    return CudaBuild(compat.TORCH_VERSION, cuda, torch.cuda.get_device_capability(device)) in rule.builds


def _expert_loop(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor | None, config: Float8LinearConfig) -> torch.Tensor:
    """The per-expert loop: ``x[rows of g] @ w[g]`` through ``Float8Linear``'s Function.

    ``offs`` given: ``x`` (M, K) sorted by group, ``w`` (G, K, N) (rows past ``offs[-1]``
    give zeros, as the grouped kernel leaves them); ``offs`` None: a batched product, ``x``
    (B, M, K) and ``w`` (B, K, N). Autograd runs each piece's backward: its two FP8 GEMMs.
    """
    if offs is None:
        pieces = [_QuantizedLinearFn.apply(x[b], w[b].transpose(0, 1), None, LinearArgs(config)) for b in range(x.shape[0])]
        return torch.stack(pieces) if pieces else x.new_zeros(0, x.shape[1], w.shape[2])
    ends = offs.tolist()  # the host sync of this path (see the module docstring)
    pieces, start = [], 0
    for g, end in enumerate(ends):
        if end > start:
            pieces.append(_QuantizedLinearFn.apply(x[start:end], w[g].transpose(0, 1), None, LinearArgs(config)))
        start = max(start, end)
    if start < x.shape[0] or not pieces:
        pieces.append(x.new_zeros(x.shape[0] - start, w.shape[2]))
    return torch.cat(pieces)


def _check_contraction(k: int, what: str) -> None:
    if k % ALIGN:
        raise ValueError(
            f"FP8 expert GEMM ({what}): the contraction dim must be a multiple of {ALIGN} "
            f"(torch._scaled_grouped_mm's stride rule); got {k}"
        )


# ===================================================================== grouped GEMMs (2D x 3D, offs)


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
    padded_sizes = (sizes + ALIGN - 1) // ALIGN * ALIGN
    padded_offs = torch.cumsum(padded_sizes, 0)
    rows = torch.arange(m, device=offs.device)
    gid = torch.searchsorted(o, rows, right=True)
    gid_c = gid.clamp(max=g - 1)
    p = (m + ALIGN - 1) // ALIGN * ALIGN + ALIGN * g + ALIGN
    dest = (padded_offs - padded_sizes)[gid_c] + rows - (o - sizes)[gid_c]
    dest = torch.where(gid < g, dest, p - 1)
    return dest, padded_offs.to(torch.int32), p


def _scatter_rows(t: torch.Tensor, dest: torch.Tensor, p: int) -> torch.Tensor:
    """``t`` (M, C) placed at rows ``dest`` of a zero (P, C) tensor (FP8 through its bytes)."""
    if t.dtype.itemsize == 1 and t.dtype.is_floating_point:
        raw = t.view(torch.uint8).new_zeros(p, t.shape[1]).index_copy_(0, dest, t.view(torch.uint8))
        return raw.view(t.dtype)
    return t.new_zeros(p, t.shape[1]).index_copy_(0, dest, t)



def _group_cast(t: torch.Tensor, offs: torch.Tensor, g: int, spec: CastSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, C) rows grouped by ``offs``: FP8 data and a (G, C) scale (rowwise: per group and
    column, from the amax of the group's rows). Tensorwise: one scale for the tensor,
    broadcast to (G, C)."""
    p, c = t.shape
    if is_tensorwise(spec.block):
        data, scale = kernels.cast(t, spec)
        return data, scale.expand(g, c)
    gid = torch.searchsorted(offs.to(torch.int64), torch.arange(p, device=t.device), right=True)  # G: no group
    scale = amax_to_scale(group_amax(t, gid, g + 1), spec.float8_dtype, round_pow2=spec.power_of_2)
    # Each row with its group's scales: a given scale per element (block (1, 1)).
    data, _ = kernels.cast(t, spec._replace(block=(1, 1)), scale[gid])
    return data, scale[:g]


def _grouped_wgrad(
    x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    grad: torch.Tensor,
    offs: torch.Tensor,
    g: int,
    config: Float8LinearConfig,
) -> torch.Tensor:
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
        x8, xs = _group_cast(_scatter_rows(x, dest, p), poffs, g, _spec(config.input, 0))  # (P, K), (G, K)
    g8, gs = _group_cast(gp, poffs, g, _spec(config.grad_output, 0))  # (P, N), (G, N)
    k, n = x8.shape[1], g8.shape[1]
    sa, sb = kernel_scale(xs.reciprocal(), (g, k), (g * k,)), kernel_scale(gs.reciprocal(), (g, n), (g * n,))
    return scaled_grouped_mm(row_major(x8.t()), col_major(g8), sa, sb, poffs, KERNEL_OUT)


class _GroupedMMFn(torch.autograd.Function):
    """``y = grouped_mm(x, w, offs)`` with x (M, K) sorted by expert and w (G, K, N), all GEMMs FP8.

    Saved for backward: w (the parameter's own view: no extra memory), offs, for a
    tensorwise weight its per-expert scales (backward re-casts the very same bytes), and x:
    with a tensorwise input its FP8 bytes and scale (the weight-gradient GEMM takes them as
    they are), else in high precision (re-cast per expert group there).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, config: Float8LinearConfig
    ) -> torch.Tensor:
        _check_contraction(x.shape[1], "forward")
        x8 = to_float8(x, _spec(config.input, 1))
        # weights: per expert (tensorwise) or per expert and output feature (rowwise), constant along K
        w8 = to_float8(w, _spec(config.weight, 1, ndim=3, per_expert=True))
        out = grouped_mm(x8, w8, offs, KERNEL_OUT)
        keep_fp8_x = not config.input.rowwise and not config.weight_grad_in_hp
        ctx.save_for_backward(
            None if keep_fp8_x else x, x8._data if keep_fp8_x else None, x8._scale if keep_fp8_x else None,
            w, offs, None if config.weight.rowwise else w8._scale,
        )
        ctx.config = config
        ctx.x_dtype = x.dtype
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, x8, xs, w, offs, ws = ctx.saved_tensors
        x_dtype = ctx.x_dtype
        config: Float8LinearConfig = ctx.config
        g, _, n = w.shape
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            _check_contraction(n, "input gradient")
            g8 = to_float8(grad, _spec(config.grad_output, 1))
            # (G, N, K): contraction over N; rowwise: per expert and input feature, constant
            # along N; tensorwise: the forward's per-expert scales, the same bytes.
            wt = w.transpose(-2, -1)
            wt8 = to_float8(wt, _spec(config.weight, 1, ndim=3, per_expert=True), scale=None if ws is None else ws.transpose(-2, -1))
            grad_x = grouped_mm(g8, wt8, offs, KERNEL_OUT).to(x_dtype)
        if ctx.needs_input_grad[1]:
            if config.weight_grad_in_hp:
                dest, poffs, p = _pad_groups(offs, x.shape[0])
                xp, gp = _scatter_rows(x, dest, p), _scatter_rows(grad.to(x.dtype), dest, p)
                grad_w = hp_grouped_mm(xp.t().contiguous(), gp, poffs)
            else:
                grad_w = _grouped_wgrad((x8, xs) if x is None else x, grad, offs, g, config)
            grad_w = grad_w.to(w.dtype)
        return grad_x, grad_w, None, None


# ===================================================================== batched GEMMs (bmm)


def _bmm_fp8(a: torch.Tensor, b: torch.Tensor, a_spec: CastSpec, b_spec: CastSpec) -> torch.Tensor:
    """FP8 ``a (B, M, K) @ b (B, K, N)``, each cast per its spec (scales constant along K)."""
    k = a.shape[2]
    pad = (-k) % ALIGN  # only the weight-gradient GEMM of one-token batches needs it (K = M = 1)
    if pad:
        a = torch.nn.functional.pad(a, (0, pad))
        b = torch.nn.functional.pad(b, (0, 0, 0, pad))
    return batched_mm(to_float8(a, a_spec), to_float8(b, b_spec), KERNEL_OUT)


class _ExpertBmmFn(torch.autograd.Function):
    """``x (B, M, K) @ w (B, K, N)`` where w holds one expert matrix per batch entry, all GEMMs FP8.

    Weight scales: per batch entry (tensorwise; a gathered expert keeps its expert's
    amax) or per entry and output column (rowwise). Activation scales: per tensor or per row.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, config: Float8LinearConfig) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.config = config
        _check_contraction(x.shape[2], "batched forward")
        _check_contraction(w.shape[2], "batched input gradient, checked in forward")
        w_spec = _spec(config.weight, 1, ndim=3, per_expert=True)
        return _bmm_fp8(x, w, _spec(config.input, 2, ndim=3), w_spec).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        c: Float8LinearConfig = ctx.config
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # grad (B, M, N) @ w^T (B, N, K): contraction over N
            _check_contraction(w.shape[2], "batched input gradient")
            w_spec = _spec(c.weight, 1, ndim=3, per_expert=True)
            grad_x = _bmm_fp8(grad, w.transpose(1, 2), _spec(c.grad_output, 2, ndim=3), w_spec).to(x.dtype)
        if ctx.needs_input_grad[1]:  # x^T (B, K, M) @ grad (B, M, N): contraction over M
            a_spec, b_spec = _spec(c.input, 2, ndim=3), _spec(c.grad_output, 1, ndim=3)
            grad_w = _bmm_fp8(x.transpose(1, 2), grad, a_spec, b_spec).to(w.dtype)
        return grad_x, grad_w, None


# ===================================================================== the parameter wrapper


class _Unwrap(torch.autograd.Function):
    """The plain tensor inside a :class:`Float8ExpertWeight`, with the gradient passed through."""

    @staticmethod
    def forward(ctx: Any, w: Float8ExpertWeight) -> torch.Tensor:  # type: ignore[override]
        # Through dispatch (view.dtype is neither in VIEWS nor COPIES: the result is the plain
        # alias of _hp), not through the attribute: torch.export traces above the subclass,
        # where ``w._hp`` would be an untracked tensor (lifted as a constant).
        return w.view(w.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
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
    bmm = (lambda x, w: _expert_loop(x, w, None, config)) if per_expert_loop(config) else (
        lambda x, w: _ExpertBmmFn.apply(x, w, config)
    )
    if isinstance(b, Float8ExpertWeight):
        return bmm(a, _Unwrap.apply(b))
    # weight on the left (HF's default layout: w (B, N, K) @ x (B, K, 1)): transpose the product
    return bmm(b.transpose(1, 2), _Unwrap.apply(a).transpose(1, 2)).transpose(1, 2)


def _route_linear(args: tuple, kwargs: dict) -> torch.Tensor:
    bound = dict(zip(("input", "weight", "bias"), args))
    bound.update(kwargs)
    x, w, bias = bound["input"], bound["weight"], bound.get("bias")
    if not isinstance(w, Float8ExpertWeight) or w.dim() != 2 or isinstance(x, Float8ExpertWeight):
        raise NotImplementedError(f"F.linear with an FP8 expert weight needs one expert's 2D matrix as weight; got {tuple(w.shape)}")
    # One expert's matrix: exactly Float8Linear's three GEMMs (and its recipe, e5m2 gradients included).
    return _QuantizedLinearFn.apply(x, _Unwrap.apply(w), _plain(bias), LinearArgs(w._config))


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
    **{fn: _route_grouped_mm for fn in GROUPED_MM_FUNCTIONS},
    torch.bmm: _route_bmm,
    torch.Tensor.bmm: _route_bmm,
    torch.nn.functional.linear: _route_linear,
    torch.matmul: _route_matmul,
    torch.Tensor.matmul: _route_matmul,
    torch.Tensor.__matmul__: _route_matmul,
}


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



class Float8ExpertWeight(RecipeWeight):
    """A high-precision expert weight whose matrix products run in FP8.

    Fields: ``_hp``, the plain bf16/fp16/fp32 tensor (E, N, K), or a view/piece of it;
    ``_config``, the :class:`Float8LinearConfig` its GEMMs follow (dynamic scaling, any
    granularity: block recipes take the per-expert loop, see :func:`per_expert_loop`).
    Every op behaves as on ``_hp`` (see :class:`~f8tensor.weights.HighPrecisionWeight`);
    views, expert selection and copies stay wrapped so that the product they reach
    (``F.linear``, ``bmm``, ``grouped_mm``) knows to run in FP8. A ``state_dict`` holds the
    plain tensor; a parameter pickles wrapped (whole-model copies stay FP8); setting its
    data to a plain tensor of another dtype (``model.double()``) is refused.

    Raises:
        NotImplementedError: a product this weight cannot run in FP8 (it names the op and the
            ways an expert weight multiplies), instead of a silent high-precision product.
        TypeError: its data set to a tensor of another dtype (``model.double()``).
    """

    _config: Float8LinearConfig

    # Ops whose result is still (a piece of) the weight: views, indexing of experts, copies.
    VIEWS = frozenset(
        {
            aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
            aten.as_strided.default, aten.slice.Tensor, aten.select.int, aten.transpose.int, aten.t.default,
            aten.permute.default, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim,
            aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int,
        }
    )
    COPIES = frozenset(
        {
            aten.index.Tensor, aten.clone.default, aten._to_copy.default, aten.empty_like.default,
            aten.new_empty.default, aten.new_zeros.default, aten._pin_memory.default,
        }
    )

    # ----------------------------------------------------------------- FSDP2 extension
    # High-precision all-gather (in mp_policy.param_dtype): the gathered weight is wrapped
    # again, so the unsharded experts still multiply in FP8. Here rather than in distributed/fsdp.py:
    # plain methods FSDP2 looks up on the parameter, needing nothing from torch.distributed.

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: nn.Module, mp_policy: Any
    ) -> tuple[tuple[torch.Tensor, ...], None]:
        hp = self._hp
        if mp_policy.param_dtype is not None and hp.dtype != mp_policy.param_dtype:
            hp = hp.to(mp_policy.param_dtype)
        # FSDP pads every shard along dim 0 to the size of the first (ceil(rows / world)).
        rows = -(-outer_size[0] // mesh.size())
        if hp.shape[0] < rows:
            hp = torch.nn.functional.pad(hp, [0, 0] * (hp.dim() - 1) + [0, rows - hp.shape[0]])
        return (hp.contiguous(),), None

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[Float8ExpertWeight, tuple[torch.Tensor, ...]] | None:
        (data,) = all_gather_outputs
        if out is not None:  # the gathered values already sit in out's storage
            return None
        return Float8ExpertWeight(data, self._config), (data,)

    @classmethod
    def _route(cls, func: Any) -> Any:
        route = _ROUTES.get(func)
        if route is None and is_op_of_namespace(func, "transformers"):
            _register_hf_fallback()  # weights wrapped by hand, not by the converter
            route = _ROUTES.get(func)
        return route

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:  # type: ignore[override]
        if func in _GEMMS or is_op_of_namespace(func, "transformers"):
            raise NotImplementedError(
                f"{func} with an FP8 expert weight would run in high precision. Expert weights multiply "
                f"through F.linear(x, w[e]), torch.bmm, torch.matmul or torch._grouped_mm / F.grouped_mm; "
                f"use w._hp for a high-precision product."
            )
        return super().__torch_dispatch__(func, types, args, kwargs)




def _rebuild_expert_parameter(hp: torch.Tensor, config: Float8LinearConfig, requires_grad: bool) -> nn.Parameter:
    """Unpickling a :class:`Float8ExpertWeight` parameter pickled before
    :class:`~f8tensor.weights.RecipeWeight` (whole-model pickles of earlier releases)."""
    return nn.Parameter(Float8ExpertWeight(hp, config), requires_grad=requires_grad)


_EXPERT_CONFIGS = "_float8_expert_configs"  # experts module attribute: {param name: config}


def _plain_expert_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """state_dict post-hook of an experts module: its FP8 expert weights are saved as the
    plain tensors they wrap (what transformers' ``save_pretrained`` and every checkpoint
    writer expect: ordinary storages). ``keep_vars=True`` gives the parameters as they are."""
    for name in getattr(module, _EXPERT_CONFIGS, {}):
        value = state_dict.get(prefix + name)
        if isinstance(value, Float8ExpertWeight) and not isinstance(value, nn.Parameter):
            state_dict[prefix + name] = value._hp.detach()


def _rewrap_after_load(module: nn.Module, incompatible_keys: Any) -> None:
    """load_state_dict post-hook of an experts module: ``assign=True`` replaces parameters by
    the loaded (plain) tensors; each expert weight that was FP8 is wrapped again, with its
    recipe, so the model keeps training its experts in FP8 (``float8_converted_fqns`` stays
    true)."""
    for name, config in getattr(module, _EXPERT_CONFIGS, {}).items():
        p = module._parameters.get(name)
        if p is not None and not isinstance(p, Float8ExpertWeight):
            module._parameters[name] = nn.Parameter(Float8ExpertWeight(p.data, config), requires_grad=p.requires_grad)


def float8_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, config: Float8LinearConfig | None = None) -> torch.Tensor:
    """``torch._grouped_mm(x, w, offs=offs)`` in FP8, differentiable in ``x`` and ``w``.

    ``x`` (M, K): tokens sorted by expert; ``w`` (G, K, N): a plain tensor or a
    :class:`Float8ExpertWeight` (then its config is used); ``offs`` (G,): cumulative token
    counts (an integer tensor or a list of ints; groups may be empty or of any size).
    ``config``: the recipe for a plain ``w`` (default: tensorwise). Validated like
    ``Float8Linear``'s inputs (:func:`f8tensor.gemm.grouped.validate_grouped_mm_args`): K and
    N multiples of 16 (checked here, in forward), bf16/fp16/fp32 operands.

    Raises:
        TypeError: ``x`` or ``w`` not a bf16/fp16/fp32 tensor, ``offs`` neither an integer
            tensor nor a list of ints, or ``config`` not a :class:`Float8LinearConfig`.
        ValueError: shapes that are not ``(M, K)``, ``(G, K, N)``, ``(G,)``; K or N not a
            multiple of 16; ``offs`` decreasing or outside [0, M] (on CPU at once; on CUDA
            and under ``torch.compile`` by an asynchronous device assert).

    Example:
        >>> from f8tensor import float8_grouped_mm
        >>> x = torch.randn(48, 32, dtype=torch.bfloat16, requires_grad=True)
        >>> w = torch.randn(3, 32, 64, dtype=torch.bfloat16, requires_grad=True)
        >>> offs = torch.tensor([16, 16, 48], dtype=torch.int32)  # expert 1 gets no token
        >>> y = float8_grouped_mm(x, w, offs)
        >>> y.sum().backward()
        >>> y.shape, x.grad.shape, w.grad.shape
        (torch.Size([48, 64]), torch.Size([48, 32]), torch.Size([3, 32, 64]))
    """
    if isinstance(w, Float8ExpertWeight):
        config = w._config if config is None else config
        w = _Unwrap.apply(w)
    elif config is None:
        config = Float8LinearConfig()
    offs = validate_grouped_mm_args(x, w, offs, config)
    if per_expert_loop(config):
        return _expert_loop(x.to(w.dtype), w, offs, config)
    return _GroupedMMFn.apply(x.to(w.dtype), w, offs, config)


# ===================================================================== the converter


def _expert_params(module: nn.Module) -> Iterator[tuple[nn.Module, str, str, nn.Parameter]]:
    """(module, fqn prefix, name, param) for every 3D parameter (num_experts, ., .) of an experts module."""
    for mod_fqn, mod in module.named_modules():
        n = getattr(mod, "num_experts", None)
        if not isinstance(n, int) or isinstance(n, bool):
            continue
        for name, p in mod.named_parameters(recurse=False):
            if p.dim() == 3 and p.shape[0] == n:
                yield mod, mod_fqn, name, p


def plan_experts(
    module: nn.Module,
    config: Float8LinearConfig,
    experts_filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> tuple[list[tuple[nn.Module, str, str]], dict[str, list[str]]]:
    """What :func:`convert_experts_to_float8` would do, without changing ``module``.

    Returns the ``(experts module, parameter name, fqn)`` to wrap and the skipped fqns by
    reason. Every ``experts_filter_fn`` call happens here, so a filter that raises leaves
    the model untouched. Already wrapped weights are neither (the converter counts them).
    """
    todo: list[tuple[nn.Module, str, str]] = []
    skipped: dict[str, list[str]] = {}
    for mod, mod_fqn, name, p in list(_expert_params(module)):
        fqn = f"{mod_fqn}.{name}" if mod_fqn else name
        if isinstance(p, Float8ExpertWeight):
            continue
        if config.any_delayed:
            skipped.setdefault("expert weights (delayed scaling is not supported for experts)", []).append(fqn)
            continue
        if experts_filter_fn is not None and not experts_filter_fn(mod, fqn):
            skipped.setdefault("rejected by experts_filter_fn", []).append(fqn)
            continue
        if p.shape[1] % ALIGN or p.shape[2] % ALIGN:
            logger.warning(
                "f8tensor: left %s %s in high precision: FP8 expert GEMMs need its last two dims to be multiples of %d",
                fqn, tuple(p.shape), ALIGN,
            )
            skipped.setdefault(f"expert weights with dims not multiples of {ALIGN}", []).append(fqn)
            continue
        todo.append((mod, name, fqn))
    return todo, skipped


def wrap_experts(todo: list[tuple[nn.Module, str, str]], config: Float8LinearConfig) -> list[str]:
    """Wrap the weights :func:`plan_experts` chose, in place; returns their fqns."""
    if todo:
        _register_hf_fallback()
    for mod, name, _ in todo:
        p = getattr(mod, name)
        setattr(mod, name, nn.Parameter(Float8ExpertWeight(p.data, config), requires_grad=p.requires_grad))
        if not hasattr(mod, _EXPERT_CONFIGS):
            setattr(mod, _EXPERT_CONFIGS, {})
            mod.register_state_dict_post_hook(_plain_expert_state)
            mod.register_load_state_dict_post_hook(_rewrap_after_load)
        getattr(mod, _EXPERT_CONFIGS)[name] = config
    return [fqn for _, _, fqn in todo]


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
    (logged), and so does every expert weight under a delayed recipe (logged, only when
    the model has expert weights). Returns the converted parameter names.

    Raises:
        TypeError: ``experts_filter_fn`` is neither None nor callable.
    """
    if experts_filter_fn is not None and not callable(experts_filter_fn):
        raise TypeError(f"experts_filter_fn must be a callable (module, fqn) -> bool or None; got {experts_filter_fn!r}")
    todo, skipped = plan_experts(module, config, experts_filter_fn)
    for reason, fqns in skipped.items():
        if reason.startswith("expert weights (delayed"):
            logger.warning("f8tensor: %d expert weights left in high precision: delayed scaling is not supported for experts", len(fqns))
    converted = wrap_experts(todo, config)
    if converted:
        logger.info(
            "f8tensor: %d expert weights run in FP8: %s; path: %s",
            len(converted), ", ".join(converted), expert_path(config, module.get_parameter(converted[0]).device),
        )
    return converted
