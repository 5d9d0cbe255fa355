"""AdamW with fp32, bf16 or 8-bit moments, and lean master weights for bf16 parameters.

:class:`AdamW` has the defaults and the math of ``torch.optim.AdamW`` (decoupled weight
decay, bias correction); what differs is where the state lives:

- ``state_dtype=torch.float32``: both moments in fp32. For fp32 parameters every step is
  bit-identical to ``torch.optim.AdamW(foreach=False)`` (the same ops in the same order).
- ``state_dtype=torch.bfloat16``: both moments stored in bf16 (2 + 2 bytes per parameter);
  each step widens them to fp32, updates and stores them back rounded to nearest.
- ``state_dtype=torch.float8_e4m3fn``: both moments ``m`` and ``v`` in e4m3 with one fp32
  scale per :data:`FP8_BLOCK` (128) consecutive elements of the flattened tensor: 1 + 1 bytes
  per parameter plus 2 * 4 / 128 for the scales, 2.0625 in all. Both go through f8tensor's
  one block cast (:func:`f8tensor.kernels.cast`, rule ``data = saturate(x * scale)``,
  dynamic scale ``448 / block amax``, round to nearest) and come back through
  :func:`f8tensor.kernels.dequantize`. Tensors with fewer than :data:`FP8_BLOCK` elements
  (biases, norms) keep fp32 moments: their states are a rounding error of the model's.

  Why ``v`` as is, blocks of 128, round to nearest: measured on an MLP regression (32 ->
  256 -> 256 -> 8, 1,024 noisy samples of a teacher network, 200 full-batch steps, lr 1e-3,
  3 seeds, CPU), the final loss relative to fp32 moments (mean over seeds; 1.0 is fp32):
  ``v`` with blocks of 32 / 128 / 256: 0.942 / 0.950 / 0.957; ``sqrt(v)`` stored instead:
  0.911 / 0.918 / 0.920; stochastic rounding of either at 128: 0.989; bf16 moments: 1.036.
  Storing ``sqrt(v)`` (half the dynamic range) was further from fp32 than ``v`` at every
  block size; stochastic rounding was closest but makes the moments depend on a random
  generator (resume and reproducibility then need its state), so it is left for later;
  128 and 256 differ by less than the seeds do, and 128 keeps an outlier's reach small.

  Experimental: 8-bit moments change the trajectory more than bf16 ones do (the final loss
  above is 5% off fp32 moments, 7-11% in ``tests/modules/test_optim.py``'s MLP, consistently lower);
  a moment rounded to nearest cannot follow ``v``'s slow decay by ``beta2`` within a block.

``master_weights`` (bf16 parameters only):

- ``None``: the update is computed in fp32 from the bf16 parameter and written back
  rounded to nearest (torch's own AdamW on bf16 parameters computes in bf16).
- ``"stochastic"``: written back with stochastic rounding (unbiased; draws from torch's
  default generator, so a resumed run repeats its bits only if that generator's state is
  restored too).
- ``"remainder"``: the low 16 bits of an fp32 master copy are kept next to the parameter
  (state ``"master_remainder"``, int16). The bf16 parameter is the master rounded to
  nearest with ties away from zero (the rounding that makes the pair an exact encoding),
  so the fp32 master is recovered exactly every step: the trajectory is that of fp32
  parameters, at 2 extra bytes per parameter instead of 4.

Non-finite gradients propagate as in torch: a NaN or inf gradient element makes its
moments and its parameter NaN (inf / inf) and the step is not skipped; with FP8 states the
NaN reaches the whole block of its moments (the block's scale is NaN). No moment is ever
a finite value computed from a non-finite gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from f8tensor.kernels import cast, dequantize
from f8tensor.specs import CastSpec

__all__ = ["FP8_BLOCK", "MASTER_WEIGHTS", "STATE_DTYPES", "AdamW"]

#: The moment dtypes :class:`AdamW` accepts.
STATE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)
#: The ``master_weights`` values :class:`AdamW` accepts.
MASTER_WEIGHTS: tuple[str | None, ...] = (None, "stochastic", "remainder")
#: Elements per fp32 scale of an FP8 moment (along the flattened tensor); also the size
#: below which a tensor keeps fp32 moments.
FP8_BLOCK = 128

_FP8_SPEC = CastSpec(torch.float8_e4m3fn, (FP8_BLOCK,))


def _check_hyper(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    if not isinstance(lr, (int, float)) or not lr >= 0.0:
        raise ValueError(f"lr must be a float >= 0; got {lr!r}")
    if not isinstance(eps, (int, float)) or not eps >= 0.0:
        raise ValueError(f"eps must be a float >= 0; got {eps!r}")
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two floats in [0, 1); got {betas!r}")
    if not isinstance(weight_decay, (int, float)) or not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be a float >= 0; got {weight_decay!r}")


def _check_options(state_dtype: Any, master_weights: Any) -> None:
    if state_dtype not in STATE_DTYPES:
        allowed = ", ".join(str(d) for d in STATE_DTYPES)
        raise ValueError(f"state_dtype must be one of {allowed}; got {state_dtype!r}")
    if master_weights not in MASTER_WEIGHTS:
        raise ValueError(f"master_weights must be one of {MASTER_WEIGHTS}; got {master_weights!r}")


# ---------------------------------------------------------------- the bf16 master encodings


def _split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``master`` -> (bf16 rounded to nearest, ties away from zero; int16 low half).

    The bf16 bits are the master's high 16 bits plus one when its low half is >= 0x8000
    (on the sign-magnitude pattern: one ulp away from zero). The low half is stored as is,
    so the high half is the bf16's minus that carry, which the low half's top bit says.
    """
    bits = master.view(torch.int32)
    low = bits & 0xFFFF
    high = (bits >> 16) + (low >= 0x8000).to(torch.int32)
    # Wrap both halves into int16's range explicitly (a narrowing .to() of out-of-range
    # values is not defined the same everywhere).
    high16 = (((high + 0x8000) & 0xFFFF) - 0x8000).to(torch.int16)
    low16 = (((low + 0x8000) & 0xFFFF) - 0x8000).to(torch.int16)
    return high16.view(torch.bfloat16), low16


