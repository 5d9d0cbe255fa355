"""The CUDA rules of FP8 GEMMs, as data: supported builds and one row per kernel.

Three tables of rows in one style (a frozen dataclass per row, ``builds`` saying where a
row applies, ``sources`` citing the PyTorch code it was read from):

- :data:`SCALED_MM_RULES`: ``torch._scaled_mm``, tensorwise and rowwise, one row per
  (scaling kind, set of builds): operand and output dtypes, scale dtype/shape/contiguity,
  layouts, alignment, bias, fast accumulation;
- :data:`BLOCK_SCALED_MM_RULES`: the block-scaled kernels of ``torch.nn.functional.scaled_mm``
  (1x128, 128x128, MX), with the scale layouts each reads;
- :data:`GROUPED_RULES`: ``torch._scaled_grouped_mm`` (MoE grouped and batched products);
- :data:`FP4_SCALED_MM_RULES`: the FP4 kernels of ``torch.nn.functional.scaled_mm`` (NVFP4,
  MXFP4; sm100), rows in :class:`BlockScaledMMRule`'s style, kept apart so that the FP8
  lookups (whose MX row has the same 1x32 blocks as MXFP4) never match them.

The supported NVIDIA builds are :data:`SUPPORTED_BUILDS` (torch 2.11-2.14; cu126, cu128,
cu130 wheels; sm89, sm90); fnuz products are checked against :data:`ROCM_BUILDS`. A new
scaling kind or build adds rows here; ``check.py`` reads them, ``dense.py``, ``blocks.py``
and ``grouped.py`` route products so that every call matches a row. No logic beyond the
lookups (:func:`rule_for`, :func:`block_rule_for`, :func:`block_rule_by_recipes`,
:func:`grouped_rule_for`).

Layer: the bottom of ``f8tensor.gemm``; imports torch only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch

__all__ = [
    "ALIGN",
    "ALL_BUILDS",
    "BLOCK_SCALED_MM_RULES",
    "FP4_SCALED_MM_RULES",
    "GROUPED_RULES",
    "ROCM_BUILDS",
    "ROCM_ROWWISE_NOTE",
    "SCALED_MM_RULES",
    "STRICTEST_BUILDS",
    "SUPPORTED_BUILDS",
    "SUPPORTED_TORCH",
    "BlockScaledMMRule",
    "Builds",
    "CudaBuild",
    "GroupedMMRule",
    "ScaledMMRule",
    "block_rule_by_recipes",
    "block_rule_for",
    "fp4_rule_for",
    "grouped_rule_for",
    "rule_for",
]

_E4M3 = torch.float8_e4m3fn
_E5M2 = torch.float8_e5m2
_E4M3_FNUZ = torch.float8_e4m3fnuz
_E5M2_FNUZ = torch.float8_e5m2fnuz
_BF16, _FP16, _FP32 = torch.bfloat16, torch.float16, torch.float32

#: K (mat1.size(1) == mat2.size(0)) and N (mat2.size(1)) of a ``torch._scaled_mm`` call
#: must be multiples of this; so must a layer's dimensions, an expert GEMM's contraction
#: dim and each group that cuts a grouped GEMM's contraction dim. The one alignment constant.
ALIGN = 16

# ===================================================================== builds

class CudaBuild(NamedTuple):
    """One GPU build f8tensor supports: a torch release, its toolkit, a GPU arch.

    ``platform="cuda"``: ``cuda`` is the wheel's CUDA version, ``sm`` the compute
    capability. ``platform="rocm"``: ``cuda`` is the ROCm version and ``sm`` the gfx
    arch's digits ((9, 42) for gfx942).
    """

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


#: The torch releases f8tensor supports (README.md, "Version matrix"): 2.11 to the newest
#: installable one.
SUPPORTED_TORCH: tuple[tuple[int, int], ...] = ((2, 11), (2, 12), (2, 13), (2, 14))

#: Every NVIDIA build whose rules every f8tensor ``_scaled_mm`` call must obey. The wheels
#: of torch 2.11-2.14 exist for CUDA 12.6, 12.8 and 13.0 (2.14's cu126 wheel: not
#: verified); FP8 tensor cores start at sm89 (Ada: L4, L40S, RTX 4090) and sm90 (Hopper:
#: H100, H200).
SUPPORTED_BUILDS: tuple[CudaBuild, ...] = tuple(
    CudaBuild(t, c, s)
    for t in SUPPORTED_TORCH
    for c in ((12, 6), (12, 8), (13, 0))
    for s in ((8, 9), (9, 0))
)

#: The fnuz formats run on AMD MI300 (gfx942) only; their products are checked against
#: these builds instead (f8tensor refuses fnuz products on NVIDIA devices up front).
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

# torch._scaled_mm's scale shapes, named as PyTorch's checks name them.
SCALE_ONE = "1 element"  # tensorwise: numel() == 1
SCALE_ROWS = "(M, 1)"  # rowwise scale_a
SCALE_COLS = "(1, N)"  # rowwise scale_b

# ===================================================================== torch._scaled_mm


@dataclasses.dataclass(frozen=True)
class ScaledMMRule:
    """What one scaling kind of one op accepts on a set of builds (one row of the table).

    ``bias_dtypes`` maps each output dtype to the bias dtypes allowed with it; an output
    dtype missing from it takes no bias. ``refused_pairs``: (mat1, mat2) dtype pairs that
    are refused even though each dtype alone is allowed.
    """

    op: str
    kind: str
    kernel: str
    builds: Builds
    mat1_dtypes: frozenset[torch.dtype]
    mat2_dtypes: frozenset[torch.dtype]
    refused_pairs: frozenset[tuple[torch.dtype, torch.dtype]]
    out_dtypes: frozenset[torch.dtype]
    scale_dtype: torch.dtype
    scale_a_shape: str
    scale_b_shape: str
    scales_contiguous: bool
    mat1_layout: str  # "row-major"
    mat2_layout: str  # "column-major"
    align_k: int
    align_n: int
    align_m: int
    bias_dtypes: tuple[tuple[torch.dtype, frozenset[torch.dtype]], ...]
    fast_accum: bool
    sources: tuple[str, ...]

    def bias_allowed(self, out_dtype: torch.dtype) -> frozenset[torch.dtype]:
        return dict(self.bias_dtypes).get(out_dtype, frozenset())


_OPERANDS = frozenset({_E4M3, _E5M2})  # no fnuz on NVIDIA: "Cannot convert ScalarType Float8_e4m3fnuz to cudaDataType"
_NO_E5M2_PAIR = frozenset({(_E5M2, _E5M2)})
# cuBLASLt bias: bf16 or fp16, matching a bf16/fp16 output; none with an fp32 output.
_BIAS = ((_BF16, frozenset({_BF16})), (_FP16, frozenset({_FP16})))

# Rowwise everywhere but cu130 sm90: the CUTLASS f8f8bf16_rowwise kernel (sm89, and sm90
# with cu126/cu128). The other NVIDIA rows are written as their differences from it.
_CUTLASS_ROWWISE = ScaledMMRule(
    op="torch._scaled_mm",
    kind="rowwise",
    kernel="CUTLASS f8f8bf16_rowwise",
    builds=ALL_BUILDS,
    mat1_dtypes=_OPERANDS,
    mat2_dtypes=frozenset({_E4M3}),
    refused_pairs=_NO_E5M2_PAIR,
    # The 2.11-2.13 wheels refuse fp32 here ("Only bf16 and fp16 high precision output
    # types are supported for row-wise scaling"); later sources add fp32.
    out_dtypes=frozenset({_BF16, _FP16}),
    scale_dtype=_FP32,
    scale_a_shape=SCALE_ROWS,
    scale_b_shape=SCALE_COLS,
    scales_contiguous=True,
    mat1_layout="row-major",
    mat2_layout="column-major",
    align_k=ALIGN,
    align_n=ALIGN,
    align_m=1,  # M is free: the kernel pads scale_a to a multiple of 256 itself
    bias_dtypes=_BIAS,
    fast_accum=True,  # both schedules exist; without fast accumulation the slow one runs
    sources=(
        (
            "aten/src/ATen/native/cuda/RowwiseScaledMM.cu: check_inputs (a e4m3fn/e5m2, b e4m3fn, fp32 "
            "scales (M, 1) stride(0) == 1 and (1, N) stride(1) == 1, a row-major, b column-major, bias "
            "1-D, no bias with fp32 out), dispatch_fp8_rowwise_kernel_on_bias_dtype (fp16 bias needs fp16 out)"
        ),
        "aten/src/ATen/native/cuda/ScaledBlas.cpp: _scaled_mm_out_cuda, rowwise branch (output dtype check)",
    ),
)

#: The table. Rows are looked up in order: the first row whose op, kind and builds match
#: a call is the one that applies (so a narrower row precedes the general one).
SCALED_MM_RULES: tuple[ScaledMMRule, ...] = (
    # Tensorwise x tensorwise: cuBLASLt on every build.
    dataclasses.replace(
        _CUTLASS_ROWWISE,
        kind="tensorwise",
        kernel="cuBLASLt",
        mat2_dtypes=_OPERANDS,
        out_dtypes=frozenset({_BF16, _FP16, _FP32, _E4M3, _E5M2}),
        scale_a_shape=SCALE_ONE,
        scale_b_shape=SCALE_ONE,
        scales_contiguous=False,
        sources=(
            (
                "aten/src/ATen/native/cuda/ScaledBlas.cpp: _scaled_mm_out_cuda (K % 16, mat2 dims % 16, "
                "no e5m2 x e5m2, bias bf16/fp16 and none with fp32 out), is_tensorwise_scaling"
            ),
            "torch/_meta_registrations.py: _check_scaled_mm_sizes (row-major self, column-major mat2 on CUDA)",
        ),
    ),
    # Rowwise on cuBLASLt: CUDA >= 12.9 (the cu130 wheels) on sm90 only. It takes an fp32
    # output and an e5m2 mat2; the CUTLASS kernel does neither.
    dataclasses.replace(
        _CUTLASS_ROWWISE,
        kernel="cuBLASLt (outer-vector scales)",
        builds=Builds(min_cuda=(12, 9), min_sm=(9, 0), max_sm=(9, 0)),
        mat2_dtypes=_OPERANDS,
        out_dtypes=frozenset({_BF16, _FP16, _FP32}),
        sources=(
            (
                "aten/src/ATen/native/cuda/ScaledBlas.cpp: _scaled_mm_out_cuda takes the CUTLASS path when "
                "sm < 9.0 or CUBLAS_VERSION < 120900, cuBLASLt otherwise; is_rowwise_scaling"
            ),
        ),
    ),
    _CUTLASS_ROWWISE,
)

#: One line for readers (kept from the first version of this module; the ROCm rows of the
#: table below are what the checker reads).
ROCM_ROWWISE_NOTE = "ROCm rowwise: mat2 e4m3fnuz (e4m3fn on non-fnuz archs), bf16 output only"

_ROCM = Builds(platform="rocm")
_FNUZ_OPERANDS = frozenset({_E4M3_FNUZ, _E5M2_FNUZ})
_ROCM_SOURCES = (
    (
        "aten/src/ATen/native/cuda/ScaledBlas.cpp: _scaled_mm_out_cuda, USE_ROCM branches (_scaled_mm_is_fnuz "
        "on gfx942; rowwise: b e4m3fnuz, BFloat16 output only)"
    ),
)
SCALED_MM_RULES += (
    # ROCm MI300 (gfx942): the fnuz formats. The e5m2 x e5m2 refusal is NVIDIA-only in
    # PyTorch; f8tensor refuses that pair everywhere, so the row keeps it.
    dataclasses.replace(
        SCALED_MM_RULES[0],
        kernel="hipBLASLt",
        builds=_ROCM,
        mat1_dtypes=_FNUZ_OPERANDS,
        mat2_dtypes=_FNUZ_OPERANDS,
        refused_pairs=frozenset({(_E5M2_FNUZ, _E5M2_FNUZ)}),
        out_dtypes=frozenset({_BF16, _FP16, _FP32, _E4M3_FNUZ, _E5M2_FNUZ}),
        sources=_ROCM_SOURCES,
    ),
    dataclasses.replace(
        SCALED_MM_RULES[2],
        kernel="hipBLASLt rowwise",
        builds=_ROCM,
        mat1_dtypes=_FNUZ_OPERANDS,
        mat2_dtypes=frozenset({_E4M3_FNUZ}),
        refused_pairs=frozenset({(_E5M2_FNUZ, _E5M2_FNUZ)}),
        out_dtypes=frozenset({_BF16}),
        sources=_ROCM_SOURCES,
    ),
)

#: Builds that between them carry every restriction of the table: sm89 (CUTLASS rowwise,
#: any CUDA) and sm90 with cu128 (CUTLASS rowwise, Hopper). cu130 on sm90 only relaxes.
STRICTEST_BUILDS: tuple[CudaBuild, ...] = (CudaBuild((2, 11), (12, 6), (8, 9)), CudaBuild((2, 13), (12, 8), (9, 0)))


def rule_for(kind: str, build: CudaBuild, op: str = "torch._scaled_mm") -> ScaledMMRule | None:
    """The row of :data:`SCALED_MM_RULES` that applies to ``kind`` on ``build``, or None."""
    for rule in SCALED_MM_RULES:
        if rule.op == op and rule.kind == kind and build in rule.builds:
            return rule
    return None


# ===================================================================== block-scaled F.scaled_mm


@dataclasses.dataclass(frozen=True)
class BlockScaledMMRule:
    """One block-scaled kernel of ``torch.nn.functional.scaled_mm`` (one row of the table).

    ``block_a`` is the block of ``mat_a`` (M, K) and ``block_b`` that of ``mat_b`` (K, N),
    in f8tensor's per-dim spelling; ``recipe_a``/``recipe_b`` name the
    ``torch.nn.functional.ScalingType`` members; ``scale_a``/``scale_b`` describe the
    scale tensors the kernel reads (shape, strides, swizzle), which
    :func:`_block_kernel_scales` builds from f8tensor's scales.

    Sizes: ``align_k`` divides K and ``align_n`` divides N (``mat_b``'s both dims) in every
    eager call; ``k_per_element`` is 2 for the packed FP4 dtype (K counts unpacked
    values). ``compile_align``: (dim, multiple) pairs that the meta registration of the
    torch releases ``compile_torch`` also asks for when ``torch.compile`` traces a CUDA call
    (it floor-divides K, M, N by 128 where the kernel rounds up); eager calls do not.
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
    k_per_element: int = 1
    compile_align: tuple[tuple[str, int], ...] = ()
    compile_torch: tuple[tuple[int, int], ...] = ()


#: The releases whose ``_check_scaled_mm_sizes_v2`` (the meta registration torch.compile
#: traces with) floor-divides the DeepSeek scale sizes; 2.14's ``meta_scaled_mm_v2`` is
#: shape-only.
_META_FLOOR_TORCH = ((2, 11), (2, 12), (2, 13))

_DEEPSEEK_BUILDS = Builds(min_cuda=(12, 9), min_sm=(9, 0), max_sm=(9, 0))
_V2_SOURCES = (
    (
        "aten/src/ATen/native/cuda/ScaledBlas.cpp: _scaled_mm_cuda_v2_out (K % 16: \"Expected trailing "
        "dimension of mat1 to be divisible by 16\"; \"mat2 shape (KxN) must be divisible by 16\"; M free)"
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
        "1x128 blockwise scaling\", same for 128x128; in the 2.11, 2.12, 2.14 binaries)"
    ),
    (
        "torch/_meta_registrations.py: _check_scaled_mm_sizes_v2 floor-divides K, M, N by 128 (K // 128: "
        "2.11 :6937, 2.12 :7178, 2.13 :7368; M // 128 for a 128x128 a: 2.11 :6969, 2.12 :7210, 2.13 :7400; "
        "N // 128 for a 128x128 b: 2.11 :7007, 2.12 :7248, 2.13 :7438)"
    ),
) + _V2_SOURCES

# The DeepSeek-V3 kernels differ only in their blocks and scale layouts; named by block.
_TILE_SCALES = "(M, ceil(K/128)), strides (1, M)"  # 1x128 a: one scale per row and K-block
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
    sources=_DEEPSEEK_SOURCES,
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
    # check_mxfp8_recipe takes e4m3fn only (the v1 _scaled_mm path would take e5m2; the v2
    # path f8tensor calls does not); the meta lets e5m2 through, only an eager GPU call refuses.
    operand_dtypes=frozenset({_E4M3}),
    scale_dtype=torch.float8_e8m0fnu,
    scale_a=_MX_SCALES.format("M", 32, "e8m0"),
    scale_b=_MX_SCALES.format("N", 32, "e8m0"),
    # Blackwell (sm100) and later: no build in SUPPORTED_BUILDS (sm89, sm90) has it.
    builds=Builds(min_cuda=(12, 8), min_sm=(10, 0)),
    fast_accum=False,  # _scaled_mxfp8_mxfp8 passes use_fast_accum=false to the GEMM
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
    ) + _V2_SOURCES,
)

