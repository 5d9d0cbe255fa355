"""The front door of every 2D FP8 product: :func:`matmul` (library) and :func:`float8_mm` (public).

Operands are prepared once (``operands.prepare``), checked against the rules every GPU
build enforces on every device (:func:`_check_operand_dtypes`), their GemmConfigs merged,
and the product handed to ``dense`` or ``blocks``.
"""

from __future__ import annotations

import torch

from f8tensor.gemm.blocks import fp4_product
from f8tensor.gemm.blocks import product as block_product
from f8tensor.gemm.dense import product as dense_product
from f8tensor.gemm.operands import BLOCKS, DENSE, prepare
from f8tensor.quant.formats import FLOAT8_DTYPES, check_hp_dtype
from f8tensor.quant.specs import DEFAULT_GEMM, CastSpec, GemmConfig
from f8tensor.tensor.float8 import Float8Tensor, check_scale_values, is_float8, scale_from_number, to_float8
from f8tensor.tensor.fp4 import Float4Tensor, is_float4

__all__ = ["float8_mm", "matmul"]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def float8_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    out_scale: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """``a @ b`` (2D) on FP8 tensor cores, with an explicit output dtype.

    Args:
        a, b: at least one a Float8Tensor; a plain one is cast like the other.
        bias: optional high-precision bias.
        out_dtype: bf16/fp16/fp32 (default ``a``'s original dtype), or an FP8 dtype: then a
            Float8Tensor scaled by ``out_scale``, saturated, non-finite values kept as NaN.
        out_scale: the FP8 output's scale.
    Returns:
        The ``(M, N)`` product.
    Raises:
        TypeError: neither operand is a Float8Tensor, or a dtype is not allowed.
        ValueError: an FP8 ``out_dtype`` without ``out_scale`` (or the reverse).
        RuntimeError: the shapes cannot be multiplied.

    Example:
        >>> from f8tensor import Float8Tensor, float8_mm
        >>> a = Float8Tensor.from_hp(torch.randn(16, 32, dtype=torch.bfloat16))
        >>> w = Float8Tensor.from_hp(torch.randn(64, 32, dtype=torch.bfloat16))
        >>> float8_mm(a, w.t()).dtype, float8_mm(a, w.t(), out_dtype=torch.float32).shape
        (torch.bfloat16, torch.Size([16, 64]))
    """
    out_scale = _check_float8_mm_args(a, b, bias, out_dtype, out_scale)
    if out_scale is not None:
        orig = a._orig_dtype if is_float8(a) else a.dtype
        # fp32 accumulator and bias, then one saturating cast (rowwise kernels refuse FP8
        # output). An inf becomes NaN, not the clamp's max: NaN exists in all four formats.
        acc = matmul(a, b, bias=bias, out_dtype=torch.float32)
        acc = torch.where(torch.isinf(acc), torch.nan, acc)
        assert out_dtype is not None  # _check_float8_mm_args: an out_scale comes with an FP8 out_dtype
        return to_float8(acc, CastSpec(out_dtype), scale=out_scale, orig_dtype=orig)
    return matmul(a, b, bias=bias, out_dtype=out_dtype)


