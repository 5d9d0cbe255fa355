"""f8tensor: FP8 training in plain PyTorch.

Wrap a weight as ``Float8Tensor.from_hp(w)`` or swap ``nn.Linear`` for ``Float8Linear``;
matrix products then run through ``torch._scaled_mm``. The public API is ``__all__``.
Importing the package changes nothing in torch: the CUDA-rules check is switched on
explicitly (``f8tensor.gemm.install_rules_check``) or by ``F8TENSOR_CHECK_CUDA_RULES``.
"""

import torch

from f8tensor._moved import install_old_paths
from f8tensor.convert import (
    block_policy,
    convert_to_float8_training,
    convert_with_policy,
    keep_last_blocks_in_hp,
    set_forward_in_high_precision,
    set_gemm_formats,
)
from f8tensor.distributed import dtensor as _dtensor  # noqa: F401  (registers Float8Linear's DTensor product)
from f8tensor.distributed.fsdp import Float8AllGatherWeight, precompute_float8_scales_for_fsdp
from f8tensor.gemm import float8_mm
from f8tensor.moe import Float8ExpertWeight, convert_experts_to_float8, float8_grouped_mm
from f8tensor.nn.activations import save_activations_in_float8
from f8tensor.nn.linear import Float8Linear
from f8tensor.nn.weight_cache import reuse_weight_casts
from f8tensor.nn.weight_precast import per_step_weight_casts
from f8tensor.quant.config import (
    FP4_CAST_DTYPE,
    RECIPES,
    BLOCK_1x128,
    BLOCK_128x128,
    BlockGranularity,
    CastConfig,
    DelayedScalingConfig,
    Float8LinearConfig,
    GemmConfig,
    GemmOverride,
    Granularity,
    MX_1x32,
    MX_1x32_FLOOR,
    MXFP4_1x32,
    NVFP4_1x16,
    NVFP4_16x16,
    ScalingType,
)
from f8tensor.quant.formats import FLOAT8_DTYPES, FORMATS, Float8Format, float8_max, saturation_bound
from f8tensor.stats import (
    STATS_FIELDS,
    Float8SaturationWarning,
    enable_float8_stats,
    float8_stats,
    format_float8_stats,
    sqnr,
)
from f8tensor.tensor import ops as _ops  # noqa: F401  (fills Float8Tensor's op table)
from f8tensor.tensor import product_ops as _product_ops  # noqa: F401  (the op table's matrix products)
from f8tensor.tensor.float8 import (
    Float8Tensor,
    _LegacyFloat8Tensor,
    _rebuild_float8_tensor,
    _RetiredCheckpointType,
)
from f8tensor.tensor.fp4 import Float4Tensor

if torch.distributed.is_available():  # the parallel styles subclass torch.distributed's
    from f8tensor.distributed.tp import Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput

__version__ = "0.1.0"

__all__ = [
    "FLOAT8_DTYPES",
    "FORMATS",
    "FP4_CAST_DTYPE",
    "RECIPES",
    "STATS_FIELDS",
    "BLOCK_1x128",
    "BLOCK_128x128",
    "BlockGranularity",
    "CastConfig",
    "DelayedScalingConfig",
    "Float4Tensor",
    "Float8AllGatherWeight",
    "Float8ColwiseParallel",
    "Float8ExpertWeight",
    "Float8Format",
    "Float8Linear",
    "Float8LinearConfig",
    "Float8RowwiseParallel",
    "Float8SaturationWarning",
    "Float8Tensor",
    "GemmConfig",
    "GemmOverride",
    "Granularity",
    "MXFP4_1x32",
    "MX_1x32",
    "MX_1x32_FLOOR",
    "NVFP4_1x16",
    "NVFP4_16x16",
    "PrepareFloat8ModuleInput",
    "ScalingType",
    "block_policy",
    "convert_experts_to_float8",
    "convert_to_float8_training",
    "convert_with_policy",
    "enable_float8_stats",
    "float8_grouped_mm",
    "float8_max",
    "float8_mm",
    "float8_stats",
    "format_float8_stats",
    "keep_last_blocks_in_hp",
    "per_step_weight_casts",
    "precompute_float8_scales_for_fsdp",
    "reuse_weight_casts",
    "saturation_bound",
    "save_activations_in_float8",
    "set_forward_in_high_precision",
    "set_gemm_formats",
    "sqnr",
]

# torch.load(weights_only=True) refuses unknown globals: allow ours (and nothing else). A
# Float8Tensor is rebuilt by one validating function. Pre-release checkpoints (format 0) name
# the class and the config types: each resolves to a refusal naming the tag that reads them.
torch.serialization.add_safe_globals(
    [
        _rebuild_float8_tensor,
        (_LegacyFloat8Tensor, "f8tensor.tensor.Float8Tensor"),
        *[
            (_RetiredCheckpointType, f"f8tensor.{m}.{n}")
            for m in ("config", "specs")
            for n in ("GemmConfig", "Granularity")
        ],
    ]
)

install_old_paths()
