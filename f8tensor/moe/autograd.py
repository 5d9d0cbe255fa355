"""The expert GEMMs in FP8: the grouped and batched autograd Functions and the per-expert loop."""

from __future__ import annotations

from typing import Any

import torch

from f8tensor import compat
from f8tensor.compat import grouped_mm as hp_grouped_mm
from f8tensor.gemm import batched_mm, grouped_mm, scaled_grouped_mm
from f8tensor.gemm.check import is_col_major, is_row_major
from f8tensor.gemm.grouped import KERNEL_OUT, grouped_kernel_available, in_dtype
from f8tensor.gemm.operands import col_major, kernel_scale, row_major
from f8tensor.gemm.rules import ALIGN, block_rule_for, build_of
from f8tensor.nn.linear_autograd import LinearArgs
from f8tensor.nn.linear_autograd import QuantizedLinearFn as _QuantizedLinearFn  # looked up at call time, here
from f8tensor.quant.block_quantizers import BlockQuantizer
from f8tensor.quant.config import DEFAULT_GEMM, CastConfig, Float8LinearConfig
from f8tensor.quant.quantizers import quantize
from f8tensor.quant.scaling import materialized, segment_amax
from f8tensor.quant.specs import CastSpec, is_tensorwise
from f8tensor.tensor.float8 import Float8Tensor
from f8tensor.tensor.ops import _permuted

__all__ = ["expert_path", "per_expert_loop"]
# The traced code writes ALIGN as the literal 16: each global read is a guard.
assert ALIGN == 16, ALIGN


# ===================================================================== casts


def _spec(cast: CastConfig, contracted_dim: int, *, ndim: int, per_expert: bool) -> CastSpec:
    """The cast of one grouped/batched GEMM operand contracted over ``contracted_dim``.

    Always e4m3 (the grouped kernel multiplies no e5m2) and round-to-nearest; ``per_expert``:
    one scale set per expert. Block recipes never get here.
    """
    if cast.blockwise:
        raise ValueError(f"block-scaled expert GEMMs run per expert (per_expert_loop); got {cast}")
    spec = cast.operand_spec(contracted_dim, ndim=ndim, per_expert=per_expert)
    return spec._replace(float8_dtype=torch.float8_e4m3fn, rounding="nearest")


def _cast(hp: torch.Tensor, spec: CastSpec, scale: torch.Tensor | None) -> Float8Tensor:
    """:func:`quantize`, every argument given: traced, each default read is a guard."""
    return quantize(
        hp, spec, DEFAULT_GEMM, scale=scale, stats=None, amax=None, layouts="natural", column_major_gemm=None
    )[0]


def _stored_transposed(t: torch.Tensor) -> bool:
    """Whether ``t``'s last two dims are stored column-major only (an (E, N, K) weight seen as (E, K, N))."""
    return t.dim() >= 2 and is_col_major(t) and not is_row_major(t)


def _cast_stored(t: torch.Tensor, spec: CastSpec, scale: torch.Tensor | None) -> Float8Tensor:
    """``t`` (3D) cast per ``spec`` in the order its bytes are stored.

    A transposed view is cast as the tensor it views and transposed back: the same bits, a
    contiguous amax, and column-major FP8 bytes with no copy.
    """
    if not _stored_transposed(t):
        return _cast(t, spec, scale)
    b = spec.block
    swapped = spec._replace(block=(*b[:-2], b[-1], b[-2])) if b else spec
    natural = _cast(t.transpose(-2, -1), swapped, None if scale is None else scale.transpose(-2, -1))
    # Rebuilt from fields: torch.export's trace returns NotImplemented for a view op here.
    perm = [*range(t.dim() - 2), t.dim() - 1, t.dim() - 2]
    return _permuted(natural, natural._data.transpose(-2, -1), perm)


def _cast_weight(w: torch.Tensor, cast: CastConfig, scale: torch.Tensor | None) -> Float8Tensor:
    """An expert weight (E, K, N) cast per expert in its stored order."""
    return _cast_stored(w, _spec(cast, 1, ndim=3, per_expert=True), scale)


@compat.constant_per_config
def per_expert_loop(config: Float8LinearConfig) -> bool:
    """Whether ``config``'s expert GEMMs run as a per-expert loop of ``Float8Linear``'s GEMMs.

    True for block scales, stochastic rounding, per-GEMM formats or FP4, which no grouped
    kernel takes. Traced, a constant per config.

    Example:
        >>> from f8tensor import Float8LinearConfig
        >>> from f8tensor.moe import per_expert_loop
        >>> per_expert_loop(Float8LinearConfig.from_recipe("blockwise"))
        True
    """
    roles = (config.input, config.weight, config.grad_output)
    return config.uses_gemm_formats or any(c.blockwise or c.rounding != "nearest" for c in roles)


