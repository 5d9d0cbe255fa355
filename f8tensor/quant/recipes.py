"""The named recipes, as data: each one is the fields of a
:class:`~f8tensor.quant.config.Float8LinearConfig`, a role's cast written as the keyword arguments
of its :class:`~f8tensor.quant.config.CastConfig`. ``config`` builds and validates them
(:data:`f8tensor.quant.config.RECIPES`, :meth:`~f8tensor.quant.config.Float8LinearConfig.from_recipe`);
this module holds the choices and where they come from, in the words of ``specs``.
"""

from __future__ import annotations

from typing import Any

import torch

from f8tensor.quant.specs import (
    FP4_CAST_DTYPE,
    BLOCK_1x128,
    BLOCK_128x128,
    Granularity,
    MX_1x32,
    MXFP4_1x32,
    NVFP4_1x16,
    NVFP4_16x16,
)

__all__ = ["CAST_ROLES", "RECIPE_FIELDS"]

#: The fields of a recipe that are casts (keyword arguments of a CastConfig).
CAST_ROLES = ("input", "weight", "grad_output")

_E4M3 = torch.float8_e4m3fn
_E5M2 = torch.float8_e5m2
_ROWWISE = {"dtype": _E4M3, "granularity": Granularity.ROWWISE}
_TILE_1x128 = {"dtype": _E4M3, "granularity": BLOCK_1x128}
_MX = {"dtype": _E4M3, "granularity": MX_1x32}
_DELAYED_E4M3 = {"dtype": _E4M3, "scaling": "delayed"}

#: Recipe name -> Float8LinearConfig fields (the roles of :data:`CAST_ROLES` as CastConfig
#: keyword arguments; a field left out keeps its default).
RECIPE_FIELDS: dict[str, dict[str, Any]] = {
    # Fastest: one scale per tensor, e5m2 for the wider range of gradients.
    "tensorwise": {},
    # One scale per row for all three operands: an outlier only costs its own row.
    "rowwise": {"input": _ROWWISE, "weight": _ROWWISE, "grad_output": _ROWWISE},
    "rowwise_with_gw_hp": {"input": _ROWWISE, "weight": _ROWWISE, "grad_output": _ROWWISE, "weight_grad_in_hp": True},
    "delayed": {
        "input": _DELAYED_E4M3,
        "weight": _DELAYED_E4M3,
        "grad_output": {"dtype": _E5M2, "scaling": "delayed"},
    },
    # DeepSeek-V3 (arXiv 2412.19437, section 3.3): e4m3 everywhere; activations and gradients
    # per 1x128 tile, weights per 128x128 block. The weight-gradient GEMM contracts over the
    # tokens, so its operands are tiled 128 tokens long (the config is re-oriented per GEMM).
    "blockwise": {
        "input": _TILE_1x128,
        "weight": {"dtype": _E4M3, "granularity": BLOCK_128x128},
        "grad_output": _TILE_1x128,
    },
    # MXFP8 (OCP MX v1.0): e4m3 data, one e8m0 scale per 32 elements along each GEMM's K.
    "mxfp8": {"input": _MX, "weight": _MX, "grad_output": _MX},
    # NVFP4 training (NVIDIA, arXiv 2509.25149): 2D 16x16 weight scales (the weight's two
    # layouts quantize alike), stochastic rounding of gradients, the random Hadamard transform
    # on the weight-gradient GEMM's inputs. Each is switchable (CastConfig / hadamard_wgrad).
    # The transform stays on as measured with these stochastic gradients: +3.3 dB wgrad SQNR
    # on tokens large in both operands, neutral on the demo GPT's layers, worse where one
    # operand alone has a dominant value in a block (README "FP4", benchmarks/bench_rht.py).
    "nvfp4": {
        "input": {"dtype": FP4_CAST_DTYPE, "granularity": NVFP4_1x16},
        "weight": {"dtype": FP4_CAST_DTYPE, "granularity": NVFP4_16x16},
        "grad_output": {"dtype": FP4_CAST_DTYPE, "granularity": NVFP4_1x16, "rounding": "stochastic"},
        "hadamard_wgrad": True,
    },
    # MXFP4 (OCP MX v1.0): E2M1 with e8m0 scales per 32 along each GEMM's K; gradients
    # rounded stochastically.
    "mxfp4": {
        "input": {"dtype": FP4_CAST_DTYPE, "granularity": MXFP4_1x32},
        "weight": {"dtype": FP4_CAST_DTYPE, "granularity": MXFP4_1x32},
        "grad_output": {"dtype": FP4_CAST_DTYPE, "granularity": MXFP4_1x32, "rounding": "stochastic"},
    },
}
