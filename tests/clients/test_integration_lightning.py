"""The Lightning Precision plugin: a Trainer fit of a few steps on CPU, next to the same
fit in Lightning's own "bf16-mixed" precision."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from f8tensor import Float8Linear, Float8LinearConfig

pytest.importorskip("lightning", reason="lightning is not installed (pip install 'f8tensor[integrations]')")
import lightning as L

from f8tensor.integrations.lightning import Float8Precision

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 12
# Final training loss of the FP8 fit relative to the bf16-mixed fit.
LOSS_REL_TOL = 0.05


class _Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
        self.head = nn.Linear(64, 8)
        self.losses: list[float] = []
        self.compute_dtypes: list[torch.dtype] = []

    def forward(self, x):
        return self.head(self.net(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.compute_dtypes.append(logits.dtype)
        loss = nn.functional.cross_entropy(logits.float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * 32, 32, generator=g)
    teacher = torch.randn(32, 8, generator=g)
    y = (x @ teacher).argmax(-1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)


def _fit(module: L.LightningModule, **trainer_kwargs) -> L.LightningModule:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(module, _data())
    return module


def test_trainer_fit_with_the_float8_plugin():
    torch.manual_seed(0)
    base = _Classifier()
    ref = _fit(copy.deepcopy(base), precision="bf16-mixed")
    plugin = Float8Precision(
        Float8LinearConfig.from_recipe("tensorwise"), module_filter_fn=lambda m, fqn: fqn != "head", device="cpu"
    )
    fp8 = _fit(copy.deepcopy(base), plugins=[plugin])
    assert isinstance(fp8.net[0], Float8Linear) and isinstance(fp8.net[2], Float8Linear)
    assert type(fp8.head) is nn.Linear
    assert fp8.float8_converted_fqns == ("net.0", "net.2")
    assert set(fp8.compute_dtypes) == {torch.bfloat16}  # forward_context: bf16 autocast around the FP8 GEMMs
    assert len(fp8.losses) == len(ref.losses) == STEPS
    assert fp8.losses[-1] < 0.8 * fp8.losses[0], fp8.losses
    assert abs(fp8.losses[-1] - ref.losses[-1]) <= LOSS_REL_TOL * ref.losses[-1], (fp8.losses, ref.losses)


def test_plugin_options_are_checked():
    with pytest.raises(TypeError, match="config must be a Float8LinearConfig"):
        Float8Precision("tensorwise")
    with pytest.raises(ValueError, match="autocast_dtype must be"):
        Float8Precision(autocast_dtype=torch.float32)
    assert Float8Precision(autocast_dtype=None).precision == "32-true"
