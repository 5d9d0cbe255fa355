"""Tutorial 6: FSDP2 with FP8 all-gather, on two CPU processes.

    python tutorials/06_fsdp2_float8.py

FSDP2 (``torch.distributed.fsdp.fully_shard``) keeps a shard of every weight on each
rank and all-gathers the full weight just before a layer runs. With
``Float8LinearConfig(enable_fsdp_float8_all_gather=True)`` each rank casts its shard to
FP8 first, so the all-gather moves 1 byte per weight element instead of 2 (bf16) or 4
(fp32). The scale is agreed by all ranks (the amax of the shards, reduced with MAX), so
the gathered weight is exactly what one process would get by casting the full weight.

This script trains the same small MLP twice on two processes (gloo, loopback): once
all-gathering bf16 weights (FSDP2 mixed precision), once FP8 weights, and prints the
bytes the all-gathers received and the losses. It runs on CPU in well under a minute.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import itertools
import math
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from f8tensor import Float8LinearConfig, convert_to_float8_training, precompute_float8_scales_for_fsdp

WORLD = 2
STEPS = 8
BATCH = 64  # rows per rank
DIMS = (256, 1024, 256, 64)


def build(fp8_all_gather: bool, mesh) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i, (d_in, d_out) in enumerate(itertools.pairwise(DIMS)):
        if i:
            layers.append(nn.GELU())
        layers.append(nn.Linear(d_in, d_out))
    model = nn.Sequential(*layers)
    # 1) swap nn.Linear for Float8Linear; the flag wraps each weight for FP8 all-gather
    config = Float8LinearConfig.from_recipe("tensorwise", enable_fsdp_float8_all_gather=fp8_all_gather)
    convert_to_float8_training(model, config=config)
    # 2) shard each layer, then the root: the usual FSDP2 recipe
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model


@contextlib.contextmanager
def count_all_gather_bytes(sink: list[int]):
    """FSDP2 calls torch.distributed.all_gather_single (all_gather_into_tensor before torch
    2.13): wrap it to see what it receives."""
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    orig = getattr(dist, name)

    def counting(output, input, *args, **kwargs):
        sink.append(output.numel() * output.element_size())
        return orig(output, input, *args, **kwargs)

    setattr(dist, name, counting)
    try:
        yield
    finally:
        setattr(dist, name, orig)


def train(fp8_all_gather: bool, rank: int, mesh) -> tuple[list[float], int]:
    model = build(fp8_all_gather, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)  # each rank its own data
    target = torch.randn(DIMS[-1], DIMS[0], generator=g) / DIMS[0] ** 0.5
    losses, step_bytes = [], []
    for step in range(STEPS):
        x = torch.randn(BATCH, DIMS[0], generator=g)
        with count_all_gather_bytes(step_bytes if step == STEPS - 1 else []):
            loss = F.mse_loss(model(x).float(), x @ target.t())
            loss.backward()
        opt.step()
        opt.zero_grad()
        if fp8_all_gather:
            # 3) optional: every weight's next scale at once, with one all-reduce
            precompute_float8_scales_for_fsdp(model)
        losses.append(loss.item())
    return losses, sum(step_bytes)


def worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if sys.platform == "linux":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (WORLD,))
    bf16_losses, bf16_bytes = train(False, rank, mesh)
    fp8_losses, fp8_bytes = train(True, rank, mesh)
    weights = sum(d_in * d_out for d_in, d_out in itertools.pairwise(DIMS))
    if rank == 0:
        print(f"{WORLD} ranks, MLP {' -> '.join(map(str, DIMS))}: {weights:,} weight elements")
        print("all-gather bytes received per rank in one training step (forward + backward re-gather):")
        print(f"  bf16 all-gather: {bf16_bytes:>10,} B")
        print(f"  FP8 all-gather:  {fp8_bytes:>10,} B   ({fp8_bytes / bf16_bytes:.2f}x; biases stay bf16)")
        print("rank 0 loss per step:")
        print("  bf16 all-gather:", " ".join(f"{v:.4f}" for v in bf16_losses))
        print("  FP8 all-gather: ", " ".join(f"{v:.4f}" for v in fp8_losses))
    # Tear down in order: free the sharded models (FSDP keeps reference cycles, which
    # would otherwise die only at interpreter exit, after the process group, and abort
    # the process there), then leave together and destroy the process group.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    # The claims, checked on every rank after the group is gone (a failure never leaves a
    # peer waiting): each of the step's two all-gathers of every layer (forward, and the
    # backward's re-gather) moves 1 byte per weight element where bf16 moves 2 (the biases stay
    # bf16), and training follows the bf16 run step by step.
    biases = sum(DIMS[1:])
    assert bf16_bytes == 2 * 2 * (weights + biases), f"rank {rank}: bf16 all-gather {bf16_bytes} B"
    assert fp8_bytes == 2 * (weights + 2 * biases), f"rank {rank}: FP8 all-gather {fp8_bytes} B"
    # Measured: 0.50x the bytes; the losses at most 0.3% apart over the 8 steps.
    worst = max(abs(a - b) / abs(b) for a, b in zip(fp8_losses, bf16_losses))
    assert all(math.isfinite(v) for v in fp8_losses) and worst < 0.02, f"rank {rank}: FP8 losses {worst:.1%} off bf16"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    mp.spawn(worker, args=(free_port(),), nprocs=WORLD)
