"""The bf16 parameter encodings of :class:`f8tensor.optim.AdamW`'s ``master_weights``.

``"remainder"``: an fp32 master kept as a bf16 parameter (the master rounded to nearest,
ties away from zero) and the int16 low half of the master's bits, an exact encoding
(:func:`split_master`, :func:`join_master`). ``"stochastic"``: an fp32 update written back
to bf16 with stochastic rounding (:func:`stochastic_bf16`).
"""

from __future__ import annotations

import torch

__all__ = ["join_master", "split_master", "stochastic_bf16"]


def _halves(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int16 (low, high) halves of each fp32 element of ``master`` (views of its bytes:
    little-endian, as every host and GPU torch runs on)."""
    pairs = master.reshape(-1).view(torch.int16).view(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``master`` -> (bf16 rounded to nearest, ties away from zero; int16 low half; under
    torch.compile its int32 value).

    The bf16 bits are the master's high 16 bits plus one when its low half is >= 0x8000
    (its int16 is negative; on the sign-magnitude pattern: one ulp away from zero). The low
    half is stored as is, so the high half is the bf16's minus that carry, which the low
    half's top bit says. int16 arithmetic throughout (a finite master never carries past
    0x7F80, inf's pattern; only NaN patterns could wrap, and stay NaN or become inf).
    """
    if torch.compiler.is_compiling():
        # The same bits in int32 arithmetic on the fp32 bits, and the bf16 made by converting
        # an fp32 whose low half is zero (exact): compiled code vectorizes same-width
        # bitcasts and conversions, not a bitcast between int16 and bf16. One difference:
        # where the bf16 is a NaN it is bf16's canonical NaN (the conversion's), not the bits.
        bits = master.view(torch.int32)
        low32 = (bits << 16) >> 16  # the low half, sign-extended: its int16 value
        high32 = (bits >> 16) + (low32 < 0).to(torch.int32)  # wraps as int16 arithmetic does
        # The low half as its int32 value: the caller's copy into the int16 remainder keeps
        # the low 16 bits (an int32 remainder, the compiled CPU step's, takes it as is).
        return (high32 << 16).view(torch.float32).to(torch.bfloat16), low32
    low, high = _halves(master)
    bf16 = (high + (low < 0).to(torch.int16)).view(torch.bfloat16).view(master.shape)
    return bf16, low.clone().view(master.shape)


def join_master(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master that :func:`split_master` split into ``param`` and ``remainder``
    (int16, or under torch.compile its int32 value)."""
    if torch.compiler.is_compiling():  # int32 arithmetic, as in split_master
        low32 = remainder.to(torch.int32)
        # The bf16 bits, sign-extended, from its exact fp32 value (the bits shifted up by 16).
        high32 = (param.to(torch.float32).view(torch.int32) >> 16) - (low32 < 0).to(torch.int32)
        return ((high32 << 16) | (low32 & 0xFFFF)).view(torch.float32)
    low = remainder.reshape(-1)
    high = param.reshape(-1).view(torch.int16) - (low < 0).to(torch.int16)
    return torch.stack((low, high), dim=-1).view(torch.int32).view(torch.float32).view(param.shape)


def stochastic_bf16(x: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to bf16 stochastically: up (in magnitude) with probability equal to
    the dropped low half's fraction of a bf16 ulp (``uniform``: draws in ``[0, 1)`` with 24
    bits, ``x``'s shape). NaN stays NaN; inf stays inf."""
    noise = (uniform * (1 << 16)).to(torch.int32)  # exact: uniform integers in [0, 2**16)
    bits = (x.view(torch.int32) + noise) & ~0xFFFF
    out = bits.view(torch.float32)
    out = torch.where(torch.isfinite(x), out, x)
    return out.to(torch.bfloat16)
