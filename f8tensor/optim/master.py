"""The bf16 parameter encodings of :class:`f8tensor.optim.AdamW`'s ``master_weights``.

``"remainder"``: an exact fp32 master as the bf16 parameter plus the int16 low half of its
bits. ``"stochastic"``: the fp32 update stochastically rounded to bf16.
"""

from __future__ import annotations

import torch

__all__ = ["join_master", "split_master", "stochastic_bf16"]


def _halves(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int16 (low, high) halves of each fp32 element (little-endian views)."""
    pairs = master.reshape(-1).view(torch.int16).view(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``master`` -> (bf16 rounded to nearest, ties away from zero; int16 low half).

    The bf16 is the high half plus one when the low half's top bit is set; under torch.compile
    the low half comes as its int32 value. A finite master never carries into inf's pattern.
    """
    if torch.compiler.is_compiling():
        # int32 arithmetic: compiled code vectorizes same-width bitcasts only. A NaN bf16 becomes the
        # canonical NaN here.
        bits = master.view(torch.int32)
        low32 = (bits << 16) >> 16
        high32 = (bits >> 16) + (low32 < 0).to(torch.int32)
        return (high32 << 16).view(torch.float32).to(torch.bfloat16), low32
    low, high = _halves(master)
    bf16 = (high + (low < 0).to(torch.int16)).view(torch.bfloat16).view(master.shape)
    return bf16, low.clone().view(master.shape)


def join_master(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master that :func:`split_master` split into ``param`` and ``remainder``."""
    if torch.compiler.is_compiling():
        low32 = remainder.to(torch.int32)
        high32 = (param.to(torch.float32).view(torch.int32) >> 16) - (low32 < 0).to(torch.int32)
        return ((high32 << 16) | (low32 & 0xFFFF)).view(torch.float32)
    low = remainder.reshape(-1)
    high = param.reshape(-1).view(torch.int16) - (low < 0).to(torch.int16)
    return torch.stack((low, high), dim=-1).view(torch.int32).view(torch.float32).view(param.shape)


def stochastic_bf16(x: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to bf16, up with probability the dropped fraction of an ulp.

    ``uniform``: draws in ``[0, 1)``, ``x``'s shape. Non-finite values stay.
    """
    noise = (uniform * (1 << 16)).to(torch.int32)
    bits = (x.view(torch.int32) + noise) & ~0xFFFF
    out = bits.view(torch.float32)
    out = torch.where(torch.isfinite(x), out, x)
    return out.to(torch.bfloat16)
