"""The GPU campaign: f8tensor's correctness, figures and profiles on one GPU, one stage per command.

A GPU is lent rarely and briefly (about three 10-minute commands, no network, at most 8
files back per command), so the whole run is this one script, rehearsed on a CPU first:

    PYTHONPATH=. python3 benchmarks/gpu_campaign.py --stage correctness --out $OUT
    PYTHONPATH=. python3 benchmarks/gpu_campaign.py --stage figures --out $OUT --torchao-wheel-dir /tmp/site
    PYTHONPATH=. python3 benchmarks/gpu_campaign.py --stage profile --out $OUT \\
        --figures-csv benchmarks/gpu_results/figures.csv
    python benchmarks/gpu_campaign.py --stage all --dry-run --out /tmp/campaign   # CPU rehearsal

Stages (``--list`` prints each one's items with their planned seconds and deadlines):

- ``correctness``: FP8 training checks on the GPU (tensorwise and rowwise recipes with fp32
  master weights under bf16 autocast, eager and compiled, SQNR against the bf16 model;
  the MoE grouped path and the kernel it reaches; the block-scaled path, kernel or clear
  refusal; ``pytest -m gpu``, which includes the ``cuda`` twins of the CPU tests marked
  ``device_param``; the demo's GPU path). Writes ``correctness.log``, ``correctness.csv``
  (one row per test or check: outcome, value, threshold), ``correctness_junit.xml`` and
  ``summary.md``.
- ``figures``: the benchmark scripts (their ``main(argv)``, in this process) and a few
  timings of their own (block-scaled linear, grouped GEMM, timm ViT-Huge), ordered by what
  they are worth, each with a deadline. Writes ``figures.log``, ``figures.csv`` (columns
  ``FIGURE_FIELDS``) and ``summary.md`` with the issue's targets evaluated as ratios within
  the run: met, missed or not run.
- ``profile``: for every figure of a ``figures.csv`` below its target, that configuration
  and its baseline under ``torch.profiler``: the kernels with the most device time
  (``profile_kernels.csv``, and as tables in ``summary.md``), one Chrome trace
  (``profile_trace.json.gz``, of the first configuration) and ``profile.log``.
- ``all``: the three in order, each into its own subfolder of ``--out``.

Each stage prints its environment first (GPU, driver, CUDA, capability, power limit and
clocks, torch and its build, triton, Python, f8tensor version and commit, torchao), gives
every item a deadline (cumulative planned seconds, scaled to ``--budget-s``; an item
stops at its deadline and those with too little time left are marked ``not run:
budget``), records each item's exception (type, message, last traceback lines) and goes
on, and rewrites its CSV and summary after every item, so a command stopped at its time
limit still returns files. A watchdog ends the process ``HARD_STOP_GRACE_S`` after the
budget if an item hangs where no deadline can interrupt it. Nothing needs the network.

``--dry-run`` runs the same items through the same code on the CPU at tiny sizes (shapes,
steps, model sizes; the device), so the campaign meets no bug of its own on the GPU.
By default the dry run compiles nothing (``torch.compile`` runs eagerly, which keeps the
rehearsal to seconds); ``--dry-compile aot_eager`` or ``inductor`` traces for real.

Ratios (``ratio_vs_bf16``): for times and throughputs the speed-up over bf16 in the same
mode and run (above 1: faster); for bytes and losses, value / bf16 value.

Exit status: 0 when the stage ran (its items' failures are in its files), 2 on bad
arguments, 3 when the watchdog stopped it.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import gc
import gzip
import importlib
import inspect
import io
import itertools
import math
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

T0 = time.monotonic()  # the first stage's budget counts from here (imports included)
REPO = Path(__file__).resolve().parents[1]
BENCH_DIR = Path(__file__).resolve().parent
for _p in (str(REPO), str(BENCH_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

STAGES = ("correctness", "figures", "profile")
#: One stage in one 10-minute command: the process starts, pip installs the carried wheels,
#: and the stage, watchdog included, must end well inside the limit.
DEFAULT_BUDGET_S = 540.0
HARD_STOP_GRACE_S = 15.0
#: Seconds a subprocess item gets after SIGINT (pytest then writes its junit XML) before SIGKILL.
SIGINT_GRACE_S = 20.0
FIGURE_FIELDS = ("stage", "item", "recipe", "mode", "shape", "metric", "value", "unit", "ratio_vs_bf16", "target",
                 "status")
CORRECTNESS_FIELDS = ("stage", "kind", "name", "device", "outcome", "seconds", "value", "threshold", "detail")
PROFILE_FIELDS = ("stage", "job", "config", "rank", "kernel", "calls", "device_ms_per_step", "share", "status")
NAME_OK = re.compile(r"^[A-Za-z0-9._-]+$")

#: The target shape of the issue (M tokens, K in, N out: LLaMA-3-8B's gate/up at 16384 tokens).
TARGET_SHAPE = (16384, 4096, 14336)
DRY_LINEAR_SHAPE = (64, 64, 128)


# ===================================================================== targets


@dataclasses.dataclass(frozen=True)
class Target:
    """One target of the issue, read off one figure row (``item``, ``recipe``, ``mode``, ``metric``)."""

    key: str
    text: str
    item: str
    recipe: str
    mode: str
    metric: str
    check: str  # "ge" (ratio >= threshold), "gt" (ratio > threshold), "within" (|ratio - 1| <= threshold)
    threshold: float

    def target_text(self) -> str:
        return {"ge": f">= {self.threshold:g}x", "gt": f"> {self.threshold:g}x",
                "within": f"within {100 * self.threshold:g}% of bf16"}[self.check]

    def met(self, ratio: float) -> bool:
        if not math.isfinite(ratio):
            return False
        if self.check == "ge":
            return ratio >= self.threshold
        if self.check == "gt":
            return ratio > self.threshold
        return abs(ratio - 1.0) <= self.threshold


TARGETS = (
    Target("tw_compiled", "tensorwise compiled >= 1.5x bf16", "linear_target_tensorwise", "tensorwise", "compiled",
           "step_ms", "ge", 1.5),
    Target("tw_vs_torchao", "tensorwise compiled ahead of torchao tensorwise", "linear_target_tensorwise", "tensorwise",
           "compiled", "speedup_vs_torchao", "gt", 1.0),
    Target("tw_eager", "tensorwise eager > 1.0x bf16", "linear_target_tensorwise", "tensorwise", "eager",
           "step_ms", "gt", 1.0),
    Target("rw_compiled", "rowwise compiled >= 1.3x bf16", "linear_target_rowwise", "rowwise", "compiled",
           "step_ms", "ge", 1.3),
    Target("rw_vs_torchao", "rowwise compiled ahead of torchao rowwise", "linear_target_rowwise", "rowwise",
           "compiled", "speedup_vs_torchao", "gt", 1.0),
    Target("blockwise", "blockwise (1x128 x 128x128) compiled >= 1.3x bf16 on sm90", "linear_target_blockwise",
           "blockwise", "compiled", "step_ms", "ge", 1.3),
    Target("e2e", "end to end (300m) compiled tensorwise >= 1.25x bf16 tokens/s", "e2e_300m_tensorwise",
           "tensorwise", "compiled", "tokens_per_s", "ge", 1.25),
    Target("e2e_loss", "end to end final loss within 1% of bf16", "e2e_300m_tensorwise", "tensorwise", "compiled",
           "final_loss", "within", 0.01),
    Target("moe_tw", "MoE grouped GEMM fwd+bwd tensorwise >= 1.3x bf16 grouped", "moe_grouped_gemm", "tensorwise",
           "compiled", "step_ms", "ge", 1.3),
    Target("moe_rw", "MoE grouped GEMM fwd+bwd rowwise >= 1.3x bf16 grouped", "moe_grouped_gemm", "rowwise",
           "compiled", "step_ms", "ge", 1.3),
)


# ===================================================================== items, budget


class ItemDeadline(BaseException):
    """Raised in the main thread when an item reaches its deadline (a BaseException, so that
    ``except Exception`` in the code under test does not swallow it)."""


@dataclasses.dataclass
class Item:
    name: str
    plan_s: float  # planned seconds on an H100/H200
    fn: Callable[[Ctx], None]
    what: str
    min_s: float = 10.0  # start only with at least this much time left (scaled like the budget)
    absent: Callable[[], str | None] | None = None  # a reason not to run it (e.g. a script not written yet)


@dataclasses.dataclass
class ItemState:
    status: str = "pending"
    deadline_s: float = math.nan  # seconds after the stage start
    started_s: float = math.nan
    took_s: float = math.nan
    detail: str = ""


def plan_deadlines(items: list[Item], budget_s: float) -> list[float]:
    """Each item's deadline in seconds after the stage start: the cumulative planned seconds,
    scaled by ``budget_s / DEFAULT_BUDGET_S`` and capped at the budget. Time an item leaves
    unused passes to the next; an item past its deadline is stopped there."""
    scale = budget_s / DEFAULT_BUDGET_S
    out, total = [], 0.0
    for item in items:
        total += item.plan_s
        out.append(min(total * scale, budget_s))
    return out


class Tee(io.TextIOBase):
    """Writes to several streams (stdout and the stage log)."""

    def __init__(self, *streams) -> None:
        self.streams = [s for s in streams if s is not None]

    def write(self, s: str) -> int:
        for st in self.streams:
            try:
                st.write(s)
            except (ValueError, OSError):
                pass
        return len(s)

    def flush(self) -> None:
        for st in self.streams:
            with contextlib.suppress(ValueError, OSError):
                st.flush()

    def isatty(self) -> bool:
        return False


class Ctx:
    """What an item sees: sizes (dry or not), the device, its deadline, and where to record."""

    def __init__(self, stage: Stage, item: Item, deadline: float) -> None:
        self.stage, self.item, self.deadline = stage, item, deadline
        self.dry, self.device, self.args = stage.dry, stage.device, stage.args
        self.rows: list[dict] = []
        self.notes: list[str] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def pick(self, gpu, dry):
        return dry if self.dry else gpu

    def say(self, text: str) -> None:
        self.stage.say(text)

    def note(self, text: str) -> None:
        self.notes.append(text)
        self.say(f"  note: {text}")


def error_text(exc: BaseException, lines: int = 4) -> tuple[str, str]:
    """``("Type: message", "last traceback lines")`` of an exception."""
    msg = " ".join(str(exc).split())
    if len(msg) > 400:
        msg = msg[:400] + " ..."
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    tail = " | ".join(" ".join(t.split()) for t in "".join(tb).strip().splitlines()[-2 * lines:-1])
    return f"{type(exc).__name__}: {msg}", tail[-1200:]


# ===================================================================== environment


def _run_cmd(cmd: list[str], cwd: Path | None = None, timeout: float = 10) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=cwd, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def f8tensor_commit() -> str:
    """``git rev-parse`` of this checkout (+dirty when the package, benchmarks or tests differ);
    else ``$F8TENSOR_COMMIT`` (a copy of the tree without ``.git``), else ``unknown``."""
    commit = _run_cmd(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO)
    if commit:
        dirty = _run_cmd(["git", "status", "--porcelain", "--untracked-files=no", "--", "f8tensor", "benchmarks", "tests"],
                         cwd=REPO)
        return commit + ("+dirty" if dirty else "")
    env = os.environ.get("F8TENSOR_COMMIT", "").strip()
    return f"{env} (from F8TENSOR_COMMIT; no git checkout here)" if env else "unknown (no git checkout here)"


def setup_torchao(wheel_dir: str | None) -> str | None:
    """Put torchao from ``--torchao-wheel-dir`` on ``sys.path`` (and ``PYTHONPATH`` for child
    processes): a folder holding ``torchao/`` (an unpacked site, e.g. pip's ``--target``) or a
    ``torchao-*.whl`` (unpacked into a temporary folder). Returns why torchao is absent, or None."""
    if wheel_dir is None:
        return None
    d = Path(wheel_dir)
    if not d.is_dir():
        return f"--torchao-wheel-dir {d} is not a directory"
    if (d / "torchao").is_dir():
        site = d
    else:
        wheels = sorted(d.glob("torchao-*.whl"))
        if not wheels:
            return f"no torchao/ package and no torchao-*.whl in --torchao-wheel-dir {d}"
        site = Path(tempfile.gettempdir()) / f"f8tensor_campaign_{wheels[-1].stem}"
        if not (site / "torchao").is_dir():
            with zipfile.ZipFile(wheels[-1]) as z:
                z.extractall(site)
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return None


def torchao_status(absent_reason: str | None) -> tuple[str, str]:
    """``(note, import output)``: torchao's version and where from, or ``absent: reason``."""
    if absent_reason is not None:
        return f"absent: {absent_reason}", ""
    if os.environ.get("F8TENSOR_BENCH_NO_TORCHAO", "") not in ("", "0"):
        return "absent: F8TENSOR_BENCH_NO_TORCHAO is set", ""
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            torchao = importlib.import_module("torchao")
            importlib.import_module("torchao.float8")
    except Exception as e:  # noqa: BLE001  (any import failure means: no torchao rows)
        why, _ = error_text(e)
        return f"absent: import failed ({why})", buf.getvalue()
    return f"{torchao.__version__} ({Path(torchao.__file__).parent.parent})", buf.getvalue()


def environment(device, torchao_note: str) -> list[tuple[str, str]]:
    import torch

    import f8tensor

    env: list[tuple[str, str]] = []
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        cap = torch.cuda.get_device_capability(device)
        env.append(("gpu", f"{props.name}, {props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} SMs"))
        env.append(("capability", f"sm_{cap[0]}{cap[1]}"))
        fields = ["driver_version", "power.limit", "power.max_limit", "clocks.sm", "clocks.max.sm", "clocks.mem",
                  "clocks.max.mem", "temperature.gpu", "pstate"]
        smi = _run_cmd(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader",
                        f"--id={device.index or torch.cuda.current_device()}"])
        if smi:
            for key, value in zip(fields, (v.strip() for v in smi.split(","))):
                env.append((f"nvidia-smi {key}", value))
        else:
            env.append(("nvidia-smi", "did not answer"))
    else:
        env.append(("gpu", "none: CPU run" + (" (dry run)" if device.type == "cpu" else "")))
    env.append(("cuda (torch build)", torch.version.cuda or "none (CPU build)"))
    env.append(("torch", f"{torch.__version__} (git {torch.version.git_version[:12]}, debug={torch.version.debug})"))
    try:
        import triton

        env.append(("triton", triton.__version__))
    except Exception as e:  # noqa: BLE001
        env.append(("triton", f"absent: {error_text(e)[0]}"))
    env.append(("python", f"{platform.python_version()} ({sys.executable})"))
    env.append(("platform", f"{platform.platform()}, {os.cpu_count()} CPUs"))
    env.append(("f8tensor", f"{f8tensor.__version__} at {Path(f8tensor.__file__).parent}"))
    env.append(("f8tensor commit", f8tensor_commit()))
    env.append(("torchao", torchao_note))
    env.append(("command", "python " + " ".join(shlex.quote(a) for a in sys.argv)))
    return env