_FP4 = torch.float4_e2m1fn_x2
_FP4_SOURCES = (
    (
        "aten/src/ATen/native/cuda/ScaledBlas.cpp: _scaled_mm_cuda_v2_out (K_multiplier = 2 for "
        "Float4_e2m1fn_x2: K counted unpacked; \"use_fast_accum is not supported\" for FP4 operands)"
    ),
    (
        "torch/testing/_internal/common_quantized.py: pack_uint4 (element 2i in the low nibble, 2i+1 in "
        "the high one), to_blocked (SWIZZLE_32_4_4)"
    ),
)

#: The table. The FP4 rows are the kernels of FP4 products (:data:`FP4_SCALED_MM_RULES`,
#: unverified); :func:`block_rule_for` finds a row by blocks, scale dtype and operand dtype.
BLOCK_SCALED_MM_RULES: tuple[BlockScaledMMRule, ...] = (
    _DEEPSEEK,
    dataclasses.replace(
        _DEEPSEEK, name="1x128 x 1x128", recipe_b="BlockWise1x128", block_b=(128, 1),
        scale_b="(N, ceil(K/128)), strides (1, N)", compile_align=(("K", 128),),
    ),
    dataclasses.replace(
        _DEEPSEEK, name="128x128 x 1x128", recipe_a="BlockWise128x128", recipe_b="BlockWise1x128",
        block_a=(128, 128), block_b=(128, 1), scale_a=_BLOCK_SCALES.format("M"),
        scale_b="(N, ceil(K/128)), strides (1, N)", compile_align=(("K", 128), ("M", 128)),
    ),
    _MXFP8,
    dataclasses.replace(
        _MXFP8,
        name="MXFP4 1x32 x 1x32",
        operand_dtypes=frozenset({_FP4}),
        # _check_mxfp4_support: dprops->major == 10 ("only supported in CUDA for B200/B300"),
        # an MSLK build; bf16 output; the bias argument is not passed on (add it after).
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
        ) + _FP4_SOURCES + _V2_SOURCES,
    ),
    dataclasses.replace(
        _MXFP8,
        name="NVFP4 1x16 x 1x16",
        recipe_a="BlockWise1x16",
        recipe_b="BlockWise1x16",
        block_a=(1, 16),
        block_b=(16, 1),
        operand_dtypes=frozenset({_FP4}),
        # Block scales e4m3fn; the two-level form adds one fp32 global scale per side
        # (scale_a=[blocks, global], recipes [BlockWise1x16, TensorWise], two swizzle entries).
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
        ) + _FP4_SOURCES + _V2_SOURCES,
    ),
)


