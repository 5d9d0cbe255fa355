"""Supported builds, :class:`Builds` (a set of builds as data) and the alignment :data:`ALIGN`."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from f8tensor import compat

__all__ = [
    "ALIGN",
    "ALL_BUILDS",
    "FP4_ALIGN",
    "ROCM_BUILDS",
    "SCALE_COLS",
    "SCALE_ONE",
    "SCALE_ROWS",
    "SUPPORTED_BUILDS",
    "SUPPORTED_TORCH",
    "Builds",
    "CudaBuild",
    "build_of",
]

_E4M3 = torch.float8_e4m3fn
_E5M2 = torch.float8_e5m2
_E4M3_FNUZ = torch.float8_e4m3fnuz
_E5M2_FNUZ = torch.float8_e5m2fnuz
_BF16, _FP16, _FP32 = torch.bfloat16, torch.float16, torch.float32

#: K and N of a ``torch._scaled_mm`` call (and each group cutting a grouped GEMM's K) must
#: be multiples of this.
ALIGN = 16
#: An FP4 cast's dims must be multiples of this: whole NVFP4 (16) and MXFP4 (32) blocks.
FP4_ALIGN = 32

# ===================================================================== builds


class CudaBuild(NamedTuple):
    """One GPU build: torch release, toolkit (CUDA or ROCm version), arch (sm, or gfx digits)."""

    torch_version: tuple[int, int]
    cuda: tuple[int, int]
    sm: tuple[int, int]
    platform: str = "cuda"

    @property
    def name(self) -> str:
        t, c, s = self.torch_version, self.cuda, self.sm
        if self.platform == "rocm":
            return f"torch {t[0]}.{t[1]} rocm{c[0]}.{c[1]} gfx{s[0]}{s[1]}"
        return f"torch {t[0]}.{t[1]} cu{c[0]}{c[1]} sm{s[0]}{s[1]}"


def build_of(device: torch.device) -> CudaBuild:
    """``device``'s build: this torch, its CUDA, the device's capability."""
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    return CudaBuild(compat.TORCH_VERSION, (cuda[0], cuda[1]), torch.cuda.get_device_capability(device))


#: The torch releases f8tensor supports.
SUPPORTED_TORCH: tuple[tuple[int, int], ...] = ((2, 11), (2, 12), (2, 13), (2, 14))

#: Every NVIDIA build whose rules each ``_scaled_mm`` call must obey (FP8 starts at sm89).
SUPPORTED_BUILDS: tuple[CudaBuild, ...] = tuple(
    CudaBuild(t, c, s) for t in SUPPORTED_TORCH for c in ((12, 6), (12, 8), (13, 0)) for s in ((8, 9), (9, 0))
)

#: The builds fnuz products are checked against (AMD MI300, gfx942).
ROCM_BUILDS: tuple[CudaBuild, ...] = tuple(CudaBuild(t, (6, 4), (9, 42), "rocm") for t in SUPPORTED_TORCH)


@dataclasses.dataclass(frozen=True)
class Builds:
    """A set of builds, as data: ``min_*``/``max_*`` bounds are inclusive; ``None`` means any."""

    min_cuda: tuple[int, int] | None = None
    min_sm: tuple[int, int] | None = None
    max_sm: tuple[int, int] | None = None
    platform: str = "cuda"

    def __contains__(self, build: CudaBuild) -> bool:
        return (
            build.platform == self.platform
            and (self.min_cuda is None or build.cuda >= self.min_cuda)
            and (self.min_sm is None or build.sm >= self.min_sm)
            and (self.max_sm is None or build.sm <= self.max_sm)
        )


ALL_BUILDS = Builds()

# Scale shapes, named as PyTorch's checks name them.
SCALE_ONE = "1 element"  # tensorwise: numel() == 1
SCALE_ROWS = "(M, 1)"  # rowwise scale_a
SCALE_COLS = "(1, N)"  # rowwise scale_b