# ===================================================================== a stage


class Stage:
    """Runs one stage's items in order, each against its deadline, and keeps its files current."""

    name = ""
    csv_name = ""
    fields: tuple[str, ...] = ()

    def __init__(self, out: Path, args: argparse.Namespace, start: float, device, torchao_note: str) -> None:
        self.out, self.args, self.start = out, args, start
        self.dry = args.dry_run
        self.device = device
        self.torchao_note = torchao_note
        self.budget = args.budget_s
        self.rows: list[dict] = []
        self.states: dict[str, ItemState] = {}
        self.env: list[tuple[str, str]] = []
        self.lock = threading.RLock()
        self.armed = False
        self.child: subprocess.Popen | None = None
        self.finished = False
        self.torchao_output = ""
        self.current: Ctx | None = None
        self.exit_on_hard_stop = True  # the watchdog ends the process (tests running a stage in-process: False)
        out.mkdir(parents=True, exist_ok=True)
        self.log = open(out / f"{self.name}.log", "w", buffering=1)  # noqa: SIM115 (open for the stage's life)
        self.console = sys.stdout

    # ----------------------------------------------------------------- output

    def say(self, text: str = "") -> None:
        with self.lock:
            for stream in (self.console, self.log):
                with contextlib.suppress(ValueError, OSError):
                    stream.write(text + "\n")
                    stream.flush()

    @contextlib.contextmanager
    def capture(self):
        """Benchmark output: stdout to the console and the log, stderr (progress bars) to the log."""
        with contextlib.redirect_stdout(Tee(self.console, self.log)), contextlib.redirect_stderr(Tee(self.log)):
            yield

    def write_files(self) -> None:
        with self.lock:
            self._write_csv()
            (self.out / "summary.md").write_text(self.summary())

    def _write_csv(self) -> None:
        tmp = self.out / (self.csv_name + ".tmp")
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.fields, extrasaction="ignore")
            w.writeheader()
            for row in self.rows:
                w.writerow({k: _cell(row.get(k, "")) for k in self.fields})
        tmp.replace(self.out / self.csv_name)

    # ----------------------------------------------------------------- items

    def items(self) -> list[Item]:
        raise NotImplementedError

    def selected(self) -> list[Item]:
        """The stage's items in plan order; with ``--items``, only those named (in ``all``, each
        stage runs the named items that are its own)."""
        items = self.items()
        if self.args.items:
            wanted = [n.strip() for n in self.args.items.split(",") if n.strip()]
            known = {i.name for i in items}
            unknown = [n for n in wanted if n not in known]
            if unknown and self.name == self.args.stage:
                raise SystemExit(f"--items: unknown item(s) {', '.join(unknown)} for stage {self.name}; "
                                 f"known: {', '.join(sorted(known))}")
            items = [i for i in items if i.name in wanted]
        return items

    def run(self) -> None:
        import torch

        self.env = environment(self.device, self.torchao_note)
        self.say(f"## Environment ({self.name} stage{', dry run on the CPU' if self.dry else ''})")
        self.say()
        for key, value in self.env:
            self.say(f"- {key}: {value}")
        self.say()
        if self.torchao_output.strip():
            self.say("torchao's import said: " + " / ".join(self.torchao_output.strip().splitlines()[:6]))
        items = self.selected()
        deadlines = plan_deadlines(items, self.budget)
        for item, dl in zip(items, deadlines):
            self.states[item.name] = ItemState(deadline_s=dl)
        self.say(f"budget {self.budget:.0f} s from {'process start' if self.start == T0 else 'stage start'}, "
                 f"{time.monotonic() - self.start:.1f} s spent; {len(items)} items")
        self.write_files()
        watchdog = threading.Timer(max(0.0, self.start + self.budget + HARD_STOP_GRACE_S - time.monotonic()),
                                   self._hard_stop)
        watchdog.daemon = True
        watchdog.start()
        previous = signal.signal(signal.SIGALRM, self._on_alarm)
        outer_timer, outer_t0 = signal.getitimer(signal.ITIMER_REAL), time.monotonic()  # e.g. pytest-timeout's
        try:
            for item, dl in zip(items, deadlines):
                self._run_item(item, self.start + dl)
                self._cleanup(torch)
                self.write_files()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            if outer_timer[0] > 0:
                signal.setitimer(signal.ITIMER_REAL, max(0.01, outer_timer[0] - (time.monotonic() - outer_t0)),
                                 outer_timer[1])
            watchdog.cancel()
        self.finished = True
        self.say()
        self.say(self.summary(digest=True))  # the end of the output: what a truncated console shows
        self.write_files()
        self.log.close()

    def _on_alarm(self, signum, frame) -> None:
        if self.armed:
            self.armed = False
            raise ItemDeadline()

    def _run_item(self, item: Item, deadline: float) -> None:
        st = self.states[item.name]
        reason = item.absent() if item.absent is not None else None
        if reason is not None:
            st.status = f"not run: absent ({reason})"
            self.say(f"### {item.name}: {st.status}")
            return
        left = deadline - time.monotonic()
        min_s = item.min_s * self.budget / DEFAULT_BUDGET_S
        if left < min_s:
            st.status = "not run: budget"
            st.detail = f"{max(left, 0):.0f} s left at its turn, {min_s:.0f} s needed"
            self.say(f"### {item.name}: not run: budget ({st.detail})")
            return
        ctx = Ctx(self, item, deadline)
        self.current = ctx
        st.started_s = time.monotonic() - self.start
        st.status = "running"
        self.say(f"### {item.name}: {item.what}")
        self.say(f"(started at +{st.started_s:.0f} s, deadline +{st.deadline_s:.0f} s, {left:.0f} s left)")
        t0 = time.monotonic()
        try:
            self.armed = True
            signal.setitimer(signal.ITIMER_REAL, max(0.01, left))
            item.fn(ctx)
            self.armed = False
            st.status = "ok"
        except ItemDeadline:
            self.armed = False
            st.status = "not run: budget"
            st.detail = f"stopped at its deadline after {time.monotonic() - t0:.0f} s; rows recorded before it are kept"
        except BaseException as e:
            self.armed = False
            if isinstance(e, KeyboardInterrupt):
                raise
            st.status, tail = ("failed: " + error_text(e)[0]), error_text(e)[1]
            st.detail = tail
            self.say(f"  FAILED: {st.status}\n  traceback: {tail}")
        finally:
            self.armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            self._kill_child()
            st.took_s = time.monotonic() - t0
            if ctx.notes:
                st.detail = "; ".join(x for x in [st.detail, *ctx.notes] if x)
            with self.lock:
                self.current = None
                self.finish_rows(item, ctx, st)
                self.rows.extend(ctx.rows)
        self.say(f"=> {item.name}: {st.status} ({st.took_s:.1f} s)")

    def finish_rows(self, item: Item, ctx: Ctx, st: ItemState) -> None:
        """Hook: evaluate targets etc. on an item's rows before they join the stage's."""

    def _cleanup(self, torch) -> None:
        gc.collect()
        with contextlib.suppress(Exception):
            torch._dynamo.reset()
        if self.device.type == "cuda":
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
                torch.cuda.empty_cache()

    def _kill_child(self) -> None:
        proc, self.child = self.child, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                proc.wait(5)

    def _hard_stop(self) -> None:
        """The watchdog: the stage outlived its budget in code no deadline could interrupt."""
        got = self.lock.acquire(timeout=5)
        try:
            for st in self.states.values():
                if st.status in ("pending", "running"):
                    st.status = "not run: budget (watchdog stop)"
            if self.current is not None:  # what the hung item recorded before it hung
                self.rows.extend(self.current.rows)
                self.current = None
            self._kill_child()
            with contextlib.suppress(Exception):
                self._write_csv()
                (self.out / "summary.md").write_text(self.summary())
            with contextlib.suppress(Exception):
                self.console.write(f"\nwatchdog: {self.name} outlived its budget by {HARD_STOP_GRACE_S:.0f} s; "
                                   "files written, exiting\n")
                self.console.flush()
                self.log.flush()
        finally:
            if got:
                self.lock.release()
        if self.exit_on_hard_stop:
            os._exit(3)

    # ----------------------------------------------------------------- subprocesses

    def run_child(self, ctx: Ctx, cmd: list[str], env: dict | None = None) -> tuple[int | None, str]:
        """Run ``cmd`` in the repository root, its output into the log (and console), until
        the item's deadline: then SIGINT (pytest writes its report), then SIGKILL. Returns
        ``(returncode or None when stopped, output)``."""
        self.say("$ " + " ".join(shlex.quote(c) for c in cmd))
        full_env = {**os.environ, **(env or {})}
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), full_env.get("PYTHONPATH", "")) if p)
        full_env["PYTHONUNBUFFERED"] = "1"
        proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", start_new_session=True)
        self.child = proc
        chunks: list[str] = []

        def pump() -> None:
            for line in proc.stdout:
                chunks.append(line)
                with self.lock:
                    for stream in (self.console, self.log):
                        with contextlib.suppress(ValueError, OSError):
                            stream.write("  | " + line)
                            stream.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        stopped = False
        try:
            proc.wait(timeout=max(1.0, ctx.left() - SIGINT_GRACE_S - 2))
        except subprocess.TimeoutExpired:
            stopped = True
            self.say(f"  (deadline: SIGINT to {cmd[2] if len(cmd) > 2 else cmd[0]})")
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=SIGINT_GRACE_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        reader.join(5)
        self.child = None
        return (None if stopped else proc.returncode), "".join(chunks)

    # ----------------------------------------------------------------- summary

    def summary(self, digest: bool = False) -> str:
        """The stage's Markdown summary; ``digest``: without the environment and long tables."""
        lines = [f"# f8tensor GPU campaign: {self.name}{' (dry run on the CPU)' if self.dry else ''}", ""]
        if not digest:
            lines += ["## Environment", ""] + [f"- {k}: {v}" for k, v in self.env] + [""]
        lines += self.summary_body(digest)
        lines += ["## Items and budget", "",
                  f"Budget {self.budget:.0f} s; deadlines are seconds after the stage start (planned for an H100/H200).",
                  "", "| item | deadline s | started s | took s | status | detail |", "| --- | ---: | ---: | ---: | --- | --- |"]
        for name, st in self.states.items():
            lines.append(f"| {name} | {_num(st.deadline_s, 0)} | {_num(st.started_s, 0)} | {_num(st.took_s, 1)} | "
                         f"{_md(st.status)} | {_md(st.detail[:300])} |")
        not_run = [n for n, st in self.states.items() if st.status.startswith("not run: budget")]
        if not_run:
            lines += ["", "Not run for lack of time; to run them next (same stage, a fresh command):", "",
                      f"    ... --stage {self.name} --items {','.join(not_run)}"]
        lines.append("")
        return "\n".join(lines)

    def summary_body(self, digest: bool = False) -> list[str]:
        return []