def block_rule_for(
    block_a: tuple[int, ...], block_b: tuple[int, ...], scale_dtype: torch.dtype, operand_dtype: torch.dtype | None = None
) -> BlockScaledMMRule | None:
    """The row whose operand blocks and scale dtype are these (and that takes
    ``operand_dtype``, when given; else the first such row), or None."""
    for rule in BLOCK_SCALED_MM_RULES:
        same = (rule.block_a, rule.block_b, rule.scale_dtype) == (tuple(block_a), tuple(block_b), scale_dtype)
        if same and (operand_dtype is None or operand_dtype in rule.operand_dtypes):
            return rule
    return None


def block_rule_by_recipes(recipe_a: Any, recipe_b: Any, operand_dtype: torch.dtype | None = None) -> BlockScaledMMRule | None:
    """The row of ``torch.nn.functional.scaled_mm``'s scaling recipes (members or names), or
    None; ``operand_dtype`` tells MXFP8 from MXFP4 (same recipes)."""
    names = tuple(str(getattr(r, "name", r)) for r in (recipe_a, recipe_b))
    matches = [rule for rule in BLOCK_SCALED_MM_RULES if (rule.recipe_a, rule.recipe_b) == names]
    for rule in matches:
        if operand_dtype is None or operand_dtype in rule.operand_dtypes:
            return rule
    return matches[0] if matches else None


