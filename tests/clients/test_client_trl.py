"""TRL (``pip install trl``): ``SFTTrainer`` fine-tunes a converted tiny Llama offline (an
in-memory dataset, a tokenizer built here, no download) with its defaults (bf16 autocast,
gradient checkpointing): the loss stays within 2% of the unconverted model's, the weight
gradients match the high-precision model's (SQNR), every converted linear runs its three
products in FP8 (counted), and the saved model reloads (``from_pretrained`` + conversion)
with the trained model's logits."""

from __future__ import annotations

import copy
import random

import pytest
import torch

pytest.importorskip("trl", reason="pip install trl (or pip install 'f8tensor[integrations]')")
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

from f8tensor import convert_to_float8_training
from tests.helpers import FP8Products, weight_grad_sqnr

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_accelerate_state")

WORDS = [f"w{i}" for i in range(56)]


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _dataset() -> Dataset:
    # Counting sequences (w3 w4 w5 ...): a pattern a tiny model learns in a few steps.
    rng = random.Random(0)
    starts = [rng.randrange(0, len(WORDS) - 12) for _ in range(64)]
    return Dataset.from_dict({"text": [" ".join(WORDS[s : s + 12]) for s in starts]})


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
    )
    return LlamaForCausalLM(config)


def _convert(model):
    return convert_to_float8_training(model, module_filter_fn=lambda m, fqn: "lm_head" not in fqn)


def _train(model, out, steps=12):
    args = SFTConfig(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=True,
        seed=0,
        data_seed=0,
        max_length=16,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=_dataset(), processing_class=_tokenizer())
    trainer.train()
    return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_sft_trainer_fine_tunes_like_the_unconverted_model(tmp_path):
    plain = _model()
    fp8 = _convert(copy.deepcopy(plain))
    assert len(fp8.float8_converted_fqns) == 14  # q, k, v, o, gate, up, down in each of 2 layers

    # One backward on the same batch: the FP8 model's weight gradients against fp32's.
    batch = _tokenizer()(_dataset()["text"][:8], return_tensors="pt")
    counter = FP8Products()
    for m in (fp8, plain):
        with counter:
            m(**batch, labels=batch["input_ids"]).loss.backward()
    assert counter.fp8 == 14 * 3  # each converted linear's forward and both backward products
    db = weight_grad_sqnr(fp8, plain)
    assert min(db.values()) >= 18.0, db  # measured 21.3 dB (worst: layers.0.self_attn.q_proj)
    fp8.zero_grad(set_to_none=True)
    plain.zero_grad(set_to_none=True)

    _, want = _train(plain, tmp_path / "plain")
    trainer, got = _train(fp8, tmp_path / "fp8")
    assert got[-1] < 0.8 * got[0]  # it learns: 4.16 -> 3.13 in 12 steps
    assert abs(got[-1] - want[-1]) / want[-1] < 0.02, (want, got)  # measured 0.03% (3.1263 plain, 3.1272 FP8)

    # The saved model reloads: converted again, the same logits as the trained model.
    trainer.save_model(str(tmp_path / "saved"))
    again = _convert(LlamaForCausalLM.from_pretrained(tmp_path / "saved"))
    assert set(again.float8_converted_fqns) == set(fp8.float8_converted_fqns)
    # The trainer ran the model under bf16 autocast (SFTConfig's bf16=True), its forward still
    # wrapped so: the reloaded model under the same autocast.
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(again(**batch).logits, fp8(**batch).logits)
