"""A model from another library: a small Hugging Face Llama (built from a config, nothing
downloaded), converted with a filter that keeps lm_head in high precision, learns like its
bf16 twin."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from f8tensor import Float8Linear, Float8LinearConfig, convert_to_float8_training

from linear_utils import RECIPE_NAMES

transformers = pytest.importorskip("transformers")

VOCAB = 256
STEPS = 40
SEQ = 32
# Next-token noise: with probability NOISE the next token is uniform instead of the rule's.
NOISE = 0.25
FINAL_LOSS_REL_TOL = 0.15


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config)


class _Tokens:
    """Sequences that follow a fixed random successor rule (token t -> perm[t]), with noise.

    Learnable from bigram statistics alone; the noise keeps a loss floor (~1.9 nats), so
    "within 15%" compares two converged losses rather than two numbers near zero.
    """

    def __init__(self, seed: int = 1) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.successor = torch.randperm(VOCAB, generator=self.gen)
        self.train = [self.batch(8) for _ in range(STEPS)]
        self.eval = self.batch(32)

    def batch(self, b: int) -> torch.Tensor:
        tokens = torch.empty(b, SEQ, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, VOCAB, (b,), generator=self.gen)
        for t in range(1, SEQ):
            noise = torch.rand(b, generator=self.gen) < NOISE
            random = torch.randint(0, VOCAB, (b,), generator=self.gen)
            tokens[:, t] = torch.where(noise, random, self.successor[tokens[:, t - 1]])
        return tokens


def _train(model: nn.Module, data: _Tokens) -> tuple[float, float]:
    """AdamW for STEPS steps; the first training loss and the final held-out loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for tokens in data.train:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        first = loss.item() if first is None else first
    with torch.no_grad():
        return first, model(input_ids=data.eval, labels=data.eval).loss.item()


# Tiny GEMMs: extra threads only add synchronization (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama_and_twin():
    torch.manual_seed(0)
    data = _Tokens()
    model = _llama().to(torch.bfloat16)
    first, twin_loss = _train(copy.deepcopy(model), data)
    assert abs(first - math.log(VOCAB)) < 0.2  # starts at chance
    assert twin_loss < 0.5 * first  # the bf16 twin learns
    return data, model, twin_loss


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_hf_llama_learns_like_its_bf16_twin(recipe, llama_and_twin):
    data, model, twin_loss = llama_and_twin
    fp8 = convert_to_float8_training(
        copy.deepcopy(model),
        config=Float8LinearConfig.from_recipe(recipe),
        module_filter_fn=lambda mod, fqn: "lm_head" not in fqn,
    )
    converted = [fqn for fqn, m in fp8.named_modules() if isinstance(m, Float8Linear)]
    assert len(converted) == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert type(fp8.lm_head) is nn.Linear
    assert fp8.state_dict().keys() >= model.state_dict().keys()

    first, loss = _train(fp8, data)
    assert loss < 0.5 * first, f"{recipe}: held-out loss {loss:.3f} after starting at {first:.3f}"
    assert abs(loss - twin_loss) <= FINAL_LOSS_REL_TOL * twin_loss, (
        f"{recipe}: final loss {loss:.4f} is not within {FINAL_LOSS_REL_TOL:.0%} of the bf16 twin's {twin_loss:.4f}"
    )
