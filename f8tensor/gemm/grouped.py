"""Grouped and batched FP8 products (MoE): ``torch._scaled_grouped_mm`` and its CPU reference.

Two front doors for Float8Tensor operands, through the one operand preparation
(``operands.prepare(..., GROUPED)``: e4m3fn operands, fp32 scales constant along K):

- :func:`grouped_mm`: ``a (M, K) @ b[g] (K, N)`` for the rows of each group (tokens sorted
  by expert, ``offs`` their cumulative counts): an MoE layer's forward and input gradient;
- :func:`batched_mm`: ``a (B, M, K) @ b (B, K, N)`` in one call (``bmm``).

And the raw kernel entry, :func:`scaled_grouped_mm`, with the signature of the kernel it
stands for (``(a, b, scale_a, scale_b, offs, out_dtype)``, scales as dequantization
factors; its three forms are described at :class:`~f8tensor.gemm.rules.GroupedMMRule`):
the rules (:data:`~f8tensor.gemm.rules.GROUPED_RULES`) are checked on every call, on every
device, and an illegal call is refused up front (``ValueError``), so a model tested on CPU
makes only calls a GPU accepts. On CUDA devices that have the kernel the call goes to
``torch._scaled_grouped_mm``; everywhere else to ``f8tensor::scaled_grouped_mm_reference``,
an exact emulation (products of the FP8 values accumulated in fp32, then the two
dequantization factors, then one rounding to ``out_dtype``: the kernel's epilogue order).
It is a custom op, opaque to torch.compile, so token counts that change every step
recompile nothing. On sm89 builds there is no grouped kernel: the reference op runs there.

Layer: above ``operands`` in ``f8tensor.gemm``; imports ``operands``, ``check``, ``rules``.
"""

from __future__ import annotations

from typing import cast

import torch

from f8tensor import compat
from f8tensor.gemm.check import check_grouped_rules
from f8tensor.gemm.operands import GROUPED, col_major, inverse_scale, kernel_scale, prepare, row_major
from f8tensor.gemm.rules import ALIGN, CudaBuild, grouped_rule_for

__all__ = ["batched_mm", "grouped_kernel_available", "grouped_mm", "scaled_grouped_mm"]

#: The one output dtype of the grouped kernel; results are cast to the caller's dtype.
KERNEL_OUT = torch.bfloat16


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a (M, K) @ b[g] (K, N)`` for the rows of group ``g`` (``offs``: cumulative row
    counts; groups may be empty or of any size), in FP8; at least one operand a Float8Tensor
    (a plain one is cast like the other). Returned in ``out_dtype``."""
    a8, b8 = prepare(a, b, GROUPED, a_k=1, b_k=1)
    (m, k), (g, _, n) = a8.shape, b8.shape
    if k % ALIGN:
        raise ValueError(f"FP8 _grouped_mm needs K to be a multiple of {ALIGN} (the kernel's stride rule); got K={k}")
    a_inv = kernel_scale(inverse_scale(a8), (m, 1), (m,))
    b_inv = kernel_scale(inverse_scale(b8), (g, 1, n), (g, n))
    out = scaled_grouped_mm(row_major(a8._data), col_major(b8._data), a_inv, b_inv, offs.to(torch.int32), KERNEL_OUT)
    return out.to(out_dtype)


def batched_mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a (B, M, K) @ b (B, K, N)`` in one grouped-kernel call, in FP8: scales per batch
    row / column. Returned in ``out_dtype``."""
    a8, b8 = prepare(a, b, GROUPED, a_k=2, b_k=1)
    (bsz, m, _), n = a8.shape, b8.shape[2]
    a_inv = kernel_scale(inverse_scale(a8), (bsz, m, 1), (bsz, m))
    b_inv = kernel_scale(inverse_scale(b8), (bsz, 1, n), (bsz, n))
    out = scaled_grouped_mm(row_major(a8._data), col_major(b8._data), a_inv, b_inv, None, KERNEL_OUT)
    return out.to(out_dtype)


def grouped_kernel_available(device: torch.device) -> bool:
    """Whether ``torch._scaled_grouped_mm`` runs on ``device`` (CUDA sm90 / sm100)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    cuda = cast("tuple[int, int]", tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2]))
    return grouped_rule_for(CudaBuild((0, 0), cuda, torch.cuda.get_device_capability(device))) is not None


def scaled_grouped_mm(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
    offs: torch.Tensor | None = None, out_dtype: torch.dtype = KERNEL_OUT,
) -> torch.Tensor:
    """The grouped FP8 product (see the module docstring), rules checked, routed by device."""
    check_grouped_rules(a, b, scale_a, scale_b, offs, out_dtype)
    if grouped_kernel_available(a.device):
        return compat.scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype)
    return torch.ops.f8tensor.scaled_grouped_mm_reference(a, b, scale_a, scale_b, offs, out_dtype)


@torch.library.custom_op("f8tensor::scaled_grouped_mm_reference", mutates_args=())
def _reference(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offs: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    # Deliberate upcast: every FP8 value is exact in fp32, and so is every product of two;
    # the fp32 sums are what the tensor cores accumulate.
    af, bf = a.float(), b.float()
    if offs is None:
        acc = torch.bmm(af, bf) * scale_a[:, :, None] * scale_b[:, None, :]
        return acc.to(out_dtype)
    g = offs.shape[0]
    if b.dim() == 3:
        acc = _grouped(af, bf, offs)  # (M, N)
        rows = torch.arange(a.shape[0], device=a.device)
        gid = torch.searchsorted(offs, rows.to(offs.dtype), right=True)
        inside = gid < g  # rows past offs[-1] belong to no group: the kernel leaves them, we zero them
        sb = scale_b[gid.clamp(max=g - 1)]
        acc = torch.where(inside[:, None], acc * scale_a[:, None] * sb, 0.0)
        return acc.to(out_dtype)
    acc = _grouped(af, bf, offs)  # (G, K, N)
    acc = acc * scale_a.view(g, -1, 1) * scale_b.view(g, 1, -1)
    return acc.to(out_dtype)


def _grouped(af: torch.Tensor, bf: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """fp32 grouped product: torch._grouped_mm where the device has an fp32 kernel, else a loop."""
    if af.device.type == "cpu":
        out = compat.grouped_mm(af, bf, offs)
        if bf.dim() == 2:
            # Groups with no rows contribute nothing: make that explicit (never stale memory).
            sizes = torch.diff(offs, prepend=offs.new_zeros(1))
            out = torch.where((sizes > 0)[:, None, None], out, 0.0)
        return out
    start = 0
    if bf.dim() == 3:
        out = af.new_zeros(af.shape[0], bf.shape[2])
        for i, end in enumerate(offs.tolist()):
            out[start:end] = af[start:end] @ bf[i]
            start = end
        return out
    out = af.new_zeros(offs.shape[0], af.shape[0], bf.shape[1])
    for i, end in enumerate(offs.tolist()):
        out[i] = af[:, start:end] @ bf[start:end]
        start = end
    return out


@_reference.register_fake
def _reference_fake(a, b, scale_a, scale_b, offs, out_dtype):
    if offs is None:
        return a.new_empty(a.shape[0], a.shape[1], b.shape[2], dtype=out_dtype)
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[2], dtype=out_dtype)
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1], dtype=out_dtype)
