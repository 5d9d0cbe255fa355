"""No library module over 600 lines (rule tables and kernel sources included): a module that
outgrows 600 lines becomes a package, split by concern or by kernel family. At most 15
top-level modules and packages (besides ``__init__.py``): a new concern joins a package."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "f8tensor"
MAX_LINES = 600


def test_no_module_over_600_lines():
    sizes = {path.relative_to(PACKAGE.parent): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    assert len(sizes) > 60  # the package's modules were found
    over = sorted(f"{path}: {n} lines" for path, n in sizes.items() if n > MAX_LINES)
    assert not over, over


MAX_TOP_LEVEL = 15


def test_at_most_15_top_level_modules():
    top = sorted(
        p.name
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").exists())
    )
    assert 10 <= len(top) <= MAX_TOP_LEVEL, top
