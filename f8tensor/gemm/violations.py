"""The checkers of the three kinds of FP8 GEMM: what a build's rule rows would refuse in a call.

Each returns a list of messages (``[]``: legal). Plain functions of their arguments; the
check mode that calls them on every product is ``check``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from f8tensor import compat
from f8tensor.gemm.rules import (
    GROUPED_RULES,
    ROCM_BUILDS,
    SCALED_MM_RULES,
    SUPPORTED_BUILDS,
    BlockScaledMMRule,
    CudaBuild,
    GroupedMMRule,
    rule_for,
)
from f8tensor.quant.formats import FLOAT8_DTYPES

__all__ = [
    "block_scaled_mm_violations",
    "check_grouped_rules",
    "grouped_mm_violations",
    "is_col_major",
    "is_row_major",
    "scaled_mm_violations",
    "violations_on_supported_builds",
]

_FNUZ = (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def _name(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.")


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(sorted(_name(d) for d in dtypes)) or "none"


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# layouts


def is_row_major(t: torch.Tensor) -> bool:
    """The last two dims stored row-major (unit stride along the last; empty counts as any)."""
    rows, cols = t.shape[-2], t.shape[-1]
    return rows == 0 or cols == 0 or (t.stride(-1) == 1 and t.stride(-2) >= max(cols, 1))


def is_col_major(t: torch.Tensor) -> bool:
    """The last two dims stored column-major (unit stride along the first of them)."""
    rows, cols = t.shape[-2], t.shape[-1]
    return rows == 0 or cols == 0 or (t.stride(-2) == 1 and t.stride(-1) >= max(rows, 1))


def _scale_and_layout_violations(
    where: str, first: tuple, second: tuple, scale_a, scale_b, scale_dtype: torch.dtype, contiguous_scales: bool = False
) -> list[str]:
    """The checks every FP8 GEMM kernel makes: the scales' dtype (and contiguity), the
    first operand row-major and the second column-major. ``first``/``second``: (name, tensor)."""
    out = []
    for label, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if s.dtype != scale_dtype:
            out.append(f"{where}: {label} dtype {_name(s.dtype)}, needs {_name(scale_dtype)}")
        if contiguous_scales and not s.is_contiguous():
            out.append(f"{where}: {label} must be contiguous; got stride {s.stride()}")
    for (name, t), layout, ok in ((first, "row-major", is_row_major), (second, "column-major", is_col_major)):
        if not ok(t):
            out.append(f"{where}: {name} must be {layout}; got shape {tuple(t.shape)} stride {t.stride()}")
    return out


# torch._scaled_mm


def _scaling_kind(mat1: torch.Tensor, mat2: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> str:
    """How torch._scaled_mm reads the scales (its own order: tensorwise first, then rowwise)."""
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        return "tensorwise"
    m, n = mat1.shape[0], mat2.shape[1]
    if scale_a.dim() == 2 and scale_b.dim() == 2 and tuple(scale_a.shape) == (m, 1) and tuple(scale_b.shape) == (1, n):
        return "rowwise"
    return "unknown"


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
    out += _scale_and_layout_violations(
        where, ("mat1", mat1), ("mat2", mat2), scale_a, scale_b, rule.scale_dtype, rule.scales_contiguous
    )
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
    """:func:`scaled_mm_violations` on every supported build, each message once with its builds.

    fnuz products are checked against :data:`ROCM_BUILDS`, others against :data:`SUPPORTED_BUILDS`.
    """
    builds = ROCM_BUILDS if mat1.dtype in _FNUZ or mat2.dtype in _FNUZ else SUPPORTED_BUILDS
    found: dict[str, list[CudaBuild]] = {}
    for representative, members in _build_groups(builds):
        for message in scaled_mm_violations(mat1, mat2, *args, build=representative, **kwargs):
            found.setdefault(message, []).extend(members)
    return [f"{msg} [refused on {len(b)} of {len(builds)} builds, e.g. {b[0].name}]" for msg, b in found.items()]


# block-scaled F.scaled_mm


def block_scaled_mm_violations(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    rule: BlockScaledMMRule,
    *,
    use_fast_accum: bool = False,
    traced: bool | None = None,
) -> list[str]:
    """What ``rule``'s kernel would refuse in this ``torch.nn.functional.scaled_mm`` call.

    ``traced``: traced by torch.compile on CUDA, so the row's ``compile_align`` applies too;
    None: traced when the operands are fake CUDA tensors.
    """
    out = []
    where = f"block-scaled {rule.name}"
    for label, t in (("mat_a", mat_a), ("mat_b", mat_b)):
        if t.dtype not in rule.operand_dtypes:
            out.append(f"{where}: {label} dtype {_name(t.dtype)} not in {{{_names(rule.operand_dtypes)}}}")
    out += _scale_and_layout_violations(where, ("mat_a", mat_a), ("mat_b", mat_b), scale_a, scale_b, rule.scale_dtype)
    m, k = mat_a.shape[0], mat_a.shape[1] * rule.k_per_element
    n = mat_b.shape[1]
    sizes = {"M": m, "K": k, "N": n}
    for dim, align in (("M", rule.align_m), ("K", rule.align_k), ("N", rule.align_n)):
        if sizes[dim] % align:
            out.append(f"{where}: {dim}={sizes[dim]} is not a multiple of {align} (mat_a (M, K), mat_b (K, N))")
    if use_fast_accum and not rule.fast_accum:
        out.append(f"{where}: use_fast_accum is not supported")
    if traced is None:
        traced = compat.is_fake(mat_a) and mat_a.device.type == "cuda"
    if traced and rule.compile_torch:
        releases = ", ".join(f"{t[0]}.{t[1]}" for t in rule.compile_torch)
        for dim, multiple in rule.compile_align:
            if sizes[dim] % multiple:
                out.append(
                    f"{where}: {dim}={sizes[dim]} is not a multiple of {multiple}, which torch.compile on "
                    f"torch {releases} asks for (the meta registration floor-divides by {multiple})"
                )
    if rule.recipe_a in ("BlockWise1x32", "BlockWise1x16"):
        kb = _round_up(-(-k // rule.block_a[1]), 4)
        want = (_round_up(m, 128) * kb, _round_up(n, 128) * kb)
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
    want_b = (
        ((n, kb), (1, n)) if rule.block_b == (128, 1) else ((_round_up(kb, 4), -(-n // 128)), (1, _round_up(kb, 4)))
    )
    for label, t, (shape, stride) in (("scale_a", scale_a, want_a), ("scale_b", scale_b, want_b)):
        if tuple(t.shape) != shape:
            out.append(f"{where}: {label} shape {tuple(t.shape)}, needs {shape}")
        elif t.stride(0) != 1 or (shape[1] > 1 and t.stride(1) != stride[1]):
            out.append(f"{where}: {label} strides {t.stride()}, needs {stride}")
    return out


# torch._scaled_grouped_mm


@compat.constant_per_config
def _rule_fields(rule: GroupedMMRule) -> tuple:
    """``rule``'s checked fields: traced, one constant."""
    return (
        tuple(sorted(rule.operand_dtypes, key=str)),
        rule.scale_dtype,
        tuple(sorted(rule.out_dtypes, key=str)),
        rule.stride_bytes,
        rule.align,
        rule.offs_dtype,
        rule.max_groups,
    )


