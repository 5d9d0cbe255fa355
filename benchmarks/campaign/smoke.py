"""Item 1: every recipe's forward and backward on the device against the same on the CPU,
and the first kernel each recipe's step launches (the GEMM route it takes, too)."""

from __future__ import annotations

from .measure import ops_seen, scaled_ops, sqnr_db
from .runner import Ctx, error_text, failure_status

#: SQNR (dB) of the device's output and gradients against the CPU's, same recipe and inputs:
#: both compute the same casts; the GEMMs differ in accumulation order (and FP4 in rounding).
#: (Measured on CPU vs CPU: inf; H100 vs CPU, tensorwise: 58.9 dB.)
DEVICE_VS_CPU_DB = 30.0
#: Recipes with stochastic rounding (NVFP4, MXFP4 gradients): the device's worst SQNR against
#: fp32 may fall this far below the CPU's (two draws of the same noise; CPU vs CPU with two
#: models, 32x128x128: measured -0.08 dB NVFP4, -0.13 dB MXFP4).
STOCHASTIC_MARGIN_DB = 3.0


def first_kernel(step, device) -> str:
    """The name of the first kernel one step launches (CUDA: the profiler's first device
    event; CPU: the first computing leaf operator, as ``bench_eager_overhead`` counts them)."""
    import bench_eager_overhead as B
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    if cuda:
        kernels = [e.name for e in events if e.device_type == DeviceType.CUDA]
    else:
        kernels = [
            e.name
            for e in events
            if e.device_type == DeviceType.CPU
            and "::" in e.name
            and e.name not in B.NO_KERNEL_OPS
            and not any("::" in c.name for c in e.cpu_children)
        ]
    return kernels[0][:160] if kernels else "none"


def smoke(ctx: Ctx) -> None:
    import torch
    from torch import nn

    from f8tensor import RECIPES, Float8LinearConfig, convert_to_float8_training

    m, k, n = ctx.pick((256, 512, 384), (32, 128, 128))  # 128: the block recipes' tile
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    w0 = torch.randn(n, k, dtype=torch.bfloat16) / k**0.5
    x0, g0 = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(m, n, dtype=torch.bfloat16)

    def make(recipe, device):
        layer = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            layer.weight.copy_(w0)
        model = convert_to_float8_training(nn.Sequential(layer), config=Float8LinearConfig.from_recipe(recipe))
        # A copy: on the CPU ``x0.to(device)`` would be x0 itself, and the CPU reference's
        # ``requires_grad_`` would make every later device copy a non-leaf without ``.grad``.
        x = x0.to(device, copy=True).requires_grad_()

        def step():
            x.grad = None
            model.zero_grad(set_to_none=True)
            y = model(x)
            y.backward(g0.to(device))
            return y, x.grad, layer.weight.grad

        return step

    def hp_step():  # the high-precision reference: the same linear in fp32, no casts
        x = x0.float().requires_grad_()
        w = w0.float().requires_grad_()
        y = x @ w.t()
        y.backward(g0.float())
        return y, x.grad, w.grad

    hp = hp_step()
    for recipe in RECIPES:
        shape = f"{m}x{k}x{n}"
        try:
            step = make(recipe, ctx.device)
            got = step()
            ref = make(recipe, cpu)()  # a second model, also in a dry run, so the run's own bugs show there
            ops = ops_seen(step)
            kernel = first_kernel(step, ctx.device)
        except Exception as e:  # noqa: BLE001  (one recipe failing does not hide the others)
            status = failure_status(e)
            ctx.row(
                kind="check",
                recipe=recipe,
                shape=shape,
                metric="fwd+bwd on the device",
                status=status[:300],
                detail=error_text(e)[1] if status.startswith("failed") else "",
            )
            continue
        detail = f"first kernel: {kernel}; GEMM ops: {', '.join(scaled_ops(ops)) or 'no scaled op'}"
        if stochastic(recipe):
            # Stochastic rounding draws other random bits on each device (and in each model), so
            # the device is held to the CPU's accuracy against fp32, not to the CPU's bits.
            gap = min(sqnr_db(h, g) - sqnr_db(h, r) for h, r, g in zip(hp, ref, got))
            ctx.row(
                kind="check",
                recipe=recipe,
                shape=shape,
                metric="worst SQNR vs fp32, device minus CPU dB",
                value=gap,
                target=f">= -{STOCHASTIC_MARGIN_DB}",
                status="passed" if gap >= -STOCHASTIC_MARGIN_DB else "failed",
                detail=detail,
            )
            ctx.say(f"  {recipe}: device vs CPU accuracy gap {gap:+.1f} dB; {detail}")
            continue
        worst = min(sqnr_db(r, g) for r, g in zip(ref, got))
        ctx.row(
            kind="check",
            recipe=recipe,
            shape=shape,
            metric="worst SQNR of out/grad_in/grad_w vs CPU dB",
            value=worst,
            target=f">= {DEVICE_VS_CPU_DB}",
            status="passed" if worst >= DEVICE_VS_CPU_DB else "failed",
            detail=detail,
        )
        ctx.say(f"  {recipe}: {worst:.1f} dB; {detail}")


def stochastic(recipe: str) -> bool:
    """Whether a recipe rounds any cast stochastically (its results are not reproducible bits)."""
    from f8tensor import Float8LinearConfig

    config = Float8LinearConfig.from_recipe(recipe)
    return any(
        getattr(c, "rounding", "nearest") == "stochastic" for c in (config.input, config.weight, config.grad_output)
    )