# ===================================================================== FP4 F.scaled_mm (sm100)
#
# Unverified on hardware (no sm100 machine was available): the FP4 rows of
# BLOCK_SCALED_MM_RULES are read from the sources they cite; the scale layout they name is
# unit-tested on CPU (tests/kernels/test_fp4_gemm.py). Operands: ``torch.float4_e2m1fn_x2``, two E2M1
# values per byte along K (element 2i in the low nibble: ``common_quantized.py : pack_uint4``),
# ``mat_a`` (M, K/2) row-major, ``mat_b`` (K/2, N) column-major; K is counted unpacked.
# NVFP4 passes a second, TensorWise, fp32 global scale per operand (two swizzle entries).

#: The FP4 rows of :data:`BLOCK_SCALED_MM_RULES` (NVFP4, then MXFP4): the products of
#: ``Float4Tensor`` operands on CUDA without ``emulate``.
FP4_SCALED_MM_RULES: tuple[BlockScaledMMRule, ...] = tuple(
    next(r for r in BLOCK_SCALED_MM_RULES if r.name == name) for name in ("NVFP4 1x16 x 1x16", "MXFP4 1x32 x 1x32")
)


def fp4_rule_for(kind: str) -> BlockScaledMMRule:
    """The FP4 row of ``kind`` (``"nvfp4"`` or ``"mxfp4"``)."""
    return FP4_SCALED_MM_RULES[0 if kind == "nvfp4" else 1]


