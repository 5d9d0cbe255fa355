"""Grouped and batched FP8 products: the ``torch._scaled_grouped_mm`` route, its CUDA rules, the CPU reference.

One entry point, :func:`scaled_grouped_mm`, with the signature of the kernel it stands for:
``(a, b, scale_a, scale_b, offs, out_dtype)``, where the scales are *dequantization*
factors (``1 / scale`` of our Float8Tensors), as ``torch._scaled_mm`` takes them. Three forms:

- 2D x 3D with ``offs`` (an MoE layer's forward and input gradient): ``a`` (M, K) holds the
  tokens sorted by expert, ``b`` (G, K, N) one matrix per expert, ``offs`` (G,) int32 the
  cumulative token counts; out (M, N). Scales: ``scale_a`` (M,), ``scale_b`` (G, N).
- 2D x 2D with ``offs`` (the expert weights' gradient): ``a`` (K, M), ``b`` (M, N), the groups
  cut the contraction dim M; out (G, K, N). Scales: ``scale_a`` (G*K,), ``scale_b`` (G*N,).
- 3D x 3D without ``offs`` (``bmm``): ``a`` (B, M, K), ``b`` (B, K, N); out (B, M, N).
  Scales: ``scale_a`` (B, M), ``scale_b`` (B, N).

The CUDA rules (:data:`GROUPED_RULES`) are checked on every call, on every device, so a
model tested on CPU makes only calls a GPU accepts. On CUDA devices that have the kernel
the call goes to ``torch._scaled_grouped_mm``; everywhere else to
``f8tensor::scaled_grouped_mm_reference``, an exact emulation (products of the FP8 values
accumulated in fp32, then the two dequantization factors, then one rounding to
``out_dtype``: the kernel's epilogue order). It is a custom op, opaque to torch.compile,
so token counts that change every step do not recompile anything.

This module sits beside the 2D route (tensor <- grouped_gemm <- ops) and moves into
``gemm.py`` with the other routes.
"""

from __future__ import annotations

import torch

__all__ = ["GROUPED_RULES", "grouped_kernel_available", "scaled_grouped_mm"]

#: The rules of ``torch._scaled_grouped_mm`` (torch 2.11-2.13), as read in PyTorch's sources:
#: ``_meta_grouped_mm_common`` in torch/_meta_registrations.py and ``_scaled_grouped_mm_cuda``
#: in aten/src/ATen/native/cuda/Blas.cpp (ScaledBlas.cpp from 2.9 on). Machine-readable so
#: that ``gemm.py``'s table can absorb them; :func:`check_grouped_rules` enforces them.
GROUPED_RULES: dict[str, object] = {
    # Blas.cpp: _scaled_mm_allowed_device(sm90_only=true, sm100_only=true); sm89 has no kernel.
    "compute_capability": ((9, 0), (10, 0)),
    # _meta_grouped_mm_common: "Expected inputs of E4M3 FP8 type" (fnuz on MI300).
    "operand_dtypes": (torch.float8_e4m3fn,),
    # Both scales float32 (float8_e8m0fnu is the MX form, not used here).
    "scale_dtype": torch.float32,
    # "If output dtype provided, it must be torch.bfloat16."
    "out_dtypes": (torch.bfloat16,),
    # a row-major, b column-major in their last two dims.
    "a_layout": "row-major",
    "b_layout": "column-major",
    # check_valid_strides: the leading stride of each operand a multiple of 16 bytes.
    "stride_bytes": 16,
    # offs: 1D int32, present exactly when one operand is 2D.
    "offs_dtype": torch.int32,
    # Groups that cut the contraction dim (2D x 2D): each group a multiple of 16 rows, the
    # leading-stride rule of every per-group sub-matrix. We pad groups to it (see moe.py).
    # Groups that cut M (2D x 3D) may have any size, 0 included.
    "contraction_group_multiple": 16,
    # bias and scale_result: not supported.
    "bias": None,
}


