"""Second plan: accelerate's FSDP2 plugin with f8tensor weights (needs accelerate).

On a GPU: one process, a one-rank NCCL group, ``Accelerator(mixed_precision="bf16",
fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))`` preparing a converted model
(linears with FP8 all-gather, ``nn.MultiheadAttention`` projections in FP8) and its
optimizer; then the same for the unconverted model. Checks: accelerate mapped every
optimizer parameter to the model's sharded one (it maps them by ``data_ptr()``), each
weight is still f8tensor's wrapper inside its DTensor, every parameter moved in a step,
and the final loss is within 2% of the bf16 model's. A CPU dry run takes the same steps
with ``Accelerator(cpu=True)`` (accelerate ignores the FSDP plugin without an accelerator;
tests/clients/test_client_accelerate_fsdp2.py runs the mapping itself on CPU)."""

from __future__ import annotations

import os
import socket

from .runner import Ctx

#: The largest distance allowed between the FP8 and the bf16 model's final loss.
MAX_LOSS_GAP = 0.02


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_fsdp2(ctx: Ctx) -> None:
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch import nn

    from f8tensor import Float8LinearConfig, convert_to_float8_training
    from f8tensor.attention import Float8AttentionWeight
    from f8tensor.distributed.fsdp import Float8AllGatherWeight

    gpu = ctx.device.type == "cuda"
    if gpu:  # accelerate takes FSDP only in a distributed launch: a one-rank one
        for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port())), ("RANK", "0"),
                           ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            os.environ.setdefault(key, value)
    width, blocks, batch, tokens, steps = ctx.pick((1024, 4, 8, 256, 20), (32, 2, 4, 8, 4))
    shape = f"{blocks} blocks of width {width}, {batch}x{tokens} tokens"

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(width, 8 if gpu else 2, batch_first=True)
            self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x):
            x = x + self.attn(x, x, x, need_weights=False)[0]
            return x + self.fc2(F.gelu(self.fc1(x)))

    def model(fp8: bool) -> nn.Module:
        torch.manual_seed(0)
        m = nn.Sequential(*[Block() for _ in range(blocks)])
        if fp8:
            convert_to_float8_training(m, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
            for b in m:
                convert_to_float8_training(b.attn)
        return m

    g = torch.Generator().manual_seed(1)
    xs = torch.randn(steps, batch, tokens, width, generator=g)
    target = torch.randn(width, width, generator=g) / width**0.5

    AcceleratorState._reset_state(reset_partial_state=True)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2) if gpu else None
    acc = Accelerator(mixed_precision="bf16", fsdp_plugin=plugin, cpu=not gpu)
    ctx.note(f"accelerate distributed type: {acc.distributed_type}")
    losses = {}
    for name, fp8 in (("bf16", False), ("tensorwise", True)):
        m = model(fp8)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        m, opt = acc.prepare(m, opt)
        params = list(m.parameters())
        mapped = [p for group in opt.param_groups for p in group["params"]]
        same = len(mapped) == len(params) and all(a is b for a, b in zip(mapped, params))
        ctx.row(kind="check", recipe=name, shape=shape, metric="optimizer params are the prepared model's",
                value=float(same), target="1", status="passed" if same else "failed")
        if fp8:
            kinds = {type(p.to_local() if hasattr(p, "to_local") else p) for p in params}
            kept = {Float8AllGatherWeight, Float8AttentionWeight} <= kinds
            ctx.row(kind="check", recipe=name, shape=shape, metric="FP8 weight wrappers kept after prepare",
                    value=float(kept), target="1", status="passed" if kept else "failed",
                    detail=", ".join(sorted(k.__name__ for k in kinds)))
        before = [p.detach().clone() for p in params]
        for x in xs:
            x = x.to(acc.device)
            with acc.autocast():
                loss = F.mse_loss(m(x).float(), x @ target.to(acc.device))
            acc.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
        moved = all(not torch.equal(b, p.detach()) for b, p in zip(before, params))
        ctx.row(kind="check", recipe=name, shape=shape, metric="every parameter moved", value=float(moved),
                target="1", status="passed" if moved else "failed")
        losses[name] = loss.item()
        ctx.row(kind="measure", recipe=name, mode="eager", shape=shape, metric=f"loss after {steps} steps",
                value=losses[name])
    gap = abs(losses["tensorwise"] - losses["bf16"]) / losses["bf16"]
    ctx.row(kind="check", recipe="tensorwise", shape=shape, metric="final loss vs bf16 (relative)", value=gap,
            target=f"< {MAX_LOSS_GAP}", status="passed" if gap < MAX_LOSS_GAP else "failed")
    AcceleratorState._reset_state(reset_partial_state=True)
