"""torchtitan (``pip install --no-deps torchtitan``): the model converter on the Qwen3 MoE
debugmodel leaves the MoE routers in high precision by default (issue 24.9)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan", reason="pip install --no-deps torchtitan==0.3.0 (see README.md)")
# exc_type=ImportError: on torch < 2.12 torchtitan 0.3.0's model code fails with an
# ImportError that is not ModuleNotFoundError (DataParallelMeshDims from torch.distributed.fsdp).
qwen3 = pytest.importorskip(
    "torchtitan.models.qwen3",
    reason=f"torchtitan's model code does not import with torch {torch.__version__}",
    exc_type=ImportError,
)
from torchtitan.models.common.linear import Linear

from f8tensor.integrations.torchtitan import F8TensorLinear, F8TensorLinearConverter


def _converted(**options) -> tuple[list[str], list[str]]:
    config = qwen3.model_registry("debugmodel_moe").model
    converter = F8TensorLinearConverter(F8TensorLinearConverter.Config(recipe="rowwise", **options))
    config = converter.convert(config)
    fp8 = [fqn for fqn, *_ in config.traverse(F8TensorLinear.Config)]
    plain = [fqn for fqn, cfg, *_ in config.traverse(Linear.Config) if not isinstance(cfg, F8TensorLinear.Config)]
    return fp8, plain


def test_routers_stay_high_precision_by_default(caplog):
    with caplog.at_level("INFO", logger="f8tensor"):
        fp8, plain = _converted()
    routers = [f for f in plain if f.endswith("router.gate")]
    assert routers and not any("router" in f for f in fp8)
    assert any(f.endswith("attention.wo") for f in fp8)
    assert "MoE router" in caplog.text


def test_routers_convert_when_asked():
    fp8, _ = _converted(convert_routers=True)
    assert any(f.endswith("router.gate") for f in fp8)