def _check_float8_mm_args(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype | None,
    out_scale: torch.Tensor | float | None,
) -> torch.Tensor | None:
    """Check float8_mm's arguments; returns the 0-dim fp32 ``out_scale`` or None."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"float8_mm: {name} must be a tensor; got {type(t).__name__}")
    if not (is_float8(a) or is_float8(b)):
        raise TypeError("float8_mm needs at least one Float8Tensor operand; use torch.mm for plain tensors")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or is_float8(bias):
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
    device = (a if is_float8(a) else b).device
    if not isinstance(out_scale, torch.Tensor):
        return scale_from_number(out_scale, "float8_mm out_scale", device)
    if out_scale.dtype != torch.float32:
        raise TypeError(f"float8_mm out_scale must be a float or a float32 tensor; got dtype {out_scale.dtype}")
    if out_scale.numel() != 1:
        raise ValueError(
            f"float8_mm out_scale must be one number (a tensor of 1 element); got shape {tuple(out_scale.shape)}"
        )
    if out_scale.device != device:
        raise ValueError(f"float8_mm out_scale is on {out_scale.device}, the operands on {device}")
    return check_scale_values(out_scale.reshape(()), "float8_mm out_scale")


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``a (M, K) @ b (K, N)`` (+ ``bias``) in FP8: the way every 2D product goes.

    Args:
        a, b: the operands (an FP4 operand takes ``blocks.fp4_product``).
        bias: optional bias.
        out_dtype: default the GemmConfig's, else ``a``'s original dtype.
    Returns:
        The ``(M, N)`` product in ``out_dtype``.
    Raises:
        RuntimeError: operands not 2D, or inner dims that differ.
        ValueError: operands (or ``bias``) on different devices.
    """
    # Operand devices: checked by prepare() (and prepare_fp4()).
    if bias is not None and bias.device != a.device:
        raise ValueError(f"FP8 matmul bias is on {bias.device}, the operands on {a.device}: they must share a device")
    if isinstance(a, Float4Tensor) or isinstance(b, Float4Tensor):
        return _fp4_matmul(a, b, bias, out_dtype)
    # A 0-dim scale first: is_blockwise's own first test, without its call.
    blockwise = (isinstance(a, Float8Tensor) and a._scale.dim() > 0 and a.is_blockwise) or (
        isinstance(b, Float8Tensor) and b._scale.dim() > 0 and b.is_blockwise
    )
    if a.dim() != 2 or b.dim() != 2:
        raise RuntimeError(f"FP8 mm expects 2D operands; got {tuple(a.shape)} and {tuple(b.shape)}")
    a8, b8 = prepare(a, b, BLOCKS if blockwise else DENSE, a_k=1, b_k=0)
    _check_operand_dtypes(a8._data.dtype, b8._data.dtype, a8._data.device)
    gemm = a8._gemm if a8._gemm == b8._gemm else _merged_gemm(a8._gemm, b8._gemm)  # the common case inline
    (m, k), (k2, n) = a8.shape, b8.shape
    if k != k2:
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({m}x{k} and {k2}x{n})")
    if out_dtype is None:
        out_dtype = gemm.out_dtype or a8._orig_dtype
    return (block_product if blockwise else dense_product)(a8, b8, bias, out_dtype, gemm)


def _fp4_matmul(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None
) -> torch.Tensor:
    if a.dim() != 2 or b.dim() != 2:
        raise RuntimeError(f"FP4 mm expects 2D operands; got {tuple(a.shape)} and {tuple(b.shape)}")
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({m}x{k} and {k2}x{n})")
    gemm = _merged_gemm(*(x._gemm if (is_float4(x) or is_float8(x)) else DEFAULT_GEMM for x in (a, b)))
    if out_dtype is None:
        ref = a if (is_float4(a) or is_float8(a)) else b
        # matmul calls this with at least one Float4Tensor operand: a plain ``a`` leaves ``b`` one.
        assert is_float4(ref) or is_float8(ref)
        out_dtype = gemm.out_dtype or ref._orig_dtype
    return fp4_product(a, b, bias, out_dtype, gemm)


def _nvidia_cuda(device: torch.device) -> bool:
    return device.type == "cuda" and torch.version.hip is None


def _check_operand_dtypes(a: torch.dtype, b: torch.dtype, device: torch.device | None = None) -> None:
    # Rules of every GPU build, enforced on every device: CPU kernels would accept these.
    if "e5m2" in str(a) and "e5m2" in str(b):
        raise ValueError(
            f"FP8 matmul of two e5m2 operands ({a} x {b}) is not supported by torch._scaled_mm on "
            f"GPUs; cast one operand to e4m3"
        )
    # By name, not membership in a global tuple: traced, each read of one is a guard.
    a_fnuz, b_fnuz = "fnuz" in str(a), "fnuz" in str(b)
    if a_fnuz != b_fnuz:
        raise ValueError(f"FP8 matmul operands must both be fnuz formats or neither; got {a} x {b}")
    if a_fnuz and device is not None and _nvidia_cuda(device):
        raise ValueError(
            f"FP8 matmul of {_name(a)} x {_name(b)} on an NVIDIA CUDA device: the fnuz formats exist "
            f"for AMD ROCm GPUs (MI300) only. This device multiplies {_name(torch.float8_e4m3fn)} and "
            f"{_name(torch.float8_e5m2)} (not both e5m2); cast with one of those."
        )


def _merged_gemm(a: GemmConfig, b: GemmConfig) -> GemmConfig:
    if a == b or b == DEFAULT_GEMM:
        return a
    if a == DEFAULT_GEMM:
        return b
    raise ValueError(f"the operands of an FP8 matmul carry different GemmConfigs: {a} and {b}")
