"""MoE in FP8: grouped and batched FP8 GEMMs, their CUDA rules, 3D Float8Tensors, the expert weight wrapper.

Numerics are SQNR (dB) against float64 products per expert group; the kernel writes bf16,
whose own rounding caps a product near 50 dB, and e4m3 operands put a single GEMM near
28-30 dB on Gaussian data.
"""

from __future__ import annotations

import importlib
import io
import pathlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from f8tensor import Float8LinearConfig, Float8Tensor
from f8tensor import gemm as gg
from f8tensor.compat import TORCH_VERSION
from f8tensor.moe import Float8ExpertWeight, _pad_groups, convert_experts_to_float8, float8_grouped_mm
from f8tensor.moe.autograd import _group_cast, _padded, _padded_to_cast, _spec
from tests.helpers import assert_sqnr, bits, compiled_fp8_casts

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
E4M3 = torch.float8_e4m3fn
RECIPES = ["tensorwise", "rowwise"]
# Groups: empty first and in the middle, single-token, ragged (not multiples of 16), aligned.
SIZES = [0, 1, 3, 17, 40, 0, 16]
K, N = 32, 48
MIN_DB = 24.0  # per group, forward and both gradients (measured 26-31 dB; 55 for a 1-token group)


def _offs(sizes):
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


# ----------------------------------------------------------------------------- grouped GEMMs


@pytest.mark.device_param
@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_fp8_matches_reference_per_group(recipe):
    offs = _offs(SIZES)
    m, g = int(offs[-1]), len(SIZES)
    w = torch.randn(g, N, K, requires_grad=True)
    x = torch.randn(m, K, requires_grad=True)
    y = float8_grouped_mm(x, w.transpose(-2, -1), offs, Float8LinearConfig.from_recipe(recipe))
    grad = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), grad)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end == start:
            assert torch.equal(gw[e], torch.zeros_like(gw[e])), f"expert {e} got no tokens, so no gradient"
            continue
        xr, wr, gr = x[start:end].double(), w[e].double(), grad[start:end].double()
        assert_sqnr(xr @ wr.t(), y[start:end], MIN_DB, f"forward, expert {e}")
        assert_sqnr(gr @ wr, gx[start:end], MIN_DB, f"grad x, expert {e}")
        assert_sqnr(gr.t() @ xr, gw[e], MIN_DB, f"grad w, expert {e}")
        start = end


def test_grouped_rows_past_the_last_offset_are_zero():
    # Tokens routed to no local expert (expert parallelism) sit past offs[-1].
    offs = torch.tensor([4, 10], dtype=torch.int32)
    x = torch.randn(16, K, requires_grad=True)
    w = torch.randn(2, N, K, requires_grad=True)
    y = float8_grouped_mm(x, w.transpose(-2, -1), offs)
    (gx,) = torch.autograd.grad(y.sum(), (x,))
    assert torch.equal(y[10:], torch.zeros_like(y[10:]))
    assert torch.equal(gx[10:], torch.zeros_like(gx[10:]))
    assert_sqnr(x[:4].double() @ w[0].double().t(), y[:4], MIN_DB)


def test_weight_gradient_groups_padded_to_16():
    offs = _offs(SIZES)
    src, pad, padded, p = _pad_groups(offs, int(offs[-1]) + 5)  # 5 rows routed to no group
    sizes = torch.diff(padded, prepend=padded.new_zeros(1))
    assert (sizes % 16 == 0).all() and int(padded[-1]) <= p and p % 16 == 0
    assert src.shape == (p,) and pad.shape == (p, 1)
    kept = torch.zeros(p, dtype=torch.bool)
    start = 0
    for e, end in enumerate(offs.tolist()):
        lo = int(padded[e]) - int(sizes[e])
        assert src[lo : lo + end - start].tolist() == list(range(start, end))
        kept[lo : lo + end - start] = True
        start = end
    assert torch.equal(pad.squeeze(1), ~kept)  # padding rows, and nothing of the unrouted rows


