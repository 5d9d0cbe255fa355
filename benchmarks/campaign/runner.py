"""The runner: items in order, each against its deadline, under one deadline from process start.

Deadlines: an item's own deadline is the cumulative planned seconds of the items up to it,
scaled so that the plan fills ``--budget-s`` (time an item leaves unused passes to the
next), counted from process start (imports included) and never later than the run's end
(``start + budget - END_RESERVE``). At its deadline an item is interrupted (``SIGALRM``
raises :class:`ItemDeadline` in the main thread; a child process gets SIGINT, then
SIGKILL) and what it recorded is kept. A watchdog thread writes the files and ends the
process at the budget if an item hangs where no signal reaches it. The results CSV and
the summary are rewritten after every item, so a run cut off anywhere returns its files.

An item whose optional package is absent (``Item.requires``, or a ``ModuleNotFoundError``
for one of :data:`OPTIONAL_PACKAGES` raised inside it) is ``not run: absent (<package>)``,
never ``failed``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import math
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import report, targets

#: Packages an item may use that a machine may lack: their absence is a reason, not a failure.
OPTIONAL_PACKAGES = frozenset(
    {"timm", "torchao", "torchvision", "transformers", "accelerate", "lightning", "expecttest", "hypothesis", "triton"}
)
#: Seconds kept at the end of the budget for the last files (summary, CSV) and the exit.
END_RESERVE_S = 2.0


class ItemDeadline(BaseException):
    """Raised in the main thread when an item reaches its deadline (a BaseException, so that
    ``except Exception`` in the code under test does not swallow it)."""


class PrerequisiteNotRun(Exception):
    """Raised by an item whose earlier item did not run: it is not run for the same reason."""

    def __init__(self, status: str) -> None:
        super().__init__(status)
        self.status = status


@dataclasses.dataclass
class Item:
    name: str
    plan_s: float  # planned seconds on an H100/H200
    fn: Callable[[Ctx], None]
    what: str
    min_s: float = 5.0  # start only with at least this much time left (scaled like the plan)
    requires: tuple[str, ...] = ()  # optional packages: absent -> "not run: absent (<name>)"
    absent: Callable[[], str | None] | None = None  # another reason not to run it (a feature not written yet)


@dataclasses.dataclass
class ItemState:
    status: str = "pending"
    deadline_s: float = math.nan  # seconds after process start
    started_s: float = math.nan
    took_s: float = math.nan
    detail: str = ""


def plan_deadlines(items: list[Item], budget_s: float) -> list[float]:
    """Each item's deadline in seconds after process start: the cumulative planned seconds,
    scaled so that the last one is the budget's end (less :data:`END_RESERVE_S`)."""
    end = max(budget_s - END_RESERVE_S, 0.5 * budget_s)
    total = sum(i.plan_s for i in items) or 1.0
    out, acc = [], 0.0
    for item in items:
        acc += item.plan_s
        out.append(min(acc * end / total, end))
    return out


def missing_package(names: tuple[str, ...]) -> str | None:
    """The first of ``names`` that cannot be imported (absent, or blocked as ``sys.modules[name] = None``)."""
    for name in names:
        if name in sys.modules and sys.modules[name] is None:
            return name
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except (ImportError, ValueError):
            return name
    return None


def _caused_by_deadline(exc: BaseException) -> bool:
    """Whether ``exc`` is, or was raised while handling, an :class:`ItemDeadline`."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, ItemDeadline):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def absent_package(exc: BaseException) -> str | None:
    """The optional package a ``ModuleNotFoundError`` (anywhere in its cause chain) is about, or None."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, ModuleNotFoundError) and exc.name:
            root = exc.name.split(".")[0]
            if root in OPTIONAL_PACKAGES:
                return root
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def error_text(exc: BaseException, lines: int = 4) -> tuple[str, str]:
    """``("Type: message", "last traceback lines")`` of an exception."""
    msg = " ".join(str(exc).split())
    if len(msg) > 400:
        msg = msg[:400] + " ..."
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    tail = " | ".join(" ".join(t.split()) for t in "".join(tb).strip().splitlines()[-2 * lines : -1])
    return f"{type(exc).__name__}: {msg}", tail[-1200:]


def failure_status(exc: BaseException) -> str:
    """A row's status for a configuration that raised: ``not run: no kernel ...`` where the
    library says this device and build have no kernel for it (a gate, not a defect: MXFP8 on
    sm90, say), else ``failed: Type: message``."""
    why = error_text(exc)[0]
    if isinstance(exc, NotImplementedError) and " kernel needs " in str(exc):
        return "not run: no kernel on this device: " + why.split(": ", 1)[1]
    return "failed: " + why


