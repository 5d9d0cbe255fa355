"""FP8 matrix products: the CUDA rules of ``torch._scaled_mm``, the kernel routes, the checker.

Three parts, in this order:

1. **The rules** (:data:`SCALED_MM_RULES`): one row per (scaling kind, set of builds) that
   says what ``torch._scaled_mm`` accepts there: operand dtypes, output dtypes, scale
   dtype/shape/contiguity, layouts, alignment, bias, fast accumulation. Data, not code: a
   new scaling kind (blockwise, MX) or a new build adds a row. The supported NVIDIA builds
   are :data:`SUPPORTED_BUILDS` (torch 2.11-2.13; cu126, cu128, cu130 wheels; sm89, sm90).
2. **The checker** (:func:`scaled_mm_violations`, :func:`violations_on_supported_builds`)
   reads those rows, and :func:`install_rules_check` wraps ``torch._scaled_mm`` (and
   ``torch.nn.functional.scaled_mm`` where it exists) so that every call is checked before
   the real op runs. ``F8TENSOR_CHECK_CUDA_RULES=1`` turns it on at ``import f8tensor``
   (any script: the demo, tutorials, benchmarks); the test suite has it on by default.
3. **The routes** (:func:`choose_route`, :func:`_matmul`, :func:`float8_mm`): every product
   f8tensor makes is sent, from the operands' dtypes and granularities, the requested
   output dtype and fast accumulation (never by catching an error), to a kernel that is
   legal on every supported build.

Nothing in here depends on the device: CPU runs the same calls a GPU would get, so the
CPU suite under the checker vouches for the GPU builds.

``torch.nn.functional.scaled_mm`` (torch >= 2.10, present in 2.13) names its scaling
recipes explicitly and reaches the same kernels through ``torch._scaled_mm_v2``; f8tensor
calls ``torch._scaled_mm`` only (it exists on every supported release), and the checker
reads ``F.scaled_mm`` calls with the same rows. New kinds (blockwise, MX, grouped GEMMs)
add rows to :data:`SCALED_MM_RULES`, a :class:`Route` member and a branch in
:func:`_matmul`.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import threading
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from f8tensor.config import DEFAULT_GEMM, GemmConfig
from f8tensor.formats import FLOAT8_DTYPES, check_hp_dtype, e4m3_like
from f8tensor.tensor import Float8Tensor, cast_to_float8, check_scale_values, dequantize, scale_from_number

__all__ = [
    "ALIGN",
    "BLOCK_SCALED_MM_RULES",
    "GROUPED_RULES",
    "ROCM_BUILDS",
    "ROCM_ROWWISE_NOTE",
    "RULES_CHECK_ENV",
    "SCALED_MM_RULES",
    "STRICTEST_BUILDS",
    "SUPPORTED_BUILDS",
    "BlockScaledMMRule",
    "CudaBuild",
    "CudaRuleViolation",
    "Route",
    "ScaledMMRule",
    "block_rule_for",
    "block_scaled_mm_violations",
    "check_grouped_rules",
    "choose_route",
    "float8_mm",
    "grouped_kernel_available",
    "install_rules_check",
    "precise_rowwise_route",
    "rules_check_installed",
    "scaled_grouped_mm",
    "scaled_mm_violations",
    "set_precise_rowwise_route",
    "uninstall_rules_check",
    "violations_on_supported_builds",
]

_E4M3 = torch.float8_e4m3fn
_E5M2 = torch.float8_e5m2
_E4M3_FNUZ = torch.float8_e4m3fnuz
_E5M2_FNUZ = torch.float8_e5m2fnuz
_FNUZ = (_E4M3_FNUZ, _E5M2_FNUZ)
_BF16, _FP16, _FP32 = torch.bfloat16, torch.float16, torch.float32

# =====================================================================================
# 1. The rules
# =====================================================================================


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


#: Every NVIDIA build whose rules every f8tensor ``_scaled_mm`` call must obey. The wheels
#: of torch 2.11-2.13 exist for CUDA 12.6, 12.8 and 13.0; FP8 tensor cores start at sm89
#: (Ada: L4, L40S, RTX 4090) and sm90 (Hopper: H100, H200).
SUPPORTED_BUILDS: tuple[CudaBuild, ...] = tuple(
    CudaBuild(t, c, s)
    for t in ((2, 11), (2, 12), (2, 13))
    for c in ((12, 6), (12, 8), (13, 0))
    for s in ((8, 9), (9, 0))
)

#: The fnuz formats run on AMD MI300 (gfx942) only; their products are checked against
#: these builds instead (f8tensor refuses fnuz products on NVIDIA devices up front).
ROCM_BUILDS: tuple[CudaBuild, ...] = tuple(CudaBuild(t, (6, 4), (9, 42), "rocm") for t in ((2, 11), (2, 12), (2, 13)))


@dataclasses.dataclass(frozen=True)
class Builds:
    """A set of builds, as data: ``min_*`` bounds are inclusive; ``None`` means any."""

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

#: K (mat1.size(1) == mat2.size(0)) and N (mat2.size(1)) must be multiples of this.
ALIGN = 16


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

#: The table. Rows are looked up in order: the first row whose op, kind and builds match
#: a call is the one that applies (so a narrower row precedes the general one).
SCALED_MM_RULES: tuple[ScaledMMRule, ...] = (
    # Tensorwise x tensorwise: cuBLASLt on every build.
    ScaledMMRule(
        op="torch._scaled_mm",
        kind="tensorwise",
        kernel="cuBLASLt",
        builds=ALL_BUILDS,
        mat1_dtypes=_OPERANDS,
        mat2_dtypes=_OPERANDS,
        refused_pairs=_NO_E5M2_PAIR,
        out_dtypes=frozenset({_BF16, _FP16, _FP32, _E4M3, _E5M2}),
        scale_dtype=_FP32,
        scale_a_shape=SCALE_ONE,
        scale_b_shape=SCALE_ONE,
        scales_contiguous=False,
        mat1_layout="row-major",
        mat2_layout="column-major",
        align_k=ALIGN,
        align_n=ALIGN,
        align_m=1,
        bias_dtypes=_BIAS,
        fast_accum=True,
        sources=(
            (
                "aten/src/ATen/native/cuda/ScaledBlas.cpp: _scaled_mm_out_cuda (K % 16, mat2 dims % 16, "
                "no e5m2 x e5m2, bias bf16/fp16 and none with fp32 out), is_tensorwise_scaling"
            ),
            "torch/_meta_registrations.py: _check_scaled_mm_sizes (row-major self, column-major mat2 on CUDA)",
        ),
    ),
    # Rowwise on cuBLASLt: CUDA >= 12.9 (the cu130 wheels) on sm90 only. It takes an fp32
    # output and an e5m2 mat2; the CUTLASS kernel below does neither.
    ScaledMMRule(
        op="torch._scaled_mm",
        kind="rowwise",
        kernel="cuBLASLt (outer-vector scales)",
        builds=Builds(min_cuda=(12, 9), min_sm=(9, 0), max_sm=(9, 0)),
        mat1_dtypes=_OPERANDS,
        mat2_dtypes=_OPERANDS,
        refused_pairs=_NO_E5M2_PAIR,
        out_dtypes=frozenset({_BF16, _FP16, _FP32}),
        scale_dtype=_FP32,
        scale_a_shape=SCALE_ROWS,
        scale_b_shape=SCALE_COLS,
        scales_contiguous=True,
        mat1_layout="row-major",
        mat2_layout="column-major",
        align_k=ALIGN,
        align_n=ALIGN,
        align_m=1,
        bias_dtypes=_BIAS,
        fast_accum=True,
        sources=(
            (
                "aten/src/ATen/native/cuda/ScaledBlas.cpp: _scaled_mm_out_cuda takes the CUTLASS path when "
                "sm < 9.0 or CUBLAS_VERSION < 120900, cuBLASLt otherwise; is_rowwise_scaling"
            ),
        ),
    ),
    # Rowwise everywhere else: the CUTLASS f8f8bf16_rowwise kernel (sm89 and sm90 with cu126/cu128).
    ScaledMMRule(
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
    ),
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


# =====================================================================================
# 2. The checker
# =====================================================================================


def _name(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.")


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(sorted(_name(d) for d in dtypes)) or "none"


def _scaling_kind(mat1: torch.Tensor, mat2: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> str:
    """How torch._scaled_mm reads the scales (its own order: tensorwise first, then rowwise)."""
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        return "tensorwise"
    m, n = mat1.shape[0], mat2.shape[1]
    if scale_a.dim() == 2 and scale_b.dim() == 2 and tuple(scale_a.shape) == (m, 1) and tuple(scale_b.shape) == (1, n):
        return "rowwise"
    return "unknown"


def _is_row_major(t: torch.Tensor) -> bool:
    rows, cols = t.shape
    return rows == 0 or cols == 0 or (t.stride(1) == 1 and t.stride(0) >= max(cols, 1))


def _is_col_major(t: torch.Tensor) -> bool:
    rows, cols = t.shape
    return rows == 0 or cols == 0 or (t.stride(0) == 1 and t.stride(1) >= max(rows, 1))


def scaled_mm_violations(
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale_result: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    use_fast_accum: bool = False,
    *,
    build: CudaBuild,
) -> list[str]:
    """What ``build`` would refuse in this ``torch._scaled_mm`` call ([] when it is legal)."""
    if mat1.dim() != 2 or mat2.dim() != 2:
        return [f"operands must be 2D; got {tuple(mat1.shape)} and {tuple(mat2.shape)}"]
    kind = _scaling_kind(mat1, mat2, scale_a, scale_b)
    rule = rule_for(kind, build)
    if rule is None:
        m, n = mat1.shape[0], mat2.shape[1]
        message = (
            f"no kernel for these scales on {build.name}: scale_a {tuple(scale_a.shape)}, scale_b "
            f"{tuple(scale_b.shape)} (tensorwise: 1 element each; rowwise: ({m}, 1) and (1, {n}))"
        )
        return [message]
    out = []
    a, b = mat1.dtype, mat2.dtype
    out_dtype = out_dtype if out_dtype is not None else a
    where = f"{kind} ({rule.kernel})"
    if a not in rule.mat1_dtypes:
        out.append(f"{where}: mat1 dtype {_name(a)} not in {{{_names(rule.mat1_dtypes)}}}")
    if b not in rule.mat2_dtypes:
        out.append(f"{where}: mat2 dtype {_name(b)} not in {{{_names(rule.mat2_dtypes)}}}")
    if (a, b) in rule.refused_pairs:
        out.append(f"{where}: {_name(a)} x {_name(b)} is refused")
    if out_dtype not in rule.out_dtypes:
        out.append(f"{where}: out_dtype {_name(out_dtype)} not in {{{_names(rule.out_dtypes)}}}")
    for label, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if s.dtype != rule.scale_dtype:
            out.append(f"{where}: {label} dtype {_name(s.dtype)}, needs {_name(rule.scale_dtype)}")
        if rule.scales_contiguous and not s.is_contiguous():
            out.append(f"{where}: {label} must be contiguous; got stride {s.stride()}")
    if not _is_row_major(mat1):
        out.append(f"{where}: mat1 must be {rule.mat1_layout}; got shape {tuple(mat1.shape)} stride {mat1.stride()}")
    if not _is_col_major(mat2):
        out.append(f"{where}: mat2 must be {rule.mat2_layout}; got shape {tuple(mat2.shape)} stride {mat2.stride()}")
    m, k = mat1.shape
    n = mat2.shape[1]
    for dim, size, align in (("K", k, rule.align_k), ("N", n, rule.align_n), ("M", m, rule.align_m)):
        if size % align:
            out.append(f"{where}: {dim}={size} is not a multiple of {align}")
    if bias is not None:
        allowed = rule.bias_allowed(out_dtype)
        if bias.dtype not in allowed:
            out.append(
                f"{where}: bias dtype {_name(bias.dtype)} with out_dtype {_name(out_dtype)}; "
                f"allowed: {{{_names(allowed)}}}"
            )
        if bias.dim() != 1 or bias.numel() != n:
            out.append(f"{where}: bias must be 1-D of size N={n}; got shape {tuple(bias.shape)}")
    if scale_result is not None and out_dtype not in FLOAT8_DTYPES:
        # PyTorch ignores it then; f8tensor never relies on an ignored argument.
        out.append(f"{where}: scale_result is only applied to an FP8 output; out_dtype is {_name(out_dtype)}")
    if use_fast_accum and not rule.fast_accum:
        out.append(f"{where}: use_fast_accum is not supported")
    return out


_GROUPS: dict[tuple[CudaBuild, ...], list[tuple[CudaBuild, list[CudaBuild]]]] = {}


def _build_groups(builds: tuple[CudaBuild, ...]) -> list[tuple[CudaBuild, list[CudaBuild]]]:
    """``builds`` grouped by the rows that apply to them (one check per group), cached."""
    if builds not in _GROUPS:
        groups: dict[tuple[int, ...], list[CudaBuild]] = {}
        kinds = sorted({r.kind for r in SCALED_MM_RULES})
        for build in builds:
            key = tuple(id(rule_for(kind, build)) for kind in kinds)
            groups.setdefault(key, []).append(build)
        _GROUPS[builds] = [(members[0], members) for members in groups.values()]
    return _GROUPS[builds]


def violations_on_supported_builds(mat1: torch.Tensor, mat2: torch.Tensor, *args: Any, **kwargs: Any) -> list[str]:
    """:func:`scaled_mm_violations` on every supported build, merged: each message once,
    with the builds that refuse it (``[]``: legal everywhere).

    Products of fnuz operands are checked against :data:`ROCM_BUILDS` (the only GPUs
    that have those formats), all others against :data:`SUPPORTED_BUILDS`.
    """
    builds = ROCM_BUILDS if mat1.dtype in _FNUZ or mat2.dtype in _FNUZ else SUPPORTED_BUILDS
    found: dict[str, list[CudaBuild]] = {}
    for representative, members in _build_groups(builds):
        for message in scaled_mm_violations(mat1, mat2, *args, build=representative, **kwargs):
            found.setdefault(message, []).extend(members)
    return [f"{msg} [refused on {len(b)} of {len(builds)} builds, e.g. {b[0].name}]" for msg, b in found.items()]


class CudaRuleViolation(AssertionError):
    """A ``torch._scaled_mm`` call that a supported NVIDIA build would refuse."""


class _RulesCheck:
    """The state of the installed check: the wrapped ops and what they recorded."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.originals: dict[str, Any] = {}
        self.raise_on_violation = True
        self.calls = 0
        self.violations: list[str] = []
        self.call_log: list[dict[str, Any]] | None = None

    def record(self, op: str, summary: dict[str, Any], problems: list[str]) -> None:
        with self.lock:
            self.calls += 1
            if self.call_log is not None:
                self.call_log.append(summary)
            if problems:
                self.violations.extend(f"{op}: {p}" for p in problems)
        if problems and self.raise_on_violation:
            raise CudaRuleViolation(f"{op} call a supported CUDA build would refuse:\n  " + "\n  ".join(problems))

    def take(self) -> list[str]:
        """The violations recorded so far, cleared."""
        with self.lock:
            out, self.violations = self.violations, []
        return out