@pytest.mark.parametrize("stored", ["(G, K, N)", "(G, N, K)"])
def test_high_precision_weight_gradient_is_bf16s_own(stored):
    # Unpadded now (the padded copies gave the same sums); the compiled copies: test_compile_counts.
    offs = _offs(SIZES)
    x = torch.randn(int(offs[-1]) + 3, K, dtype=torch.bfloat16)  # 3 rows routed to no group
    grad = torch.randn(x.shape[0], N, dtype=torch.bfloat16)
    base = torch.randn(len(SIZES), K, N) if stored == "(G, K, N)" else torch.randn(len(SIZES), N, K).transpose(-2, -1)
    w = base.to(torch.bfloat16).detach().requires_grad_()
    (expected,) = torch.autograd.grad(torch._grouped_mm(x, w, offs=offs), w, grad)
    config = Float8LinearConfig.from_recipe("rowwise_with_gw_hp")
    (got,) = torch.autograd.grad(float8_grouped_mm(x, w, offs, config), w, grad)
    assert torch.equal(got, expected) and got.stride() == expected.stride()


@pytest.mark.parametrize("sizes", [SIZES, [0, 0, 37, 0], [16, 32, 5, 0]])
def test_group_cast_gather_is_the_pad_groups_gather(sizes):
    offs = _offs(sizes)
    m = int(offs[-1]) + 5  # 5 rows routed to no group
    x = torch.randn(m, K)
    src, pad, _, _ = _pad_groups(offs, m)
    assert torch.equal(_padded_to_cast(x, pad), _padded(x, src, pad))


def test_compiled_group_cast_writes_no_padded_copy(monkeypatch):
    # Before: the gather through _pad_groups' index was written as padded bf16 rows, then read
    # by the amax and the cast passes.
    from torch._inductor.utils import run_and_get_code

    monkeypatch.syspath_prepend(str(BENCH))
    traffic = importlib.import_module("bench_cast_traffic")
    offs, spec = (
        _offs([100, 160, 140, 112]),
        _spec(Float8LinearConfig.from_recipe("rowwise").input, 0, ndim=2, per_expert=False),
    )
    x = torch.randn(512, 256, dtype=torch.bfloat16)

    def group_cast(x, offs):
        _, pad, padded_offs, _ = _pad_groups(offs, x.shape[0])
        data, scale = _group_cast(_padded_to_cast(x, pad), padded_offs, 4, spec)
        return data.view(torch.uint8), scale

    eager = group_cast(x, offs)
    torch._dynamo.reset()
    compiled, (code,) = run_and_get_code(torch.compile(group_cast), x, offs)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
    rows = compiled[0].shape[0]  # padded
    written = traffic.parse_graph_code(code, 1).written_bytes
    assert written < rows * 256 * 2, f"{written} bytes written: a padded bf16 copy is {rows * 256 * 2}"


@pytest.mark.skipif(
    TORCH_VERSION < (2, 12), reason="torch 2.11's partitioner places casts apart (tensorwise 4 + 1, rowwise 4 + 2)"
)
@pytest.mark.parametrize(("recipe", "backward_casts"), [("tensorwise", 1), ("rowwise", 3)])
def test_compiled_weight_gradient_casts_each_operand_once(recipe, backward_casts):
    # Backward's casts (the weight's transposed cast sits in forward, where the partitioner
    # puts it): tensorwise the gradient once, its bytes padded for the weight gradient (a
    # second cast of a padded copy before); rowwise the gradient by rows and by groups, and
    # the input by groups.
    offs = _offs([16, 40, 0, 8])
    x = torch.randn(int(offs[-1]), K, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, N, K, dtype=torch.bfloat16, requires_grad=True)
    config = Float8LinearConfig.from_recipe(recipe)
    _, backward = compiled_fp8_casts(lambda x, w: float8_grouped_mm(x, w.transpose(-2, -1), offs, config), x, w)
    assert backward == backward_casts


