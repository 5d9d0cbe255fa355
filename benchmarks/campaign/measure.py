"""Measuring pieces the items share: ops seen, SQNR, interleaved timing, compile."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from .runner import Ctx, error_text


def ops_seen(fn: Callable[[], Any]) -> set[str]:
    """The ATen ops one call of ``fn`` runs, as the profiler records them (every level)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


def scaled_ops(ops: Iterable[str]) -> list[str]:
    return sorted(o for o in ops if "scaled" in o and ("mm" in o or "grouped" in o))


def sqnr_db(ref, out) -> float:
    from f8tensor import sqnr

    return float(sqnr(ref.detach().float().cpu(), out.detach().float().cpu()))


def compile_fn(fn, dynamic: bool | None = False):
    import torch

    return torch.compile(fn, dynamic=dynamic)


def timed_configs(ctx: Ctx, steps: dict[tuple, Callable[[], Any]], warmup: int, rounds: int, per_round: int):
    """Warm up every configuration (a failure drops it, recorded), then time them in interleaved
    rounds with CUDA events (``_common.interleaved``). Returns ``({key: Timing}, {key: error})``."""
    import _common as C

    ready, failed = {}, {}
    for key, step in steps.items():
        try:
            for _ in range(warmup + (2 if "compiled" in key else 0)):
                step()
            C.sync(ctx.device)
            ready[key] = step
        except Exception as e:  # noqa: BLE001  (one configuration failing does not cost the others)
            failed[key] = error_text(e)[0]
            ctx.say(f"  {' '.join(map(str, key))}: failed in warm-up: {failed[key]}")
    return (C.interleaved(ready, rounds, per_round, ctx.device) if ready else {}), failed


def timing_rows(ctx: Ctx, shape: str, timings, failed, skip: Iterable[tuple] = ()) -> None:
    """Rows of ``(recipe, mode)``-keyed step times, with the speed-up over bf16 in the same mode."""
    base = {mode: t.median for (recipe, mode), t in timings.items() if recipe == "bf16"}
    for (recipe, mode), t in timings.items():
        if (recipe, mode) in skip:
            continue
        ratio = base[mode] / t.median if mode in base else math.nan
        ctx.row(
            recipe=recipe,
            mode=mode,
            shape=shape,
            metric="step_ms",
            value=t.median,
            unit="ms",
            ratio=ratio,
            detail=f"median of {len(t.all)} steps, spread +-{100 * t.spread:.1f}%" if t.spread == t.spread else "",
        )
    for (recipe, mode), why in failed.items():
        ctx.row(recipe=recipe, mode=mode, shape=shape, metric="step_ms", unit="ms", status=f"failed: {why}")
