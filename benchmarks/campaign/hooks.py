"""Second plan: places for GPU checks of features that may not exist yet. Each item is
``not run: absent (...)`` until its module exists; then it runs its check from
:data:`CHECKS`, or says that the check is still to be written here."""

from __future__ import annotations

import importlib.util

from . import activations, clients
from .runner import Ctx

#: (item name, the module that will hold the feature, what the check will measure)
HOOKS = (
    ("fused_optimizer_step", "f8tensor.optim", "an optimizer step over fp32 / bf16 / FP8 states vs torch.optim.AdamW"),
    ("fp8_activation_casts", "f8tensor.nn.activations", "FP8 saved activations: bytes saved and step time vs bf16"),
    ("accelerate_fsdp2_plugin", "accelerate", "accelerate's FSDP2 plugin, f8tensor weights: mapping, wrappers, loss"),
)


def module_absent(name: str) -> str | None:
    try:
        found = importlib.util.find_spec(name) is not None
    except ImportError:
        found = False
    return None if found else f"module {name} does not exist yet"


def optimizer_step(ctx: Ctx) -> None:
    """One optimizer step over a 10M-parameter weight (dry run: 64K): torch's AdamW (its
    default, foreach) against f8tensor's AdamW with fp32, bf16 and FP8 states, each on the
    path the optimizer takes by default (the fused Triton kernel for eager CUDA tensors);
    the detail names the path, as the optimizer decided it for the timed tensor."""
    import statistics

    import _common as C
    import torch

    from f8tensor.optim import AdamW

    rows, steps = ctx.pick((9766, 10), (64, 3))
    shape = f"{rows}x1024"
    makers = {
        "torch AdamW": lambda p: torch.optim.AdamW(p, lr=1e-3),
        "f8tensor fp32 states": lambda p: AdamW(p, lr=1e-3),
        "f8tensor bf16 states": lambda p: AdamW(p, lr=1e-3, state_dtype=torch.bfloat16),
        "f8tensor fp8 states": lambda p: AdamW(p, lr=1e-3, state_dtype=torch.float8_e4m3fn),
    }
    base = None
    for name, make in makers.items():
        p = torch.nn.Parameter(torch.randn(rows, 1024, device=ctx.device))
        p.grad = torch.randn_like(p)
        opt = make([p])
        for _ in range(2):
            opt.step()
        ms = statistics.median(C.time_steps(opt.step, steps, ctx.device))
        base = base or ms
        path = ""
        if isinstance(opt, AdamW):
            fused = opt._takes_kernel(p, p.grad, opt.state[p])
            path = "; path: fused kernel" if fused else "; path: torch ops"
        ctx.row(
            kind="measure",
            recipe=name,
            mode="eager",
            shape=shape,
            metric="optimizer step",
            value=ms,
            unit="ms" if ctx.device.type == "cuda" else "CPU ms",
            ratio=ms / base,
            detail="ratio: against torch AdamW's step" + path,
        )


#: The checks written so far, by item name, and their planned seconds (2 for a placeholder).
CHECKS = {
    "fused_optimizer_step": optimizer_step,
    "fp8_activation_casts": activations.activation_casts,
    "accelerate_fsdp2_plugin": clients.accelerate_fsdp2,
}
PLANNED_S = {"fused_optimizer_step": 8, "fp8_activation_casts": 12, "accelerate_fsdp2_plugin": 8}


def hook_fn(name: str, module: str, what: str):
    if name in CHECKS:
        return CHECKS[name]

    def check(ctx: Ctx) -> None:
        ctx.row(
            kind="check",
            metric=f"{module} present",
            status="info",
            detail=f"no GPU check written yet for {what}: add it in benchmarks/campaign/hooks.py",
        )

    return check