def grouped_mm_violations(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offs: torch.Tensor | None,
    out_dtype: torch.dtype,
    rule: GroupedMMRule = GROUPED_RULES[0],
) -> list[str]:
    """What ``rule``'s kernel would refuse in this ``torch._scaled_grouped_mm`` call."""
    out = []
    operand_dtypes, scale_dtype, out_dtypes, stride_bytes, align, offs_dtype, max_groups = _rule_fields(rule)
    if a.dtype not in operand_dtypes or b.dtype not in operand_dtypes:
        out.append(f"torch._scaled_grouped_mm takes only {operand_dtypes} operands; got {a.dtype} x {b.dtype}")
    if scale_a.dtype != scale_dtype or scale_b.dtype != scale_dtype:
        out.append(f"scales must be {_name(scale_dtype)}; got {scale_a.dtype} and {scale_b.dtype}")
    if out_dtype not in out_dtypes:
        out.append(f"the output dtype must be one of {out_dtypes}; got {out_dtype}")
    if a.dim() not in (2, 3) or b.dim() not in (2, 3):
        return out + [f"operands must be 2D or 3D; got {a.dim()}D and {b.dim()}D"]
    if not is_row_major(a) or not is_col_major(b):
        out.append(
            f"a must be {rule.a_layout} and b {rule.b_layout} in their last two dims; got strides "
            f"{a.stride()} for {tuple(a.shape)} and {b.stride()} for {tuple(b.shape)}"
        )
    for name, t, lead in (("a", a, a.stride(-2)), ("b", b, b.stride(-1))):
        if lead % stride_bytes:
            out.append(
                f"the leading stride of {name} must be a multiple of {stride_bytes} bytes; got {lead} "
                f"for shape {tuple(t.shape)} (pad the contraction dim to a multiple of 16)"
            )
    if a.shape[-1] != b.shape[-2]:
        out.append(f"contraction dims differ: {tuple(a.shape)} x {tuple(b.shape)}")
    for what, size in (("K (a.size(-1))", a.shape[-1]), ("b.size(-2)", b.shape[-2]), ("N (b.size(-1))", b.shape[-1])):
        if size % align:
            out.append(f"{what}={size} is not a multiple of {align}")
    two_d = a.dim() == 2 or b.dim() == 2
    if two_d != (offs is not None):
        return out + ["offs is needed exactly when an operand is 2D"]
    if offs is not None and (offs.dim() != 1 or offs.dtype != offs_dtype):
        out.append(f"offs must be a 1D {_name(offs_dtype)} tensor; got {offs.dim()}D {offs.dtype}")
    if a.dim() == 3 and b.dim() == 2:
        return out + [f"the form {a.dim()}D x {b.dim()}D is not used by f8tensor"]
    groups = offs.shape[0] if offs is not None and offs.dim() == 1 else (b.shape[0] if b.dim() == 3 else a.shape[0])
    if groups > max_groups:
        out.append(f"{groups} groups: one call takes at most {max_groups}")
    if offs is not None and offs.dim() == 1:
        out += _offs_value_violations(offs, a.shape[0] if b.dim() == 3 else a.shape[-1])
    expected = _grouped_scale_shapes(a, b, offs)
    if (tuple(scale_a.shape), tuple(scale_b.shape)) != expected:
        out.append(
            f"scales for {tuple(a.shape)} x {tuple(b.shape)} must have shapes {expected}; "
            f"got {tuple(scale_a.shape)} and {tuple(scale_b.shape)}"
        )
    if not (scale_a.is_contiguous() and scale_b.is_contiguous()):
        out.append("scales must be contiguous")
    return out


