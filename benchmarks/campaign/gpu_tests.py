"""Item 6 (and the second plan's rest): ``pytest -m gpu``, most important first, one item
per group of test files, each with its own timeout. One CSV row per test (the junit XML is
read into ``results.csv`` and not kept, so no file is added per group).

On the CPU (dry run) the same command runs :data:`DRY_STUB`, a stand-in with one test that
passes and one that skips, after checking that the group's files exist."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from . import report
from .runner import Ctx, ItemDeadline

REPO = Path(__file__).resolve().parents[2]
DRY_STUB = Path(__file__).resolve().with_name("dry_pytest_stub.py")
#: (item name, files, planned seconds on the GPU machine), most important first.
GROUPS = (("pytest_gpu_core", ("tests/gemm/test_gpu_scaled_mm.py",), 40),)


def run_pytest(ctx: Ctx, paths: list[str], timeout_s: float, extra: tuple[str, ...] = ()) -> None:
    with tempfile.TemporaryDirectory(prefix="f8tensor_campaign_") as tmp:
        _run_pytest(ctx, paths, timeout_s, extra, Path(tmp) / "junit.xml")


def _run_pytest(ctx: Ctx, paths: list[str], timeout_s: float, extra: tuple[str, ...], junit: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-q",
        "-rfE",
        "-p",
        "no:cacheprovider",
        "--continue-on-collection-errors",
        f"--junitxml={junit}",
        "-o",
        "junit_family=xunit1",
        *extra,
        *paths,
    ]
    rc, output = ctx.runner.run_child(ctx, cmd, timeout_s)
    if junit.exists():
        ctx.rows.extend(report.junit_rows(junit, ctx.item.name))
    last = [ln for ln in output.strip().splitlines() if ln.strip()][-1:] or ["(no output)"]
    ctx.note(f"pytest exit status {rc if rc is not None else 'none (stopped at its timeout)'}: {last[0].strip()}")
    if rc is None:
        raise ItemDeadline()
    if not junit.exists():
        raise RuntimeError(f"pytest wrote no junit XML (exit status {rc}); its output is in the log")


def group_fn(paths: tuple[str, ...]):
    """A group's item. Its pytest runs until the item's deadline (time earlier items left
    passes on), not for the group's planned seconds alone."""

    def run(ctx: Ctx) -> None:
        run_pytest(ctx, dry_paths(ctx, paths), ctx.left())

    return run


def rest(ctx: Ctx) -> None:
    """Every other ``gpu`` test: ``tests/`` without the files the default plan's groups ran,
    and without the tests ``--figures-csv`` already has an outcome for (the default plan ends
    with this item, on whatever time its other items left; the second plan goes on from there)."""
    ignore = () if ctx.dry else tuple(f"--ignore={p}" for _, paths, _ in GROUPS for p in paths)
    done = tuple(f"--deselect={node}" for node in already_run(ctx.args.figures_csv))
    if done:
        ctx.note(f"{len(done)} test(s) with an outcome in --figures-csv deselected")
    run_pytest(ctx, dry_paths(ctx, ("tests",)), ctx.left(), extra=ignore + (() if ctx.dry else done))


def already_run(paths: str | None) -> list[str]:
    """The pytest node ids with an outcome in the CSVs named (comma-separated; absent: none)."""
    files = [Path(p) for p in (paths or "").split(",") if p and Path(p).exists()]
    return sorted(
        {
            r["metric"]
            for p in files
            for r in report.read_csv(p)
            if r["kind"] == "pytest" and r["status"] in ("passed", "failed", "error", "skipped")
        }
    )


def dry_paths(ctx: Ctx, paths: tuple[str, ...]) -> list[str]:
    """The paths to test; in a dry run :data:`DRY_STUB` instead (on a CPU every ``gpu`` test
    skips, and collecting the real files costs a minute), once the real ones are found."""
    if not ctx.dry:
        return list(paths)
    missing = [p for p in paths if not (REPO / p).exists()]
    if missing:
        raise FileNotFoundError(f"{ctx.item.name}: no such test path {', '.join(missing)}")
    return [str(DRY_STUB.relative_to(REPO))]