_CHECK = _RulesCheck()
# The real ops, captured at import (before any wrapping): a wrapper that inductor captured
# in a compiled graph keeps working after uninstall_rules_check().
_ORIGINAL_SCALED_MM = torch._scaled_mm
_ORIGINAL_F_SCALED_MM = getattr(torch.nn.functional, "scaled_mm", None)


def _summary(mat1, mat2, scale_a, scale_b, bias, out_dtype, use_fast_accum) -> dict[str, Any]:
    return {
        "kind": _scaling_kind(mat1, mat2, scale_a, scale_b),
        "mat1": mat1.dtype,
        "mat2": mat2.dtype,
        "shape": (mat1.shape[0], mat1.shape[1], mat2.shape[1]),
        "out_dtype": out_dtype if out_dtype is not None else mat1.dtype,
        "bias": None if bias is None else bias.dtype,
        "use_fast_accum": use_fast_accum,
    }


def _checked_scaled_mm(
    mat1, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False, **kwargs
):
    """``torch._scaled_mm``, after checking the call against every supported build.

    ``kwargs``: passed through (inductor's CPU extern-kernel call adds ``out=``)."""
    problems = violations_on_supported_builds(
        mat1, mat2, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum
    )
    _CHECK.record("torch._scaled_mm", _summary(mat1, mat2, scale_a, scale_b, bias, out_dtype, use_fast_accum), problems)
    return _ORIGINAL_SCALED_MM(
        mat1,
        mat2,
        scale_a,
        scale_b,
        bias=bias,
        scale_result=scale_result,
        out_dtype=out_dtype,
        use_fast_accum=use_fast_accum,
        **kwargs,
    )


