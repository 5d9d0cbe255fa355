"""Item 5: the MoE grouped GEMM forward + backward, ``float8_grouped_mm`` (tensorwise and
rowwise) against bf16 ``torch._grouped_mm``, eager and compiled, and the route it took."""

from __future__ import annotations

from .measure import compile_fn, ops_seen, scaled_ops, timed_configs, timing_rows
from .runner import Ctx


def moe_grouped(ctx: Ctx) -> None:
    import torch

    from f8tensor import Float8LinearConfig, float8_grouped_mm

    groups, m, k, n = ctx.pick((8, 16384, 4096, 14336), (4, 256, 64, 128))
    dev = ctx.device
    torch.manual_seed(0)
    offs = torch.full((groups,), m // groups, dtype=torch.int32).cumsum(0).to(torch.int32).to(dev)
    w = torch.randn(groups, n, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(m, n, device=dev, dtype=torch.bfloat16)

    def fwd_for(recipe):
        if recipe == "bf16":
            return lambda x, w: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        config = Float8LinearConfig.from_recipe(recipe)
        return lambda x, w: float8_grouped_mm(x, w.transpose(-2, -1), offs, config)

    steps = {}
    for recipe in ("bf16", "tensorwise", "rowwise"):
        for mode in ("compiled", "eager"):
            run = compile_fn(fwd_for(recipe)) if mode == "compiled" else fwd_for(recipe)

            def step(run=run):
                x.grad = w.grad = None
                run(x, w).backward(grad)

            steps[recipe, mode] = step
    ctx.note(f"tensorwise route: {', '.join(scaled_ops(ops_seen(steps['tensorwise', 'eager']))) or 'no scaled op'}")
    warmup, rounds, per_round = ctx.pick((3, 5, 8), (1, 2, 1))
    timings, failed = timed_configs(ctx, steps, warmup, rounds, per_round)
    timing_rows(ctx, f"{groups}x{m}x{k}x{n}", timings, failed)
