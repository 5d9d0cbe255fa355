"""The GPU campaign (benchmarks/gpu_campaign.py), rehearsed on the CPU: every stage's dry run
writes the files the device brings back, in the agreed shape, and the budget logic stops
items at their deadlines and marks what it had no time for.

Marked ``campaign`` (deselect with ``-m "not campaign"``); about a minute on a 2-core CPU.
"""

from __future__ import annotations

import csv
import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.campaign

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_campaign.py"
NAME_OK = re.compile(r"^[A-Za-z0-9._-]+$")


def _load_campaign():
    spec = importlib.util.spec_from_file_location("gpu_campaign", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


campaign = _load_campaign()
CSV_FIELDS = {
    "correctness": ("correctness.csv", campaign.CORRECTNESS_FIELDS),
    "figures": ("figures.csv", campaign.FIGURE_FIELDS),
    "profile": ("profile_kernels.csv", campaign.PROFILE_FIELDS),
}


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.fixture(scope="module")
def dry_all(tmp_path_factory):
    """One dry run of all three stages (profile reads the figures stage's CSV)."""
    out = tmp_path_factory.mktemp("campaign") / "out"
    proc = _run("--stage", "all", "--dry-run", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, out


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("stage", campaign.STAGES)
def test_each_stage_writes_at_most_8_files_with_plain_names(dry_all, stage):
    _, out = dry_all
    files = [p for p in (out / stage).rglob("*") if p.is_file()]
    assert 3 <= len(files) <= 8, files
    for p in files:
        rel = p.relative_to(out / stage)
        assert len(rel.parts) <= 2, rel  # no folder deeper than one
        assert all(NAME_OK.match(part) for part in rel.parts), rel
    assert (out / stage / "summary.md").read_text().startswith(f"# f8tensor GPU campaign: {stage}")
    assert (out / stage / f"{stage}.log").read_text().startswith(f"## Environment ({stage} stage")


@pytest.mark.parametrize("stage", campaign.STAGES)
def test_csv_schema(dry_all, stage):
    _, out = dry_all
    name, fields = CSV_FIELDS[stage]
    with open(out / stage / name, newline="") as f:
        header = next(csv.reader(f))
    assert tuple(header) == fields
    rows = _rows(out / stage / name)
    assert rows, f"{name} has no rows"
    assert {r["stage"] for r in rows} == {stage}


def test_environment_is_printed_first(dry_all):
    proc, _ = dry_all
    lines = proc.stdout.splitlines()
    assert lines[0] == "## Environment (correctness stage, dry run on the CPU)", lines[:3]
    env = lines[2:14]
    for key in ("gpu", "torch", "triton", "python", "f8tensor", "f8tensor commit", "torchao"):
        assert any(line.startswith(f"- {key}:") for line in env), (key, env)


def test_every_item_ran_or_says_why(dry_all):
    _, out = dry_all
    for stage in campaign.STAGES:
        text = (out / stage / "summary.md").read_text()
        table = text[text.index("## Items and budget"):]
        statuses = [line.split("|")[5].strip() for line in table.splitlines() if re.match(r"^\| \w", line)][1:]
        assert statuses, stage
        for status in statuses:
            # On the CPU every item runs; two benchmark scripts do not exist yet.
            assert status == "ok" or status.startswith("not run: absent"), (stage, status)


def test_figures_evaluate_every_target(dry_all):
    _, out = dry_all
    rows = _rows(out / "figures" / "figures.csv")
    summary = (out / "figures" / "summary.md").read_text()
    for target in campaign.TARGETS:
        assert f"| {target.text} | {target.item} |" in summary, target.text
    judged = [r for r in rows if r["target"]]
    assert judged and {r["status"] for r in judged} <= {"met", "missed"} | {
        r["status"] for r in judged if r["status"].startswith("not run")}
    # The CPU has no FP8 units: speed targets are missed there (timing noise at these tiny
    # sizes may flip one), and every missed figure is profiled, with its baseline.
    missed = [r for r in judged if r["status"] == "missed"]
    assert any(r["metric"] == "step_ms" for r in missed)
    kernels = _rows(out / "profile" / "profile_kernels.csv")
    jobs = {campaign.Job(r["item"], r["recipe"], r["mode"], r["shape"], "", "").name for r in missed}
    assert {r["job"] for r in kernels} == jobs
    assert {r["config"].split(":")[0] for r in kernels} == {"fp8", "baseline"}
    assert (out / "profile" / "profile_trace.json.gz").stat().st_size > 0


def test_correctness_records_tests_and_checks(dry_all):
    _, out = dry_all
    rows = _rows(out / "correctness" / "correctness.csv")
    kinds = {r["kind"] for r in rows}
    assert {"pytest", "check", "demo"} <= kinds
    cuda_twins = [r for r in rows if r["kind"] == "pytest" and "[cuda" in r["name"]]
    assert cuda_twins and all(r["outcome"] == "skipped" for r in cuda_twins)
    assert all(r["outcome"] == "passed" for r in rows if r["kind"] != "pytest" or "[cpu" in r["name"])


def test_tiny_budget_marks_items_not_run(tmp_path):
    import argparse

    import torch

    # The figures stage with 1 s of budget, 2 s of it already spent (imports, say).
    args = argparse.Namespace(dry_run=True, budget_s=1.0, items=None, stage="figures")
    stage = campaign.Figures(tmp_path, args, time.monotonic() - 2, torch.device("cpu"), "absent: test")
    stage.exit_on_hard_stop = False  # its watchdog must not end pytest
    stage.run()
    assert (tmp_path / "figures.log").read_text().startswith("## Environment (figures stage")
    assert _rows(tmp_path / "figures.csv") == []
    statuses = {name: st.status for name, st in stage.states.items()}
    assert "linear_target_tensorwise" in statuses and "vit_huge" in statuses
    assert all(s.startswith(("not run: budget", "not run: absent")) for s in statuses.values()), statuses
    summary = (tmp_path / "summary.md").read_text()
    assert "| tensorwise compiled >= 1.5x bf16 | linear_target_tensorwise | - | >= 1.5x | not run: budget |" in summary
    assert "--items linear_target_tensorwise," in summary  # how to run them next


def test_an_item_is_stopped_at_its_deadline_and_the_next_runs(tmp_path):
    import argparse

    import torch

    class Sleepy(campaign.Stage):
        name, csv_name, fields = "figures", "figures.csv", campaign.FIGURE_FIELDS

        def items(self):
            def record(ctx):
                ctx.rows.append(campaign.fig("after", "bf16", "eager", "1x1x1", "step_ms", 1.0, "ms", 1.0))

            def sleep(ctx):
                ctx.rows.append(campaign.fig("sleeps", "bf16", "eager", "1x1x1", "step_ms", 2.0, "ms", 1.0))
                time.sleep(60)

            return [campaign.Item("sleeps", 270, sleep, "sleeps past its deadline", min_s=0),
                    campaign.Item("after", 270, record, "runs after it", min_s=0)]

    # 10 s: each item's deadline is 5 s after the stage starts, room for the environment
    # probe on a loaded machine (with 3 s, "after" found its deadline already gone).
    args = argparse.Namespace(dry_run=True, budget_s=10.0, items=None, stage="figures")
    stage = Sleepy(tmp_path, args, time.monotonic(), torch.device("cpu"), "absent: test")
    stage.exit_on_hard_stop = False
    t0 = time.monotonic()
    stage.run()
    assert time.monotonic() - t0 < 20
    assert stage.states["sleeps"].status == "not run: budget"
    assert "stopped at its deadline" in stage.states["sleeps"].detail
    assert stage.states["after"].status == "ok"
    rows = _rows(tmp_path / "figures.csv")
    assert [r["item"] for r in rows] == ["sleeps", "after"]  # what the stopped item recorded is kept


def test_plan_deadlines_scale_with_the_budget():
    items = [campaign.Item(n, s, lambda c: None, "") for n, s in (("a", 100), ("b", 200), ("c", 400))]
    assert campaign.plan_deadlines(items, campaign.DEFAULT_BUDGET_S) == [100, 300, campaign.DEFAULT_BUDGET_S]
    assert campaign.plan_deadlines(items, campaign.DEFAULT_BUDGET_S / 10) == pytest.approx([10, 30, 54])


def test_junit_rows(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_x" name="test_a[cuda-tensorwise]" file="tests/test_x.py" time="0.5"/>'
        '<testcase classname="tests.test_x" name="test_b[cpu]" time="0.1"><failure message="assert 1 == 2">x</failure>'
        '</testcase><testcase classname="tests.test_x" name="test_c"><skipped message="needs CUDA"/></testcase>'
        "</testsuite></testsuites>"
    )
    rows = campaign.junit_rows(xml, "cuda")
    assert [(r["name"], r["outcome"]) for r in rows] == [
        ("tests/test_x.py::test_a[cuda-tensorwise]", "passed"),
        ("tests/test_x.py::test_b[cpu]", "failed"),
        ("tests/test_x.py::test_c", "skipped"),
    ]
    assert rows[1]["detail"] == "assert 1 == 2"