def _checked_functional_scaled_mm(mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, *args, **kwargs):
    """``torch.nn.functional.scaled_mm`` (torch >= 2.10), checked like ``_scaled_mm`` for
    the recipes the table has rows for; any other recipe is reported until a row covers it."""
    recipes = {str(getattr(r, "name", r)).lower() for r in (scale_recipe_a, scale_recipe_b)}
    single = not isinstance(scale_a, (list, tuple)) and not isinstance(scale_b, (list, tuple))
    block_rule = _block_rule_by_recipes(scale_recipe_a, scale_recipe_b) if single else None
    if block_rule is not None:
        # Block-scaled kernels exist on some builds only; the route refuses the others up
        # front (_block_kernel_mm), so a call is checked against its own row's layouts.
        problems = block_scaled_mm_violations(mat_a, mat_b, scale_a, scale_b, block_rule)
        summary = {"kind": block_rule.name, "mat1": mat_a.dtype, "mat2": mat_b.dtype}
    elif single and len(recipes) == 1 and recipes <= {"tensorwise", "rowwise"}:
        bias = kwargs.get("bias", args[2] if len(args) > 2 else None)
        out_dtype = kwargs.get("output_dtype", args[3] if len(args) > 3 else torch.bfloat16)
        fast = kwargs.get("use_fast_accum", args[5] if len(args) > 5 else False)
        problems = violations_on_supported_builds(mat_a, mat_b, scale_a, scale_b, bias, None, out_dtype, fast)
        summary = _summary(mat_a, mat_b, scale_a, scale_b, bias, out_dtype, fast)
    else:
        problems = [f"no rules row for scale recipes {sorted(recipes)}: add one to f8tensor.gemm.SCALED_MM_RULES"]
        summary = {"kind": "unknown", "recipes": sorted(recipes)}
    _CHECK.record("torch.nn.functional.scaled_mm", summary, problems)
    return _ORIGINAL_F_SCALED_MM(mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, *args, **kwargs)


# Inductor names its extern-kernel call after the function it captured; keep torch's name.
_checked_scaled_mm.__name__ = _checked_scaled_mm.__qualname__ = "_scaled_mm"


def install_rules_check(*, raise_on_violation: bool = True) -> _RulesCheck:
    """Wrap ``torch._scaled_mm`` (and ``torch.nn.functional.scaled_mm``) with the checker.

    Every call is checked against :data:`SUPPORTED_BUILDS` and recorded (``.calls``,
    ``.violations``; ``.take()`` drains them), then the real op runs. With
    ``raise_on_violation`` a violation raises :class:`CudaRuleViolation` at the call.
    Idempotent; :func:`uninstall_rules_check` restores the originals. Under torch.compile
    the wrapper is one opaque call for dynamo (``allow_in_graph``), so it checks the fake
    tensors AOTAutograd traces with, without a graph break.
    """
    _CHECK.raise_on_violation = raise_on_violation
    if _CHECK.originals:
        return _CHECK
    _CHECK.originals["_scaled_mm"] = torch._scaled_mm
    torch._scaled_mm = torch._dynamo.allow_in_graph(_checked_scaled_mm)
    functional = torch.nn.functional
    if hasattr(functional, "scaled_mm"):
        _CHECK.originals["F.scaled_mm"] = functional.scaled_mm
        functional.scaled_mm = torch._dynamo.allow_in_graph(_checked_functional_scaled_mm)
    return _CHECK


def uninstall_rules_check() -> None:
    """Put the original ops back (no-op when the check is not installed)."""
    if "_scaled_mm" in _CHECK.originals:
        torch._scaled_mm = _CHECK.originals.pop("_scaled_mm")
    if "F.scaled_mm" in _CHECK.originals:
        torch.nn.functional.scaled_mm = _CHECK.originals.pop("F.scaled_mm")


def rules_check_installed() -> _RulesCheck | None:
    """The installed check (its counters and records), or None."""
    return _CHECK if _CHECK.originals else None


#: Environment switch read at ``import f8tensor``: "1"/"raise" installs the check and
#: raises at a violation; "record" only records; "0" or unset leaves torch alone.
RULES_CHECK_ENV = "F8TENSOR_CHECK_CUDA_RULES"


def _install_from_env() -> None:
    mode = os.environ.get(RULES_CHECK_ENV, "").strip().lower()
    if mode in ("", "0", "off", "false", "no"):
        return
    if mode not in ("1", "on", "true", "yes", "raise", "record"):
        raise ValueError(f"{RULES_CHECK_ENV}={mode!r}: use 1 (check and raise), record (check and record) or 0 (off)")
    install_rules_check(raise_on_violation=mode != "record")


# =====================================================================================
# 3. The routes
# =====================================================================================


class Route(str, enum.Enum):
    """The kernel a product runs on (see :func:`choose_route`)."""

    #: cuBLASLt with one scale per operand.
    TENSORWISE = "tensorwise"
    #: The rowwise kernel, outer scales applied in its epilogue.
    ROWWISE = "rowwise"
    #: The rowwise kernel on ``(B^T A^T)^T``: an e5m2 second operand becomes the first.
    ROWWISE_SWAPPED = "rowwise_swapped"
    #: cuBLASLt with the rowwise sides' scales set to 1 and an fp32 output, then one
    #: elementwise ``acc * a_inv[:, None] * b_inv[None, :]`` (+ bias, cast). Legal on every
    #: build: the route of the products the rowwise kernels refuse (an fp32 output on the
    #: CUTLASS builds, an e5m2 ``b`` that cannot be swapped), and, when asked for with
    #: :func:`set_precise_rowwise_route`, of precise-accumulation rowwise products.
    TENSORWISE_POSTSCALE = "tensorwise_postscale"


# The route of a rowwise product that accumulates precisely (use_fast_accum=False, as the
# rowwise recipes' backward GEMMs do) and asks for a bf16/fp16 output. Both routes are
# legal on every supported build. Default: the rowwise kernel. The post-scale route writes
# the fp32 product and reads it back (+9 MiB per training step of Linear(512 -> 1024) on
# 2048 tokens, benchmarks/bench_cast_traffic.py) and costs one more kernel per GEMM; it was
# the usual remedy for the CUTLASS kernel's slow precise-accumulation schedule (cu126/cu128
# wheels, sm89), while on cu130 sm90 the rowwise product runs on cuBLASLt with the same
# accumulation as the tensorwise kernel. Which is faster on a given build and shape is a
# GPU timing: benchmarks/bench_routes.py measures both.
# Process-wide, like torch.backends flags: it belongs to the build, not to a tensor (and so
# is not part of GemmConfig or of any checkpoint).
_PRECISE_ROWWISE = {"route": "kernel"}
_PRECISE_ROWWISE_CHOICES = ("kernel", "postscale")


def set_precise_rowwise_route(route: str) -> str:
    """Choose how rowwise products with precise accumulation and a bf16/fp16 output run:
    ``"kernel"`` (the rowwise kernel, default) or ``"postscale"`` (the tensorwise kernel
    with an fp32 output and one scaling pass after). Returns the previous choice.

    Products the rowwise kernels refuse take the post-scale route whatever is set here.
    Read when a product is traced or run: set it before ``torch.compile`` traces a model
    (a change afterwards recompiles).
    """
    previous, _PRECISE_ROWWISE["route"] = _PRECISE_ROWWISE["route"], _checked_precise_route(route)
    return previous


def _checked_precise_route(route: object) -> str:
    if route not in _PRECISE_ROWWISE_CHOICES:
        raise ValueError(f"precise rowwise route must be one of {_PRECISE_ROWWISE_CHOICES}; got {route!r}")
    return route


def precise_rowwise_route() -> str:
    """The current choice of :func:`set_precise_rowwise_route`."""
    return _PRECISE_ROWWISE["route"]


def _is_e4m3(dtype: torch.dtype) -> bool:
    return dtype in (_E4M3, _E4M3_FNUZ)


