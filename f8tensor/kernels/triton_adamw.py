"""The fused AdamW step: one Triton kernel per parameter tensor, used by :class:`f8tensor.optim.AdamW`.

The kernel reads parameter, gradient and moments once, dequantizes FP8 moments with their
block scales, updates in fp32 and writes everything once, requantizing FP8 moments in the
same program (a program holds whole blocks). Stochastic rounding reads the same seeded
tables of draws as the torch-ops path, so both write the same bits.

Bits: the kernel repeats torch's op sequence and rounding (correctly rounded ``div_rn``
and ``sqrt_rn``; contraction only where torch fuses), following the device it runs for:
``x / scalar`` divides on CPU but multiplies by the fp32 reciprocal on CUDA; ``addcdiv``
is ``p + (s * m) / d`` on CPU, ``fma(s, m / d, p)`` on CUDA. On CPU tensors it runs under
the Triton interpreter, compared bit for bit with the torch-ops path; only a NaN's payload
and sign may differ. No device read on the host (no sync).
"""

from __future__ import annotations

import os
import struct
from typing import NamedTuple

import torch

from f8tensor.kernels.triton_cast import _format, _kernels, available
from f8tensor.quant.scaling import EPS

__all__ = ["AdamWScalars", "adamw_step", "available", "supports"]

#: Blocks per program (of ``block`` elements, padded to a power of two).
_BLOCKS_PER_PROGRAM = 8
#: The flat tiling of a tensor with fp32 or bf16 moments (no scales: any cut is a tiling).
_FLAT_BLOCK = 128
# No contraction beyond the kernel's explicit fma calls: each op rounds as torch's does.
_OPTIONS = {"enable_fp_fusion": False}
_PLAIN = (torch.Tensor, torch.nn.Parameter)


