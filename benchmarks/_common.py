"""What every benchmark script shares: devices, timing, torchao, memory, tables, CSV, progress.

Kept small and dependency-free (torch only; torchao when installed). Each script puts its
own directory on ``sys.path`` and imports it as ``_common``.

Conventions:

- Times are per step in milliseconds. On CUDA each step is bracketed by CUDA events and
  read after one ``torch.cuda.synchronize``; on CPU by ``time.perf_counter``.
- Configurations are timed in interleaved rounds (every configuration runs a few steps,
  then the next, round after round), so that load from other processes falls on all of
  them alike; a figure is the median over all steps, its spread the range of the
  per-round medians around it.
- "speed-up" is ``bf16 time / time``: above 1 is faster than bf16.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import importlib
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from f8tensor.stats import tensor_bytes  # noqa: F401  (re-exported for the scripts: C.tensor_bytes)

#: f8tensor's recipes, in the order tables list them.
F8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed")
#: torchao.float8's recipes compared against (``Float8LinearConfig.from_recipe_name``).
TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
#: Set to 1 to run as if torchao were not installed (tests use it for the skip path).
NO_TORCHAO_ENV = "F8TENSOR_BENCH_NO_TORCHAO"
MODES = ("eager", "compiled")

REPO = Path(__file__).resolve().parents[1]


# ===================================================================== arguments


class BenchArgumentParser(argparse.ArgumentParser):
    """argparse with the flags every script takes; errors name the flag and what is allowed."""

    def __init__(self, description: str | None, recipes: Sequence[str] = F8_RECIPES, **kwargs: Any) -> None:
        super().__init__(description=description, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
        self.f8_recipes = tuple(recipes)  # what --recipes accepts (and its default)
        self.add_argument(
            "--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda when available, else cpu"
        )
        self.add_argument("--csv", metavar="PATH", help="also write the rows to this CSV file")
        self.add_argument("--quick", action="store_true", help="tiny sizes, few steps: a smoke run in seconds")
        self.add_argument(
            "--recipes",
            default=",".join(recipes),
            help=f"f8tensor recipes, comma-separated, or 'none' (default: all of {', '.join(recipes)})",
        )
        self.add_argument(
            "--torchao-recipes",
            default=",".join(TORCHAO_RECIPES),
            help=f"torchao.float8 recipes, comma-separated, or 'none' (default: {', '.join(TORCHAO_RECIPES)})",
        )
        self.add_argument(
            "--no-torchao",
            action="store_true",
            help=f"skip the torchao column (as does {NO_TORCHAO_ENV}=1, or torchao not being installed)",
        )
        self.add_argument(
            "--threads",
            type=int,
            default=None,
            help="CPU threads for torch (default: 1 on CPU, so that shared machines give stable figures)",
        )

    def add_modes(self, default: str = "eager,compiled") -> None:
        self.add_argument(
            "--modes",
            default=default,
            help="eager, compiled, or both, comma-separated (compiled: torch.compile, inductor)",
        )
        self.add_argument("--no-compile", action="store_true", help="same as --modes eager")

    def parse_args(self, argv: Sequence[str] | None = None) -> argparse.Namespace:  # type: ignore[override]
        args = super().parse_args(argv)
        args.device = resolve_device(args.device, self)
        args.recipes = parse_list(args.recipes, self.f8_recipes, "--recipes", self)
        args.torchao_recipes = parse_list(args.torchao_recipes, TORCHAO_RECIPES, "--torchao-recipes", self)
        if hasattr(args, "modes"):
            args.modes = ["eager"] if args.no_compile else parse_list(args.modes, MODES, "--modes", self)
            if not args.modes:
                self.error("--modes: give at least one of eager, compiled")
        if args.threads is not None and args.threads < 1:
            self.error(f"--threads must be >= 1; got {args.threads}")
        if args.device.type == "cpu":
            torch.set_num_threads(args.threads or 1)
        args.torchao, args.torchao_note = load_torchao(disabled=args.no_torchao)
        if args.torchao is None:
            args.torchao_recipes = []
        return args


def parse_list(value: str, allowed: Sequence[str], flag: str, parser: argparse.ArgumentParser) -> list[str]:
    """``"a,b"`` -> ``["a", "b"]``, each checked against ``allowed``; ``"none"`` or ``""`` -> ``[]``."""
    if value.strip().lower() in ("", "none"):
        return []
    items = [v.strip() for v in value.split(",") if v.strip()]
    for item in items:
        if item not in allowed:
            parser.error(
                f"{flag}: unknown value {item!r}; choose from {', '.join(allowed)} (comma-separated) or 'none'"
            )
    return list(dict.fromkeys(items))


def resolve_device(name: str, parser: argparse.ArgumentParser | None = None) -> torch.device:
    """``auto`` -> cuda if available else cpu. CUDA must have FP8 tensor cores (sm_89+)."""
    fail = parser.error if parser is not None else _raise
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            fail(
                "--device cuda: no CUDA device is available (this torch build: "
                f"{torch.__version__}, CUDA {torch.version.cuda}); use --device cpu"
            )
        cap = torch.cuda.get_device_capability()
        if cap < (8, 9):
            fail(
                f"--device cuda: FP8 matmuls need compute capability >= 8.9 (Ada, Hopper, Blackwell); "
                f"{torch.cuda.get_device_name()} has {cap[0]}.{cap[1]}"
            )
    return torch.device(name)


def _raise(message: str) -> None:
    raise ValueError(message)


def setup_compile() -> None:
    """Many layers of one class are compiled in one process: raise dynamo's recompile
    limits so none silently falls back to eager, and fail loudly if one still would."""
    import torch._dynamo.config as dc

    dc.recompile_limit = 256
    dc.accumulated_recompile_limit = 4096
    dc.fail_on_recompile_limit_hit = True


# ===================================================================== torchao


@functools.cache
def _import_torchao():
    # torchao prints a line per CUDA extension it cannot load (harmless on a CPU build).
    return importlib.import_module("torchao"), importlib.import_module("torchao.float8")


def load_torchao(disabled: bool = False) -> tuple[Any, str]:
    """``(torchao.float8 module or None, note)``; the note says why the column is skipped."""
    if disabled:
        return None, "torchao column skipped (--no-torchao)"
    if os.environ.get(NO_TORCHAO_ENV, "") not in ("", "0"):
        return None, f"torchao column skipped ({NO_TORCHAO_ENV} is set)"
    try:
        torchao, float8 = _import_torchao()
    except ImportError as exc:
        return None, f"torchao column skipped (torchao not installed: {exc}; pip install 'f8tensor[bench]')"
    return float8, f"torchao {torchao.__version__}"


def torchao_version() -> str | None:
    try:
        return importlib.import_module("torchao").__version__
    except ImportError:
        return None


def f8tensor_convert(model: torch.nn.Module, recipe: str, module_filter_fn=None) -> torch.nn.Module:
    from f8tensor import Float8LinearConfig, convert_to_float8_training

    return convert_to_float8_training(
        model, config=Float8LinearConfig.from_recipe(recipe), module_filter_fn=module_filter_fn
    )


def torchao_convert(float8: Any, model: torch.nn.Module, recipe: str, module_filter_fn=None) -> torch.nn.Module:
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    return float8.convert_to_float8_training(model, config=config, module_filter_fn=module_filter_fn)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One column of a side by side: bf16, an f8tensor recipe or a torchao recipe."""

    library: str  # "bf16", "f8tensor" or "torchao"
    recipe: str  # "" for bf16

    @property
    def name(self) -> str:
        return "bf16" if self.library == "bf16" else f"{self.library} {self.recipe}"

    def convert(self, model: torch.nn.Module, float8: Any = None, module_filter_fn=None) -> torch.nn.Module:
        if self.library == "bf16":
            return model
        if self.library == "f8tensor":
            return f8tensor_convert(model, self.recipe, module_filter_fn)
        return torchao_convert(float8, model, self.recipe, module_filter_fn)


