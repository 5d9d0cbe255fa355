"""The rows of ``torch._scaled_mm`` (tensorwise and rowwise) and :func:`rule_for`."""

from __future__ import annotations

import dataclasses

import torch

from f8tensor.gemm.rules.builds import (
    _BF16,
    _E4M3,
    _E4M3_FNUZ,
    _E5M2,
    _E5M2_FNUZ,
    _FP16,
    _FP32,
    ALIGN,
    ALL_BUILDS,
    SCALE_COLS,
    SCALE_ONE,
    SCALE_ROWS,
    Builds,
    CudaBuild,
)

__all__ = ["ROCM_ROWWISE_NOTE", "SCALED_MM_RULES", "STRICTEST_BUILDS", "ScaledMMRule", "rule_for"]


@dataclasses.dataclass(frozen=True)
class ScaledMMRule:
    """What one scaling kind of one op accepts on a set of builds (one row of the table).

    ``bias_dtypes`` maps an output dtype to its allowed bias dtypes (missing: no bias);
    ``refused_pairs`` are (mat1, mat2) dtype pairs refused though each dtype is allowed.
    """

    op: str
    kind: str
    kernel: str
    builds: Builds
    mat1_dtypes: frozenset[torch.dtype]
    mat2_dtypes: frozenset[torch.dtype]
    refused_pairs: frozenset[tuple[torch.dtype, torch.dtype]]
    out_dtypes: frozenset[torch.dtype]
    scale_dtype: torch.dtype
    scale_a_shape: str
    scale_b_shape: str
    scales_contiguous: bool
    mat1_layout: str  # "row-major"
    mat2_layout: str  # "column-major"
    align_k: int
    align_n: int
    align_m: int
    bias_dtypes: tuple[tuple[torch.dtype, frozenset[torch.dtype]], ...]
    fast_accum: bool
    sources: tuple[str, ...]

    def bias_allowed(self, out_dtype: torch.dtype) -> frozenset[torch.dtype]:
        return dict(self.bias_dtypes).get(out_dtype, frozenset())


_OPERANDS = frozenset({_E4M3, _E5M2})  # no fnuz on NVIDIA: "Cannot convert ScalarType Float8_e4m3fnuz to cudaDataType"
_NO_E5M2_PAIR = frozenset({(_E5M2, _E5M2)})
# cuBLASLt bias: bf16 or fp16, matching a bf16/fp16 output; none with an fp32 output.
_BIAS = ((_BF16, frozenset({_BF16})), (_FP16, frozenset({_FP16})))

# Rowwise everywhere but cu130 sm90; the other NVIDIA rows are differences from it.
_CUTLASS_ROWWISE = ScaledMMRule(
    op="torch._scaled_mm",
    kind="rowwise",
    kernel="CUTLASS f8f8bf16_rowwise",
    builds=ALL_BUILDS,
    mat1_dtypes=_OPERANDS,
    mat2_dtypes=frozenset({_E4M3}),
    refused_pairs=_NO_E5M2_PAIR,
    # The 2.11-2.13 wheels refuse an fp32 output here; later sources add it.
    out_dtypes=frozenset({_BF16, _FP16}),
    scale_dtype=_FP32,
    scale_a_shape=SCALE_ROWS,
    scale_b_shape=SCALE_COLS,
    scales_contiguous=True,
    mat1_layout="row-major",
    mat2_layout="column-major",
    align_k=ALIGN,
    align_n=ALIGN,
    align_m=1,  # M is free: the kernel pads scale_a to a multiple of 256 itself
    bias_dtypes=_BIAS,
    fast_accum=True,
    sources=(
        (
            "aten/src/ATen/native/cuda/RowwiseScaledMM.cu: check_inputs (a e4m3fn/e5m2, b e4m3fn, fp32 "
            "scales (M, 1) stride(0) == 1 and (1, N) stride(1) == 1, a row-major, b column-major, bias "
            "1-D, no bias with fp32 out), dispatch_fp8_rowwise_kernel_on_bias_dtype (fp16 bias needs fp16 out)"
        ),
        "aten/src/ATen/native/cuda/ScaledBlas.cpp: _scaled_mm_out_cuda, rowwise branch (output dtype check)",
    ),
)

