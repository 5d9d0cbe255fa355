"""Lightning (``pip install lightning``) with the f8tensor precision plugin: resume and re-setup.

Issue 24.8: ``fit(ckpt_path=...)`` restores the checkpoint before the plugin converts the
model; a delayed run could not be resumed. Resume must equal the uninterrupted run bit for
bit, every recipe. Issue 24.6: ``trainer.validate`` after ``fit`` converts again and must
not warn that the model trains in high precision.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from f8tensor import RECIPES, Float8Linear, Float8LinearConfig

pytest.importorskip("lightning", reason="pip install lightning (or pip install 'f8tensor[integrations]')")
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from f8tensor.integrations.lightning import Float8Precision

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS_PER_EPOCH = 3


class _Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x).float(), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val", nn.functional.cross_entropy(self(x).float(), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS_PER_EPOCH * 16, 32, generator=g)
    y = torch.randint(0, 16, (x.shape[0],), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def _trainer(epochs: int, root, **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        num_sanity_val_steps=0,
        **kwargs,
    )


def _plugin(recipe: str) -> Float8Precision:
    return Float8Precision(Float8LinearConfig.from_recipe(recipe), device="cpu")


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_resume_equals_the_uninterrupted_run(recipe, tmp_path):
    torch.manual_seed(0)
    init = _Net().state_dict()

    def fresh() -> _Net:
        net = _Net()
        net.load_state_dict(init)
        return net

    # Stochastic rounding (the FP4 recipes) draws from torch's global generator: both runs
    # start from the same state, and the plugin checkpoints it for the resumed one.
    straight = fresh()
    torch.manual_seed(1)
    _trainer(2, tmp_path / "a", plugins=[_plugin(recipe)], enable_checkpointing=False).fit(straight, _data())

    first = fresh()
    torch.manual_seed(1)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "b", save_last=True)
    _trainer(1, tmp_path / "b", plugins=[_plugin(recipe)], callbacks=[ckpt]).fit(first, _data())
    resumed = fresh()
    _trainer(2, tmp_path / "c", plugins=[_plugin(recipe)], enable_checkpointing=False).fit(
        resumed, _data(), ckpt_path=str(tmp_path / "b" / "last.ckpt")
    )
    assert isinstance(resumed.net[0], Float8Linear)
    want, got = straight.state_dict(), resumed.state_dict()
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), f"{recipe}: {key} differs after resume"


def test_validate_after_fit_counts_the_fp8_layers(tmp_path, caplog):
    net = _Net()
    trainer = _trainer(1, tmp_path, plugins=[_plugin("tensorwise")], enable_checkpointing=False)
    trainer.fit(net, _data())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with caplog.at_level("INFO", logger="f8tensor"):
            trainer.validate(net, _data(), verbose=False)
    assert "trains in high precision" not in caplog.text
    assert "2 layers or expert weights were already FP8" in caplog.text
