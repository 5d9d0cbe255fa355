"""PEFT (``pip install peft``): LoRA adapters on an FP8 model (a tiny Llama, no download).

The base layers run in FP8 (measured: ``Float8Linear``'s forward runs for each converted
layer), the adapters train, and the adapted model saves and loads its adapter.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="pip install transformers (or pip install 'f8tensor[integrations]')")
pytest.importorskip("peft", reason="pip install peft (or pip install 'f8tensor[integrations]')")
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from f8tensor import Float8Linear, Float8LinearConfig, convert_to_float8_training
from tests.helpers import RanFP8

pytestmark = pytest.mark.usefixtures("one_thread")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config)
    convert_to_float8_training(
        model, config=Float8LinearConfig.from_recipe("rowwise"), module_filter_fn=lambda m, fqn: "lm_head" not in fqn
    )
    return model


def test_lora_on_fp8_base_layers_trains_and_saves(tmp_path, monkeypatch):
    model = get_peft_model(_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    ran = RanFP8(monkeypatch)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    lora = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(lora, lr=0.5)
    first = model(ids, labels=ids).loss
    for _ in range(5):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    assert model(ids, labels=ids).loss < first
    fp8 = [m for m in model.modules() if isinstance(m, Float8Linear)]
    assert fp8 and all(id(m) in ran.ran for m in fp8), "every FP8 base layer ran in FP8"
    model.save_pretrained(tmp_path)
    again = PeftModel.from_pretrained(_model(), tmp_path)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
