"""The demo's report: the table (80 columns, no column equal in every row, one format for
percentages) and the figure (bf16 visible, a smoothing that invents no plateau, the band
of seed noise)."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from helpers import demo_table

import f8tensor
from f8tensor.demo import ABLATIONS
from f8tensor.demo import report as demo_report
from f8tensor.demo.report import RunResult, ema, format_table, table_notes

CPU = torch.device("cpu")


def _results(names, optim_bytes=(3 * 2**20,), saturation=2e-5) -> list[RunResult]:
    """A run per name, every column filled with figures as wide as a real run's."""
    out = []
    for k, name in enumerate(names):
        losses = [5.5 - 0.01 * i + 0.001 * k for i in range(250)]
        sat = None if name == "bf16" else saturation
        out.append(
            RunResult(
                name,
                losses,
                12345.0 - 1000 * k,
                11_000_000 - 10_000 * k,
                sat,
                20.0,
                optim_bytes[k % len(optim_bytes)],
                123_000_000 - 1_000_000 * k,  # peak: "117.3" MiB and below
            )
        )
    return out


def test_the_table_and_its_notes_fit_80_columns_with_the_longest_names():
    # Every run of one demo has the same optimizer, so its column is left out; all the
    # others are shown.
    results = _results(["bf16", *f8tensor.RECIPES, *ABLATIONS])
    table = format_table(results, 25)
    assert len(demo_table(table + "\n")["tensorwise"]) == len(demo_report._TITLES) - 2
    notes = table_notes(results, 25, 250, CPU, fp8_activations="recompute")
    assert "peak MiB" in table.splitlines()[0] and "rebuilt norms" in " ".join(notes.split())
    widths = [len(line) for line in (table + "\n" + notes).splitlines()]
    assert max(widths) <= demo_report.TABLE_WIDTH, max(widths)  # it was 98


def test_a_column_equal_in_every_row_is_left_out_and_its_value_said():
    results = _results(["bf16", "tensorwise", "rowwise"])  # the same optimizer state in every run
    table = format_table(results, 25)
    rows = demo_table(table + "\n")
    assert "opt. MiB" not in table.splitlines()[0]
    for column in rows["bf16"]:  # every column left differs between rows
        assert len({row[column] for row in rows.values()}) > 1, column
    notes = " ".join(table_notes(results, 25, 250, CPU).split())
    assert "opt. MiB 3.00 in every run (so no column);" in notes
    # One run: nothing is compared, every column shown.
    assert "opt. MiB" in format_table(results[:1], 25)


def test_percentages_have_one_format():
    results = _results(["bf16", "tensorwise", "rowwise"], saturation=0.0123)
    results.append(RunResult("delayed", results[0].losses, 1.0, 1, 2e-7, 1.0, 3 * 2**20))
    rows = demo_table(format_table(results, 25) + "\n")
    cells = [c for row in rows.values() for c in row.values() if c.endswith("%")]
    assert {rows["tensorwise"]["sat."], rows["delayed"]["sat."]} == {"1.23%", "<0.01%"}
    assert rows["delayed"]["loss vs bf16"] == "+0.00%"  # the same loss: no "-0.00%"
    assert all(re.fullmatch(r"[+-]?\d+\.\d\d%|<0\.01%", c) for c in cells), cells


def test_the_notes_say_how_many_cpu_threads(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    notes = " ".join(table_notes(_results(["bf16"]), 25, 250, CPU).split())
    assert "1 CPU thread (--threads N for more)" in notes


# --- the figure ---------------------------------------------------------------------


@pytest.fixture
def figure(monkeypatch, tmp_path):
    """Draws ``results``; returns the matplotlib Figure instead of writing it."""
    matplotlib_figure = pytest.importorskip("matplotlib.figure")
    saved = []
    monkeypatch.setattr(matplotlib_figure.Figure, "savefig", lambda fig, *a, **k: saved.append(fig))

    def draw(results):
        assert demo_report.plot_losses(results, tmp_path / "x.png", "t")
        return saved[-1]

    return draw


def test_bf16_is_drawn_last_and_dashed(figure):
    left = figure(_results(["bf16", "tensorwise", "rowwise"])).axes[0]
    lines = left.get_lines()
    assert lines[-1].get_label().startswith("bf16")
    assert lines[-1].get_linestyle() == "--"
    assert lines[-1].get_zorder() > max(line.get_zorder() for line in lines[:-1])


def test_one_outlier_step_decays_instead_of_holding_a_plateau(figure):
    steps, spike = 100, 40
    base = [2.0] * steps
    fp8 = [2.2 if i == spike else 2.0 for i in range(steps)]  # one step 10% above bf16
    right = figure([RunResult("bf16", base, 1.0, 1, None, 1.0), RunResult("tensorwise", fp8, 1.0, 1, 0.0, 1.0)]).axes[1]
    (gap,) = [line.get_ydata() for line in right.get_lines() if line.get_label() == "tensorwise"]
    assert max(gap) == gap[spike]
    tail = [float(g) for g in gap[spike:]]
    # A moving mean over a window holds 10%/window for the window's length (a box); the
    # average here falls at every step after the spike.
    assert all(b < a for a, b in itertools.pairwise(tail)), tail[:8]


def test_the_gap_panel_shades_the_seed_noise(figure):
    right = figure(_results(["bf16", "tensorwise"])).axes[1]
    (band,) = [p for p in right.patches if "seed noise" in p.get_label()]
    y = right.transData.inverted().transform(band.get_verts())[:, 1]  # the band's corners, in %
    assert (y.min(), y.max()) == pytest.approx((-demo_report.SEED_NOISE_PCT, demo_report.SEED_NOISE_PCT))


def test_ema_starts_at_the_first_value_and_keeps_a_constant():
    assert ema([3.0, 3.0, 3.0], 10) == pytest.approx([3.0, 3.0, 3.0])
    assert ema([1.0, 2.0], 1) == [1.0, 2.0]  # a span of one step: the values themselves
    assert ema([4.0, 0.0], 2) == pytest.approx([4.0, 4.0 / 3.0])  # (0.5 * 0.5 * 4) / (1 - 0.25)


def test_ema_refuses_a_span_below_one_step():
    with pytest.raises(ValueError, match="span must be a positive number of steps; got 0"):
        ema([1.0], 0)
