"""FSDP2 with FP8 all-gather: the weight wrapper on its own, then FSDP2 on CPU with gloo.

The distributed tests spawn real processes (gloo on 127.0.0.1). Starting a process and
importing torch costs seconds, so each world size is spawned once and runs every
scenario in one go (``_SCENARIOS``); the tests then check their part of the results.
The runs, in order (the checkpoint tests need it):

- 2 ranks: every scenario (FP8 all-gather of every recipe only here), then saves a checkpoint;
- 3 ranks: every scenario except compile, loads the 2-rank checkpoint, saves its own;
- 2 ranks again: loads the 3-rank checkpoint;
- this process (no process group) loads the 2-rank checkpoint into a plain model.

The model (``DIMS``: 32 -> 64 -> 16 -> 1) shards unevenly over 3 ranks (64 rows: 22, 22,
20; 16 rows: 6, 6, 4) and its 1-row head leaves empty shards on every rank but the first.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import io
import itertools
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import free_port, run_processes
from torch import nn

from f8tensor import (
    Float8AllGatherWeight,
    Float8Linear,
    Float8LinearConfig,
    Float8Tensor,
    compat,
    precompute_float8_scales_for_fsdp,
)
from f8tensor.quant.scaling import tensor_amax
from f8tensor.tensor import cast_to_float8

DIMS = (32, 64, 16, 1)
BATCH = 8  # rows per rank and step
STEPS = 4
LR = 0.05
E4M3 = torch.float8_e4m3fn


def _config(recipe: str = "tensorwise", **overrides: object) -> Float8LinearConfig:
    # pad_inner_dim: the 16 -> 1 head has N = 1, zero-padded to 16 in its GEMMs.
    return Float8LinearConfig.from_recipe(recipe, pad_inner_dim=True, **overrides)


FP8_AG = _config(enable_fsdp_float8_all_gather=True)
HP_AG = _config()


def _mlp(
    config: Float8LinearConfig,
    *,
    seed: int = 0,
    bias: bool = True,
    device: str = "cpu",
    layer_configs: dict[int, Float8LinearConfig] | None = None,
    dims: tuple[int, ...] = DIMS,
) -> nn.Sequential:
    """Float8Linear layers over ``dims`` with ReLU between; ``layer_configs`` overrides by layer."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (d_in, d_out) in enumerate(itertools.pairwise(dims)):
        if i:
            layers.append(nn.ReLU())
        linear = nn.Linear(d_in, d_out, bias=bias, device=device)
        layers.append(Float8Linear.from_float(linear, (layer_configs or {}).get(i, config)))
    return nn.Sequential(*layers)


def _batch(step: int, world: int, device: str, dims: tuple[int, ...] = DIMS) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step; rank r takes rows [r * BATCH, (r + 1) * BATCH)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world * BATCH, dims[0], generator=g)
    y = torch.randn(world * BATCH, dims[-1], generator=g)
    return x.to(device), y.to(device)


def _rows(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[rank * BATCH : (rank + 1) * BATCH]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x).float(), y)


