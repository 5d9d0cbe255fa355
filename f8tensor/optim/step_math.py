"""The arithmetic of an :class:`f8tensor.optim.AdamW` step that is not a cast.

Group options (:func:`check_group`), torch's step scalars (:func:`scalars`), and the moments'
update with the eager CPU kernels' roundings for compiled code (:func:`compiled_moments`).
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
#: ``torch.optim.AdamW``'s group options taken at these values only (``foreach``/``fused``
#: pick an implementation and are ignored).
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
    """Raise ``ValueError`` naming the first option of ``group`` AdamW does not take, and what it allows."""
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
    """One step's hyperparameters: Python floats, or under compile 0-dim fp32 tensors for the step-dependent two."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    bias_correction2_sqrt: float | torch.Tensor
    neg_step_size: float | torch.Tensor


def scalars(group: dict[str, Any], step: float | torch.Tensor) -> Scalars:
    """torch's single-tensor AdamW's scalars for ``step`` in float64, rounded to fp32 under compile."""
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
    """The moments' ``lerp_`` and ``mul_`` + ``addcmul_`` with the eager CPU kernels' roundings.

    ATen's CPU lerp and addcmul are fused multiply-adds that inductor's lowerings do not emit
    on CPU; :func:`~f8tensor.compat.fma` does.
    """
    # fp32 scalars and branch, as the eager kernel computes them.
    w = torch.full((), 1 - s.beta1, dtype=torch.float32, device=grad.device)
    small = w.abs() < 0.5
    exp_avg = fma(torch.where(small, w, w - 1), grad - exp_avg, torch.where(small, exp_avg, grad))
    value = torch.full((), 1 - s.beta2, dtype=torch.float32, device=grad.device)
    exp_avg_sq = fma(grad * value, grad, exp_avg_sq * s.beta2)
    return exp_avg, exp_avg_sq
