"""A small Llama-style language model and synthetic data with structure it can learn.

Plain PyTorch, for the end-to-end and memory benchmarks: token embedding, pre-norm
blocks (RMSNorm, causal grouped-query attention with rotary positions through
``F.scaled_dot_product_attention``, SwiGLU MLP), a final RMSNorm and an untied output
projection. Every ``nn.Linear`` in the blocks has dimensions that are multiples of 16, so
FP8 conversion takes all of them; the output projection (``output``) stays in high
precision, as is usual for FP8 training (:func:`fp8_filter`).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    seq: int  # training sequence length
    batch: int  # sequences per step
    lr: float

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def describe(self) -> str:
        return (
            f"dim {self.dim}, {self.layers} layers, {self.heads} heads ({self.kv_heads} KV), "
            f"SwiGLU {self.ffn}, vocab {self.vocab}; batch {self.batch} x seq {self.seq}"
        )


SIZES: dict[str, LlamaConfig] = {
    # CPU default: a few seconds per step in FP8 emulation.
    "tiny": LlamaConfig(vocab=1024, dim=256, layers=2, heads=4, kv_heads=2, ffn=768, seq=128, batch=8, lr=2e-3),
    # Tests and smoke runs.
    "quick": LlamaConfig(vocab=256, dim=64, layers=1, heads=2, kv_heads=1, ffn=192, seq=32, batch=4, lr=3e-3),
    # GPU: ~0.13B parameters, for a quick look.
    "100m": LlamaConfig(vocab=32768, dim=768, layers=12, heads=12, kv_heads=4, ffn=2048, seq=2048, batch=8, lr=6e-4),
    # GPU default: ~0.35B parameters.
    "300m": LlamaConfig(vocab=32768, dim=1024, layers=24, heads=16, kv_heads=8, ffn=2816, seq=2048, batch=8, lr=3e-4),
    # GPU: Llama-3-8B's block widths (head dim 128, GQA 32/8, SwiGLU 14336), 4 of its 32 layers,
    # a 32k vocabulary, one 8192-token sequence: ~1.1B parameters.
    "llama8b-4": LlamaConfig(
        vocab=32768, dim=4096, layers=4, heads=32, kv_heads=8, ffn=14336, seq=8192, batch=1, lr=3e-4
    ),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 (a bf16 mean of squares loses too much), return the input dtype.
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.to(x.dtype) * self.weight


def rotary_tables(seq: int, head_dim: int, base: float = 500000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, (seq, head_dim / 2), fp32."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of each head's features; x: (B, H, S, D)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn, cfg.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """``model(tokens, targets)`` -> mean cross-entropy (fp32); ``model(tokens)`` -> logits."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        cos, sin = rotary_tables(cfg.seq, cfg.head_dim)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights()

    def _init_weights(self) -> None:
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 2:
                # Residual-branch outputs scaled down with depth (GPT-2 style).
                scale = 1 / math.sqrt(2 * self.cfg.layers) if name.endswith(("wo.weight", "w2.weight")) else 1.0
                nn.init.normal_(p, std=std * scale)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        s = tokens.shape[1]
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.output(self.norm(h))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def build_model(cfg: LlamaConfig, device: torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    model = Llama(cfg).to(device=device, dtype=dtype)
    # .to(dtype) casts buffers too: the rotary tables go back to fp32.
    cos, sin = rotary_tables(cfg.seq, cfg.head_dim)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    return model


def fp8_filter(module: nn.Module, fqn: str) -> bool:
    """Which linears FP8 conversion takes: all but the output projection."""
    return fqn != "output"


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def synthetic_batches(
    cfg: LlamaConfig, steps: int, device: torch.device, seed: int = 1234, successors: int = 4
) -> torch.Tensor:
    """``(steps, batch, seq + 1)`` int64 token ids from a fixed sparse Markov chain.

    Each token has ``successors`` possible next tokens (a fixed random table), drawn
    uniformly: a model that learns the table reaches a loss of about ``ln(successors)``
    (1.386 nats for 4; a little less where a row drew one successor twice), from
    ``ln(vocab)`` at the start. Every configuration trains on the same
    batches. Generated on CPU with its own generator, then moved to ``device``.
    """
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(cfg.vocab, (cfg.vocab, successors), generator=g)
    rows = steps * cfg.batch
    out = torch.empty(rows, cfg.seq + 1, dtype=torch.int64)
    out[:, 0] = torch.randint(cfg.vocab, (rows,), generator=g)
    choice = torch.randint(successors, (rows, cfg.seq), generator=g)
    for t in range(cfg.seq):
        out[:, t + 1] = table[out[:, t], choice[:, t]]
    return out.view(steps, cfg.batch, cfg.seq + 1).to(device)
