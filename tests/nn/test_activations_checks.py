"""save_activations_in_float8 keeps autograd's checks and its statistics: a tensor changed in
place after it was saved makes backward raise as it does without the context (autograd skips
its own version check under saved-tensor hooks), and attention's logsumexp (a per-row
statistic of its q) stays in its dtype."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_sqnr
from torch import nn

from f8tensor import convert_to_float8_training, save_activations_in_float8
from f8tensor.nn import activations
from f8tensor.nn.activations._recompute import Recomputed


def _model(kind: str) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU())
    return convert_to_float8_training(model) if kind == "float8" else model


def _changed(model: nn.Sequential, what: str, context) -> tuple[torch.Tensor, torch.Tensor]:
    """A forward, then an in-place change of what it saved; returns (loss, the changed tensor)."""
    x = torch.randn(512, 256, requires_grad=True)
    with context:
        h = model[0](x * 1)  # (512, 256): GELU's input, packed in FP8
        small = h[:4] * 1  # below min_numel: saved as it is
        loss = model[1](h).sum() + (small * small).sum()
    changed = {"weight": model[0].weight, "packed": h, "kept": small}[what]
    with torch.no_grad():
        changed.add_(1)
    return loss, changed


@pytest.mark.parametrize("what", ["weight", "packed", "kept"])
@pytest.mark.parametrize("kind", ["nn.Linear", "float8"])
def test_a_change_after_the_save_raises_as_without_the_context(kind, what):
    loss, _ = _changed(_model(kind), what, contextlib.nullcontext())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    loss, changed = _changed(_model(kind), what, save_activations_in_float8())
    now = changed._version
    with pytest.raises(
        RuntimeError, match=rf"modified by an inplace operation: .* at version {now - 1} is now at version {now}"
    ):
        loss.backward()


def _sdpa_grads(q0, k0, v0, g, context, **kwargs) -> tuple[torch.Tensor, ...]:
    q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
    with context:
        out = F.scaled_dot_product_attention(q * 1, k * 1, v * 1, **kwargs)
    return torch.autograd.grad(out, (q, k, v), g)


def _packs(monkeypatch) -> list[tuple[torch.Size, Any]]:
    """Records (shape, what the context stored) for every tensor saved from now on."""
    kept: list[tuple[torch.Size, Any]] = []
    real = activations._Hooks.pack
    monkeypatch.setattr(activations._Hooks, "pack", lambda self, t: kept.append((t.shape, p := real(self, t))) or p)
    return kept


def _in_fp8(kept: list[tuple[torch.Size, Any]], shape: torch.Size) -> int:
    """How many saves of ``shape`` ended in FP8 (not kept, nor made exact afterwards)."""
    return sum(s == shape and isinstance(p, activations._Packed) and p.exact is None for s, p in kept)


def _exact(kept: list[tuple[torch.Size, Any]], shape: torch.Size) -> bool:
    return any(s == shape and not (isinstance(p, activations._Packed) and p.exact is None) for s, p in kept)


@pytest.mark.parametrize(
    ("shape", "qk_scale", "packed", "min_db"),
    [
        # Soft attention (logit error bound 0.09 nats): q, k, v, output in FP8 along memory
        # order, the logsumexp exact. Measured 28.8 dB (q), 28.8 (k), 52.7 (v); the
        # logsumexp in e4m3 too: 16.0 dB.
        ((8, 8, 1024, 16), 0.25, 4, 25.0),
        ((16, 16, 256, 128), 0.25, 4, 25.0),  # measured 28.8 dB (q), 28.7 (k), 52.8 (v)
        # Unit q and k: logits up to 12 (16 per head) and 17 nats (128), a bound of 1.4 and
        # 2.1 nats: all kept exact (in FP8 they measured 23.0 and 25.3 dB): bit-identical.
        ((8, 8, 1024, 16), 1.0, 0, float("inf")),
        ((16, 16, 256, 128), 1.0, 0, float("inf")),
    ],
)
def test_attention_logsumexp_stays_in_its_dtype(monkeypatch, shape, qk_scale, packed, min_db):
    torch.manual_seed(0)
    q, k, v, g = (torch.randn(shape) for _ in range(4))  # logsumexp: (B, H, L), 65,536 elements
    q, k = q * qk_scale, k * qk_scale
    want = _sdpa_grads(q, k, v, g, contextlib.nullcontext())
    kept = _packs(monkeypatch)
    got = _sdpa_grads(q, k, v, g, save_activations_in_float8())
    assert _exact(kept, torch.Size(shape[:-1]))  # the logsumexp
    assert _in_fp8(kept, torch.Size(shape)) == packed  # q, k, v, output
    for name, a, b in zip("qkv", want, got):
        if min_db == float("inf"):
            assert torch.equal(a, b), name
        else:
            assert_sqnr(a, b, min_db, name)


def _mha_grads(in_proj_scale: float, context) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(256, 16, batch_first=True)
    with torch.no_grad():
        mha.in_proj_weight.mul_(in_proj_scale)
    x = torch.randn(8, 512, 256, requires_grad=True)  # logsumexp (8, 16, 512): 65,536 elements
    g = torch.randn(8, 512, 256)
    with context:
        out, _ = mha(x * 1, x * 1, x * 1, need_weights=False)
    gx, gw = torch.autograd.grad(out, (x, mha.in_proj_weight), g)
    return gx, gw


def test_multihead_attention_with_sharp_attention():
    """in_proj_weight x 8: large q and k, sharp attention (logits in the hundreds of nats).
    Its backward recomputes the probabilities from q, k and the logsumexp, and subtracts
    near-equal terms built from v and the output: FP8 q, k, v or output there gave -32 dB
    (FP8 v or output alone: 15 dB). They stay exact, so x's gradient is bit-identical."""
    want = _mha_grads(8.0, contextlib.nullcontext())
    got = _mha_grads(8.0, save_activations_in_float8())
    assert torch.equal(want[0], got[0])  # x: bit-identical (the logsumexp in e4m3: -34.1 dB)
    assert_sqnr(want[1], got[1], 30.0, "in_proj_weight")  # measured 31.7 dB (its input in FP8)


