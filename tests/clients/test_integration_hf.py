"""Hugging Face: save_pretrained -> from_pretrained_float8 keeps delayed scaling bit for
bit; the accelerate and Trainer recipe (convert, then prepare) trains."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from f8tensor import Float8Linear, Float8LinearConfig, convert_to_float8_training

transformers = pytest.importorskip("transformers")

from f8tensor.integrations.hf import float8_state_dict, from_pretrained_float8, load_float8_state

pytestmark = pytest.mark.usefixtures("one_thread")

DELAYED = Float8LinearConfig.from_recipe("delayed")


def _keep_head(mod: nn.Module, fqn: str) -> bool:
    return fqn != "lm_head"


def _llama() -> nn.Module:
    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config)


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(seed))


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> torch.Tensor:
    tokens = _tokens(seed)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _trained_delayed_model() -> nn.Module:
    model = convert_to_float8_training(_llama(), config=DELAYED, module_filter_fn=_keep_head)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for seed in range(3):
        _step(model, opt, seed)
    return model


@pytest.mark.parametrize("max_shard_size", [None, "100KB"], ids=["one_file", "sharded"])
def test_save_pretrained_round_trip_keeps_the_scaling_state_bit_exact(tmp_path, max_shard_size):
    model = _trained_delayed_model()
    state = float8_state_dict(model)
    assert len(state) == 14 * 5 and all(
        k.startswith("model.layers.") for k in state
    )  # 7 linears x 2 layers x 5 buffers
    assert any(v.abs().sum() > 0 for k, v in state.items() if "amax_history" in k)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(tmp_path, **kwargs)
    if max_shard_size is not None:
        assert (tmp_path / "model.safetensors.index.json").is_file()

    # What a user gets from from_pretrained + convert: fresh, empty histories.
    plain = convert_to_float8_training(
        transformers.LlamaForCausalLM.from_pretrained(tmp_path), config=DELAYED, module_filter_fn=_keep_head
    )
    assert all(not v.any() for k, v in float8_state_dict(plain).items() if "amax_history" in k)

    loaded = from_pretrained_float8(
        transformers.LlamaForCausalLM, tmp_path, config=DELAYED, module_filter_fn=_keep_head
    )
    expected, got = model.state_dict(), loaded.state_dict()
    assert expected.keys() == got.keys()
    for key in expected:
        assert expected[key].dtype == got[key].dtype, key
        assert torch.equal(expected[key].reshape(-1).view(torch.uint8), got[key].reshape(-1).view(torch.uint8)), key
    # ... so the next step is the very same step.
    opt_a, opt_b = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(loaded.parameters(), lr=0.1)
    assert torch.equal(_step(model, opt_a, 9), _step(loaded, opt_b, 9))
    for key, value in float8_state_dict(model).items():
        assert torch.equal(value, float8_state_dict(loaded)[key]), key


def test_load_float8_state_says_what_is_missing(tmp_path):
    _llama().save_pretrained(tmp_path)  # saved before conversion: no scaling state
    model = convert_to_float8_training(
        transformers.LlamaForCausalLM.from_pretrained(tmp_path), config=DELAYED, module_filter_fn=_keep_head
    )
    with pytest.raises(KeyError, match=r"70 FP8 scaling buffers are not in .*same recipe and module_filter_fn"):
        load_float8_state(model, tmp_path)
    assert len(load_float8_state(model, tmp_path, strict=False)) == 70
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_float8_state(model, tmp_path / "nowhere")


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_accelerate_recipe_convert_then_prepare():
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed")
    model = convert_to_float8_training(
        _llama(), config=Float8LinearConfig.from_recipe("rowwise"), module_filter_fn=_keep_head
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    model, opt = accelerator.prepare(model, opt)
    losses = []
    for _ in range(6):
        tokens = _tokens(0)
        with accelerator.autocast():
            loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    unwrapped = accelerator.unwrap_model(model)
    assert sum(isinstance(m, Float8Linear) for m in unwrapped.modules()) == 14
    assert losses[-1] < losses[0] - 0.3, losses


def test_hf_trainer_recipe(tmp_path):
    pytest.importorskip("accelerate", reason="the HF Trainer needs accelerate")
    base = _llama()
    model = convert_to_float8_training(copy.deepcopy(base), config=DELAYED, module_filter_fn=_keep_head)
    data = [{"input_ids": t, "labels": t} for t in _tokens(5)] * 4
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "run"),
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        use_cpu=True,
        bf16=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    # The histories advanced once per backward, and the Trainer's save keeps them.
    assert all(int((v != 0).sum()) == 6 for k, v in float8_state_dict(model).items() if "amax_history_input" in k)
    trainer.save_model(str(tmp_path / "final"))
    loaded = from_pretrained_float8(
        transformers.LlamaForCausalLM, tmp_path / "final", config=DELAYED, module_filter_fn=_keep_head
    )
    for key, value in float8_state_dict(model).items():
        assert torch.equal(value, float8_state_dict(loaded)[key]), key
