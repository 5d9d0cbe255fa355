"""No library module over 600 lines (rule tables and kernel sources included): a module that
must grow is split by concern or by kernel family, as the layering contract's layers are."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "f8tensor"
MAX_LINES = 600


def test_no_module_over_600_lines():
    sizes = {path.relative_to(PACKAGE.parent): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    assert len(sizes) > 60  # the package's modules were found
    over = sorted(f"{path}: {n} lines" for path, n in sizes.items() if n > MAX_LINES)
    assert not over, over