def variants(args: argparse.Namespace) -> list[Variant]:
    return (
        [Variant("bf16", "")]
        + [Variant("f8tensor", r) for r in args.recipes]
        + [Variant("torchao", r) for r in args.torchao_recipes]
    )


# ===================================================================== timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[], Any], steps: int, device: torch.device) -> list[float]:
    """Per-step times (ms) of ``steps`` consecutive calls of ``step``.

    CUDA: an event pair around each step, read after one synchronize at the end (the
    queue stays full, as in training). CPU: ``perf_counter`` around each step.
    """
    if device.type == "cuda":
        sync(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        for start, end in events:
            start.record()
            step()
            end.record()
        sync(device)
        return [start.elapsed_time(end) for start, end in events]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(1e3 * (time.perf_counter() - t0))
    return times


@dataclasses.dataclass
class Timing:
    """Per-step times of one configuration, grouped by round."""

    rounds: list[list[float]] = dataclasses.field(default_factory=list)

    @property
    def all(self) -> list[float]:
        return [t for r in self.rounds for t in r]

    @property
    def median(self) -> float:
        return statistics.median(self.all) if self.all else math.nan

    @property
    def spread(self) -> float:
        """Half the range of the per-round medians, relative to the median (0.05 = +-5%)."""
        meds = [statistics.median(r) for r in self.rounds if r]
        if len(meds) < 2:
            return math.nan
        return (max(meds) - min(meds)) / 2 / self.median


def interleaved(
    steps: dict[Any, Callable[[], Any]],
    rounds: int,
    steps_per_round: int,
    device: torch.device,
    progress: Progress | None = None,
) -> dict[Any, Timing]:
    """Time every configuration in ``steps`` for ``rounds`` interleaved rounds."""
    out = {key: Timing() for key in steps}
    for r in range(rounds):
        for key, step in steps.items():
            if progress is not None:
                progress.update(f"round {r + 1}/{rounds}: {label(key)}")
            out[key].rounds.append(time_steps(step, steps_per_round, device))
    return out


def label(key: Any) -> str:
    return " ".join(str(k.name if isinstance(k, Variant) else k) for k in (key if isinstance(key, tuple) else (key,)))


def profile_steps(
    step: Callable[[], Any], device: torch.device, out_dir: str, title: str, steps: int = 3, rows: int = 15
) -> None:
    """Profile ``steps`` calls of ``step``: print the ops (CPU) or kernels (CUDA) with the most
    self time, and write a Chrome trace (``chrome://tracing``, Perfetto) into ``out_dir``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync(device)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    name = "".join(c if c.isalnum() or c in "-_" else "_" for c in title) + ".json"
    prof.export_chrome_trace(str(Path(out_dir) / name))
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"profile: {title}, {steps} steps (trace: {Path(out_dir) / name})")
    print()
    print(prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=60))
    print()


# ===================================================================== memory


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list[torch.Tensor]:
    """Parameters, buffers, gradients and optimizer state: what lives between steps."""
    out = list(model.parameters()) + list(model.buffers())
    out += [p.grad for p in model.parameters() if p.grad is not None]
    if optimizer is not None:
        for state in optimizer.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out


@dataclasses.dataclass
class PeakMemory:
    """Peak bytes of one step: ``resident`` (tensors alive before the step) plus the
    highest point the step's own allocations reach above it."""

    resident: int
    step_peak: int
    #: CPU only: the step peak leaving out buffers a CPU FP8 product allocates and frees
    #: inside itself (FP8 operands widened to fp32: the CPU kernel's scratch, which a GPU
    #: GEMM does not have). Equal to ``step_peak`` on CUDA.
    step_peak_no_gemm_scratch: int

    @property
    def peak(self) -> int:
        return self.resident + self.step_peak

    @property
    def peak_no_gemm_scratch(self) -> int:
        return self.resident + self.step_peak_no_gemm_scratch


#: The CPU FP8 products whose fp32 widening is emulation scratch: torch's, and f8tensor's own
#: per-tensor CPU product (``compat.cpu_scaled_mm``, which computes as torch's kernel does).
_CPU_GEMMS = ("aten::_scaled_mm", "f8tensor::cpu_scaled_mm")


def measure_peak(step: Callable[[], Any], resident: int, device: torch.device) -> PeakMemory:
    """Peak memory of one call of ``step``.

    CUDA: ``torch.cuda.max_memory_allocated`` over the step, minus what was allocated
    when it began (other models alive in the process do not count), plus ``resident``.
    CPU: torch's CPU allocator reports each allocation and free to the profiler
    (``profile_memory=True``); the running sum of those, in time order, is the bytes the
    step holds above what it started with.
    """
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        sync(device)
        rise = torch.cuda.max_memory_allocated(device) - before
        return PeakMemory(resident, rise, rise)
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events: list[tuple[int, int, int, bool]] = []  # (time, bytes, ptr, inside a CPU FP8 GEMM)

    def walk(node, in_gemm: bool) -> None:
        in_gemm = in_gemm or node.name in _CPU_GEMMS
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.ptr, in_gemm))
        for child in node.children:
            walk(child, in_gemm)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, False)
    events.sort(key=lambda e: e[0])
    # Scratch: an allocation inside a CPU FP8 GEMM freed again inside one.
    open_in_gemm: dict[int, int] = {}
    scratch: set[int] = set()
    for i, (_, size, ptr, in_gemm) in enumerate(events):
        if size > 0 and in_gemm:
            open_in_gemm[ptr] = i
        elif size < 0 and ptr in open_in_gemm:
            j = open_in_gemm.pop(ptr)
            if in_gemm:
                scratch.update((i, j))
        elif size > 0:
            open_in_gemm.pop(ptr, None)
    peak = peak_ns = cur = cur_ns = 0
    for i, (_, size, _, _) in enumerate(events):
        cur += size
        peak = max(peak, cur)
        if i not in scratch:
            cur_ns += size
            peak_ns = max(peak_ns, cur_ns)
    return PeakMemory(resident, peak, peak_ns)


