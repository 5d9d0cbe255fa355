"""The GPU campaign's accelerate FSDP2 item (benchmarks/campaign/clients.py): its model
trains in bf16, and the FP8 run of it (linears with FP8 all-gather, FP8 attention
projections) follows the bf16 run's loss within the item's 2%, under FSDP2 on CPU.

The item compares two final losses; that means something only for a model that converges
(the item's first toy, no norms at lr 1e-3, diverged in fp32 and bf16 alike at width 1024,
and its final loss was chaotic). accelerate switches to FSDP only on an accelerator, so
this test takes the steps its FSDP2 plugin takes with ``mixed_precision="bf16"`` itself:
``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16,
output_dtype=bf16)`` over fp32 master weights, a bf16 autocast forward, one gloo rank (the
campaign's WORLD_SIZE=1), at the item's dry-run sizes and learning rate."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tests.helpers import FP8Products, free_port, init_gloo, run_processes

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from campaign import clients


def _worker(rank, world, port, out):
    init_gloo(rank, world, port)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    from f8tensor.distributed.fsdp import Float8AllGatherWeight
    from f8tensor.nn.attention import Float8AttentionWeight

    width, blocks, heads, batch, tokens, steps = clients.DRY_SIZES
    xs, target = clients.toy_data(steps, batch, tokens, width)
    bf16 = torch.bfloat16
    mp = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16, output_dtype=bf16)  # accelerate's, for "bf16"
    mesh = init_device_mesh("cpu", (world,))
    result = {}
    for fp8 in (False, True):
        model = clients.toy_model(width, blocks, heads, fp8)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        params = list(model.parameters())
        assert all(isinstance(p, DTensor) for p in params)
        kinds = {type(p.to_local()) for p in params}
        opt = torch.optim.AdamW(params, lr=clients.DRY_LR)
        counter = FP8Products()
        with counter:
            losses = clients.toy_train(
                model,
                opt,
                xs,
                target,
                torch.device("cpu"),
                lambda: torch.autocast("cpu", dtype=bf16),
                lambda loss: loss.backward(),
            )
        result["fp8" if fp8 else "bf16"] = {
            "losses": losses,
            "fp8_products": counter.fp8,
            "wrapped": {Float8AllGatherWeight, Float8AttentionWeight} <= kinds,
        }
    torch.save(result, out)
    torch.distributed.destroy_process_group()


def test_campaign_toy_trains_and_fp8_follows_bf16_under_fsdp2(tmp_path):
    out = tmp_path / "result.pt"
    run_processes(_worker, 1, (1, free_port(), str(out)), timeout_s=180)
    result = torch.load(out)
    bf16, fp8 = result["bf16"], result["fp8"]
    blocks, steps = clients.DRY_SIZES[1], clients.DRY_SIZES[5]
    assert bf16["fp8_products"] == 0 and not bf16["wrapped"]
    # Every projection (4 per block: attention in and out, fc1, fc2) in FP8 in the forward
    # and both backward products, every step, on the gathered FP8 weights.
    assert fp8["wrapped"] and fp8["fp8_products"] == 3 * 4 * blocks * steps, fp8["fp8_products"]
    # The reference trains: bf16 measured 2.196 -> 1.352 (ratio 0.62).
    b, f = bf16["losses"], fp8["losses"]
    assert len(b) == len(f) == steps
    assert b[-1] / b[0] < clients.MAX_BF16_LOSS_RATIO, b
    # FP8 follows it at every step: measured largest gap 0.09% (the item allows 2%). A
    # tensorwise all-gather that kept its first scale after the optimizer's steps (the
    # refresh in fsdp_post_all_gather skipped) measured 9.4% here.
    gaps = [abs(x - y) / y for x, y in zip(f, b)]
    assert max(gaps) < 0.005 < clients.MAX_LOSS_GAP, (b, f)