def test_multihead_attention_keeps_its_logsumexp_exact(monkeypatch):
    """Soft attention (in_proj_weight x 0.5): q, k, v and the output of 16 per head in FP8
    (blocks across heads), the logsumexp exact."""
    want = _mha_grads(0.5, contextlib.nullcontext())
    kept = _packs(monkeypatch)
    got = _mha_grads(0.5, save_activations_in_float8())
    assert _exact(kept, torch.Size((8, 16, 512)))  # the logsumexp
    assert _in_fp8(kept, torch.Size((8, 16, 512, 16))) == 4  # q, k, v, output
    assert_sqnr(want[0], got[0], 40.0, "x")  # measured 42.3 dB
    assert_sqnr(want[1], got[1], 30.0, "in_proj_weight")  # measured 31.7 dB


@pytest.mark.parametrize(("bias", "packed", "min_db"), [(0.5, 3, 25.0), (8.0, 0, float("inf"))])
def test_attention_mask_stays_exact(monkeypatch, bias, packed, min_db):
    """A float mask is a logit operand: its -inf in FP8 came back NaN. It stays exact, and
    its spread counts in how sharp the attention may be: a bias of a few nats keeps q, k, v
    in FP8 (measured 28.6 dB) and the output is recomputed from them in backward, one of
    tens of nats keeps them and the output exact (bit-identical)."""
    torch.manual_seed(0)
    q, k, v, g = (torch.randn(2, 4, 256, 16) * 0.25 for _ in range(4))
    mask = torch.randn(2, 1, 256, 256) * bias
    mask[..., 128:] = float("-inf")
    want = _sdpa_grads(q, k, v, g, contextlib.nullcontext(), attn_mask=mask)
    kept = _packs(monkeypatch)
    got = _sdpa_grads(q, k, v, g, save_activations_in_float8(min_numel=0), attn_mask=mask)
    assert _exact(kept, mask.shape) and _in_fp8(kept, mask.shape) == 0
    assert _in_fp8(kept, q.shape) == packed  # q, k, v
    recomputed = [p for shape, p in kept if shape == q.shape and isinstance(p, Recomputed)]
    assert len(recomputed) == (packed > 0) and all(p.kind == "attention" for p in recomputed)
    for name, a, b in zip("qkv", want, got):
        if min_db == float("inf"):
            assert torch.equal(a, b), name
        else:
            assert_sqnr(a, b, min_db, name)


