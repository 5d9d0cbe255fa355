"""Where the package casts: the raw casts are named only by the modules listed here.

Every FP8 cast of a linear's operands goes through ``quantizers.quantize`` (its Quantizers),
every cast kept as raw bytes and scales (optimizer moments, saved activations, the FSDP2 and
TP gathers, MoE's per-group casts, export) through ``block_quantizers.BlockQuantizer``; only
those two modules, the casts themselves (``kernels/``, the tensor classes' own casts) and
the product machinery below the quantizer layer (which cannot import it) name a raw cast.
A new ``kernels.cast(...)`` or ``to_float8(...)`` anywhere else fails here, as an import
that points up a layer fails ``test_layering.py``.

Names are resolved through each module's imports (``from typing import cast`` is not
``kernels.cast``); docstrings and comments are not code and do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import dotted_name

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "f8tensor"

#: The raw casts, fully qualified: FP8 and FP4 data and scales from a high-precision tensor
#: (and the raw way back), and the tensor-level casts that wrap them.
RAW_CASTS = frozenset(
    {
        "f8tensor.kernels.cast",
        "f8tensor.kernels.cast_for_gemm",
        "f8tensor.kernels.cast_with_stats",
        "f8tensor.kernels.dequantize",
        "f8tensor.kernels.block_scale",
        "f8tensor.kernels.reference.cast",
        "f8tensor.kernels.reference.cast_values",
        "f8tensor.kernels.reference.cast_with_stats",
        "f8tensor.kernels.reference.dequantize",
        "f8tensor.kernels.reference.block_scale",
        "f8tensor.kernels.fp4.cast_fp4",
        "f8tensor.kernels.fp4.dequantize_fp4",
        "f8tensor.tensor.float8.to_float8",
        "f8tensor.tensor.float8.to_float8_for_gemm",
        "f8tensor.tensor.float8.to_float8_with_stats",
        "f8tensor.tensor.float8.cast_to_float8",
        "f8tensor.tensor.float8.cast_to_float8_with_stats",
        "f8tensor.tensor.float8.Float8Tensor.from_hp",
        "f8tensor.Float8Tensor.from_hp",
        "f8tensor.tensor.fp4.to_float4",
        "f8tensor.tensor.fp4.to_float4_with_stats",
        "f8tensor.tensor.fp4.from_hp_fp4",
        "f8tensor.tensor.fp4.Float4Tensor.from_hp",
        "f8tensor.Float4Tensor.from_hp",
    }
)

#: The casts themselves: not checked.
CAST_MODULES = ("f8tensor/kernels/",)

#: module -> the raw casts it may name (exactly these), and why.
ALLOWED: dict[str, frozenset[str]] = {
    # The quantizer layer: the linear's roles and the one entry point of GEMM operand casts.
    "f8tensor/quant/quantizers.py": frozenset(
        {
            "f8tensor.kernels.cast_for_gemm",
            "f8tensor.tensor.float8.to_float8_with_stats",
            "f8tensor.tensor.fp4.to_float4",
            "f8tensor.tensor.fp4.to_float4_with_stats",
        }
    ),
    # The quantizer layer: the roles kept as raw bytes and scales.
    "f8tensor/quant/block_quantizers.py": frozenset(
        {"f8tensor.kernels.cast", "f8tensor.kernels.dequantize", "f8tensor.kernels.block_scale"}
    ),
    # The tensor classes: their own casts (from_hp, to_float8, ...) wrap the raw ones.
    "f8tensor/tensor/float8.py": frozenset(
        {
            "f8tensor.kernels.cast",
            "f8tensor.kernels.cast_for_gemm",
            "f8tensor.kernels.cast_with_stats",
            "f8tensor.kernels.dequantize",
        }
    ),
    "f8tensor/tensor/fp4.py": frozenset({"f8tensor.kernels.fp4.cast_fp4", "f8tensor.kernels.fp4.dequantize_fp4"}),
    # The package re-exports the casts that scripts name as f8tensor.tensor.cast_to_float8.
    "f8tensor/tensor/__init__.py": frozenset(
        {"f8tensor.tensor.float8.cast_to_float8", "f8tensor.tensor.float8.cast_to_float8_with_stats"}
    ),
    # Below the quantizer layer (they cannot import it): the products' own re-casts. An
    # FP8 output with the caller's scale (float8_mm); an operand re-cast in the block or
    # format its kernel takes; copy_ of a high-precision tensor into a Float8Tensor.
    "f8tensor/gemm/front.py": frozenset({"f8tensor.tensor.float8.to_float8"}),
    "f8tensor/gemm/operands.py": frozenset({"f8tensor.tensor.float8.to_float8", "f8tensor.tensor.fp4.to_float4"}),
    "f8tensor/tensor/ops.py": frozenset({"f8tensor.tensor.float8.to_float8"}),
}


def _package(path: Path) -> str:
    """The package a module file belongs to (for ``__init__.py``, its own)."""
    return ".".join(path.relative_to(ROOT).parent.parts)


def raw_casts_named(source: str, package: str) -> set[str]:
    """The raw casts (:data:`RAW_CASTS`) that a module of ``package`` with code ``source``
    names: imported by name, or reached as an attribute of an imported module or class."""
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # local name -> fully qualified name
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    bound[top] = top
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = package.split(".")
                anchor = here[: len(here) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                qualified = f"{base}.{alias.name}"
                bound[alias.asname or alias.name] = qualified
                if qualified in RAW_CASTS:
                    found.add(qualified)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load):
            parts = dotted_name(node)
            if parts is None or parts[0] not in bound:
                continue
            qualified = ".".join([bound[parts[0]], *parts[1:]])
            if qualified in RAW_CASTS:
                found.add(qualified)
    return found


def test_the_check_resolves_names_through_imports():
    source = (
        "from typing import cast\n"
        "import torch\n"
        "from f8tensor import kernels\n"
        "from f8tensor.kernels import dequantize as back\n"
        "import f8tensor.tensor.float8 as T\n"
        "from f8tensor.tensor.float8 import Float8Tensor, dequantize\n"
        "def f(x, spec):\n"
        "    cast(int, x); torch.cast = 1; dequantize(x)\n"
        "    kernels.cast(x, spec); back(x, x, (), None); T.to_float8(x, spec)\n"
        "    return Float8Tensor.from_hp(x)\n"
    )
    assert raw_casts_named(source, "f8tensor") == {
        "f8tensor.kernels.cast",
        "f8tensor.kernels.dequantize",
        "f8tensor.tensor.float8.to_float8",
        "f8tensor.tensor.float8.Float8Tensor.from_hp",
    }
    assert raw_casts_named("from .kernels import cast\n", "f8tensor.moe") == set()
    assert raw_casts_named("from ..kernels import cast\n", "f8tensor.moe") == {"f8tensor.kernels.cast"}


def test_raw_casts_are_named_only_where_allowed():
    named = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(CAST_MODULES):
            continue
        found = raw_casts_named(path.read_text(), _package(path))
        if found:
            named[rel] = found
    unexpected = {
        m: sorted(f - ALLOWED.get(m, frozenset())) for m, f in named.items() if f - ALLOWED.get(m, frozenset())
    }
    assert not unexpected, (
        "raw casts outside the quantizer layer (cast through quantizers.quantize or a "
        f"block_quantizers.BlockQuantizer): {unexpected}"
    )
    # The list is kept exact: a module that stopped casting leaves it.
    stale = {m: sorted(a - named.get(m, set())) for m, a in ALLOWED.items() if a - named.get(m, set())}
    assert not stale, f"ALLOWED names raw casts these modules no longer make: {stale}"
