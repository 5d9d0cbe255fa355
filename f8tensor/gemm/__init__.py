"""FP8 matrix products: one front door for every device, and the CUDA rules as data.

Modules, each importing only those listed before it (``tests/project/test_layering.py``):
``rules`` (the rule tables), ``violations`` (the checkers), ``check`` (the check mode:
:func:`install_rules_check`, :func:`rules_check`), ``operands`` (the one operand
preparation), ``dense`` (tensorwise and rowwise routes, :func:`choose_route`), ``blocks``
(block-scaled), ``grouped`` (grouped and batched), ``front`` (:func:`matmul`,
:func:`float8_mm`). The CPU suite vouches for GPU builds because every product is checked
against the rules on every device.
"""

from __future__ import annotations

from f8tensor.gemm.check import (
    RULES_CHECK_ENV,
    CudaRuleViolation,
    block_scaled_mm_violations,
    check_grouped_rules,
    checked_functional_scaled_mm,
    checked_scaled_mm,
    grouped_mm_violations,
    install_from_env,
    install_rules_check,
    rules_check,
    rules_check_installed,
    scaled_mm_violations,
    uninstall_rules_check,
    violations_on_supported_builds,
)
from f8tensor.gemm.dense import (
    Route,
    choose_route,
    precise_rowwise_route,
    set_precise_rowwise_route,
    use_precise_rowwise_route,
)
from f8tensor.gemm.front import float8_mm, matmul
from f8tensor.gemm.grouped import batched_mm, grouped_kernel_available, grouped_mm, scaled_grouped_mm
from f8tensor.gemm.rules import (
    ALIGN,
    BLOCK_SCALED_MM_RULES,
    GROUPED_RULES,
    ROCM_BUILDS,
    ROCM_ROWWISE_NOTE,
    SCALED_MM_RULES,
    STRICTEST_BUILDS,
    SUPPORTED_BUILDS,
    BlockScaledMMRule,
    CudaBuild,
    GroupedMMRule,
    ScaledMMRule,
    block_rule_for,
)

__all__ = [
    "ALIGN",
    "BLOCK_SCALED_MM_RULES",
    "GROUPED_RULES",
    "ROCM_BUILDS",
    "ROCM_ROWWISE_NOTE",
    "RULES_CHECK_ENV",
    "SCALED_MM_RULES",
    "STRICTEST_BUILDS",
    "SUPPORTED_BUILDS",
    "BlockScaledMMRule",
    "CudaBuild",
    "CudaRuleViolation",
    "GroupedMMRule",
    "Route",
    "ScaledMMRule",
    "batched_mm",
    "block_rule_for",
    "block_scaled_mm_violations",
    "check_grouped_rules",
    "checked_functional_scaled_mm",
    "checked_scaled_mm",
    "choose_route",
    "float8_mm",
    "grouped_kernel_available",
    "grouped_mm",
    "grouped_mm_violations",
    "install_from_env",
    "install_rules_check",
    "matmul",
    "precise_rowwise_route",
    "rules_check",
    "rules_check_installed",
    "scaled_grouped_mm",
    "scaled_mm_violations",
    "set_precise_rowwise_route",
    "uninstall_rules_check",
    "use_precise_rowwise_route",
    "violations_on_supported_builds",
]
