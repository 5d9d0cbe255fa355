"""The rows of ``torch._scaled_grouped_mm`` and :func:`grouped_rule_for`."""

from __future__ import annotations

import dataclasses

import torch

from f8tensor.gemm.rules.builds import _BF16, _E4M3, _FP32, ALIGN, Builds, CudaBuild

__all__ = ["GROUPED_RULES", "GroupedMMRule", "grouped_rule_for"]


@dataclasses.dataclass(frozen=True)
class GroupedMMRule:
    """What ``torch._scaled_grouped_mm`` accepts on a set of builds (one row of the table).

    Forms: 2D x 3D with ``offs`` (scales (M,), (G, N)), 2D x 2D with ``offs`` (groups cut
    K; scales (G*K,), (G*N,)) and 3D x 3D without (scales (B, M), (B, N)); scales are
    dequantization factors. ``align`` divides K and N in every form; ``max_groups`` bounds
    the groups of one call. ``offs`` values are device asserts, checked on the host.
    """

    op: str
    kernel: str
    builds: Builds
    operand_dtypes: frozenset[torch.dtype]
    scale_dtype: torch.dtype
    out_dtypes: frozenset[torch.dtype]
    a_layout: str  # "row-major" in the last two dims
    b_layout: str  # "column-major" in the last two dims
    stride_bytes: int  # each operand's leading stride a multiple of this many bytes
    offs_dtype: torch.dtype  # offs: 1-D, present exactly when one operand is 2D
    contraction_group_multiple: int  # each group that cuts the contraction dim (2D x 2D)
    bias: bool
    sources: tuple[str, ...]
    align: int = ALIGN
    max_groups: int = 1023


_GROUPED_SOURCES = (
    (
        'torch/_meta_registrations.py: _meta_grouped_mm_common ("Expected inputs of E4M3 FP8 type", fp32 '
        "scales, bf16 output, offs int32 exactly when an operand is 2D, scale shapes per form; 2.11 :8178, "
        "2.12 :8428, 2.13 :8642, 2.14 :8467)"
    ),
    (
        'aten/src/ATen/native/cuda/GroupedBlas.cpp: _scaled_grouped_mm_cuda ("Expected trailing dimension of '
        'mat_a to be divisible by 16", "Expected mat_b shape to be divisible by 16": K and N, host checks in '
        "forward; no bias, no scale_result); ATen/native/GroupedMMUtils.h: check_valid_strides_and_return_"
        "transposed (a row-major, b column-major, leading strides multiples of 16 bytes; 2.14 adds the 3-D "
        "batch stride)"
    ),
    (
        "aten/src/ATen/native/cuda/ScaledGroupMM.cu: f8f8bf16_grouped_gemm_impl_sm90 (\"Can't process more "
        'than 1024 groups": group_count < 1024; the only FP8 grouped kernel in the 2.11, 2.12, 2.14 binaries: '
        "no sm100 instance; common_cuda.py: PLATFORM_SUPPORTS_FP8_GROUPED_GEMM = SM90OrLater and not "
        "SM100OrLater, 2.11 :159, 2.12 :199, 2.13 :200, 2.14 :277)"
    ),
    (
        "aten/src/ATen/native/cuda/GroupMMCommon.cuh: prepare_grouped_gemm_data (device asserts: offs "
        "non-decreasing, offs[-1] <= the grouped dim; identical 2.11-2.14); GroupedMMUtils.h: "
        "create_grouped_gemm_output_tensor (at::empty_strided: groups with no rows are not zeroed)"
    ),
)

#: The rows of ``torch._scaled_grouped_mm``: sm90 only (the kernel is built for sm90 alone);
#: elsewhere f8tensor runs the reference op. Groups cutting K are padded to 16 rows.
GROUPED_RULES: tuple[GroupedMMRule, ...] = (
    GroupedMMRule(
        op="torch._scaled_grouped_mm",
        kernel="CUTLASS grouped (sm90)",
        builds=Builds(min_sm=(9, 0), max_sm=(9, 0)),
        operand_dtypes=frozenset({_E4M3}),
        scale_dtype=_FP32,
        out_dtypes=frozenset({_BF16}),
        a_layout="row-major",
        b_layout="column-major",
        stride_bytes=16,
        offs_dtype=torch.int32,
        contraction_group_multiple=ALIGN,
        bias=False,
        sources=_GROUPED_SOURCES,
    ),
)


def grouped_rule_for(build: CudaBuild) -> GroupedMMRule | None:
    """The row of :data:`GROUPED_RULES` that applies on ``build``, or None (no kernel there)."""
    for rule in GROUPED_RULES:
        if build in rule.builds:
            return rule
    return None
