"""Round 5 campaign: ``save_activations_in_float8(recompute=True)`` and its attention handling.

The reference is the same computation without the context (plain torch autograd): gradients
within the docstring's bar (SQNR >= 25 dB for e4m3), bitwise where the tensors stay exact, or
the error autograd itself gives.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from f8tensor import save_activations_in_float8, sqnr

# Measured: 31-40 dB on these shapes (e4m3, block 128); the docstring's bar.
GRAD_MIN_DB = 25.0
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def fp8(**kw):
    """The context compressing every saved tensor (tiny test shapes)."""
    return save_activations_in_float8(min_numel=0, recompute=True, **kw)


def grads(fn, inputs, params=(), ctx=None, retain=False):
    """(output, grads of inputs and params) of ``fn(*inputs).float().pow(2).sum()``."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    for p in params:
        p.grad = None
    if ctx is None:
        out = fn(*leaves)
    else:
        with ctx:
            out = fn(*leaves)
    out.float().pow(2).sum().backward(retain_graph=retain)
    return out.detach(), [x.grad for x in leaves] + [p.grad.clone() for p in params]


def assert_close_db(want, got, db=GRAD_MIN_DB):
    for w, g in zip(want, got, strict=True):
        assert g is not None and g.dtype == w.dtype and g.shape == w.shape
        assert sqnr(w.float(), g.float()) >= db


class LlamaRMSNorm(nn.Module):
    """Hugging Face's RMSNorm, copied."""

    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n) + 0.1 * torch.randn(n))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def randomize(module):
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return module


NORMS = {
    "rms": lambda: nn.RMSNorm(64),
    "rms_eps": lambda: nn.RMSNorm(64, eps=1e-2),
    "rms_no_affine": lambda: nn.RMSNorm(64, elementwise_affine=False),
    "ln": lambda: nn.LayerNorm(64),
    "ln_no_bias": lambda: nn.LayerNorm(64, bias=False),
    "ln_no_affine": lambda: nn.LayerNorm(64, elementwise_affine=False),
    "llama": lambda: LlamaRMSNorm(64),
}


def mlp_with(norm, dtype):
    torch.manual_seed(0)
    return nn.Sequential(randomize(norm), nn.Linear(64, 128), nn.SiLU(), nn.Linear(128, 64)).to(dtype)


# ---------------------------------------------------------------- norms, dtypes


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(NORMS))
def test_recomputed_norm_gradients_match_torch(kind, dtype):
    model = mlp_with(NORMS[kind](), dtype)
    x = torch.randn(4, 8, 64, dtype=dtype)
    params = [p for p in model.parameters()]
    out0, want = grads(model, [x], params)
    out1, got = grads(model, [x], params, fp8())
    assert torch.equal(out0, out1)  # forward unchanged
    assert_close_db(want, got)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_function_recomputed(approximate):
    torch.manual_seed(0)
    lin = nn.Linear(64, 128)
    fn = lambda x: F.gelu(lin(x), approximate=approximate)
    x = torch.randn(16, 64)
    _, want = grads(fn, [x], list(lin.parameters()))
    _, got = grads(fn, [x], list(lin.parameters()), fp8())
    assert_close_db(want, got)


def swiglu_block():
    torch.manual_seed(0)
    gate, up, down = nn.Linear(64, 128), nn.Linear(64, 128), nn.Linear(128, 64)
    params = [*gate.parameters(), *up.parameters(), *down.parameters()]
    return (lambda x: down(F.silu(gate(x)) * up(x))), params


def test_swiglu_product_recomputed():
    fn, params = swiglu_block()
    x = torch.randn(16, 64)
    _, want = grads(fn, [x], params)
    _, got = grads(fn, [x], params, fp8())
    assert_close_db(want, got)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_norm_under_autocast(dtype):
    model = mlp_with(nn.RMSNorm(64), torch.float32)
    x = torch.randn(4, 8, 64)
    params = list(model.parameters())

    def run(x):
        with torch.autocast("cpu", dtype=dtype):
            return model(x)

    _, want = grads(run, [x], params)
    _, got = grads(run, [x], params, fp8())
    assert_close_db(want, got)