def test_reference_kernel_is_exact():
    """The CPU kernel: fp32 sums of FP8 products, times both factors, one rounding to bf16."""
    offs = _offs([5, 0, 11])
    a = (torch.randn(16, K) * 8).to(E4M3)
    b = (torch.randn(3, N, K) * 8).to(E4M3).transpose(-2, -1)
    sa, sb = torch.rand(16) + 0.5, torch.rand(3, N) + 0.5
    out = gg.scaled_grouped_mm(a, b, sa, sb, offs)
    ref = torch.zeros(16, N, dtype=torch.float64)
    start = 0
    for e, end in enumerate(offs.tolist()):
        ref[start:end] = (a[start:end].double() @ b[e].double()) * sa[start:end, None].double() * sb[e].double()
        start = end
    # fp32 accumulation then one bf16 rounding: within half an ulp of bf16 plus fp32 noise.
    torch.testing.assert_close(out.double(), ref, rtol=2.0**-8, atol=0)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a, b, sa, sb, o: (a.view(torch.uint8).view(torch.float8_e5m2), b, sa, sb, o), "only"),
        (lambda a, b, sa, sb, o: (a, b.contiguous(), sa, sb, o), "column-major"),
        (lambda a, b, sa, sb, o: (a, b, sa[:-1], sb, o), "scales for"),
        (lambda a, b, sa, sb, o: (a, b, sa, sb, o.long()), "int32"),
        (lambda a, b, sa, sb, o: (a, b, sa, sb, None), "offs is needed"),
    ],
    ids=["e5m2", "b_row_major", "scale_shape", "offs_int64", "no_offs"],
)
def test_grouped_rules_refuse_illegal_calls(change, message):
    a = torch.randn(16, K).to(E4M3)
    b = torch.randn(2, N, K).to(E4M3).transpose(-2, -1)
    args = change(a, b, torch.ones(16), torch.ones(2, N), _offs([8, 8]))
    with pytest.raises(ValueError, match=message):
        gg.scaled_grouped_mm(*args)


def test_grouped_rules_refuse_fp32_output_and_unaligned_k():
    a, b = torch.randn(16, K).to(E4M3), torch.randn(2, N, K).to(E4M3).transpose(-2, -1)
    with pytest.raises(ValueError, match="output dtype must be one of"):
        gg.scaled_grouped_mm(a, b, torch.ones(16), torch.ones(2, N), _offs([8, 8]), torch.float32)
    with pytest.raises(ValueError, match="multiple of 16"):
        float8_grouped_mm(torch.randn(16, 24), torch.randn(2, 24, N), _offs([8, 8]))


def test_grouped_kernel_not_claimed_on_cpu():
    assert not gg.grouped_kernel_available(torch.device("cpu"))


# ----------------------------------------------------------------------------- 3D Float8Tensors


# Per-expert scales on (E, N, K): one per expert, one per expert row; and one for the tensor.
GRANULARITIES = {"tensorwise": "tensorwise", "per_expert": (1, 0, 0), "per_expert_row": "rowwise"}
EXPERT_BLOCKS = {"tensorwise": (0, 0), "per_expert": (0, 0), "per_expert_row": (1, 0)}


@pytest.mark.parametrize("name", sorted(GRANULARITIES))
def test_expert_layout_ops(name):
    w = torch.randn(4, N, K)
    w8 = Float8Tensor.from_hp(w, granularity=GRANULARITIES[name])
    e2 = w8[2]  # one expert: its own scale (rows)
    assert torch.equal(bits(e2._data), bits(w8._data[2]))
    torch.testing.assert_close(e2.to_hp(), w8.to_hp()[2], rtol=0, atol=0)
    assert e2._block == EXPERT_BLOCKS[name]
    x = torch.randn(5, K)
    assert_sqnr(F.linear(x.double(), w[2].double()), F.linear(x, e2), 25.0, "one expert through F.linear")
    for piece, ref in (
        (w8.transpose(-2, -1), w8.to_hp().transpose(-2, -1)),
        (w8[1:3], w8.to_hp()[1:3]),
        (w8[torch.tensor([3, 0, 3])], w8.to_hp()[torch.tensor([3, 0, 3])]),
        (w8.detach(), w8.to_hp()),
    ):
        assert isinstance(piece, Float8Tensor)
        torch.testing.assert_close(piece.to_hp(), ref, rtol=0, atol=0)
    moved = w8.to(torch.bfloat16)
    assert moved.dtype == torch.bfloat16 and torch.equal(bits(moved._data), bits(w8._data))


