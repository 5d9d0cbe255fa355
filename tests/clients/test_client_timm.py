"""timm (``pip install --no-deps timm``): ConvNeXt and MLP-Mixer with FP8 linears train a
step, every reported layer runs in FP8 (measured), and the state_dict loads into the
unconverted model."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch


def _import_timm():
    """timm as tutorial 10 imports it: with a stand-in for torchvision where none imports (PyPI's
    torchvision is a CUDA build; timm's model code needs nothing from it). None without timm."""
    path = Path(__file__).resolve().parents[2] / "tutorials" / "10_vit_timm.py"
    spec = importlib.util.spec_from_file_location("tutorial_10_vit_timm", path)
    module = importlib.util.module_from_spec(spec)
    threads = torch.get_num_threads()
    spec.loader.exec_module(module)
    torch.set_num_threads(threads)  # the tutorial pins one thread for its own run
    finders = list(sys.meta_path)
    timm = module.import_timm()
    if sys.meta_path != finders:
        # The stand-in served timm's import; no other test may take it for torchvision.
        sys.meta_path[:] = finders
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
    return timm


timm = _import_timm()
if timm is None:
    pytest.skip("pip install --no-deps timm==1.0.31 (see README.md)", allow_module_level=True)

from f8tensor import Float8LinearConfig, convert_to_float8_training
from tests.helpers import RanFP8

pytestmark = pytest.mark.usefixtures("one_thread")

MODELS = {
    "convnext": lambda: timm.create_model("convnext_atto", pretrained=False, num_classes=16),
    # The class itself: the registered mixer_* names fix embed_dim and num_blocks.
    "mixer": lambda: timm.models.mlp_mixer.MlpMixer(
        num_classes=16, img_size=64, patch_size=32, num_blocks=2, embed_dim=64
    ),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_timm_model_runs_its_fp8_layers_and_round_trips(name, monkeypatch):
    torch.manual_seed(0)
    model, plain = MODELS[name](), MODELS[name]()
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe("rowwise"))
    assert model.float8_converted_fqns
    ran = RanFP8(monkeypatch)
    x = torch.randn(2, 3, 64, 64)
    model(x).float().pow(2).mean().backward()
    assert ran.missing(model) == []
    plain.load_state_dict(model.state_dict())
