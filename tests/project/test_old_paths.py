"""Module paths from before the package was cut by concern still import, as the moved
module itself (``f8tensor/_moved.py``), so scripts and pickles that name them keep working."""

from __future__ import annotations

import importlib
import pickle

import pytest
import torch

import f8tensor
from f8tensor._moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_is_the_moved_module(old):
    assert importlib.import_module(f"f8tensor.{old}") is importlib.import_module(f"f8tensor.{MOVED[old]}")


def test_old_names_resolve_to_the_same_objects():
    import f8tensor.config
    import f8tensor.linear

    assert f8tensor.linear.Float8Linear is f8tensor.Float8Linear
    assert f8tensor.config.CastConfig is f8tensor.CastConfig


@pytest.mark.parametrize(
    ("module", "name"), [("config", "CastConfig"), ("linear", "Float8Linear"), ("specs", "GemmConfig")]
)
def test_a_pickle_naming_an_old_module_loads(module, name):
    # GLOBAL "f8tensor.<old module>" "<name>", STOP: what a pickle of an older save names.
    old = b"\x80\x02cf8tensor." + module.encode() + b"\n" + name.encode() + b"\n."
    assert pickle.loads(old) is getattr(f8tensor, name)


def test_checkpoints_name_the_stable_tensor_path(tmp_path):
    x8 = f8tensor.Float8Tensor.from_hp(torch.randn(16, 32))
    torch.save({"w": x8}, tmp_path / "w.pt")
    raw = (tmp_path / "w.pt").read_bytes()
    assert b"f8tensor.tensor\n_rebuild_float8_tensor\n" in raw
    assert b"f8tensor.tensor.float8" not in raw
    loaded = torch.load(tmp_path / "w.pt", weights_only=True)["w"]
    assert torch.equal(loaded._data.view(torch.uint8), x8._data.view(torch.uint8))


def test_an_unknown_old_path_still_fails():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("f8tensor.no_such_module")