# ===================================================================== torch._scaled_grouped_mm


@dataclasses.dataclass(frozen=True)
class GroupedMMRule:
    """What ``torch._scaled_grouped_mm`` accepts on a set of builds (one row of the table).

    Its three forms: 2D x 3D with ``offs`` (an MoE layer's forward and input gradient: ``a``
    (M, K) tokens sorted by group, ``b`` (G, K, N), ``offs`` (G,) cumulative counts; scales
    (M,) and (G, N)), 2D x 2D with ``offs`` (the weights' gradient: groups cut the
    contraction dim; scales (G*K,) and (G*N,)) and 3D x 3D without (``bmm``; scales (B, M)
    and (B, N)). The scales are dequantization factors, as ``torch._scaled_mm`` takes them.

    ``align``: ``a.size(-1)``, ``b.size(-2)`` and ``b.size(-1)`` (K and N; in 2D x 2D the
    padded total of the grouped dim) are multiples of it, in every form. ``max_groups``:
    the most groups (``offs.size(0)``, ``b.size(0)`` of 2D x 3D, ``a.size(0)`` of 3D x 3D) one
    call takes. ``offs`` values (non-decreasing, at most the grouped dim) are device-side
    asserts in the kernel, checked by f8tensor where they are on the host.
    """

    op: str
    kernel: str
    builds: Builds
    operand_dtypes: frozenset[torch.dtype]
    scale_dtype: torch.dtype
    out_dtypes: frozenset[torch.dtype]
    a_layout: str  # "row-major" in the last two dims
    b_layout: str  # "column-major" in the last two dims
    stride_bytes: int  # each operand's leading stride a multiple of this many bytes
    offs_dtype: torch.dtype  # offs: 1-D, present exactly when one operand is 2D
    contraction_group_multiple: int  # each group that cuts the contraction dim (2D x 2D)
    bias: bool
    sources: tuple[str, ...]
    align: int = ALIGN
    max_groups: int = 1023


