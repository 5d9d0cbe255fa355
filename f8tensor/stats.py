"""Numerics you can see: accuracy measures and (per layer) cast telemetry."""

from __future__ import annotations

import torch

__all__ = ["sqnr"]


def sqnr(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``actual`` against ``reference``, in dB.

    ``10 * log10(sum(ref**2) / sum((ref - actual)**2))``, computed in float64. Equal
    tensors give ``inf``; a NaN anywhere gives NaN (so a threshold check fails loudly).
    """
    if reference.shape != actual.shape:
        raise ValueError(f"sqnr needs equal shapes; got {tuple(reference.shape)} and {tuple(actual.shape)}")
    ref = _plain(reference).detach().to(torch.float64)
    act = _plain(actual).detach().to(torch.float64)
    signal = ref.pow(2).sum()
    noise = (ref - act).pow(2).sum()
    return float(10.0 * torch.log10(signal / noise))


def _plain(t: torch.Tensor) -> torch.Tensor:
    to_hp = getattr(type(t), "to_hp", None)
    return t.to_hp() if to_hp is not None else t
