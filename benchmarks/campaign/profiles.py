"""Second plan: for every figure of an earlier ``results.csv`` below its target, that
configuration and its baseline under ``torch.profiler``: the kernels with the most device
time per step (``kernel`` rows) and one Chrome trace (``profile_trace.json.gz``, the first)."""

from __future__ import annotations

import gzip
import shutil
import tempfile
from pathlib import Path

from . import e2e, report
from .measure import compile_fn
from .runner import Ctx

TOP = 16  # kernels per configuration


def missed(paths: str | None) -> tuple[list[dict], str]:
    """The ``missed`` target rows of the CSVs named (comma-separated)."""
    if not paths:
        return [], "no --figures-csv given"
    files = [Path(p) for p in paths.split(",")]
    gone = [str(p) for p in files if not p.exists()]
    if gone:
        return [], f"--figures-csv not found: {', '.join(gone)}"
    rows = [r for p in files for r in report.read_csv(p) if r["status"] == "missed"]
    return rows, f"{len(rows)} missed figure(s) in {', '.join(map(str, files))}"


def linear_step(ctx: Ctx, recipe: str, mode: str, shape: str):
    import _common as C
    import torch
    from torch import nn

    m, k, n = (int(v) for v in shape.split("x"))
    layer = nn.Sequential(nn.Linear(k, n, bias=False, device=ctx.device, dtype=torch.bfloat16))
    if recipe.startswith("torchao "):
        float8, note = C.load_torchao()
        if float8 is None:
            raise ModuleNotFoundError(note, name="torchao")
        layer = C.torchao_convert(float8, layer, recipe.split(" ", 1)[1])
    elif recipe != "bf16":
        layer = C.f8tensor_convert(layer, recipe)
    run = compile_fn(layer) if mode == "compiled" else layer
    x = torch.randn(m, k, device=ctx.device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(m, n, device=ctx.device, dtype=torch.bfloat16)

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        run(x).backward(grad)

    return step


def moe_step(ctx: Ctx, recipe: str, mode: str, shape: str):
    import torch

    from f8tensor import Float8LinearConfig, float8_grouped_mm

    groups, m, k, n = (int(v) for v in shape.split("x"))
    offs = torch.full((groups,), m // groups, dtype=torch.int32).cumsum(0).to(torch.int32).to(ctx.device)
    w = torch.randn(groups, n, k, device=ctx.device, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(m, k, device=ctx.device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(m, n, device=ctx.device, dtype=torch.bfloat16)
    config = None if recipe == "bf16" else Float8LinearConfig.from_recipe(recipe)

    def fwd(x, w):
        if config is None:
            return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        return float8_grouped_mm(x, w.transpose(-2, -1), offs, config)

    run = compile_fn(fwd) if mode == "compiled" else fwd

    def step():
        x.grad = w.grad = None
        run(x, w).backward(grad)

    return step


def e2e_step(ctx: Ctx, recipe: str, mode: str, shape: str):
    return e2e.build_step(ctx, recipe, shape)[2]  # compiled per block, as e2e_compile does


BUILDERS = {"linear_target": linear_step, "moe_grouped": moe_step, "e2e_step": e2e_step}


def _self_time(e, cuda: bool) -> float:
    if cuda:
        return float(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0))
    return float(e.self_cpu_time_total)


def _on_device(e) -> bool:
    from torch.autograd import DeviceType

    return e.device_type == DeviceType.CUDA


def profile_one(ctx: Ctx, label: str, step) -> None:
    import _common as C
    from torch.profiler import ProfilerActivity, profile

    warmup, steps = ctx.pick((4, 5), (1, 2))
    for _ in range(warmup):
        step()
    C.sync(ctx.device)
    cuda = ctx.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            step()
        C.sync(ctx.device)
    # On CUDA the device's own events only: a Triton kernel's launcher (a CPU event of the same
    # name) and an ATen op also carry its kernels' device time, which would list it twice.
    events = [e for e in prof.key_averages() if _self_time(e, cuda) > 0 and (not cuda or _on_device(e))]
    events.sort(key=lambda e: -_self_time(e, cuda))
    total = sum(_self_time(e, cuda) for e in events) or 1.0
    for rank, e in enumerate(events[:TOP], 1):
        ctx.row(
            kind="kernel",
            recipe=label,
            metric=e.key[:200],
            value=_self_time(e, cuda) / 1e3 / steps,
            unit="ms/step" if cuda else "CPU ms/step",
            detail=f"rank {rank}, {e.count / steps:g} calls/step, "
            f"{100 * _self_time(e, cuda) / total:.1f}% of the total",
        )
    trace = ctx.runner.out / "profile_trace.json.gz"
    if not trace.exists():
        with tempfile.TemporaryDirectory(prefix="f8tensor_trace_") as tmp:
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            with open(raw, "rb") as src, gzip.open(trace, "wb", compresslevel=6) as dst:
                shutil.copyfileobj(src, dst)
        if trace.stat().st_size > 15 * 2**20:
            trace.unlink()
            ctx.note(f"the trace of {label} was over 15 MiB gzipped: not kept")


def profiles(ctx: Ctx) -> None:
    rows, note = missed(ctx.args.figures_csv)
    ctx.note(note)
    done = set()
    for r in rows:
        baseline = f"torchao {r['recipe']}" if r["metric"] == "speedup_vs_torchao" else "bf16"
        builder = BUILDERS.get(r["item"])
        if builder is None:
            ctx.note(f"no profile recipe for {r['item']} (its figure: {r['recipe']} {r['mode']} {r['shape']})")
            continue
        for recipe in (r["recipe"], baseline):
            key = (r["item"], recipe, r["mode"], r["shape"])
            if key in done:
                continue
            done.add(key)
            profile_one(
                ctx, f"{r['item']} {recipe} {r['mode']} {r['shape']}", builder(ctx, recipe, r["mode"], r["shape"])
            )
