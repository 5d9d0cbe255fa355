"""The ``f8tensor-readme`` directive: a section of README.md, rendered in the reference.

README.md stays the one source of the "How it works" text (and its code runs in the test
suite); this directive reads a section from it at build time, so the two cannot drift.
It converts the little Markdown that section uses: inline code, bold, links, pipe tables.
"""

from __future__ import annotations

import re
from pathlib import Path

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

README = Path(__file__).resolve().parents[2] / "README.md"


def section(markdown: str, title: str) -> str:
    """The body of the ``## title`` section (up to the next ``## `` heading)."""
    heading = f"\n## {title}\n"
    start = markdown.find(heading)
    if start == -1:
        raise ValueError(f"README.md has no section '## {title}'")
    start += len(heading)
    end = markdown.find("\n## ", start)
    return markdown[start : end if end != -1 else len(markdown)].strip("\n")


def _inline(text: str) -> str:
    text = re.sub(r"\[([^\]]+)\]\(([^)]+)\)", r"\1 (``\2``)", text)
    return re.sub(r"(?<!`)`([^`]+)`(?!`)", r"``\1``", text)


def to_rst(markdown: str) -> list[str]:
    """reStructuredText for a Markdown section of paragraphs, lists and pipe tables."""
    out: list[str] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("|"):
            out.append(_inline(lines[i]))
            i += 1
            continue
        rows = []
        while i < len(lines) and lines[i].startswith("|"):
            cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", lines[i].strip()[1:-1])]
            if not all(set(c) <= set("-: ") for c in cells):
                rows.append(cells)
            i += 1
        out += [".. list-table::", "   :header-rows: 1", ""]
        for row in rows:
            for j, cell in enumerate(row):
                out.append(("   * - " if j == 0 else "     - ") + (_inline(cell) or "\\ "))
        out.append("")
    return out


class ReadmeSection(SphinxDirective):
    """``.. f8tensor-readme:: <section title>``: that section of README.md."""

    required_arguments = 1
    final_argument_whitespace = True

    def run(self) -> list[nodes.Node]:
        self.env.note_dependency(str(README))
        rst = to_rst(section(README.read_text(encoding="utf-8"), self.arguments[0]))
        container = nodes.container()
        self.state.nested_parse(StringList(rst, source=str(README)), self.content_offset, container)
        return container.children


def setup(app: Sphinx) -> dict[str, object]:
    app.add_directive("f8tensor-readme", ReadmeSection)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