class AdamWScalars(NamedTuple):
    """One step's hyperparameters, as Python floats (``step``: the step count after the
    increment)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: float


def _f32(x: float) -> float:
    """``x`` rounded to fp32 (to nearest), as torch converts a Python scalar for an fp32 op."""
    return struct.unpack("f", struct.pack("f", x))[0]


def supports(param: torch.Tensor, grad: torch.Tensor, states: tuple[torch.Tensor, ...]) -> bool:
    """Whether the kernel takes this tensor: plain, contiguous tensors on one device, an
    fp32 or bf16 parameter, a gradient of the parameter's dtype or fp32, moments in fp32,
    bf16 or e4m3 (with fp32 scales). Anything else (fp16 parameters, strided views, a
    weight wrapper subclass as the local shard) takes the torch-ops path."""
    if param.dtype not in (torch.float32, torch.bfloat16) or grad.dtype not in (torch.float32, param.dtype):
        return False
    if grad.shape != param.shape:
        return False
    for t in (param, grad, *states):
        if type(t) not in _PLAIN or t.device != param.device or not t.is_contiguous():
            return False
    return True


def adamw_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    scalars: AdamWScalars,
    *,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    block: int = _FLAT_BLOCK,
    stochastic: tuple[bool, bool] = (False, False),
    tables: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] = (None, None, None),
    start: int = 0,
    master: str | None = None,
    remainder: torch.Tensor | None = None,
) -> None:
    """One AdamW step of one tensor, in place, by one kernel launch.

    ``param`` (fp32 or bf16), ``grad``, ``exp_avg``, ``exp_avg_sq``: contiguous, the same
    shape (FP8 moments: e4m3 data of that shape). ``scales``: FP8 moments' fp32 scales,
    shape ``(rows, ceil(row / block))`` with ``rows = param.shape[0]``; ``block``: the
    elements per scale along a row. ``stochastic``: per moment, stochastic rounding (else
    nearest). ``tables``: the uniform draws (fp32, one period each) of the two moments'
    and the parameter's stochastic roundings; element ``i`` reads entry ``(start + i) mod
    period``. ``master``: None, ``"stochastic"`` or ``"remainder"`` (bf16 parameters;
    ``remainder``: the int16 low halves)."""
    if param.numel() == 0:
        return
    if param.device.type == "cuda" and param.device.index != torch.cuda.current_device():
        with torch.cuda.device(param.device):  # Triton launches on the current device
            adamw_step(param, grad, exp_avg, exp_avg_sq, scalars, scales=scales, block=block, stochastic=stochastic,
                       tables=tables, start=start, master=master, remainder=remainder)  # fmt: skip
        return
    cuda = param.device.type == "cuda"
    k = _kernels(not cuda or os.environ.get("TRITON_INTERPRET") == "1", "_triton_adamw_kernels")
    fp8 = scales is not None
    if scales is not None:
        if exp_avg.dtype != torch.float8_e4m3fn or exp_avg_sq.dtype != torch.float8_e4m3fn:
            raise ValueError(f"adamw_step: FP8 moments must be float8_e4m3fn; got {exp_avg.dtype}, {exp_avg_sq.dtype}")
        rows = param.shape[0]
        cols = param.numel() // rows
        nb = -(-cols // block)
        if tuple(scales[0].shape) != (rows, nb) or tuple(scales[1].shape) != (rows, nb):
            raise ValueError(f"adamw_step: scales must have shape {(rows, nb)}; got {tuple(scales[0].shape)}")
        states = 2
        m, v = exp_avg.view(torch.uint8), exp_avg_sq.view(torch.uint8)
        ms, vs = scales
    else:
        rows, cols, block = 1, param.numel(), _FLAT_BLOCK
        nb = -(-cols // block)
        if exp_avg.dtype == torch.bfloat16:
            states, m, v = 1, exp_avg.view(torch.int16), exp_avg_sq.view(torch.int16)
        elif exp_avg.dtype == torch.float32:
            states, m, v = 0, exp_avg, exp_avg_sq
        else:
            raise ValueError(f"adamw_step: moments must be fp32, bf16 or e4m3 with scales; got {exp_avg.dtype}")
        ms, vs = m, v  # unread
    p_bf16 = param.dtype == torch.bfloat16
    if master is not None and not p_bf16:
        raise ValueError(f"adamw_step: master={master!r} needs a bf16 parameter; got {param.dtype}")
    if master == "remainder" and remainder is None:
        raise ValueError("adamw_step: master='remainder' needs the int16 remainder")
    p = param.view(torch.int16) if p_bf16 else param
    g = grad.view(torch.int16) if grad.dtype == torch.bfloat16 else grad
    m_table, v_table, p_table = (t if t is not None else g for t in tables)
    period = next((t.numel() for t in tables if t is not None), 1)

    lr, beta1, beta2, eps, weight_decay, step = scalars
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    w1 = _f32(1 - beta1)
    # CUDA's ``x / scalar`` multiplies by the fp32 reciprocal (computed in fp32 on the host:
    # the float64 quotient of two fp32 values, rounded once, is the correctly rounded one).
    bc2 = _f32(bias_correction2_sqrt)
    bc2 = _f32(1.0 / bc2) if cuda else bc2
    f = _format(torch.float8_e4m3fn)
    n_blocks = rows * nb
    grid = (-(-n_blocks // _BLOCKS_PER_PROGRAM),)
    k.adamw_step_kernel[grid](
        p, remainder if remainder is not None else p, g, m, v, ms, vs, m_table, v_table, p_table,
        cols, nb, n_blocks, block, start, period,
        _f32(1 - lr * weight_decay), w1, _f32(beta2), _f32(1 - beta2), bc2, _f32(-(lr / bias_correction1)), _f32(eps),
        P_BF16=p_bf16, G_BF16=grad.dtype == torch.bfloat16, STATES=states,
        MASTER={None: 0, "stochastic": 1, "remainder": 2}[master],
        HAS_WD=weight_decay != 0, LERP_SMALL=abs(w1) < 0.5, STOCH_M=fp8 and stochastic[0],
        STOCH_V=fp8 and stochastic[1], TORCH_CUDA=cuda,
        FMAX=f.fmax, BIAS=f.bias, MBITS=f.mbits, EPS=EPS,
        G=_BLOCKS_PER_PROGRAM, B=1 << max(block - 1, 0).bit_length(), **_OPTIONS,
    )  # fmt: skip
