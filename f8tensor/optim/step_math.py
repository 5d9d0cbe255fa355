"""The arithmetic of one :class:`f8tensor.optim.AdamW` step that is not a cast: a param
group's options (:func:`check_group`), the scalars of a step, and the moments' update as
compiled code computes it.

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

__all__ = [
    "MASTER_WEIGHTS",
    "STATE_DTYPES",
    "TORCH_FIXED_OPTIONS",
    "Scalars",
    "check_group",
    "compiled_moments",
    "scalars",
]

#: The moment dtypes :class:`~f8tensor.optim.AdamW` accepts.
STATE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)
#: The ``master_weights`` values :class:`~f8tensor.optim.AdamW` accepts.
MASTER_WEIGHTS: tuple[str | None, ...] = (None, "stochastic", "remainder")
#: ``torch.optim.AdamW``'s param-group options that :class:`~f8tensor.optim.AdamW` takes at
#: these values only: ``foreach`` and ``fused`` pick torch's implementation, not the math
#: (no-ops here); ``capturable`` and ``differentiable`` are not implemented; AdamW's weight
#: decay is decoupled.
TORCH_FIXED_OPTIONS: dict[str, tuple[bool | None, ...]] = {
    "foreach": (None, False, True),
    "fused": (None, False, True),
    "capturable": (False,),
    "differentiable": (False,),
    "decoupled_weight_decay": (True,),
}


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_group(group: dict[str, Any]) -> None:
    """Raise ValueError naming the first option of ``group`` (a param group with every
    default filled in) that AdamW does not take, and what it allows."""
    lr, betas, eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    if not _number(lr) or not lr >= 0.0:
        raise ValueError(f"lr must be a float >= 0; got {lr!r}")
    if not _number(eps) or not eps >= 0.0:
        raise ValueError(f"eps must be a float >= 0; got {eps!r}")
    if len(betas) != 2 or not all(_number(b) and 0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two floats in [0, 1); got {betas!r}")
    if not _number(weight_decay) or not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be a float >= 0; got {weight_decay!r}")
    if group["state_dtype"] not in STATE_DTYPES:
        allowed = ", ".join(str(d) for d in STATE_DTYPES)
        raise ValueError(f"state_dtype must be one of {allowed}; got {group['state_dtype']!r}")
    if group["master_weights"] not in MASTER_WEIGHTS:
        raise ValueError(f"master_weights must be one of {MASTER_WEIGHTS}; got {group['master_weights']!r}")
    for key in ("amsgrad", "maximize"):
        if not isinstance(group[key], bool):
            raise TypeError(f"{key} must be True or False; got {group[key]!r}")
    if group["amsgrad"] and group["state_dtype"] != torch.float32:
        raise ValueError(
            f"amsgrad=True keeps the running max of exp_avg_sq in fp32 and needs state_dtype=torch.float32; got "
            f"state_dtype={group['state_dtype']} (use amsgrad=False with 8-bit or bf16 moments)"
        )
    for option, values in TORCH_FIXED_OPTIONS.items():
        if option in group and not any(group[option] is value for value in values):
            raise ValueError(
                f"f8tensor.optim.AdamW does not implement torch's {option}={group[option]!r}; allowed: "
                f"{', '.join(repr(v) for v in values)}"
            )


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