def grouped_kernel_available(device: torch.device) -> bool:
    """Whether ``torch._scaled_grouped_mm`` runs on ``device`` (CUDA sm90 / sm100)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) in GROUPED_RULES["compute_capability"]


def _row_major(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.stride(-2) >= max(1, t.shape[-1])


def _col_major(t: torch.Tensor) -> bool:
    return t.stride(-2) == 1 and t.stride(-1) >= max(1, t.shape[-2])


def check_grouped_rules(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offs: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> None:
    """Raise ``ValueError`` naming the rule a call to ``torch._scaled_grouped_mm`` would break."""
    allowed = GROUPED_RULES["operand_dtypes"]
    if a.dtype not in allowed or b.dtype not in allowed:
        raise ValueError(
            f"FP8 grouped GEMM: torch._scaled_grouped_mm takes only {allowed} operands; got {a.dtype} x {b.dtype}"
        )
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
        raise ValueError(f"FP8 grouped GEMM: scales must be float32; got {scale_a.dtype} and {scale_b.dtype}")
    if out_dtype not in GROUPED_RULES["out_dtypes"]:
        raise ValueError(f"FP8 grouped GEMM: the output dtype must be one of {GROUPED_RULES['out_dtypes']}; got {out_dtype}")
    if a.dim() not in (2, 3) or b.dim() not in (2, 3):
        raise ValueError(f"FP8 grouped GEMM: operands must be 2D or 3D; got {a.dim()}D and {b.dim()}D")
    if not _row_major(a) or not _col_major(b):
        raise ValueError(
            f"FP8 grouped GEMM: a must be row-major and b column-major in their last two dims; got strides "
            f"{a.stride()} for {tuple(a.shape)} and {b.stride()} for {tuple(b.shape)}"
        )
    for name, t, lead in (("a", a, a.stride(-2)), ("b", b, b.stride(-1))):
        if lead % GROUPED_RULES["stride_bytes"]:
            raise ValueError(
                f"FP8 grouped GEMM: the leading stride of {name} must be a multiple of 16 bytes; got {lead} "
                f"for shape {tuple(t.shape)} (pad the contraction dim to a multiple of 16)"
            )
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"FP8 grouped GEMM: contraction dims differ: {tuple(a.shape)} x {tuple(b.shape)}")
    two_d = a.dim() == 2 or b.dim() == 2
    if two_d != (offs is not None):
        raise ValueError("FP8 grouped GEMM: offs is needed exactly when an operand is 2D")
    if offs is not None and (offs.dim() != 1 or offs.dtype != torch.int32):
        raise ValueError(f"FP8 grouped GEMM: offs must be a 1D int32 tensor; got {offs.dim()}D {offs.dtype}")
    expected = _scale_shapes(a, b, offs)
    if (tuple(scale_a.shape), tuple(scale_b.shape)) != expected:
        raise ValueError(
            f"FP8 grouped GEMM: scales for {tuple(a.shape)} x {tuple(b.shape)} must have shapes {expected}; "
            f"got {tuple(scale_a.shape)} and {tuple(scale_b.shape)}"
        )
    if not (scale_a.is_contiguous() and scale_b.is_contiguous()):
        raise ValueError("FP8 grouped GEMM: scales must be contiguous")


def _scale_shapes(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> tuple[tuple, tuple]:
    if a.dim() == 2 and b.dim() == 3:
        return (a.shape[0],), (b.shape[0], b.shape[2])
    if a.dim() == 2 and b.dim() == 2:
        g = offs.shape[0]
        return (g * a.shape[0],), (g * b.shape[1],)
    if a.dim() == 3 and b.dim() == 3:
        return (a.shape[0], a.shape[1]), (b.shape[0], b.shape[2])
    raise ValueError(f"FP8 grouped GEMM: the form {a.dim()}D x {b.dim()}D is not used by f8tensor")


def scaled_grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The grouped FP8 product (see the module docstring), rules checked, routed by device."""
    check_grouped_rules(a, b, scale_a, scale_b, offs, out_dtype)
    if grouped_kernel_available(a.device):
        return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=out_dtype)
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
        out = torch._grouped_mm(af, bf, offs=offs)
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
