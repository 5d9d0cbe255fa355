"""Item 1: every recipe's forward and backward on the device against the same on the CPU,
and the first kernel each recipe's step launches (the GEMM route it takes, too)."""

from __future__ import annotations

from .measure import ops_seen, scaled_ops, sqnr_db
from .runner import Ctx, error_text

#: SQNR (dB) of the device's output and gradients against the CPU's, same recipe and inputs:
#: both compute the same casts; the GEMMs differ in accumulation order (and FP4 in rounding).
#: (Measured on CPU vs CPU: inf.)
DEVICE_VS_CPU_DB = 30.0


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
        kernels = [e.name for e in events if e.device_type == DeviceType.CPU and "::" in e.name
                   and e.name not in B.NO_KERNEL_OPS and not any("::" in c.name for c in e.cpu_children)]
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
        x = x0.to(device).requires_grad_()

        def step():
            x.grad = None
            model.zero_grad(set_to_none=True)
            y = model(x)
            y.backward(g0.to(device))
            return y, x.grad, layer.weight.grad

        return step

    for recipe in RECIPES:
        shape = f"{m}x{k}x{n}"
        try:
            step = make(recipe, ctx.device)
            got = step()
            ref = make(recipe, cpu)() if ctx.device.type != "cpu" else got
            ops = ops_seen(step)
            kernel = first_kernel(step, ctx.device)
        except Exception as e:  # noqa: BLE001  (one recipe failing does not hide the others)
            why, tail = error_text(e)
            ctx.row(kind="check", recipe=recipe, shape=shape, metric="fwd+bwd on the device", status="failed",
                    detail=f"{why} | {tail}")
            continue
        worst = min(sqnr_db(r, g) for r, g in zip(ref, got))
        ctx.row(kind="check", recipe=recipe, shape=shape, metric="worst SQNR of out/grad_in/grad_w vs CPU dB",
                value=worst, target=f">= {DEVICE_VS_CPU_DB}", status="passed" if worst >= DEVICE_VS_CPU_DB else "failed",
                detail=f"first kernel: {kernel}; GEMM ops: {', '.join(scaled_ops(ops)) or 'no scaled op'}")
        ctx.say(f"  {recipe}: {worst:.1f} dB; first kernel {kernel}; {', '.join(scaled_ops(ops)) or 'no scaled op'}")
