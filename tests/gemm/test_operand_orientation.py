"""Block orientation and scale layout of every GEMM operand, against a reference written here.

A granularity is written for an operand laid out as ``(rows, contracted)``: its blocks run
along the dim the GEMM contracts. So in ``A (M, K) @ B (K, N)`` a ``(r, c)`` granularity is
the block ``(r, c)`` of A and ``(c, r)`` of B; rowwise is one scale per row of A and per
column of B; tensorwise one scale. The three GEMMs of a linear ``y = x @ W.t()`` are

- output:      A = x (M, K),      B = W.t() (K, N)
- grad_input:  A = g (M, N),      B = W (N, K)
- grad_weight: A = g.t() (N, M),  B = x (M, K)

and the tests below check each operand f8tensor casts for each GEMM (its FP8 bytes and its
scale, shape and bits) against :func:`ref_cast`, which follows the block definition in
plain torch (blocks, amax per block, ``scale = fp8_max / amax``, saturate, cast), not
f8tensor's own cast or ``CastConfig.operand_spec``; and each product's result against the
product of the dequantized reference casts. Inputs are structured (one spike of its own
magnitude per 32x32 tile, on small noise): any other orientation of a block, a transposed
scale or blocks along the wrong dim give other scales, so other bytes.
"""

from __future__ import annotations

import math

import pytest
import torch

import f8tensor.moe.autograd
import f8tensor.nn.linear_autograd
from f8tensor import Float8Linear, Float8LinearConfig, Float8Tensor, float8_grouped_mm
from f8tensor.tensor.fp4 import is_float4
from tests.block_reference import E4M3, E5M2, E8M0, GEMMS, RECIPES, operand_block, ref_cast, spiky  # noqa: F401
from tests.helpers import assert_sqnr


def assert_operand(op: Float8Tensor, hp: torch.Tensor, block, f8, e8m0, what: str) -> torch.Tensor:
    """``op`` is ``hp`` cast with ``block``: same shape, FP8 bytes, scale shape and scale
    bits. Returns the reference's dequantized values."""
    data, scale, deq = ref_cast(hp, block, f8, e8m0)
    assert isinstance(op, Float8Tensor), f"{what}: {type(op).__name__}"
    assert op.shape == hp.shape, f"{what}: shape {tuple(op.shape)}, reference {tuple(hp.shape)}"
    got_scale = op._scale.float()
    assert tuple(got_scale.shape) == tuple(scale.shape), (
        f"{what}: scale shape {tuple(got_scale.shape)}, the reference's blocks {block} give {tuple(scale.shape)}"
    )
    assert torch.equal(got_scale, scale), f"{what}: scale values differ from the reference's"
    assert op._data.dtype == f8, f"{what}: {op._data.dtype}, reference {f8}"
    differ = (op._data.view(torch.uint8) != data.view(torch.uint8)).sum().item()
    assert differ == 0, f"{what}: {differ} of {data.numel()} FP8 bytes differ from the reference"
    return deq