# ===================================================================== environment


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=cwd, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    out = _run(["lscpu"])
    for line in (out or "").splitlines():
        if line.startswith("Model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def git_commit() -> str:
    """``git rev-parse --short HEAD`` of the f8tensor checkout; ``+dirty`` when the package or
    the benchmark scripts differ from it (edits elsewhere, e.g. to the docs, change no figure).
    A copy of the tree without ``.git`` (the GPU machine's): ``$F8TENSOR_COMMIT``, else unknown."""
    import f8tensor

    where = Path(f8tensor.__file__).resolve().parent
    commit = _run(["git", "rev-parse", "--short", "HEAD"], cwd=where)
    if commit is None:
        given = os.environ.get("F8TENSOR_COMMIT", "").strip()
        return f"{given} (from F8TENSOR_COMMIT; no git checkout here)" if given else "unknown (not a git checkout)"
    dirty = _run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", str(where), str(Path(__file__).parent)],
        cwd=where,
    )
    return commit + ("+dirty" if dirty else "")


def triton_version() -> str:
    try:
        return importlib.import_module("triton").__version__
    except Exception as exc:  # noqa: BLE001  (a broken triton is as good as none here)
        return f"absent ({type(exc).__name__}: {exc})"


def environment(device: torch.device, torchao_note: str = "") -> dict[str, str]:
    """Everything a pasted table needs to describe itself."""
    env = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "device": device.type,
        "cpu": f"{cpu_model()} ({os.cpu_count()} logical CPUs, torch threads: {torch.get_num_threads()})",
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none (CPU build)",
        "triton": triton_version(),
        "python": platform.python_version(),
        "f8tensor commit": git_commit(),
        "torchao": torchao_note or (torchao_version() or "not installed"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu"] = (
            f"{props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB, "
            f"{props.multi_processor_count} SMs)"
        )
        # Keys differ in their first word: write_csv names the env_* columns by it.
        queries = {
            "driver": "driver_version",
            "power limit / max": "power.limit,power.max_limit",
            "clocks sm / max sm / mem / max mem": "clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem",
        }
        for key, query in queries.items():
            smi = _run(
                [
                    "nvidia-smi",
                    f"--query-gpu={query}",
                    "--format=csv,noheader",
                    f"--id={device.index or torch.cuda.current_device()}",
                ]
            )
            env[key] = smi or "unknown (nvidia-smi did not answer)"
    else:
        env["note"] = (
            "CPU figures: CPUs have no FP8 matrix units (torch._scaled_mm widens FP8 to fp32 and "
            "multiplies in software), so ratios show the FP8 path's overhead, not GPU speed-ups"
        )
    return env