def choose_route(
    a_dtype: torch.dtype,
    b_dtype: torch.dtype,
    *,
    rowwise: bool,
    out_dtype: torch.dtype,
    use_fast_accum: bool,
    m: int,
    precise_route: str | None = None,
) -> Route:
    """The kernel route for ``(M, K) @ (K, N)`` FP8 operands of these dtypes.

    ``rowwise``: either operand has one scale per row/column. Decided from the arguments
    (and the process-wide :func:`precise_rowwise_route`) alone, so that the choice is the
    same on every device and build:

    - both tensorwise: :attr:`Route.TENSORWISE`;
    - rowwise with a bf16/fp16 output (bf16 only for fnuz operands, the ROCm rule), fast
      accumulation or precise (unless ``precise_route`` is ``"postscale"``): the rowwise
      kernel, :attr:`Route.ROWWISE` when ``b`` is e4m3, else :attr:`Route.ROWWISE_SWAPPED`
      when ``a`` is e4m3 and ``M`` is a multiple of 16 (``M`` becomes the swapped product's N);
    - every other rowwise product (fp32 output, an e5m2 ``b`` that cannot be swapped,
      precise accumulation with ``precise_route="postscale"``): :attr:`Route.TENSORWISE_POSTSCALE`.

    ``precise_route``: ``"kernel"`` or ``"postscale"``; None reads
    :func:`precise_rowwise_route`.
    """
    if not rowwise:
        return Route.TENSORWISE
    precise_route = _PRECISE_ROWWISE["route"] if precise_route is None else _checked_precise_route(precise_route)
    fnuz = a_dtype in _FNUZ
    kernel_outs = (_BF16,) if fnuz else (_BF16, _FP16)
    if (use_fast_accum or precise_route == "kernel") and out_dtype in kernel_outs:
        if _is_e4m3(b_dtype):
            return Route.ROWWISE
        if _is_e4m3(a_dtype) and m % ALIGN == 0:
            return Route.ROWWISE_SWAPPED
    return Route.TENSORWISE_POSTSCALE


def _is_f8(x: object) -> bool:
    return isinstance(x, Float8Tensor)


def float8_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    out_scale: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """``a @ b`` (2D) on FP8 tensor cores, with an explicit output dtype.

    At least one operand is a Float8Tensor; a plain one is cast on the fly (dynamic
    scale, the other operand's granularity). ``out_dtype``: bf16, fp16 or fp32 are
    written straight from the fp32 accumulator (default: ``a``'s original dtype). An FP8
    ``out_dtype`` needs ``out_scale`` and returns a Float8Tensor with that scale; the
    product is saturated into range, never overflowed; a non-finite one (an inf in
    ``bias``) becomes NaN, never the format's max.
    """
    out_scale = _check_float8_mm_args(a, b, bias, out_dtype, out_scale)
    if out_scale is not None:
        orig = a._orig_dtype if _is_f8(a) else a.dtype
        # Accumulate and add the bias in fp32, then one saturating cast: the only rounding
        # to FP8 is the one asked for (and no FP8 output is asked of the kernel, which the
        # rowwise kernels refuse). The clamp would turn an inf into the format's max: keep
        # it non-finite (NaN, the one non-finite value all four formats have).
        acc = _matmul(a, b, bias=bias, out_dtype=torch.float32)
        acc = torch.where(torch.isinf(acc), torch.nan, acc)
        return cast_to_float8(acc, out_dtype, scale=out_scale, orig_dtype=orig)
    return _matmul(a, b, bias=bias, out_dtype=out_dtype)


def _check_float8_mm_args(a, b, bias, out_dtype, out_scale) -> torch.Tensor | None:
    """float8_mm's arguments, checked at its entry; returns the 0-dim fp32 out_scale (FP8 output) or None."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"float8_mm: {name} must be a tensor; got {type(t).__name__}")
    if not (_is_f8(a) or _is_f8(b)):
        raise TypeError("float8_mm needs at least one Float8Tensor operand; use torch.mm for plain tensors")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or _is_f8(bias):
            raise TypeError(f"float8_mm: bias must be None or a high-precision tensor; got {type(bias).__name__}")
        check_hp_dtype(bias.dtype, "float8_mm bias")
    if out_dtype is not None and out_dtype not in FLOAT8_DTYPES:
        check_hp_dtype(out_dtype, "out_dtype")
    if out_dtype not in FLOAT8_DTYPES:
        if out_scale is not None:
            raise ValueError("out_scale is only meaningful with an FP8 out_dtype")
        return None
    if out_scale is None:
        raise ValueError(f"an FP8 out_dtype ({out_dtype}) needs out_scale (the scale of the output)")
    device = (a if _is_f8(a) else b).device
    if not isinstance(out_scale, torch.Tensor):
        return scale_from_number(out_scale, "float8_mm out_scale", device)
    if out_scale.dtype != torch.float32:
        raise TypeError(f"float8_mm out_scale must be a float or a float32 tensor; got dtype {out_scale.dtype}")
    if out_scale.numel() != 1:
        raise ValueError(
            f"float8_mm out_scale must be one number (a tensor of 1 element); got shape {tuple(out_scale.shape)}"
        )
    if out_scale.device != device:
        raise ValueError(f"float8_mm out_scale is on {out_scale.device}, the operands on {device}")
    return check_scale_values(out_scale.reshape(()), "float8_mm out_scale")


def _matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The one place that calls ``torch._scaled_mm``. ``a``: (M, K), ``b``: (K, N).

    Block-scaled operands (1x128, 128x128, MX) go to :func:`_block_matmul`."""
    if _is_blockwise(a) or _is_blockwise(b):
        return _block_matmul(a, b, bias=bias, out_dtype=out_dtype)
    if a.dim() != 2 or b.dim() != 2:
        raise RuntimeError(f"FP8 mm expects 2D operands; got {tuple(a.shape)} and {tuple(b.shape)}")
    a8, b8 = _as_float8_operands(a, b)
    _check_operand_dtypes(a8._data.dtype, b8._data.dtype, a8._data.device)
    gemm = _merged_gemm(a8._gemm, b8._gemm)
    (m, k), (k2, n) = a8.shape, b8.shape
    if k != k2:
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({m}x{k} and {k2}x{n})")
    if out_dtype is None:
        out_dtype = gemm.out_dtype or a8._orig_dtype

    # Layouts the kernels take: A row-major, B column-major. FP8 copies are 1 byte/element.
    a_data = a8._data if a8._data.is_contiguous() else a8._data.contiguous()
    b_data = b8._data if b8._data.t().is_contiguous() else b8._data.t().contiguous().t()

    pad_k, pad_n = (-k) % ALIGN, (-n) % ALIGN
    if pad_k or pad_n:
        if not gemm.pad_inner_dim:
            raise ValueError(
                f"FP8 matmul needs the inner dimension K and the output dimension N to be multiples "
                f"of {ALIGN} (torch._scaled_mm's rule); got ({m}x{k}) @ ({k}x{n}). Use such shapes, or "
                f"ask for zero padding with GemmConfig(pad_inner_dim=True)."
            )
        a_data = _pad_bytes(a_data, 0, pad_k)
        b_data = _pad_bytes(b_data.t(), pad_n, pad_k).t()

    rowwise = a8._axiswise_dim is not None or b8._axiswise_dim is not None
    route = choose_route(
        a_data.dtype, b_data.dtype, rowwise=rowwise, out_dtype=out_dtype, use_fast_accum=gemm.use_fast_accum, m=m
    )
    a_inv, b_inv = a8._scale.reciprocal(), b8._scale.reciprocal()
    if route is Route.TENSORWISE:
        out = _fused_bias_mm(a_data, b_data, a_inv, b_inv, bias, out_dtype, gemm.use_fast_accum, pad_n)
    elif route is Route.ROWWISE:
        a_vec, b_vec = _row_scales(a_inv, m), _col_scales(b_inv, n)
        if pad_n:
            b_vec = torch.nn.functional.pad(b_vec, (0, pad_n), value=1.0)
        out = _fused_bias_mm(a_data, b_data, a_vec, b_vec, bias, out_dtype, gemm.use_fast_accum, pad_n)
    elif route is Route.ROWWISE_SWAPPED:
        # (A B)^T = B^T A^T: B^T is (N, K) row-major and A^T is (K, M) column-major, both
        # views of the bytes we have. The bias runs along the swapped product's rows, so it
        # is added after the kernel.
        a_vec, b_vec = _row_scales(a_inv, m), _col_scales(b_inv, n)
        if pad_n:
            b_vec = torch.nn.functional.pad(b_vec, (0, pad_n), value=1.0)
        out_t = torch._scaled_mm(
            b_data.t(),
            a_data.t(),
            scale_a=b_vec.reshape(-1, 1),
            scale_b=a_vec.reshape(1, -1),
            out_dtype=out_dtype,
            use_fast_accum=gemm.use_fast_accum,
        )
        out = out_t[:n].t().contiguous()
        if bias is not None:
            out = out + bias.to(out_dtype)
    else:
        out = _postscaled_mm(a8, b8, a_data, b_data, a_inv, b_inv, m, n, bias, out_dtype, gemm.use_fast_accum)
    return out


