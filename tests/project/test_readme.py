"""README.md's Python code blocks run as written (a block that is a fragment is marked).

Every fenced ``python`` block of README.md is one test: it runs in a fresh interpreter
from the repository root, as a reader who pastes it would run it. A block that cannot run
alone (it needs a model, a process group or a logger the page does not build) is marked
in the markdown by an HTML comment on the line before its fence, which renders as
nothing::

    <!-- skip: needs a process group (tutorials/06_fsdp2_float8.py runs this) -->
    ```python

and is reported as skipped with that reason. A new block is picked up without editing
this file.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

_FENCE = re.compile(r"^```(\w*)\s*$")
_SKIP = re.compile(r"^<!--\s*skip:\s*(?P<reason>.*?)\s*-->\s*$")


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


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def test_readme_has_runnable_blocks():
    assert any(block.skip is None for block in BLOCKS), "README.md has no Python block that runs"


def test_collector_reads_markers():
    text = "a\n```python\nx = 1\n```\n<!-- skip: needs a GPU -->\n```python\ny\n```\n```bash\nls\n```\n"
    assert python_blocks(text) == [Block(2, "x = 1\n", None), Block(6, "y\n", "needs a GPU")]
    with pytest.raises(ValueError, match="never closed"):
        python_blocks("```python\nx = 1\n")


@pytest.mark.parametrize("block", BLOCKS, ids=[f"README.md:{block.line}" for block in BLOCKS])
def test_readme_block_runs(block: Block, tmp_path: Path):
    if block.skip is not None:
        pytest.skip(f"README.md:{block.line}: {block.skip}")
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
        f"README.md:{block.line} exited with {result.returncode}\n"
        f"--- code ---\n{block.code}\n--- stderr (tail) ---\n{result.stderr[-4000:]}"
    )
