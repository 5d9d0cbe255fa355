"""torchvision (``pip install --no-deps torchvision==0.28.0 --index-url
https://download.pytorch.org/whl/cpu``): its ``VisionTransformer`` converts with every
reported layer running in FP8, ``nn.MultiheadAttention``'s in- and out-projections included
(round 4; skipped and reported before). The same pattern without torchvision: tests/modules/test_convert_reports.py."""

from __future__ import annotations

import pytest
import torch

tv_models = pytest.importorskip(
    "torchvision.models",
    reason="pip install --no-deps torchvision==0.28.0 --index-url https://download.pytorch.org/whl/cpu",
)

from f8tensor import convert_to_float8_training
from tests.helpers import RanFP8

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_vit_reports_only_layers_that_run_in_fp8(mode, monkeypatch, caplog):
    torch.manual_seed(0)
    model = tv_models.VisionTransformer(
        image_size=32, patch_size=16, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=16
    )
    with caplog.at_level("INFO", logger="f8tensor"):
        convert_to_float8_training(model)
    assert sum(f.endswith(("in_proj_weight", "out_proj.weight")) for f in model.float8_converted_fqns) == 4
    assert "2 of 2 nn.MultiheadAttention" in caplog.text
    ran = RanFP8(monkeypatch)
    model.train(mode == "train")
    with torch.set_grad_enabled(mode == "train"):
        model(torch.randn(2, 3, 32, 32))
    assert ran.missing(model) == []