# ---------------------------------------------------------------- in-place, retain, double backward


def test_in_place_change_of_a_packed_input_after_forward_raises():
    lin = nn.Linear(64, 64)
    x = torch.randn(16, 64, requires_grad=True)
    h = x * 2
    with fp8():
        y = lin(h)
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_in_place_change_of_a_norm_input_after_forward_raises():
    norm = nn.RMSNorm(64)
    x = torch.randn(16, 64, requires_grad=True)
    h = x * 2
    with fp8():
        y = norm(h)
    with torch.no_grad():
        h.mul_(3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_in_place_change_of_a_silu_output_after_forward_raises():
    lin = nn.Linear(64, 64)
    x = torch.randn(16, 64, requires_grad=True)
    with fp8():
        a = F.silu(lin(x))
        y = a * lin(x)
    with torch.no_grad():
        a.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_in_place_change_of_the_norm_weight_after_forward_raises():
    norm = nn.RMSNorm(64)
    x = torch.randn(16, 64, requires_grad=True)
    with fp8():
        y = norm(x)
    # Plain torch raises too: RMSNorm saves its weight.
    with torch.no_grad():
        norm.weight.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_retain_graph_backward_twice_accumulates_as_torch():
    model = mlp_with(nn.RMSNorm(64), torch.float32)
    x = torch.randn(4, 8, 64)
    params = list(model.parameters())

    def twice(ctx):
        for p in params:
            p.grad = None
        if ctx is None:
            loss = model(x).pow(2).sum()
        else:
            with ctx:
                loss = model(x).pow(2).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        return [p.grad for p in params]

    assert_close_db(twice(None), twice(fp8()))


def test_second_backward_without_retain_graph_raises():
    model = mlp_with(nn.RMSNorm(64), torch.float32)
    with fp8():
        loss = model(torch.randn(4, 64)).pow(2).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()


@pytest.mark.parametrize("leaf", [True, False])
@pytest.mark.parametrize("kind", ["rms", "ln", "llama"])
def test_double_backward_through_a_recomputed_norm(kind, leaf):
    torch.manual_seed(0)
    norm = randomize(NORMS[kind]())
    x0 = torch.randn(16, 64)

    def gradgrad(ctx):
        x = x0.clone().requires_grad_(True)
        h = x if leaf else x * 1.5
        if ctx is None:
            y = norm(h)
        else:
            with ctx:
                y = norm(h)
        (g,) = torch.autograd.grad(y.pow(3).sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad(g.pow(2).sum(), x)
        return [g.detach(), gg]

    assert_close_db(gradgrad(None), gradgrad(fp8()))


def test_double_backward_through_silu():
    torch.manual_seed(0)
    lin = nn.Linear(64, 64)
    x0 = torch.randn(16, 64)

    def gradgrad(ctx):
        x = x0.clone().requires_grad_(True)
        if ctx is None:
            y = F.silu(lin(x))
        else:
            with ctx:
                y = F.silu(lin(x))
        (g,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad(g.pow(2).sum(), x)
        return [g.detach(), gg]

    assert_close_db(gradgrad(None), gradgrad(fp8()))


# ---------------------------------------------------------------- grad modes, nesting, reuse


def test_no_grad_inside_the_context_runs_as_torch():
    model = mlp_with(nn.RMSNorm(64), torch.float32)
    x = torch.randn(4, 64)
    with fp8(), torch.no_grad():
        got = model(x)
    assert torch.equal(got, model(x).detach()) and not got.requires_grad
    assert torch.is_grad_enabled()


def test_inference_mode_inside_the_context_runs_as_torch():
    model = mlp_with(nn.LayerNorm(64), torch.float32)
    x = torch.randn(4, 64)
    with fp8(), torch.inference_mode():
        got = model(x)
    assert torch.equal(got, model(x).detach())


def test_norm_that_raises_runs_once_and_grad_mode_is_restored():
    calls = []

    class Bad(nn.RMSNorm):
        def forward(self, x):
            calls.append(1)
            raise ValueError("broken norm")

    norm = Bad(64)
    x = torch.randn(4, 64, requires_grad=True)
    with fp8(), pytest.raises(ValueError, match="broken norm"):
        norm(x)
    assert torch.is_grad_enabled() and len(calls) == 1


def test_nested_contexts_match_torch():
    model = mlp_with(nn.RMSNorm(64), torch.float32)
    x = torch.randn(4, 8, 64)
    params = list(model.parameters())

    class Nested:
        def __enter__(self):
            self.outer, self.inner = fp8(), fp8(block=32)
            self.outer.__enter__()
            self.inner.__enter__()

        def __exit__(self, *exc):
            self.inner.__exit__(*exc)
            self.outer.__exit__(*exc)

    _, want = grads(model, [x], params)
    _, got = grads(model, [x], params, Nested())
    assert_close_db(want, got)


def test_same_norm_twice_in_one_forward():
    torch.manual_seed(0)
    norm, lin = randomize(nn.RMSNorm(64)), nn.Linear(64, 64)
    fn = lambda x: lin(norm(lin(norm(x))))
    params = [*norm.parameters(), *lin.parameters()]
    x = torch.randn(16, 64)
    _, want = grads(fn, [x], params)
    _, got = grads(fn, [x], params, fp8())
    assert_close_db(want, got)


def test_tied_weights_embedding_and_head():
    torch.manual_seed(0)
    emb, norm = nn.Embedding(100, 64), nn.RMSNorm(64)
    fn = lambda ids: F.linear(norm(emb(ids)), emb.weight)
    ids = torch.randint(0, 100, (4, 16))
    params = [emb.weight, norm.weight]

    def run(ctx):
        for p in params:
            p.grad = None
        if ctx is None:
            out = fn(ids)
        else:
            with ctx:
                out = fn(ids)
        F.cross_entropy(out.flatten(0, 1), ids.flatten()).backward()
        return [p.grad.clone() for p in params]

    assert_close_db(run(None), run(fp8()))


def test_norm_with_forward_hook_changing_its_output():
    torch.manual_seed(0)
    model = mlp_with(nn.RMSNorm(64), torch.float32)
    model[0].register_forward_hook(lambda m, a, out: out * 2)
    model[0].register_forward_pre_hook(lambda m, a: (a[0] + 1,))
    x = torch.randn(4, 8, 64)
    params = list(model.parameters())
    out0, want = grads(model, [x], params)
    out1, got = grads(model, [x], params, fp8())
    assert torch.equal(out0, out1)
    assert_close_db(want, got)


def test_norm_called_with_a_keyword_argument():
    torch.manual_seed(0)
    norm = randomize(nn.LayerNorm(64))
    fn = lambda x: norm(input=x)
    x = torch.randn(16, 64)
    _, want = grads(fn, [x], list(norm.parameters()))
    _, got = grads(fn, [x], list(norm.parameters()), fp8())
    assert_close_db(want, got)


def test_frozen_norm_on_a_frozen_input_saves_nothing_new():
    norm = nn.RMSNorm(64).requires_grad_(False)
    x = torch.randn(16, 64)
    with fp8():
        y = norm(x)
    assert not y.requires_grad and torch.equal(y, norm(x))


# ---------------------------------------------------------------- layouts, edge values


@pytest.mark.parametrize("layout", ["transposed", "expanded", "sliced"])
def test_non_contiguous_inputs(layout):
    torch.manual_seed(0)
    model = mlp_with(nn.RMSNorm(64), torch.float32)
    base = torch.randn(64, 16)
    params = list(model.parameters())

    def fn(b):
        views = {"transposed": b.t(), "expanded": b.t()[None].expand(3, 16, 64), "sliced": b.t()[::2]}
        return model(views[layout])

    _, want = grads(fn, [base], params)
    _, got = grads(fn, [base], params, fp8())
    assert_close_db(want, got)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_activation_stays_non_finite(bad):
    torch.manual_seed(0)
    model = mlp_with(nn.RMSNorm(64), torch.float32)
    x = torch.randn(4, 64)
    x[1, 3] = bad
    params = list(model.parameters())
    _, want = grads(model, [x], params)
    _, got = grads(model, [x], params, fp8())
    for w, g in zip(want, got):
        # Every element torch gets non-finite stays non-finite.
        assert bool((~torch.isfinite(g))[~torch.isfinite(w)].all())
    assert not bool(torch.isfinite(got[0][1]).all())


def test_non_finite_in_one_block_of_a_linear_input_poisons_that_block_only():
    lin = nn.Linear(256, 8)
    x = torch.randn(4, 256)
    h0 = x.clone()
    h0[0, 5] = float("inf")

    def run(ctx):
        lin.weight.grad = None
        h = h0.clone().requires_grad_(True)
        if ctx is None:
            y = lin(h)
        else:
            with ctx:
                y = lin(h)
        y.sum().backward()
        return lin.weight.grad

    want, got = run(None), run(fp8())
    assert not bool(torch.isfinite(got).all())
    assert bool((~torch.isfinite(got))[~torch.isfinite(want)].all())


def test_zero_size_batch():
    model = mlp_with(nn.RMSNorm(64), torch.float32)
    x = torch.randn(0, 64)
    params = list(model.parameters())
    _, want = grads(model, [x], params)
    _, got = grads(model, [x], params, fp8())
    for w, g in zip(want, got):
        assert torch.equal(w, g)


# ---------------------------------------------------------------- attention


def qkv(b=2, heads=4, kv_heads=4, length=16, dim=32, scale=0.3, dtype=torch.float32, seed=0):
    """q, k, v as (B, H, L, D) views of (B, L, H, D) projections, as a model makes them."""
    torch.manual_seed(seed)
    return [(scale * torch.randn(b, length, h, dim)).to(dtype).transpose(1, 2) for h in (heads, kv_heads, kv_heads)]


def sdpa_grads(ctx, q, k, v, **kw):
    def fn(q, k, v):  # q * 1: a leaf that requires grad is saved as is, a projection's output in FP8
        return F.scaled_dot_product_attention(q * 1, k * 1, v * 1, **kw)

    return grads(fn, [q, k, v], ctx=ctx)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_packed_across_heads(dtype):
    q, k, v = qkv(dtype=dtype)
    _, want = sdpa_grads(None, q, k, v)
    _, got = sdpa_grads(fp8(), q, k, v)
    # Measured 27-29 dB (fp32); below the gate, so FP8 is used: not bitwise.
    assert_close_db(want, got)
    assert not torch.equal(want[0], got[0])


@pytest.mark.parametrize("length", [16, 64, 256])
def test_attention_causal(length):
    """Causal rows are sharp (row i attends to i+1 keys): backward's dP - rowsum(dO * O)
    cancels only with the output recomputed from the v it reads (an output rounded apart
    from v measured 24.0-26.7 dB in dq and dk)."""
    q, k, v = qkv(length=length)
    _, want = sdpa_grads(None, q, k, v, is_causal=True)
    _, got = sdpa_grads(fp8(), q, k, v, is_causal=True)
    assert_close_db(want, got)


def test_attention_lower_triangular_bool_mask():
    q, k, v = qkv()
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    _, want = sdpa_grads(None, q, k, v, attn_mask=mask)
    _, got = sdpa_grads(fp8(), q, k, v, attn_mask=mask)
    assert_close_db(want, got)


def test_attention_gqa():
    q, k, v = qkv(heads=4, kv_heads=2)
    _, want = sdpa_grads(None, q, k, v, enable_gqa=True)
    _, got = sdpa_grads(fp8(), q, k, v, enable_gqa=True)
    assert_close_db(want, got)


def test_attention_with_an_all_masked_row():
    q, k, v = qkv()
    mask = torch.zeros(16, 16)
    mask[3] = float("-inf")
    _, want = sdpa_grads(None, q, k, v, attn_mask=mask)
    _, got = sdpa_grads(fp8(), q, k, v, attn_mask=mask)
    for w, g in zip(want, got):
        assert torch.isnan(w).any() == torch.isnan(g).any()
        finite = torch.isfinite(w)
        assert bool(torch.equal(finite, torch.isfinite(g)))
        assert sqnr(w[finite].float(), g[finite].float()) >= GRAD_MIN_DB


def test_attention_bool_mask():
    q, k, v = qkv()
    mask = torch.rand(16, 16) > 0.3
    mask.fill_diagonal_(True)
    _, want = sdpa_grads(None, q, k, v, attn_mask=mask)
    _, got = sdpa_grads(fp8(), q, k, v, attn_mask=mask)
    assert_close_db(want, got)


def test_attention_float_mask_stays_exact():
    q, k, v = qkv()
    mask = torch.randn(2, 1, 16, 16).requires_grad_(True)
    mask0 = mask.detach().clone().requires_grad_(True)

    def run(ctx, m):
        if ctx is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        else:
            with ctx:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        out.pow(2).sum().backward()
        return m.grad

    assert_close_db([run(None, mask0)], [run(fp8(), mask)])


def test_sharp_attention_keeps_every_tensor_exact():
    # Logit bound eps * scale * |q| * |k| >> ATTENTION_LOGIT_ERROR: q, k, v and output stay exact.
    q, k, v = qkv(scale=30.0)
    _, want = sdpa_grads(None, q, k, v)
    _, got = sdpa_grads(fp8(), q, k, v)
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_attention_dropout_in_training_with_the_same_seed():
    q, k, v = qkv()
    torch.manual_seed(5)
    _, want = sdpa_grads(None, q, k, v, dropout_p=0.3)
    torch.manual_seed(5)
    _, got = sdpa_grads(fp8(), q, k, v, dropout_p=0.3)
    assert_close_db(want, got)


def test_attention_with_non_finite_query_stays_non_finite():
    q, k, v = qkv()
    q[0, 1, 2, 3] = float("nan")
    _, want = sdpa_grads(None, q, k, v)
    _, got = sdpa_grads(fp8(), q, k, v)
    for w, g in zip(want, got):
        assert bool((~torch.isfinite(g))[~torch.isfinite(w)].all())


def test_empty_saved_tensors_are_kept_even_at_min_numel_0():
    # Before: a saved (4, 0) operand was reshaped to (-1, 0) for its blocks and raised.
    x = torch.randn(4, 0, requires_grad=True)
    w = torch.randn(0, 8, requires_grad=True)
    with save_activations_in_float8(min_numel=0):
        y = (x * 2) @ (w * 2)
    y.sum().backward()
    assert x.grad.shape == (4, 0) and torch.equal(w.grad, torch.zeros(0, 8))


def test_attention_zero_length():
    q, k, v = qkv(length=0)
    _, want = sdpa_grads(None, q, k, v)
    _, got = sdpa_grads(fp8(), q, k, v)
    for w, g in zip(want, got):
        assert torch.equal(w, g)


# ---------------------------------------------------------------- checkpointing


def block_fn():
    torch.manual_seed(0)
    model = mlp_with(nn.RMSNorm(64), torch.float32)
    return model, list(model.parameters())


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_block_matches_torch(reentrant):
    model, params = block_fn()
    x = torch.randn(4, 8, 64)
    fn = lambda x: checkpoint(model, x, use_reentrant=reentrant)
    _, want = grads(model, [x], params)
    _, got = grads(fn, [x], params, fp8())
    assert_close_db(want, got)


def test_checkpointed_half_of_the_model():
    model, params = block_fn()
    x = torch.randn(4, 8, 64)
    fn = lambda x: model[3](checkpoint(model[:3], x, use_reentrant=False))
    _, want = grads(model, [x], params)
    _, got = grads(fn, [x], params, fp8())
    assert_close_db(want, got)


def test_selective_checkpointing():
    from torch.utils.checkpoint import CheckpointPolicy

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    model, params = block_fn()
    x = torch.randn(4, 8, 64)

    def fn(x):
        return checkpoint(
            model, x, use_reentrant=False, context_fn=lambda: create_selective_checkpoint_contexts(policy)
        )

    _, want = grads(model, [x], params)
    _, got = grads(fn, [x], params, fp8())
    assert_close_db(want, got)


def test_context_entered_inside_a_checkpointed_function():
    model, params = block_fn()
    x = torch.randn(4, 8, 64)

    def inner(x):
        with fp8():
            return model(x)

    fn = lambda x: checkpoint(inner, x, use_reentrant=False)
    _, want = grads(model, [x], params)
    _, got = grads(fn, [x], params)
    assert_close_db(want, got)


# ---------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"block": 0}, ValueError, "block must be a positive int"),
        ({"block": True}, ValueError, "block must be a positive int"),
        ({"float8_dtype": torch.float16}, ValueError, "float8_dtype must be one of"),
        ({"min_numel": -1}, ValueError, "min_numel must be an int >= 0"),
        ({"recompute": 1}, TypeError, "recompute must be a bool"),
        ({"model": "net"}, TypeError, "model must be an nn.Module"),
        ({"module_filter_fn": lambda m, f: True}, ValueError, "module_filter_fn needs model="),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        save_activations_in_float8(**kwargs)


def test_e5m2_gradients():
    model = mlp_with(nn.RMSNorm(64), torch.float32)
    x = torch.randn(4, 8, 64)
    params = list(model.parameters())
    _, want = grads(model, [x], params)
    _, got = grads(model, [x], params, fp8(float8_dtype=torch.float8_e5m2))
    # Measured 21-27 dB: e5m2 has two mantissa bits.
    assert_close_db(want, got, db=18.0)


# ---------------------------------------------------------------- in-place inside forward, filters


def test_in_place_silu_module():
    torch.manual_seed(0)
    model = nn.Sequential(nn.RMSNorm(64), nn.Linear(64, 128), nn.SiLU(inplace=True), nn.Linear(128, 64))
    x = torch.randn(4, 8, 64)
    params = list(model.parameters())
    _, want = grads(model, [x], params)
    _, got = grads(model, [x], params, fp8())
    assert_close_db(want, got)


def test_forward_hook_changing_a_norm_output_in_place():
    torch.manual_seed(0)
    model = mlp_with(nn.RMSNorm(64), torch.float32)
    model[0].register_forward_hook(lambda m, a, out: out.mul_(2))
    x = torch.randn(4, 8, 64)
    params = list(model.parameters())
    out0, want = grads(model, [x], params)
    out1, got = grads(model, [x], params, fp8())
    assert torch.equal(out0, out1)
    assert_close_db(want, got)


def test_norm_output_changed_in_place_after_it_was_saved_raises():
    norm, lin = nn.RMSNorm(64), nn.Linear(64, 64)
    x = torch.randn(16, 64, requires_grad=True)
    with fp8():
        h = norm(x)
        y = lin(h)
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_swiglu_up_output_changed_in_place_after_forward_raises():
    gate, up = nn.Linear(64, 128), nn.Linear(64, 128)
    x = torch.randn(16, 64, requires_grad=True)
    with fp8():
        u = up(x)
        y = F.silu(gate(x)) * u
    with torch.no_grad():
        u.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_filtered_norm_is_not_rewritten_and_matches_torch():
    model = mlp_with(nn.RMSNorm(64), torch.float32)
    x = torch.randn(4, 8, 64)
    params = list(model.parameters())
    keep_norm = lambda module, fqn: fqn != "0"
    _, want = grads(model, [x], params)
    _, got = grads(model, [x], params, fp8(model=model, module_filter_fn=keep_norm))
    assert_close_db(want, got)
    with fp8(model=model, module_filter_fn=keep_norm):
        out = model[0](x.requires_grad_(True))
    assert type(out.grad_fn).__name__ != "_NormBackward"


def test_context_exit_removes_the_global_norm_hooks():
    from torch.nn.modules import module as nn_module

    before = (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks))
    with fp8():
        pass
    assert (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)) == before
    x = torch.randn(4, 64, requires_grad=True)
    assert type(nn.RMSNorm(64)(x).grad_fn).__name__ != "_NormBackward"


# ---------------------------------------------------------------- more norms and attention gates


class FusedAddRMSNorm(nn.Module):
    """A norm returning (normed, residual), as fused-add kernels' wrappers do."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(n))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight), x


def test_norm_returning_a_tuple_matches_torch():
    torch.manual_seed(0)
    norm, lin = FusedAddRMSNorm(64), nn.Linear(64, 64)

    def fn(x):
        h, residual = norm(x)
        return lin(h) + residual

    params = [*norm.parameters(), *lin.parameters()]
    x = torch.randn(16, 64)
    _, want = grads(fn, [x], params)
    _, got = grads(fn, [x], params, fp8())
    assert_close_db(want, got)


def test_norm_on_an_input_without_grad_trains_its_weight():
    torch.manual_seed(0)
    norm, lin = randomize(nn.RMSNorm(64)), nn.Linear(64, 64)
    params = [*norm.parameters(), *lin.parameters()]
    x = torch.randn(16, 64)

    def run(ctx):
        for p in params:
            p.grad = None
        if ctx is None:
            out = lin(norm(x))
        else:
            with ctx:
                out = lin(norm(x))
        out.pow(2).sum().backward()
        return [p.grad.clone() for p in params]

    assert_close_db(run(None), run(fp8()))


def test_fp32_weight_norm_on_bf16_input():
    torch.manual_seed(0)
    norm, lin = LlamaRMSNorm(64), nn.Linear(64, 64).to(torch.bfloat16)
    fn = lambda x: lin(norm(x).to(torch.bfloat16))
    params = [*norm.parameters(), *lin.parameters()]
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    out0, want = grads(fn, [x], params)
    out1, got = grads(fn, [x], params, fp8())
    assert torch.equal(out0, out1)
    assert_close_db(want, got)


def test_same_context_object_entered_twice_nested():
    model = mlp_with(nn.RMSNorm(64), torch.float32)
    x = torch.randn(4, 8, 64)
    params = list(model.parameters())
    ctx = fp8()

    class Twice:
        def __enter__(self):
            ctx.__enter__()
            ctx.__enter__()

        def __exit__(self, *exc):
            ctx.__exit__(*exc)
            ctx.__exit__(*exc)

    _, want = grads(model, [x], params)
    _, got = grads(model, [x], params, Twice())
    assert_close_db(want, got)
    x.requires_grad_(True)
    assert type(model[0](x).grad_fn).__name__ != "_NormBackward"


def test_exception_inside_the_context_removes_its_hooks():
    norm = nn.RMSNorm(64)
    x = torch.randn(4, 64, requires_grad=True)
    with pytest.raises(KeyError, match="boom"), fp8():
        norm(x)
        raise KeyError("boom")
    assert type(norm(x).grad_fn).__name__ != "_NormBackward"
    assert torch.is_grad_enabled()


def test_explicit_scale_enters_the_logit_gate():
    # |q|, |k| small, but scale=30 makes the logits sharp: everything stays exact.
    q, k, v = qkv()
    _, want = sdpa_grads(None, q, k, v, scale=30.0)
    _, got = sdpa_grads(fp8(), q, k, v, scale=30.0)
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_sharp_gqa_attention_stays_exact():
    q, k, v = qkv(heads=4, kv_heads=2, scale=30.0)
    _, want = sdpa_grads(None, q, k, v, enable_gqa=True)
    _, got = sdpa_grads(fp8(), q, k, v, enable_gqa=True)
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_large_float_mask_spread_enters_the_logit_gate():
    # Logits bounded by q, k are small; a mask spanning 40 nats makes the bound sharp.
    q, k, v = qkv()
    mask = torch.linspace(-20, 20, 16).expand(16, 16).contiguous()
    _, want = sdpa_grads(None, q, k, v, attn_mask=mask)
    _, got = sdpa_grads(fp8(), q, k, v, attn_mask=mask)
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_e5m2_attention_uses_its_own_epsilon_in_the_gate():
    # Bound 0.25 * scale * |q| * |k| is above 0.5 at e5m2 where e4m3's is below: exact.
    q, k, v = qkv(scale=0.45)
    _, want = sdpa_grads(None, q, k, v)
    _, got = sdpa_grads(fp8(float8_dtype=torch.float8_e5m2), q, k, v)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    _, e4m3 = sdpa_grads(fp8(), q, k, v)
    assert not torch.equal(want[0], e4m3[0])


@pytest.mark.parametrize("kind", ["rms", "ln", "llama"])
def test_full_backward_hook_on_a_recomputed_norm(kind):
    torch.manual_seed(0)
    model = mlp_with(NORMS[kind](), torch.float32)
    seen = []
    model[0].register_full_backward_hook(lambda m, gin, gout: seen.append((gin[0], gout[0])))
    x = torch.randn(4, 8, 64)
    params = list(model.parameters())
    _, want = grads(model, [x], params)
    plain = seen.pop()
    _, got = grads(model, [x], params, fp8())
    hooked = seen.pop()
    assert not seen
    assert_close_db(want, got)
    assert_close_db(list(plain), list(hooked))


def test_gradient_hook_on_the_norm_weight_runs_once_per_backward():
    torch.manual_seed(0)
    model = mlp_with(nn.RMSNorm(64), torch.float32)
    seen = []

    def halve(g):
        seen.append(g.clone())
        return g * 0.5

    model[0].weight.register_hook(halve)
    x = torch.randn(4, 8, 64)
    params = list(model.parameters())
    _, want = grads(model, [x], params)
    _, got = grads(model, [x], params, fp8())
    assert len(seen) == 2
    assert sqnr(seen[0], seen[1]) >= GRAD_MIN_DB
    assert_close_db(want, got)


def test_norm_run_on_another_thread_inside_the_context():
    import threading

    torch.manual_seed(0)
    model = mlp_with(nn.RMSNorm(64), torch.float32)
    x = torch.randn(4, 8, 64)
    params = list(model.parameters())
    _, want = grads(model, [x], params)

    def fn(x):
        out = []
        worker = threading.Thread(target=lambda: out.append(model(x)))
        worker.start()
        worker.join()
        return out[0]

    _, got = grads(fn, [x], params, fp8())
    assert_close_db(want, got)


def test_double_backward_through_the_norm_weight():
    torch.manual_seed(0)
    norm = randomize(nn.RMSNorm(64))
    x0 = torch.randn(16, 64)

    def gradgrad(ctx):
        x = x0.clone().requires_grad_(True)
        if ctx is None:
            y = norm(x)
        else:
            with ctx:
                y = norm(x)
        (g,) = torch.autograd.grad(y.pow(3).sum(), norm.weight, create_graph=True)
        gw, gx = torch.autograd.grad(g.pow(2).sum(), (norm.weight, x))
        return [g.detach(), gw, gx]

    assert_close_db(gradgrad(None), gradgrad(fp8()))
