"""The CUDA rules of FP8 GEMMs, as data: supported builds and one row per kernel.

Three tables of rows in one style (a frozen dataclass per row, ``builds`` saying where a
row applies, ``sources`` citing the PyTorch code it was read from):

- :data:`SCALED_MM_RULES`: ``torch._scaled_mm``, tensorwise and rowwise, one row per
  (scaling kind, set of builds): operand and output dtypes, scale dtype/shape/contiguity,
  layouts, alignment, bias, fast accumulation;
- :data:`BLOCK_SCALED_MM_RULES`: the block-scaled kernels of ``torch.nn.functional.scaled_mm``
  (1x128, 128x128, MX), with the scale layouts each reads;
- :data:`GROUPED_RULES`: ``torch._scaled_grouped_mm`` (MoE grouped and batched products);
- :data:`FP4_SCALED_MM_RULES`: the FP4 kernels of ``torch.nn.functional.scaled_mm`` (NVFP4,
  MXFP4; sm100), rows in :class:`BlockScaledMMRule`'s style, kept apart so that the FP8
  lookups (whose MX row has the same 1x32 blocks as MXFP4) never match them.

The supported NVIDIA builds are :data:`SUPPORTED_BUILDS` (torch 2.11-2.14; cu126, cu128,
cu130 wheels; sm89, sm90); fnuz products are checked against :data:`ROCM_BUILDS`. A new
scaling kind or build adds rows here; ``violations.py`` reads them, ``dense.py``, ``blocks.py``
and ``grouped.py`` route products so that every call matches a row. No logic beyond the
lookups (:func:`rule_for`, :func:`block_rule_for`, :func:`block_rule_by_recipes`,
:func:`grouped_rule_for`).

One module per kernel family: ``builds`` (the builds and the alignment), ``scaled_mm``,
``block_scaled`` (FP8 and FP4 blocks), ``grouped``; this package re-exports their names.
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
    ROCM_BUILDS,
    SCALE_COLS,
    SCALE_ONE,
    SCALE_ROWS,
    SUPPORTED_BUILDS,
    SUPPORTED_TORCH,
    Builds,
    CudaBuild,
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
    "fp4_rule_for",
    "grouped_rule_for",
    "rule_for",
]
