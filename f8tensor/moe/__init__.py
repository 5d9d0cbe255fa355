"""FP8 expert weights: the three GEMMs of a mixture-of-experts layer in FP8, model code untouched.

:class:`Float8ExpertWeight` wraps a 3D expert parameter and routes ``F.linear`` loops,
``torch.bmm`` and ``torch._grouped_mm`` to autograd Functions whose forward and both
backward GEMMs are FP8 (through :func:`f8tensor.gemm.grouped_mm` /
:func:`f8tensor.gemm.batched_mm`). Grouped kernels take no block scales, so block recipes,
stochastic rounding, per-GEMM formats and FP4 run a per-expert loop of ``Float8Linear``'s GEMMs
(:func:`expert_path` names the path). Every cast goes through the quantizer layer.

Modules: ``autograd`` (the products), ``weight`` (the parameter and its routes), ``state``
(checkpoints), ``planning`` (which weights a conversion wraps).
"""

from f8tensor.moe.autograd import _ExpertBmmFn, _GroupedMMFn, _pad_groups, expert_path, per_expert_loop
from f8tensor.moe.planning import (
    check_expert_config,
    convert_experts_to_float8,
    expert_configs,
    plan_experts,
    set_expert_config,
    wrap_experts,
)
from f8tensor.moe.state import _rebuild_expert_parameter
from f8tensor.moe.weight import Float8ExpertWeight, float8_grouped_mm

__all__ = ["Float8ExpertWeight", "convert_experts_to_float8", "expert_path", "float8_grouped_mm", "per_expert_loop"]

# Private names reached through the package (pickles name _rebuild_expert_parameter).
_REEXPORTED = (
    _ExpertBmmFn,
    _GroupedMMFn,
    _pad_groups,
    _rebuild_expert_parameter,
    check_expert_config,
    expert_configs,
    plan_experts,
    set_expert_config,
    wrap_experts,
)
