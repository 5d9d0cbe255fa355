"""Prose that fits: comments and docstrings of f8tensor/ against its code (tools/prose_ratio.py)."""

from __future__ import annotations

import pathlib

from helpers import load_script

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: The ratio at most (the lean-path issue's bar: 0.6). 0.45 after the prose cut; 0.47 once
#: the round's new public APIs (FP8 checkpoint loading and streaming, recompute=True) came
#: with their docstrings. Lower it with every change that lowers the ratio.
MAX_RATIO = 0.48


def _tool():
    return load_script(ROOT / "tools" / "prose_ratio.py")


def test_prose_ratio_at_most_the_ceiling(capsys):
    assert _tool().main([str(ROOT / "f8tensor"), "--max", str(MAX_RATIO)]) == 0, capsys.readouterr().out


def test_counts_comments_and_docstrings_only():
    source = '"""Doc."""\n\n\ndef f(x):  # why\n    """One line."""\n    return "text" + x\n'
    prose, code = _tool().count(source)
    assert prose == len('"""Doc."""') + len("# why") + len('"""One line."""')
    assert code == len('deffx():return"text"+x')
