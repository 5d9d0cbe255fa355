"""Bytes each collective moves per training step: FP8 vs bf16, per recipe, FSDP2 and TP/SP.

Runs ``--ranks`` CPU processes (gloo on 127.0.0.1). For each configuration it builds a
small model of pre-norm MLP blocks (``--dim``, ``--hidden``, ``--blocks``), runs one
warm-up step and then counts, over one training step (forward, backward, optimizer
step), every collective that reaches torch's dispatcher: the ``c10d`` ops behind
``torch.distributed``'s calls (FSDP2) and the ``_c10d_functional`` ops behind DTensor's
redistributions (tensor and sequence parallel). A ``TorchDispatchMode`` records each
op's name and the bytes of the buffer this rank contributes: the local shard for an
all-gather, the full input for a reduce-scatter, the tensor for an all-reduce or a
broadcast. (Bytes on the wire are a function of these and the algorithm; the ratio
FP8 / bf16 is the same.) Figures are per rank and per step.

Configurations, per parallelism:

- ``fsdp``: ``fully_shard`` per block and at the root, bf16 parameters
  (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``). ``bf16``: plain
  ``nn.Linear``; each recipe: ``Float8Linear`` with FP8 all-gather (every recipe; a
  128x128-block weight whose row shards cut its blocks adds one all-reduce of its block
  amaxes per all-gather, 4 bytes per block, counted with the rest).
- ``tp``: sequence parallel over all ranks, bf16 activations. ``bf16``: torch's styles on
  plain ``nn.Linear``; each recipe: f8tensor's styles (``Float8ColwiseParallel`` gathers
  the sequence-sharded input in FP8, scales included).

Usage: ``python benchmarks/bench_comm.py [--ranks 2] [--quick] [--csv PATH]``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C

from f8tensor import (
    Float8ColwiseParallel,
    Float8LinearConfig,
    Float8RowwiseParallel,
    convert_to_float8_training,
)

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed", "blockwise", "mxfp8")
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "alltoall")


class CommCounter(TorchDispatchMode):
    """Records (op name, bytes this rank contributes) for every collective dispatched."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.world = world
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _kind(func.__name__) if func.namespace in COLLECTIVE_NAMESPACES else None
        if kind in COLLECTIVES:
            self.calls.append((kind, _contributed_bytes(func.__name__, args, self.world)))
        return func(*args, **kwargs)


def _kind(name: str) -> str:
    name = name.split(".")[0].lower()
    if "all_gather" in name or "allgather" in name:
        return "all_gather"
    if "reduce_scatter" in name:
        return "reduce_scatter"
    if "allreduce" in name or "all_reduce" in name:
        return "all_reduce"
    return name.strip("_")


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _contributed_bytes(name: str, args, world: int) -> int:
    kind = _kind(name)
    tensors = [_tensors(a) for a in args]
    tensors = [ts for ts in tensors if ts]
    sizes = [sum(t.numel() * t.element_size() for t in ts) for ts in tensors]
    if not sizes:
        return 0
    if kind == "all_gather":  # (output, input) or (input,): the smaller buffer is this rank's shard
        return min(sizes)
    if kind == "reduce_scatter":
        return max(sizes)
    return sizes[0]


class _Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.w2(F.relu(self.w1(self.norm(x))))


def _model(args, recipe: str, fsdp_fp8: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*(_Block(args.dim, args.hidden) for _ in range(args.blocks)))
    if recipe != "bf16":
        cfg = Float8LinearConfig.from_recipe(recipe, enable_fsdp_float8_all_gather=fsdp_fp8)
        convert_to_float8_training(model, config=cfg)
    return model


