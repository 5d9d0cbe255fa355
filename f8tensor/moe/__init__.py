"""FP8 expert weights: the three GEMMs of a mixture-of-experts layer in FP8, model code untouched.

Hugging Face MoE models keep their experts as 3D parameters, ``gate_up_proj`` (E, 2I, H) and
``down_proj`` (E, H, I), and multiply them in one of three ways: a Python loop of
``F.linear(x, w[e])``, ``torch.bmm`` over gathered per-token weights, or
``torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)`` over tokens sorted by expert.
:class:`Float8ExpertWeight` is the parameter that makes all three run in FP8: it behaves
like the plain tensor it wraps (indexing, views, optimizer steps, ``copy_``, checkpoints),
and its ``__torch_function__`` routes ``F.linear``, ``torch.bmm``, ``torch._grouped_mm`` /
``F.grouped_mm`` and transformers' grouped fallback op to autograd Functions whose forward
and both backward GEMMs are FP8, through gemm's front doors for grouped and batched
products (:func:`f8tensor.gemm.grouped_mm`, :func:`f8tensor.gemm.batched_mm`).

Scaling, per :class:`~f8tensor.quant.config.Float8LinearConfig` (``input``, ``weight``,
``grad_output`` granularities; recipes ``tensorwise`` and ``rowwise``):

- weights: tensorwise = one scale per expert; rowwise = one scale per expert row of the
  stored (E, N, K) weight (per output feature, constant along the contraction dim K); the
  input-gradient GEMM contracts over N and re-casts the weight along N (per expert column).
- activations and gradients: tensorwise = one scale per tensor; rowwise = one per token
  row. The weight-gradient GEMM contracts over each expert's tokens: rowwise scales there
  are per (expert, feature), measured over that expert's tokens only.
- all three grouped/batched GEMMs take e4m3 operands, ``grad_output`` included, because
  ``torch._scaled_grouped_mm`` multiplies no e5m2 (the tensorwise recipe's e5m2 gradients
  apply to the loop path, which runs through ``Float8Linear``'s GEMMs).

Every cast takes a :class:`~f8tensor.quant.config.CastSpec` from :meth:`CastConfig.operand_spec`
(:func:`_spec`) and goes through the quantizer layer: the operands of a grouped or batched
product through :func:`f8tensor.quant.quantizers.quantize`, the linear's one cast entry point; the
weight-gradient product's per-group casts (raw bytes and scales) through a
:class:`~f8tensor.quant.block_quantizers.BlockQuantizer`.

Block granularities (``blockwise``: 1x128 activations and gradients, 128x128 weights;
``mxfp8``: 1x32 e8m0) and stochastic rounding: the grouped kernel takes one fp32 scale per
row of ``a`` and per column of ``b`` (:class:`~f8tensor.gemm.rules.GroupedMMRule`, torch
2.11-2.14), so no grouped or batched kernel takes these scales. Such a recipe runs its
experts as a per-expert loop of ``Float8Linear``'s own three GEMMs (:func:`_expert_loop`):
the same casts, bytes and block-scaled products as a dense ``Float8Linear`` with that
recipe, legal ``F.scaled_mm`` calls where the block rules allow them (sm90, 1x128 by
128x128) and the emulated reference product elsewhere, decided by the block rules
(:func:`expert_path` names the path; the converter reports it). The grouped loop reads the
group sizes on the host (one sync per product; under ``torch.compile`` a graph break).

The package, one concern per module: ``autograd`` (the grouped and batched FP8 products
and the per-expert loop), ``weight`` (:class:`Float8ExpertWeight` and the routes of its
products), ``state`` (checkpoints: state-dict hooks and the pickle rebuild), ``planning``
(which weights a conversion wraps).
"""

from f8tensor.moe.autograd import _ExpertBmmFn, _GroupedMMFn, _pad_groups, expert_path, per_expert_loop
from f8tensor.moe.planning import convert_experts_to_float8, plan_experts, wrap_experts
from f8tensor.moe.state import _rebuild_expert_parameter
from f8tensor.moe.weight import Float8ExpertWeight, float8_grouped_mm

__all__ = ["Float8ExpertWeight", "convert_experts_to_float8", "expert_path", "float8_grouped_mm", "per_expert_loop"]

# Private names other modules and tests reach through the package; _rebuild_expert_parameter
# is named by pickles of earlier releases.
_REEXPORTED = (_ExpertBmmFn, _GroupedMMFn, _pad_groups, _rebuild_expert_parameter, plan_experts, wrap_experts)