def expert_path(config: Float8LinearConfig, device: torch.device | str) -> str:
    """The path ``config``'s expert GEMMs take on ``device`` (a device or its name), in words.

    Raises:
        RuntimeError: an unknown device name.

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
    if config.uses_gemm_formats:
        return "per-expert loop of Float8Linear's per-GEMM-format GEMMs (no grouped kernel takes them)"
    reason = "no grouped kernel takes block scales or stochastic rounding"
    if device.type == "cuda" and not config.emulate and _block_kernel_here(config, device):
        return f"per-expert loop of block-scaled F.scaled_mm ({reason})"
    return f"per-expert loop of the emulated block-scaled product ({reason}; no block-scaled kernel here)"


def _block_kernel_here(config: Float8LinearConfig, device: torch.device) -> bool:
    """Whether the forward's block-scaled product has a kernel on ``device``."""
    a = config.input.operand_spec(1)
    b = config.weight.operand_spec(1)
    rule = block_rule_for(a.block, b.block, a.scale_dtype) if a.scale_dtype == b.scale_dtype else None
    if rule is None:
        return False
    return build_of(device) in rule.builds


def _expert_loop(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor | None, config: Float8LinearConfig
) -> torch.Tensor:
    """``x[rows of g] @ w[g]`` per expert through ``Float8Linear``'s Function.

    ``offs`` given: x (M, K) sorted by group, w (G, K, N), rows past ``offs[-1]`` give zeros;
    ``offs`` None: a batched product (B, M, K) @ (B, K, N).
    """
    if offs is None:
        pieces = [
            _QuantizedLinearFn.apply(x[b], w[b].transpose(0, 1), None, LinearArgs(config)) for b in range(x.shape[0])
        ]
        return torch.stack(pieces) if pieces else x.new_zeros(0, x.shape[1], w.shape[2])
    ends = offs.tolist()  # this path's one host sync (a graph break under compile)
    pieces, start = [], 0
    for g, end in enumerate(ends):
        if end > start:
            pieces.append(_QuantizedLinearFn.apply(x[start:end], w[g].transpose(0, 1), None, LinearArgs(config)))
        start = max(start, end)
    if start < x.shape[0] or not pieces:
        pieces.append(x.new_zeros(x.shape[0] - start, w.shape[2]))
    return torch.cat(pieces)


def _check_contraction(k: int, what: str) -> None:
    if k % 16:  # ALIGN
        raise ValueError(
            f"FP8 expert GEMM ({what}): the contraction dim must be a multiple of {ALIGN} "
            f"(torch._scaled_grouped_mm's stride rule); got {k}"
        )


# ===================================================================== grouped GEMMs (2D x 3D, offs)


