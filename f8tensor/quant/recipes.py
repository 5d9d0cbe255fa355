"""The named recipes, as data: each one the fields of a
:class:`~f8tensor.quant.config.Float8LinearConfig`; ``config`` builds and validates them.
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

#: Recipe name -> Float8LinearConfig fields (casts as CastConfig keyword arguments).
RECIPE_FIELDS: dict[str, dict[str, Any]] = {
    "tensorwise": {},
    "rowwise": {"input": _ROWWISE, "weight": _ROWWISE, "grad_output": _ROWWISE},
    "rowwise_with_gw_hp": {"input": _ROWWISE, "weight": _ROWWISE, "grad_output": _ROWWISE, "weight_grad_in_hp": True},
    "delayed": {
        "input": _DELAYED_E4M3,
        "weight": _DELAYED_E4M3,
        "grad_output": {"dtype": _E5M2, "scaling": "delayed"},
    },
    # DeepSeek-V3 (arXiv 2412.19437, section 3.3).
    "blockwise": {
        "input": _TILE_1x128,
        "weight": {"dtype": _E4M3, "granularity": BLOCK_128x128},
        "grad_output": _TILE_1x128,
    },
    # MXFP8 (OCP MX v1.0).
    "mxfp8": {"input": _MX, "weight": _MX, "grad_output": _MX},
    # NVFP4 training (arXiv 2509.25149); the transform's measurements: BENCHMARKS.md.
    "nvfp4": {
        "input": {"dtype": FP4_CAST_DTYPE, "granularity": NVFP4_1x16},
        "weight": {"dtype": FP4_CAST_DTYPE, "granularity": NVFP4_16x16},
        "grad_output": {"dtype": FP4_CAST_DTYPE, "granularity": NVFP4_1x16, "rounding": "stochastic"},
        "hadamard_wgrad": True,
    },
    # MXFP4 (OCP MX v1.0).
    "mxfp4": {
        "input": {"dtype": FP4_CAST_DTYPE, "granularity": MXFP4_1x32},
        "weight": {"dtype": FP4_CAST_DTYPE, "granularity": MXFP4_1x32},
        "grad_output": {"dtype": FP4_CAST_DTYPE, "granularity": MXFP4_1x32, "rounding": "stochastic"},
    },
}
