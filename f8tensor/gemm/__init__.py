"""FP8 matrix products: one front door, the CUDA rules, one file per concern.

Every FP8 product f8tensor makes goes through here, on every device, so that the CPU
suite vouches for the GPU builds: CPU kernels accept products that GPU kernels refuse.

==============  ==========================================================================
file            concern
==============  ==========================================================================
``rules``       the CUDA rules as data, one module per kernel family: supported builds,
                rule rows of ``torch._scaled_mm``, the block-scaled ``F.scaled_mm`` kernels
                and ``torch._scaled_grouped_mm``, each citing the PyTorch sources it was
                read from
``violations``  the checkers, one per kind: what a build would refuse in a call
``check``       the check mode (:func:`install_rules_check`, :func:`rules_check`,
                ``F8TENSOR_CHECK_CUDA_RULES``)
``operands``    the one operand preparation: plain operands cast like the other one,
                re-quantization along K, e4m3 re-casts, layouts, inverse scales
``dense``       tensorwise and rowwise products: routes (:func:`choose_route`)
``blocks``      block-scaled products (1x128, 128x128, MX) and their reference path
``grouped``     grouped and batched products (MoE) and their reference op
``front``       the front door of 2D products: :func:`matmul`, :func:`float8_mm`
==============  ==========================================================================

Each file imports only those above it in this table (``tests/project/test_layering.py``). A new
kind adds rule rows, a checker, and a module next to ``dense``/``blocks``/``grouped``
that takes prepared operands; the front door sends it there.
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
