"""Shared pytest set-up: ``gpu``-marked tests run only where FP8 GEMMs do."""

import pytest
import torch


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def pytest_collection_modifyitems(config, items):
    if _fp8_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device with FP8 support (compute capability >= 8.9)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