class Ctx:
    """What an item sees: sizes (dry or not), the device, its deadline, where to record."""

    def __init__(self, runner: Runner, item: Item, deadline: float) -> None:
        self.runner, self.item, self.deadline = runner, item, deadline
        self.dry, self.device, self.args = runner.dry, runner.device, runner.args
        self.shared = runner.shared  # what one item leaves for a later one (compiled models)
        self.rows: list[dict] = []
        self.notes: list[str] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def pick(self, gpu, dry):
        return dry if self.dry else gpu

    def say(self, text: str) -> None:
        self.runner.say(text)

    def shared_from(self, key: str, item: str) -> Any:
        """What ``item`` left under ``key``; raises :class:`PrerequisiteNotRun` where ``item`` was
        not run (the same reason), RuntimeError where it ran and left nothing."""
        value = self.shared.pop(key, None)
        if value:
            return value
        status = self.runner.states[item].status if item in self.runner.states else "absent"
        if status.startswith("not run"):
            raise PrerequisiteNotRun(f"{status.split(' (')[0]} ({item} did not run)")
        raise RuntimeError(f"{item} left no compiled model (see its status: {status})")

    def note(self, text: str) -> None:
        self.notes.append(text)
        self.say(f"  note: {text}")

    def row(self, **fields: Any) -> dict:
        r = report.row(self.item.name, **fields)
        self.rows.append(r)
        return r