def _cell(v: Any) -> Any:
    if isinstance(v, float):
        if math.isnan(v):
            return ""
        return f"{v:.6g}"
    return v


def _num(v: float, digits: int) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def _md(text: str) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def _f(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


# ===================================================================== shared measuring pieces


def ops_seen(fn: Callable[[], Any]) -> set[str]:
    """The ATen ops one call of ``fn`` runs, as the profiler records them (every level:
    what a tensor subclass's handlers call too)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


def scaled_ops(ops: Iterable[str]) -> list[str]:
    return sorted(o for o in ops if "scaled" in o and ("mm" in o or "grouped" in o))


def sqnr_db(ref, out) -> float:
    from f8tensor import sqnr

    return float(sqnr(ref.detach().float(), out.detach().float()))


def timed_configs(ctx: Ctx, steps: dict[tuple, Callable[[], Any]], warmup: int, rounds: int, per_round: int):
    """Warm up every configuration (a failure drops that configuration, recorded), then time
    them in interleaved rounds (``_common.interleaved``). Returns ``({key: Timing}, {key: error})``."""
    import _common as C

    ready, failed = {}, {}
    for key, step in steps.items():
        try:
            for _ in range(warmup + (2 if "compiled" in key else 0)):
                step()
            C.sync(ctx.device)
            ready[key] = step
        except Exception as e:  # noqa: BLE001
            failed[key] = error_text(e)
            ctx.say(f"  {' '.join(map(str, key))}: failed in warm-up: {failed[key][0]}")
    timings = C.interleaved(ready, rounds, per_round, ctx.device) if ready else {}
    return timings, failed


def figure_rows_from_timings(ctx: Ctx, item: str, shape: str, timings, failed, metric="step_ms") -> None:
    """Rows of ``(recipe, mode)``-keyed step times, with the speed-up over bf16 in the same mode."""
    base = {mode: t.median for (recipe, mode), t in timings.items() if recipe == "bf16"}
    for (recipe, mode), t in timings.items():
        ratio = base[mode] / t.median if mode in base else math.nan
        ctx.rows.append(fig(item, recipe, mode, shape, metric, t.median, "ms", ratio))
    for (recipe, mode), (why, _) in failed.items():
        ctx.rows.append(fig(item, recipe, mode, shape, metric, math.nan, "ms", math.nan, status=f"failed: {why}"))


def fig(item, recipe, mode, shape, metric, value, unit, ratio=math.nan, target="", status="ok") -> dict:
    return {"stage": "figures", "item": item, "recipe": recipe, "mode": mode, "shape": shape, "metric": metric,
            "value": value, "unit": unit, "ratio_vs_bf16": ratio, "target": target, "status": status}


def compile_fn(fn, fullgraph: bool = False, dynamic: bool | None = False):
    import torch

    return torch.compile(fn, fullgraph=fullgraph, dynamic=dynamic)


def run_bench_main(ctx: Ctx, script: str, argv: list[str]) -> Path:
    """``benchmarks/<script>.py``'s ``main(argv)`` in this process (output captured into the
    log), its CSV into a temporary file. Returns the CSV path."""
    module = importlib.import_module(script)
    csv_path = Path(tempfile.mkdtemp(prefix="f8tensor_campaign_")) / f"{script}.csv"
    argv = [*argv, "--device", ctx.device.type, "--csv", str(csv_path)]
    ctx.say(f"$ python benchmarks/{script}.py {' '.join(shlex.quote(a) for a in argv)}")
    main = module.main
    with ctx.stage.capture():
        try:
            if inspect.signature(main).parameters:
                main(argv)
            else:
                saved = sys.argv
                sys.argv = [f"{script}.py", *argv]
                try:
                    main()
                finally:
                    sys.argv = saved
        except SystemExit as e:
            if e.code not in (0, None):
                raise RuntimeError(f"{script}.py exited with {e.code!r} (argument error? see the log)") from None
    if not csv_path.exists():
        raise RuntimeError(f"{script}.py wrote no CSV")
    return csv_path


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ===================================================================== correctness


class Correctness(Stage):
    name = "correctness"
    csv_name = "correctness.csv"
    fields = CORRECTNESS_FIELDS

    def items(self) -> list[Item]:
        return [
            Item("recipes_autocast", 70, self.recipes_autocast,
                 "tensorwise and rowwise with fp32 master weights under bf16 autocast, eager and compiled, "
                 "SQNR against the same model in bf16 autocast", min_s=15),
            Item("moe_grouped", 25, self.moe_grouped,
                 "FP8 grouped GEMM (MoE): torch._scaled_grouped_mm on sm90/sm100, against the CPU reference", min_s=5),
            Item("block_scaled", 35, self.block_scaled,
                 "block-scaled 1x128 x 128x128 product (F.scaled_mm on sm90 with CUDA >= 12.9, else a clear "
                 "refusal) and the blockwise recipe's training step", min_s=5),
            Item("pytest_gpu", 280, self.pytest_gpu,
                 "pytest -m gpu: the GPU tests and the cuda twins of the device_param CPU tests", min_s=60),
            Item("demo", 120, self.demo, "the demo's GPU path: python -m f8tensor.demo --device cuda, a few steps",
                 min_s=40),
        ]

    def finish_rows(self, item: Item, ctx: Ctx, st: ItemState) -> None:
        failed = [r for r in ctx.rows if r["outcome"] in ("failed", "error")]
        if failed and st.status == "ok":
            st.status = f"failed: {len(failed)} of {len(ctx.rows)} " + ("tests" if item.name == "pytest_gpu" else "checks")

    def check(self, ctx: Ctx, name: str, ok: bool | None, value=math.nan, threshold="", detail="", kind="check") -> None:
        outcome = "passed" if ok else ("failed" if ok is not None else "info")
        ctx.rows.append({"stage": "correctness", "kind": kind, "name": name, "device": self.device.type,
                         "outcome": outcome, "seconds": math.nan, "value": value, "threshold": threshold,
                         "detail": detail})
        ctx.say(f"  {outcome:7s} {name}" + (f": {value:.2f}" if isinstance(value, float) and math.isfinite(value) else "")
                + (f" (threshold {threshold})" if threshold else "") + (f"; {detail}" if detail else ""))

    # ---- recipes under autocast

    #: SQNR thresholds (dB) of a two-layer MLP (fp32 master weights, bf16 autocast) in FP8
    #: against the same MLP in bf16 autocast, and of compiled against eager FP8. The CPU
    #: tests' contract for one layer is 24 dB (output) / 17 dB (gradients) and 30 dB for
    #: compiled vs eager; two FP8 layers in series add their errors, hence 3 dB less.
    #: (Measured on CPU at the dry-run size: 26 / 22 / 33 dB.)
    MLP_OUT_DB, MLP_GRAD_DB, COMPILED_VS_EAGER_DB = 21.0, 14.0, 27.0

    def recipes_autocast(self, ctx: Ctx) -> None:
        import copy

        import torch
        from torch import nn

        from f8tensor import Float8LinearConfig, convert_to_float8_training

        dim, hidden, batch, seq = ctx.pick((1024, 4096, 4, 512), (64, 128, 2, 16))
        dev = ctx.device
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)).to(dev)  # fp32 master weights
        x = torch.randn(batch, seq, dim, device=dev)

        def step(model, run=None):
            xi = x.clone().requires_grad_()
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                y = (run or model)(xi)
            y.float().pow(2).mean().backward()
            return y, xi.grad, {n: p.grad for n, p in model.named_parameters()}

        y_ref, gx_ref, g_ref = step(copy.deepcopy(base))
        for recipe in ("tensorwise", "rowwise"):
            eager_out = None
            for mode in ("eager", "compiled"):
                name = f"{recipe} {mode}"
                try:
                    model = convert_to_float8_training(copy.deepcopy(base), config=Float8LinearConfig.from_recipe(recipe))
                    y, gx, g = step(model, compile_fn(model, fullgraph=True) if mode == "compiled" else None)
                except Exception as e:  # noqa: BLE001
                    why, tail = error_text(e)
                    self.check(ctx, f"autocast {name}: fwd+bwd", False, detail=f"{why} | {tail}")
                    continue
                dtypes_ok = y.dtype == torch.bfloat16 and all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
                                                             for p in model.parameters())
                self.check(ctx, f"autocast {name}: bf16 output, fp32 weights and grads", dtypes_ok,
                           detail=f"output {y.dtype}")
                self.check(ctx, f"autocast {name}: output SQNR vs bf16 dB", sqnr_db(y_ref, y) >= self.MLP_OUT_DB,
                           sqnr_db(y_ref, y), f">= {self.MLP_OUT_DB}")
                self.check(ctx, f"autocast {name}: grad_input SQNR vs bf16 dB", sqnr_db(gx_ref, gx) >= self.MLP_GRAD_DB,
                           sqnr_db(gx_ref, gx), f">= {self.MLP_GRAD_DB}")
                worst = min(sqnr_db(g_ref[n], g[n]) for n in g_ref)
                self.check(ctx, f"autocast {name}: worst weight/bias grad SQNR vs bf16 dB", worst >= self.MLP_GRAD_DB,
                           worst, f">= {self.MLP_GRAD_DB}")
                if mode == "eager":
                    eager_out = y
                elif eager_out is not None:
                    db = sqnr_db(eager_out, y)
                    self.check(ctx, f"autocast {name}: output SQNR vs eager FP8 dB", db >= self.COMPILED_VS_EAGER_DB,
                               db, f">= {self.COMPILED_VS_EAGER_DB}")

    # ---- MoE grouped

    GROUPED_VS_REF_DB, GROUPED_VS_HP_DB = 40.0, 24.0

    def moe_grouped(self, ctx: Ctx) -> None:
        import torch

        from f8tensor import Float8LinearConfig, float8_grouped_mm

        dev = ctx.device
        sizes = ctx.pick([0, 64, 37, 155, 16, 0, 200, 40], [0, 5, 17, 3])  # empty, ragged and aligned groups
        k, n = ctx.pick((256, 512), (32, 48))
        offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
        m, g = int(offs[-1]), len(sizes)
        torch.manual_seed(0)
        w0 = torch.randn(g, n, k, dtype=torch.bfloat16)
        x0 = torch.randn(m, k, dtype=torch.bfloat16)
        expected_kernel = dev.type == "cuda" and torch.cuda.get_device_capability(dev) in ((9, 0), (10, 0))
        for recipe in ("tensorwise", "rowwise"):
            config = Float8LinearConfig.from_recipe(recipe)

            def run(device, x0=x0, w0=w0, config=config):
                w = w0.to(device).requires_grad_()
                x = x0.to(device).requires_grad_()
                y = float8_grouped_mm(x, w.transpose(-2, -1), offs.to(device), config)
                gx, gw = torch.autograd.grad(y, (x, w), torch.ones_like(y))
                return y, gx, gw

            try:
                ops = ops_seen(lambda: run(dev))
                y, gx, gw = run(dev)
                yc, gxc, gwc = run(torch.device("cpu"))
            except Exception as e:  # noqa: BLE001
                why, tail = error_text(e)
                self.check(ctx, f"grouped {recipe}: fwd+bwd", False, detail=f"{why} | {tail}")
                continue
            kernel = "aten::_scaled_grouped_mm" in ops
            self.check(ctx, f"grouped {recipe}: route", kernel == expected_kernel,
                       detail=f"scaled ops seen: {', '.join(scaled_ops(ops)) or 'none'}; "
                              f"expected {'torch._scaled_grouped_mm' if expected_kernel else 'the reference op'}")
            worst = min(sqnr_db(a.cpu(), b.cpu()) for a, b in ((yc, y), (gxc, gx), (gwc, gw)))
            self.check(ctx, f"grouped {recipe}: worst SQNR of fwd/grads vs CPU reference dB",
                       worst >= self.GROUPED_VS_REF_DB, worst, f">= {self.GROUPED_VS_REF_DB}")
            hp = torch.cat([x0[s:e].float() @ w0[i].float().t() for i, (s, e) in
                            enumerate(zip([0, *offs[:-1].tolist()], offs.tolist()))])
            db = sqnr_db(hp, y.cpu())
            self.check(ctx, f"grouped {recipe}: forward SQNR vs fp32 dB", db >= self.GROUPED_VS_HP_DB, db,
                       f">= {self.GROUPED_VS_HP_DB}")

    # ---- block-scaled

    BLOCK_KERNEL_VS_REF_DB, BLOCK_VS_HP_DB = 40.0, 25.0

    def block_scaled(self, ctx: Ctx) -> None:
        import copy

        import torch
        import torch.nn.functional as F
        from torch import nn

        from f8tensor import BLOCK_1x128, BLOCK_128x128, Float8LinearConfig, Float8Tensor, convert_to_float8_training

        dev = ctx.device
        torch.manual_seed(0)
        m, k, n = ctx.pick((1024, 2048, 1536), (256, 512, 384))
        a = torch.randn(m, k, device=dev)
        w = torch.randn(n, k, device=dev)
        a8, w8 = Float8Tensor.from_hp(a, granularity=BLOCK_1x128), Float8Tensor.from_hp(w, granularity=BLOCK_128x128)
        ref = a8.to_hp(torch.float32) @ w8.to_hp(torch.float32).t()
        if dev.type == "cuda":
            cap = torch.cuda.get_device_capability(dev)
            cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
            kernel_expected = cap == (9, 0) and cuda >= (12, 9) and hasattr(F, "scaled_mm")
            where = f"sm{cap[0]}{cap[1]}, CUDA {torch.version.cuda}, F.scaled_mm {'present' if hasattr(F, 'scaled_mm') else 'absent'}"
        else:
            kernel_expected, where = False, "CPU: the reference path"
        try:
            ops = ops_seen(lambda: torch.mm(a8, w8.t()))
            out = torch.mm(a8, w8.t())
        except NotImplementedError as e:
            why = error_text(e)[0]
            clear = "emulate=True" in why
            self.check(ctx, "block 1x128 x 128x128: refused", (not kernel_expected) and clear,
                       detail=f"{where}; {why}")
            kernel_ok = False
        else:
            kernel = bool(scaled_ops(ops))
            self.check(ctx, "block 1x128 x 128x128: route", kernel == kernel_expected,
                       detail=f"{where}; scaled ops seen: {', '.join(scaled_ops(ops)) or 'none (reference path)'}")
            db = sqnr_db(ref, out)
            self.check(ctx, "block 1x128 x 128x128: SQNR vs dequantized fp32 reference dB",
                       db >= self.BLOCK_KERNEL_VS_REF_DB, db, f">= {self.BLOCK_KERNEL_VS_REF_DB}")
            db = sqnr_db(a @ w.t(), out)
            self.check(ctx, "block 1x128 x 128x128: SQNR vs fp32 product dB", db >= self.BLOCK_VS_HP_DB, db,
                       f">= {self.BLOCK_VS_HP_DB}")
            kernel_ok = True
        if not kernel_ok and dev.type == "cuda":
            return  # the recipe would meet the same refusal
        base = nn.Sequential(nn.Linear(k, n, bias=False), nn.GELU(), nn.Linear(n, k, bias=False)).to(dev, torch.bfloat16)
        x = torch.randn(4, m // 4, k, device=dev, dtype=torch.bfloat16)

        def step(model):
            xi = x.clone().requires_grad_()
            y = model(xi)
            y.float().pow(2).mean().backward()
            return y, xi.grad

        y_ref, gx_ref = step(copy.deepcopy(base))
        for mode in ("eager", "compiled"):
            try:
                model = convert_to_float8_training(copy.deepcopy(base), config=Float8LinearConfig.from_recipe("blockwise"))
                y, gx = step(compile_fn(model, fullgraph=True) if mode == "compiled" else model)
            except Exception as e:  # noqa: BLE001
                self.check(ctx, f"blockwise recipe {mode}: fwd+bwd", False, detail=" | ".join(error_text(e)))
                continue
            self.check(ctx, f"blockwise recipe {mode}: output SQNR vs bf16 dB", sqnr_db(y_ref, y) >= self.MLP_OUT_DB,
                       sqnr_db(y_ref, y), f">= {self.MLP_OUT_DB}")
            self.check(ctx, f"blockwise recipe {mode}: grad_input SQNR vs bf16 dB",
                       sqnr_db(gx_ref, gx) >= self.MLP_GRAD_DB, sqnr_db(gx_ref, gx), f">= {self.MLP_GRAD_DB}")

    # ---- pytest

    def pytest_gpu(self, ctx: Ctx) -> None:
        if self.dry:
            # The same call on a CPU: one module, its CPU tests and their (skipped) cuda twins.
            select, paths = ["-m", "gpu or device_param"], ["tests/test_serialization.py"]
        else:
            select, paths = ["-m", "gpu"], ["tests"]
        junit = self.out / "correctness_junit.xml"
        cmd = [sys.executable, "-m", "pytest", *select, "-q", "-rfE", "-p", "no:cacheprovider",
               "--continue-on-collection-errors", f"--junitxml={junit}", "-o", "junit_family=xunit1", *paths]
        rc, output = self.run_child(ctx, cmd)
        if not junit.exists():
            raise RuntimeError(f"pytest wrote no junit XML (exit status {rc}); its output is in the log")
        ctx.rows.extend(junit_rows(junit, self.device.type))
        last = [ln for ln in output.strip().splitlines() if ln.strip()][-1:] or ["(no output)"]
        ctx.note(f"pytest exit status {rc if rc is not None else 'none (stopped at the deadline)'}: {last[0].strip()}")
        if rc is None:
            raise ItemDeadline()

    # ---- demo

    def demo(self, ctx: Ctx) -> None:
        sizes = ctx.pick(["--steps", "60", "--size", "small"], ["--steps", "2", "--size", "tiny", "--batch-size", "2",
                                                                 "--seq-len", "32"])
        png = Path(tempfile.mkdtemp(prefix="f8tensor_demo_")) / "demo.png"
        cmd = [sys.executable, "-m", "f8tensor.demo", "--device", self.device.type, *sizes,
               "--recipes", "bf16,tensorwise,rowwise", "--out", str(png)]
        rc, output = self.run_child(ctx, cmd)
        # The demo's result table: the rows after its last rule of dashes, up to a blank line.
        lines = output.splitlines()
        rule = max((i for i, ln in enumerate(lines) if ln.strip().startswith("-----")), default=len(lines))
        table = list(itertools.takewhile(str.strip, lines[rule + 1:]))
        self.check(ctx, "demo: exit status 0 (rows: run, final loss, vs bf16, tokens/s, ...)", rc == 0,
                   detail=" / ".join(" ".join(t.split()) for t in table)[:600], kind="demo")
        if rc is None:
            raise ItemDeadline()
        if rc != 0:
            errors = [ln.strip() for ln in lines if re.match(r"^\w*(Error|Exception)\b", ln.strip())]
            raise RuntimeError(f"the demo exited with {rc}: {errors[-1][:300] if errors else 'see the log'}")

    # ---- summary

    def summary_body(self, digest: bool = False) -> list[str]:
        lines = ["## Checks" + (" (failed only)" if digest else ""), ""]
        checks = [r for r in self.rows if r["kind"] != "pytest" and not (digest and r["outcome"] == "passed")]
        if checks:
            lines += ["| check | outcome | value | threshold | detail |", "| --- | --- | ---: | --- | --- |"]
            for r in checks:
                lines.append(f"| {_md(r['name'])} | {r['outcome']} | {_num(_f(r['value']), 2)} | {_md(r['threshold'])} | "
                             f"{_md(str(r['detail'])[:300])} |")
        else:
            lines.append("(none run yet)")
        lines += ["", "## pytest", ""]
        tests = [r for r in self.rows if r["kind"] == "pytest"]
        if not tests:
            return lines + ["(not run, or no report)", ""]
        counts: dict[str, int] = {}
        for r in tests:
            counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
        lines.append(", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
        lines.append("")
        bad = [r for r in tests if r["outcome"] in ("failed", "error")]
        if bad:
            lines += ["Failures:", ""] + [f"- `{r['name']}`: {_md(str(r['detail'])[:400])}" for r in bad[:60]] + [""]
        if digest:
            return lines
        twins: dict[str, dict[str, int]] = {}
        for r in tests:
            base, _, params = r["name"].partition("[")
            if params.startswith("cuda") and "test_gpu.py" not in base:
                twins.setdefault(base, {}).setdefault(r["outcome"], 0)
                twins[base][r["outcome"]] += 1
        if twins:
            lines += ["The cuda twins of the device_param CPU tests:", "", "| test | outcomes |", "| --- | --- |"]
            for base, c in sorted(twins.items()):
                lines.append(f"| `{base}` | {', '.join(f'{v} {k}' for k, v in sorted(c.items()))} |")
            lines.append("")
        return lines


def junit_rows(path: Path, device: str) -> list[dict]:
    """One row per test case of a pytest junit XML: ``path::name[params]``, outcome, seconds, message."""
    rows = []
    root = ET.parse(path).getroot()
    for case in root.iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        file = case.get("file") or (classname.replace(".", "/") + ".py")
        outcome, detail = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                detail = " ".join((child.get("message") or child.text or "").split())[:600]
                break
        rows.append({"stage": "correctness", "kind": "pytest", "name": f"{file}::{name}", "device": device,
                     "outcome": outcome, "seconds": _f(case.get("time")), "value": math.nan, "threshold": "",
                     "detail": detail})
    return rows


# ===================================================================== figures


class Figures(Stage):
    name = "figures"
    csv_name = "figures.csv"
    fields = FIGURE_FIELDS

    def items(self) -> list[Item]:
        import bench_linear

        items = [
            Item("linear_target_tensorwise", 80, lambda c: self.linear(c, "linear_target_tensorwise", TARGET_SHAPE,
                                                                      "tensorwise", "tensorwise", gemm=True),
                 "bench_linear at M=16384, K=4096, N=14336: bf16, tensorwise, torchao tensorwise, eager and "
                 "compiled, with the GEMM-only ceiling", min_s=30),
            Item("linear_target_rowwise", 70, lambda c: self.linear(c, "linear_target_rowwise", TARGET_SHAPE,
                                                                   "rowwise", "rowwise", gemm=True),
                 "bench_linear at the target shape: bf16, rowwise, torchao rowwise, eager and compiled", min_s=30),
            # Two compiles of a 24-layer model (about a minute each is expected): the CSV comes at the end.
            Item("e2e_300m_tensorwise", 200, lambda c: self.e2e(c, "e2e_300m_tensorwise", "tensorwise"),
                 "bench_e2e: the 300m Llama-style model, bf16 vs tensorwise, compiled, 60 steps", min_s=90),
            Item("moe_grouped_gemm", 40, self.moe_gemm,
                 "grouped GEMM fwd+bwd: float8_grouped_mm (tensorwise, rowwise) vs bf16 torch._grouped_mm, "
                 "eager and compiled", min_s=15),
            Item("linear_target_blockwise", 50, self.blockwise,
                 "one linear at the target shape, blockwise (1x128 x 128x128) vs bf16, eager and compiled", min_s=20),
            Item("vit_huge", 100, self.vit,
                 "timm ViT-Huge (vit_huge_patch14_224, random init) training step: bf16, tensorwise, rowwise; "
                 "eager and compiled; images/s", min_s=30),
            Item("moe_block", 30, self.moe_block,
                 "bench_moe: a Qwen3-MoE sparse block (grouped_mm experts) in FP8 vs bf16", min_s=15),
            Item("routes", 40, self.routes, "bench_routes: precise rowwise products, kernel vs post-scale route",
                 min_s=15),
            Item("memory", 120, self.memory, "bench_memory: saved bytes and peak memory, one layer and the 300m step",
                 min_s=40),
            Item("e2e_300m_rowwise", 120, lambda c: self.e2e(c, "e2e_300m_rowwise", "rowwise"),
                 "bench_e2e: the 300m model, bf16 vs rowwise, compiled", min_s=60),
        ]
        for m, k, n in sorted(bench_linear.SHAPE_PRESETS["llama"], key=lambda s: -s[0]):  # the largest M first
            if (m, k, n) == TARGET_SHAPE:
                continue
            name = f"llama_{m}x{k}x{n}"
            items.append(Item(name, 60, lambda c, s=(m, k, n), name=name: self.linear(
                c, name, s, "tensorwise,rowwise", "tensorwise,rowwise", gemm=True),
                f"bench_linear, LLaMA-3-8B sweep at {m}x{k}x{n}: bf16, tensorwise, rowwise, torchao both, "
                "eager and compiled", min_s=30))
        items.append(Item("linear_small", 60, lambda c: self.linear(c, "linear_small", "small", "tensorwise,rowwise",
                                                                    "tensorwise", gemm=False),
                          "bench_linear, the small shapes (where FP8 loses)", min_s=30))
        items.append(Item("eager_overhead", 60, lambda c: self.other_script(c, "bench_eager_overhead"),
                          "benchmarks/bench_eager_overhead.py, when present", min_s=20,
                          absent=lambda: _script_absent("bench_eager_overhead")))
        items.append(Item("comm", 60, lambda c: self.other_script(c, "bench_comm"),
                          "benchmarks/bench_comm.py, when present", min_s=20, absent=lambda: _script_absent("bench_comm")))
        return items

    # ---- bench_linear

    def linear(self, ctx: Ctx, item: str, shape, recipes: str, torchao_recipes: str, gemm: bool) -> None:
        if self.dry:
            shapes = f"{DRY_LINEAR_SHAPE[0]}x{DRY_LINEAR_SHAPE[1]}x{DRY_LINEAR_SHAPE[2]}"
            timing = ["--warmup", "1", "--rounds", "2", "--steps", "1"]
        else:
            shapes = shape if isinstance(shape, str) else "x".join(map(str, shape))
            timing = []
        argv = ["--shapes", shapes, "--recipes", recipes, "--torchao-recipes", torchao_recipes,
                "--modes", "eager,compiled", *timing, *([] if gemm else ["--no-gemm"])]
        try:
            rows = read_csv(run_bench_main(ctx, "bench_linear", argv))
        except Exception as e:
            # One part failing should not cost the others: without torchao, or without the
            # GEMM-only ceiling, once, when the traceback points there.
            frames = traceback.extract_tb(e.__traceback__)
            why = error_text(e)[0]
            if any("torchao" in f.filename for f in frames) and torchao_recipes != "none":
                retry = ["--torchao-recipes", "none"]
            elif gemm and any(f.filename.endswith("bench_linear.py") and f.name == "<lambda>" for f in frames):
                retry = ["--no-gemm"]  # the GEMM-only ceiling's products are bench_linear's only lambdas
            else:
                raise
            ctx.note(f"first attempt failed ({why}); retried with {' '.join(retry)}")
            rows = read_csv(run_bench_main(ctx, "bench_linear", [*argv, *retry]))
        for r in rows:
            shp = f"{r['M']}x{r['K']}x{r['N']}"
            if r["table"] == "linear":
                recipe = "bf16" if r["library"] == "bf16" else (r["recipe"] if r["library"] == "f8tensor"
                                                                 else f"torchao {r['recipe']}")
                ctx.rows.append(fig(item, recipe, r["mode"], shp, "step_ms", _f(r["ms"]), "ms", _f(r["speedup_vs_bf16"])))
                if r["library"] != "bf16" and math.isfinite(_f(r["gemm_ceiling"])):
                    ctx.rows.append(fig(item, recipe, r["mode"], shp, "fraction_of_gemm_ceiling",
                                        _f(r["fraction_of_ceiling"]), "ratio"))
            elif r["table"] == "gemm":
                ctx.rows.append(fig(item, "bf16", "gemm", shp, f"gemm_{r['gemm']}_ms", _f(r["bf16_ms"]), "ms", 1.0))
                for kind in ("tensorwise", "rowwise"):
                    ctx.rows.append(fig(item, kind, "gemm", shp, f"gemm_{r['gemm']}_ms", _f(r[f"{kind}_ms"]), "ms",
                                        _f(r[f"{kind}_speedup"])))
        gemm_rows = [r for r in ctx.rows if r["mode"] == "gemm"]
        for kind, gm in (("tensorwise", ("tensorwise",) * 3), ("rowwise", ("rowwise",) * 3)):
            for shp in {r["shape"] for r in gemm_rows}:
                ms = {(r["recipe"], r["metric"]): r["value"] for r in gemm_rows if r["shape"] == shp}
                try:
                    bf16 = sum(ms["bf16", f"gemm_{g}_ms"] for g in ("forward", "grad_input", "grad_weight"))
                    fp8 = sum(ms[k, f"gemm_{g}_ms"] for k, g in zip(gm, ("forward", "grad_input", "grad_weight")))
                except KeyError:
                    continue
                ctx.rows.append(fig(item, kind, "gemm", shp, "gemm_ceiling_3_gemms", fp8, "ms", bf16 / fp8))

    # ---- bench_e2e

    def e2e(self, ctx: Ctx, item: str, recipe: str) -> None:
        size, steps, warmup = ctx.pick(("300m", "60", "10"), ("quick", "6", "2"))
        argv = ["--size", size, "--modes", "compiled", "--recipes", recipe, "--torchao-recipes", "none",
                "--steps", steps, "--warmup", warmup, "--rounds", "1"]
        rows = read_csv(run_bench_main(ctx, "bench_e2e", argv))
        base = {r["mode"]: r for r in rows if r["library"] == "bf16"}
        for r in rows:
            name = "bf16" if r["library"] == "bf16" else (r["recipe"] if r["library"] == "f8tensor" else f"torchao {r['recipe']}")
            b = base.get(r["mode"])
            ctx.rows.append(fig(item, name, r["mode"], size, "tokens_per_s", _f(r["tokens_per_s"]), "tokens/s",
                                _f(r["speedup_vs_bf16"])))
            ctx.rows.append(fig(item, name, r["mode"], size, "step_ms", _f(r["step_ms"]), "ms", _f(r["speedup_vs_bf16"])))
            ctx.rows.append(fig(item, name, r["mode"], size, "peak_mib", _f(r["peak_mib"]), "MiB", _f(r["peak_vs_bf16"])))
            ctx.rows.append(fig(item, name, r["mode"], size, "final_loss", _f(r["final_loss"]), "loss",
                                _f(r["final_loss"]) / _f(b["final_loss"]) if b else math.nan,
                                status="ok" if r["finite"] == "True" else "non-finite loss"))

    # ---- grouped GEMM

    def moe_gemm(self, ctx: Ctx) -> None:
        import torch

        from f8tensor import Float8LinearConfig, float8_grouped_mm

        groups, m, k, n = ctx.pick((8, 16384, 4096, 14336), (4, 256, 64, 128))
        shape = f"{groups}x{m}x{k}x{n}"
        dev = ctx.device
        torch.manual_seed(0)
        offs = torch.full((groups,), m // groups, dtype=torch.int32).cumsum(0).to(torch.int32).to(dev)
        w = torch.randn(groups, n, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(m, n, device=dev, dtype=torch.bfloat16)

        def bf16_fwd(x, w):
            return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

        def fp8_fwd(recipe):
            config = Float8LinearConfig.from_recipe(recipe)
            return lambda x, w: float8_grouped_mm(x, w.transpose(-2, -1), offs, config)

        steps = {}
        for recipe in ("bf16", "tensorwise", "rowwise"):
            fwd = bf16_fwd if recipe == "bf16" else fp8_fwd(recipe)
            for mode in ("eager", "compiled"):
                run = compile_fn(fwd) if mode == "compiled" else fwd

                def step(run=run):
                    x.grad = w.grad = None
                    run(x, w).backward(grad)

                steps[recipe, mode] = step
        ops = ops_seen(steps["tensorwise", "eager"])
        ctx.note(f"tensorwise route: {', '.join(scaled_ops(ops)) or 'no scaled op (reference path)'}")
        warmup, rounds, per_round = ctx.pick((3, 5, 10), (1, 2, 1))
        timings, failed = timed_configs(ctx, steps, warmup, rounds, per_round)
        figure_rows_from_timings(ctx, "moe_grouped_gemm", shape, timings, failed)

    # ---- blockwise linear

    def blockwise(self, ctx: Ctx) -> None:
        import copy

        import torch
        from torch import nn

        from f8tensor import Float8LinearConfig, convert_to_float8_training

        m, k, n = ctx.pick(TARGET_SHAPE, DRY_LINEAR_SHAPE)
        dev = ctx.device
        torch.manual_seed(0)
        ref = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        steps = {}
        for recipe in ("bf16", "blockwise"):
            layer = ref if recipe == "bf16" else convert_to_float8_training(
                nn.Sequential(copy.deepcopy(ref)), config=Float8LinearConfig.from_recipe(recipe))
            for mode in ("eager", "compiled"):
                run = compile_fn(layer) if mode == "compiled" else layer

                def step(run=run, layer=layer):
                    layer.zero_grad(set_to_none=True)
                    x.grad = None
                    run(x).backward(grad)

                steps[recipe, mode] = step
        warmup, rounds, per_round = ctx.pick((5, 5, 10), (1, 2, 1))
        timings, failed = timed_configs(ctx, steps, warmup, rounds, per_round)
        figure_rows_from_timings(ctx, "linear_target_blockwise", f"{m}x{k}x{n}", timings, failed)

    # ---- bench_moe, bench_routes, bench_memory, others

    def moe_block(self, ctx: Ctx) -> None:
        shape = ctx.pick(["--shape", "8192x2048x1536x16x4"], ["--quick"])
        rows = read_csv(run_bench_main(ctx, "bench_moe", [*shape, "--impls", "grouped_mm", "--recipes",
                                                          "tensorwise,rowwise"]))
        for r in rows:
            shp = f"{r['tokens']}x{r['hidden']}x{r['inter']}x{r['experts']}x{r['top_k']}"
            ctx.rows.append(fig("moe_block", r["recipe"], f"eager {r['impl']}", shp, "step_ms", _f(r["ms"]), "ms",
                                _f(r["speedup_vs_bf16"])))
            ctx.rows.append(fig("moe_block", r["recipe"], f"eager {r['impl']}", shp, "saved_bytes", _f(r["saved_bytes"]),
                                "bytes", _f(r["saved_vs_bf16"])))

    def routes(self, ctx: Ctx) -> None:
        rows = read_csv(run_bench_main(ctx, "bench_routes", ctx.pick([], ["--quick"])))
        for r in rows:
            shp = f"{r['M']}x{r['K']}x{r['N']}"
            ctx.rows.append(fig("routes", f"rowwise precise, {r['route']} route", r["mode"], shp, "ms", _f(r["ms"]), "ms"))
            ctx.rows.append(fig("routes", f"rowwise precise, {r['route']} route", r["mode"], shp, "time_vs_kernel_route",
                                _f(r["vs_kernel"]), "ratio"))
            ctx.rows.append(fig("routes", f"rowwise precise, {r['route']} route", r["mode"], shp, "sqnr_vs_kernel_db",
                                _f(r["sqnr_vs_kernel_db"]), "dB"))

    def memory(self, ctx: Ctx) -> None:
        argv = ["--recipes", "tensorwise,rowwise", "--torchao-recipes", "tensorwise,rowwise", "--modes", "eager,compiled",
                *ctx.pick([], ["--quick"])]
        rows = read_csv(run_bench_main(ctx, "bench_memory", argv))
        lin_base = next((r for r in rows if r["table"] == "linear" and r["layer"] == "nn.Linear"), None)
        model_base = {r["mode"]: r for r in rows if r["table"] == "model" and r["library"] == "bf16"}
        for r in rows:
            if r["table"] == "linear":
                name = "bf16" if r["layer"] == "nn.Linear" else r["layer"]
                shp = f"{r['batch']}x{r['seq']}x{r['K']}->{r['N']}"
                for metric in ("saved_bytes", "peak_bytes"):
                    if r.get(metric):
                        ctx.rows.append(fig("memory", name, "eager", shp, metric, _f(r[metric]), "bytes",
                                            _f(r[metric]) / _f(lin_base[metric]) if lin_base else math.nan))
            else:
                name = "bf16" if r["library"] == "bf16" else (r["recipe"] if r["library"] == "f8tensor" else f"torchao {r['recipe']}")
                b = model_base.get(r["mode"])
                for metric in ("saved_bytes", "peak_bytes"):
                    if math.isfinite(_f(r[metric])):
                        ctx.rows.append(fig("memory", name, r["mode"], r["size"], metric, _f(r[metric]), "bytes",
                                            _f(r[metric]) / _f(b[metric]) if b else math.nan))

    def other_script(self, ctx: Ctx, script: str) -> None:
        """A benchmark written after this campaign: its CSV, column by column (numeric columns
        become metrics; ``recipe``/``mode``/``M``,``K``,``N`` columns fill those fields)."""
        rows = read_csv(run_bench_main(ctx, script, ctx.pick([], ["--quick"])))
        for r in rows:
            shape = "x".join(r[c] for c in ("M", "K", "N") if r.get(c)) or r.get("shape", "")
            recipe = r.get("recipe") or r.get("library") or r.get("variant") or ""
            ratio = _f(r.get("speedup_vs_bf16"))
            for col, v in r.items():
                if col.startswith("env_") or col in ("M", "K", "N", "speedup_vs_bf16") or not math.isfinite(_f(v)):
                    continue
                ctx.rows.append(fig(script.removeprefix("bench_"), recipe, r.get("mode", ""), shape, col, _f(v), "",
                                    ratio))

    # ---- ViT-Huge

    def vit(self, ctx: Ctx) -> None:
        import copy

        import _common as C
        import torch
        import torch.nn.functional as F

        from f8tensor import Float8LinearConfig, convert_to_float8_training

        timm = import_timm(ctx)
        dev = ctx.device
        # The write-up's model: ViT-Huge, no class token, average pooling; random init, no download.
        tiny = {"img_size": 32, "patch_size": 8, "embed_dim": 64, "depth": 2, "num_heads": 4} if self.dry else {}
        torch.manual_seed(0)
        base = timm.create_model("vit_huge_patch14_224", pretrained=False, class_token=False, global_pool="avg",
                                 num_classes=1000, **tiny)
        base.to(dev)
        batch, image = ctx.pick((32, 224), (4, 32))
        shape = f"{batch}x3x{image}x{image}"
        images = torch.randn(batch, 3, image, image, device=dev)
        labels = torch.randint(0, 1000, (batch,), device=dev)
        warmup, timed = ctx.pick((3, 10), (1, 2))
        results = {}
        order = [("bf16", "eager"), ("tensorwise", "eager"), ("bf16", "compiled"), ("tensorwise", "compiled"),
                 ("rowwise", "eager"), ("rowwise", "compiled")]
        for recipe, mode in order:
            try:
                model = copy.deepcopy(base)
                if recipe != "bf16":
                    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe(recipe),
                                               module_filter_fn=lambda m, fqn: fqn != "head")
                run = compile_fn(model) if mode == "compiled" else model
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

                def step(run=run, opt=opt):
                    with torch.autocast(dev.type, dtype=torch.bfloat16):
                        loss = F.cross_entropy(run(images).float(), labels)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)

                for _ in range(warmup + (2 if mode == "compiled" else 0)):
                    step()
                C.sync(dev)
                t = C.Timing([C.time_steps(step, timed, dev)])
                results[recipe, mode] = t.median
                base_ms = results.get(("bf16", mode), math.nan)
                ctx.rows.append(fig("vit_huge", recipe, mode, shape, "images_per_s", batch / (t.median / 1e3), "images/s",
                                    base_ms / t.median))
                ctx.say(f"  vit {recipe} {mode}: {t.median:.1f} ms/step, {batch / (t.median / 1e3):.1f} images/s")
            except ItemDeadline:
                raise
            except Exception as e:  # noqa: BLE001
                why, _ = error_text(e)
                ctx.rows.append(fig("vit_huge", recipe, mode, shape, "images_per_s", math.nan, "images/s",
                                    status=f"failed: {why}"))
                ctx.say(f"  vit {recipe} {mode}: failed: {why}")
            finally:
                model = run = opt = None
                gc.collect()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()

    # ---- targets

    def finish_rows(self, item: Item, ctx: Ctx, st: ItemState) -> None:
        failed = [r for r in ctx.rows if r["status"].startswith("failed")]
        if failed and st.status == "ok":
            st.status = f"ok, {len(failed)} configuration(s) failed"
        for t in TARGETS:
            if t.item != item.name:
                continue
            if t.metric == "speedup_vs_torchao":
                mine = _find(ctx.rows, t.recipe, t.mode, "step_ms")
                theirs = _find(ctx.rows, f"torchao {t.recipe}", t.mode, "step_ms")
                if mine is None:
                    continue
                if theirs is None or not math.isfinite(_f(theirs["value"])):
                    ctx.rows.append(fig(item.name, t.recipe, t.mode, mine["shape"], t.metric, math.nan, "x",
                                        target=t.target_text(),
                                        status=f"not run: torchao {self.torchao_note}"
                                        if self.torchao_note.startswith("absent") else "not run: no torchao row"))
                    continue
                ratio = _f(theirs["value"]) / _f(mine["value"])
                ctx.rows.append(fig(item.name, t.recipe, t.mode, mine["shape"], t.metric, ratio, "x",
                                    target=t.target_text(), status="met" if t.met(ratio) else "missed"))
                continue
            row = _find(ctx.rows, t.recipe, t.mode, t.metric)
            if row is None or row["status"] not in ("ok",):
                continue
            ratio = _f(row["ratio_vs_bf16"])
            row["target"] = t.target_text()
            row["status"] = "met" if t.met(ratio) else "missed"

    def summary_body(self, digest: bool = False) -> list[str]:
        lines = ["## Targets (ratios within this run)", "", "| target | item | value | target | status |",
                 "| --- | --- | ---: | --- | --- |"]
        for t in TARGETS:
            row = next((r for r in self.rows if r["item"] == t.item and r["recipe"] == t.recipe and r["mode"] == t.mode
                        and r["metric"] == t.metric and r["target"]), None)
            if row is not None:
                value = _f(row["value"]) if t.metric == "speedup_vs_torchao" else _f(row["ratio_vs_bf16"])
                lines.append(f"| {t.text} | {t.item} | {_num(value, 3)} | {t.target_text()} | {_md(row['status'])} |")
            else:
                st = self.states.get(t.item)
                if st is None:
                    why = "not run: not selected (--items)"
                else:
                    why = st.status if st.status != "ok" and not st.status.startswith("ok,") else "no such row"
                    why = why if why.startswith("not run") else f"not run: {why}"
                lines.append(f"| {t.text} | {t.item} | - | {t.target_text()} | {_md(why)} |")
        if digest:
            return [*lines, ""]
        lines += ["", "## Figures", "", "| item | recipe | mode | shape | metric | value | unit | vs bf16 | status |",
                  "| --- | --- | --- | --- | --- | ---: | --- | ---: | --- |"]
        for r in self.rows:
            lines.append(f"| {r['item']} | {r['recipe']} | {r['mode']} | {r['shape']} | {r['metric']} | "
                         f"{_num(_f(r['value']), 4)} | {r['unit']} | {_num(_f(r['ratio_vs_bf16']), 3)} | {_md(r['status'])} |")
        lines.append("")
        return lines


def _find(rows: list[dict], recipe: str, mode: str, metric: str) -> dict | None:
    return next((r for r in rows if r["recipe"] == recipe and r["mode"] == mode and r["metric"] == metric), None)


def _script_absent(script: str) -> str | None:
    path = BENCH_DIR / f"{script}.py"
    return None if path.exists() else f"benchmarks/{script}.py does not exist in this tree"


def import_timm(ctx: Ctx):
    """timm, or timm with a stand-in for a torchvision that is absent or broken (a CPU torch
    next to PyPI's CUDA torchvision): tutorial 10's importer."""
    try:
        import timm

        return timm
    except ModuleNotFoundError as e:
        if e.name == "timm":
            raise
    except RuntimeError as e:
        if "torchvision" not in str(e):
            raise
    ctx.note("torchvision absent or broken: timm imported through tutorials/10_vit_timm.py's stand-in")
    spec = importlib.util.spec_from_file_location("_tutorial_10", REPO / "tutorials" / "10_vit_timm.py")
    module = importlib.util.module_from_spec(spec)
    threads = __import__("torch").get_num_threads()
    spec.loader.exec_module(module)
    __import__("torch").set_num_threads(threads)  # the tutorial pins one thread at import
    return module.import_timm()


# ===================================================================== profile


@dataclasses.dataclass
class Job:
    """One missed figure to profile: its configuration and the baseline it was compared with."""

    item: str
    recipe: str
    mode: str
    shape: str
    baseline: str  # "bf16" or "torchao <recipe>"
    why: str

    @property
    def name(self) -> str:
        return "_".join(re.sub(r"[^A-Za-z0-9]+", "-", p).strip("-") for p in (self.item, self.recipe, self.mode))


class Profile(Stage):
    name = "profile"
    csv_name = "profile_kernels.csv"
    fields = PROFILE_FIELDS
    ROWS = 12  # kernels per configuration

    def __init__(self, *a, figures_csv: Path | None = None, **k) -> None:
        super().__init__(*a, **k)
        self.figures_csv = figures_csv
        self.trace_written = False
        self.tables: list[str] = []

    def jobs(self) -> tuple[list[Job], str]:
        if self.figures_csv is None:
            return [], "no --figures-csv given"
        paths = [Path(p) for p in str(self.figures_csv).split(",")]
        missing = [str(p) for p in paths if not p.exists()]
        if missing:
            return [], f"--figures-csv not found: {', '.join(missing)}"
        rows = [r for p in paths for r in read_csv(p)]
        jobs: dict[tuple, Job] = {}
        for r in rows:
            if r.get("status") != "missed":
                continue
            baseline = f"torchao {r['recipe']}" if r["metric"] == "speedup_vs_torchao" else "bf16"
            key = (r["item"], r["recipe"], r["mode"], r["shape"], baseline)
            jobs.setdefault(key, Job(r["item"], r["recipe"], r["mode"], r["shape"], baseline,
                                     f"{r['metric']} {r['value']} vs target {r['target']}"))
        return list(jobs.values()), f"{len(jobs)} missed figure(s) in {', '.join(map(str, paths))}"

    def items(self) -> list[Item]:
        jobs, self.jobs_note = self.jobs()
        items = [Item(f"profile_{j.name}" + ("_vs_torchao" if j.baseline != "bf16" else ""), 70,
                      lambda c, j=j: self.profile_job(c, j), f"{j.item} {j.recipe} {j.mode} {j.shape} (missed: {j.why}); "
                      f"baseline {j.baseline}", min_s=20) for j in jobs]
        return items or [Item("nothing_to_profile", 1, lambda c: c.note(self.jobs_note), self.jobs_note, min_s=0)]

    def profile_job(self, ctx: Ctx, job: Job) -> None:
        builders = {"linear": self.linear_step, "llama": self.linear_step, "e2e": self.e2e_step,
                    "moe_grouped_gemm": self.moe_step}
        kind = next((k for k in builders if job.item.startswith(k)), None)
        if kind is None:
            raise NotImplementedError(f"no profile recipe for item {job.item!r}")
        for config, recipe in (("fp8", job.recipe), ("baseline", job.baseline)):
            step = builders[kind](ctx, job, recipe)
            self.profile(ctx, job, config, recipe, step)

    # ---- steps to profile (the figures' configurations, rebuilt)

    def linear_step(self, ctx: Ctx, job: Job, recipe: str):
        import _common as C
        import torch
        from torch import nn

        m, k, n = (int(v) for v in job.shape.split("x"))
        dev = ctx.device
        torch.manual_seed(0)
        layer = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        if recipe.startswith("torchao "):
            float8, note = C.load_torchao()
            if float8 is None:
                raise RuntimeError(note)
            layer = C.torchao_convert(float8, nn.Sequential(layer), recipe.split(" ", 1)[1])
        elif recipe != "bf16":
            from f8tensor import Float8LinearConfig, convert_to_float8_training

            layer = convert_to_float8_training(nn.Sequential(layer), config=Float8LinearConfig.from_recipe(recipe))
        run = compile_fn(layer) if job.mode == "compiled" else layer
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(m, n, device=dev, dtype=torch.bfloat16)

        def step():
            layer.zero_grad(set_to_none=True)
            x.grad = None
            run(x).backward(grad)

        return step

    def e2e_step(self, ctx: Ctx, job: Job, recipe: str):
        import _models as M
        import torch

        from f8tensor import Float8LinearConfig, convert_to_float8_training

        cfg = M.SIZES[job.shape]
        model = M.build_model(cfg, ctx.device)
        if recipe != "bf16":
            convert_to_float8_training(model, config=Float8LinearConfig.from_recipe(recipe), module_filter_fn=M.fp8_filter)
        run = compile_fn(model, dynamic=None) if job.mode == "compiled" else model
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        batches = M.synthetic_batches(cfg, 2, ctx.device)

        def step():
            b = batches[0]
            run(b[:, :-1], b[:, 1:]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    def moe_step(self, ctx: Ctx, job: Job, recipe: str):
        import torch

        from f8tensor import Float8LinearConfig, float8_grouped_mm

        groups, m, k, n = (int(v) for v in job.shape.split("x"))
        dev = ctx.device
        offs = torch.full((groups,), m // groups, dtype=torch.int32).cumsum(0).to(torch.int32).to(dev)
        w = torch.randn(groups, n, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        if recipe == "bf16":
            def fwd(x, w):
                return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        else:
            config = Float8LinearConfig.from_recipe(recipe)

            def fwd(x, w):
                return float8_grouped_mm(x, w.transpose(-2, -1), offs, config)
        run = compile_fn(fwd) if job.mode == "compiled" else fwd

        def step():
            x.grad = w.grad = None
            run(x, w).backward(grad)

        return step

    # ---- the profiler

    def profile(self, ctx: Ctx, job: Job, config: str, recipe: str, step) -> None:
        import _common as C
        import torch
        from torch.profiler import ProfilerActivity, profile

        warmup, steps = ctx.pick((5, 5), (1, 2))
        for _ in range(warmup + (2 if job.mode == "compiled" else 0)):
            step()
        C.sync(ctx.device)
        cuda = ctx.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step()
            C.sync(ctx.device)
        events = [e for e in prof.key_averages() if _self_time(e, cuda) > 0]
        events.sort(key=lambda e: _self_time(e, cuda), reverse=True)
        total = sum(_self_time(e, cuda) for e in events) or 1.0
        what = "device" if cuda else "CPU (dry run: no device kernels)"
        title = f"{job.item} {recipe} {job.mode} {job.shape}: top {self.ROWS} by self {what} time, per step"
        table = [f"### {title}", "", "| # | kernel / op | calls / step | ms / step | share |", "| ---: | --- | ---: | ---: | ---: |"]
        for rank, e in enumerate(events[: self.ROWS], 1):
            ms = _self_time(e, cuda) / 1e3 / steps
            share = _self_time(e, cuda) / total
            ctx.rows.append({"stage": "profile", "job": job.name, "config": f"{config}: {recipe}", "rank": rank,
                             "kernel": e.key[:200], "calls": e.count / steps, "device_ms_per_step": ms, "share": share,
                             "status": "ok"})
            table.append(f"| {rank} | `{_md(e.key[:90])}` | {e.count / steps:g} | {ms:.4f} | {100 * share:.1f}% |")
        table.append(f"| | all {len(events)} | | {total / 1e3 / steps:.4f} | 100% |")
        self.tables += table + [""]
        ctx.say("\n".join(table))
        if not self.trace_written:
            raw = Path(tempfile.mkdtemp(prefix="f8tensor_trace_")) / "trace.json"
            prof.export_chrome_trace(str(raw))
            target = self.out / "profile_trace.json.gz"
            with open(raw, "rb") as src, gzip.open(target, "wb", compresslevel=6) as dst:
                shutil.copyfileobj(src, dst)
            size = target.stat().st_size
            if size > 15 * 2**20:
                target.unlink()
                ctx.note(f"trace of {job.name} {config} was {size / 2**20:.1f} MiB gzipped: not kept")
            else:
                self.trace_written = True
                ctx.note(f"trace: profile_trace.json.gz = {job.name} {config} ({recipe}), {steps} steps, "
                         f"{size / 2**20:.2f} MiB")
        del prof
        if cuda:
            torch.cuda.synchronize()

    def summary_body(self, digest: bool = False) -> list[str]:
        lines = ["## Profiles", "", getattr(self, "jobs_note", ""), ""]
        if digest:
            return lines
        return lines + (self.tables or ["(no profile yet)", ""])


def _self_time(e, cuda: bool) -> float:
    if cuda:
        for attr in ("self_device_time_total", "self_cuda_time_total"):
            v = getattr(e, attr, None)
            if v is not None:
                return float(v)
        return 0.0
    return float(e.self_cpu_time_total)


# ===================================================================== main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Details: the module docstring and "
                                "BENCHMARKS.md, 'GPU campaign: how to run it'.")
    p.add_argument("--stage", choices=(*STAGES, "all"), required=True)
    p.add_argument("--out", type=Path, help="folder for the stage's files (created; 'all': one subfolder per stage)")
    p.add_argument("--dry-run", action="store_true", help="the same items on the CPU at tiny sizes")
    p.add_argument("--dry-compile", choices=("off", "aot_eager", "inductor"), default="off",
                   help="dry run only: how torch.compile runs (off: eagerly; default)")
    p.add_argument("--torchao-wheel-dir", metavar="DIR",
                   help="a folder with torchao-*.whl or an unpacked site (pip --target) holding torchao/")
    p.add_argument("--figures-csv", metavar="PATH",
                   help="profile: the figures.csv of an earlier figures run (comma-separated for several)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help=f"seconds per stage, the first counted from process start (default {DEFAULT_BUDGET_S:.0f}: "
                        "one 10-minute command with margin)")
    p.add_argument("--items", help="comma-separated item names: run only these (in plan order)")
    p.add_argument("--list", action="store_true", help="print each stage's items, planned seconds and deadlines; run nothing")
    args = p.parse_args(argv)
    if args.budget_s <= 0:
        p.error(f"--budget-s must be positive; got {args.budget_s}")
    if not args.list and args.out is None:
        p.error("--out is required")
    if args.out is not None:
        bad = [part for part in args.out.parts[-2:] if part not in ("/", ".", "..") and not NAME_OK.match(part)]
        if bad:
            p.error(f"--out: use letters, digits, '.', '_', '-' in names (the device brings back only those); got {bad}")
    return args


def resolve_device(args):
    import torch

    if args.dry_run:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on the GPU machine, or rehearse with --dry-run")
    cap = torch.cuda.get_device_capability()
    if cap < (8, 9):
        raise SystemExit(f"{torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}) has no FP8 tensor cores (need sm_89+)")
    return torch.device("cuda")


def setup_dry_compile(mode: str) -> None:
    """Dry run: ``torch.compile`` runs eagerly (off), or with the aot_eager backend, or for real."""
    import torch

    if mode == "off":

        def compile_off(model=None, **kwargs):
            return model if model is not None else (lambda fn: fn)

        torch.compile = compile_off
    elif mode == "aot_eager":
        original = torch.compile

        def compile_aot_eager(model=None, **kwargs):
            kwargs["backend"] = "aot_eager"
            return original(model, **kwargs) if model is not None else original(**kwargs)

        torch.compile = compile_aot_eager


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    absent = setup_torchao(args.torchao_wheel_dir)
    if args.list:
        return list_plan(args)
    device = resolve_device(args)
    if args.dry_run:
        setup_dry_compile(args.dry_compile)
    note, said = torchao_status(absent if args.torchao_wheel_dir else None)
    if args.torchao_wheel_dir is None and note.startswith("absent: import failed"):
        note = "absent: not installed and no --torchao-wheel-dir given"
    stages = STAGES if args.stage == "all" else (args.stage,)
    start = T0
    figures_csv = Path(args.figures_csv) if args.figures_csv else None
    for name in stages:
        out = args.out / name if args.stage == "all" else args.out
        if name == "profile" and args.stage == "all" and figures_csv is None:
            figures_csv = args.out / "figures" / "figures.csv"
        cls = {"correctness": Correctness, "figures": Figures, "profile": Profile}[name]
        extra = {"figures_csv": figures_csv} if name == "profile" else {}
        stage = cls(out, args, start, device, note, **extra)
        stage.torchao_output = said
        stage.run()
        start = time.monotonic()
    return 0


def list_plan(args) -> int:
    stages = STAGES if args.stage == "all" else (args.stage,)
    for name in stages:
        cls = {"correctness": Correctness, "figures": Figures, "profile": Profile}[name]
        stage = cls.__new__(cls)
        stage.args, stage.dry, stage.figures_csv = args, args.dry_run, Path(args.figures_csv) if args.figures_csv else None
        stage.name = name
        stage.torchao_note = ""
        items = stage.selected()
        print(f"{name} (budget {args.budget_s:.0f} s):")
        for item, dl in zip(items, plan_deadlines(items, args.budget_s)):
            print(f"  {item.name:28s} plan {item.plan_s:5.0f} s  deadline +{dl:5.0f} s  {item.what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
