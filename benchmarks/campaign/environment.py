"""The environment line every run prints first (``_common.environment``, plus what the
campaign adds: f8tensor's version and path, torchao from a carried wheel, the command)."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import shlex
import sys
import tempfile
import zipfile
from pathlib import Path


def setup_torchao(wheel_dir: str | None) -> str | None:
    """Put torchao from ``--torchao-wheel-dir`` on ``sys.path`` (and ``PYTHONPATH`` for child
    processes): a folder holding ``torchao/`` (an unpacked site, e.g. pip's ``--target``) or a
    ``torchao-*.whl`` (unpacked into a temporary folder). Returns why torchao is absent, or None."""
    if wheel_dir is None:
        return None
    d = Path(wheel_dir)
    if not d.is_dir():
        return f"--torchao-wheel-dir {d} is not a directory"
    site = d
    if not (d / "torchao").is_dir():
        wheels = sorted(d.glob("torchao-*.whl"))
        if not wheels:
            return f"no torchao/ package and no torchao-*.whl in --torchao-wheel-dir {d}"
        site = Path(tempfile.gettempdir()) / f"f8tensor_campaign_{wheels[-1].stem}"
        if not (site / "torchao").is_dir():
            with zipfile.ZipFile(wheels[-1]) as z:
                z.extractall(site)
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return None


def torchao_note(absent_reason: str | None) -> str:
    """torchao's version and where it comes from, or ``absent: <why>`` (its import chatter is dropped)."""
    import _common as C

    if absent_reason is not None:
        return f"absent: {absent_reason}"
    float8, note = None, ""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        float8, note = C.load_torchao()
    if float8 is None:
        return f"absent: {note}"
    torchao = importlib.import_module("torchao")
    return f"{torchao.__version__} ({Path(torchao.__file__).parent.parent})"


def environment(device, torchao: str) -> list[tuple[str, str]]:
    """``(key, value)`` lines: GPU, clocks, power limit, driver, CUDA, torch, triton, f8tensor and its commit, torchao."""
    import _common as C
    import torch

    import f8tensor

    env = C.environment(device, torchao)
    env.setdefault("gpu", "none: CPU run (dry run)")
    env.pop("command", None)
    env["torch"] = f"{torch.__version__} (git {torch.version.git_version[:12]})"
    env["f8tensor"] = f"{f8tensor.__version__} at {Path(f8tensor.__file__).parent}"
    env["command"] = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    return list(env.items())
