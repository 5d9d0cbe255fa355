"""FSDP2 sharding of FP8 expert weights (high-precision all-gather), 2 gloo processes on loopback.

Each rank trains the same tiny experts layer on its own tokens, sharded over both ranks,
and compares with one process training on all tokens: the expert GEMMs run in FP8 in
both, so the losses and the gathered weights agree to fp32 summation order.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import free_port, init_gloo, run_processes
from torch import nn

from f8tensor import Float8ExpertWeight, Float8LinearConfig, convert_experts_to_float8, set_forward_in_high_precision

E, H, I_, STEPS, WORLD = 4, 32, 16, 3, 2
OFFS = torch.tensor([3, 3, 10, 16], dtype=torch.int32)  # per rank: 16 tokens, one expert empty


class _Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts = E
        torch.manual_seed(0)
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I_, H) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(E, H, I_) * 0.1)

    def forward(self, x):  # transformers' grouped path, tokens already sorted by expert
        h = torch._grouped_mm(x, self.gate_up_proj.transpose(-2, -1), offs=OFFS)
        gate, up = h.chunk(2, dim=-1)
        return torch._grouped_mm(torch.nn.functional.silu(gate) * up, self.down_proj.transpose(-2, -1), offs=OFFS)


def _data(step: int, rank: int) -> torch.Tensor:
    return torch.randn(16, H, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(model, ranks):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        loss = sum(model(_data(step, r)).pow(2).mean() for r in ranks) / len(ranks)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _worker(rank: int, port: int, out_dir: str) -> None:
    init_gloo(rank, WORLD, port, timeout_s=90)
    result = {}
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = _Experts()
        convert_experts_to_float8(model, Float8LinearConfig.from_recipe("rowwise"))
        fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
        local = model.gate_up_proj.to_local()
        result["local_type"] = type(local).__name__
        result["local_rows"] = local.shape[0]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(STEPS):
            loss = model(_data(step, rank)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            t = torch.tensor([loss.item()])
            dist.all_reduce(t)
            losses.append(t.item() / WORLD)
        result["losses"] = losses
        result["gate_up"] = model.gate_up_proj.full_tensor().detach()
        result["gate_up"] = (
            result["gate_up"]._hp if isinstance(result["gate_up"], Float8ExpertWeight) else result["gate_up"]
        )
        set_forward_in_high_precision(model)  # reaches the shards and the gathered weight FSDP2 reuses
        result["hp_out"] = model(_data(STEPS, rank)).detach()
    except Exception:  # noqa: BLE001  (read by the test)
        result["error"] = traceback.format_exc()
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_fsdp2_shards_fp8_expert_weights(tmp_path):
    run_processes(_worker, WORLD, (free_port(), str(tmp_path)), timeout_s=240)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
        assert res["local_type"] == "Float8ExpertWeight" and res["local_rows"] == E // WORLD
    single = _Experts()
    convert_experts_to_float8(single, Float8LinearConfig.from_recipe("rowwise"))
    reference = _train(single, range(WORLD))
    torch.testing.assert_close(results[0]["losses"], reference, rtol=1e-5, atol=0)
    torch.testing.assert_close(results[0]["gate_up"], single.gate_up_proj._hp.detach(), rtol=1e-5, atol=1e-6)
    set_forward_in_high_precision(single)
    torch.testing.assert_close(results[0]["hp_out"], single(_data(STEPS, 0)).detach(), rtol=1e-5, atol=1e-6)
