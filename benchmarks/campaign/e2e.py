"""Item 4: one training step of the ~300M-parameter Llama-style model (``_models``, size
``300m``), compiled, bf16 vs tensorwise vs rowwise (and torchao's tensorwise when it is
installed): tokens/s and peak memory.

Two items: ``e2e_compile`` builds the three models and compiles them (each transformer
block on its own: the 24 blocks share one compiled graph per recipe, which keeps the
compile to seconds; embedding, final norm and output head run eagerly in every
configuration), reporting each compile's seconds; ``e2e_step`` times the compiled models it
left behind in interleaved rounds. A compile cut off at its deadline costs that recipe's
rows, not the run."""

from __future__ import annotations

from .runner import Ctx

RECIPES = ("bf16", "tensorwise", "rowwise")


def build_step(ctx: Ctx, recipe: str, size: str, batches=None, mode: str | None = None) -> tuple:
    """``(model, opt, step, state)``: the ``size`` model under ``recipe`` (bf16, an f8tensor
    recipe or ``torchao <recipe>``), each block compiled (with torch.compile's ``mode``:
    ``"reduce-overhead"`` captures CUDA graphs), and one AdamW training step over
    ``batches``. Shared with the ``llama`` and ``profiles`` items."""
    import _common as C
    import _models as M
    import torch

    cfg = M.SIZES[size]
    if batches is None:
        batches = M.synthetic_batches(cfg, 4, ctx.device)
    model = M.build_model(cfg, ctx.device)
    if recipe.startswith("torchao "):
        float8, note = C.load_torchao()
        if float8 is None:
            raise ModuleNotFoundError(note, name="torchao")
        C.torchao_convert(float8, model, recipe.split(" ", 1)[1], module_filter_fn=M.fp8_filter)
    elif recipe != "bf16":
        C.f8tensor_convert(model, recipe, module_filter_fn=M.fp8_filter)
    for block in model.layers:
        block.compile(dynamic=False, **({"mode": mode} if mode else {}))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    state = {"i": 0, "loss": float("nan")}

    def step():
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        b = batches[state["i"] % len(batches)]
        state["i"] += 1
        loss = model(b[:, :-1], b[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        state["loss"] = loss.detach()

    return model, opt, step, state


def e2e_compile(ctx: Ctx) -> None:
    import time

    import _common as C
    import _models as M

    size = ctx.pick("300m", "quick")
    cfg = M.SIZES[size]
    batches = M.synthetic_batches(cfg, 4, ctx.device)
    built = ctx.shared.setdefault("e2e", {"size": size, "cfg": cfg, "runs": {}})
    float8, _ = C.load_torchao()
    # torchao's tensorwise on the same model says whether a gap to bf16 is the model's size
    # (small GEMMs gain little from FP8) or f8tensor's own overhead.
    for recipe in RECIPES + (("torchao tensorwise",) if float8 is not None else ()):
        model, opt, step, state = build_step(ctx, recipe, size, batches)
        t0 = time.monotonic()
        step()
        C.sync(ctx.device)
        compile_s = time.monotonic() - t0
        t1 = time.monotonic()
        step()  # a second step: whatever the first one left to compile (the optimizer's state)
        C.sync(ctx.device)
        ctx.row(
            recipe=recipe,
            mode="compiled",
            shape=size,
            metric="first_step_s",
            value=compile_s,
            unit="s",
            detail=f"second step {time.monotonic() - t1:.2f} s; {M.count_parameters(model) / 1e6:.0f}M parameters",
        )
        built["runs"][recipe] = (model, opt, step, state)
        ctx.say(f"  {recipe}: first step (compile) {compile_s:.1f} s")


def e2e_step(ctx: Ctx) -> None:
    import _common as C

    built = ctx.shared_from("e2e", "e2e_compile")
    if not built["runs"]:
        raise RuntimeError("e2e_compile left no compiled model (see its status)")
    cfg, size, runs = built["cfg"], built["size"], built["runs"]
    tokens = cfg.batch * cfg.seq
    try:
        steps = {(recipe, "compiled"): run[2] for recipe, run in runs.items()}
        rounds, per_round = ctx.pick((3, 5), (1, 1))
        timings = C.interleaved(steps, rounds, per_round, ctx.device)
        base = timings.get(("bf16", "compiled"))
        peaks = {}
        for recipe, (model, opt, step, state) in runs.items():
            resident = sum(t.numel() * t.element_size() for t in C.state_tensors(model, opt))
            peaks[recipe] = C.measure_peak(step, resident, ctx.device).peak / 2**20
        split_rows(ctx, {recipe: run[2] for recipe, run in runs.items()}, size, "compiled")
        for (recipe, mode), t in timings.items():
            tps = tokens / (t.median / 1e3)
            ratio = base.median / t.median if base else float("nan")
            loss = float(runs[recipe][3]["loss"])
            ctx.row(
                recipe=recipe,
                mode=mode,
                shape=size,
                metric="tokens_per_s",
                value=tps,
                unit="tokens/s",
                ratio=ratio,
                detail=f"{t.median:.2f} ms/step over {len(t.all)} steps; last loss {loss:.3f}",
            )
            ctx.row(
                recipe=recipe,
                mode=mode,
                shape=size,
                metric="peak_mib",
                value=peaks[recipe],
                unit="MiB",
                ratio=peaks[recipe] / peaks["bf16"] if "bf16" in peaks else float("nan"),
            )
    finally:
        runs.clear()


def host_device_split(ctx: Ctx, step, steps: int) -> dict[str, float]:
    """Per step: ``host_ms`` (the call's time from an idle queue: what the host spends issuing
    the step), ``device_ms`` (the device's busy time: its kernels' durations summed) and
    ``kernels`` (device kernels, memcpys and memsets; on a CPU: top-level ATen ops, and
    ``device_ms`` is their time)."""
    import statistics
    import time

    import _common as C
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    host = []
    for _ in range(steps):
        C.sync(ctx.device)
        t0 = time.perf_counter()
        step()
        host.append(1e3 * (time.perf_counter() - t0))
    C.sync(ctx.device)
    cuda = ctx.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            step()
        C.sync(ctx.device)
    if cuda:
        events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    else:
        events = [e for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")]
    busy = sum(e.time_range.elapsed_us() for e in events) / 1e3
    return {"host_ms": statistics.median(host), "device_ms": busy / steps, "kernels": len(events) / steps}


def split_rows(ctx: Ctx, steps: dict, shape: str, mode: str) -> None:
    """``host_ms``, ``device_ms`` and ``kernels`` rows (:func:`host_device_split`) of each step."""
    n = ctx.pick(3, 1)
    split = {recipe: host_device_split(ctx, step, n) for recipe, step in steps.items()}
    units = {"host_ms": "ms", "device_ms": "ms", "kernels": "kernels" if ctx.device.type == "cuda" else "CPU ops"}
    for recipe, found in split.items():
        for metric, value in found.items():
            base = split.get("bf16", {}).get(metric)
            # Times: bf16's / ours (a speed-up); kernels: ours / bf16's.
            ratio = (base / value if metric != "kernels" else value / base) if base and value else float("nan")
            ctx.row(
                recipe=recipe,
                mode=mode,
                shape=shape,
                metric=metric,
                value=value,
                unit=units[metric],
                ratio=ratio,
                detail="per step",
            )
