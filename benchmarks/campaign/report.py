"""What a run writes: one CSV of every row (``FIELDS``) and a Markdown summary.

Row kinds: ``env`` (one per environment line), ``check`` (a correctness check: value,
threshold in ``target``, status passed/failed), ``figure`` (a measurement; ``ratio_vs_bf16``
is the speed-up over bf16 in the same mode and run for times and throughputs, value / bf16
value for bytes and losses), ``pytest`` (one per test: ``metric`` is its id, ``value`` its
seconds, ``status`` its outcome) and ``kernel`` (a profile row: ``value`` ms per step).
"""

from __future__ import annotations

import csv
import math
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from . import targets

FIELDS = (
    "item",
    "kind",
    "recipe",
    "mode",
    "shape",
    "metric",
    "value",
    "unit",
    "ratio_vs_bf16",
    "target",
    "status",
    "detail",
)


def row(
    item: str,
    kind: str = "figure",
    recipe: str = "",
    mode: str = "",
    shape: str = "",
    metric: str = "",
    value: Any = math.nan,
    unit: str = "",
    ratio: float = math.nan,
    target: str = "",
    status: str = "ok",
    detail: str = "",
) -> dict:
    return {
        "item": item,
        "kind": kind,
        "recipe": recipe,
        "mode": mode,
        "shape": shape,
        "metric": metric,
        "value": value,
        "unit": unit,
        "ratio_vs_bf16": ratio,
        "target": target,
        "status": status,
        "detail": detail,
    }


def env_rows(env: list[tuple[str, str]]) -> list[dict]:
    return [row("environment", "env", metric=k, value="", detail=v) for k, v in env]


def cell(v: Any) -> Any:
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.6g}"
    return v


def num(v: Any, digits: int) -> str:
    v = f(v)
    return "-" if math.isnan(v) else f"{v:.{digits}f}"


def f(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def md(text: Any) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def write_csv(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: cell(r.get(k, "")) for k in FIELDS})
    tmp.replace(path)


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def junit_rows(path: Path, item: str) -> list[dict]:
    """One ``pytest`` row per test case of a junit XML: ``path::name[params]``, outcome, seconds, message."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        file = case.get("file") or (classname.replace(".", "/") + ".py")
        outcome, detail = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                detail = " ".join((child.get("message") or child.text or "").split())[:600]
                break
        rows.append(
            row(
                item,
                "pytest",
                metric=f"{file}::{name}",
                value=f(case.get("time")),
                unit="s",
                status=outcome,
                detail=detail,
            )
        )
    return rows


def summary(runner, digest: bool = False) -> str:
    """The run's Markdown summary; ``digest``: without the environment and the long tables."""
    lines = [f"# f8tensor GPU campaign: {runner.plan} plan{' (dry run on the CPU)' if runner.dry else ''}", ""]
    if not digest:
        lines += ["## Environment", ""] + [f"- {k}: {v}" for k, v in runner.env] + [""]
    rows = runner.rows
    judged = [(t, r, status) for t, r, status in targets.evaluate(rows, runner.states) if t.item in runner.states]
    if judged:
        lines += [
            "## Targets (ratios within this run)",
            "",
            "| target | item | value | target | status |",
            "| --- | --- | ---: | --- | --- |",
        ]
    for t, r, status in judged:
        value = num(r["value"] if t.metric == "speedup_vs_torchao" else r["ratio_vs_bf16"], 3) if r else "-"
        lines.append(f"| {t.text} | {t.item} | {value} | {t.target_text()} | {md(status)} |")
    lines += [""] if judged else []
    checks = [r for r in rows if r["kind"] == "check" and not (digest and r["status"] == "passed")]
    if checks or not digest:
        lines += ["## Checks" + (" (failed only)" if digest else ""), ""]
        lines += ["| item | check | status | value | threshold | detail |", "| --- | --- | --- | ---: | --- | --- |"]
        lines += [
            f"| {r['item']} | {md(r['metric'])} | {r['status']} | {num(r['value'], 2)} | {md(r['target'])} | "
            f"{md(str(r['detail'])[:300])} |"
            for r in checks
        ]
        lines.append("")
    tests = [r for r in rows if r["kind"] == "pytest"]
    if tests:
        counts: dict[str, int] = {}
        for r in tests:
            counts[r["status"]] = counts.get(r["status"], 0) + 1
        lines += ["## pytest", "", ", ".join(f"{v} {k}" for k, v in sorted(counts.items())), ""]
        bad = [r for r in tests if r["status"] in ("failed", "error")]
        lines += [f"- `{r['metric']}`: {md(str(r['detail'])[:400])}" for r in bad[:60]] + ([""] if bad else [])
    if not digest:
        figs = [r for r in rows if r["kind"] in ("figure", "kernel")]
        lines += [
            "## Figures",
            "",
            "| item | recipe | mode | shape | metric | value | unit | vs bf16 | status |",
            "| --- | --- | --- | --- | --- | ---: | --- | ---: | --- |",
        ]
        lines += [
            f"| {r['item']} | {md(r['recipe'])} | {r['mode']} | {r['shape']} | {md(r['metric'])} | "
            f"{num(r['value'], 4)} | {r['unit']} | {num(r['ratio_vs_bf16'], 3)} | {md(r['status'])} |"
            for r in figs
        ]
        lines.append("")
    lines += [
        "## Items and budget",
        "",
        f"Budget {runner.budget:.0f} s from process start; deadlines in seconds after it.",
        "",
        "| item | deadline s | started s | took s | status | detail |",
        "| --- | ---: | ---: | ---: | --- | --- |",
    ]
    for name, st in runner.states.items():
        lines.append(
            f"| {name} | {num(st.deadline_s, 0)} | {num(st.started_s, 0)} | {num(st.took_s, 1)} | "
            f"{md(st.status)} | {md(st.detail[:300])} |"
        )
    not_run = [n for n, st in runner.states.items() if st.status.startswith("not run: budget")]
    if not_run:
        lines += [
            "",
            "Not run for lack of time; to run them next (a fresh command):",
            "",
            f"    ... --items {','.join(not_run)}",
        ]
    lines.append("")
    return "\n".join(lines)
