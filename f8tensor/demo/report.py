"""The demo's results: one run's measurements, the comparison table with its notes, and
the loss-curve figure (``python -m f8tensor.demo`` prints and draws these)."""

from __future__ import annotations

import dataclasses
import textwrap
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
    peak_bytes: int = 0  # peak memory of the last training step

    def final_loss(self, last: int) -> float:
        tail = self.losses[-last:]
        return sum(tail) / len(tail)


# ===================================================================== report

#: The table and its notes fit a terminal this wide.
TABLE_WIDTH = 80
#: A loss gap to bf16 within this many percent is noise: changing ``--seed`` moves bf16's
#: own final loss about that much (default CPU run, seeds 0 to 3: 2.224 to 2.249, 1.1%).
#: Shaded in the figure, said under the table.
SEED_NOISE_PCT = 1.0

_TITLES = ("run", "loss", "vs bf16", "tok/s", "vs bf16", "act. MiB", "vs bf16", "sat.", "opt. MiB", "peak MiB")
_NOT_COMPARED = "-"  # a cell with nothing to say: the baseline against itself, no baseline


def _percent(fraction: float, signed: bool = False) -> str:
    """Every percentage of the table, one way: two decimals (``<0.01%`` for less but not 0)."""
    pct = round(100.0 * fraction, 2) + 0.0  # + 0.0: no "-0.00%"
    if not signed and pct == 0.0 and fraction > 0.0:
        return "<0.01%"
    return f"{pct:+.2f}%" if signed else f"{pct:.2f}%"


def _cells(results: Sequence[RunResult], last: int) -> list[list[str]]:
    """The table's cells, a row per run, a column per entry of ``_TITLES``."""
    base = next((r for r in results if r.name == BASELINE), None)
    rows = []
    for r in results:
        loss = r.final_loss(last)
        rel_loss = rel_tok = rel_mem = _NOT_COMPARED
        if base is not None and r is not base:
            rel_loss = _percent(loss / base.final_loss(last) - 1.0, signed=True)
            rel_tok = f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base.tokens_per_s > 0 else "n/a"
            rel_mem = f"{r.saved_bytes / base.saved_bytes:.2f}x" if base.saved_bytes > 0 else "n/a"
        if r.name == BASELINE:
            sat = _NOT_COMPARED
        else:
            sat = "n/a" if r.saturation is None else _percent(r.saturation)
        rows.append(
            [
                r.name,
                f"{loss:.4f}",
                rel_loss,
                f"{r.tokens_per_s:.0f}",
                rel_tok,
                f"{r.saved_bytes / 2**20:.2f}",
                rel_mem,
                sat,
                f"{r.optim_bytes / 2**20:.2f}",
                f"{r.peak_bytes / 2**20:.1f}",
            ]
        )
    return rows


def _same_in_every_row(rows: list[list[str]]) -> dict[int, str]:
    """Columns (not the run's name) with one text in every row, and that text; none for one row."""
    if len(rows) < 2:
        return {}
    return {j: rows[0][j] for j in range(1, len(_TITLES)) if len({row[j] for row in rows}) == 1}


def format_table(results: Sequence[RunResult], last: int) -> str:
    """The comparison table, a row per run; a column with the same text in every row is left
    out (:func:`table_notes` gives its value)."""
    rows = _cells(results, last)
    keep = [j for j in range(len(_TITLES)) if j not in _same_in_every_row(rows)]
    widths = {j: max(len(_TITLES[j]), *(len(row[j]) for row in rows)) for j in keep}
    gap = " " * (2 if sum(widths.values()) + 2 * (len(keep) - 1) <= TABLE_WIDTH else 1)

    def line(cells: Sequence[str]) -> str:
        return gap.join(cells[j].rjust(widths[j]) if j else cells[j].ljust(widths[j]) for j in keep).rstrip()

    header = line(_TITLES)
    return "\n".join([header, "-" * len(header), *(line(row) for row in rows)])


