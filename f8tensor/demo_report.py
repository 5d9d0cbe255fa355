"""The demo's results: one run's measurements, the comparison table with its notes, and
the loss-curve figure (``python -m f8tensor.demo`` prints and draws these)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch

BASELINE = "bf16"


@dataclasses.dataclass
class RunResult:
    name: str
    losses: list[float]
    tokens_per_s: float
    saved_bytes: int
    saturation: float | None
    seconds: float
    optim_bytes: int = 0  # the optimizer's state (moments, scales, master remainders)

    def final_loss(self, last: int) -> float:
        tail = self.losses[-last:]
        return sum(tail) / len(tail)


# ===================================================================== report


def format_table(results: Sequence[RunResult], last: int) -> str:
    base = next((r for r in results if r.name == BASELINE), None)
    header = (
        f"{'run':<19}{'final loss':>11}{'vs bf16':>9}{'tokens/s':>10}{'vs bf16':>9}"
        f"{'act. MiB':>10}{'vs bf16':>9}{'saturated':>11}{'opt. MiB':>10}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        loss = r.final_loss(last)
        rel_loss = rel_tok = rel_mem = "-"
        if base is not None and r is not base:
            rel_loss = f"{100.0 * (loss - base.final_loss(last)) / base.final_loss(last):+.2f}%"
            rel_tok = f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base.tokens_per_s > 0 else "n/a"
            rel_mem = f"{r.saved_bytes / base.saved_bytes:.2f}x" if base.saved_bytes > 0 else "n/a"
        sat = "n/a" if r.saturation is None else f"{100.0 * r.saturation:.3g}%"
        lines.append(
            f"{r.name:<19}{loss:>11.4f}{rel_loss:>9}{r.tokens_per_s:>10.0f}{rel_tok:>9}"
            f"{r.saved_bytes / 2**20:>10.2f}{rel_mem:>9}{sat:>11}{r.optim_bytes / 2**20:>10.2f}"
        )
    return "\n".join(lines)


def table_notes(
    results: Sequence[RunResult], last: int, steps: int, device: torch.device, fp8_activations: bool = False
) -> str:
    """What each column means, under the table."""
    notes = [
        ("final loss", f"mean of the last {last} of {steps} steps; same weights and batches in every run."),
        ("", "Gaps of a percent or so are noise here: another --seed moves bf16 itself that much."),
        ("tokens/s", "from the median step time, warm-up steps excluded."),
    ]
    if device.type == "cpu":
        notes += [
            ("", "CPU: no FP8 hardware, torch._scaled_mm runs a reference kernel, so this shows"),
            ("", "what the casts cost, not a speed-up (that needs a GPU, compute capability >= 8.9)."),
        ]
    notes += [
        ("act. MiB", "allocated by one training forward and loss and alive for backward (eager, from the"),
        ("", "allocator's records); parameters and their bf16 copies excluded, FP8 data with its scales."),
    ]
    if fp8_activations:
        notes.append(("", "--fp8-activations: FP8 runs saved their activations in FP8; bf16 did not."))
    notes += [
        ("opt. MiB", "the optimizer's state after training: moments (and their FP8 scales), step counters"),
        ("", "excluded; --optim picks fp32 (adamw), bf16 (adamw-bf16) or FP8 (adamw-fp8) moments."),
    ]
    if any(r.name != BASELINE and r.saturation is None for r in results):
        notes.append(("saturated", "n/a: this f8tensor has no per-layer telemetry (f8tensor.stats.float8_stats)."))
    else:
        notes += [
            ("saturated", "mean fraction of values clamped at the FP8 maximum per cast, over one more"),
            ("", "step on a batch not trained on, with the telemetry of f8tensor.stats on."),
        ]
    return "\n".join(f"{key:<11} {text}" for key, text in notes)


def plot_losses(results: Sequence[RunResult], path: Path, title: str) -> bool:
    """Write the loss curves (and their gap to bf16) to ``path``; False without matplotlib."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state
    except ImportError:
        print(
            "matplotlib is not installed, so no loss-curve figure was written; install it with\n"
            '  python -m pip install matplotlib      (or: python -m pip install -e ".[demo]")'
        )
        return False
    base = next((r for r in results if r.name == BASELINE), None)
    fig = Figure(figsize=(11, 4.2) if base else (6, 4.2), layout="constrained")
    axes = fig.subplots(1, 2 if base else 1, squeeze=False)[0]
    steps = len(results[0].losses)
    window = max(1, steps // 25)
    curves = {r.name: _smooth(r.losses, window) for r in results}
    # One colour per recipe, the same in both panels (the gap panel has no bf16 line, so
    # matplotlib's own colour cycle would shift every recipe by one there).
    colours = {name: f"C{i}" for i, name in enumerate(curves)}
    for name, curve in curves.items():
        axes[0].plot(range(1, steps + 1), curve, label=name, linewidth=1.3, color=colours[name])
    # The first steps fall steeply from ln(256) = 5.5; show the part where the runs differ.
    lowest = min(min(c) for c in curves.values())
    top = max(c[min(steps - 1, steps // 10)] for c in curves.values())
    if top > lowest:
        axes[0].set_ylim(lowest - 0.05 * (top - lowest), top)
    axes[0].set(xlabel="step", ylabel=f"training loss (moving mean of {window} steps)", title="loss")
    axes[0].legend()
    if base is not None:
        for r in results:
            if r is not base:
                gap = [100.0 * (a - b) / b for a, b in zip(r.losses, base.losses)]
                axes[1].plot(
                    range(1, steps + 1), _smooth(gap, window), label=r.name, linewidth=1.3, color=colours[r.name]
                )
        axes[1].axhline(0.0, color="black", linewidth=0.8)
        axes[1].set(xlabel="step", ylabel="loss vs bf16, % (same batches)", title="gap to bf16")
        if len(results) > 1:
            axes[1].legend()
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def _smooth(values: Sequence[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out
