"""The rows of the block-scaled ``F.scaled_mm`` kernels (1x128, 128x128, MX, FP4) and their lookups."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from f8tensor.gemm.rules.builds import _E4M3, _FP32, ALIGN, Builds

__all__ = [
    "BLOCK_SCALED_MM_RULES",
    "FP4_SCALED_MM_RULES",
    "BlockScaledMMRule",
    "block_rule_by_recipes",
    "block_rule_for",
    "fp4_rule_for",
]


@dataclasses.dataclass(frozen=True)
class BlockScaledMMRule:
    """One block-scaled kernel of ``torch.nn.functional.scaled_mm`` (one row of the table).

    ``block_a``/``block_b``: the blocks of ``mat_a`` (M, K) and ``mat_b`` (K, N);
    ``recipe_a``/``recipe_b``: ``ScalingType`` member names; ``scale_a``/``scale_b``: the
    scale layouts the kernel reads. ``align_k``, ``align_n``, ``align_m`` divide K, N, M in
    every eager call (``blocks.py`` pads M); ``k_per_element`` is 2 for packed FP4.
    ``compile_align``: (dim, multiple) pairs the meta of the releases ``compile_torch`` also
    asks for under ``torch.compile`` (it floor-divides by 128 where the kernel rounds up).
    """

    name: str
    recipe_a: str
    recipe_b: str
    block_a: tuple[int, int]
    block_b: tuple[int, int]
    operand_dtypes: frozenset[torch.dtype]
    scale_dtype: torch.dtype
    scale_a: str
    scale_b: str
    builds: Builds
    fast_accum: bool
    sources: tuple[str, ...]
    align_k: int = ALIGN
    align_n: int = ALIGN
    align_m: int = 1
    k_per_element: int = 1
    compile_align: tuple[tuple[str, int], ...] = ()
    compile_torch: tuple[tuple[int, int], ...] = ()


#: The releases whose ``_check_scaled_mm_sizes_v2`` meta floor-divides the DeepSeek scale sizes.
_META_FLOOR_TORCH = ((2, 11), (2, 12), (2, 13))

_DEEPSEEK_BUILDS = Builds(min_cuda=(12, 9), min_sm=(9, 0), max_sm=(9, 0))
_V2_SOURCES = (
    (
        'aten/src/ATen/native/cuda/ScaledBlas.cpp: _scaled_mm_cuda_v2_out (K % 16: "Expected trailing '
        'dimension of mat1 to be divisible by 16"; "mat2 shape (KxN) must be divisible by 16"; M free)'
    ),
    (
        "torch/_meta_registrations.py: _check_scaled_mm_sizes_v2 (the same % 16 checks under torch.compile; "
        "2.11 :6829, 2.12 :7070, 2.13 :7242; 2.14 meta_scaled_mm_v2 :7346 is shape-only)"
    ),
)
_DEEPSEEK_SOURCES = (
    (
        "aten/src/ATen/native/cuda/ScaledBlas.cpp: _scaled_block1x128_block128x128, "
        "_scaled_block1x128_block1x128, _scaled_block128x128_block1x128 (scale shapes and strides, ceil_div), "
        "_check_deepseek_support (sm90, cuBLAS >= 12.9); check_deepseek_recipe (both operands e4m3fn, fp32 "
        "scales; 2.11 CUDAScaledBlas.h:151, 2.12/2.13 ScaledBlasUtils.h:103, 2.14 :150)"
    ),
    (
        "aten/src/ATen/cuda/CUDABlas.cpp: get_scale_mode (\"scaled_gemm doesn't support fast accum with "
        '1x128 blockwise scaling", same for 128x128; in the 2.11, 2.12, 2.14 binaries)'
    ),
    (
        "torch/_meta_registrations.py: _check_scaled_mm_sizes_v2 floor-divides K, M, N by 128 (K // 128: "
        "2.11 :6937, 2.12 :7178, 2.13 :7368; M // 128 for a 128x128 a: 2.11 :6969, 2.12 :7210, 2.13 :7400; "
        "N // 128 for a 128x128 b: 2.11 :7007, 2.12 :7248, 2.13 :7438)"
    ),
) + _V2_SOURCES

# The outer dim of a 1x128-scaled operand: M % 16 asked (conservative; M % 4 not ruled out).
_OUTER_1x128_SOURCE = (
    "measured: H100, torch 2.11+cu130, cuBLAS of CUDA 13.0: M=15 with a 1x128 a refused "
    "(CUBLAS_STATUS_NOT_SUPPORTED from cublasLtMatmulAlgoGetHeuristic); M=256 accepted. "
    "Rule taken: the outer dim of every 1x128-scaled operand a multiple of 16 (conservative; "
    "M % 4 is not ruled out)"
)

# The DeepSeek-V3 kernels differ only in their blocks and scale layouts.
_TILE_SCALES = "(M, ceil(K/128)), strides (1, M)"  # 1x128 a
_BLOCK_SCALES = "(round_up(ceil(K/128), 4), ceil({}/128)), strides (1, round_up(ceil(K/128), 4))"  # 128x128
_DEEPSEEK = BlockScaledMMRule(
    name="1x128 x 128x128",
    recipe_a="BlockWise1x128",
    recipe_b="BlockWise128x128",
    block_a=(1, 128),
    block_b=(128, 128),
    operand_dtypes=frozenset({_E4M3}),
    scale_dtype=_FP32,
    scale_a=_TILE_SCALES,
    scale_b=_BLOCK_SCALES.format("N"),
    builds=_DEEPSEEK_BUILDS,
    fast_accum=False,  # cuBLASLt refuses fast accumulation with 1x128 and 128x128 scales
    sources=(*_DEEPSEEK_SOURCES, _OUTER_1x128_SOURCE),
    align_m=ALIGN,
    compile_align=(("K", 128), ("N", 128)),
    compile_torch=_META_FLOOR_TORCH,
)

_MX_SCALES = "round_up({}, 128) * round_up(ceil(K/{}), 4) {}, SWIZZLE_32_4_4, contiguous"
_MXFP8 = dataclasses.replace(
    _DEEPSEEK,
    name="MXFP8 1x32 x 1x32",
    recipe_a="BlockWise1x32",
    recipe_b="BlockWise1x32",
    block_a=(1, 32),
    block_b=(32, 1),
    # check_mxfp8_recipe takes e4m3fn only; the meta lets e5m2 through, an eager GPU call refuses.
    operand_dtypes=frozenset({_E4M3}),
    scale_dtype=torch.float8_e8m0fnu,
    scale_a=_MX_SCALES.format("M", 32, "e8m0"),
    scale_b=_MX_SCALES.format("N", 32, "e8m0"),
    # sm100 and later: no supported build has it.
    builds=Builds(min_cuda=(12, 8), min_sm=(10, 0)),
    fast_accum=False,
    align_m=1,  # the swizzle pads MX scales to 128 rows
    compile_align=(),  # the meta's MX counts round up, as the kernel's do
    compile_torch=(),
    sources=(
        (
            "aten/src/ATen/native/cuda/ScaledBlas.cpp: _scaled_mxfp8_mxfp8 (scale element counts, "
            "SWIZZLE_32_4_4 on CUDA, contiguous scales)"
        ),
        (
            "check_mxfp8_recipe (both operands Float8_e4m3fn, e8m0 scales; 2.11 CUDAScaledBlas.h:160, "
            "2.12/2.13 ScaledBlasUtils.h:118, 2.14 :165)"
        ),
        (
            "aten/src/ATen/cuda/CUDABlas.cpp: get_scale_mode (1x32 e8m0 needs CUDA >= 12.8); "
            "torch/testing/_internal/common_cuda.py: PLATFORM_SUPPORTS_MX_GEMM = SM100OrLater"
        ),
    )
    + _V2_SOURCES,
)

_FP4 = torch.float4_e2m1fn_x2
_FP4_SOURCES = (
    (
        "aten/src/ATen/native/cuda/ScaledBlas.cpp: _scaled_mm_cuda_v2_out (K_multiplier = 2 for "
        'Float4_e2m1fn_x2: K counted unpacked; "use_fast_accum is not supported" for FP4 operands)'
    ),
    (
        "torch/testing/_internal/common_quantized.py: pack_uint4 (element 2i in the low nibble, 2i+1 in "
        "the high one), to_blocked (SWIZZLE_32_4_4)"
    ),
)

#: The table, FP4 rows included (unverified); :func:`block_rule_for` looks a row up.
BLOCK_SCALED_MM_RULES: tuple[BlockScaledMMRule, ...] = (
    _DEEPSEEK,
    dataclasses.replace(
        _DEEPSEEK,
        name="1x128 x 1x128",
        recipe_b="BlockWise1x128",
        block_b=(128, 1),
        scale_b="(N, ceil(K/128)), strides (1, N)",
        compile_align=(("K", 128),),
    ),
    dataclasses.replace(
        _DEEPSEEK,
        name="128x128 x 1x128",
        recipe_a="BlockWise128x128",
        recipe_b="BlockWise1x128",
        block_a=(128, 128),
        block_b=(128, 1),
        scale_a=_BLOCK_SCALES.format("M"),
        align_m=1,  # a 128x128 a's scale rows count K-blocks, not M
        scale_b="(N, ceil(K/128)), strides (1, N)",
        compile_align=(("K", 128), ("M", 128)),
    ),
    _MXFP8,
    dataclasses.replace(
        _MXFP8,
        name="MXFP4 1x32 x 1x32",
        operand_dtypes=frozenset({_FP4}),
        # _check_mxfp4_support: sm100 only, bf16 output, bias not passed on (added after).
        builds=Builds(min_cuda=(12, 8), min_sm=(10, 0), max_sm=(10, 99)),
        k_per_element=2,
        # The 2.11-2.13 meta checks the packed size(1) % 16, i.e. unpacked K % 32.
        align_k=32,
        sources=(
            (
                "aten/src/ATen/native/cuda/ScaledBlas.cpp: _scaled_mxfp4_mxfp4, _check_mxfp4_support "
                "(BlockWise1x32 only, sm100, mslk::gemm::f4f4bf16)"
            ),
            "check_mxfp4_recipe (2.11 CUDAScaledBlas.h:136-167, 2.12/2.13 ScaledBlasUtils.h:75-131, 2.14 :122-178)",
        )
        + _FP4_SOURCES
        + _V2_SOURCES,
    ),
    dataclasses.replace(
        _MXFP8,
        name="NVFP4 1x16 x 1x16",
        recipe_a="BlockWise1x16",
        recipe_b="BlockWise1x16",
        block_a=(1, 16),
        block_b=(16, 1),
        operand_dtypes=frozenset({_FP4}),
        # The two-level form adds one fp32 TensorWise global scale per side.
        scale_dtype=_E4M3,
        scale_a=_MX_SCALES.format("M", 16, "e4m3fn"),
        scale_b=_MX_SCALES.format("N", 16, "e4m3fn"),
        builds=Builds(min_cuda=(12, 8), min_sm=(10, 0)),
        k_per_element=2,
        align_k=32,
        sources=(
            (
                "aten/src/ATen/native/cuda/ScaledBlas.cpp: _scaled_nvfp4_nvfp4 (scale counts, SWIZZLE_32_4_4, "
                "global_scale_a/b for the two-level form)"
            ),
            "aten/src/ATen/cuda/CUDABlas.cpp: get_scale_mode (BlockWise1x16 needs e4m3fn scales and CUDA >= 12.8)",
            "check_nvfp4_recipe, check_nvfp4_recipe_single_scale (2.14 ScaledBlasUtils.h:122-178)",
        )
        + _FP4_SOURCES
        + _V2_SOURCES,
    ),
)


# A constant to torch.compile: traced, a scan of the table would guard every row it reads.
@torch.compiler.assume_constant_result
def block_rule_for(
    block_a: tuple[int, ...],
    block_b: tuple[int, ...],
    scale_dtype: torch.dtype,
    operand_dtype: torch.dtype | None = None,
) -> BlockScaledMMRule | None:
    """The row with these blocks and scale dtype (taking ``operand_dtype`` when given), or None."""
    for rule in BLOCK_SCALED_MM_RULES:
        same = (rule.block_a, rule.block_b, rule.scale_dtype) == (tuple(block_a), tuple(block_b), scale_dtype)
        if same and (operand_dtype is None or operand_dtype in rule.operand_dtypes):
            return rule
    return None


def block_rule_by_recipes(
    recipe_a: Any, recipe_b: Any, operand_dtype: torch.dtype | None = None
) -> BlockScaledMMRule | None:
    """The row of these scaling recipes, or None; ``operand_dtype`` tells MXFP8 from MXFP4."""
    names = tuple(str(getattr(r, "name", r)) for r in (recipe_a, recipe_b))
    matches = [rule for rule in BLOCK_SCALED_MM_RULES if (rule.recipe_a, rule.recipe_b) == names]
    for rule in matches:
        if operand_dtype is None or operand_dtype in rule.operand_dtypes:
            return rule
    return matches[0] if matches else None


# FP4 rows: unverified on hardware, read from the sources they cite. Two E2M1 values per
# byte along K (element 2i in the low nibble); K is counted unpacked.

#: The FP4 rows of :data:`BLOCK_SCALED_MM_RULES` (NVFP4, then MXFP4).
FP4_SCALED_MM_RULES: tuple[BlockScaledMMRule, ...] = tuple(
    next(r for r in BLOCK_SCALED_MM_RULES if r.name == name) for name in ("NVFP4 1x16 x 1x16", "MXFP4 1x32 x 1x32")
)


def fp4_rule_for(kind: str) -> BlockScaledMMRule:
    """The FP4 row of ``kind`` (``"nvfp4"`` or ``"mxfp4"``)."""
    return FP4_SCALED_MM_RULES[0 if kind == "nvfp4" else 1]
