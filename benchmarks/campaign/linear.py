"""Item 2: one linear layer's forward + backward at M=16384, K=4096, N=14336 (LLaMA-3-8B's
gate/up at 16384 tokens), eager and compiled: f8tensor tensorwise, rowwise and blockwise
against bf16 and torchao.float8 (CUDA events, interleaved rounds).

Timed in two groups, each with its own bf16, so that the tensorwise figures (the first
targets) are on record before the rest is compiled."""

from __future__ import annotations

import copy

from .measure import compile_fn, timed_configs, timing_rows
from .runner import Ctx

TARGET_SHAPE = (16384, 4096, 14336)
DRY_SHAPE = (64, 128, 128)  # 128: the blockwise recipe's 128x128 weight blocks
GROUPS = (("tensorwise",), ("rowwise", "blockwise"))


def linear_target(ctx: Ctx) -> None:
    import _common as C
    import torch
    from torch import nn

    m, k, n = ctx.pick(TARGET_SHAPE, DRY_SHAPE)
    dev = ctx.device
    float8, note = C.load_torchao()
    if float8 is None:
        ctx.note(f"torchao rows not run: absent (torchao): {note}")
    torch.manual_seed(0)
    ref = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(m, n, device=dev, dtype=torch.bfloat16)

    def steps_for(name: str) -> dict:
        if name == "bf16":
            layer = ref
        elif name.startswith("torchao "):
            layer = C.torchao_convert(float8, nn.Sequential(copy.deepcopy(ref)), name.split(" ", 1)[1])
        else:
            layer = C.f8tensor_convert(nn.Sequential(copy.deepcopy(ref)), name)
        out = {}
        for mode in ("compiled", "eager"):
            run = compile_fn(layer) if mode == "compiled" else layer

            def step(run=run, layer=layer):
                layer.zero_grad(set_to_none=True)
                x.grad = None
                run(x).backward(grad)

            out[name, mode] = step
        return out

    bf16 = steps_for("bf16")
    warmup, rounds, per_round = ctx.pick((3, 5, 8), (1, 2, 1))
    for i, recipes in enumerate(GROUPS):
        steps = dict(bf16)
        for recipe in recipes:
            steps.update(steps_for(recipe))
            if float8 is not None and recipe in C.TORCHAO_RECIPES:
                steps.update(steps_for(f"torchao {recipe}"))
        timings, failed = timed_configs(ctx, steps, warmup if i == 0 else 1, rounds, per_round)
        timing_rows(ctx, f"{m}x{k}x{n}", timings, failed, skip=bf16 if i else ())
