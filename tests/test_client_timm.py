"""timm (``pip install --no-deps timm``): ConvNeXt and MLP-Mixer with FP8 linears train a
step, every reported layer runs in FP8 (measured), and the state_dict loads into the
unconverted model."""

from __future__ import annotations

import pytest
import torch

timm = pytest.importorskip("timm", reason="pip install --no-deps timm==1.0.31 (see README.md)")

from f8tensor import Float8LinearConfig, convert_to_float8_training
from tests.helpers import RanFP8

pytestmark = pytest.mark.usefixtures("one_thread")

MODELS = {
    "convnext": {"model_name": "convnext_atto", "num_classes": 16},
    "mixer": {"model_name": "mixer_s32_224", "num_classes": 16, "img_size": 64, "embed_dim": 64, "num_blocks": 2},
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_timm_model_runs_its_fp8_layers_and_round_trips(name, monkeypatch):
    torch.manual_seed(0)
    kwargs = dict(MODELS[name])
    model = timm.create_model(kwargs.pop("model_name"), pretrained=False, **kwargs)
    plain = timm.create_model(MODELS[name]["model_name"], pretrained=False, **kwargs)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe("rowwise"))
    assert model.float8_converted_fqns
    ran = RanFP8(monkeypatch)
    x = torch.randn(2, 3, 64, 64)
    model(x).float().pow(2).mean().backward()
    assert ran.missing(model) == []
    plain.load_state_dict(model.state_dict())