def test_index_with_a_2d_tensor_raises():
    w8 = Float8Tensor.from_hp(torch.randn(4, N, K), granularity="rowwise")
    with pytest.raises(NotImplementedError, match="one 1D integer tensor along dim 0"):
        w8[torch.tensor([[0, 1]])]


@pytest.mark.device_param
@pytest.mark.parametrize("name", sorted(GRANULARITIES))
def test_float8tensor_grouped_mm(name):
    offs = _offs([0, 7, 20, 5])
    w, x = torch.randn(4, N, K), torch.randn(32, K)
    w8 = Float8Tensor.from_hp(w, granularity=GRANULARITIES[name])
    y = torch._grouped_mm(x, w8.transpose(-2, -1), offs=offs)
    assert y.dtype == torch.float32 and y.shape == (32, N)
    assert_sqnr(torch._grouped_mm(x, w.transpose(-2, -1), offs=offs), y, 25.0)


@pytest.mark.parametrize("name", sorted(GRANULARITIES))
def test_bmm_is_one_grouped_call(name, monkeypatch):
    calls = {"grouped": 0, "scaled_mm": 0}
    real_grouped, real_mm = gg.scaled_grouped_mm, torch._scaled_mm

    def grouped(*a, **k):
        calls["grouped"] += 1
        return real_grouped(*a, **k)

    def scaled_mm(*a, **k):
        calls["scaled_mm"] += 1
        return real_mm(*a, **k)

    monkeypatch.setattr("f8tensor.gemm.grouped.scaled_grouped_mm", grouped)
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    x, w = torch.randn(6, 5, K, dtype=torch.bfloat16), torch.randn(6, N, K, dtype=torch.bfloat16)
    w8 = Float8Tensor.from_hp(w, granularity=GRANULARITIES[name])
    y = torch.bmm(x, w8.transpose(1, 2))
    assert calls == {"grouped": 1, "scaled_mm": 0}
    assert_sqnr(torch.bmm(x.double(), w.double().transpose(1, 2)), y, 25.0)


# ----------------------------------------------------------------------------- the parameter wrapper


class _Experts(nn.Module):
    """The shape of transformers' experts modules: 3D weights, num_experts."""

    def __init__(self, e=4, h=32, i=16):
        super().__init__()
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * i, h) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(e, h, i) * 0.1)
        self.router = nn.Parameter(torch.randn(e, h))  # 2D: never converted


def test_converter_wraps_3d_expert_weights_only(caplog):
    mod = _Experts()
    with caplog.at_level("INFO", logger="f8tensor"):
        names = convert_experts_to_float8(mod, Float8LinearConfig.from_recipe("rowwise"))
    assert names == ["gate_up_proj", "down_proj"]
    assert isinstance(mod.gate_up_proj, Float8ExpertWeight) and isinstance(mod.gate_up_proj, nn.Parameter)
    assert type(mod.router) is nn.Parameter
    assert "2 expert weights run in FP8" in caplog.text
    skipped = convert_experts_to_float8(_Experts(), Float8LinearConfig(), lambda m, fqn: fqn != "down_proj")
    assert skipped == ["gate_up_proj"]


def test_converter_leaves_unaligned_experts_in_high_precision(caplog):
    mod = _Experts(h=24)
    with caplog.at_level("WARNING", logger="f8tensor"):
        assert convert_experts_to_float8(mod, Float8LinearConfig()) == []
    assert "multiples of 16" in caplog.text and type(mod.down_proj) is nn.Parameter


