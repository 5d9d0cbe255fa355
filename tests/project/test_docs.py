"""The API reference covers the public API, and every public name has a docstring.

The reference itself (``sphinx-build -W -b html docs docs/_build/html``) is built in CI,
which installs Sphinx; these checks need nothing beyond the package.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import f8tensor
from f8tensor import gemm

ROOT = Path(__file__).resolve().parents[2]
PAGES = "\n".join(page.read_text(encoding="utf-8") for page in sorted((ROOT / "docs").glob("*.rst")))
# The names the pages document: ``.. autoclass:: Name``, ``.. py:data:: Name``, ...
DOCUMENTED = set(re.findall(r"^\.\. (?:auto\w+|py:\w+):: (?:f8tensor\.)?([\w.]+)", PAGES, flags=re.MULTILINE))

CALLABLES = [name for name in f8tensor.__all__ if callable(getattr(f8tensor, name))]


@pytest.mark.parametrize("name", f8tensor.__all__)
def test_public_name_in_reference(name: str):
    assert name in DOCUMENTED, f"f8tensor.{name} is on no page of docs/ (add it where a user would look)"


@pytest.mark.parametrize("name", CALLABLES)
def test_public_name_has_docstring(name: str):
    doc = inspect.getdoc(getattr(f8tensor, name))
    assert doc and len(doc) > 20, f"f8tensor.{name} needs a docstring: what it takes, returns and refuses"


def test_integrations_in_reference():
    for module in ("hf", "lightning", "torchtitan"):
        assert f"integrations.{module}" in DOCUMENTED


def test_gemm_entry_points_documented():
    for name in ("rules_check", "install_rules_check", "CudaRuleViolation", "use_precise_rowwise_route"):
        assert name in DOCUMENTED and inspect.getdoc(getattr(gemm, name))


def test_moe_and_version_names_documented():
    from f8tensor import compat, moe

    for name in moe.__all__:
        assert name in DOCUMENTED or f"moe.{name}" in DOCUMENTED, f"f8tensor.moe.{name} is on no page of docs/"
    for name in ("validate_grouped_mm_args", "check_grouped_dims"):
        assert f"gemm.grouped.{name}" in DOCUMENTED
    for name in ("TORCH_VERSION", "HAS_CPU_ROWWISE_SCALED_MM", "HAS_CPU_SCALED_MM_V2", "assert_async"):
        assert f"compat.{name}" in DOCUMENTED, f"f8tensor.compat.{name} is on no page of docs/"
    assert "Raises" in (inspect.getdoc(compat.assert_async) or "")


def _public_modules() -> set[str]:
    """The modules that define a class or function of ``f8tensor.__all__`` (plus the package)."""
    found = {"f8tensor"}
    for name in f8tensor.__all__:
        obj = getattr(f8tensor, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            found.add(obj.__module__)
    return found


def test_public_modules_are_strictly_typed_and_doctested():
    # A module that starts defining a public name (a merge, a new feature) joins the
    # modules mypy checks with disallow_untyped_defs and those whose examples run.
    tomllib = pytest.importorskip("tomllib")
    from tests.project.test_doctests import PUBLIC_MODULES

    overrides = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["mypy"]["overrides"]
    strict = {m for o in overrides if o.get("disallow_untyped_defs") for m in o["module"]}
    public = _public_modules()
    assert public <= strict, f"add to disallow_untyped_defs in pyproject.toml: {sorted(public - strict)}"
    assert public <= set(PUBLIC_MODULES), (
        f"add to PUBLIC_MODULES in tests/project/test_doctests.py: {sorted(public - set(PUBLIC_MODULES))}"
    )
