"""The CUDA-rules check: the checkers of the three kinds of FP8 GEMM, and the check mode.

The checkers (from ``violations``) list what a build of the ``rules`` would refuse in one
call (``[]``: legal). The check mode records or raises at each such call; it is switched on
explicitly (:func:`install_rules_check`, :func:`rules_check`, or :data:`RULES_CHECK_ENV`
read at the first FP8 product). gemm calls :func:`scaled_mm` and :func:`block_scaled_mm`,
which check when it is on: traced, the checked calls are ``allow_in_graph`` and the mode is
read once per trace (:func:`check_active`), so checking adds no graph break.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch

from f8tensor import compat

# By name on the traced path: dynamo guards a module reached two ways.
from f8tensor.compat import scaled_mm as compat_scaled_mm
from f8tensor.gemm.rules import (
    BLOCK_SCALED_MM_RULES,
    block_rule_by_recipes,
)
from f8tensor.gemm.violations import (
    _scaling_kind,
    block_scaled_mm_violations,
    check_grouped_rules,
    grouped_mm_violations,
    is_col_major,
    is_row_major,
    scaled_mm_violations,
    violations_on_supported_builds,
)

__all__ = [
    "RULES_CHECK_ENV",
    "CudaRuleViolation",
    "block_scaled_mm",
    "block_scaled_mm_violations",
    "check_active",
    "check_grouped_rules",
    "checked_functional_scaled_mm",
    "checked_scaled_mm",
    "functional_scaled_mm",
    "grouped_mm_violations",
    "install_from_env",
    "install_rules_check",
    "is_col_major",
    "is_row_major",
    "record_block_reference",
    "record_block_refusal",
    "rules_check",
    "rules_check_installed",
    "scaled_mm",
    "scaled_mm_violations",
    "uninstall_rules_check",
    "violations_on_supported_builds",
]


class CudaRuleViolation(AssertionError):
    """A ``torch._scaled_mm`` call that a supported NVIDIA build would refuse."""


class _RulesCheck:
    """The check mode's state: on or off, the wrapped torch functions, what it recorded."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = False
        self.env_read = False
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


@torch.compiler.assume_constant_result
def check_active() -> bool:
    """Whether the check mode is on (the first call reads :data:`RULES_CHECK_ENV`); constant per trace."""
    if not _CHECK.env_read:
        install_from_env()
    return _CHECK.active


def _summary(mat1, mat2, scale_a, scale_b, bias, out_dtype, use_fast_accum) -> dict[str, Any]:
    return {
        "kind": _scaling_kind(mat1, mat2, scale_a, scale_b),
        "mat1": mat1.dtype,
        "mat2": mat2.dtype,
        # (M, K, N); operands that are not matrices (refused by the product) as they are.
        "shape": (
            (mat1.shape[0], mat1.shape[1], mat2.shape[1])
            if mat1.dim() == 2 and mat2.dim() == 2
            else (tuple(mat1.shape), tuple(mat2.shape))
        ),
        "out_dtype": out_dtype if out_dtype is not None else mat1.dtype,
        "bias": None if bias is None else bias.dtype,
        "use_fast_accum": use_fast_accum,
    }