class Runner:
    """Runs one plan's items in order and keeps ``campaign.log``, ``results.csv`` and ``summary.md`` current."""

    def __init__(
        self,
        plan: str,
        items: list[Item],
        out: Path,
        args,
        start: float,
        device,
        env: list[tuple[str, str]],
        end_note: Callable[[list[str]], list[str]] | None = None,
    ) -> None:
        self.plan, self.items, self.out, self.args, self.start = plan, items, out, args, start
        self.dry, self.device, self.env = args.dry_run, device, env
        self.budget = args.budget_s
        self.rows: list[dict] = []
        self.states = {item.name: ItemState() for item in items}
        self.shared: dict[str, Any] = {}
        self.lock = threading.RLock()
        self.armed = False
        self.child: subprocess.Popen | None = None
        self.current: Ctx | None = None
        self.exit_on_hard_stop = True  # the watchdog ends the process (tests running in-process: False)
        self.end_note = end_note
        out.mkdir(parents=True, exist_ok=True)
        self.log = open(out / "campaign.log", "w", buffering=1)  # noqa: SIM115 (open for the run's life)
        self.console = sys.stdout

    # ----------------------------------------------------------------- output

    def say(self, text: str = "") -> None:
        with self.lock:
            for stream in (self.console, self.log):
                with contextlib.suppress(ValueError, OSError):
                    stream.write(text + "\n")
                    stream.flush()

    def write_files(self) -> None:
        with self.lock:
            report.write_csv(self.out / "results.csv", [*report.env_rows(self.env), *self.rows])
            (self.out / "summary.md").write_text(self.summary())

    def summary(self, digest: bool = False) -> str:
        return report.summary(self, digest)

    # ----------------------------------------------------------------- the run

    def run(self) -> None:
        import torch

        self.say(f"## Environment ({self.plan} plan{', dry run on the CPU' if self.dry else ''})")
        self.say()
        for key, value in self.env:
            self.say(f"- {key}: {value}")
        self.say()
        deadlines = plan_deadlines(self.items, self.budget)
        for item, dl in zip(self.items, deadlines):
            self.states[item.name].deadline_s = dl
        self.say(
            f"budget {self.budget:.0f} s from process start, {time.monotonic() - self.start:.1f} s spent; "
            f"{len(self.items)} items"
        )
        self.write_files()
        watchdog = threading.Timer(max(0.0, self.start + self.budget - 1.0 - time.monotonic()), self._hard_stop)
        watchdog.daemon = True
        watchdog.start()
        previous = signal.signal(signal.SIGALRM, self._on_alarm)
        outer_timer, outer_t0 = signal.getitimer(signal.ITIMER_REAL), time.monotonic()  # e.g. pytest-timeout's
        try:
            for item, dl in zip(self.items, deadlines):
                self._run_item(item, self.start + dl)
                self._cleanup(torch)
                self.write_files()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            if outer_timer[0] > 0:
                signal.setitimer(
                    signal.ITIMER_REAL, max(0.01, outer_timer[0] - (time.monotonic() - outer_t0)), outer_timer[1]
                )
            watchdog.cancel()
        self.say()
        self.say(self.summary(digest=True))  # the end of the output: what a truncated console shows
        self.say(f"wall {time.monotonic() - self.start:.1f} s from process start")
        self.write_files()
        self.log.close()

    def _on_alarm(self, signum, frame) -> None:
        if self.armed:
            self.armed = False
            raise ItemDeadline()

    def _skip_reason(self, item: Item, left: float) -> str | None:
        pkg = missing_package(item.requires)
        if pkg is not None:
            return f"not run: absent ({pkg})"
        reason = item.absent() if item.absent is not None else None
        if reason is not None:
            return f"not run: absent ({reason})"
        min_s = item.min_s * min(1.0, self.budget / max(sum(i.plan_s for i in self.items), 1.0))
        if left < min_s:
            return f"not run: budget ({max(left, 0):.0f} s left at its turn, {min_s:.0f} s needed)"
        return None

    def _run_item(self, item: Item, deadline: float) -> None:
        st = self.states[item.name]
        left = deadline - time.monotonic()
        skip = self._skip_reason(item, left)
        if skip is not None:
            st.status = skip
            self.say(f"### {item.name}: {skip}")
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
        except PrerequisiteNotRun as e:
            self.armed = False
            st.status = e.status
        except ItemDeadline:
            self.armed = False
            st.status = "not run: budget"
            st.detail = f"stopped at its deadline after {time.monotonic() - t0:.0f} s; rows recorded before it are kept"
        except BaseException as e:
            self.armed = False
            if isinstance(e, KeyboardInterrupt):
                raise
            pkg = absent_package(e)
            if _caused_by_deadline(e):  # code under the item wrapped the deadline in its own error
                st.status = "not run: budget"
                st.detail = (
                    f"stopped at its deadline after {time.monotonic() - t0:.0f} s (raised as {type(e).__name__})"
                )
            elif pkg is not None:
                st.status = f"not run: absent ({pkg})"
                st.detail = error_text(e)[0]
            else:
                st.status, st.detail = "failed: " + error_text(e)[0], error_text(e)[1]
                self.say(f"  FAILED: {st.status}\n  traceback: {st.detail}")
        finally:
            self.armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            self._kill_child()
            st.took_s = time.monotonic() - t0
            if ctx.notes:
                st.detail = "; ".join(x for x in [st.detail, *ctx.notes] if x)
            with self.lock:
                self.current = None
                bad = [r for r in ctx.rows if r["status"].startswith(("failed", "error"))]
                if bad and st.status == "ok":
                    st.status = f"ok, {len(bad)} of {len(ctx.rows)} rows failed"
                targets.judge_item(item.name, ctx.rows)
                self.rows.extend(ctx.rows)
        self.say(f"=> {item.name}: {st.status} ({st.took_s:.1f} s)")

    def _cleanup(self, torch) -> None:
        # No torch._dynamo.reset(): later items reuse what earlier ones compiled.
        gc.collect()
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
        """The watchdog: the run reached its budget in code no deadline could interrupt."""
        got = self.lock.acquire(timeout=2)
        try:
            for st in self.states.values():
                if st.status in ("pending", "running"):
                    st.status = "not run: budget (watchdog stop)"
            if self.current is not None:  # what the hung item recorded before it hung
                self.rows.extend(self.current.rows)
                self.current = None
            self._kill_child()
            with contextlib.suppress(Exception):
                self.write_files()
            with contextlib.suppress(Exception):
                self.console.write("\nwatchdog: the run reached its budget; files written, exiting\n")
                self.console.flush()
                self.log.flush()
        finally:
            if got:
                self.lock.release()
        if self.exit_on_hard_stop:
            os._exit(3)

    # ----------------------------------------------------------------- subprocesses

    def run_child(self, ctx: Ctx, cmd: list[str], timeout_s: float, env: dict | None = None) -> tuple[int | None, str]:
        """Run ``cmd`` in the repository root, its output into the log, for at most ``timeout_s``
        and never past the item's deadline: then SIGINT (pytest writes its report), then
        SIGKILL. Returns ``(returncode, or None when stopped, output)``."""
        self.say("$ " + " ".join(shlex.quote(c) for c in cmd))
        repo = Path(__file__).resolve().parents[2]
        full_env = {**os.environ, **(env or {})}
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo), full_env.get("PYTHONPATH", "")) if p)
        full_env["PYTHONUNBUFFERED"] = "1"
        proc = subprocess.Popen(
            cmd,
            cwd=repo,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        self.child = proc
        chunks: list[str] = []

        def pump() -> None:
            for line in proc.stdout:
                chunks.append(line)
                with self.lock, contextlib.suppress(ValueError, OSError):
                    self.log.write("  | " + line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        allowed = min(timeout_s, ctx.left() - 1.0)
        grace = min(15.0, max(1.0, 0.2 * allowed))  # SIGINT -> SIGKILL: time for pytest to write its report
        stopped = False
        try:
            proc.wait(timeout=max(0.5, allowed - grace))
        except subprocess.TimeoutExpired:
            stopped = True
            self.say(f"  (timeout: SIGINT after {allowed - grace:.0f} s)")
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        reader.join(5)
        self.child = None
        return (None if stopped else proc.returncode), "".join(chunks)