def _offs_value_violations(offs: torch.Tensor, grouped: int) -> list[str]:
    """The kernel's device asserts on ``offs``, checked where the values are on the host."""
    if (
        torch.compiler.is_compiling()
        or offs.device.type != "cpu"
        or type(offs) is not torch.Tensor
        or offs.numel() == 0
    ):
        return []
    o = offs.to(torch.int64)
    out = []
    if bool((o < 0).any()):
        out.append(f"offs must be >= 0; got {o.tolist()}")
    if bool((o[1:] < o[:-1]).any()):
        out.append(f"offs must be non-decreasing; got {o.tolist()}")
    if int(o.max()) > grouped:
        out.append(f"offs must be at most the grouped dim {grouped}; got {o.tolist()}")
    return out


def _grouped_scale_shapes(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> tuple[tuple, tuple]:
    if a.dim() == 2 and b.dim() == 3:
        return (a.shape[0],), (b.shape[0], b.shape[2])
    if a.dim() == 2 and b.dim() == 2:
        assert offs is not None  # grouped_mm_violations returned earlier without offs
        g = offs.shape[0]
        return (g * a.shape[0],), (g * b.shape[1],)
    return (a.shape[0], a.shape[1]), (b.shape[0], b.shape[2])


def check_grouped_rules(a, b, scale_a, scale_b, offs, out_dtype) -> None:
    """Refuse a ``torch._scaled_grouped_mm`` call that breaks a rule, on every device.

    Raises:
        ValueError: every broken rule, in one message (see :func:`grouped_mm_violations`).
    """
    problems = grouped_mm_violations(a, b, scale_a, scale_b, offs, out_dtype)
    if problems:
        raise ValueError("FP8 grouped GEMM: " + "; ".join(problems))