def _pad_groups(offs: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Where each row of a layout giving every group a multiple of 16 rows comes from.

    Returns:
        ``src`` (P,): each padded row's source row; ``pad`` (P, 1): True for padding (zero)
        rows; ``padded_offs`` (G,) int32; a static row count P (no host sync). Rows past
        ``offs[-1]`` are in no group.
    """
    g = offs.shape[0]
    o = offs.to(torch.int64)
    sizes = torch.diff(o, prepend=o.new_zeros(1))
    padded_sizes = (sizes + 15) // 16 * 16  # 16: ALIGN
    padded_offs = torch.cumsum(padded_sizes, 0)
    p = (m + 15) // 16 * 16 + 16 * g + 16
    rows = torch.arange(p, device=offs.device)
    gid = torch.searchsorted(padded_offs, rows, right=True)
    gid_c = gid.clamp(max=g - 1)
    local = rows - (padded_offs - padded_sizes)[gid_c]
    pad = local >= sizes[gid_c]  # past the last group too: there local >= its padded size
    src = ((o - sizes)[gid_c] + local).masked_fill(pad, 0)
    return src, pad.unsqueeze(1), padded_offs.to(torch.int32), p


def _padded(t: torch.Tensor, src: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """``t`` (M, C) in the padded (P, C) layout of :func:`_pad_groups` (FP8 through its bytes,
    not cast again): a gather."""
    if t.dtype.itemsize == 1 and t.dtype.is_floating_point:
        return _padded(materialized(t, None).view(torch.uint8), src, pad).view(t.dtype)
    return t[src].masked_fill_(pad, 0)


def _padded_to_cast(t: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """:func:`_padded` for a group cast: a row's source is its index less the padding rows up
    to it. Traced, the gather reads one scan besides ``t``: inductor folds it into the cast's
    passes (it wrote a padded copy of a gather reading more buffers)."""
    pads = torch.cumsum(pad.squeeze(1), 0)
    again = torch.diff(pads, prepend=pads.new_zeros(1)) != 0  # == pad
    src = torch.arange(pads.shape[0], device=pads.device) - pads
    return _padded(t, src.masked_fill(again, 0), again.unsqueeze(1))


def _group_cast(t: torch.Tensor, offs: torch.Tensor, g: int, spec: CastSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, C) padded rows cast per group: FP8 data and a (G, C) scale."""
    p, c = t.shape
    quantizer = BlockQuantizer(spec)
    if is_tensorwise(spec.block):
        data, scale = quantizer.quantize(t)
        return data, scale.expand(g, c)
    o = offs.to(torch.int64)
    # The groups' row counts, then the rows past offs[-1].
    lengths = torch.diff(o, prepend=o.new_zeros(1), append=o.new_full((1,), p))
    amax = segment_amax(t, lengths, rows_per_chunk=16)  # (G + 1, C); 16: ALIGN
    scale = quantizer.scale_for(amax)
    gid = torch.searchsorted(o, torch.arange(p, device=t.device), right=True)
    data, _ = quantizer.with_block((1, 1)).quantize(t, scale[gid])
    return data, scale[:g]


def _grouped_wgrad(
    x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    grad: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    offs: torch.Tensor,
    g: int,
    config: Float8LinearConfig,
    transposed: bool = False,
) -> torch.Tensor:
    """FP8 ``x[group].t() @ grad[group]`` per group: (G, K, N), in bf16.

    ``x``, ``grad``: high precision, or tensorwise ``(FP8 data, scale)`` (the forward's x, the
    input gradient's grad), placed in the padded layout as bytes. ``transposed``: the
    result is laid out as a (G, N, K)-stored weight, so autograd makes no transposing copy.
    """
    src, pad, poffs, _ = _pad_groups(offs, (grad[0] if isinstance(grad, tuple) else grad).shape[0])
    if isinstance(x, tuple):
        x8, scale = x
        x8, xs = _padded(x8, src, pad), scale.expand(g, x8.shape[1])
    else:
        x8, xs = _group_cast(
            _padded_to_cast(x, pad), poffs, g, _spec(config.input, 0, ndim=2, per_expert=False)
        )  # (P, K), (G, K)
    if isinstance(grad, tuple):
        g8, scale = grad
        g8, gs = _padded(g8, src, pad), scale.expand(g, g8.shape[1])
    else:
        g8, gs = _group_cast(
            _padded_to_cast(grad, pad), poffs, g, _spec(config.grad_output, 0, ndim=2, per_expert=False)
        )  # (P, N), (G, N)
    k, n = x8.shape[1], g8.shape[1]
    sa, sb = kernel_scale(xs.reciprocal(), (g, k), (g * k,)), kernel_scale(gs.reciprocal(), (g, n), (g * n,))
    compiling = torch.compiler.is_compiling()
    if transposed:
        return scaled_grouped_mm(
            row_major(g8.t(), compiling), col_major(x8, compiling), sb, sa, poffs, KERNEL_OUT
        ).transpose(-2, -1)
    return scaled_grouped_mm(row_major(x8.t(), compiling), col_major(g8, compiling), sa, sb, poffs, KERNEL_OUT)


class _GroupedMMFn(torch.autograd.Function):
    """``y = grouped_mm(x, w, offs)``, x (M, K) sorted by expert, w (G, K, N); all GEMMs FP8.

    Saves x's FP8 bytes for a tensorwise input (else x), and a tensorwise weight's scales, so
    backward multiplies the forward's bytes.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, config: Float8LinearConfig
    ) -> torch.Tensor:
        _check_contraction(x.shape[1], "forward")
        x8 = _cast(x, _spec(config.input, 1, ndim=2, per_expert=False), None)
        w8 = _cast_weight(w, config.weight, None)
        out = grouped_mm(x8, w8, offs, KERNEL_OUT)
        keep_fp8_x = not config.input.rowwise and not config.weight_grad_in_hp
        ctx.save_for_backward(
            None if keep_fp8_x else x,
            x8._data if keep_fp8_x else None,
            x8._scale if keep_fp8_x else None,
            w,
            offs,
            None if config.weight.rowwise else w8._scale,
        )
        ctx.config = config
        ctx.x_dtype = x.dtype
        return in_dtype(out, x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, x8, xs, w, offs, ws = ctx.saved_tensors
        x_dtype = ctx.x_dtype
        config: Float8LinearConfig = ctx.config
        g, _, n = w.shape
        grad_x = grad_w = g8 = None
        if ctx.needs_input_grad[0]:
            _check_contraction(n, "input gradient")
            g8 = _cast(grad, _spec(config.grad_output, 1, ndim=2, per_expert=False), None)
            # (G, N, K), contracted over N; tensorwise reuses the forward's scales.
            wt = w.transpose(-2, -1)
            wt8 = _cast_weight(wt, config.weight, None if ws is None else ws.transpose(-2, -1))
            grad_x = grouped_mm(g8, wt8, offs, KERNEL_OUT).to(x_dtype)
        if ctx.needs_input_grad[1]:
            transposed = _stored_transposed(w)
            if config.weight_grad_in_hp:
                # bf16's own derivative: any group size.
                grad = grad.to(x.dtype)
                if transposed:
                    grad_w = hp_grouped_mm(grad.t(), x, offs).transpose(-2, -1)
                else:
                    grad_w = hp_grouped_mm(x.t(), grad, offs)
            else:
                # A tensorwise gradient's bytes serve both products (its scale has no group).
                g_w = (g8._data, g8._scale) if g8 is not None and g8._scale.numel() == 1 else grad
                grad_w = _grouped_wgrad((x8, xs) if x is None else x, g_w, offs, g, config, transposed)
            grad_w = grad_w.to(w.dtype)
        return grad_x, grad_w, None, None


# ===================================================================== batched GEMMs (bmm)


def _bmm_fp8(a: torch.Tensor, b: torch.Tensor, a_spec: CastSpec, b_spec: CastSpec) -> torch.Tensor:
    """FP8 ``a (B, M, K) @ b (B, K, N)``, each cast per its spec."""
    k = a.shape[2]
    pad = (-k) % ALIGN  # only the weight-gradient GEMM of one-token batches needs it (K = M = 1)
    if pad:
        a = torch.nn.functional.pad(a, (0, pad))
        b = torch.nn.functional.pad(b, (0, 0, 0, pad))
    return batched_mm(_cast_stored(a, a_spec, None), _cast_stored(b, b_spec, None), KERNEL_OUT)


class _ExpertBmmFn(torch.autograd.Function):
    """``x (B, M, K) @ w (B, K, N)``, one expert matrix per batch entry; all GEMMs FP8.

    Weight scales per entry (tensorwise) or per entry and output column (rowwise).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, config: Float8LinearConfig) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.config = config
        _check_contraction(x.shape[2], "batched forward")
        _check_contraction(w.shape[2], "batched input gradient, checked in forward")
        w_spec = _spec(config.weight, 1, ndim=3, per_expert=True)
        return in_dtype(_bmm_fp8(x, w, _spec(config.input, 2, ndim=3, per_expert=False), w_spec), x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        c: Float8LinearConfig = ctx.config
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # grad (B, M, N) @ w^T (B, N, K): contraction over N
            _check_contraction(w.shape[2], "batched input gradient")
            w_spec = _spec(c.weight, 1, ndim=3, per_expert=True)
            grad_x = _bmm_fp8(grad, w.transpose(1, 2), _spec(c.grad_output, 2, ndim=3, per_expert=False), w_spec).to(
                x.dtype
            )
        if ctx.needs_input_grad[1]:  # x^T (B, K, M) @ grad (B, M, N): contraction over M
            if _stored_transposed(w):
                # In w's own layout.
                a_spec, b_spec = (
                    _spec(c.grad_output, 2, ndim=3, per_expert=False),
                    _spec(c.input, 1, ndim=3, per_expert=False),
                )
                grad_w = _bmm_fp8(grad.transpose(1, 2), x, a_spec, b_spec).transpose(1, 2).to(w.dtype)
            else:
                a_spec, b_spec = (
                    _spec(c.input, 2, ndim=3, per_expert=False),
                    _spec(c.grad_output, 1, ndim=3, per_expert=False),
                )
                grad_w = _bmm_fp8(x.transpose(1, 2), grad, a_spec, b_spec).to(w.dtype)
        return grad_x, grad_w, None
