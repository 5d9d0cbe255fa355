"""Raw casts: a high-precision tensor and a cast spec in, FP8 data and scales out.

Below the tensor (``f8tensor.tensor`` wraps what these return in a Float8Tensor), so that
``from_hp``, every Float8Linear and expert cast, and the operand preparation of every
product use the same casts. Three functions, each the one place its kind of call goes:

- :func:`cast`: ``(hp, spec, scale=None) -> (data, scale)``;
- :func:`cast_with_stats`: the same, plus the telemetry vector (:data:`CAST_STATS_FIELDS`);
- :func:`dequantize`: ``(data, scale, block, dtype) -> hp``.

Today they are the torch-ops reference (:mod:`f8tensor.kernels.reference`): the same bits
eager and under torch.compile, where inductor fuses each into one pass. Fused kernels
(Triton, behind ``torch.library.custom_op``) are siblings of ``reference.py``; choosing
between them happens in these three functions, and nothing above this package changes.

Layer: above ``scaling``; imports ``scaling``, ``config``, ``formats``, ``compat``.
"""

from __future__ import annotations

from f8tensor.kernels.reference import CAST_STATS_FIELDS, cast, cast_with_stats, dequantize

__all__ = ["CAST_STATS_FIELDS", "cast", "cast_with_stats", "dequantize"]