def _reference_losses(
    world: int,
    device: str,
    steps: int = STEPS,
    input_dtype: torch.dtype | None = None,
    config: Float8LinearConfig = HP_AG,
    dims: tuple[int, ...] = DIMS,
    first_grads: dict | None = None,
) -> list:
    """One process, the same recipe, grads reduced as data parallelism does.

    Each rank's rows run as their own micro-batch (so every activation cast sees the
    same amax as on that rank); the gradients are summed and divided by the world size.
    The weight is cast from the full fp32 weight, whose amax FSDP reproduces exactly.
    Returns losses[step][rank]; ``first_grads``, when given, receives the first step's
    gradients by parameter name. Delayed scaling runs every micro-batch's forward before
    their backwards, as gradient accumulation does: each rank's forward of a step casts
    with the history as the previous step left it, and so does each micro-batch's here.
    """
    model = _mlp(config, device=device, dims=dims)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for step in range(steps):
        x, y = _batch(step, world, device, dims)
        losses, pending = [], []
        for r in range(world):
            xr = _rows(x, r) if input_dtype is None else _rows(x, r).to(input_dtype)
            loss = _loss(model, xr, _rows(y, r))
            if config.any_delayed:
                pending.append(loss)
            else:
                loss.backward()
            losses.append(loss.item())
        if pending:
            torch.stack(pending).sum().backward()
        for p in model.parameters():
            p.grad.div_(world)
        if step == 0 and first_grads is not None:
            first_grads.update({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        out.append(losses)
    return out


# ======================================================================= in-process tests


def test_wrapper_behaves_like_its_tensor():
    w = torch.randn(32, 16)
    ww = Float8AllGatherWeight(w.clone(), FP8_AG.weight)
    # Storage and views keep the wrapper (FSDP shards and pads through them) ...
    for kept in (ww.detach(), ww[:8], ww.view(-1), ww.clone(), ww.new_zeros(4, 16), torch.chunk(ww, 3)[2]):
        assert type(kept) is Float8AllGatherWeight
    assert torch.chunk(ww, 3)[2].shape == (10, 16)
    # ... everything else computes on the plain tensor and returns plain tensors.
    for plain in (ww * 2, ww.sum(), torch.zeros_like(ww), ww @ torch.ones(16, 2), ww.t()):
        assert type(plain) is torch.Tensor
    torch.testing.assert_close(ww * 2, w * 2, rtol=0, atol=0)
    # In-place ops return the wrapper itself and change the wrapped values.
    assert ww.add_(1.0) is ww
    torch.testing.assert_close(ww._hp, w + 1, rtol=0, atol=0)
    assert ww.zero_() is ww and not ww._hp.any()
    ww.copy_(w)
    torch.testing.assert_close(ww._hp, w, rtol=0, atol=0)


def test_wrapper_flatten_unflatten_roundtrip():
    ww = Float8AllGatherWeight(torch.randn(16, 16), FP8_AG.weight)
    names, meta = ww.__tensor_flatten__()
    back = Float8AllGatherWeight.__tensor_unflatten__({n: getattr(ww, n) for n in names}, meta, ww.shape, ww.stride())
    assert back._hp is ww._hp and back._cast == ww._cast


def test_float8_all_gather_weight_takes_every_recipe():
    for recipe in ("rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8"):
        assert Float8AllGatherWeight(torch.randn(16, 16), _config(recipe).weight)._cast == _config(recipe).weight
    # A delayed cast reads its layer's history: the layer hands itself over.
    with pytest.raises(ValueError, match="needs the DelayedWeightSource of its layer"):
        Float8AllGatherWeight(torch.randn(16, 16), _config("delayed").weight)
    layer = Float8Linear.from_float(nn.Linear(16, 16), _config("delayed", enable_fsdp_float8_all_gather=True))
    assert layer.weight._source.layer() is layer


def test_converted_layer_trains_and_checkpoints_like_a_plain_one():
    """Outside FSDP the flag changes nothing: same losses, plain state dict both ways."""
    models = [_mlp(FP8_AG), _mlp(HP_AG)]
    assert isinstance(models[0][0].weight, nn.Parameter)
    assert isinstance(models[0][0].weight, Float8AllGatherWeight)
    losses = []
    for model in models:
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        trace = []
        for step in range(3):
            x, y = _batch(step, 1, "cpu")
            loss = _loss(model, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            trace.append(loss.item())
        losses.append(trace)
    assert losses[0] == losses[1]
    # Saved as plain tensors (weights_only loading needs no allow-listing) ...
    buf = io.BytesIO()
    torch.save(models[0].state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert all(type(v) is torch.Tensor for v in sd.values())
    torch.testing.assert_close(sd["0.weight"], models[0][0].weight._hp, rtol=0, atol=0)
    # ... and loaded in place into the wrapper, from a model without FP8 all-gather too.
    fresh = _mlp(FP8_AG, seed=1)
    fresh.load_state_dict(models[1].state_dict())
    assert isinstance(fresh[0].weight, Float8AllGatherWeight)
    torch.testing.assert_close(fresh[0].weight._hp, models[1][0].weight, rtol=0, atol=0)


def test_converted_layer_compiles_without_fsdp():
    model = _mlp(FP8_AG)
    x, y = _batch(0, 1, "cpu")
    eager = _loss(model, x, y)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(_loss(compiled, x, y), eager, rtol=0, atol=0)


class _OneRankMesh:
    """Stands in for a DeviceMesh of one rank: no collective is needed."""

    ndim = 1

    def size(self, dim: int | None = None) -> int:
        return 1


def test_precomputed_amax_is_used_until_the_weight_is_written():
    ww = Float8AllGatherWeight(torch.randn(16, 16), FP8_AG.weight)
    stale = torch.tensor(123.0)

    def precompute() -> None:
        ww._precomputed = (stale, ww._writes.n)

    precompute()
    assert ww._reduced_amax(_OneRankMesh()) is stale
    ww.clone().add_(1.0)  # a copy changes, the weight does not
    ww.detach().sum()  # reading a view is no write
    assert ww._reduced_amax(_OneRankMesh()) is stale
    for write in (
        lambda: ww.mul_(2.0),  # an optimizer step
        lambda: ww.detach()[:4].copy_(torch.ones(4, 16)),  # a checkpoint load into a view
        lambda: torch._foreach_add_([ww], [torch.ones(16, 16)]),  # a foreach optimizer
    ):
        precompute()
        write()
        fresh = ww._reduced_amax(_OneRankMesh())
        assert ww._precomputed is None
        torch.testing.assert_close(fresh, ww._hp.abs().max(), rtol=0, atol=0)
        torch.testing.assert_close(ww._tensorwise_scale(_OneRankMesh()), 448.0 / ww._hp.abs().max(), rtol=1e-6, atol=0)


def test_rowwise_gathered_weight_backward_folds_its_row_scales():
    """The weight FSDP hands over after a rowwise FP8 all-gather (one scale per row) gives
    grad_x through (g / s) @ W8: as accurate as one process casting the fp32 weight per
    column (measured 28.6-28.7 dB both, against fp64), in grad_output's dtype."""
    from f8tensor.nn.linear_autograd import LinearArgs, QuantizedLinearFn
    from f8tensor.tensor import to_float8

    cfg = _config("rowwise")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1024, 256, generator=g)
    x = torch.randn(512, 256, generator=g)
    grad_y = torch.randn(512, 1024, generator=g)
    w8 = to_float8(w, cfg.weight.operand_spec(1))
    assert w8._block == (1, 0)
    grads_x = []
    for weight in (nn.Parameter(w8), nn.Parameter(w.clone())):
        xx = x.clone().requires_grad_()
        QuantizedLinearFn.apply(xx, weight, None, LinearArgs(cfg)).backward(grad_y)
        grads_x.append(xx.grad)
        assert weight.grad.shape == w.shape
    assert grads_x[0].dtype == grad_y.dtype
    ref = grad_y.double() @ w.double()
    folded, one_process = (_sqnr_db(ref, gx) for gx in grads_x)
    assert folded >= one_process - 0.5, (folded, one_process)
    assert folded >= 25.0, folded


# ======================================================================= worker side


# The collective FSDP2's all-gather calls: all_gather_single from torch 2.13,
# all_gather_into_tensor before (same (output, input) arguments).
_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


@contextlib.contextmanager
def _recording(name: str, sink: list, what: Callable) -> Iterator[None]:
    """Wrap ``torch.distributed.<name>`` (FSDP and f8tensor look it up at call time)."""
    orig = getattr(dist, name)

    def spy(*args, **kwargs):
        sink.append(what(*args, **kwargs))
        return orig(*args, **kwargs)

    setattr(dist, name, spy)
    try:
        yield
    finally:
        setattr(dist, name, orig)


@contextlib.contextmanager
def _recording_scale_gather(sink: list, what: Callable) -> Iterator[None]:
    """Record ``all_gather_into_tensor`` too where FSDP's own gather is another function."""
    if _ALL_GATHER == "all_gather_into_tensor":
        yield
    else:
        with _recording("all_gather_into_tensor", sink, what):
            yield


def _shard(model: nn.Sequential, mesh, **kwargs) -> nn.Sequential:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _train(model, opt, rank, world, device, steps=STEPS, precompute=False, first_step=0, dims=DIMS) -> dict:
    """Train on this rank's rows; count the all-reduces inside steps and inside precompute."""
    losses, in_steps, in_precompute = [], [], []
    for step in range(first_step, first_step + steps):
        x, y = _batch(step, world, device, dims)
        with _recording("all_reduce", in_steps, lambda *a, **k: 1):
            loss = _loss(model, _rows(x, rank), _rows(y, rank))
            loss.backward()
            opt.step()
            opt.zero_grad()
        if precompute:
            with _recording("all_reduce", in_precompute, lambda *a, **k: 1):
                precompute_float8_scales_for_fsdp(model)
        losses.append(loss.item())
    return {"losses": losses, "all_reduces_in_steps": len(in_steps), "all_reduces_in_precompute": len(in_precompute)}


def _fp8_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, Float8Linear) and m.config.enable_fsdp_float8_all_gather]


def _unsharded_matches_single_process_cast(model: nn.Module) -> list[bool]:
    """Per FP8 layer: are the gathered bytes and scale those of casting the full weight?"""
    out = []
    for layer in _fp8_layers(model):
        full = layer.weight.full_tensor()  # a plain tensor, not a wrapper
        assert type(full) is torch.Tensor, type(full)
        layer.unshard()
        w8 = layer.weight
        expected = cast_to_float8(full, E4M3)
        out.append(
            isinstance(w8, Float8Tensor)
            and w8.shape == full.shape
            and torch.equal(w8._data.view(torch.uint8), expected._data.view(torch.uint8))
            and torch.equal(w8._scale, expected._scale)
        )
        layer.reshard()
    return out


def _scenario_parity(rank, world, mesh, ctx, *, reshard_after_forward: bool, precompute: bool) -> dict:
    device = ctx["device"]
    model = _shard(_mlp(FP8_AG, device=device), mesh, reshard_after_forward=reshard_after_forward)
    weights = {n: p for n, p in model.named_parameters() if n.endswith("weight")}
    result = {
        "wrapped": all(isinstance(p._local_tensor, Float8AllGatherWeight) for p in weights.values()),
        "shard_rows": [p._local_tensor.shape[0] for p in weights.values()],
    }
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    result.update(_train(model, opt, rank, world, device, precompute=precompute))
    calls: list = []
    with _recording("all_reduce", calls, lambda *a, **k: 1):
        result["unsharded_exact"] = _unsharded_matches_single_process_cast(model)
    result["all_reduces_in_unshard"] = len(calls)
    if precompute:
        # The weights change after the precompute (through DTensor, as an optimizer step
        # does): the stored scales must be dropped, and each all-gather reduces again.
        with torch.no_grad():
            for p in weights.values():
                p.mul_(1.5)
        calls.clear()
        with _recording("all_reduce", calls, lambda *a, **k: 1):
            result["unsharded_exact_after_change"] = _unsharded_matches_single_process_cast(model)
        result["all_reduces_after_change"] = len(calls)
    if rank == 0:
        result["reference"] = _reference_losses(world, device)
    return result


def _scenario_bytes(rank, world, mesh, ctx) -> dict:
    """Bytes the all-gather collective receives in one forward (bias-free model)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    device = ctx["device"]
    x, _ = _batch(0, world, device)
    out = {}
    for name, config, param_dtype in (
        ("fp8", FP8_AG, None),
        ("fp32", HP_AG, None),
        ("fp8_mp_bf16", FP8_AG, torch.bfloat16),
        ("bf16", HP_AG, torch.bfloat16),
    ):
        model = _shard(
            _mlp(config, bias=False, device=device), mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype)
        )
        calls: list = []
        record = _recording(_ALL_GATHER, calls, lambda o, i, *a, **k: (str(o.dtype), o.numel() * o.element_size()))
        with record, torch.no_grad():
            model(_rows(x, rank))
        out[name] = calls
    return out


def _scenario_delayed(rank, world, mesh, ctx) -> dict:
    """Delayed scaling under FSDP2 with a high-precision all-gather (FP8 all-gather:
    _scenario_fp8_all_gather_recipes)."""
    device = ctx["device"]
    model = _shard(_mlp(_config("delayed"), device=device), mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    result = _train(model, opt, rank, world, device, steps=3)
    # The persistent parts by name (Float8Linear.float8_state), and the buffers they live in.
    state = {
        f"{fqn}.{n}": v
        for fqn, m in model.named_modules()
        if hasattr(m, "float8_state")
        for n, v in m.float8_state().items()
    }
    result["buffers"] = {n: b.detach().cpu().clone() for n, b in [*model.named_buffers(), *state.items()]}
    x, _ = _batch(0, world, device)
    result["local_input_amax"] = tensor_amax(_rows(x, rank)).item()
    return result


def _scenario_compile(rank, world, mesh, ctx) -> dict:
    from torch._dynamo.testing import CompileCounterWithBackend

    device = ctx["device"]
    counter = CompileCounterWithBackend("aot_eager")
    model = _mlp(FP8_AG, device=device)
    for i, layer in enumerate(model):
        if isinstance(layer, Float8Linear):
            model[i] = torch.compile(layer, backend=counter, fullgraph=True)
    _shard(model, mesh, reshard_after_forward=True)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    first = _train(model, opt, rank, world, device, steps=1)
    frames_after_first_step = counter.frame_count
    rest = _train(model, opt, rank, world, device, steps=STEPS - 1, precompute=True, first_step=1)
    return {
        "losses": first["losses"] + rest["losses"],
        "frames_after_first_step": frames_after_first_step,
        "frames_at_end": counter.frame_count,
    }


def _scenario_mixed_precision(rank, world, mesh, ctx) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    device = ctx["device"]
    model = _shard(_mlp(FP8_AG, device=device), mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    seen = []
    model[0].register_forward_pre_hook(lambda m, args: seen.append((type(m.weight).__name__, str(m.weight.dtype))))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    result = _train(model, opt, rank, world, device)
    result["unsharded_weight"] = seen[0]
    if rank == 0:
        result["reference"] = _reference_losses(world, device, input_dtype=torch.bfloat16)
    return result


BLOCK_RECIPES = ("blockwise", "mxfp8")


def _scenario_block_recipes(rank, world, mesh, ctx) -> dict:
    """Block-scaled recipes under FSDP2 with a high-precision all-gather (fp32 parameters,
    and bf16 through a MixedPrecisionPolicy): each layer casts the gathered weight itself.
    (FP8 all-gather of block weights: _scenario_fp8_all_gather_recipes.)"""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    device = ctx["device"]
    out = {}
    for recipe in BLOCK_RECIPES:
        model = _shard(_mlp(_config(recipe), device=device), mesh)
        res = _train(model, torch.optim.SGD(model.parameters(), lr=LR), rank, world, device)
        bf16 = _shard(
            _mlp(_config(recipe), device=device), mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        )
        res["bf16_losses"] = _train(bf16, torch.optim.SGD(bf16.parameters(), lr=LR), rank, world, device)["losses"]
        if rank == 0:
            res["reference"] = _reference_losses(world, device, config=_config(recipe))
        out[recipe] = res
    return out


FP8_AG_RECIPES = ("rowwise", "rowwise_with_gw_hp", "delayed", "blockwise", "mxfp8")


def _block_dims(world: int) -> tuple[int, ...]:
    # 128x128 weight blocks: every FSDP chunk of rows (ceil(rows / world)) holds whole blocks.
    return (128, 128 * world, 128 * world)


def _gathered_matches_single_process_cast(model: nn.Module, recipe: str) -> list[bool]:
    """Per FP8 layer: are the gathered bytes and scales those of casting the full weight in
    one process as the recipe's definition states it (test_orientation.ref_cast, not the
    operand_spec under test; delayed: with the scale of the layer's history, which the
    gather used)?"""
    from f8tensor.kernels import cast
    from f8tensor.quant.config import CastSpec
    from f8tensor.quant.scaling import delayed_scale
    from tests.block_reference import RECIPES as DEFINITION
    from tests.block_reference import operand_block, ref_cast

    out = []
    for layer in _fp8_layers(model):
        full = layer.weight.full_tensor()
        wcast = layer.config.weight
        if wcast.delayed:
            d = layer.config.delayed
            scale = delayed_scale(layer.amax_history_weight, wcast.dtype, reduction=d.reduction, margin=d.margin)
            data, scale = cast(full, CastSpec(wcast.dtype), scale)
        else:  # the weight (N, K) is the output GEMM's B transposed: blocked as an A (rows, K)
            gran, f8, e8m0 = DEFINITION[recipe]["weight"]
            data, scale, _ = ref_cast(full, operand_block(gran, "A"), f8, e8m0)
        layer.unshard()
        w8 = layer.weight
        out.append(
            isinstance(w8, Float8Tensor)
            and w8.shape == full.shape
            and torch.equal(w8._data.view(torch.uint8), data.view(torch.uint8))
            and w8._scale.numel() == scale.numel()
            and torch.equal(w8._scale.float().reshape(-1), scale.float().reshape(-1))
        )
        layer.reshard()
    return out


def _scenario_fp8_all_gather_recipes(rank, world, mesh, ctx) -> dict:
    """FP8 all-gather for every recipe but tensorwise (covered above): the gathered bytes,
    the first step's gradients and the losses against one process; the bytes moved; shards
    that cut 128x128 blocks (more in distributed/test_fsdp_block_shards.py)."""
    device = ctx["device"]
    out = {}
    for recipe in FP8_AG_RECIPES:
        dims = _block_dims(world) if recipe == "blockwise" else DIMS
        model = _shard(_mlp(_config(recipe, enable_fsdp_float8_all_gather=True), device=device, dims=dims), mesh)
        res = {
            "wrapped": all(
                isinstance(layer.weight._local_tensor, Float8AllGatherWeight) for layer in _fp8_layers(model)
            )
        }
        calls: list = []
        size = lambda o, i, *a, **k: (str(o.dtype), o.numel() * o.element_size())
        x, y = _batch(0, world, device, dims)
        # FSDP's own all-gather (all_gather_single from torch 2.13) and the scales' gather of
        # an uneven shard (all_gather_into_tensor, which FSDP itself uses before 2.13).
        with _recording(_ALL_GATHER, calls, size), _recording_scale_gather(calls, size):
            loss = _loss(model, _rows(x, rank), _rows(y, rank))
        res["gathered"] = calls
        res["gathered_bytes"] = sum(b for _, b in calls)
        loss.backward()
        res["first_grads"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        opt.step()
        opt.zero_grad()
        res["losses"] = [loss.item()] + _train(
            model, opt, rank, world, device, steps=STEPS - 1, first_step=1, dims=dims
        )["losses"]
        res["exact"] = _gathered_matches_single_process_cast(model, recipe)
        if recipe == "delayed":
            res["histories"] = [layer.amax_history_weight.clone() for layer in _fp8_layers(model)]
        # Delayed scaling all-reduces its amaxes whenever a process group exists: every rank
        # runs that reference (the same collectives on each).
        if rank == 0 or recipe == "delayed":
            grads: dict = {}
            res["reference"] = _reference_losses(world, device, config=_config(recipe), dims=dims, first_grads=grads)
            res["reference_grads"] = grads
        out[recipe] = res
    # FSDP chunks of 64 / world rows cut 128-row blocks: the ranks agree on the blocks'
    # amaxes, and the gathered weight is still one process's cast.
    cut = _shard(
        _mlp(_config("blockwise", enable_fsdp_float8_all_gather=True), device=device, dims=(128, 128, 16)), mesh
    )
    cut(torch.randn(4, 128, device=device))
    out["cut_block_exact"] = _gathered_matches_single_process_cast(cut, "blockwise")
    return out


def _dcp_model(seed: int, device: str) -> nn.Sequential:
    # FP8 all-gather everywhere but the middle layer, which keeps delayed-scaling state.
    return _mlp(FP8_AG, seed=seed, device=device, layer_configs={1: _config("delayed")})


def _full_state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optim": osd}


def _scenario_dcp_save(rank, world, mesh, ctx) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    device, root = ctx["device"], Path(ctx["checkpoints"])
    model = _shard(_dcp_model(0, device), mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, rank, world, device, steps=2, precompute=True)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=root / f"ranks{world}")
    full = _full_state(model, opt)
    if rank == 0:
        torch.save(full, root / f"ranks{world}_full.pt")
    # After the full state is taken: a delayed layer's forward rewrites its scale buffers.
    return {"saved": True, "next_loss": _next_step_loss(model, device)}


def _next_step_loss(model: nn.Module, device: str) -> float:
    """The loss of the next step's whole batch (steps 0 and 1 were trained), the same input
    on every rank: what a run resumed from the checkpoint computes first."""
    x, y = _batch(2, 1, device)
    with torch.no_grad():
        return _loss(model, x, y).item()


def _scenario_dcp_load(rank, world, mesh, ctx, *, saved_by: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    device, root = ctx["device"], Path(ctx["checkpoints"])
    model = _shard(_dcp_model(1, device), mesh)  # another init: the load must overwrite it
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, opt)  # also creates the optimizer state
    # A scale for the weights as they are now: loading must make it unusable.
    precompute_float8_scales_for_fsdp(model)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=root / f"ranks{saved_by}")
    locals_ = [layer.weight._local_tensor for layer in _fp8_layers(model)]
    dropped_by_dcp_load = [w._precomputed[1] != w._writes.n for w in locals_]
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    result = {
        "shard_rows": [w.shape[0] for w in locals_],
        "dropped_by_dcp_load": dropped_by_dcp_load,
        "dropped_by_set_state_dict": [w._precomputed is None or w._precomputed[1] != w._writes.n for w in locals_],
        "wrapped": all(isinstance(layer.weight._local_tensor, Float8AllGatherWeight) for layer in _fp8_layers(model)),
        "unsharded_exact": _unsharded_matches_single_process_cast(model),
    }
    full = _full_state(model, opt)
    if rank == 0:
        saved = torch.load(root / f"ranks{saved_by}_full.pt", weights_only=True)
        result["mismatches"] = _compare_nested(saved, full)
        result["compared"] = _count_tensors(saved)
    result["next_loss"] = _next_step_loss(model, device)
    result["loss_after_load"] = _train(model, opt, rank, world, device, steps=1)["losses"][0]
    return result


def _compare_nested(a, b, path: str = "") -> list[str]:
    """Paths where two nested state dicts differ (tensors compared bit for bit)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return [m for k in a for m in _compare_nested(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: lengths {len(a)} != {len(b)}"]
        return [m for i, (x, y) in enumerate(zip(a, b)) for m in _compare_nested(x, y, f"{path}/{i}")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = type(b) is torch.Tensor and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [f"{path}: tensors differ"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def _count_tensors(a) -> int:
    if isinstance(a, dict):
        return sum(_count_tensors(v) for v in a.values())
    if isinstance(a, (list, tuple)):
        return sum(_count_tensors(v) for v in a)
    return int(isinstance(a, torch.Tensor))


_SCENARIOS: dict[str, Callable] = {
    "parity": _scenario_parity,
    "bytes": _scenario_bytes,
    "delayed": _scenario_delayed,
    "compile": _scenario_compile,
    "mixed_precision": _scenario_mixed_precision,
    "block_recipes": _scenario_block_recipes,
    "fp8_all_gather_recipes": _scenario_fp8_all_gather_recipes,
    "dcp_save": _scenario_dcp_save,
    "dcp_load": _scenario_dcp_load,
}


def _worker(rank: int, world: int, port: int, jobs: list, ctx: dict, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if sys.platform == "linux":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    device = ctx["device"]
    if device == "cuda":
        torch.cuda.set_device(rank)
    # A collective that waits longer than this raises instead of hanging the test run.
    dist.init_process_group(ctx["backend"], rank=rank, world_size=world, timeout=datetime.timedelta(seconds=90))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (world,))
    results = {}
    for key, scenario, kwargs in jobs:
        start = time.perf_counter()
        try:
            results[key] = _SCENARIOS[scenario](rank, world, mesh, ctx, **kwargs)
        except Exception:  # noqa: BLE001  (recorded for the test that reads this result)
            results[key] = {"error": traceback.format_exc()}
        results[key]["seconds"] = time.perf_counter() - start
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    # Free the scenarios' sharded models now (FSDP keeps reference cycles that would
    # otherwise die at interpreter exit, after the process group, aborting the process).
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _launch(world: int, jobs: list, out_dir: Path, *, checkpoints: Path, backend="gloo", device="cpu", timeout=240):
    """Run ``jobs`` on ``world`` fresh processes; return each rank's results dict."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = {"backend": backend, "device": device, "checkpoints": str(checkpoints)}
    run_processes(_worker, world, (world, free_port(), jobs, ctx, str(out_dir)), timeout_s=timeout)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


_COMMON_JOBS = [
    ("parity", "parity", {"reshard_after_forward": True, "precompute": False}),
    ("parity_precompute", "parity", {"reshard_after_forward": False, "precompute": True}),
    ("bytes", "bytes", {}),
    ("delayed", "delayed", {}),
    ("mixed_precision", "mixed_precision", {}),
    ("block_recipes", "block_recipes", {}),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def ranks2(tmp_path_factory, checkpoints):
    # FP8 all-gather of the other recipes: 2 ranks only (the 1-row head is uneven and
    # leaves an empty shard already; a 3-rank run would add a minute).
    jobs = _COMMON_JOBS + [
        ("fp8_all_gather_recipes", "fp8_all_gather_recipes", {}),
        ("compile", "compile", {}),
        ("dcp_save", "dcp_save", {}),
    ]
    # A hang guard, not a speed limit: this run carries the most scenarios (about a minute
    # on an idle 2-core machine, over three on a loaded one).
    return _launch(2, jobs, tmp_path_factory.mktemp("ranks2"), checkpoints=checkpoints, timeout=420)


@pytest.fixture(scope="module")
def ranks3(tmp_path_factory, checkpoints, ranks2):
    jobs = _COMMON_JOBS + [("dcp_load", "dcp_load", {"saved_by": 2}), ("dcp_save", "dcp_save", {})]
    return _launch(3, jobs, tmp_path_factory.mktemp("ranks3"), checkpoints=checkpoints)


@pytest.fixture(scope="module")
def ranks2_reload(tmp_path_factory, checkpoints, ranks3):
    jobs = [("dcp_load", "dcp_load", {"saved_by": 3})]
    return _launch(2, jobs, tmp_path_factory.mktemp("ranks2_reload"), checkpoints=checkpoints)


@pytest.fixture(params=[2, 3], ids=["ranks2", "ranks3"])
def run(request):
    return request.getfixturevalue(f"ranks{request.param}")


def _results(run: list, key: str) -> list[dict]:
    """Every rank's result for ``key``; fails the test with the worker's traceback."""
    per_rank = [r.get(key, {"error": "no result (the run stopped before this scenario)"}) for r in run]
    for rank, res in enumerate(per_rank):
        if "error" in res:
            pytest.fail(f"rank {rank}, scenario {key}:\n{res['error']}")
    return per_rank


def _padded_rows(rows: int, world: int) -> int:
    return -(-rows // world)


# ======================================================================= distributed tests

# Loss parity threshold against the one-process reference. The forward casts are bit for
# bit the same (the global amax gives the reference's weight scale; each rank's rows are
# the reference's micro-batch), so only the order in which gradients are summed differs
# (ulps of fp32), and FP8 rounding can amplify that slightly over the steps.
PARITY_RTOL = 1e-5


@pytest.mark.distributed
@pytest.mark.parametrize("key", ["parity", "parity_precompute"])
def test_loss_parity_with_single_process(run, key):
    res = _results(run, key)
    world = len(run)
    assert all(r["wrapped"] for r in res)
    reference = res[0]["reference"]
    for rank, r in enumerate(res):
        got = torch.tensor(r["losses"], dtype=torch.float64)
        want = torch.tensor([step[rank] for step in reference], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=PARITY_RTOL, atol=0, msg=f"rank {rank} of {world}")
    # Training happened: the loss moved.
    assert reference[-1] != reference[0]


@pytest.mark.distributed
@pytest.mark.parametrize("recipe", BLOCK_RECIPES)
def test_block_recipes_with_high_precision_all_gather(run, recipe):
    res = [r[recipe] for r in _results(run, "block_recipes")]
    reference = res[0]["reference"]
    for rank, r in enumerate(res):
        got = torch.tensor(r["losses"], dtype=torch.float64)
        want = torch.tensor([step[rank] for step in reference], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=PARITY_RTOL, atol=0, msg=f"{recipe}: rank {rank} of {len(run)}")
        assert all(math.isfinite(v) for v in r["bf16_losses"]), r["bf16_losses"]
    assert reference[-1] != reference[0]


@pytest.mark.distributed
def test_uneven_and_empty_shards_gather_the_single_process_bytes(run):
    world = len(run)
    for key in ("parity", "parity_precompute"):
        res = _results(run, key)
        shard_rows = [r["shard_rows"] for r in res]
        for layer, rows in enumerate(DIMS[1:]):
            expected = [len(c) for c in torch.arange(rows).chunk(world)] + [0] * world
            assert [s[layer] for s in shard_rows] == expected[:world]
        # The head (1 row) leaves every rank but the first with an empty shard.
        assert [s[-1] for s in shard_rows] == [1] + [0] * (world - 1)
        for r in res:
            assert r["unsharded_exact"] == [True] * (len(DIMS) - 1)


@pytest.mark.distributed
def test_all_gather_moves_one_byte_per_weight_element(run):
    world = len(run)
    res = _results(run, "bytes")
    # Bias-free model: per layer FSDP gathers world * padded_rows * in_features elements.
    elements = [world * _padded_rows(d_out, world) * d_in for d_in, d_out in itertools.pairwise(DIMS)]
    for r in res:
        for name, nbytes, dtype in (
            ("fp8", 1, "torch.uint8"),
            ("fp8_mp_bf16", 1, "torch.uint8"),
            ("fp32", 4, "torch.float32"),
            ("bf16", 2, "torch.bfloat16"),
        ):
            calls = r[name]
            assert sorted(b for _, b in calls) == sorted(n * nbytes for n in elements), name
            assert {d for d, _ in calls} == {dtype}, name


@pytest.mark.distributed
def test_precompute_takes_one_all_reduce_and_steps_need_none(run):
    res = _results(run, "parity_precompute")
    layers = len(DIMS) - 1
    for r in res:
        assert r["all_reduces_in_precompute"] == STEPS  # one per call
        # The first step gathers before any precompute: one all-reduce per FP8 layer.
        assert r["all_reduces_in_steps"] == layers
        assert r["all_reduces_in_unshard"] == 0
        # A weight changed after precompute: its stale scale is not used.
        assert r["all_reduces_after_change"] == layers
        assert r["unsharded_exact_after_change"] == [True] * layers
    # Without precompute every FP8 all-gather reduces its own amax (forward, and the
    # backward re-gather with reshard_after_forward=True).
    for r in _results(run, "parity"):
        assert r["all_reduces_in_steps"] >= STEPS * (len(DIMS) - 1)


@pytest.mark.distributed
def test_delayed_scaling_state_agrees_across_ranks(run):
    res = _results(run, "delayed")
    # The ranks see different data ...
    amaxes = [r["local_input_amax"] for r in res]
    assert len(set(amaxes)) == len(amaxes)
    # ... yet every amax history and scale is identical, bit for bit.
    first = res[0]["buffers"]
    assert any(name.endswith("amax_history_input") for name in first)
    for r in res[1:]:
        assert r["buffers"].keys() == first.keys()
        for name, buf in r["buffers"].items():
            assert torch.equal(buf, first[name]), name
    for name, buf in first.items():
        if name.rsplit(".", 1)[-1].startswith("amax_history"):
            assert (buf[:3] > 0).all(), name  # three steps recorded
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in res)


# FP8 all-gather, every recipe. The forward is the same math as one process's (the gathered
# bytes are those of its cast), so the first loss agrees to fp32 ulps. In backward, 128x128
# blocks serve grad_x as they are, and MX re-blocks the gathered 1x32 bytes into 32x1 with
# power-of-two scales, which is exact for normal FP8 values: both match one process, bit for
# bit (measured; one process accumulates the two ranks' micro-batches, the reduce-scatter
# adds the same two partial gradients). The rowwise backward (row scales folded into
# grad_output) rounds differently from one process casting the fp32 weight per column
# (measured 26.1 dB at worst), and a delayed grad_output cast takes each rank's history as the
# step began where one process accumulating micro-batches updates it in between (17.8 dB at
# worst): those gradients are held to GRAD_MIN_DB, and the losses follow the one-process run
# within LOSS_RTOL.
GRAD_MIN_DB = {"rowwise": 23.0, "rowwise_with_gw_hp": 23.0, "delayed": 17.0}
SAME_BACKWARD = ("blockwise", "mxfp8")
LOSS_RTOL = 2e-2


def _fp8_all_gather_bytes(recipe: str, dims: tuple[int, ...], world: int) -> int:
    """The bytes FSDP's all-gathers receive in one forward of the FP8-gathered model."""
    total = 0
    for d_in, d_out in itertools.pairwise(dims):
        rows = _padded_rows(d_out, world)
        # Per rank: in FSDP's all-gather when the shards are even, else in one of their own.
        scales = {"rowwise": rows * 4, "rowwise_with_gw_hp": rows * 4, "delayed": 0}.get(recipe, 0)
        if recipe == "blockwise":
            scales = rows // 128 * -(-d_in // 128) * 4
        elif recipe == "mxfp8":
            scales = rows * -(-d_in // 32)
        total += world * (rows * d_in + rows * 4 + scales)  # FP8 weight, fp32 bias, scales
    return total


def _sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    noise = (ref - got).pow(2).sum()
    return math.inf if noise == 0 else 10 * math.log10(ref.pow(2).sum().item() / noise.item())


@pytest.mark.distributed
@pytest.mark.parametrize("recipe", FP8_AG_RECIPES)
def test_fp8_all_gather_every_recipe(ranks2, recipe):
    world = len(ranks2)
    res = [r[recipe] for r in _results(ranks2, "fp8_all_gather_recipes")]
    ref = res[0]
    dims = _block_dims(world) if recipe == "blockwise" else DIMS
    for rank, r in enumerate(res):
        assert r["wrapped"]
        # The gathered bytes (and scales) are those of one process casting the full weight.
        assert r["exact"] == [True] * (len(dims) - 1), (rank, r["exact"])
        # FP8 on the wire: 1 byte per weight element, the fp32 biases, and the scales
        # (rowwise: 4 bytes per row; 128x128: 4 per block; MX: 1 per 32 elements) in FSDP's
        # all-gather when the shards are even (else in one of their own); never 4 per weight.
        assert r["gathered_bytes"] == _fp8_all_gather_bytes(recipe, dims, world), r["gathered"]
        assert {d for d, _ in r["gathered"]} == {"torch.uint8"}
        # Parity with one process: the first loss to fp32 ulps, the first gradients by SQNR.
        want = [step[rank] for step in ref["reference"]]
        assert r["losses"][0] == pytest.approx(want[0], rel=PARITY_RTOL)
        for name, g in ref["reference_grads"].items():
            db = _sqnr_db(g, r["first_grads"][name])
            if recipe in SAME_BACKWARD:
                assert db == math.inf, f"{recipe} {name}.grad: {db:.1f} dB, expected the single-process gradient"
            else:
                min_db = GRAD_MIN_DB[recipe]
                assert db >= min_db, f"{recipe} {name}.grad: {db:.1f} dB < {min_db} dB (rank {rank})"
        if recipe in SAME_BACKWARD:
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(want), rtol=PARITY_RTOL, atol=0)
        else:
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(want), rtol=LOSS_RTOL, atol=0)
    if recipe == "delayed":
        # The histories got the whole weight's amax, the same on every rank, every step.
        for r in res[1:]:
            assert all(torch.equal(a, b) for a, b in zip(r["histories"], res[0]["histories"]))
        assert all((h[:STEPS] > 0).all() for h in res[0]["histories"])


@pytest.mark.distributed
def test_fp8_all_gather_of_shards_that_cut_a_128_block(ranks2):
    for r in _results(ranks2, "fp8_all_gather_recipes"):
        assert r["cut_block_exact"] == [True, True]


# bf16 parameters under FSDP2 mixed precision: the gradient and its reduce-scatter are bf16
# while the reference accumulates fp32 gradients; bf16 has 8 mantissa bits.
MIXED_PRECISION_RTOL = 5e-3


@pytest.mark.distributed
def test_mixed_precision_bf16_params(run):
    res = _results(run, "mixed_precision")
    reference = res[0]["reference"]
    for rank, r in enumerate(res):
        assert r["unsharded_weight"] == ("Float8Tensor", "torch.bfloat16")
        got = torch.tensor(r["losses"], dtype=torch.float64)
        want = torch.tensor([step[rank] for step in reference], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=MIXED_PRECISION_RTOL, atol=0)


@pytest.mark.distributed
@pytest.mark.skipif(
    compat.TORCH_VERSION < (2, 12),
    reason="torch 2.11's dynamo asserts (overwrite_tensor_vt_proxy) while it traces QuantizedLinearFn.apply on an "
    "FSDP2-sharded layer; 2.12+ compiles it (docs/versions.rst)",
)
def test_compiled_layers_under_fsdp2(ranks2):
    res = _results(ranks2, "compile")
    reference = _results(ranks2, "parity")[0]["reference"]
    for rank, r in enumerate(res):
        assert r["frames_after_first_step"] > 0
        assert r["frames_at_end"] == r["frames_after_first_step"]  # no recompiles
        want = torch.tensor([step[rank] for step in reference], dtype=torch.float64)
        torch.testing.assert_close(torch.tensor(r["losses"], dtype=torch.float64), want, rtol=PARITY_RTOL, atol=0)


@pytest.mark.distributed
@pytest.mark.parametrize("saved_by,loaded_by", [(2, 3), (3, 2)])
def test_dcp_roundtrip_onto_another_number_of_ranks(request, saved_by, loaded_by):
    run = request.getfixturevalue("ranks3" if loaded_by == 3 else "ranks2_reload")
    saver = request.getfixturevalue(f"ranks{saved_by}")
    assert all(r["saved"] for r in _results(saver, "dcp_save"))
    res = _results(run, "dcp_load")
    assert res[0]["compared"] > 10  # parameters, delayed-scaling buffers, Adam state
    assert res[0]["mismatches"] == []
    for r in res:
        assert r["wrapped"]
        # dcp.load writes in place into every shard that holds elements (through a view
        # the state dict made inside DTensor's dispatch); set_state_dict then writes all.
        assert r["dropped_by_dcp_load"] == [rows > 0 for rows in r["shard_rows"]]
        assert r["dropped_by_set_state_dict"] == [True, True]
        # No stale precomputed scale survived the load.
        assert r["unsharded_exact"] == [True, True]
        assert torch.isfinite(torch.tensor(r["loss_after_load"]))


@pytest.mark.distributed
@pytest.mark.parametrize("saved_by,loaded_by", [(2, 3), (3, 2)])
def test_dcp_next_step_loss_equals_the_savers(request, saved_by, loaded_by):
    run = request.getfixturevalue("ranks3" if loaded_by == 3 else "ranks2_reload")
    saved = _results(request.getfixturevalue(f"ranks{saved_by}"), "dcp_save")
    want = saved[0]["next_loss"]
    assert all(r["next_loss"] == want for r in saved)  # every rank computes the same loss
    for r in _results(run, "dcp_load"):
        assert r["next_loss"] == pytest.approx(want, rel=PARITY_RTOL, abs=0)


@pytest.mark.distributed
def test_dcp_from_two_ranks_loads_into_one_process(ranks2, checkpoints):
    """2 -> 1: the 2-rank FSDP2 checkpoint into a plain model and optimizer in this process
    (no process group): weights, delayed-scaling state and Adam state bit for bit, the same
    next-step loss, and the FP8 all-gather wrappers kept."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    saved = _results(ranks2, "dcp_save")
    model = _dcp_model(1, "cpu")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=checkpoints / "ranks2")
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    assert all(isinstance(layer.weight, Float8AllGatherWeight) for layer in _fp8_layers(model))
    full_msd, full_osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    want = torch.load(checkpoints / "ranks2_full.pt", weights_only=True)
    assert _count_tensors(want) > 10
    assert _compare_nested(want, {"model": _plain_tensors(full_msd), "optim": _plain_tensors(full_osd)}) == []
    assert _next_step_loss(model, "cpu") == pytest.approx(saved[0]["next_loss"], rel=PARITY_RTOL, abs=0)


def _plain_tensors(tree):
    """A state dict with the weight wrappers replaced by the plain tensors they wrap."""
    if isinstance(tree, dict):
        return {k: _plain_tensors(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_plain_tensors(v) for v in tree)
    if isinstance(tree, Float8AllGatherWeight):
        return tree._hp
    return tree


@pytest.mark.gpu
@pytest.mark.distributed
def test_nccl_single_gpu(tmp_path):
    jobs = [
        ("parity", "parity", {"reshard_after_forward": True, "precompute": True}),
        ("bytes", "bytes", {}),
        ("mixed_precision", "mixed_precision", {}),
    ]
    run = _launch(1, jobs, tmp_path / "out", checkpoints=tmp_path, backend="nccl", device="cuda")
    test_loss_parity_with_single_process(run, "parity")
    test_all_gather_moves_one_byte_per_weight_element(run)
    test_mixed_precision_bf16_params(run)
