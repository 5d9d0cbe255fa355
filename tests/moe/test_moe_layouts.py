"""The grouped expert GEMMs' memory traffic around the FP8 product, checked on CPU.

Three things the grouped path must not do (each measured on an H100 as a pass over the
whole weight or gradient that costs more than the FP8 product saves):

- return a weight gradient laid out otherwise than its weight: autograd then copies it into
  the weight's layout (``AccumulateGrad``'s transposing ``copy_``, outside any compiled
  graph). Experts are stored (E, N, K) and multiplied as their (E, K, N) transposed view;
- reduce a weight's amax over that transposed view (a reduction whose inner loop strides
  through memory K elements at a time): every amax reads a contiguous tensor;
- take per-expert amaxes with a scatter (``scatter_reduce``: an atomic max per element,
  every row of an expert racing for the same addresses): a segment reduction instead.

And none of it changes a bit: the transposed weight gives the numbers of the same weight
stored row-major (the orientation whose code path is unchanged), eager and compiled agree
bitwise, and the products keep their SQNR against float64 per-group products.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from f8tensor import Float8LinearConfig, float8_grouped_mm
from f8tensor.moe import _ExpertBmmFn
from f8tensor.quant.scaling import segment_amax
from tests.helpers import assert_sqnr

aten = torch.ops.aten
RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]
G, K, N = 4, 32, 48
OFFS = [40, 40, 130, 190]  # an empty group, ragged sizes, rows past offs[-1]
M = 200


def _inputs(seed: int = 0):
    """Structured data: one large row and column per expert weight, one large token and
    feature, one large gradient row, so that a scale taken along the wrong axis costs tens
    of dB."""
    torch.manual_seed(seed)
    w = torch.randn(G, N, K, dtype=torch.bfloat16)  # stored (E, N, K), multiplied as (E, K, N)
    w[:, 3, :] *= 50
    w[:, :, 5] *= 20
    x = torch.randn(M, K, dtype=torch.bfloat16)
    x[7] *= 30
    x[:, 9] *= 10
    grad = torch.randn(M, N, dtype=torch.bfloat16)
    grad[100] *= 40
    return w, x, grad, torch.tensor(OFFS, dtype=torch.int32)


def _step(fn, w_param, x0, grad, view):
    """One forward + backward; returns (out, grad_x, grad of w_param's view (E, K, N))."""
    x = x0.clone().requires_grad_()
    wv = view(w_param)
    out = fn(x, wv)
    gx, gw = torch.autograd.grad(out, (x, wv), grad)
    return out.detach(), gx, gw


def _transposed(w):
    return w.transpose(-2, -1)


def _fn(recipe, offs):
    config = Float8LinearConfig.from_recipe(recipe)
    return lambda x, w: float8_grouped_mm(x, w, offs, config)


# ----------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("recipe", RECIPES)
def test_weight_gradient_has_the_weight_layout(recipe):
    w, x, grad, offs = _inputs()
    w = w.requires_grad_()
    _, _, gw = _step(_fn(recipe, offs), w, x, grad, _transposed)
    # The gradient of the (E, K, N) view, stored as the (E, N, K) weight is: column-major.
    assert gw.shape == (G, K, N)
    assert gw.transpose(-2, -1).is_contiguous(), (
        f"weight gradient strides {gw.stride()}, weight view {_transposed(w).stride()}"
    )
    # A weight stored (E, K, N) gets a row-major gradient.
    w_rows = w.detach().transpose(-2, -1).contiguous().requires_grad_()
    _, _, gw_rows = _step(_fn(recipe, offs), w_rows, x, grad, lambda t: t)
    assert gw_rows.is_contiguous()


def _profiled_ops(step) -> list[str]:
    """Every op one ``step()`` ran, as 'op <- parent <- ...' chains."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    chains = []
    for event in prof.events():
        names, e = [], event
        while e is not None:
            names.append(e.name)
            e = e.cpu_parent
        chains.append(" <- ".join(names))
    return chains


def _copies_and_scatters(chains: list[str]) -> list[str]:
    """The weight-gradient copies autograd makes (``AccumulateGrad``'s ``copy_``) and every scatter."""
    return [
        c for c in chains if (c.startswith("aten::copy_") and "AccumulateGrad" in c) or c.startswith("aten::scatter")
    ]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_training_step_makes_no_gradient_copy_and_no_scatter_eager(recipe):
    w, x, grad, offs = _inputs()
    w, x = w.requires_grad_(), x.requires_grad_()
    fn = _fn(recipe, offs)

    def step():
        w.grad = x.grad = None
        fn(x, w.transpose(-2, -1)).backward(grad)

    step()
    assert _copies_and_scatters(_profiled_ops(step)) == []
    assert w.grad.stride() == w.stride()


class _Reductions(TorchDispatchMode):
    """Records the input of every amax/amin/aminmax and every scatter that runs."""

    def __init__(self):
        super().__init__()
        self.inputs: list[torch.Tensor] = []
        self.scatters: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (aten.amax, aten.amin, aten.aminmax):
            self.inputs.append(args[0])
        if "scatter" in func.overloadpacket.__name__:
            self.scatters.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_amax_reads_a_contiguous_tensor(recipe):
    """The per-expert amaxes read the weight in its stored order (and so does every other
    amax of the step: activations, gradients, the per-group chunks)."""
    w, x, grad, offs = _inputs()
    w = w.requires_grad_()
    with _Reductions() as seen:
        _step(_fn(recipe, offs), w, x, grad, _transposed)
    assert seen.inputs, "no amax ran: the check would pass vacuously"
    strided = [(tuple(t.shape), t.stride()) for t in seen.inputs if not t.is_contiguous()]
    assert strided == [], f"amax over non-contiguous views (shape, strides): {strided}"
    assert seen.scatters == []


def test_batched_expert_weight_gradient_has_the_weight_layout():
    """The bmm route: the same rule for a weight that is a transposed view."""
    torch.manual_seed(1)
    config = Float8LinearConfig.from_recipe("rowwise")
    w = torch.randn(3, N, K, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(3, 16, K, dtype=torch.bfloat16, requires_grad=True)
    wv = w.transpose(1, 2)
    out = _ExpertBmmFn.apply(x, wv, config)
    grad = torch.randn_like(out)
    _, gw = torch.autograd.grad(out, (x, wv), grad)
    assert gw.transpose(1, 2).is_contiguous(), gw.stride()
    ref = torch.bmm(x.detach().double(), wv.detach().double())
    assert_sqnr(ref, out, 28.0, "bmm forward")  # measured 29.2 dB
    assert_sqnr(
        x.detach().double().transpose(1, 2) @ grad.double(), gw, 28.5, "bmm weight gradient"
    )  # measured 30.0 dB


# ----------------------------------------------------------------------------- numbers


def _reference(w, x, grad, offs):
    """float64 per-group products, from the definition: y[rows of g] = x[rows] @ w[g]^T."""
    wd, xd, gd = w.double(), x.double(), grad.double()
    out, gx, gw = (
        torch.zeros(M, N, dtype=torch.float64),
        torch.zeros(M, K, dtype=torch.float64),
        torch.zeros(G, K, N, dtype=torch.float64),
    )
    start = 0
    for g, end in enumerate(OFFS):
        out[start:end] = xd[start:end] @ wd[g].t()
        gx[start:end] = gd[start:end] @ wd[g]
        gw[g] = xd[start:end].t() @ gd[start:end]
        start = end
    return out, gx, gw


# Measured on this data (output, input gradient, weight gradient): tensorwise 28.9 / 30.4 /
# 28.8 dB, rowwise 29.4 / 31.5 / 30.7 dB, rowwise_with_gw_hp 29.4 / 31.5 / 55.5 dB.
MIN_DB = {"tensorwise": (27.5, 29.0, 27.5), "rowwise": (28.0, 30.0, 29.5), "rowwise_with_gw_hp": (28.0, 30.0, 54.0)}


@pytest.mark.parametrize("recipe", RECIPES)
def test_transposed_weight_gives_the_numbers_of_the_row_major_weight(recipe):
    """Casting the weight in its stored order and computing its gradient transposed changes
    no bit: the same weight stored (E, K, N) row-major (the orientation whose code did not
    change) gives bitwise the same output and gradients. And SQNR against float64."""
    w, x, grad, offs = _inputs()
    fn = _fn(recipe, offs)
    got = _step(fn, w.clone().requires_grad_(), x, grad, _transposed)
    rows = _step(fn, w.transpose(-2, -1).contiguous().requires_grad_(), x, grad, lambda t: t)
    for name, a, b in zip(("output", "input gradient", "weight gradient"), got, rows):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (
            f"{recipe} {name}: differs from the row-major weight's"
        )
    for name, ref, a, db in zip(
        ("output", "input gradient", "weight gradient"), _reference(w, x, grad, offs), got, MIN_DB[recipe]
    ):
        assert_sqnr(ref, a, db, f"{recipe} {name}")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_compiled_step_equals_eager_and_makes_no_copy_or_scatter(recipe):
    """Under torch.compile (inductor, CPU): bitwise the eager numbers, and no op outside the
    compiled graphs copies the weight gradient, and no scatter runs inside them."""
    torch._dynamo.reset()
    w, x, grad, offs = _inputs()
    eager = _step(_fn(recipe, offs), w.clone().requires_grad_(), x, grad, _transposed)
    compiled_fn = torch.compile(_fn(recipe, offs), fullgraph=True)
    w_param, x_in = w.clone().requires_grad_(), x.clone().requires_grad_()

    def step():
        w_param.grad = x_in.grad = None
        compiled_fn(x_in, w_param.transpose(-2, -1)).backward(grad)

    step()
    chains = _profiled_ops(step)
    assert any("CompiledFunctionBackward" in c for c in chains), "the backward did not run compiled"
    assert _copies_and_scatters(chains) == []
    out = compiled_fn(x_in, w_param.transpose(-2, -1)).detach()
    for name, a, b in zip(
        ("output", "input gradient", "weight gradient"), eager, (out, x_in.grad, w_param.grad.transpose(-2, -1))
    ):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{recipe} {name}: compiled differs from eager"


# ----------------------------------------------------------------------------- segment_amax


def _segment_amax_reference(x, lengths):
    out, start = [], 0
    for n in lengths:
        seg = x[start : start + n].float()
        out.append(seg.abs().amax(0) if n else torch.zeros(x.shape[1]))
        start += n
    return torch.stack(out)


@pytest.mark.parametrize("rows_per_chunk", [1, 4])
def test_segment_amax_matches_a_loop_and_keeps_non_finite(rows_per_chunk):
    torch.manual_seed(2)
    lengths = [8, 0, 4, 12, 0, 8]
    x = torch.randn(sum(lengths), 5, dtype=torch.bfloat16) * torch.tensor(
        [1.0, 10.0, 0.1, 100.0, 1.0], dtype=torch.bfloat16
    )
    x[13, 0] = -300.0  # a negative extreme: |x| wins
    x[2, 2] = float("nan")
    x[20, 3] = float("-inf")
    got = segment_amax(x, torch.tensor(lengths), rows_per_chunk=rows_per_chunk)
    want = _segment_amax_reference(x, lengths)
    assert got.dtype == torch.float32 and got.shape == (len(lengths), 5)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # exact (a NaN's sign bit aside)
    assert got[0, 2].isnan() and got[3, 3] == float("inf") and got[3, 0] == 300.0
    assert (got[1] == 0).all() and (got[4] == 0).all()


# ----------------------------------------------------------------------------- compiled outputs


@pytest.mark.parametrize("route", ["grouped", "batched"])
def test_traced_function_output_aliases_no_intermediate(route):
    """Compiled on torch 2.11, an autograd.Function whose output is also one of its traced
    intermediates (a no-op ``.to``'s alias) got zero gradients (pytorch/pytorch#180642): the
    expert GEMMs' forward returns a tensor no other traced value is (checked on any torch)."""
    w, x, _, offs = _inputs()
    w, x = w.requires_grad_(), x.requires_grad_()
    config = Float8LinearConfig.from_recipe("rowwise")
    if route == "grouped":
        fn, args = _fn("rowwise", offs), (x, w.transpose(-2, -1))
    else:
        fn, args = (lambda a, b: _ExpertBmmFn.apply(a, b, config)), (x[:192].view(3, 64, K), w[:3].transpose(-2, -1))
    graphs = []
    torch._dynamo.reset()
    torch.compile(fn, fullgraph=True, backend=lambda gm, _: graphs.append(gm) or gm)(*args)
    forwards = [sub for name, sub in graphs[0].named_children() if name.startswith("fwd_body")]
    assert len(forwards) == 1, [name for name, _ in graphs[0].named_children()]
    nodes = list(forwards[0].graph.nodes)
    out = nodes[-1].args[0][0][0]  # the output of ((outputs, intermediates), saved)
    others = [n.name for n in nodes[:-1] if n is not out and n.meta.get("example_value") is out.meta["example_value"]]
    assert others == [], f"the forward's output {out.name} is also {others}"
