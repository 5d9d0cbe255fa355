"""compat.multi_head_attention_forward_with: PyTorch's own attention with ``linear``
replaced (what FP8 ``nn.MultiheadAttention`` runs on), and its refusal of a torch whose
attention reaches its projections under another name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from f8tensor.compat import multi_head_attention_forward_with


def _mha_args(mha, q, k, v):
    return (
        q,
        k,
        v,
        mha.embed_dim,
        mha.num_heads,
        mha.in_proj_weight,
        mha.in_proj_bias,
        mha.bias_k,
        mha.bias_v,
        mha.add_zero_attn,
        mha.dropout,
        mha.out_proj.weight,
        mha.out_proj.bias,
    )


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_every_projection_goes_through_the_replacement_and_nothing_else_changes(cross):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4)
    q = torch.randn(5, 2, 32)
    kv = torch.randn(7, 2, 32) if cross else q
    calls = []

    def linear(x, w, b=None):
        calls.append(tuple(w.shape))
        return F.linear(x, w, b)

    fn = multi_head_attention_forward_with(linear)
    with torch.no_grad():
        got = fn(*_mha_args(mha, q, kv, kv), training=False)
        want = F.multi_head_attention_forward(*_mha_args(mha, q, kv, kv), training=False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # self-attention: one packed (96, 32) product; cross: q (32, 32) and the packed kv
    # (64, 32); then the out-projection
    assert calls == ([(32, 32), (64, 32)] if cross else [(96, 32)]) + [(32, 32)]


def test_a_torch_whose_attention_no_longer_calls_linear_is_refused(monkeypatch):
    def packed(q, k, v, w, b=None):  # a release that multiplies through another name
        return torch.matmul(q, w.t())

    monkeypatch.setattr(F, "_in_projection_packed", packed)
    with pytest.raises(NotImplementedError, match=r"F\._in_projection_packed no longer calls F\.linear"):
        multi_head_attention_forward_with(F.linear)