def test_every_fused_attention_node_is_recognised():
    """SDPA's efficient, flash and cuDNN kernels and flash attention's own (CUDA kernels; their
    autograd nodes are built on meta tensors here) save query, key and a logsumexp."""
    q = torch.randn(2, 4, 64, 16, device="meta", requires_grad=True)
    t = q.transpose(1, 2)
    nodes = {
        "efficient": torch.ops.aten._scaled_dot_product_efficient_attention(q * 1, q * 1, q * 1, None, True),
        "flash": torch.ops.aten._scaled_dot_product_flash_attention(q * 1, q * 1, q * 1),
        "cudnn": torch.ops.aten._scaled_dot_product_cudnn_attention(q * 1, q * 1, q * 1, None, True),
        "flash_attention": torch.ops.aten._flash_attention_forward(
            t * 1, t * 1, t * 1, None, None, 64, 64, 0.0, False, False
        ),
    }
    for name, out in nodes.items():
        assert activations._packing._is_attention(out[0].grad_fn), name
    cpu = F.scaled_dot_product_attention(*(torch.randn(1, 1, 4, 8, requires_grad=True) for _ in range(3)))
    assert activations._packing._is_attention(cpu.grad_fn)
    assert not activations._packing._is_attention((q @ q.mT).grad_fn)


def test_a_mask_spread_ignores_masked_positions_and_broadcast_dims():
    mask = torch.full((1, 1, 4, 4), torch.finfo(torch.float32).min)
    mask[..., :2] = torch.tensor([-1.0, 2.5])
    expanded = mask.expand(8, 16, 4, 4)
    assert float(activations._packing._spread(expanded)) == 3.5
    assert float(activations._packing._spread(torch.full((2, 2), float("-inf")))) == 0.0
    assert float(activations._packing._spread(torch.ones(2, 2, dtype=torch.bool))) == 0.0


@pytest.mark.parametrize(("dropout", "stored"), [(0.0, Recomputed), (0.1, activations._Kept)])
def test_causal_attention_output_is_recomputed_unless_dropout(monkeypatch, dropout, stored):
    """Causal attention's output is rebuilt in backward from the q, k, v it saved; with
    dropout (its mask is not saved on every kernel) v and the output stay exact. CUDA's
    efficient-attention node, built on meta tensors (q, k, v of distinct shapes: meta
    tensors share an address, so the context would take equal shapes for one tensor)."""
    q, k, v = (torch.randn(2, 4, n, d, device="meta", requires_grad=True) for n, d in ((256, 16), (128, 16), (128, 32)))
    kept = _packs(monkeypatch)
    with save_activations_in_float8(min_numel=0):
        torch.ops.aten._scaled_dot_product_efficient_attention(q * 1, k * 1, v * 1, None, True, dropout, True)
    outputs = [p for shape, p in kept if shape == (2, 4, 256, 32)]
    assert [type(p) for p in outputs] == [stored]
    assert _in_fp8(kept, q.shape) == _in_fp8(kept, k.shape) == 1
    assert _in_fp8(kept, v.shape) == (stored is Recomputed)  # v exact with dropout
