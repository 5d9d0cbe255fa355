"""The benchmark that represents users: a Llama-3-8B-shaped model (``_models`` size
``llama8b-4``: dim 4096, 32 heads / 8 KV, head dim 128, SwiGLU 14336, RMSNorm, RoPE, vocab
32k, 4 layers, one 8192-token sequence, output head in bf16, AdamW), each block compiled:
bf16 against f8tensor tensorwise, rowwise and blockwise and torchao.float8 tensorwise and
rowwise, interleaved.

Three items: ``llama_compile`` builds and compiles every configuration (first-step
seconds); ``llama_step`` times them interleaved (tokens/s, step time, peak memory, host and
device-busy time and kernels per step) and keeps the profile of tensorwise and bf16 (top
kernels; the trace file); ``llama_graphs`` times bf16 and tensorwise with CUDA graphs
(``torch.compile(mode="reduce-overhead")`` per block). The dry run uses the ``quick`` size.
"""

from __future__ import annotations

import time

from .runner import Ctx, failure_status

SIZE, DRY_SIZE = "llama8b-4", "quick"
RECIPES = ("bf16", "tensorwise", "rowwise", "blockwise")
TORCHAO = ("torchao tensorwise", "torchao rowwise")
#: The CUDA-graphs variant: the baseline and the first target's recipe.
GRAPHED = ("bf16", "tensorwise")
#: Profiled in ``llama_step`` (their top kernels; the first one's Chrome trace kept).
PROFILED = ("tensorwise", "bf16")


def _compile_all(ctx: Ctx, recipes, mode: str | None, label: str) -> dict:
    """Build and run two steps of each of ``recipes``; ``{recipe: (model, opt, step, state)}``."""
    import _common as C
    import _models as M

    from . import e2e

    size = ctx.pick(SIZE, DRY_SIZE)
    cfg = M.SIZES[size]
    batches = M.synthetic_batches(cfg, 2, ctx.device)
    runs = {}
    for recipe in recipes:
        try:
            model, opt, step, state = e2e.build_step(ctx, recipe, size, batches, mode=mode)
            t0 = time.monotonic()
            step()
            C.sync(ctx.device)
            first = time.monotonic() - t0
            step()
            C.sync(ctx.device)
        except Exception as e:  # noqa: BLE001  (one configuration failing does not cost the others)
            ctx.row(recipe=recipe, mode=label, shape=size, metric="first_step_s", unit="s", status=failure_status(e))
            continue
        ctx.row(recipe=recipe, mode=label, shape=size, metric="first_step_s", value=first, unit="s")
        ctx.say(f"  {recipe} ({label}): first step (compile) {first:.1f} s")
        runs[recipe] = (model, opt, step, state)
    return runs


def _time_rows(ctx: Ctx, runs: dict, mode: str) -> None:
    """Interleaved step times of ``runs``: ``step_ms``, ``tokens_per_s`` and ``peak_mib`` rows."""
    import _common as C
    import _models as M

    size = ctx.pick(SIZE, DRY_SIZE)
    cfg = M.SIZES[size]
    rounds, per_round = ctx.pick((3, 3), (1, 1))
    timings = C.interleaved({r: run[2] for r, run in runs.items()}, rounds, per_round, ctx.device)
    base = timings.get("bf16")
    for recipe, t in timings.items():
        model, opt, step, state = runs[recipe]
        ratio = base.median / t.median if base else float("nan")
        detail = f"median of {len(t.all)} steps; last loss {float(state['loss']):.3f}"
        ctx.row(recipe=recipe, mode=mode, shape=size, metric="step_ms", value=t.median, unit="ms", ratio=ratio)
        tokens = cfg.batch * cfg.seq / (t.median / 1e3)
        ctx.row(
            recipe=recipe,
            mode=mode,
            shape=size,
            metric="tokens_per_s",
            value=tokens,
            unit="tokens/s",
            ratio=ratio,
            detail=detail,
        )
    peaks = {}
    for recipe, (model, opt, step, _) in runs.items():
        resident = sum(t.numel() * t.element_size() for t in C.state_tensors(model, opt))
        peaks[recipe] = C.measure_peak(step, resident, ctx.device).peak / 2**20
    for recipe, peak in peaks.items():
        ratio = peak / peaks["bf16"] if "bf16" in peaks else float("nan")
        ctx.row(recipe=recipe, mode=mode, shape=size, metric="peak_mib", value=peak, unit="MiB", ratio=ratio)


def llama_compile(ctx: Ctx) -> None:
    import _common as C

    float8, note = C.load_torchao()
    recipes = RECIPES + (TORCHAO if float8 is not None else ())
    if float8 is None:
        ctx.note(f"torchao rows not run: absent (torchao): {note}")
    ctx.shared["llama"] = _compile_all(ctx, recipes, None, "compiled")


def llama_step(ctx: Ctx) -> None:
    from . import e2e, profiles

    runs = ctx.shared_from("llama", "llama_compile")
    size = ctx.pick(SIZE, DRY_SIZE)
    try:
        _time_rows(ctx, runs, "compiled")
        e2e.split_rows(ctx, {r: run[2] for r, run in runs.items()}, size, "compiled")
        for recipe in PROFILED:
            if recipe in runs:
                profiles.profile_one(ctx, f"llama_step {recipe} compiled {size}", runs[recipe][2])
    finally:
        runs.clear()


def llama_graphs(ctx: Ctx) -> None:
    from . import e2e

    runs = _compile_all(ctx, GRAPHED, "reduce-overhead", "cuda graphs")
    if not runs:
        raise RuntimeError("no configuration compiled with CUDA graphs (see the rows)")
    try:
        _time_rows(ctx, runs, "cuda graphs")
        e2e.split_rows(ctx, {r: run[2] for r, run in runs.items()}, ctx.pick(SIZE, DRY_SIZE), "cuda graphs")
    finally:
        runs.clear()
