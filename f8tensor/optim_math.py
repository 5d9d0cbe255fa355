"""The arithmetic of one :class:`f8tensor.optim.AdamW` step that is not a cast: the
scalars of a step, and the moments' update as compiled code computes it.

:func:`scalars` gives torch's single-tensor AdamW's scalars (bias corrections, step size)
as Python floats for the eager path, or as tensors computed from the step counter under
``torch.compile``, where the counter stays a tensor. :func:`compiled_moments` is
``lerp_`` and ``mul_`` + ``addcmul_`` of the moments with the eager CPU kernels' roundings,
for compiled code.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from f8tensor.compat import fma

__all__ = ["Scalars", "compiled_moments", "scalars"]


class Scalars(NamedTuple):
    """One step's hyperparameters as the ops take them: Python floats, except under
    ``torch.compile``, where the two that depend on the step counter are 0-dim fp32 tensors
    computed from it (the counter stays a tensor in the graph)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    bias_correction2_sqrt: float | torch.Tensor
    neg_step_size: float | torch.Tensor


def scalars(group: dict[str, Any], step: float | torch.Tensor) -> Scalars:
    """torch's single-tensor AdamW's scalars for ``step`` (after the increment), in float64:
    Python floats in eager mode; under compile a float64 tensor (0-dim pow, division and
    square root give the Python floats' fp32 values: 160,000 (beta, step) pairs checked),
    rounded to fp32 as torch rounds a Python scalar for an fp32 op."""
    beta1, beta2 = group["betas"]
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = group["lr"] / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    hyper = (group["lr"], beta1, beta2, group["eps"], group["weight_decay"])
    if isinstance(step, torch.Tensor):
        return Scalars(*hyper, bias_correction2_sqrt.float(), (-step_size).float())
    return Scalars(*hyper, bias_correction2_sqrt, -step_size)


def compiled_moments(
    grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, s: Scalars
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lerp_`` and ``mul_`` + ``addcmul_`` of the moments as compiled code computes them
    with the eager CPU kernels' roundings: ATen's vectorized CPU lerp is
    ``fma(w, end - start, start)`` (``fma(w - 1, end - start, end)`` for ``w >= 0.5``) and
    its addcmul ``fma(value * t1, t2, self)``, fused multiply-adds that inductor's own
    lowerings of lerp and addcmul do not emit on CPU; :func:`~f8tensor.compat.fma` does."""
    # The scalars as fp32 tensors, as the eager kernels convert them; the weight's branch
    # and ``w - 1`` (exact) in fp32, as the kernel computes them.
    w = torch.full((), 1 - s.beta1, dtype=torch.float32, device=grad.device)
    small = w.abs() < 0.5
    exp_avg = fma(torch.where(small, w, w - 1), grad - exp_avg, torch.where(small, exp_avg, grad))
    value = torch.full((), 1 - s.beta2, dtype=torch.float32, device=grad.device)
    exp_avg_sq = fma(grad * value, grad, exp_avg_sq * s.beta2)
    return exp_avg, exp_avg_sq