_GROUPED_SOURCES = (
    (
        "torch/_meta_registrations.py: _meta_grouped_mm_common (\"Expected inputs of E4M3 FP8 type\", fp32 "
        "scales, bf16 output, offs int32 exactly when an operand is 2D, scale shapes per form; 2.11 :8178, "
        "2.12 :8428, 2.13 :8642, 2.14 :8467)"
    ),
    (
        "aten/src/ATen/native/cuda/GroupedBlas.cpp: _scaled_grouped_mm_cuda (\"Expected trailing dimension of "
        "mat_a to be divisible by 16\", \"Expected mat_b shape to be divisible by 16\": K and N, host checks in "
        "forward; no bias, no scale_result); ATen/native/GroupedMMUtils.h: check_valid_strides_and_return_"
        "transposed (a row-major, b column-major, leading strides multiples of 16 bytes; 2.14 adds the 3-D "
        "batch stride)"
    ),
    (
        "aten/src/ATen/native/cuda/ScaledGroupMM.cu: f8f8bf16_grouped_gemm_impl_sm90 (\"Can't process more "
        "than 1024 groups\": group_count < 1024; the only FP8 grouped kernel in the 2.11, 2.12, 2.14 binaries: "
        "no sm100 instance; common_cuda.py: PLATFORM_SUPPORTS_FP8_GROUPED_GEMM = SM90OrLater and not "
        "SM100OrLater, 2.11 :159, 2.12 :199, 2.13 :200, 2.14 :277)"
    ),
    (
        "aten/src/ATen/native/cuda/GroupMMCommon.cuh: prepare_grouped_gemm_data (device asserts: offs "
        "non-decreasing, offs[-1] <= the grouped dim; identical 2.11-2.14); GroupedMMUtils.h: "
        "create_grouped_gemm_output_tensor (at::empty_strided: groups with no rows are not zeroed)"
    ),
)