def table_notes(
    results: Sequence[RunResult],
    last: int,
    steps: int,
    device: torch.device,
    fp8_activations: bool | str | None = False,
) -> str:
    """What each column means, under the table, wrapped to :data:`TABLE_WIDTH`."""
    speed = "tokens per second, from the median step time, warm-up steps excluded."
    if device.type == "cpu":
        n = torch.get_num_threads()
        speed += (
            f" {n} CPU thread{'s' if n > 1 else ''} (--threads N for more). No FP8 hardware on a CPU:"
            " torch._scaled_mm runs a reference kernel, so this shows what the casts cost, not a"
            " speed-up (that needs a GPU, compute capability >= 8.9)."
        )
    memory = (
        "allocated by one training forward and loss and alive for backward (eager); parameters"
        " and their bf16 copies excluded, FP8 data with its scales."
    )
    if fp8_activations:
        memory += " --fp8-activations: FP8 runs saved their activations in FP8; bf16 did not."
    if fp8_activations == "recompute":
        memory += " recompute: they rebuilt norms and activations in backward instead of saving them."
    if any(r.name != BASELINE and r.saturation is None for r in results):
        saturated = "n/a: this f8tensor has no per-layer telemetry (f8tensor.stats.float8_stats)."
    else:
        saturated = (
            "mean fraction of values clamped at the FP8 maximum per cast, over one more step on a"
            " batch not trained on, with the telemetry of f8tensor.stats on."
        )
    notes = {
        "loss": (
            f"mean training loss of the last {last} of {steps} steps; every run starts from the same"
            f" weights and sees the same batches. A gap to bf16 within {SEED_NOISE_PCT:g}% either way"
            " is noise: another --seed moves bf16 itself that much."
        ),
        "tok/s": speed,
        "act. MiB": memory,
        "sat.": saturated,
        "opt. MiB": (
            "the optimizer's state after training: moments (and their FP8 scales), step counters"
            " excluded; --optim picks fp32 (adamw), bf16 (adamw-bf16) or FP8 (adamw-fp8) moments."
        ),
        "peak MiB": (
            "peak memory of the last training step: what lives between steps (weights, optimizer"
            " state, batch) plus the highest point the step's allocations reach (CPU: storages"
            " torch's ops return, a kernel's own scratch aside)."
        ),
    }
    for j, text in _same_in_every_row(_cells(results, last)).items():
        if _TITLES[j] in notes:
            notes[_TITLES[j]] = f"{text} in every run (so no column); {notes[_TITLES[j]]}"
    key_width = max(map(len, notes)) + 2
    return "\n".join(
        textwrap.fill(
            text,
            TABLE_WIDTH,
            initial_indent=key.ljust(key_width),
            subsequent_indent=" " * key_width,
            break_on_hyphens=False,  # never split a flag such as --fp8-activations
        )
        for key, text in notes.items()
    )


# ===================================================================== figure


def ema(values: Sequence[float], span: int) -> list[float]:
    """Exponential moving average of ``values``, weight ``1/span`` on the newest, bias-corrected
    (it starts at ``values[0]``).

    A single outlier lifts it at its step and decays from there: no window-long plateau.
    """
    if span < 1:
        raise ValueError(f"span must be a positive number of steps; got {span}")
    beta = 1.0 - 1.0 / span
    out, acc = [], 0.0
    for i, v in enumerate(values, 1):
        acc = beta * acc + (1.0 - beta) * v
        out.append(acc / (1.0 - beta**i))
    return out


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
    span = max(1, steps // 25)
    x = range(1, steps + 1)
    # One colour per recipe, the same in both panels; bf16 black, dashed and drawn last, so
    # the recipes that follow it closely cannot hide it.
    others = [r for r in results if r is not base]
    colours = {r.name: f"C{i}" for i, r in enumerate(others)}
    for r in others:
        axes[0].plot(x, ema(r.losses, span), label=r.name, linewidth=1.3, color=colours[r.name], zorder=2)
    if base is not None:
        axes[0].plot(
            x,
            ema(base.losses, span),
            label=f"{BASELINE} (baseline)",
            color="black",
            linestyle="--",
            linewidth=1.3,
            zorder=3,
        )
    axes[0].set(xlabel="step", ylabel=f"training loss (moving average, {span}-step span)", title="loss")
    axes[0].legend()
    if base is not None:
        band = SEED_NOISE_PCT
        axes[1].axhspan(-band, band, color="0.88", zorder=0, label=f"±{band:g}%: seed noise")
        for r in others:
            gap = [100.0 * (a / b - 1.0) for a, b in zip(r.losses, base.losses)]
            axes[1].plot(x, ema(gap, span), label=r.name, linewidth=1.3, color=colours[r.name], zorder=2)
        axes[1].axhline(0.0, color="black", linestyle="--", linewidth=0.8, zorder=1)
        axes[1].set(
            xlabel="step",
            ylabel=f"loss / bf16 loss - 1, % (moving average, {span}-step span)",
            title="gap to bf16 (same batches)",
        )
        axes[1].legend()
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True
