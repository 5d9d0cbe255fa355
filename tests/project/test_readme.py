"""The Python code blocks of README.md and of the docs pages run as written.

Every fenced ``python`` block of README.md, and every ``.. code-block:: python`` of
``docs/*.rst``, is one test: it runs in a fresh interpreter, as a reader who pastes it
would run it. A block that cannot run alone (it needs a model, a process group or a
logger the page does not build) is marked by a comment just before it, which renders as
nothing: in the markdown an HTML comment on the line before its fence::

    <!-- skip: needs a process group (tutorials/06_fsdp2_float8.py runs this) -->
    ```python

and in a docs page an rst comment, followed by a blank line::

    .. skip: needs a process group (tutorials/06_fsdp2_float8.py runs this)

    .. code-block:: python

It is reported as skipped with that reason. A new block is picked up without editing
this file.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.rst"))

_FENCE = re.compile(r"^```(\w*)\s*$")
_SKIP = re.compile(r"^<!--\s*skip:\s*(?P<reason>.*?)\s*-->\s*$")
_RST_BLOCK = re.compile(r"^\.\. code-block:: (\w+)\s*$")
_RST_SKIP = re.compile(r"^\.\. skip:(?P<reason>.*)$")


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    code: str
    skip: str | None  # the reason given in the marker, or None: the block runs


def python_blocks(text: str) -> list[Block]:
    """The fenced ``python`` blocks of a markdown text, each with its skip marker (if any)."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        start, language = i, match.group(1)
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            i += 1
        if i == len(lines):
            raise ValueError(f"README.md:{start + 1}: a code fence is never closed")
        body = "\n".join(lines[start + 1 : i]) + "\n"
        i += 1
        if language != "python":
            continue
        marker = _SKIP.match(lines[start - 1]) if start > 0 else None
        if marker is not None and not marker.group("reason"):
            raise ValueError(f"README.md:{start}: a skip marker must give its reason")
        blocks.append(Block(start + 1, body, marker.group("reason") if marker else None))
    return blocks


def rst_python_blocks(text: str) -> list[Block]:
    """The ``.. code-block:: python`` blocks of an rst text, each with its skip marker (if any)."""
    lines = text.splitlines()
    blocks: list[Block] = []
    for start, line in enumerate(lines):
        match = _RST_BLOCK.match(line)
        if match is None or match.group(1) != "python":
            continue
        i = start + 1
        while i < len(lines) and (not lines[i].strip() or lines[i].startswith("   ")):
            i += 1
        body = textwrap.dedent("\n".join(lines[start + 1 : i])).strip("\n") + "\n"
        before = start - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        marker = _RST_SKIP.match(lines[before]) if before >= 0 else None
        if marker is not None and not marker.group("reason").strip():
            raise ValueError(f"line {before + 1}: a skip marker must give its reason")
        blocks.append(Block(start + 1, body, marker.group("reason").strip() if marker else None))
    return blocks


# (id, block): README.md's blocks, then each docs page's.
BLOCKS = [(f"README.md:{b.line}", b) for b in python_blocks(README.read_text(encoding="utf-8"))] + [
    (f"docs/{page.name}:{b.line}", b) for page in DOCS for b in rst_python_blocks(page.read_text(encoding="utf-8"))
]


def test_readme_has_runnable_blocks():
    assert any(block.skip is None for name, block in BLOCKS if name.startswith("README.md")), (
        "README.md has no Python block that runs"
    )


def test_docs_have_runnable_blocks():
    assert any(block.skip is None for name, block in BLOCKS if name.startswith("docs/")), (
        "no docs page has a Python block that runs"
    )


def test_collector_reads_markers():
    text = "a\n```python\nx = 1\n```\n<!-- skip: needs a GPU -->\n```python\ny\n```\n```bash\nls\n```\n"
    assert python_blocks(text) == [Block(2, "x = 1\n", None), Block(6, "y\n", "needs a GPU")]
    with pytest.raises(ValueError, match="never closed"):
        python_blocks("```python\nx = 1\n")


def test_rst_collector_reads_markers():
    text = (
        "Text::\n\n   literal\n\n.. code-block:: python\n\n   x = 1\n   if x:\n\n       y = 2\nafter\n"
        ".. skip: needs a GPU\n\n.. code-block:: python\n\n   z\n\n.. code-block:: bash\n\n   ls\n"
    )
    assert rst_python_blocks(text) == [Block(5, "x = 1\nif x:\n\n    y = 2\n", None), Block(14, "z\n", "needs a GPU")]
    with pytest.raises(ValueError, match="must give its reason"):
        rst_python_blocks(".. skip:\n\n.. code-block:: python\n\n   z\n")


@pytest.mark.parametrize("block", [b for _, b in BLOCKS], ids=[name for name, _ in BLOCKS])
def test_readme_block_runs(block: Block, tmp_path: Path):
    if block.skip is not None:
        pytest.skip(f"line {block.line}: {block.skip}")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    result = subprocess.run(
        [sys.executable, "-c", block.code],
        cwd=tmp_path,  # anything a block writes stays out of the repository
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, (
        f"the block at line {block.line} exited with {result.returncode}\n"
        f"--- code ---\n{block.code}\n--- stderr (tail) ---\n{result.stderr[-4000:]}"
    )