#: The rows of ``torch._scaled_grouped_mm`` (torch 2.11-2.14): Hopper only. The host gate
#: admits sm100 too, but these releases build the FP8 grouped kernel for sm90 alone (an
#: sm100 call fails in the kernel launch); sm89 has no grouped kernel. Where no row
#: applies, f8tensor runs the reference op. Groups that cut M (2D x 3D) may have any size,
#: 0 included; groups that cut the contraction dim (2D x 2D) a multiple of 16 rows each
#: (f8tensor pads them, see ``moe.py``).
GROUPED_RULES: tuple[GroupedMMRule, ...] = (
    GroupedMMRule(
        op="torch._scaled_grouped_mm",
        kernel="CUTLASS grouped (sm90)",
        builds=Builds(min_sm=(9, 0), max_sm=(9, 0)),
        operand_dtypes=frozenset({_E4M3}),
        scale_dtype=_FP32,
        out_dtypes=frozenset({_BF16}),
        a_layout="row-major",
        b_layout="column-major",
        stride_bytes=16,
        offs_dtype=torch.int32,
        contraction_group_multiple=ALIGN,
        bias=False,
        sources=_GROUPED_SOURCES,
    ),
)


def grouped_rule_for(build: CudaBuild) -> GroupedMMRule | None:
    """The row of :data:`GROUPED_RULES` that applies on ``build``, or None (no kernel there)."""
    for rule in GROUPED_RULES:
        if build in rule.builds:
            return rule
    return None
