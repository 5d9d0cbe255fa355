"""Tensor/sequence-parallel reliability: gradients of the FP8 input gather, blockwise
token blocks under sequence parallel, recipe mismatches, and collectives left in flight.

The 2-rank checks run in one gloo run on loopback (start-up costs seconds); the tests then
read their part. Shapes are tiny: the point is the gradient's layout, not its accuracy.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import assert_sqnr, free_port, init_gloo, run_processes
from test_tp import _try
from torch import nn

from f8tensor import (
    Float8ColwiseParallel,
    Float8Linear,
    Float8LinearConfig,
    PrepareFloat8ModuleInput,
)

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

K, N, B, S = 32, 32, 2, 8


class _TwoHeads(nn.Module):
    """Two layers that read the same input (attention's q and k; an MLP's w1 and w3)."""

    def __init__(self, recipe: str):
        super().__init__()
        torch.manual_seed(0)
        cfg = Float8LinearConfig.from_recipe(recipe)
        self.a = Float8Linear.from_float(nn.Linear(K, N), cfg)
        self.b = Float8Linear.from_float(nn.Linear(K, N), cfg)

    def forward(self, x):
        return self.a(x), self.b(x)


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _prepared_run(mesh, style: str, consumers: str, use_local_output: bool, recipe: str = "tensorwise") -> dict:
    """The module's input sequence-sharded on S, gathered by ``style`` ("torch":
    PrepareModuleInput; "float8": PrepareFloat8ModuleInput); its two consumers replicated
    (plain layers) or column-parallel. The full outputs and the full input gradient."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, parallelize_module

    model = _TwoHeads(recipe)
    prep_cls = PrepareModuleInput if style == "torch" else PrepareFloat8ModuleInput
    plan = {
        "": prep_cls(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=use_local_output)
    }
    if consumers == "colwise":
        col = ColwiseParallel if style == "torch" else Float8ColwiseParallel
        plan.update({"a": col(), "b": col()})
    elif not use_local_output:  # replicated consumers of a DTensor input: replicated weights
        plan.update({"a": _replicated_style(), "b": _replicated_style()})
    parallelize_module(model, mesh, plan)
    x = torch.randn(B, S, K, generator=torch.Generator().manual_seed(1))
    xl = x.chunk(mesh.size(), 1)[mesh.get_local_rank()].clone().requires_grad_()
    ya, yb = model(xl)
    ya, yb = _full(ya), _full(yb)
    (ya.float().pow(2).mean() + 3 * yb.float().sum()).backward()
    grad = DTensor.from_local(xl.grad, mesh, [Shard(1)], run_check=False).full_tensor()
    return {"y": torch.cat([ya, yb]).detach(), "grad_x": grad.detach()}


def _replicated_style():
    """A style that replicates a layer's parameters (torch's SequenceParallel does the same
    to the parameters; its input hook is not wanted here)."""
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel.style import ParallelStyle

    class _Replicated(ParallelStyle):
        def _apply(self, module, mesh):
            for name, p in list(module.named_parameters(recurse=False)):
                module.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()])))
            return module

    return _Replicated()


_PREPARE_CASES = [("replicated", True), ("replicated", False), ("colwise", True), ("colwise", False)]


def _scenario_prepare(mesh) -> dict:
    out = {}
    for consumers, local in _PREPARE_CASES:
        for style in ("torch", "float8"):
            out[(style, consumers, local)] = _try(lambda s=style, c=consumers, u=local: _prepared_run(mesh, s, c, u))
    return out