class _Recorder:
    """Wraps a product function: records (args, result) of each call."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, *args, **kwargs):
        out = self.fn(*args, **kwargs)
        self.calls.append((args, out))
        return out


def _linear_run(monkeypatch, recipe: str, m: int = 256, k: int = 384, n: int = 128):
    x, w, gy = spiky((m, k), 1), spiky((n, k), 2), spiky((m, n), 3)
    layer = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        layer.weight.copy_(w)
    fp8 = Float8Linear.from_float(layer, Float8LinearConfig.from_recipe(recipe))
    recorder = _Recorder(f8tensor.nn.linear_autograd.matmul)
    monkeypatch.setattr(f8tensor.nn.linear_autograd, "matmul", recorder)
    xr = x.clone().requires_grad_()
    fp8(xr).backward(gy)
    names = ["output", "grad_input"] + ([] if recipe == "rowwise_with_gw_hp" else ["grad_weight"])
    assert len(recorder.calls) == len(names), [type(c[1]) for c in recorder.calls]
    hp = {"output": (x, w.t()), "grad_input": (gy, w), "grad_weight": (gy.t(), x)}
    return dict(zip(names, recorder.calls)), hp


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_linear_gemm_operands_follow_their_contracted_dim(monkeypatch, recipe):
    calls, hp = _linear_run(monkeypatch, recipe)
    for gemm, ((args, out), (hp_a, hp_b)) in ((g, (calls[g], hp[g])) for g in calls):
        deqs = []
        for (role, side), op, ref in zip(GEMMS[gemm], args[:2], (hp_a, hp_b)):
            gran, f8, e8m0 = RECIPES[recipe][role]
            deqs.append(
                assert_operand(op, ref, operand_block(gran, side), f8, e8m0, f"{recipe} {gemm} {side} ({role})")
            )
        want = deqs[0] @ deqs[1]
        if any(isinstance(g, tuple) for g in (RECIPES[recipe]["input"][0], RECIPES[recipe]["weight"][0])):
            # Block-scaled products run the reference path on CPU: dequantize per block,
            # fp32 matmul, one cast. Bit for bit.
            assert torch.equal(out.float(), want.to(out.dtype).float()), f"{recipe} {gemm}: result differs"
        else:
            # torch._scaled_mm's CPU kernel: its own order of scaling and accumulation.
            # Measured: 138.5 dB (output), 138.5-199 dB (grad_input), 138.5-218 dB (grad_weight).
            assert_sqnr(want, out.float(), 132.0, f"{recipe} {gemm}")


def test_linear_results_are_the_reference_products(monkeypatch):
    """The layer's own outputs (not only the recorded products): the blockwise recipe's
    y, grad_x and grad_W equal the products of the reference casts, bit for bit."""
    x, w, gy = spiky((256, 384), 1), spiky((128, 384), 2), spiky((256, 128), 3)
    layer = torch.nn.Linear(384, 128, bias=False)
    with torch.no_grad():
        layer.weight.copy_(w)
    fp8 = Float8Linear.from_float(layer, Float8LinearConfig.from_recipe("blockwise"))
    xr = x.clone().requires_grad_()
    y = fp8(xr)
    y.backward(gy)
    deq = {
        key: ref_cast(t, operand_block(g, side), E4M3, False)[2]
        for key, t, g, side in (
            ("x_A", x, (1, 128), "A"),
            ("wt_B", w.t(), (128, 128), "B"),
            ("g_A", gy, (1, 128), "A"),
            ("w_B", w, (128, 128), "B"),
            ("gt_A", gy.t(), (1, 128), "A"),
            ("x_B", x, (1, 128), "B"),
        )
    }
    assert torch.equal(y, deq["x_A"] @ deq["wt_B"])
    assert torch.equal(xr.grad, deq["g_A"] @ deq["w_B"])
    assert torch.equal(fp8.weight.grad, deq["gt_A"] @ deq["x_B"])


# Every granularity a tensor can be cast with, on the tensor itself (no GEMM): the block
# spelled per dim and the reference's.
TENSOR_GRANULARITIES = {
    "tensorwise": ("tensorwise", (), False),
    "rowwise": ("rowwise", (1, 0), False),
    "1x128": ((1, 128), (1, 128), False),
    "128x1": ((128, 1), (128, 1), False),
    "128x128": ((128, 128), (128, 128), False),
    "mx_1x32": ("mx", (1, 32), True),
    "mx_32x1": ("mx_t", (32, 1), True),
}


@pytest.mark.parametrize("name", list(TENSOR_GRANULARITIES))
def test_from_hp_blocks_match_the_definition(name):
    from f8tensor import BlockGranularity

    gran, block, e8m0 = TENSOR_GRANULARITIES[name]
    if gran == "mx":
        gran = BlockGranularity((1, 32), E8M0)
    elif gran == "mx_t":
        gran = BlockGranularity((32, 1), E8M0)
    x = spiky((256, 192), 4)
    assert_operand(Float8Tensor.from_hp(x, granularity=gran), x, block, E4M3, e8m0, name)


def test_rowwise_along_each_axis_matches_the_definition():
    from f8tensor.tensor import cast_to_float8

    x = spiky((96, 160), 5)
    for axis, block in ((-1, (1, 0)), (0, (0, 1))):
        assert_operand(cast_to_float8(x, E4M3, axiswise_dim=axis), x, block, E4M3, False, f"axiswise_dim={axis}")


# ----------------------------------------------------------------------------- FP4


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
def test_fp4_gemm_operands_are_blocked_along_their_contracted_dim(monkeypatch, recipe):
    """NVFP4 / MXFP4: each operand's scale grid has its 16- or 32-element blocks along the
    dim its GEMM contracts (16x16 weights: both dims), for every GEMM."""
    calls, hp = _linear_run(monkeypatch, recipe)
    kb = 16 if recipe == "nvfp4" else 32
    weight_block = (16, 16) if recipe == "nvfp4" else (1, 32)
    blocks = {"input": (1, kb), "grad_output": (1, kb), "weight": weight_block}
    for gemm, (args, _) in calls.items():
        for (role, side), op, ref in zip(GEMMS[gemm], args[:2], hp[gemm]):
            assert is_float4(op), f"{recipe} {gemm} {side}: {type(op).__name__}"
            block = operand_block(blocks[role], side)
            grid = tuple(math.ceil(s / b) for s, b in zip(ref.shape, block))
            assert tuple(op._scale.shape) == grid, (
                f"{recipe} {gemm} {side} ({role}): scale {tuple(op._scale.shape)}, want {grid}"
            )


# ----------------------------------------------------------------------------- grouped (MoE)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_grouped_gemm_operands_follow_their_contracted_dim(monkeypatch, recipe):
    """The grouped product (every operand e4m3, per-expert weight scales): x and grad per
    token row (rowwise), each expert's weight per output column in forward and per input
    column in the input-gradient GEMM; the rowwise weight gradient per expert and feature
    from that expert's tokens only (tensorwise: the tensors' own scales)."""
    m, k, n, offs = 96, 64, 48, torch.tensor([32, 32, 96], dtype=torch.int32)
    x, gy = spiky((m, k), 6), spiky((m, n), 7)
    w = torch.stack([spiky((k, n), 8 + e) for e in range(3)])
    recorder = _Recorder(f8tensor.moe.autograd.grouped_mm)
    monkeypatch.setattr(f8tensor.moe.autograd, "grouped_mm", recorder)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = float8_grouped_mm(xr, wr, offs, Float8LinearConfig.from_recipe(recipe))
    y.backward(gy)
    gran = "T" if recipe == "tensorwise" else "R"
    (fwd_args, fwd_out), (bwd_args, bwd_out) = recorder.calls
    starts = [0, 32, 32]
    for gemm, (a8, b8), out, a_hp, b_hp in (
        ("output", fwd_args[:2], fwd_out, x, w),
        ("grad_input", bwd_args[:2], bwd_out, gy, w.transpose(1, 2)),
    ):
        deq_a = assert_operand(a8, a_hp, operand_block(gran, "A"), E4M3, False, f"grouped {gemm} A")
        for e in range(3):
            data, scale = b8._data[e], b8._scale[e]
            ref_data, ref_scale, deq_b = ref_cast(b_hp[e], operand_block(gran, "B"), E4M3, False)
            assert scale.numel() == ref_scale.numel() and torch.equal(scale.reshape(ref_scale.shape), ref_scale), (
                f"grouped {gemm} B expert {e}: scale {tuple(scale.shape)}"
            )
            assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8)), (
                f"grouped {gemm} B expert {e}: bytes"
            )
            rows = slice(starts[e], int(offs[e]))
            want = (deq_a[rows] @ deq_b).to(out.dtype).float()
            # bf16 output of an fp32 product: equal up to one bf16 rounding of the sum order.
            torch.testing.assert_close(out[rows].float(), want, rtol=2**-7, atol=1e-6, msg=f"grouped {gemm} expert {e}")
    # The weight gradient: per expert, A = x[tokens].t() and B = grad[tokens], each
    # scaled along that expert's tokens.
    for e in range(3):
        rows = slice(starts[e], int(offs[e]))
        if rows.stop == rows.start:
            assert torch.count_nonzero(wr.grad[e]) == 0
            continue
        if gran == "T":  # one scale for the whole tensor, as in the other two GEMMs
            deq_a = ref_cast(x.t(), (), E4M3, False)[2][:, rows]
            deq_b = ref_cast(gy, (), E4M3, False)[2][rows]
        else:
            deq_a = ref_cast(x[rows].t(), operand_block(gran, "A"), E4M3, False)[2]
            deq_b = ref_cast(gy[rows], operand_block(gran, "B"), E4M3, False)[2]
        want = (deq_a @ deq_b).to(torch.bfloat16).float()
        torch.testing.assert_close(wr.grad[e], want, rtol=2**-7, atol=1e-6, msg=f"grouped grad_weight expert {e}")


def _grouped_expert_step(monkeypatch, recipe: str, mkn: tuple[int, int, int], seed: int):
    """Forward and backward of ``float8_grouped_mm`` over two experts of ``m / 2`` tokens each
    (spiky tokens, gradients and weights from ``seed`` on), recording every product the
    linear's GEMMs make. Returns ``(x, grad_output, w, recorder)``; ``w`` is ``(2, K, N)``."""
    m, k, n = mkn
    offs = torch.tensor([m // 2, m], dtype=torch.int32)
    x, gy = spiky((m, k), seed), spiky((m, n), seed + 1)
    w = torch.stack([spiky((k, n), seed + 2 + e) for e in range(2)])
    recorder = _Recorder(f8tensor.nn.linear_autograd.matmul)
    monkeypatch.setattr(f8tensor.nn.linear_autograd, "matmul", recorder)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    float8_grouped_mm(xr, wr, offs, Float8LinearConfig.from_recipe(recipe)).backward(gy)
    return x, gy, w, recorder


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_grouped_block_recipes_cast_each_expert_like_a_linear(monkeypatch, recipe):
    """Block recipes run the experts as a loop of the linear's GEMMs: each expert's
    operands are the reference casts of its own tokens and weight, in every GEMM."""
    x, gy, w, recorder = _grouped_expert_step(monkeypatch, recipe, (256, 128, 256), seed=10)
    assert len(recorder.calls) == 6
    roles = RECIPES[recipe]
    # Forward: expert 0, expert 1; backward runs in reverse: expert 1 then expert 0.
    order = [("output", 0), ("output", 1), ("grad_input", 1), ("grad_weight", 1), ("grad_input", 0), ("grad_weight", 0)]
    for (gemm, e), (args, out) in zip(order, recorder.calls):
        rows = slice(128 * e, 128 * (e + 1))
        w_e = w[e].t()  # the linear's (N, K) weight
        hp = {"output": (x[rows], w_e.t()), "grad_input": (gy[rows], w_e), "grad_weight": (gy[rows].t(), x[rows])}[gemm]
        deqs = []
        for (role, side), op, ref in zip(GEMMS[gemm], args[:2], hp):
            gran, f8, e8m0 = roles[role]
            deqs.append(
                assert_operand(op, ref, operand_block(gran, side), f8, e8m0, f"{recipe} expert {e} {gemm} {side}")
            )
        assert torch.equal(out.float(), (deqs[0] @ deqs[1]).to(out.dtype).float()), f"{recipe} expert {e} {gemm}"


def _assert_batched_operand(op: Float8Tensor, hp: torch.Tensor, gran, side: str, per_expert: bool, what: str):
    """A 3D operand of a batched GEMM ``A (B, M, K) @ B (B, K, N)``: each batch entry cast with
    the operand's block (rowwise: per row of A, per column of B), or, for a tensorwise
    activation or gradient, one scale for the whole 3D tensor (per entry for a weight,
    ``per_expert``). Returns the reference's dequantized values."""
    assert isinstance(op, Float8Tensor) and op.shape == hp.shape, f"{what}: {type(op).__name__} {tuple(op.shape)}"
    assert op._data.dtype == E4M3, f"{what}: {op._data.dtype}"
    if gran == "T" and not per_expert:
        data, scale, deq = ref_cast(hp.reshape(-1, hp.shape[-1]), (), E4M3, False)
        data, deq, want_shape = data.reshape(hp.shape), deq.reshape(hp.shape), ()
    else:
        refs = [ref_cast(h, operand_block(gran, side), E4M3, False) for h in hp]
        data, scale, deq = (torch.stack(r) for r in zip(*refs))
        b, rows, cols = hp.shape
        want_shape = (b, 1, 1) if gran == "T" else (b, rows, 1) if side == "A" else (b, 1, cols)
    got = op._scale.float()
    assert tuple(got.shape) == want_shape, f"{what}: scale shape {tuple(got.shape)}, the definition's {want_shape}"
    assert torch.equal(got.reshape(-1), scale.reshape(-1)), f"{what}: scale values differ from the reference's"
    differ = (op._data.view(torch.uint8) != data.view(torch.uint8)).sum().item()
    assert differ == 0, f"{what}: {differ} of {data.numel()} FP8 bytes differ from the reference"
    return deq


@pytest.mark.parametrize("stored", ["row_major", "transposed"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_batched_gemm_operands_follow_their_contracted_dim(monkeypatch, recipe, stored):
    """The batched expert product (``torch.bmm`` over gathered expert weights): in each of
    its three GEMMs every operand is cast along the dim that GEMM contracts, per batch entry
    for the weight, including the weight gradient written in a transposed weight's layout."""
    from f8tensor.moe import _ExpertBmmFn

    b, m, k, n = 3, 32, 64, 48
    x = torch.stack([spiky((m, k), 40 + i) for i in range(b)])
    gy = torch.stack([spiky((m, n), 43 + i) for i in range(b)])
    w_kn = torch.stack([spiky((k, n), 46 + i) for i in range(b)])
    w = w_kn if stored == "row_major" else w_kn.transpose(1, 2).contiguous().transpose(1, 2)
    recorder = _Recorder(f8tensor.moe.autograd.batched_mm)
    monkeypatch.setattr(f8tensor.moe.autograd, "batched_mm", recorder)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    _ExpertBmmFn.apply(xr, wr, Float8LinearConfig.from_recipe(recipe)).backward(gy)
    gran = "T" if recipe == "tensorwise" else "R"
    if stored == "row_major":  # grad_w = x^T (B, K, M) @ grad (B, M, N)
        wgrad = (x.transpose(1, 2), gy, False)
    else:  # in the weight's layout: grad^T (B, N, M) @ x (B, M, K), read transposed
        wgrad = (gy.transpose(1, 2), x, False)
    gemms = [("output", (x, w_kn, True)), ("grad_input", (gy, w_kn.transpose(1, 2), True)), ("grad_weight", wgrad)]
    assert len(recorder.calls) == 3
    for (gemm, (a_hp, b_hp, b_weight)), (args, out) in zip(gemms, recorder.calls):
        deq_a = _assert_batched_operand(args[0], a_hp, gran, "A", False, f"bmm {recipe} {stored} {gemm} A")
        deq_b = _assert_batched_operand(args[1], b_hp, gran, "B", b_weight, f"bmm {recipe} {stored} {gemm} B")
        # The product of the reference casts, rounded once to the kernel's bf16 output:
        # measured 55.1 (output), 76.4-78.1 (grad_input), 129-130 dB (grad_weight).
        assert_sqnr(torch.bmm(deq_a, deq_b), out.float(), 52.0, f"bmm {recipe} {stored} {gemm} result")


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
def test_grouped_fp4_recipes_block_each_expert_along_its_contracted_dim(monkeypatch, recipe):
    """FP4 recipes run the experts as a loop of the linear's GEMMs: each expert's operands
    have their 16- or 32-element blocks along the dim each GEMM contracts (NVFP4's 16x16
    weight blocks: both dims)."""
    x, gy, w, recorder = _grouped_expert_step(monkeypatch, recipe, (64, 128, 96), seed=50)
    kb = 16 if recipe == "nvfp4" else 32
    blocks = {"input": (1, kb), "grad_output": (1, kb), "weight": (16, 16) if recipe == "nvfp4" else (1, kb)}
    order = [("output", 0), ("output", 1), ("grad_input", 1), ("grad_weight", 1), ("grad_input", 0), ("grad_weight", 0)]
    assert len(recorder.calls) == len(order)
    for (gemm, e), (args, _) in zip(order, recorder.calls):
        rows = slice(32 * e, 32 * (e + 1))
        hp = {"output": (x[rows], w[e]), "grad_input": (gy[rows], w[e].t()), "grad_weight": (gy[rows].t(), x[rows])}
        for (role, side), op, ref in zip(GEMMS[gemm], args[:2], hp[gemm]):
            assert is_float4(op), f"{recipe} expert {e} {gemm} {side}: {type(op).__name__}"
            grid = tuple(math.ceil(s / b) for s, b in zip(ref.shape, operand_block(blocks[role], side)))
            assert tuple(op._scale.shape) == grid, (
                f"{recipe} expert {e} {gemm} {side} ({role}): scale {tuple(op._scale.shape)}, want {grid}"
            )


# ----------------------------------------------------------------------------- the CUDA-rules check


def test_rules_check_records_a_block_product_no_kernel_takes():
    """A (128, 1) @ (128, 128) product (the scales' blocks of the two operands): no block-scaled
    kernel takes it (CUDA raises), so the check records it as a violation on CPU."""
    from f8tensor import gemm

    a8 = Float8Tensor.from_hp(spiky((64, 256), 20), granularity=(128, 1))
    b8 = Float8Tensor.from_hp(spiky((256, 128), 21), granularity=(128, 128))
    with gemm.rules_check(raise_on_violation=False) as check:
        check.take()
        calls = check.calls
        torch.mm(a8, b8)
        found = check.take()
    assert check.calls == calls + 1
    assert len(found) == 1 and "no CUDA kernel multiplies a block-(128, 1)" in found[0], found


@pytest.mark.parametrize("grans", [((1, 128), (128, 128)), ((1, 128), (128, 1)), ((128, 128), (128, 1))], ids=str)
def test_rules_check_records_legal_block_products_as_checked(grans):
    """The three DeepSeek kernels' block pairs: each product is checked (counted) and legal."""
    from f8tensor import gemm

    a8 = Float8Tensor.from_hp(spiky((128, 256), 22), granularity=grans[0])
    b8 = Float8Tensor.from_hp(spiky((256, 128), 23), granularity=grans[1])
    with gemm.rules_check(raise_on_violation=False) as check:
        check.take()
        calls = check.calls
        torch.mm(a8, b8)
        found = check.take()
    assert check.calls == calls + 1 and found == []


# ----------------------------------------------------------------------------- in-place copy_


@pytest.mark.parametrize("source", ["float8", "plain"])
def test_copy_into_a_cast_with_a_cached_inverse_scale_gives_the_new_product(source):
    """A tensorwise cast carries ``1 / scale`` for the products that read it
    (``with_inverse_scale``); an in-place ``copy_`` writes a new scale, so a later product
    must read the new inverse, not the cached one (8x off here: the source is 8x larger)."""
    from f8tensor.tensor import with_inverse_scale

    a, b = spiky((32, 64), 30), spiky((64, 48), 31)
    dst = with_inverse_scale(Float8Tensor.from_hp(a))
    assert dst._inv_scale is not None  # the cached inverse this test is about
    new = 8 * spiky((32, 64), 32)
    dst.copy_(Float8Tensor.from_hp(new) if source == "float8" else new)
    want_a = ref_cast(new, (), E4M3, False)[2]
    want_b = ref_cast(b, (), E4M3, False)[2]
    out = torch.mm(dst, b)
    # torch._scaled_mm's CPU kernel vs the fp32 product of the reference casts: measured 143.5 dB
    # (the cached inverse, 8x off, gives 1.2 dB).
    assert_sqnr(want_a @ want_b, out, 137.0, f"copy_ from a {source} tensor")
