"""The demo's model and data: a small GPT (byte-level, no tokenizer to ship) in plain
``nn.Linear`` layers, its sizes, and the shipped corpus cut into the same batches for every
run. ``demo`` trains it once per recipe; the benchmarks reuse it.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "CORPUS",
    "GPT",
    "SIZES",
    "VOCAB",
    "Size",
    "batch_starts",
    "get_batch",
    "keep_lm_head_in_high_precision",
    "load_corpus",
]

CORPUS = Path(__file__).resolve().parents[1] / "data" / "corpus.txt"
VOCAB = 256  # byte-level: every byte is a token, no tokenizer to ship


# ===================================================================== the model


@dataclasses.dataclass(frozen=True)
class Size:
    """A model and batch preset. Widths are multiples of 16, as FP8 GEMMs require."""

    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    batch_size: int
    lr: float


SIZES: dict[str, Size] = {
    "tiny": Size(d_model=64, n_layers=2, n_heads=4, seq_len=64, batch_size=8, lr=3e-3),  # tests and CI
    "small": Size(d_model=128, n_layers=2, n_heads=4, seq_len=64, batch_size=16, lr=3e-3),  # CPU default
    "medium": Size(d_model=768, n_layers=8, n_heads=12, seq_len=256, batch_size=32, lr=1e-3),  # GPU default
}
DEFAULT_SIZE = {"cpu": "small", "cuda": "medium"}
DEFAULT_STEPS = {"cpu": 250, "cuda": 400}


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small decoder-only transformer over bytes; returns logits ``(batch, seq, 256)``."""

    def __init__(self, size: Size) -> None:
        super().__init__()
        if size.d_model % size.n_heads:
            raise ValueError(f"d_model {size.d_model} is not divisible by n_heads {size.n_heads}")
        self.tok_emb = nn.Embedding(VOCAB, size.d_model)
        self.pos_emb = nn.Embedding(size.seq_len, size.d_model)
        self.blocks = nn.ModuleList(Block(size.d_model, size.n_heads) for _ in range(size.n_layers))
        self.ln_f = nn.LayerNorm(size.d_model)
        self.lm_head = nn.Linear(size.d_model, VOCAB, bias=False)
        self._init_weights(size.n_layers)

    def _init_weights(self, n_layers: int) -> None:
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                # Projections that write into the residual stream start smaller, so the
                # stream's variance does not grow with depth.
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("proj.weight", "fc2.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def keep_lm_head_in_high_precision(module: nn.Module, fqn: str) -> bool:
    """``module_filter_fn`` for the demo: convert every linear except ``lm_head``."""
    return fqn != "lm_head"


# ===================================================================== data


def load_corpus(device: torch.device) -> torch.Tensor:
    """The shipped text as a 1D tensor of byte values (int64)."""
    raw = CORPUS.read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device=device, dtype=torch.long)


def batch_starts(n_tokens: int, steps: int, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
    """Where each sequence of each step starts: ``(steps, batch_size)``, the same for every run.

    Ask for one step more than you train: the last row is a batch no run trains on.
    """
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_tokens - seq_len - 1, (steps, batch_size), generator=g)


def get_batch(data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = torch.arange(seq_len + 1)
    window = data[(starts[:, None] + offsets).to(data.device)]
    return window[:, :-1], window[:, 1:]