def _fsdp(args, recipe: str, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = _model(args, recipe, fsdp_fp8=recipe != "bf16")
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model


def _tp(args, recipe: str, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    model = _model(args, recipe, fsdp_fp8=False).to(torch.bfloat16)
    col, row = (
        (ColwiseParallel, RowwiseParallel) if recipe == "bf16" else (Float8ColwiseParallel, Float8RowwiseParallel)
    )
    plan = {}
    for i in range(args.blocks):
        plan[f"{i}.norm"] = SequenceParallel()
        plan[f"{i}.w1"] = col(input_layouts=Shard(1))
        plan[f"{i}.w2"] = row(output_layouts=Shard(1))
    parallelize_module(model, mesh, plan)
    return model


def _count_step(args, parallelism: str, recipe: str, rank: int, world: int) -> list[tuple[str, int]]:
    model = (_fsdp if parallelism == "fsdp" else _tp)(args, recipe, world)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    if parallelism == "fsdp":  # data parallel: each rank its own batch
        x = torch.randn(args.batch, args.seq, args.dim, generator=g)
    else:  # sequence parallel: each rank its slice of the sequence, bf16
        x = torch.randn(args.batch, args.seq // world, args.dim, generator=g).to(torch.bfloat16)

    def step():
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    step()  # warm-up: lazy initialisation (FSDP's first all-gather set-up) is not a step
    counter = CommCounter(world)
    with counter:
        step()
    return counter.calls


def _worker(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if sys.platform == "linux":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    results = {}
    for parallelism in args.parallelisms:
        for recipe in ("bf16", *args.recipes):
            results[(parallelism, recipe)] = _count_step(args, parallelism, recipe, rank, world)
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _summarise(calls: list[tuple[str, int]]) -> dict[str, tuple[int, int]]:
    summary: dict[str, list[int]] = {}
    for kind, nbytes in calls:
        entry = summary.setdefault(kind, [0, 0])
        entry[0] += 1
        entry[1] += nbytes
    return {k: (v[0], v[1]) for k, v in summary.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--parallelisms", default="fsdp,tp")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, two recipes")
    parser.add_argument("--csv", default=None)
    parser.add_argument("--device", default="cpu", help="cpu only (gloo)")
    args = parser.parse_args(argv)
    if args.device not in ("cpu", "auto"):
        parser.error("--device: bench_comm runs on CPU processes with gloo; use --device cpu")
    args.recipes = C.parse_list(args.recipes, RECIPES, "--recipes", parser)
    args.parallelisms = C.parse_list(args.parallelisms, ("fsdp", "tp"), "--parallelisms", parser)
    if args.quick:
        args.dim, args.hidden, args.blocks, args.seq = 128, 256, 1, 16
        args.recipes = [r for r in args.recipes if r in ("tensorwise", "blockwise")] or args.recipes[:1]
    _, note = C.load_torchao()  # not compared here; the header states it like every script's
    env = C.environment(torch.device("cpu"), note)
    env["ranks"] = str(args.ranks)
    C.print_environment(env, "Bytes per collective per training step (per rank)")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "comm.pt")
        start = time.monotonic()
        mp.start_processes(_worker, args=(args.ranks, free_port(), args, out), nprocs=args.ranks, start_method="spawn")
        results = torch.load(out, weights_only=False)
    rows = []
    for (parallelism, recipe), calls in results.items():
        base = _summarise(results[(parallelism, "bf16")])
        for kind, (n, nbytes) in sorted(_summarise(calls).items()):
            ref = base.get(kind, (0, 0))[1]
            rows.append(
                {
                    "parallelism": parallelism,
                    "recipe": recipe,
                    "collective": kind,
                    "calls": n,
                    "bytes": nbytes,
                    "vs_bf16": round(nbytes / ref, 3) if ref else float("nan"),
                }
            )
    print(
        f"\nshapes: {args.blocks} block(s) of LayerNorm({args.dim}) -> Linear({args.dim}, {args.hidden}) -> ReLU -> "
        f"Linear({args.hidden}, {args.dim}); batch {args.batch} x seq {args.seq} per rank (fsdp) or in all (tp); "
        f"{args.ranks} ranks; {time.monotonic() - start:.0f} s\n"
    )
    print(
        C.markdown_table(
            ["parallelism", "recipe", "collective", "calls", "bytes", "vs bf16"],
            [[r["parallelism"], r["recipe"], r["collective"], r["calls"], r["bytes"], r["vs_bf16"]] for r in rows],
        )
    )
    C.write_csv(args.csv, rows, env)


if __name__ == "__main__":
    main()