def _fused_bias_mm(a_data, b_data, scale_a, scale_b, bias, out_dtype, use_fast_accum, pad_n):
    """One ``_scaled_mm`` call; the bias is fused when the kernels take it (1-D, same
    bf16/fp16 dtype as the output, no N padding), else added afterwards."""
    fuse_bias = (
        bias is not None and not pad_n and bias.dim() == 1 and bias.dtype == out_dtype and out_dtype in (_BF16, _FP16)
    )
    out = torch._scaled_mm(
        a_data,
        b_data,
        scale_a=scale_a,
        scale_b=scale_b,
        bias=bias if fuse_bias else None,
        out_dtype=out_dtype,
        use_fast_accum=use_fast_accum,
    )
    if pad_n:
        out = out[:, : out.shape[1] - pad_n].contiguous()
    if bias is not None and not fuse_bias:
        out = out + bias.to(out_dtype)
    return out


def _postscaled_mm(a8, b8, a_data, b_data, a_inv, b_inv, m, n, bias, out_dtype, use_fast_accum):
    """:attr:`Route.TENSORWISE_POSTSCALE`: the tensorwise kernel, fp32 out, outer scales after.

    A tensorwise side passes its own scale to the kernel; a rowwise side passes 1 and is
    applied in fp32 afterwards, in the order the rowwise kernel's epilogue uses
    (``acc * a_inv`` then ``* b_inv``), then the bias in fp32, then one cast. Deliberate
    fp32 intermediate: the rowwise kernel's epilogue is fp32 as well.
    """
    one = torch.ones((), dtype=torch.float32, device=a_data.device)
    a_rowwise, b_rowwise = a8._axiswise_dim is not None, b8._axiswise_dim is not None
    acc = torch._scaled_mm(
        a_data,
        b_data,
        scale_a=one if a_rowwise else a_inv,
        scale_b=one if b_rowwise else b_inv,
        out_dtype=torch.float32,
        use_fast_accum=use_fast_accum,
    )
    out = acc if acc.shape[1] == n else acc[:, :n]
    # The first product allocates (the kernel's output may be a padded view); the rest
    # run in place on that fresh tensor: one fp32 M x N buffer besides the kernel's.
    if a_rowwise:
        out = out * _row_scales(a_inv, m)
    if b_rowwise:
        out = out.mul_(_col_scales(b_inv, n)) if a_rowwise else out * _col_scales(b_inv, n)
    if bias is not None:
        out = out.add_(bias.to(torch.float32))
    return out.to(out_dtype)


def _row_scales(inv: torch.Tensor, m: int) -> torch.Tensor:
    """An operand's inverse scale as the (M, 1) fp32 contiguous column the kernels take."""
    return inv.reshape(-1, 1).expand(m, 1).contiguous()


def _col_scales(inv: torch.Tensor, n: int) -> torch.Tensor:
    """An operand's inverse scale as the (1, N) fp32 contiguous row the kernels take."""
    return inv.reshape(1, -1).expand(1, n).contiguous()


def _as_float8_operands(a: torch.Tensor, b: torch.Tensor) -> tuple[Float8Tensor, Float8Tensor]:
    """Both operands as Float8Tensors whose scales are constant along K.

    A plain operand is cast with a dynamic scale, in the e4m3 format of the other
    operand's family (cuBLASLt refuses e5m2 x e5m2) and with its granularity. An operand
    whose scale varies along K (e.g. a rowwise weight used in ``grad @ w``) is
    re-quantized along the other axis: one extra rounding, but the product stays in FP8.
    """
    ref = a if _is_f8(a) else b
    if not _is_f8(ref):
        raise TypeError("FP8 mm needs at least one Float8Tensor operand")
    rowwise = ref._axiswise_dim is not None
    if not _is_f8(a):
        a = _cast_plain(a, ref, 1 if rowwise else None)
    if not _is_f8(b):
        b = _cast_plain(b, ref, 0 if rowwise else None)
    if a._axiswise_dim not in (None, 1):
        a = _requantize(a, 1)
    if b._axiswise_dim not in (None, 0):
        b = _requantize(b, 0)
    return a, b


def _cast_plain(x: torch.Tensor, ref: Float8Tensor, axiswise_dim: int | None) -> Float8Tensor:
    check_hp_dtype(x.dtype, "the plain operand of an FP8 matmul")
    return cast_to_float8(x, e4m3_like(ref._data.dtype), axiswise_dim=axiswise_dim, gemm=ref._gemm)


def _requantize(f8: Float8Tensor, axiswise_dim: int) -> Float8Tensor:
    # Deliberate upcast to fp32 between the two roundings, not to the original dtype.
    return cast_to_float8(
        dequantize(f8, torch.float32),
        f8._data.dtype,
        axiswise_dim=axiswise_dim,
        gemm=f8._gemm,
        orig_dtype=f8._orig_dtype,
    )


def _nvidia_cuda(device: torch.device) -> bool:
    return device.type == "cuda" and torch.version.hip is None


def _check_operand_dtypes(a: torch.dtype, b: torch.dtype, device: torch.device | None = None) -> None:
    # Rules of every GPU build, enforced on every device (CPU kernels would accept these),
    # so a model that runs on CPU runs unchanged on a GPU.
    if "e5m2" in str(a) and "e5m2" in str(b):
        raise ValueError(
            f"FP8 matmul of two e5m2 operands ({a} x {b}) is not supported by torch._scaled_mm on "
            f"GPUs; cast one operand to e4m3"
        )
    if (a in _FNUZ) != (b in _FNUZ):
        raise ValueError(f"FP8 matmul operands must both be fnuz formats or neither; got {a} x {b}")
    if device is not None and _nvidia_cuda(device) and a in _FNUZ:
        raise ValueError(
            f"FP8 matmul of {_name(a)} x {_name(b)} on an NVIDIA CUDA device: the fnuz formats exist "
            f"for AMD ROCm GPUs (MI300) only. This device multiplies {_name(_E4M3)} and {_name(_E5M2)} "
            f"(not both e5m2); cast with one of those."
        )


def _merged_gemm(a: GemmConfig, b: GemmConfig) -> GemmConfig:
    if a == b or b == DEFAULT_GEMM:
        return a
    if a == DEFAULT_GEMM:
        return b
    raise ValueError(f"the operands of an FP8 matmul carry different GemmConfigs: {a} and {b}")


def _pad_bytes(x: torch.Tensor, pad_rows: int, pad_cols: int) -> torch.Tensor:
    # Pad through uint8: constant_pad_nd has no FP8 kernels, and the zero byte is +0.0 in
    # all four formats (0x80 would be NaN in the fnuz ones).
    raw = torch.nn.functional.pad(x.contiguous().view(torch.uint8), (0, pad_cols, 0, pad_rows))
    return raw.view(x.dtype)


# =====================================================================================
# 4. Block-scaled products (1x128, 128x128, MX 1x32)
# =====================================================================================
#
# A product with a block-scaled operand (see Float8Tensor's ``_block``) goes to
# :func:`_block_matmul`. On CPU, and on CUDA with ``GemmConfig(emulate=True)``, it is the
# reference computation: each operand dequantized per block in fp32, an fp32 matmul, the
# bias added in fp32, one cast (the numbers the GPU kernels compute up to accumulation
# order). On CUDA otherwise it is ``torch.nn.functional.scaled_mm`` with the scale layouts
# of :data:`BLOCK_SCALED_MM_RULES`, or a clear error where no supported build has the kernel.


