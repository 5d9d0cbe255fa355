"""The fused AdamW step on DTensor parameters (dim-0 shards, uneven): each rank runs the
kernel on its local shard (CPU: the Triton interpreter), and the gathered parameters and
states are the bits one process writes with the torch-ops path. Two ranks, gloo on loopback.

The draws of FP8 moments and of stochastic bf16 masters are a function of each element's
global index: the shard's offset reaches the kernel as ``start``. Square roots: correctly
rounded on both paths (see tests/optim/test_triton_adamw.py for why).
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import free_port, run_processes, unfused_interpreter_fma

pytest.importorskip("triton", reason="the fused AdamW step needs triton")

pytestmark = pytest.mark.distributed

FP8 = torch.float8_e4m3fn
#: Rows of 300 (ragged last block) cut 3 + 2 across two ranks; a 1-D bias cut 4 + 3.
SHAPES = ((5, 300), (7,))


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    differ = _bits(a) != _bits(b)
    if a.is_floating_point():
        nan = torch.isnan(a.float())
        if not torch.equal(nan, torch.isnan(b.float())):
            return False
        differ &= ~nan
    return not differ.any()


def _full(t: torch.Tensor) -> torch.Tensor:
    """A dim-0 sharded DTensor gathered through a byte view (gloo gathers none of FP8, bf16
    or int16), else ``t``."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    k = t.element_size()
    local = t.to_local().contiguous()
    local = local.reshape(-1).view(torch.uint8).view(*local.shape, k)  # a new last dim: dim 0 keeps its rows
    shape = (*t.shape, k)
    stride = torch.empty(shape, device="meta").stride()
    as_bytes = DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=shape, stride=stride)
    return as_bytes.full_tensor().reshape(-1).view(t.dtype).view(t.shape)


def _scenario(mesh, state_dtype, master) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    from f8tensor import optim
    from f8tensor.optim import AdamW

    optim._sqrt = lambda x: x.to(torch.float64).sqrt().to(torch.float32)
    torch.manual_seed(0)
    init = [torch.randn(s).to(torch.bfloat16) for s in SHAPES]
    g = torch.Generator().manual_seed(1)
    grads = [[torch.randn(s, generator=g).to(torch.bfloat16) for s in SHAPES] for _ in range(2)]
    sharded = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in init]
    whole = [torch.nn.Parameter(t.clone()) for t in init]
    opts = [
        AdamW(sharded, lr=1e-2, state_dtype=state_dtype, master_weights=master, fused=True),
        AdamW(whole, lr=1e-2, state_dtype=state_dtype, master_weights=master, fused=False),
    ]
    for step_grads in grads:
        for p, q, grad in zip(sharded, whole, step_grads):
            p.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
            q.grad = grad.clone()
        for opt in opts:
            opt.step()
    result = {}
    for i, (p, q) in enumerate(zip(sharded, whole)):
        result[f"param {i}"] = _same(p.full_tensor(), q.detach())
        for key, value in opts[1].state[q].items():
            got = _full(opts[0].state[p][key])
            result[f"param {i} {key}"] = _same(got, value)
    return result


JOBS = [
    (f"{str(sd)[6:]}-{master}", sd, master) for sd in (FP8, torch.bfloat16) for master in ("stochastic", "remainder")
]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if sys.platform == "linux":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=90))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for key, state_dtype, master in JOBS:
        try:
            results[key] = _scenario(mesh, state_dtype, master)
        except Exception:  # noqa: BLE001  (recorded for the test that reads this result)
            results[key] = {"error": traceback.format_exc()}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks2(tmp_path_factory) -> list[dict]:
    why = unfused_interpreter_fma()
    if why is not None:
        pytest.skip(why)
    out = tmp_path_factory.mktemp("optim_fused_ranks2")
    run_processes(_worker, 2, (2, free_port(), str(out)), timeout_s=300)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("key", [job[0] for job in JOBS])
def test_sharded_fused_step_is_one_process_torch_ops_step(ranks2, key):
    for rank, results in enumerate(ranks2):
        result = results[key]
        assert "error" not in result, result.get("error")
        bad = [name for name, same in result.items() if not same]
        assert not bad, f"rank {rank}: {bad}"
