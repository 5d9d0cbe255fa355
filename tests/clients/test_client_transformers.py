"""transformers (``pip install transformers``): a tiny Qwen3-MoE with FP8 experts and a tiny
dense Llama, through what users do with them (issue 24.2-24.4).

save_pretrained -> from_pretrained + conversion gives the same logits bit for bit; generate
under ``torch.inference_mode`` gives the tokens ``no_grad`` gives; ``torch.export`` gives the
eager logits bit for bit (compile: tests/clients/test_client_hf_moe.py). Tiny configs, no download.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="pip install transformers (or pip install 'f8tensor[integrations]')")
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from f8tensor import Float8LinearConfig, convert_to_float8_training
from f8tensor.moe import Float8ExpertWeight

pytestmark = pytest.mark.usefixtures("one_thread")

COMMON = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": 64,
}


def _moe(impl: str = "grouped_mm") -> torch.nn.Module:
    config = Qwen3MoeConfig(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, **COMMON)
    config._experts_implementation = impl
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config)


def _dense() -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**COMMON))


def _convert(model: torch.nn.Module, recipe: str) -> torch.nn.Module:
    convert_to_float8_training(
        model, config=Float8LinearConfig.from_recipe(recipe), module_filter_fn=lambda m, fqn: "lm_head" not in fqn
    )
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_moe_save_pretrained_and_from_pretrained(recipe, tmp_path):
    model = _convert(_moe(), recipe)
    assert any(isinstance(p, Float8ExpertWeight) for p in model.parameters())
    model.save_pretrained(tmp_path)
    again = _convert(Qwen3MoeForCausalLM.from_pretrained(tmp_path), recipe)
    assert set(again.float8_converted_fqns) == set(model.float8_converted_fqns)
    with torch.no_grad():
        assert torch.equal(again(_ids()).logits, model(_ids()).logits)


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm", "eager"])
def test_moe_generate_under_inference_mode(impl):
    model = _convert(_moe(impl), "rowwise").eval()
    with torch.no_grad():
        want = model.generate(_ids(), max_new_tokens=4, do_sample=False)
    with torch.inference_mode():
        got = model.generate(_ids(), max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)


def test_dense_generate_under_inference_mode():
    model = _convert(_dense(), "rowwise").eval()
    with torch.no_grad():
        want = model.generate(_ids(), max_new_tokens=4, do_sample=False)
    with torch.inference_mode():
        got = model.generate(_ids(), max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids, use_cache=False).logits


def test_moe_export_gives_the_eager_logits():
    model = _Logits(_convert(_moe(), "rowwise")).eval()
    exported = torch.export.export(model, (_ids(),))
    with torch.no_grad():
        assert torch.equal(exported.module()(_ids()), model(_ids()))