@pytest.mark.device_param
@pytest.mark.parametrize("recipe", RECIPES)
def test_wrapper_routes_the_three_expert_paths_to_fp8(recipe):
    mod = _Experts()
    ref = {n: p.detach().clone().requires_grad_() for n, p in mod.named_parameters()}
    convert_experts_to_float8(mod, Float8LinearConfig.from_recipe(recipe))
    w, wr = mod.gate_up_proj, ref["gate_up_proj"]
    x = torch.randn(10, 32)
    ids = torch.tensor([0, 3, 3, 1, 2, 0, 1, 1, 2, 3])
    offs = _offs([3, 2, 2, 3])
    cases = {
        "loop": (lambda w: F.linear(x[:4], w[1]), lambda w: F.linear(x[:4], w[1])),
        "bmm": (lambda w: torch.bmm(w[ids], x.unsqueeze(-1)).squeeze(-1), None),
        "grouped": (lambda w: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs), None),
    }
    for name, (fn, _) in cases.items():
        y = fn(w)
        yr = fn(wr)
        g = torch.randn_like(yr)
        (gw,) = torch.autograd.grad(y, (w,), g)
        (gwr,) = torch.autograd.grad(yr, (wr,), g)
        assert type(gw) is torch.Tensor and gw.shape == w.shape
        db = assert_sqnr(yr, y, MIN_DB, f"{name} forward")
        assert db < 45, f"{name}: {db:.1f} dB is high-precision accuracy; the FP8 route was not taken"
        assert_sqnr(gwr, gw, MIN_DB, f"{name} weight gradient")


def test_wrapper_behaves_like_its_tensor_for_training_and_checkpoints():
    mod, plain = _Experts(), _Experts()
    plain.load_state_dict(mod.state_dict())
    convert_experts_to_float8(mod, Float8LinearConfig())
    opt = torch.optim.AdamW(mod.parameters(), lr=0.1)
    x = torch.randn(8, 32)
    torch._grouped_mm(x, mod.gate_up_proj.transpose(-2, -1), offs=_offs([8, 0, 0, 0])).sum().backward()
    opt.step()
    assert isinstance(mod.gate_up_proj, Float8ExpertWeight)
    assert not torch.equal(mod.gate_up_proj._hp, plain.gate_up_proj.detach())
    # state_dict round trips with the unconverted module, also through torch.save(weights_only=True).
    buf = io.BytesIO()
    torch.save(mod.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert all(type(v) is torch.Tensor for v in loaded.values())
    plain.load_state_dict(loaded)
    assert torch.equal(plain.gate_up_proj.detach(), mod.gate_up_proj._hp)
    fresh = _Experts()
    convert_experts_to_float8(fresh, Float8LinearConfig())
    fresh.load_state_dict(plain.state_dict())
    assert isinstance(fresh.gate_up_proj, Float8ExpertWeight)
    assert torch.equal(fresh.gate_up_proj._hp, plain.gate_up_proj.detach())


def test_wrapper_matmul_routes_and_unrouted_products_refuse():
    mod = _Experts()
    convert_experts_to_float8(mod, Float8LinearConfig())
    x = torch.randn(4, 32)
    w = mod.gate_up_proj.detach()
    assert_sqnr(x.double() @ w._hp[1].double().t(), x @ w[1].t(), 27.0, "x @ w[e].t()")  # measured 30.3 dB
    with pytest.raises(NotImplementedError, match="would run in high precision"):
        torch.mm(x, w[1].t())


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
def test_cuda_grouped_route_matches_the_reference(recipe):
    """On sm90/sm100 the products go to torch._scaled_grouped_mm; elsewhere to the reference op."""
    offs = _offs(SIZES).cuda()
    m, g = int(offs[-1]), len(SIZES)
    w = torch.randn(g, N, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    config = Float8LinearConfig.from_recipe(recipe)
    y = float8_grouped_mm(x, w.transpose(-2, -1), offs, config)
    grads = torch.autograd.grad(y, (x, w), torch.ones_like(y))
    xc, wc = x.detach().cpu().requires_grad_(), w.detach().cpu().requires_grad_()
    yc = float8_grouped_mm(xc, wc.transpose(-2, -1), offs.cpu(), config)
    grads_c = torch.autograd.grad(yc, (xc, wc), torch.ones_like(yc))
    # same FP8 bytes and scales; only the accumulation order of the fp32 sums differs
    assert_sqnr(yc, y.cpu(), 40.0, "forward")
    for gc, gg_ in zip(grads_c, grads):
        assert_sqnr(gc, gg_.cpu(), 40.0, "gradient")
