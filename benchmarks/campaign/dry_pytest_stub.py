"""The dry run's stand-in for ``pytest -m gpu``: the same command, the same junit report,
without a GPU or the test suite's minute of collection (``gpu_tests.dry_paths``)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from campaign import gpu_tests


@pytest.mark.gpu
def test_every_group_names_test_files():
    for _, paths, _ in gpu_tests.GROUPS:
        assert all(p.startswith("tests/") and (gpu_tests.REPO / p).is_file() for p in paths), paths


@pytest.mark.gpu
@pytest.mark.skip(reason="dry run: stands for a test that needs a GPU")
def test_stands_for_a_gpu_test():
    raise AssertionError("skipped")