def _blockwise_sp(mesh, seq: int) -> dict:
    """A blockwise layer under torch's SequenceParallel with a (B, seq, 128) input sharded
    on the sequence: the full weight gradient, or the error."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    layer = _blockwise_layer()
    parallelize_module(layer, mesh, SequenceParallel())
    x = _blockwise_input(seq)
    xl = x.chunk(mesh.size(), 1)[mesh.get_local_rank()].clone().requires_grad_()
    try:
        y = layer(xl)
    except ValueError as e:
        return {"error_message": str(e)}
    y_full = DTensor.from_local(
        y.to_local() if isinstance(y, DTensor) else y, mesh, [Shard(1)], run_check=False
    ).full_tensor()
    (y_full.float().pow(2).sum() * 0.5).backward()
    return {"grad_w": _full(layer.weight.grad).detach().clone()}


def _blockwise_layer() -> Float8Linear:
    torch.manual_seed(0)
    return Float8Linear.from_float(nn.Linear(128, 128, bias=False), Float8LinearConfig.from_recipe("blockwise"))


def _blockwise_input(seq: int) -> torch.Tensor:
    # One large token per 32-token run: a block that mixes runs of other batch entries (or
    # other ranks' tokens) gets another scale than one process's block.
    x = torch.randn(B, seq, 128, generator=torch.Generator().manual_seed(3))
    x[:, ::32] *= 40
    x[1] *= 0.01
    return x


def _in_flight(mesh) -> dict:
    """Functional collectives left un-waited (the work registry's growth) by f8tensor's
    own steps: the FP8 gather (forward only, as when a module runs in eval), and the forward
    of delayed-scaling layers under torch's ColwiseParallel (no communication of torch's
    own: its output stays sharded). A rank that exits with one still registered can abort
    at teardown ("terminate called without an active exception")."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from f8tensor import convert_to_float8_training
    from f8tensor.distributed.tp import float8_all_gather

    registered = torch._C._distributed_c10d._get_work_registry_size
    out = {}
    for recipe in ("tensorwise", "rowwise", "blockwise"):
        x = torch.randn(B, 256, 128, generator=torch.Generator().manual_seed(5))
        xl = x.chunk(mesh.size(), 1)[mesh.get_local_rank()]
        before = registered()
        f8 = float8_all_gather(xl, mesh, 1, Float8LinearConfig.from_recipe(recipe).input)
        out[("gather", recipe)] = registered() - before
        del f8
    for bwd in (False, True):
        torch.manual_seed(0)
        model = convert_to_float8_training(
            nn.Sequential(nn.Linear(K, N)), config=Float8LinearConfig.from_recipe("delayed")
        )
        parallelize_module(model, mesh, {"0": ColwiseParallel()})
        before = registered()
        y = model(torch.randn(B, S, K))
        if bwd:
            y.float().pow(2).sum().backward()
        out[("delayed", bwd)] = registered() - before
        del model, y
    return out


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    init_gloo(rank, world, port)
    mesh = init_device_mesh("cpu", (world,))
    res: dict = {}
    start = time.monotonic()
    res["prepare"] = _try(lambda: _scenario_prepare(mesh))
    res["blockwise_ok"] = _try(lambda: _blockwise_sp(mesh, 256))
    res["blockwise_mixed"] = _try(lambda: _blockwise_sp(mesh, 128))
    res["in_flight"] = _try(lambda: _in_flight(mesh))
    res["seconds"] = time.monotonic() - start
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks2(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_rel")
    run_processes(_worker, 2, (2, free_port(), str(out)), 300)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _ok(res):
    assert not (isinstance(res, dict) and "error" in res), res["error"]
    return res


@pytest.mark.parametrize("consumers, use_local_output", _PREPARE_CASES)
def test_prepare_float8_module_input_grad_matches_torch(ranks2, consumers, use_local_output):
    """The input gradient of PrepareFloat8ModuleInput is torch's PrepareModuleInput's for
    the same module: reduce-scattered where the consumers' gradients are partial sums
    (column parallel), split where they are replicated (the doubled gradient, x world
    size, was 0 dB). Outputs: the gathered bytes are one process's cast (bit for bit)."""
    for r in range(2):
        res = _ok(ranks2[r]["prepare"])
        ref = _ok(res[("torch", consumers, use_local_output)])
        got = _ok(res[("float8", consumers, use_local_output)])
        torch.testing.assert_close(got["y"], ref["y"], rtol=0, atol=0)
        # Same FP8 bytes and the same collectives on both sides: bit for bit (the doubled
        # gradient was 0 dB off).
        torch.testing.assert_close(got["grad_x"], ref["grad_x"], rtol=0, atol=0, msg=f"rank {r} grad_x")


def test_no_collective_left_in_flight(ranks2):
    """f8tensor's own collectives are waited where they are issued: the FP8 gather's (bytes,
    scales, the tensorwise amax) and the delayed-scaling amax all-reduces (2 left
    registered per forward without backward, before). An un-waited one can still run when a
    rank destroys its process group and exits."""
    for r in range(2):
        got = _ok(ranks2[r]["in_flight"])
        assert all(v == 0 for v in got.values()), (r, got)


def test_blockwise_sequence_parallel_weight_grad_matches_one_process(ranks2):
    """Shards of 128 tokens per batch entry: every rank's 128-token blocks are blocks of
    one process's (B*S, K) view, so the weight gradient is one process's up to the order
    of the fp32 sum across ranks."""
    got = _ok(ranks2[0]["blockwise_ok"])
    assert "grad_w" in got, got
    layer = _blockwise_layer()
    x = _blockwise_input(256).requires_grad_()
    (layer(x).float().pow(2).sum() * 0.5).backward()
    # Measured: 129.3 dB (fp32 rounding of the sum across ranks; not bitwise).
    assert_sqnr(layer.weight.grad, got["grad_w"], 124.0, "grad_w")


def test_blockwise_sequence_parallel_refuses_blocks_that_mix_batch_entries(ranks2):
    """S = 128 over 2 ranks: 64 tokens per batch entry per rank, so one process's 128-token
    blocks (one batch entry each) span both ranks and a rank's would mix batch entries
    (the weight gradient fell to about 32 dB, silently). Refused, naming the fix."""
    got = _ok(ranks2[0]["blockwise_mixed"])
    assert "error_message" in got, f"no error: a grad_w of {got}"
    msg = got["error_message"]
    assert "batch" in msg and "128" in msg and "Shard(1)" in msg, msg


# ----------------------------------------------------------- one process (world size 1)


@pytest.fixture
def world1():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_default_prepare_float8_module_input_follows_rowwise_consumers(world1):
    """A default PrepareFloat8ModuleInput in front of rowwise layers gathers with their
    input cast (it failed with 'pass a high-precision tensor'); results equal torch's
    PrepareModuleInput, bit for bit (the gathered bytes are the layers' own cast)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module

    outs = []
    for cls in (PrepareModuleInput, PrepareFloat8ModuleInput):
        model = _TwoHeads("rowwise")
        parallelize_module(
            model,
            world1,
            {"": cls(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)},
        )
        x = torch.randn(B, S, K, generator=torch.Generator().manual_seed(1)).requires_grad_()
        ya, yb = model(x)
        (ya.pow(2).sum() + yb.sum()).backward()
        outs.append((ya.detach(), yb.detach(), x.grad))
    for ref, got in zip(*outs):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_prepare_float8_module_input_with_another_recipe_names_the_mismatch(world1):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    model = _TwoHeads("rowwise")
    style = PrepareFloat8ModuleInput(
        input_layouts=(Shard(1),),
        desired_input_layouts=(Replicate(),),
        use_local_output=True,
        config=Float8LinearConfig.from_recipe("tensorwise"),
    )
    parallelize_module(model, world1, {"": style})
    x = torch.randn(B, S, K)
    with pytest.raises(TypeError, match=r"PrepareFloat8ModuleInput.*config="):
        model(x)


def test_prepare_float8_module_input_with_mixed_consumer_recipes_asks_for_config(world1):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    model = _TwoHeads("rowwise")
    model.b = Float8Linear.from_float(nn.Linear(K, N), Float8LinearConfig.from_recipe("tensorwise"))
    style = PrepareFloat8ModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    with pytest.raises(ValueError, match=r"config="):
        parallelize_module(model, world1, {"": style})


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
def test_fp4_layer_under_float8_colwise_sequence_parallel_is_refused_by_name(world1, recipe):
    """It raised KeyError: torch.float4_e2m1fn_x2 from the FP8 gather."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    model = nn.Sequential(Float8Linear.from_float(nn.Linear(64, 64), Float8LinearConfig.from_recipe(recipe)))
    with pytest.raises(NotImplementedError, match="FP4 and per-GEMM-format configs do not run on DTensors"):
        parallelize_module(model, world1, {"0": Float8ColwiseParallel(input_layouts=Shard(1))})
        model(torch.randn(2, 8, 64))


def test_prepare_float8_module_input_refuses_an_fp4_config():
    with pytest.raises(ValueError, match="config"):
        PrepareFloat8ModuleInput(config=Float8LinearConfig.from_recipe("nvfp4"))
