"""Every tutorials/*.py runs to completion with no arguments (new tutorials are picked up)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = sorted((ROOT / "tutorials").glob("*.py"))


def test_tutorials_exist():
    assert TUTORIALS, f"no tutorials found under {ROOT / 'tutorials'}"


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.name for p in TUTORIALS])
def test_tutorial_runs(path, tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["F8TENSOR_OUT"] = str(tmp_path)  # figures go to a scratch folder, never the repo
    result = subprocess.run(
        [sys.executable, str(path)],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        # A hang guard, not a speed check (tutorial 05 compiles; minutes on a loaded machine).
        timeout=900,
    )
    assert result.returncode == 0, (
        f"{path.name} exited with {result.returncode}\n"
        f"--- stdout (tail) ---\n{result.stdout[-4000:]}\n--- stderr (tail) ---\n{result.stderr[-4000:]}"
    )
