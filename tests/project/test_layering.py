"""The package's layers: the import-linter contracts of pyproject.toml hold, and no module
dodges them with an import inside a function.

The layers (top to bottom) and why they are ordered so: docs/how_it_works.rst.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "f8tensor"

pytest.importorskip("importlinter.cli", reason="import-linter is in the [test] extra")


def test_import_linter_contracts_are_kept():
    # In a subprocess: import-linter configures logging process-wide (dictConfig), which
    # would disable the loggers other tests read through caplog.
    code = (
        "import sys; from importlinter.cli import lint_imports; "
        f"sys.exit(lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}, no_cache=True))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    assert "0 broken" in report and "4 kept" in report, report


def _deferred_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import inside a function or class body."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Import):
                    found += [(inner.lineno, alias.name) for alias in inner.names]
                elif isinstance(inner, ast.ImportFrom):
                    found.append((inner.lineno, "." * inner.level + (inner.module or "")))
    return found


# Optional third-party packages, imported where they are used so that `import f8tensor`
# (and each integration) needs torch alone. (triton: the fused casts, kernels/triton_cast.py.)
OPTIONAL = ("matplotlib", "safetensors", "triton")


def test_no_deferred_imports_of_the_package():
    """An import inside a function hides an arrow from the layers (and a cycle from a
    reader): only optional third-party packages may be imported there."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, module in _deferred_imports(path):
            if module.startswith((".", "f8tensor", "torch")) or not module.startswith(OPTIONAL):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {module}")
    assert bad == [], "imports inside functions:\n" + "\n".join(bad)