#: The table; the first row whose op, kind and builds match a call applies (narrow rows first).
SCALED_MM_RULES: tuple[ScaledMMRule, ...] = (
    # Tensorwise x tensorwise: cuBLASLt on every build.
    dataclasses.replace(
        _CUTLASS_ROWWISE,
        kind="tensorwise",
        kernel="cuBLASLt",
        mat2_dtypes=_OPERANDS,
        out_dtypes=frozenset({_BF16, _FP16, _FP32, _E4M3, _E5M2}),
        scale_a_shape=SCALE_ONE,
        scale_b_shape=SCALE_ONE,
        scales_contiguous=False,
        sources=(
            (
                "aten/src/ATen/native/cuda/ScaledBlas.cpp: _scaled_mm_out_cuda (K % 16, mat2 dims % 16, "
                "no e5m2 x e5m2, bias bf16/fp16 and none with fp32 out), is_tensorwise_scaling"
            ),
            "torch/_meta_registrations.py: _check_scaled_mm_sizes (row-major self, column-major mat2 on CUDA)",
        ),
    ),
    # Rowwise on cuBLASLt: CUDA >= 12.9 on sm90 only; takes fp32 output and e5m2 mat2.
    dataclasses.replace(
        _CUTLASS_ROWWISE,
        kernel="cuBLASLt (outer-vector scales)",
        builds=Builds(min_cuda=(12, 9), min_sm=(9, 0), max_sm=(9, 0)),
        mat2_dtypes=_OPERANDS,
        out_dtypes=frozenset({_BF16, _FP16, _FP32}),
        sources=(
            (
                "aten/src/ATen/native/cuda/ScaledBlas.cpp: _scaled_mm_out_cuda takes the CUTLASS path when "
                "sm < 9.0 or CUBLAS_VERSION < 120900, cuBLASLt otherwise; is_rowwise_scaling"
            ),
        ),
    ),
    _CUTLASS_ROWWISE,
)

#: A summary for readers; the checker reads the ROCm rows of the table.
ROCM_ROWWISE_NOTE = "ROCm rowwise: mat2 e4m3fnuz (e4m3fn on non-fnuz archs), bf16 output only"

_ROCM = Builds(platform="rocm")
_FNUZ_OPERANDS = frozenset({_E4M3_FNUZ, _E5M2_FNUZ})
_ROCM_SOURCES = (
    (
        "aten/src/ATen/native/cuda/ScaledBlas.cpp: _scaled_mm_out_cuda, USE_ROCM branches (_scaled_mm_is_fnuz "
        "on gfx942; rowwise: b e4m3fnuz, BFloat16 output only)"
    ),
)
SCALED_MM_RULES += (
    # ROCm gfx942, fnuz. PyTorch refuses e5m2 x e5m2 only on NVIDIA; f8tensor everywhere.
    dataclasses.replace(
        SCALED_MM_RULES[0],
        kernel="hipBLASLt",
        builds=_ROCM,
        mat1_dtypes=_FNUZ_OPERANDS,
        mat2_dtypes=_FNUZ_OPERANDS,
        refused_pairs=frozenset({(_E5M2_FNUZ, _E5M2_FNUZ)}),
        out_dtypes=frozenset({_BF16, _FP16, _FP32, _E4M3_FNUZ, _E5M2_FNUZ}),
        sources=_ROCM_SOURCES,
    ),
    dataclasses.replace(
        SCALED_MM_RULES[2],
        kernel="hipBLASLt rowwise",
        builds=_ROCM,
        mat1_dtypes=_FNUZ_OPERANDS,
        mat2_dtypes=frozenset({_E4M3_FNUZ}),
        refused_pairs=frozenset({(_E5M2_FNUZ, _E5M2_FNUZ)}),
        out_dtypes=frozenset({_BF16}),
        sources=_ROCM_SOURCES,
    ),
)

#: Builds that between them carry every restriction of the table (cu130 sm90 only relaxes).
STRICTEST_BUILDS: tuple[CudaBuild, ...] = (CudaBuild((2, 11), (12, 6), (8, 9)), CudaBuild((2, 13), (12, 8), (9, 0)))


def rule_for(kind: str, build: CudaBuild, op: str = "torch._scaled_mm") -> ScaledMMRule | None:
    """The row of :data:`SCALED_MM_RULES` that applies to ``kind`` on ``build``, or None."""
    for rule in SCALED_MM_RULES:
        if rule.op == op and rule.kind == kind and build in rule.builds:
            return rule
    return None
