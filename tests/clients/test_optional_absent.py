"""An optional client that is absent is reported as absent: the integration module's import
names the package and its install command (never an unrelated attribute or path error)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# (integration module, the packages made absent, what the message must name)
CASES = [
    ("f8tensor.integrations.torchtitan", ["torchtitan"], "pip install --no-deps torchtitan==0.3.0"),
    ("f8tensor.integrations.lightning", ["lightning", "pytorch_lightning"], "pip install lightning"),
]


@pytest.mark.parametrize(("module", "absent", "install"), CASES, ids=[c[0].rsplit(".", 1)[1] for c in CASES])
def test_integration_without_its_client_says_absent(module, absent, install):
    # A fresh interpreter: sys.modules[name] = None makes `import name` fail as if absent,
    # whether or not the package is installed here.
    code = (
        "import sys\n"
        f"for name in {absent!r}: sys.modules[name] = None\n"
        "try:\n"
        f"    import {module}\n"
        "except ModuleNotFoundError as exc:\n"
        "    print(repr(exc.name), str(exc))\n"
        "else:\n"
        "    print('imported')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith(repr(absent[0])), line
    assert "is not installed" in line and install in line, line
