"""Prose against code in a package: characters of comments and docstrings over all other tokens.

Usage: ``python tools/prose_ratio.py [PACKAGE_DIR] [--max RATIO] [--per-file]``
(default ``f8tensor``). Exits 1 when ``--max`` is given and the ratio is above it.
"""

from __future__ import annotations

import argparse
import ast
import io
import pathlib
import sys
import tokenize

_LAYOUT = {tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER, tokenize.ENCODING}


def _docstring_starts(tree: ast.AST) -> set[tuple[int, int]]:
    starts = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                starts.add((first.value.lineno, first.value.col_offset))
    return starts


def count(source: str) -> tuple[int, int]:
    """``(prose, code)`` characters of one module's source.

    Args:
        source: the module's text.
    Returns:
        Characters of comment and docstring tokens, and of every other non-layout token.
    """
    docstrings = _docstring_starts(ast.parse(source))
    prose = code = 0
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in _LAYOUT:
            continue
        if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING and tok.start in docstrings):
            prose += len(tok.string)
        else:
            code += len(tok.string)
    return prose, code


def main(argv: list[str] | None = None) -> int:
    """Print the ratio (and per file with ``--per-file``); returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", nargs="?", default="f8tensor")
    parser.add_argument("--max", type=float, default=None, help="fail above this ratio")
    parser.add_argument("--per-file", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    for path in sorted(pathlib.Path(args.package).rglob("*.py")):
        prose, code = count(path.read_text())
        rows.append((str(path), prose, code))
    prose = sum(r[1] for r in rows)
    code = sum(r[2] for r in rows)
    if args.per_file:
        for name, p, c in sorted(rows, key=lambda r: -r[1] / max(r[2], 1)):
            print(f"{p / max(c, 1):6.2f}  {p:7d} {c:7d}  {name}")
    ratio = prose / code
    print(f"{args.package}: prose {prose:,} characters, code {code:,}: ratio {ratio:.2f}")
    return 1 if args.max is not None and ratio > args.max else 0


if __name__ == "__main__":
    sys.exit(main())