def _join_master(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master that :func:`_split_master` split into ``param`` and ``remainder``."""
    # int64: every shift and sum below stays in range.
    high = param.view(torch.int16).to(torch.int64) & 0xFFFF
    low = remainder.to(torch.int64) & 0xFFFF
    high = (high - (low >= 0x8000).to(torch.int64)) & 0xFFFF
    bits = (high << 16) | low
    bits = bits - (bits >= 2**31).to(torch.int64) * 2**32
    return bits.to(torch.int32).view(torch.float32)


def _stochastic_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to bf16 stochastically: up (in magnitude) with probability equal to
    the dropped low half's fraction of a bf16 ulp. NaN stays NaN; inf stays inf."""
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device)
    bits = (x.view(torch.int32) + noise) & ~0xFFFF
    out = bits.view(torch.float32)
    out = torch.where(torch.isfinite(x), out, x)
    return out.to(torch.bfloat16)


# ---------------------------------------------------------------- the optimizer


class AdamW(torch.optim.Optimizer):
    """AdamW (``torch.optim.AdamW``'s defaults and math) with moments in ``state_dtype`` and,
    for bf16 parameters, a choice of ``master_weights``. See the module docstring.

    Group options: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``state_dtype``,
    ``master_weights`` (a group added later inherits the constructor's unless it sets them).

    State per parameter: ``step`` (a 0-dim fp32 tensor, as torch's); ``exp_avg`` and
    ``exp_avg_sq`` (the parameter's shape, in ``state_dtype``; fp32 for FP8 states of a
    tensor under :data:`FP8_BLOCK` elements); for FP8 states ``exp_avg`` (flat e4m3 data),
    ``exp_avg_scale``, ``exp_avg_sq`` (flat e4m3 data) and ``exp_avg_sq_scale``
    (fp32, one per block of :data:`FP8_BLOCK`); with ``master_weights="remainder"``
    ``master_remainder`` (int16, the parameter's shape). Every entry is a plain tensor, so
    ``state_dict()`` loads with ``torch.load(weights_only=True)``.

    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        state_dtype: torch.dtype = torch.float32,
        master_weights: str | None = None,
    ) -> None:
        _check_hyper(lr, betas, eps, weight_decay)
        _check_options(state_dtype, master_weights)
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "state_dtype": state_dtype,
            "master_weights": master_weights,
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        _check_options(group["state_dtype"], group["master_weights"])
        for p in group["params"]:
            if p.is_complex():
                raise ValueError(f"AdamW takes real parameters; got a {p.dtype} parameter of shape {tuple(p.shape)}")
            if not p.is_floating_point():
                raise ValueError(f"AdamW takes floating-point parameters; got {p.dtype}")
            if group["master_weights"] is not None and p.dtype != torch.bfloat16:
                raise ValueError(
                    f"master_weights={group['master_weights']!r} applies to bf16 parameters only; got a {p.dtype} "
                    f"parameter of shape {tuple(p.shape)} (put it in a param group with master_weights=None)"
                )

    # ------------------------------------------------------------ state

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[p]
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state_dtype = group["state_dtype"]
        if state_dtype == torch.float8_e4m3fn and p.numel() >= FP8_BLOCK:
            zeros = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
            for name in ("exp_avg", "exp_avg_sq"):
                data, scale = cast(zeros, _FP8_SPEC)
                state[name], state[name + "_scale"] = data, scale
        else:
            dtype = torch.bfloat16 if state_dtype == torch.bfloat16 else torch.float32
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        if group["master_weights"] == "remainder":
            # A bf16 parameter is an fp32 master whose low half is zero: the remainder starts at 0.
            state["master_remainder"] = torch.zeros_like(p, dtype=torch.int16)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, but every state tensor keeps the dtype it was saved in (torch's casts
        floating-point state to the parameter's dtype, which would undo 8-bit and bf16
        states and round fp32 moments of a bf16 parameter)."""
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        super().load_state_dict(state_dict)
        for group, saved in zip(self.param_groups, saved_groups):
            for p, pid in zip(group["params"], saved["params"]):
                if pid not in saved_state:
                    continue
                for key, value in saved_state[pid].items():
                    if isinstance(value, torch.Tensor) and key != "step":
                        self.state[p][key] = value.to(device=p.device, copy=True)

    # ------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW does not support sparse gradients; got a sparse gradient")
                state = self.state[p]
                if len(state) == 0:
                    state = self._init_state(p, group)
                self._update(p, p.grad, state, group)
        return loss

    def _update(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        master_weights = group["master_weights"]
        step_t = state["step"]
        step_t += 1
        step = step_t.item()

        # The fp32 tensor the update is applied to: the parameter itself when it is fp32.
        if p.dtype == torch.float32:
            param = p
        elif master_weights == "remainder":
            param = _join_master(p, state["master_remainder"])
        else:
            # Deliberate upcast: the update is computed in fp32 from the low-precision parameter.
            param = p.to(torch.float32)
        grad = grad if grad.dtype == torch.float32 else grad.to(torch.float32)

        if weight_decay != 0:
            param.mul_(1 - lr * weight_decay)

        fp8 = "exp_avg_scale" in state
        if fp8:
            exp_avg = dequantize(state["exp_avg"], state["exp_avg_scale"], (FP8_BLOCK,), torch.float32)
            exp_avg_sq = dequantize(state["exp_avg_sq"], state["exp_avg_sq_scale"], (FP8_BLOCK,), torch.float32)
            exp_avg, exp_avg_sq = exp_avg.view_as(param), exp_avg_sq.view_as(param)
        elif state["exp_avg"].dtype == torch.float32:
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        else:
            exp_avg, exp_avg_sq = state["exp_avg"].to(torch.float32), state["exp_avg_sq"].to(torch.float32)

        # The ops and their order are torch's single-tensor AdamW's (bit-identical in fp32).
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)

        if fp8:
            state["exp_avg"], state["exp_avg_scale"] = cast(exp_avg.reshape(-1), _FP8_SPEC)
            state["exp_avg_sq"], state["exp_avg_sq_scale"] = cast(exp_avg_sq.reshape(-1), _FP8_SPEC)
        elif state["exp_avg"].dtype != torch.float32:
            state["exp_avg"].copy_(exp_avg)
            state["exp_avg_sq"].copy_(exp_avg_sq)

        if param is not p:
            if master_weights == "remainder":
                high, low = _split_master(param)
                p.copy_(high)
                state["master_remainder"].copy_(low)
            elif master_weights == "stochastic":
                p.copy_(_stochastic_bf16(param))
            else:
                p.copy_(param)
