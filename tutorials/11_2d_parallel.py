"""Tutorial 11: 2D parallelism (FSDP2 x tensor parallel) in FP8, on four CPU processes.

    python tutorials/11_2d_parallel.py

Large models combine two kinds of sharding on a 2D device mesh ``(dp, tp)``:

- tensor parallel (``tp``): each layer's weight is split across the ``tp`` ranks
  (``parallelize_module``), and with sequence parallel the activations between layers
  are split along the sequence;
- FSDP2 (``dp``): each ``tp`` shard is sharded again across the ``dp`` ranks and
  all-gathered just before its layer runs.

A converted model works with torch's own styles (``ColwiseParallel``, ``RowwiseParallel``,
``SequenceParallel``). f8tensor's styles move FP8 bytes where the communication allows:
``Float8ColwiseParallel`` all-gathers the sequence-sharded input in FP8 (1 byte per
element, the scale agreed across the ``tp`` group), and with
``enable_fsdp_float8_all_gather=True`` FSDP2 all-gathers the weights in FP8. The two
lines that differ from a bf16 plan are marked below.

This script trains a two-block MLP on a 2 x 2 mesh of gloo processes (loopback) and
compares its losses with one process training on the same data. Under a minute on CPU.
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

from f8tensor import Float8ColwiseParallel, Float8LinearConfig, Float8RowwiseParallel, convert_to_float8_training

DP, TP = 2, 2
DIM, HIDDEN, BATCH, SEQ, STEPS = 128, 512, 2, 32, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.w2(F.relu(self.w1(self.norm(x))))


def build() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    config = Float8LinearConfig.from_recipe("tensorwise", enable_fsdp_float8_all_gather=True)
    return convert_to_float8_training(model, config=config)


def batch(step: int) -> torch.Tensor:
    """The global batch of a step: DP * BATCH sequences."""
    return torch.randn(DP * BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(step))


def worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if sys.platform == "linux":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=DP * TP, timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh["tp"], mesh["dp"]

    model = build()
    plan = {}
    for i in range(len(model)):
        plan[f"{i}.norm"] = SequenceParallel()
        plan[f"{i}.w1"] = Float8ColwiseParallel(input_layouts=Shard(1))  # FP8 sequence all-gather
        plan[f"{i}.w2"] = Float8RowwiseParallel(output_layouts=Shard(1))
    parallelize_module(model, tp, plan)  # 1) tensor parallel inside each dp group
    for block in model:
        fully_shard(block, mesh=dp)  # 2) FSDP2 across the dp groups
    fully_shard(model, mesh=dp)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    losses = []
    for step in range(STEPS):
        x = batch(step).chunk(DP)[dp.get_local_rank()]  # this dp rank's sequences
        x = x.chunk(TP, dim=1)[tp.get_local_rank()]  # this tp rank's part of each sequence
        y = DTensor.from_local(model(x), tp, [Shard(1)], run_check=False).full_tensor()
        loss = y.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = torch.tensor([loss.item()])
        dist.all_reduce(total)
        losses.append(total.item() / (DP * TP))

    # Block 0's w1 (512, 128): its rows split over tp, then again over dp (FSDP2's shard of the
    # tp shard), so each rank holds a (128, 128) piece.
    w1 = model[0].w1.weight
    rows_sharded = all(getattr(p, "dim", None) == 0 for p in w1.placements)  # Shard(0), FSDP2's strided one
    local_shape = tuple(w1.to_local().shape)
    worst = None
    if rank == 0:
        reference = build()
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
        ref_losses = []
        for step in range(STEPS):
            loss = sum(reference(x).float().pow(2).mean() for x in batch(step).chunk(DP)) / DP
            loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_losses.append(loss.item())
        local = model[0].w1.weight.to_local()
        print(
            f"mesh (dp={DP}, tp={TP}); block 0's w1 {tuple(model[0].w1.weight.shape)} is a "
            f"{type(model[0].w1.weight).__name__} of placements {model[0].w1.weight.placements}, "
            f"local shard {tuple(local.shape)}"
        )
        print("loss per step, 2D FP8:      ", " ".join(f"{v:.5f}" for v in losses))
        print("loss per step, one process: ", " ".join(f"{v:.5f}" for v in ref_losses))
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        print(f"largest relative difference: {worst:.2e}")
    gc.collect()  # free the sharded model before the process group goes (see tutorial 6)
    dist.barrier()
    dist.destroy_process_group()
    # The claims, checked after the group is gone (a failure never leaves a peer waiting): the
    # weight sharded over both mesh dims; the losses those of one process (measured at most
    # 3.1e-4 apart, relative).
    assert rows_sharded and local_shape == (HIDDEN // (TP * DP), DIM), local_shape
    assert worst is None or worst < 2e-3, f"2D FP8 losses {worst:.2e} from one process's"


if __name__ == "__main__":
    with socket.socket() as sock:  # a free port on loopback for the process group
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(worker, args=(port,), nprocs=DP * TP)