@torch.compiler.allow_in_graph
def checked_scaled_mm(
    mat1, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False, **kwargs
):
    """``torch._scaled_mm``, after checking the call against every supported build.

    ``kwargs`` pass through (inductor's CPU extern-kernel call adds ``out=``).
    """
    problems = violations_on_supported_builds(
        mat1, mat2, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum
    )
    _CHECK.record("torch._scaled_mm", _summary(mat1, mat2, scale_a, scale_b, bias, out_dtype, use_fast_accum), problems)
    kwargs.update(bias=bias, scale_result=scale_result, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    return compat.scaled_mm(mat1, mat2, scale_a, scale_b, **kwargs)


# Inductor's generated code calls ``extern_kernels._scaled_mm`` by the captured function's
# ``__name__``: the wrapper must answer to torch's name.
checked_scaled_mm.__name__ = "_scaled_mm"


@torch.compiler.allow_in_graph
def checked_functional_scaled_mm(mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, *args, **kwargs):
    """``torch.nn.functional.scaled_mm``, checked against its recipes' table row (none: a violation)."""
    recipes = {str(getattr(r, "name", r)).lower() for r in (scale_recipe_a, scale_recipe_b)}
    single = not isinstance(scale_a, (list, tuple)) and not isinstance(scale_b, (list, tuple))
    block_rule = block_rule_by_recipes(scale_recipe_a, scale_recipe_b, mat_a.dtype) if single else None
    if block_rule is not None:
        # gemm refuses builds without the kernel up front: check against the row's layouts only.
        fast = kwargs.get("use_fast_accum", args[5] if len(args) > 5 else False)
        problems = block_scaled_mm_violations(mat_a, mat_b, scale_a, scale_b, block_rule, use_fast_accum=fast)
        summary = {"kind": block_rule.name, "mat1": mat_a.dtype, "mat2": mat_b.dtype}
    elif single and len(recipes) == 1 and recipes <= {"tensorwise", "rowwise"}:
        bias = kwargs.get("bias", args[2] if len(args) > 2 else None)
        out_dtype = kwargs.get("output_dtype", args[3] if len(args) > 3 else torch.bfloat16)
        fast = kwargs.get("use_fast_accum", args[5] if len(args) > 5 else False)
        problems = violations_on_supported_builds(mat_a, mat_b, scale_a, scale_b, bias, None, out_dtype, fast)
        summary = _summary(mat_a, mat_b, scale_a, scale_b, bias, out_dtype, fast)
    else:
        problems = [f"no rules row for scale recipes {sorted(recipes)}: add one to f8tensor.gemm.rules"]
        summary = {"kind": "unknown", "recipes": sorted(recipes)}
    _CHECK.record("torch.nn.functional.scaled_mm", summary, problems)
    return functional_scaled_mm(mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, *args, **kwargs)


@torch.compiler.allow_in_graph
def record_block_reference(rule_name: str, mat_a, mat_b, scale_a, scale_b, use_fast_accum: bool = False) -> None:
    """Check the ``F.scaled_mm`` call the CUDA branch would make for a reference-path product.

    The operands are CPU or fake tensors; compile-time rules of a CUDA trace are enforced in ``blocks.py``.
    """
    rule = next(r for r in BLOCK_SCALED_MM_RULES if r.name == rule_name)
    problems = block_scaled_mm_violations(mat_a, mat_b, scale_a, scale_b, rule, use_fast_accum=use_fast_accum)
    summary = {"kind": rule.name, "mat1": mat_a.dtype, "mat2": mat_b.dtype, "reference": True}
    _CHECK.record("torch.nn.functional.scaled_mm (reference path)", summary, problems)


@torch.compiler.allow_in_graph
def record_block_refusal(reason: str) -> None:
    """Record a reference-path block-scaled product that no kernel takes (CUDA would raise)."""
    _CHECK.record("torch.nn.functional.scaled_mm (reference path)", {"kind": "no kernel", "reference": True}, [reason])


def scaled_mm(mat1, mat2, scale_a, scale_b, *, bias=None, out_dtype=None, use_fast_accum=False) -> torch.Tensor:
    """``torch._scaled_mm`` through ``compat``, checked first when the check mode is on."""
    if check_active():
        return checked_scaled_mm(
            mat1, mat2, scale_a, scale_b, bias=bias, out_dtype=out_dtype, use_fast_accum=use_fast_accum
        )
    return compat_scaled_mm(
        mat1, mat2, scale_a, scale_b, bias=bias, out_dtype=out_dtype, scale_result=None, use_fast_accum=use_fast_accum
    )


def block_scaled_mm(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, **kwargs: Any) -> torch.Tensor:
    """:func:`functional_scaled_mm`, checked first when the check mode is on."""
    if check_active():
        return checked_functional_scaled_mm(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, **kwargs)
    return functional_scaled_mm(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, **kwargs)


#: The op's ints of ``F.ScalingType`` and ``F.SwizzleType`` names.
_SCALED_MM_CODES: dict[str, int] = {
    name: int(member.value)
    for kind in (torch.nn.functional.ScalingType, torch.nn.functional.SwizzleType)
    for name, member in kind.__members__.items()
}


def _codes(values: Any) -> list[int]:
    """Recipes or swizzles (members, names, lists, None): ints."""
    values = values if isinstance(values, (list, tuple)) else [] if values is None else [values]
    return [_SCALED_MM_CODES[getattr(v, "name", v)] for v in values]


def functional_scaled_mm(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    scale_a: torch.Tensor | list[torch.Tensor],
    scale_recipe_a: Any,
    scale_b: torch.Tensor | list[torch.Tensor],
    scale_recipe_b: Any,
    swizzle_a: Any = None,
    swizzle_b: Any = None,
    bias: torch.Tensor | None = None,
    output_dtype: torch.dtype | None = torch.bfloat16,
    contraction_dim: tuple[int, ...] | list[int] = (),
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """``torch.nn.functional.scaled_mm`` by its op, recipes and swizzles also by name: traced, no
    enum is read (2.12's dynamo breaks the graph at one, 2.11's at ``F.scaled_mm``)."""
    scales_a, scales_b = ([s] if isinstance(s, torch.Tensor) else list(s) for s in (scale_a, scale_b))
    a_args = scales_a, _codes(scale_recipe_a), _codes(swizzle_a)
    b_args = scales_b, _codes(scale_recipe_b), _codes(swizzle_b)
    return torch.ops.aten._scaled_mm_v2.default(
        mat_a, mat_b, *a_args, *b_args, bias, output_dtype, list(contraction_dim), use_fast_accum
    )


def install_rules_check(*, raise_on_violation: bool = True) -> _RulesCheck:
    """Switch the check mode on (idempotent; :func:`uninstall_rules_check` undoes it).

    Every FP8 GEMM f8tensor makes is checked and recorded (``.calls``, ``.violations``,
    ``.take()``), and ``torch._scaled_mm`` / ``F.scaled_mm`` are wrapped so direct calls are
    checked too.

    Args:
        raise_on_violation: raise :class:`CudaRuleViolation` at a violating call (else record only).
    Returns:
        The check mode's state.
    """
    _CHECK.raise_on_violation = raise_on_violation
    _CHECK.active = _CHECK.env_read = True
    if _CHECK.originals:
        return _CHECK
    _CHECK.originals["_scaled_mm"] = compat.set_scaled_mm(checked_scaled_mm)
    _CHECK.originals["F.scaled_mm"] = torch.nn.functional.scaled_mm
    torch.nn.functional.scaled_mm = checked_functional_scaled_mm
    return _CHECK


def uninstall_rules_check() -> None:
    """Switch the check mode off and put the original torch functions back."""
    _CHECK.active = False
    _CHECK.env_read = True
    if "_scaled_mm" in _CHECK.originals:
        compat.set_scaled_mm(_CHECK.originals.pop("_scaled_mm"))
    if "F.scaled_mm" in _CHECK.originals:
        torch.nn.functional.scaled_mm = _CHECK.originals.pop("F.scaled_mm")


def rules_check_installed() -> _RulesCheck | None:
    """The check mode's state (its counters and records) when it is on, else None."""
    return _CHECK if _CHECK.active else None


@contextlib.contextmanager
def rules_check(*, raise_on_violation: bool = True) -> Iterator[_RulesCheck]:
    """The check mode for a block of code; the state before is restored after.

    Example:
        >>> from f8tensor import Float8Tensor, float8_mm, gemm
        >>> a = Float8Tensor.from_hp(torch.randn(16, 32, dtype=torch.bfloat16))
        >>> b = Float8Tensor.from_hp(torch.randn(64, 32, dtype=torch.bfloat16)).t()
        >>> with gemm.rules_check(raise_on_violation=False) as check:
        ...     _ = float8_mm(a, b)
        >>> check.take()  # what a supported CUDA build would refuse: nothing
        []
    """
    was_on, was_raising = _CHECK.active, _CHECK.raise_on_violation
    check = install_rules_check(raise_on_violation=raise_on_violation)
    try:
        yield check
    finally:
        if was_on:
            _CHECK.raise_on_violation = was_raising
        else:
            uninstall_rules_check()


#: The environment switch: "1"/"raise" raises at a violation, "record" records, "0"/unset is off.
RULES_CHECK_ENV = "F8TENSOR_CHECK_CUDA_RULES"


def install_from_env() -> None:
    """Switch the check mode on if :data:`RULES_CHECK_ENV` asks for it (f8tensor's products only).

    An explicit install or uninstall before the first FP8 product wins over the variable.

    Raises:
        ValueError: the variable is not one of 1/on/true/yes/raise, record, 0/off/false/no/empty.
    """
    _CHECK.env_read = True
    mode = os.environ.get(RULES_CHECK_ENV, "").strip().lower()
    if mode in ("", "0", "off", "false", "no"):
        return
    if mode not in ("1", "on", "true", "yes", "raise", "record"):
        raise ValueError(f"{RULES_CHECK_ENV}={mode!r}: use 1 (check and raise), record (check and record) or 0 (off)")
    _CHECK.raise_on_violation = mode != "record"
    _CHECK.active = True
