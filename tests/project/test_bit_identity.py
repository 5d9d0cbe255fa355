"""The bit-identity baseline (tools/bit_identity.py) holds: a refactor that should not change
numbers changes none. A change of bits on purpose rewrites the baseline in the same commit
(``python tools/bit_identity.py --write``) and names the change in CHANGELOG.md."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from helpers import load_script

TOOL = pathlib.Path(__file__).resolve().parents[2] / "tools" / "bit_identity.py"
BASELINE = TOOL.with_name("bit_identity_baseline.json")


def _same_torch() -> bool:
    written = json.loads(BASELINE.read_text())["torch"]
    return written.split("+")[0].rsplit(".", 1)[0] == torch.__version__.split("+")[0].rsplit(".", 1)[0]


pytestmark = pytest.mark.skipif(not _same_torch(), reason="the baseline was written with another torch minor version")


def _check(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "F8TENSOR_CHECK_CUDA_RULES": "0"}
    return subprocess.run(
        [sys.executable, str(TOOL), "--check", *args], check=False, capture_output=True, text=True, env=env, timeout=600
    )


def test_eager_runs_bit_identical():
    done = _check("--eager")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "0 missing" in done.stdout


def test_compiled_runs_bit_identical():
    done = _check("--recipes", "tensorwise", "rowwise")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert ".compiled." in BASELINE.read_text()


def test_the_check_fails_on_a_changed_bit(tmp_path):
    # The check is not a tautology: one digest changed in a copy of the baseline fails it.
    baseline = json.loads(BASELINE.read_text())
    key = next(k for k in baseline["digests"] if k.startswith("tensorwise.2d.step0.out"))
    baseline["digests"][key] = "0" * 16
    module = load_script(TOOL)
    module.BASELINE = tmp_path / "baseline.json"
    module.BASELINE.write_text(json.dumps(baseline))
    assert module.main(["--check", "--eager", "--recipes", "tensorwise"]) == 1


def test_bf16_gemm_digests_are_compared_only_on_the_baseline_cpu(tmp_path, capsys):
    # A bf16 GEMM's bits depend on the CPU: with another CPU's probe, a changed high-precision
    # weight gradient is skipped (and said); with this CPU's probe, it fails the check.
    module = load_script(TOOL)
    baseline = json.loads(BASELINE.read_text())
    key = next(k for k in baseline["digests"] if module._depends_on_cpu_bf16_gemm(k) and ".compiled." not in k)
    baseline["digests"][key] = "0" * 16
    module.BASELINE = tmp_path / "baseline.json"
    for probe, want in (("another CPU", 0), (module._bf16_gemm_probe(), 1)):
        module.BASELINE.write_text(json.dumps({**baseline, "bf16_gemm_probe": probe}))
        assert module.main(["--check", "--eager", "--recipes", "rowwise_with_gw_hp"]) == want
        assert ("skipped" in capsys.readouterr().out) == (want == 0)
