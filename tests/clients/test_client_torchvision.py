"""torchvision (``pip install --no-deps torchvision==0.28.0 --index-url
https://download.pytorch.org/whl/cpu``): its ``VisionTransformer`` converts with every
reported layer running in FP8, ``nn.MultiheadAttention``'s in- and out-projections included
(round 4; skipped and reported before): the four GEMMs of each encoder block (packed q/k/v
in-projection, out-projection, the two MLP linears) are FP8 products, counted, in training
and under ``inference_mode``; a few training steps stay within 2% of the bf16 model's loss.
The same pattern without torchvision: tests/nn/test_attention.py and
tests/nn/test_convert_reports.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

tv_models = pytest.importorskip(
    "torchvision.models",
    reason="pip install --no-deps torchvision==0.28.0 --index-url https://download.pytorch.org/whl/cpu",
)

from f8tensor import Float8LinearConfig, convert_to_float8_training
from tests.helpers import FP8Products, RanFP8, weight_grad_sqnr

pytestmark = pytest.mark.usefixtures("one_thread")


def _vit(seed=0, **kw):
    torch.manual_seed(seed)
    args = {"image_size": 32, "patch_size": 16, "num_layers": 2, "num_heads": 2, "hidden_dim": 32, "mlp_dim": 64}
    return tv_models.VisionTransformer(**({"num_classes": 16} | args | kw))


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_vit_reports_only_layers_that_run_in_fp8(mode, monkeypatch, caplog):
    model = _vit()
    with caplog.at_level("INFO", logger="f8tensor"):
        convert_to_float8_training(model)
    assert sum(f.endswith(("in_proj_weight", "out_proj.weight")) for f in model.float8_converted_fqns) == 4
    assert "2 of 2 nn.MultiheadAttention" in caplog.text
    ran = RanFP8(monkeypatch)
    model.train(mode == "train")
    with torch.set_grad_enabled(mode == "train"):
        model(torch.randn(2, 3, 32, 32))
    assert ran.missing(model) == []


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_vit_encoder_block_runs_its_four_gemms_in_fp8(recipe):
    model = _vit()
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe(recipe))
    block = model.encoder.layers[0]
    counter = FP8Products([p.shape for p in block.parameters() if p.dim() == 2])
    x = torch.randn(2, 5, 32, requires_grad=True)  # (batch, class token + 4 patches, hidden)
    with counter:
        y = block(x)
    assert counter.fp8 == 4  # in-projection (packed q/k/v), out-projection, mlp.0, mlp.3
    with counter:
        y.float().pow(2).mean().backward()
    assert counter.fp8 == 4 + 8  # the input and weight gradients of each
    block.eval()
    with torch.inference_mode(), counter:
        block(x.detach())
    assert counter.fp8 == 4 + 8 + 4  # inference_mode: FP8 too, not the fused fast path
    assert counter.hp == []


def test_vit_trains_like_bf16_and_its_gradients_match_fp32():
    vit = _vit(image_size=32, patch_size=8, num_classes=10)  # 16 patches and a class token
    # torchvision starts the classifier at zero (no gradient reaches the blocks on step one).
    torch.nn.init.normal_(vit.heads.head.weight, std=0.1)
    model = copy.deepcopy(vit)
    convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn != "heads.head")

    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 10, (8, 16), generator=g)
    patterns = torch.randn(10, 3, 32, 32, generator=g)
    images = patterns[labels] + torch.randn(8, 16, 3, 32, 32, generator=g)

    # One backward in fp32, no autocast: the weight gradients against the fp32 model's.
    for m in (model, vit):
        F.cross_entropy(m(images[0]), labels[0]).backward()
    db = weight_grad_sqnr(model, vit)
    assert min(db.values()) >= 15.0, db  # measured 17.8 dB (worst: encoder_layer_0 in_proj_weight; e5m2 gradients)

    def train(m):
        m.zero_grad(set_to_none=True)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        losses = []
        for x, y in zip(images, labels):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(m(x).float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    bf16, fp8 = train(vit), train(model)
    assert fp8[-1] < fp8[0]
    rel = abs(fp8[-1] - bf16[-1]) / bf16[-1]
    assert rel < 0.02, (bf16, fp8)  # measured 0.26% after 8 steps (1.669 bf16, 1.674 FP8)
