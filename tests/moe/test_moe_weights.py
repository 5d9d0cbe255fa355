"""FP8 expert weights stay FP8 and truthful through what clients do to parameters
(issue 23.11, 23.12, the sliced pickle and the compile-cache hash; issue 24.2-24.3 at the
parameter level: plain state_dict values, inference_mode)."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

from f8tensor import Float8LinearConfig, convert_to_float8_training
from f8tensor.moe import Float8ExpertWeight

pytestmark = pytest.mark.usefixtures("one_thread")


class _Experts(nn.Module):
    """transformers' layout: (experts, out, in) weights, multiplied by torch._grouped_mm."""

    SHAPES = (("gate_up_proj", (4, 32, 32)), ("down_proj", (4, 32, 16)))

    def __init__(self):
        super().__init__()
        self.num_experts = 4
        for name, shape in self.SHAPES:
            self.register_parameter(name, nn.Parameter(torch.randn(shape) * 0.1))

    def forward(self, x, offs):
        h = torch._grouped_mm(x, self.gate_up_proj.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h[:, :16].contiguous(), self.down_proj.transpose(-2, -1), offs=offs)


def _model(recipe="rowwise") -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    model.experts = _Experts()
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe(recipe))
    return model


def _fp8(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if isinstance(p, Float8ExpertWeight)]


def test_state_dict_holds_plain_tensors_and_loads_back():
    model = _model()
    sd = model.state_dict()
    assert all(type(v) is torch.Tensor for v in sd.values())
    assert all(isinstance(v, Float8ExpertWeight) for v in model.state_dict(keep_vars=True).values())
    other = _model()
    other.load_state_dict(sd)
    assert _fp8(other) == ["experts.gate_up_proj", "experts.down_proj"]
    assert torch.equal(other.experts.down_proj._hp, model.experts.down_proj._hp)


def test_assign_load_keeps_expert_weights_fp8():
    model = _model()
    sd = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    model.load_state_dict(sd, assign=True)
    assert _fp8(model) == ["experts.gate_up_proj", "experts.down_proj"]
    assert set(model.float8_converted_fqns) == set(_fp8(model))
    assert torch.equal(model.experts.gate_up_proj._hp, sd["experts.gate_up_proj"])
    assert model.experts.gate_up_proj._config == Float8LinearConfig.from_recipe("rowwise")


@pytest.mark.parametrize("how", ["pickle", "torch.save", "deepcopy"])
def test_whole_model_copies_keep_expert_weights_fp8(how):
    model = _model()
    if how == "pickle":
        again = pickle.loads(pickle.dumps(model))
    elif how == "torch.save":
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        again = torch.load(buf, weights_only=False)
    else:
        again = copy.deepcopy(model)
    assert _fp8(again) == _fp8(model) and set(again.float8_converted_fqns) == set(_fp8(again))
    assert again.experts.gate_up_proj._config == model.experts.gate_up_proj._config
    x, offs = torch.randn(8, 32), torch.tensor([2, 4, 6, 8], dtype=torch.int32)
    assert torch.equal(again.experts(x, offs), model.experts(x, offs))
    again.load_state_dict(model.state_dict(), assign=True)  # the hooks came along
    assert _fp8(again) == _fp8(model)


def test_dtype_follows_or_is_refused():
    model = _model()
    model.half()
    for p in model.parameters():
        assert isinstance(p, Float8ExpertWeight) and p.dtype == p._hp.dtype == torch.float16
    with pytest.raises(TypeError, match="cannot set its data to a plain torch.float64 tensor"):
        model.double()
    assert model.experts.gate_up_proj.dtype == model.experts.gate_up_proj._hp.dtype


def test_a_slice_pickles_only_its_own_elements():
    w = nn.Parameter(Float8ExpertWeight(torch.randn(64, 32, 32), Float8LinearConfig()))
    piece = w.detach()[3]
    assert isinstance(piece, Float8ExpertWeight)
    size = len(pickle.dumps(piece))
    assert size < 2 * 32 * 32 * 4, f"{size} bytes for a 4 KB piece"
    assert len(pickle.dumps(w.detach()[::16])) < 6 * 32 * 32 * 4
    assert torch.equal(pickle.loads(pickle.dumps(piece)), piece._hp)


def test_stable_hash_for_compile_caching():
    """What AOT autograd's cache asks a traceable subclass for. The key is a blake2b of
    values only (shapes, strides, dtypes, the frozen config's repr), never id() or hash(),
    so it is the same in every process."""

    def h(recipe, shape=(2, 16, 16)):
        return Float8ExpertWeight(torch.randn(shape), Float8LinearConfig.from_recipe(recipe))._stable_hash_for_caching()

    assert h("rowwise") == h("rowwise")
    assert h("rowwise") != h("tensorwise") and h("rowwise") != h("rowwise", (2, 16, 32))
    w = Float8ExpertWeight(torch.randn(2, 16, 16), Float8LinearConfig())
    assert w.transpose(-2, -1)._stable_hash_for_caching() != w._stable_hash_for_caching()


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_inference_mode_gives_the_no_grad_result(recipe):
    model = _model(recipe)
    x, offs = torch.randn(8, 32), torch.tensor([2, 4, 6, 8], dtype=torch.int32)
    with torch.no_grad():
        ref = model.experts(x, offs)
    with torch.inference_mode():
        out = model.experts(x, offs)
        out_linear = torch.nn.functional.linear(x, model.experts.gate_up_proj[1])
    assert torch.equal(out, ref)
    with torch.no_grad():
        assert torch.equal(out_linear, torch.nn.functional.linear(x, model.experts.gate_up_proj[1]))