@dataclasses.dataclass(frozen=True)
class BlockScaledMMRule:
    """One block-scaled kernel of ``torch.nn.functional.scaled_mm`` (one row of the table).

    ``block_a`` is the block of ``mat_a`` (M, K) and ``block_b`` that of ``mat_b`` (K, N),
    in f8tensor's per-dim spelling; ``recipe_a``/``recipe_b`` name the
    ``torch.nn.functional.ScalingType`` members; ``scale_a``/``scale_b`` describe the
    scale tensors the kernel reads (shape, strides, swizzle), which
    :func:`_block_kernel_scales` builds from f8tensor's scales.
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


_DEEPSEEK_BUILDS = Builds(min_cuda=(12, 9), min_sm=(9, 0), max_sm=(9, 0))
_DEEPSEEK_SOURCES = (
    (
        "aten/src/ATen/native/cuda/ScaledBlas.cpp: _scaled_block1x128_block128x128, "
        "_scaled_block1x128_block1x128, _scaled_block128x128_block1x128 (scale shapes and strides), "
        "_check_deepseek_support (sm90, cuBLAS >= 12.9); check_deepseek_recipe (both operands e4m3fn, fp32 scales)"
    ),
)

BLOCK_SCALED_MM_RULES: tuple[BlockScaledMMRule, ...] = (
    BlockScaledMMRule(
        name="1x128 x 128x128",
        recipe_a="BlockWise1x128",
        recipe_b="BlockWise128x128",
        block_a=(1, 128),
        block_b=(128, 128),
        operand_dtypes=frozenset({_E4M3}),
        scale_dtype=_FP32,
        scale_a="(M, ceil(K/128)), strides (1, M)",
        scale_b="(round_up(ceil(K/128), 4), ceil(N/128)), strides (1, round_up(ceil(K/128), 4))",
        builds=_DEEPSEEK_BUILDS,
        fast_accum=True,
        sources=_DEEPSEEK_SOURCES,
    ),
    BlockScaledMMRule(
        name="1x128 x 1x128",
        recipe_a="BlockWise1x128",
        recipe_b="BlockWise1x128",
        block_a=(1, 128),
        block_b=(128, 1),
        operand_dtypes=frozenset({_E4M3}),
        scale_dtype=_FP32,
        scale_a="(M, ceil(K/128)), strides (1, M)",
        scale_b="(N, ceil(K/128)), strides (1, N)",
        builds=_DEEPSEEK_BUILDS,
        fast_accum=True,
        sources=_DEEPSEEK_SOURCES,
    ),
    BlockScaledMMRule(
        name="128x128 x 1x128",
        recipe_a="BlockWise128x128",
        recipe_b="BlockWise1x128",
        block_a=(128, 128),
        block_b=(128, 1),
        operand_dtypes=frozenset({_E4M3}),
        scale_dtype=_FP32,
        scale_a="(round_up(ceil(K/128), 4), ceil(M/128)), strides (1, round_up(ceil(K/128), 4))",
        scale_b="(N, ceil(K/128)), strides (1, N)",
        builds=_DEEPSEEK_BUILDS,
        fast_accum=True,
        sources=_DEEPSEEK_SOURCES,
    ),
    BlockScaledMMRule(
        name="MXFP8 1x32 x 1x32",
        recipe_a="BlockWise1x32",
        recipe_b="BlockWise1x32",
        block_a=(1, 32),
        block_b=(32, 1),
        operand_dtypes=frozenset({_E4M3, _E5M2}),
        scale_dtype=torch.float8_e8m0fnu,
        scale_a="round_up(M, 128) * round_up(ceil(K/32), 4) e8m0, SWIZZLE_32_4_4, contiguous",
        scale_b="round_up(N, 128) * round_up(ceil(K/32), 4) e8m0, SWIZZLE_32_4_4, contiguous",
        # Blackwell (sm100) and later: no build in SUPPORTED_BUILDS (sm89, sm90) has it.
        builds=Builds(min_cuda=(12, 8), min_sm=(10, 0)),
        fast_accum=False,  # _scaled_mxfp8_mxfp8 passes use_fast_accum=false to the GEMM
        sources=(
            (
                "aten/src/ATen/native/cuda/ScaledBlas.cpp: _scaled_mxfp8_mxfp8 (scale element counts, "
                "SWIZZLE_32_4_4 on CUDA, contiguous scales); check_mxfp8_recipe (e8m0 scales)"
            ),
        ),
    ),
)


def block_rule_for(block_a: tuple[int, ...], block_b: tuple[int, ...], scale_dtype: torch.dtype) -> BlockScaledMMRule | None:
    """The row whose operand blocks and scale dtype are these, or None."""
    for rule in BLOCK_SCALED_MM_RULES:
        if (rule.block_a, rule.block_b, rule.scale_dtype) == (tuple(block_a), tuple(block_b), scale_dtype):
            return rule
    return None


def _is_blockwise(x: object) -> bool:
    return isinstance(x, Float8Tensor) and x.is_blockwise


def _block_operands(a: torch.Tensor, b: torch.Tensor) -> tuple[Float8Tensor, Float8Tensor]:
    """Both operands as Float8Tensors. A plain one is cast with the other's block along K
    (``(1, k)`` for ``a``, ``(k, 1)`` for ``b``; rowwise where the other's K block is 0),
    its scale dtype and the e4m3 format of its family."""
    if not _is_f8(a):
        check_hp_dtype(a.dtype, "the plain operand of an FP8 matmul")
        kb = b._block[0] if b._scale.dim() else 0
        block = (1, kb) if kb else (1, 0)
        a = cast_to_float8(a, e4m3_like(b._data.dtype), block=block, scale_dtype=b._scale.dtype, gemm=b._gemm)
    if not _is_f8(b):
        check_hp_dtype(b.dtype, "the plain operand of an FP8 matmul")
        kb = a._block[1] if a._scale.dim() else 0
        block = (kb, 1) if kb else (0, 1)
        b = cast_to_float8(b, e4m3_like(a._data.dtype), block=block, scale_dtype=a._scale.dtype, gemm=a._gemm)
    return a, b


def _block_matmul(
    a: torch.Tensor, b: torch.Tensor, *, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``a @ b`` where at least one operand is block-scaled (2D: (M, K) @ (K, N))."""
    if a.dim() != 2 or b.dim() != 2:
        raise RuntimeError(f"FP8 mm expects 2D operands; got {tuple(a.shape)} and {tuple(b.shape)}")
    a8, b8 = _block_operands(a, b)
    _check_operand_dtypes(a8._data.dtype, b8._data.dtype, a8._data.device)
    gemm = _merged_gemm(a8._gemm, b8._gemm)
    (m, k), (k2, n) = a8.shape, b8.shape
    if k != k2:
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({m}x{k} and {k2}x{n})")
    if out_dtype is None:
        out_dtype = gemm.out_dtype or a8._orig_dtype
    if a8._data.device.type == "cuda" and not gemm.emulate:
        return _block_kernel_mm(a8, b8, bias, out_dtype, gemm)
    return _block_reference_mm(a8, b8, bias, out_dtype)


def _block_reference_mm(a8: Float8Tensor, b8: Float8Tensor, bias, out_dtype: torch.dtype) -> torch.Tensor:
    """The reference: dequantize per block in fp32, fp32 matmul, fp32 bias, one cast.

    Deliberate fp32 throughout: it is what the block-scaled kernels accumulate in (they
    apply each K-block's scales to its fp32 partial sum), so the results agree up to the
    order of accumulation.
    """
    acc = dequantize(a8, torch.float32) @ dequantize(b8, torch.float32)
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc.to(out_dtype)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _swizzle_32_4_4(scale: torch.Tensor) -> torch.Tensor:
    """An (R, C) e8m0 scale in the tiled layout cuBLAS reads for 1x32 block scaling.

    Padded to 128-row x 4-column tiles (tiles in row-major order); inside a tile, the
    entry at (r, c) lands at offset ``(r % 32) * 16 + (r // 32) * 4 + c``.
    """
    rows, cols = scale.shape
    pr, pc = _round_up(rows, 128), _round_up(cols, 4)
    raw = scale.view(torch.uint8)
    if (pr, pc) != (rows, cols):
        # Pad bytes: 127 is 2**0 in e8m0, a harmless 1 for the padding's zero data.
        raw = torch.nn.functional.pad(raw, (0, pc - cols, 0, pr - rows), value=127)
    tiles = raw.reshape(pr // 128, 4, 32, pc // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().reshape(-1).view(torch.float8_e8m0fnu)


def _inverse_block_scale(x8: Float8Tensor) -> torch.Tensor:
    """The kernels' dequantization factors (``1 / _scale``) in the scale's dtype; exact for
    e8m0 (powers of two)."""
    inv = x8._scale.to(torch.float32).reciprocal()
    return inv if x8._scale.dtype == torch.float32 else inv.to(torch.float8_e8m0fnu)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def _block_kernel_scales(rule: BlockScaledMMRule, a8: Float8Tensor, b8: Float8Tensor):
    """The two scale tensors in the layouts ``rule`` names (see its ``scale_a``/``scale_b``)."""
    a_inv, b_inv = _inverse_block_scale(a8), _inverse_block_scale(b8)
    if rule.recipe_a == "BlockWise1x32":
        # a: (M, K/32) as is; b: its (K/32, N) scales read per column of b, i.e. (N, K/32).
        return _swizzle_32_4_4(a_inv), _swizzle_32_4_4(b_inv.t().contiguous())
    if rule.block_a == (1, 128):
        sa = _column_major(a_inv)  # (M, K/128), strides (1, M)
    else:  # 128x128 a: (M/128, K/128) -> (round_up(K/128, 4), M/128), column-major
        t = a_inv.t()
        sa = _column_major(torch.nn.functional.pad(t, (0, 0, 0, _round_up(t.shape[0], 4) - t.shape[0])))
    if rule.block_b == (128, 1):
        sb = b_inv.contiguous().t()  # (K/128, N) row-major, read as (N, K/128) with strides (1, N)
    else:  # 128x128 b: (K/128, N/128) -> (round_up(K/128, 4), N/128), column-major
        sb = _column_major(torch.nn.functional.pad(b_inv, (0, 0, 0, _round_up(b_inv.shape[0], 4) - b_inv.shape[0])))
    return sa, sb


def _block_kernel_mm(a8: Float8Tensor, b8: Float8Tensor, bias, out_dtype: torch.dtype, gemm: GemmConfig) -> torch.Tensor:
    """``torch.nn.functional.scaled_mm`` with block scales, or a clear error."""
    scale_dtype = a8._scale.dtype if a8._scale.dtype == b8._scale.dtype else None
    rule = block_rule_for(a8._block, b8._block, scale_dtype) if scale_dtype is not None else None
    allowed = "; ".join(f"{r.name}: a block {r.block_a}, b block {r.block_b}, {_name(r.scale_dtype)} scales" for r in BLOCK_SCALED_MM_RULES)
    if rule is None:
        raise NotImplementedError(
            f"no CUDA kernel multiplies a block-{a8._block} ({_name(a8._scale.dtype)} scales) by a "
            f"block-{b8._block} ({_name(b8._scale.dtype)} scales) operand. Kernels: {allowed}. "
            f"Use GemmConfig(emulate=True) / Float8LinearConfig(emulate=True) for the reference path."
        )
    functional = torch.nn.functional
    major, minor = torch.cuda.get_device_capability(a8._data.device)
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    here = CudaBuild((0, 0), cuda, (major, minor))
    if not hasattr(functional, "scaled_mm") or here not in rule.builds:
        raise NotImplementedError(
            f"the {rule.name} kernel needs {rule.builds} and torch.nn.functional.scaled_mm; this is "
            f"sm{major}{minor} with CUDA {torch.version.cuda}. Use emulate=True for the reference path."
        )
    if a8._data.dtype not in rule.operand_dtypes or b8._data.dtype not in rule.operand_dtypes:
        raise ValueError(f"the {rule.name} kernel takes {_names(rule.operand_dtypes)} operands; got {_name(a8._data.dtype)} x {_name(b8._data.dtype)}")
    a_data = a8._data if a8._data.is_contiguous() else a8._data.contiguous()
    b_data = b8._data if b8._data.t().is_contiguous() else b8._data.t().contiguous().t()
    sa, sb = _block_kernel_scales(rule, a8, b8)
    kinds, swizzle = functional.ScalingType, functional.SwizzleType
    swz = swizzle.SWIZZLE_32_4_4 if rule.recipe_a == "BlockWise1x32" else swizzle.NO_SWIZZLE
    out = functional.scaled_mm(
        a_data, b_data, sa, getattr(kinds, rule.recipe_a), sb, getattr(kinds, rule.recipe_b),
        swizzle_a=swz, swizzle_b=swz, output_dtype=out_dtype,
        use_fast_accum=gemm.use_fast_accum and rule.fast_accum,
    )
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out


def _block_rule_by_recipes(recipe_a: Any, recipe_b: Any) -> BlockScaledMMRule | None:
    names = tuple(str(getattr(r, "name", r)) for r in (recipe_a, recipe_b))
    for rule in BLOCK_SCALED_MM_RULES:
        if (rule.recipe_a, rule.recipe_b) == names:
            return rule
    return None


def block_scaled_mm_violations(
    mat_a: torch.Tensor, mat_b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, rule: BlockScaledMMRule
) -> list[str]:
    """What ``rule``'s kernel would refuse in this ``torch.nn.functional.scaled_mm`` call:
    operand dtypes and layouts, scale dtypes, and the scale sizes of its row."""
    out = []
    where = f"block-scaled {rule.name}"
    for label, t in (("mat_a", mat_a), ("mat_b", mat_b)):
        if t.dtype not in rule.operand_dtypes:
            out.append(f"{where}: {label} dtype {_name(t.dtype)} not in {{{_names(rule.operand_dtypes)}}}")
    for label, t in (("scale_a", scale_a), ("scale_b", scale_b)):
        if t.dtype != rule.scale_dtype:
            out.append(f"{where}: {label} dtype {_name(t.dtype)}, needs {_name(rule.scale_dtype)}")
    if not _is_row_major(mat_a):
        out.append(f"{where}: mat_a must be row-major; got stride {mat_a.stride()}")
    if not _is_col_major(mat_b):
        out.append(f"{where}: mat_b must be column-major; got stride {mat_b.stride()}")
    m, k = mat_a.shape
    n = mat_b.shape[1]
    if rule.recipe_a == "BlockWise1x32":
        want = (_round_up(m, 128) * _round_up(-(-k // 32), 4), _round_up(n, 128) * _round_up(-(-k // 32), 4))
        got = (scale_a.numel(), scale_b.numel())
        if got != want:
            out.append(f"{where}: scale element counts {got}, needs {want}")
        return out
    kb = -(-k // 128)
    shapes = {
        (1, 128): ((m, kb), (1, m)),
        (128, 128): ((_round_up(kb, 4), -(-m // 128)), (1, _round_up(kb, 4))),
    }
    want_a = shapes[rule.block_a]
    want_b = ((n, kb), (1, n)) if rule.block_b == (128, 1) else ((_round_up(kb, 4), -(-n // 128)), (1, _round_up(kb, 4)))
    for label, t, (shape, stride) in (("scale_a", scale_a, want_a), ("scale_b", scale_b, want_b)):
        if tuple(t.shape) != shape:
            out.append(f"{where}: {label} shape {tuple(t.shape)}, needs {shape}")
        elif t.stride(0) != 1 or (shape[1] > 1 and t.stride(1) != stride[1]):
            out.append(f"{where}: {label} strides {t.stride()}, needs {stride}")
    return out
# ===================================================================== grouped and batched products
#
# Grouped and batched FP8 products: the ``torch._scaled_grouped_mm`` route, its CUDA rules, the CPU reference.
#
# One entry point, :func:`scaled_grouped_mm`, with the signature of the kernel it stands for:
# ``(a, b, scale_a, scale_b, offs, out_dtype)``, where the scales are *dequantization*
# factors (``1 / scale`` of our Float8Tensors), as ``torch._scaled_mm`` takes them. Three forms:
#
# - 2D x 3D with ``offs`` (an MoE layer's forward and input gradient): ``a`` (M, K) holds the
#   tokens sorted by expert, ``b`` (G, K, N) one matrix per expert, ``offs`` (G,) int32 the
#   cumulative token counts; out (M, N). Scales: ``scale_a`` (M,), ``scale_b`` (G, N).
# - 2D x 2D with ``offs`` (the expert weights' gradient): ``a`` (K, M), ``b`` (M, N), the groups
#   cut the contraction dim M; out (G, K, N). Scales: ``scale_a`` (G*K,), ``scale_b`` (G*N,).
# - 3D x 3D without ``offs`` (``bmm``): ``a`` (B, M, K), ``b`` (B, K, N); out (B, M, N).
#   Scales: ``scale_a`` (B, M), ``scale_b`` (B, N).
#
# The CUDA rules (:data:`GROUPED_RULES`) are checked on every call, on every device, so a
# model tested on CPU makes only calls a GPU accepts. On CUDA devices that have the kernel
# the call goes to ``torch._scaled_grouped_mm``; everywhere else to
# ``f8tensor::scaled_grouped_mm_reference``, an exact emulation (products of the FP8 values
# accumulated in fp32, then the two dequantization factors, then one rounding to
# ``out_dtype``: the kernel's epilogue order). It is a custom op, opaque to torch.compile,
# so token counts that change every step do not recompile anything.
#
# On sm89 builds (in SUPPORTED_BUILDS) there is no grouped kernel: the reference op runs there.

#: The rules of ``torch._scaled_grouped_mm`` (torch 2.11-2.13), as read in PyTorch's sources:
#: ``_meta_grouped_mm_common`` in torch/_meta_registrations.py and ``_scaled_grouped_mm_cuda``
#: in aten/src/ATen/native/cuda/Blas.cpp (ScaledBlas.cpp from 2.9 on). Machine-readable so
#: that ``gemm.py``'s table can absorb them; :func:`check_grouped_rules` enforces them.
GROUPED_RULES: dict[str, object] = {
    # Blas.cpp: _scaled_mm_allowed_device(sm90_only=true, sm100_only=true); sm89 has no kernel.
    "compute_capability": ((9, 0), (10, 0)),
    # _meta_grouped_mm_common: "Expected inputs of E4M3 FP8 type" (fnuz on MI300).
    "operand_dtypes": (torch.float8_e4m3fn,),
    # Both scales float32 (float8_e8m0fnu is the MX form, not used here).
    "scale_dtype": torch.float32,
    # "If output dtype provided, it must be torch.bfloat16."
    "out_dtypes": (torch.bfloat16,),
    # a row-major, b column-major in their last two dims.
    "a_layout": "row-major",
    "b_layout": "column-major",
    # check_valid_strides: the leading stride of each operand a multiple of 16 bytes.
    "stride_bytes": 16,
    # offs: 1D int32, present exactly when one operand is 2D.
    "offs_dtype": torch.int32,
    # Groups that cut the contraction dim (2D x 2D): each group a multiple of 16 rows, the
    # leading-stride rule of every per-group sub-matrix. We pad groups to it (see moe.py).
    # Groups that cut M (2D x 3D) may have any size, 0 included.
    "contraction_group_multiple": 16,
    # bias and scale_result: not supported.
    "bias": None,
}


def grouped_kernel_available(device: torch.device) -> bool:
    """Whether ``torch._scaled_grouped_mm`` runs on ``device`` (CUDA sm90 / sm100)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) in GROUPED_RULES["compute_capability"]


def _row_major(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.stride(-2) >= max(1, t.shape[-1])


def _col_major(t: torch.Tensor) -> bool:
    return t.stride(-2) == 1 and t.stride(-1) >= max(1, t.shape[-2])


def check_grouped_rules(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offs: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> None:
    """Raise ``ValueError`` naming the rule a call to ``torch._scaled_grouped_mm`` would break."""
    allowed = GROUPED_RULES["operand_dtypes"]
    if a.dtype not in allowed or b.dtype not in allowed:
        raise ValueError(
            f"FP8 grouped GEMM: torch._scaled_grouped_mm takes only {allowed} operands; got {a.dtype} x {b.dtype}"
        )
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
        raise ValueError(f"FP8 grouped GEMM: scales must be float32; got {scale_a.dtype} and {scale_b.dtype}")
    if out_dtype not in GROUPED_RULES["out_dtypes"]:
        raise ValueError(f"FP8 grouped GEMM: the output dtype must be one of {GROUPED_RULES['out_dtypes']}; got {out_dtype}")
    if a.dim() not in (2, 3) or b.dim() not in (2, 3):
        raise ValueError(f"FP8 grouped GEMM: operands must be 2D or 3D; got {a.dim()}D and {b.dim()}D")
    if not _row_major(a) or not _col_major(b):
        raise ValueError(
            f"FP8 grouped GEMM: a must be row-major and b column-major in their last two dims; got strides "
            f"{a.stride()} for {tuple(a.shape)} and {b.stride()} for {tuple(b.shape)}"
        )
    for name, t, lead in (("a", a, a.stride(-2)), ("b", b, b.stride(-1))):
        if lead % GROUPED_RULES["stride_bytes"]:
            raise ValueError(
                f"FP8 grouped GEMM: the leading stride of {name} must be a multiple of 16 bytes; got {lead} "
                f"for shape {tuple(t.shape)} (pad the contraction dim to a multiple of 16)"
            )
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"FP8 grouped GEMM: contraction dims differ: {tuple(a.shape)} x {tuple(b.shape)}")
    two_d = a.dim() == 2 or b.dim() == 2
    if two_d != (offs is not None):
        raise ValueError("FP8 grouped GEMM: offs is needed exactly when an operand is 2D")
    if offs is not None and (offs.dim() != 1 or offs.dtype != torch.int32):
        raise ValueError(f"FP8 grouped GEMM: offs must be a 1D int32 tensor; got {offs.dim()}D {offs.dtype}")
    expected = _scale_shapes(a, b, offs)
    if (tuple(scale_a.shape), tuple(scale_b.shape)) != expected:
        raise ValueError(
            f"FP8 grouped GEMM: scales for {tuple(a.shape)} x {tuple(b.shape)} must have shapes {expected}; "
            f"got {tuple(scale_a.shape)} and {tuple(scale_b.shape)}"
        )
    if not (scale_a.is_contiguous() and scale_b.is_contiguous()):
        raise ValueError("FP8 grouped GEMM: scales must be contiguous")


def _scale_shapes(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> tuple[tuple, tuple]:
    if a.dim() == 2 and b.dim() == 3:
        return (a.shape[0],), (b.shape[0], b.shape[2])
    if a.dim() == 2 and b.dim() == 2:
        g = offs.shape[0]
        return (g * a.shape[0],), (g * b.shape[1],)
    if a.dim() == 3 and b.dim() == 3:
        return (a.shape[0], a.shape[1]), (b.shape[0], b.shape[2])
    raise ValueError(f"FP8 grouped GEMM: the form {a.dim()}D x {b.dim()}D is not used by f8tensor")


def scaled_grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The grouped FP8 product (see the module docstring), rules checked, routed by device."""
    check_grouped_rules(a, b, scale_a, scale_b, offs, out_dtype)
    if grouped_kernel_available(a.device):
        return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=out_dtype)
    return torch.ops.f8tensor.scaled_grouped_mm_reference(a, b, scale_a, scale_b, offs, out_dtype)


@torch.library.custom_op("f8tensor::scaled_grouped_mm_reference", mutates_args=())
def _reference(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offs: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    # Deliberate upcast: every FP8 value is exact in fp32, and so is every product of two;
    # the fp32 sums are what the tensor cores accumulate.
    af, bf = a.float(), b.float()
    if offs is None:
        acc = torch.bmm(af, bf) * scale_a[:, :, None] * scale_b[:, None, :]
        return acc.to(out_dtype)
    g = offs.shape[0]
    if b.dim() == 3:
        acc = _grouped(af, bf, offs)  # (M, N)
        rows = torch.arange(a.shape[0], device=a.device)
        gid = torch.searchsorted(offs, rows.to(offs.dtype), right=True)
        inside = gid < g  # rows past offs[-1] belong to no group: the kernel leaves them, we zero them
        sb = scale_b[gid.clamp(max=g - 1)]
        acc = torch.where(inside[:, None], acc * scale_a[:, None] * sb, 0.0)
        return acc.to(out_dtype)
    acc = _grouped(af, bf, offs)  # (G, K, N)
    acc = acc * scale_a.view(g, -1, 1) * scale_b.view(g, 1, -1)
    return acc.to(out_dtype)


def _grouped(af: torch.Tensor, bf: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """fp32 grouped product: torch._grouped_mm where the device has an fp32 kernel, else a loop."""
    if af.device.type == "cpu":
        out = torch._grouped_mm(af, bf, offs=offs)
        if bf.dim() == 2:
            # Groups with no rows contribute nothing: make that explicit (never stale memory).
            sizes = torch.diff(offs, prepend=offs.new_zeros(1))
            out = torch.where((sizes > 0)[:, None, None], out, 0.0)
        return out
    start = 0
    if bf.dim() == 3:
        out = af.new_zeros(af.shape[0], bf.shape[2])
        for i, end in enumerate(offs.tolist()):
            out[start:end] = af[start:end] @ bf[i]
            start = end
        return out
    out = af.new_zeros(offs.shape[0], af.shape[0], bf.shape[1])
    for i, end in enumerate(offs.tolist()):
        out[i] = af[:, start:end] @ bf[start:end]
        start = end
    return out


@_reference.register_fake
def _reference_fake(a, b, scale_a, scale_b, offs, out_dtype):
    if offs is None:
        return a.new_empty(a.shape[0], a.shape[1], b.shape[2], dtype=out_dtype)
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[2], dtype=out_dtype)
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1], dtype=out_dtype)
