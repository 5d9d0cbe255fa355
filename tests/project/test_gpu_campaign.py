"""The GPU campaign (benchmarks/gpu_campaign.py, benchmarks/campaign/), rehearsed on the CPU:
the default plan fits one 480-s command and every item has a deadline; each plan's dry run
writes at most 8 files in the agreed shape; the runner keeps one deadline from process start,
stops items at their deadlines, and reports an absent optional package as ``not run: absent``.

Marked ``campaign`` (deselect with ``-m "not campaign"``); about three minutes on a quiet 2-core CPU.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.campaign

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_campaign.py"
NAME_OK = re.compile(r"^[A-Za-z0-9._-]+$")
sys.path.insert(0, str(REPO / "benchmarks"))

from campaign import linear, plans, report, runner, targets


def _run(*args: str, blocked=None, timeout: float = 300, tmp=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **({"TMPDIR": str(tmp)} if tmp else {}))
    paths = [str(blocked)] if blocked else []
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
    )


@pytest.fixture(scope="module")
def blocked(tmp_path_factory):
    """A folder that, first on PYTHONPATH, makes ``import timm`` and ``import torchao`` fail as
    when they are not installed, whether or not they are."""
    d = tmp_path_factory.mktemp("blocked")
    for name in ("timm", "torchao"):
        (d / name).mkdir()
        (d / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}' (blocked by the test)\", name={name!r})\n"
        )
    return d


@pytest.fixture(scope="module")
def dry_default(tmp_path_factory, blocked):
    out = tmp_path_factory.mktemp("campaign") / "default"
    proc = _run("--dry-run", "--out", str(out), blocked=blocked, tmp=tmp_path_factory.mktemp("tmpdir"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, out


FORCED_MISS = {
    "item": "linear_target",
    "kind": "figure",
    "recipe": "tensorwise",
    "mode": "compiled",
    "shape": "x".join(map(str, linear.DRY_SHAPE)),
    "metric": "step_ms",
    "status": "missed",
}


@pytest.fixture(scope="module")
def dry_second(tmp_path_factory, blocked, dry_default):
    root = tmp_path_factory.mktemp("campaign")
    out = root / "second"
    # Which figures a CPU dry run misses depends on the CPU's timings; one compiled miss is
    # added so that the compiled profile is always exercised.
    forced = root / "forced.csv"
    report.write_csv(forced, [FORCED_MISS])
    proc = _run(
        "--second",
        "--dry-run",
        "--out",
        str(out),
        "--figures-csv",
        f"{dry_default[1] / 'results.csv'},{forced}",
        blocked=blocked,
        tmp=tmp_path_factory.mktemp("tmpdir"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, out


def _statuses(out: Path) -> dict[str, str]:
    text = (out / "summary.md").read_text()
    table = text[text.index("## Items and budget") :].splitlines()
    return {
        c[1].strip(): c[5].strip()
        for c in (ln.split("|") for ln in table if re.match(r"^\| \w", ln))
        if c[1].strip() != "item"
    }


def _plan(*flags: str) -> tuple[list[str], int]:
    proc = _run("--plan", *flags, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    total = re.fullmatch(r"planned total: (\d+) s", lines[-1])
    assert total, lines[-1]
    return lines[1:-1], int(total.group(1))


def test_plan_fits_one_command_and_every_item_has_a_deadline():
    lines, total = _plan()
    assert total <= 480
    names = [ln.split()[0] for ln in lines]
    # The smoke test, then the checks of the features no GPU has run yet, then the figures:
    # the Llama-shaped model first.
    assert names[:9] == [
        "smoke",
        "fused_optimizer_step",
        "fp8_activation_casts",
        "llama_compile",
        "llama_step",
        "llama_graphs",
        "linear_target",
        "moe_grouped",
        "references",
    ]
    assert all(n.startswith("pytest_gpu") for n in names[9:]) and len(names) > 9
    for ln in lines:
        assert re.search(r"plan +\d+ s +deadline \+ *\d+ s", ln), ln
    deadlines = [int(re.search(r"deadline \+ *(\d+)", ln).group(1)) for ln in lines]
    assert deadlines == sorted(deadlines) and deadlines[-1] <= plans.DEFAULT_BUDGET_S["default"] < 480
    second, total = _plan("--second")
    assert total <= 240 and all("deadline +" in ln for ln in second)
    # The 300m (an overhead check) and the eager overhead moved to the second plan.
    assert [ln.split()[0] for ln in second][:3] == ["e2e_compile", "e2e_step", "eager_overhead"]


def test_dry_run_writes_at_most_8_files_with_plain_names(dry_default, dry_second):
    for (_, out), plan in ((dry_default, "default"), (dry_second, "second")):
        files = [p for p in out.rglob("*") if p.is_file()]
        assert 3 <= len(files) <= 8, files
        assert all(len(p.relative_to(out).parts) == 1 and NAME_OK.match(p.name) for p in files), files
        assert (out / "summary.md").read_text().startswith(f"# f8tensor GPU campaign: {plan} plan")
        assert (out / "campaign.log").read_text().startswith(f"## Environment ({plan} plan")
        with open(out / "results.csv", newline="") as f:
            assert tuple(next(csv.reader(f))) == report.FIELDS


def test_dry_runs_leave_only_the_inductor_cache_in_the_temporary_folder(tmp_path_factory, dry_default, dry_second):
    folders = sorted(tmp_path_factory.getbasetemp().glob("tmpdir[0-9]*"))  # one per dry run
    assert len(folders) == 2, folders
    for tmp in folders:
        assert sorted(p.name for p in tmp.iterdir()) in ([], ["f8tensor_campaign_inductor"]), tmp


def test_environment_is_printed_first(dry_default):
    proc, _ = dry_default
    lines = proc.stdout.splitlines()
    assert lines[0] == "## Environment (default plan, dry run on the CPU)", lines[:3]
    env = lines[2:20]
    for key in ("gpu", "cuda", "torch", "triton", "f8tensor commit", "torchao"):
        assert any(line.startswith(f"- {key}:") for line in env), (key, env)
    assert "- torchao: absent" in proc.stdout


def test_every_item_ran_or_says_why(dry_default, dry_second):
    # timm and torchao are blocked: their items and rows say "not run: absent", never "failed".
    for _, out in (dry_default, dry_second):
        statuses = _statuses(out)
        assert statuses
        for name, status in statuses.items():
            assert status == "ok" or status.startswith("not run: absent"), (name, status)
    assert _statuses(dry_second[1])["vit_huge"] == "not run: absent (timm)"
    rows = report.read_csv(dry_default[1] / "results.csv")
    assert not [r for r in rows if r["status"].startswith("failed")]
    vs_torchao = [r for r in rows if r["metric"] == "speedup_vs_torchao"]
    assert vs_torchao and {r["status"] for r in vs_torchao} == {"not run: absent (torchao)"}


def test_default_plan_measures_every_item_and_judges_every_target(dry_default):
    _, out = dry_default
    rows = report.read_csv(out / "results.csv")
    smoke = [r for r in rows if r["item"] == "smoke"]
    from f8tensor import RECIPES

    assert {r["recipe"] for r in smoke} == set(RECIPES)
    assert all(r["status"] == "passed" and "first kernel: " in r["detail"] for r in smoke)
    llama = {"bf16", "tensorwise", "rowwise", "blockwise"}  # torchao is blocked
    assert {r["recipe"] for r in rows if r["item"] == "llama_compile"} == llama
    split = {"host_ms", "device_ms", "kernels"}
    for recipe in llama:
        metrics = {r["metric"] for r in rows if r["item"] == "llama_step" and r["recipe"] == recipe}
        assert metrics >= {"step_ms", "tokens_per_s", "peak_mib"} | split, (recipe, metrics)
    graphed = {(r["recipe"], r["mode"]) for r in rows if r["item"] == "llama_graphs" and r["metric"] == "tokens_per_s"}
    assert graphed == {("bf16", "cuda graphs"), ("tensorwise", "cuda graphs")}
    # The profile of the Llama-shaped step is kept: top kernels and the trace.
    assert {r["recipe"] for r in rows if r["kind"] == "kernel"} == {
        "llama_step tensorwise compiled quick",
        "llama_step bf16 compiled quick",
    }
    assert (out / "profile_trace.json.gz").stat().st_size > 0
    references = [r for r in rows if r["item"] == "references" and r["recipe"] != "bf16"]
    assert references and all("published 1." in r["detail"] for r in references), references
    assert [r for r in rows if r["kind"] == "pytest"]
    summary = (out / "summary.md").read_text()
    in_plan = {item.name for item in plans.default_plan()}
    for t in targets.TARGETS:
        assert (f"| {t.text} | {t.item} |" in summary) == (t.item in in_plan), t.text
    assert any(t.item not in in_plan for t in targets.TARGETS)  # the 300m's, judged in the second plan
    # Each speed target is judged against its figure (met or missed: on a CPU, by its timings).
    timed = [r for r in rows if r["metric"] == "step_ms" and r["target"]]
    assert timed and all(r["status"] in ("met", "missed") for r in timed), timed


def test_second_plan_profiles_missed_figures_and_reports_absent_hooks(dry_default, dry_second):
    _, out = dry_second
    rows = report.read_csv(out / "results.csv")
    labels = {r["recipe"] for r in rows if r["kind"] == "kernel"}
    # The 300m overhead check, with the host/device split, and the eager overhead.
    assert {r["recipe"] for r in rows if r["item"] == "e2e_compile"} == {"bf16", "tensorwise", "rowwise"}
    e2e_metrics = {r["metric"] for r in rows if r["item"] == "e2e_step"}
    assert e2e_metrics == {"tokens_per_s", "peak_mib", "host_ms", "device_ms", "kernels"}, e2e_metrics
    assert {r["metric"] for r in rows if r["item"] == "eager_overhead"} == {"host_us", "kernels"}
    # Every figure the first command missed, and the compiled one added, is profiled with
    # its baseline.
    from campaign import profiles

    missed = [
        r
        for r in report.read_csv(dry_default[1] / "results.csv")
        if r["status"] == "missed" and r["item"] in profiles.BUILDERS
    ] + [FORCED_MISS]
    for r in missed:
        for recipe in (r["recipe"], "bf16" if r["metric"] != "speedup_vs_torchao" else f"torchao {r['recipe']}"):
            assert f"{r['item']} {recipe} {r['mode']} {r['shape']}" in labels, (r, labels)
    assert (out / "profile_trace.json.gz").stat().st_size > 0
    # Each feature check runs in one plan: the default plan's right after its smoke test,
    # the others here.
    hooks = __import__("campaign.hooks").hooks
    by_plan = {out: _statuses(out) for out in (dry_default[1], out)}
    for name, module, _ in hooks.HOOKS:
        ran_in = [o for o, statuses in by_plan.items() if name in statuses]
        assert ran_in == [dry_default[1] if name in plans.DEFAULT_HOOKS else out], name
        status = by_plan[ran_in[0]][name]
        if hooks.module_absent(module):
            assert status == f"not run: absent (module {module} does not exist yet)"
        else:
            assert status == "ok", (name, status)
    default_rows = report.read_csv(dry_default[1] / "results.csv")
    step = {r["recipe"]: float(r["value"]) for r in default_rows if r["item"] == "fused_optimizer_step"}
    assert set(step) == {"torch AdamW", "f8tensor fp32 states", "f8tensor bf16 states", "f8tensor fp8 states"}
    assert all(v > 0 for v in step.values()), step
    # accelerate's FSDP2 plugin (on the CPU accelerate ignores the plugin: the same steps unsharded)
    if not hooks.module_absent("accelerate"):
        checks = {
            (r["recipe"], r["metric"]): r["status"]
            for r in rows
            if r["item"] == "accelerate_fsdp2_plugin" and r["kind"] == "check"
        }
        # 3 per run (params mapped, wrappers kept for FP8, every parameter moved: 5), bf16
        # trains, and FP8's gap to bf16 at the last step and at the worst step.
        assert len(checks) == 8 and set(checks.values()) == {"passed"}, checks
        assert ("bf16", "last loss / first loss") in checks


def test_targets_name_what_they_retired_and_moved():
    keys = [t.key for t in targets.TARGETS]
    assert len(keys) == len(set(keys))
    assert not set(keys) & set(targets.RETIRED) and set(targets.MOVED) <= set(keys)
    llama = {"llama_tw", "llama_tw_vs_torchao", "llama_rw", "llama_rw_vs_torchao"}
    assert llama | {"e2e_300m_tw", "e2e_300m_rw"} <= set(keys)
    assert all(t.item == "llama_step" for t in targets.TARGETS if t.key in llama)


def test_budget_20_ends_within_20_s_with_its_files(tmp_path):
    t0 = time.monotonic()
    proc = _run("--dry-run", "--budget-s", "20", "--out", str(tmp_path / "b"), timeout=60)
    took = time.monotonic() - t0
    # The budget counts from the process's own start (imports included): the run's last line
    # says how long it took by that clock. The spawn and the interpreter's exit around it
    # take a second on an idle machine and several on a loaded one (24.9 s outside against
    # 18.6 s inside, measured at a load average of 8 on 2 cores), so they get their own bound.
    inside = re.search(r"wall ([0-9.]+) s from process start", proc.stdout)
    assert inside is not None, proc.stdout[-2000:]
    assert float(inside.group(1)) <= 20.5, proc.stdout[-2000:]
    assert took < 20.5 + 15, (took, proc.stdout[-2000:])
    assert proc.returncode in (0, 3), proc.stderr[-2000:]
    files = sorted(p.name for p in (tmp_path / "b").iterdir())
    # The Llama item keeps its profile's trace where it had time to run.
    assert [f for f in files if f != "profile_trace.json.gz"] == ["campaign.log", "results.csv", "summary.md"], files
    statuses = _statuses(tmp_path / "b")
    assert list(statuses) == [i.name for i in plans.default_plan()]
    log = (tmp_path / "b" / "campaign.log").read_text()[-3000:]
    assert all(s == "ok" or s.startswith(("not run: budget", "not run: absent")) for s in statuses.values()), (
        statuses,
        log,
    )


# ----------------------------------------------------------------- the runner, in process


def _args(budget_s: float) -> argparse.Namespace:
    return argparse.Namespace(dry_run=True, budget_s=budget_s, figures_csv=None)


def _runner(tmp_path, items, budget_s, start=None):
    import torch

    r = runner.Runner(
        "default",
        items,
        tmp_path,
        _args(budget_s),
        start or time.monotonic(),
        torch.device("cpu"),
        [("gpu", "none (test)")],
    )
    r.exit_on_hard_stop = False  # the watchdog must not end pytest
    return r


def test_an_item_is_stopped_at_its_deadline_and_the_next_runs(tmp_path):
    def sleep(ctx):
        ctx.row(metric="before_sleep", value=1.0)
        time.sleep(60)

    items = [
        runner.Item("sleeps", 100, sleep, "sleeps past its deadline", min_s=0),
        runner.Item("after", 100, lambda ctx: ctx.row(metric="after", value=2.0), "runs after it", min_s=0),
    ]
    r = _runner(tmp_path, items, 10.0)  # deadlines +4 s and +8 s
    t0 = time.monotonic()
    r.run()
    assert time.monotonic() - t0 < 10
    assert r.states["sleeps"].status == "not run: budget"
    assert "stopped at its deadline" in r.states["sleeps"].detail
    assert r.states["after"].status == "ok"
    rows = [x for x in report.read_csv(tmp_path / "results.csv") if x["kind"] != "env"]
    assert [x["metric"] for x in rows] == ["before_sleep", "after"]  # what the stopped item recorded is kept


def test_a_deadline_wrapped_in_another_error_is_still_the_budget(tmp_path):
    # Code under an item may catch the deadline and raise its own error from it (as a
    # compiler wrapping what interrupted it does): the item ran out of time, it did not fail.
    def wraps(ctx):
        try:
            time.sleep(60)
        except BaseException as e:
            raise RuntimeError("backend compiler failed") from e

    items = [runner.Item("wraps", 100, wraps, "wraps its deadline", min_s=0)]
    r = _runner(tmp_path, items, 4.0)
    r.run()
    assert r.states["wraps"].status == "not run: budget"
    assert "raised as RuntimeError" in r.states["wraps"].detail


def test_a_missing_optional_package_is_absent_not_failed(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm -> ModuleNotFoundError, installed or not

    def uses_timm(ctx):
        import timm  # noqa: F401

    items = [
        runner.Item("declared", 1, uses_timm, "declares timm", min_s=0, requires=("timm",)),
        runner.Item("undeclared", 1, uses_timm, "imports timm inside", min_s=0),
        runner.Item("broken", 1, lambda ctx: 1 / 0, "fails", min_s=0),
    ]
    r = _runner(tmp_path, items, 30.0)
    r.run()
    assert r.states["declared"].status == "not run: absent (timm)"
    assert r.states["undeclared"].status == "not run: absent (timm)"
    assert r.states["broken"].status == "failed: ZeroDivisionError: division by zero"


def test_a_spent_budget_marks_every_item_not_run(tmp_path):
    r = _runner(tmp_path, plans.default_plan(), 1.0, start=time.monotonic() - 2)  # 2 s spent of 1
    r.run()
    assert {s.status.split(" (")[0] for s in r.states.values()} == {"not run: budget"}
    summary = (tmp_path / "summary.md").read_text()
    assert "| tensorwise compiled >= 1.5x bf16 | linear_target | - | >= 1.5x | not run: budget" in summary
    assert "--items smoke,fused_optimizer_step,fp8_activation_casts,llama_compile,llama_step," in summary  # what next


def test_plan_deadlines_scale_to_the_budget_and_stop_before_its_end():
    items = [runner.Item(n, s, lambda c: None, "") for n, s in (("a", 100), ("b", 200), ("c", 100))]
    end = 450 - runner.END_RESERVE_S
    assert runner.plan_deadlines(items, 450) == pytest.approx([end / 4, 3 * end / 4, end])
    assert runner.plan_deadlines(items, 20)[-1] == pytest.approx(20 - runner.END_RESERVE_S)


def test_junit_rows(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_x" name="test_a[cuda-tensorwise]" file="tests/test_x.py" time="0.5"/>'
        '<testcase classname="tests.test_x" name="test_b[cpu]" time="0.1"><failure message="assert 1 == 2">x</failure>'
        '</testcase><testcase classname="tests.test_x" name="test_c"><skipped message="needs CUDA"/></testcase>'
        "</testsuite></testsuites>"
    )
    rows = report.junit_rows(xml, "pytest_gpu_core")
    assert [(r["metric"], r["status"]) for r in rows] == [
        ("tests/test_x.py::test_a[cuda-tensorwise]", "passed"),
        ("tests/test_x.py::test_b[cpu]", "failed"),
        ("tests/test_x.py::test_c", "skipped"),
    ]
    assert rows[1]["detail"] == "assert 1 == 2"


def test_a_kernel_gate_is_not_run_and_anything_else_failed():
    gate = NotImplementedError("the MXFP8 1x32 x 1x32 kernel needs Builds(min_sm=(10, 0)); this is sm90")
    assert runner.failure_status(gate) == (
        "not run: no kernel on this device: the MXFP8 1x32 x 1x32 kernel needs Builds(min_sm=(10, 0)); this is sm90"
    )
    assert runner.failure_status(NotImplementedError("aten::foo is not supported")).startswith("failed: ")
    assert runner.failure_status(RuntimeError("the kernel needs more")).startswith("failed: RuntimeError")


def test_the_second_rest_deselects_tests_the_first_command_ran(tmp_path):
    from campaign import gpu_tests

    rows = [
        report.row("pytest_gpu_rest", "pytest", metric="tests/a.py::test_x[cuda]", status="passed"),
        report.row("pytest_gpu_rest", "pytest", metric="tests/a.py::test_y", status="failed"),
        report.row("linear_target", "figure", metric="step_ms", value=1.0),
    ]
    path = tmp_path / "results.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=report.FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    assert gpu_tests.already_run(str(path)) == ["tests/a.py::test_x[cuda]", "tests/a.py::test_y"]
    assert gpu_tests.already_run(None) == [] and gpu_tests.already_run(str(tmp_path / "absent.csv")) == []


def test_smoke_holds_stochastic_recipes_to_the_cpus_accuracy(dry_default):
    from campaign import smoke

    from f8tensor import RECIPES

    rows = [r for r in report.read_csv(dry_default[1] / "results.csv") if r["item"] == "smoke"]
    by_recipe = {r["recipe"]: r for r in rows}
    stochastic = {r for r in RECIPES if smoke.stochastic(r)}
    assert stochastic == {"nvfp4", "mxfp4"}
    for recipe, r in by_recipe.items():
        gap = recipe in stochastic
        assert r["metric"] == (
            "worst SQNR vs fp32, device minus CPU dB" if gap else "worst SQNR of out/grad_in/grad_w vs CPU dB"
        ), r
        # Two CPU models: the same bits (inf dB), or with stochastic rounding within 3 dB.
        assert float(r["value"]) >= (-smoke.STOCHASTIC_MARGIN_DB if gap else smoke.DEVICE_VS_CPU_DB), r


def test_activation_casts_check_measures_bytes_kernels_and_time(dry_default):
    rows = [r for r in report.read_csv(dry_default[1] / "results.csv") if r["item"] == "fp8_activation_casts"]
    by = {(r["recipe"], r["metric"]): r for r in rows}
    for recipe in ("bf16", "tensorwise"):
        # The dry run's quick block keeps about 0.61-0.63x of its bytes under the context.
        assert float(by[recipe, "saved bytes, context vs none"]["value"]) < 0.8
        kernels = by[recipe, "kernels added per packed tensor"]
        assert kernels["status"] == "info" and float(kernels["value"]) > 0  # CPU: counted, not judged
        assert float(by[recipe, "step ms, context vs none"]["value"]) > 0