def print_environment(env: dict[str, str], title: str) -> None:
    print(f"## {title}")
    print()
    for key, value in env.items():
        print(f"- {key}: {value}")
    print()


# ===================================================================== output


def fmt(value: Any, digits: int = 2) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:,.{digits}f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], numeric: Sequence[bool] | None = None) -> str:
    """A Markdown table; numeric columns are right-aligned."""
    rows = [list(r) for r in rows]
    if numeric is None:
        numeric = [
            all(isinstance(r[i], (int, float)) or r[i] in ("-", "") for r in rows) and bool(rows)
            for i in range(len(headers))
        ]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---:" if n else "---" for n in numeric) + " |"]
    for r in rows:
        lines.append("| " + " | ".join(c if isinstance(c, str) else fmt(c) for c in r) + " |")
    return "\n".join(lines)


def write_csv(path: str | None, rows: list[dict[str, Any]], env: dict[str, str]) -> None:
    """One row per measurement; the environment repeats in every row (columns ``env_*``)."""
    if not path:
        return
    env_cols = {
        f"env_{k.split(' ')[0] if k != 'f8tensor commit' else 'commit'}": v for k, v in env.items() if k != "note"
    }
    full = [{**row, **env_cols} for row in rows]
    fields = list(dict.fromkeys(k for row in full for k in row))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(full)
    print(f"CSV: {path} ({len(rows)} rows)", file=sys.stderr)


class Progress:
    """A progress bar on stderr: redrawn in place (``\\r``) on a terminal, plain lines otherwise."""

    def __init__(self, total: int, title: str, stream=None) -> None:
        self.total, self.title, self.done = max(total, 1), title, 0
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.perf_counter()

    def update(self, what: str = "") -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.start
        n = min(self.done, self.total)
        if self.tty:
            width = 24
            filled = int(width * n / self.total)
            bar = "#" * filled + "." * (width - filled)
            line = f"\r{self.title} [{bar}] {n}/{self.total} {elapsed:6.1f}s {what}"
            self.stream.write(line[:160].ljust(100))
        else:
            self.stream.write(f"{self.title} [{n}/{self.total}] {elapsed:.1f}s {what}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
