"""The CUDA rules of FP8 GEMMs, as data: supported builds and one row per kernel.

Tables: :data:`SCALED_MM_RULES` (``torch._scaled_mm``), :data:`BLOCK_SCALED_MM_RULES`
(block-scaled ``F.scaled_mm``), :data:`GROUPED_RULES` (``torch._scaled_grouped_mm``) and
:data:`FP4_SCALED_MM_RULES` (kept apart so FP8 lookups never match an FP4 row). Each row
is a frozen dataclass naming its builds and citing the PyTorch source it was read from.
No logic beyond the lookups.
"""

from __future__ import annotations

from f8tensor.gemm.rules.block_scaled import (
    BLOCK_SCALED_MM_RULES,
    FP4_SCALED_MM_RULES,
    BlockScaledMMRule,
    block_rule_by_recipes,
    block_rule_for,
    fp4_rule_for,
)
from f8tensor.gemm.rules.builds import (  # noqa: F401
    ALIGN,
    ALL_BUILDS,
    FP4_ALIGN,
    ROCM_BUILDS,
    SCALE_COLS,
    SCALE_ONE,
    SCALE_ROWS,
    SUPPORTED_BUILDS,
    SUPPORTED_TORCH,
    Builds,
    CudaBuild,
    build_of,
)
from f8tensor.gemm.rules.grouped import (
    GROUPED_RULES,
    GroupedMMRule,
    grouped_rule_for,
)
from f8tensor.gemm.rules.scaled_mm import (
    ROCM_ROWWISE_NOTE,
    SCALED_MM_RULES,
    STRICTEST_BUILDS,
    ScaledMMRule,
    rule_for,
)

__all__ = [
    "ALIGN",
    "ALL_BUILDS",
    "BLOCK_SCALED_MM_RULES",
    "FP4_ALIGN",
    "FP4_SCALED_MM_RULES",
    "GROUPED_RULES",
    "ROCM_BUILDS",
    "ROCM_ROWWISE_NOTE",
    "SCALED_MM_RULES",
    "STRICTEST_BUILDS",
    "SUPPORTED_BUILDS",
    "SUPPORTED_TORCH",
    "BlockScaledMMRule",
    "Builds",
    "CudaBuild",
    "GroupedMMRule",
    "ScaledMMRule",
    "block_rule_by_recipes",
    "block_rule_for",
    "build_of",
    "fp4_rule_for",
    "grouped_rule_for",
    "rule_for",
]
