"""The main job: train a small GPT in bf16 and with every FP8 recipe, and compare.

Run it::

    python -m f8tensor.demo
    python -m f8tensor.demo --recipes bf16,rowwise --steps 400

A byte-level GPT learns to continue ``f8tensor/data/corpus.txt``, once per run: ``bf16``
first, then each FP8 recipe on the transformer blocks' linears (``lm_head`` stays high
precision). Every run starts from the same weights and sees the same batches, so the rows
of the table differ only in the precision of the matrix products. fp32 master weights and
AdamW state, bf16 autocast. On a CPU ``torch._scaled_mm`` is a reference kernel: tokens/s
shows what the casts cost, not a speed-up. The table goes to stdout, loss curves to a PNG.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import math
import os
import shutil
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import f8tensor
import f8tensor.stats
from f8tensor import FP4_CAST_DTYPE, CastConfig, Float8LinearConfig, NVFP4_1x16, convert_to_float8_training
from f8tensor.compat import TorchDispatchMode, tree_map_only
from f8tensor.demo.gpt import (  # noqa: F401  (re-exported: the demo's model and data)
    CORPUS,
    DEFAULT_SIZE,
    DEFAULT_STEPS,
    GPT,
    SIZES,
    VOCAB,
    Size,
    batch_starts,
    get_batch,
    keep_lm_head_in_high_precision,
    load_corpus,
)
from f8tensor.demo.report import BASELINE, RunResult, format_table, plot_losses, table_notes
from f8tensor.optim import AdamW

__all__ = ["GPT", "SIZES", "RunResult", "keep_lm_head_in_high_precision", "main"]

DEFAULT_OUT = Path("out") / "f8tensor_demo_loss.png"


#: NVFP4 with one trick off each (``--recipes nvfp4,nvfp4_no_rht,...``); not run by default.
_NVFP4 = Float8LinearConfig.from_recipe("nvfp4")
ABLATIONS: dict[str, Float8LinearConfig] = {
    "nvfp4_no_rht": dataclasses.replace(_NVFP4, hadamard_wgrad=False),
    "nvfp4_no_2d": dataclasses.replace(_NVFP4, weight=CastConfig(FP4_CAST_DTYPE, NVFP4_1x16)),
    "nvfp4_no_sr": dataclasses.replace(_NVFP4, grad_output=CastConfig(FP4_CAST_DTYPE, NVFP4_1x16)),
}


def run_config(name: str) -> Float8LinearConfig:
    """The config of a run: a recipe or one of :data:`ABLATIONS`."""
    return ABLATIONS[name] if name in ABLATIONS else Float8LinearConfig.from_recipe(name)


# ===================================================================== measurements


def saved_activation_bytes(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    amp: torch.autocast,
    activations: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> int:
    """Bytes one training forward (model and loss, under ``activations()``) leaves alive for
    backward; see :func:`f8tensor.stats.alive_tensor_bytes` for how they are read and what
    counts."""

    def forward_and_loss() -> torch.Tensor:
        with activations():
            with amp:
                logits = model(x)
            return _loss(logits, y)

    return f8tensor.stats.alive_tensor_bytes(model, forward_and_loss)[0]


class _Peak(TorchDispatchMode):
    """The highest sum of bytes of the storages ops created while it was active and still
    alive (read on CPU, where no allocator statistic exists; CUDA reads the allocator's)."""

    def __init__(self) -> None:
        super().__init__()
        self.alive = self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        parts: list[torch.Tensor] = []
        tree_map_only(torch.Tensor, lambda t: parts.extend(f8tensor.stats.storage_parts(t)), out)
        for part in parts:
            storage = part.untyped_storage()
            key = storage.data_ptr()
            if key in self.seen or storage.nbytes() == 0:
                continue
            self.seen.add(key)
            self.alive += storage.nbytes()
            weakref.finalize(storage, self._free, key, storage.nbytes())
        self.peak = max(self.peak, self.alive)
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.alive -= nbytes


def step_peak_bytes(step: Callable[[], object], resident: Iterable[torch.Tensor], device: torch.device) -> int:
    """Peak memory of one call of ``step``: the bytes of ``resident`` (what lives between
    steps) plus the highest point the step's own allocations reach above them."""
    before = f8tensor.stats.tensor_bytes(resident)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return before + torch.cuda.max_memory_allocated(device) - start
    with _Peak() as peak:
        step()
    return before + peak.peak


def _saturation_rate(model: nn.Module, probe_step: Callable[[], object]) -> float | None:
    """Mean fraction of values clamped at the FP8 maximum per cast, or None (shown as n/a).

    Telemetry is on only for ``probe_step`` (one untrained batch), so training costs nothing.
    """
    stats = f8tensor.stats
    if not (hasattr(stats, "enable_float8_stats") and hasattr(stats, "float8_stats")):
        return None
    stats.enable_float8_stats(model)
    probe_step()
    fracs = [v for k, v in stats.float8_stats(model).items() if k.endswith("/saturated_frac") and not math.isnan(v)]
    return sum(fracs) / len(fracs) if fracs else None


# ===================================================================== one run


class Progress:
    """A one-line progress bar on stderr; plain lines every 10% when stderr is not a terminal."""

    def __init__(self, name: str, total: int, stream=None) -> None:
        self.name, self.total = name, total
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.every = max(1, total // 10)
        self.t0 = time.perf_counter()
        self.last_draw = 0.0
        self.drawn = 0  # width of the line on screen, to blank out leftovers

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        now = time.perf_counter()
        done = step == self.total
        if self.tty:
            if not done and now - self.last_draw < 0.1:
                return
            self.last_draw = now
            filled = round(20 * step / self.total)
            bar = "#" * filled + "." * (20 - filled)
            eta = (now - self.t0) / step * (self.total - step)
            speed = f"{tokens_per_s:7.0f} tok/s" if tokens_per_s else "   warm-up   "
            line = f"{self.name:<18} [{bar}] {step}/{self.total} loss {loss:.3f} {speed} eta {eta:.0f}s"
            # Never wider than the terminal: a wrapped line cannot be redrawn with \r.
            width = shutil.get_terminal_size().columns - 1
            self.stream.write("\r" + line[:width].ljust(min(width, self.drawn)) + ("\n" if done else ""))
            self.drawn = len(line)
        elif done or step % self.every == 0:
            speed = f"  {tokens_per_s:.0f} tok/s" if tokens_per_s else ""
            self.stream.write(f"{self.name}: step {step}/{self.total}  loss {loss:.3f}{speed}\n")
        self.stream.flush()


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))


def _lr_schedule(steps: int) -> Callable[[int], float]:
    warmup = max(1, steps // 20)

    def factor(step: int) -> float:  # linear warm-up, then cosine down to 10%
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

    return factor


#: ``--optim`` choices: what each one builds (AdamW, betas (0.9, 0.95), weight decay 0.1).
OPTIMIZERS: dict[str, str] = {
    "adamw": "torch.optim.AdamW, fp32 moments",
    "adamw-bf16": "f8tensor.optim.AdamW, bf16 moments",
    "adamw-fp8": "f8tensor.optim.AdamW, FP8 (e4m3) moments",
}
DEFAULT_OPTIM = "adamw"
#: ``--fp8-activations`` choices (the flag alone: ``fp8``).
FP8_ACTIVATIONS: dict[str, str] = {
    "fp8": "save_activations_in_float8",
    "recompute": "save_activations_in_float8(recompute=True)",
}


#: The demo's AdamW hyperparameters (every ``--optim`` choice, and a benchmark's own builder).
ADAMW_BETAS, ADAMW_WEIGHT_DECAY = (0.9, 0.95), 0.1
#: An optimizer of the caller's: ``(params, lr) -> optimizer``.
OptimizerBuilder = Callable[[Iterable[torch.Tensor], float], torch.optim.Optimizer]


def make_optimizer(name: str | OptimizerBuilder, params: Iterable[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    """The optimizer ``--optim name`` asks for, or what a builder makes."""
    if callable(name):
        return name(params, lr)
    betas, weight_decay = ADAMW_BETAS, ADAMW_WEIGHT_DECAY
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    state_dtype = {"adamw-bf16": torch.bfloat16, "adamw-fp8": torch.float8_e4m3fn}.get(name)
    if state_dtype is not None:
        return AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, state_dtype=state_dtype)
    raise ValueError(f"optim must be one of {', '.join(OPTIMIZERS)}; got {name!r}")


def _optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every state tensor of ``opt`` but the step counters."""
    tensors = [v for state in opt.state.values() for k, v in state.items() if k != "step"]
    return sum(v.numel() * v.element_size() for v in tensors if isinstance(v, torch.Tensor))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_run(
    name: str,
    base_model: GPT,
    data: torch.Tensor,
    starts: torch.Tensor,
    size: Size,
    device: torch.device,
    compile_model: bool,
    optim: str | OptimizerBuilder = DEFAULT_OPTIM,
    fp8_activations: bool | str | None = False,
    *,
    measure_peak: bool = True,
) -> RunResult:
    """Train a copy of ``base_model`` in ``name`` ("bf16" or an FP8 recipe), then measure it.

    ``fp8_activations``: an FP8 recipe's forward and loss save activations in FP8 (True or
    ``"fp8"``), and also recompute its norms and activations in backward (``"recompute"``).
    ``starts`` has one row more than steps: the saturation is measured on that last,
    untrained batch. With ``measure_peak`` (the default) the last training step's peak memory
    is measured (and not timed; on a CPU under a dispatch mode, which an optimizer compiled
    with ``fullgraph=True`` refuses: pass False for one, and the peak reads 0).
    """
    model = copy.deepcopy(base_model)
    if name != BASELINE:
        convert_to_float8_training(model, config=run_config(name), module_filter_fn=keep_lm_head_in_high_precision)
    opt = make_optimizer(optim, model.parameters(), size.lr)
    steps = len(starts) - 1
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_schedule(steps))
    amp = torch.autocast(device.type, dtype=torch.bfloat16)
    if compile_model:
        torch.compiler.reset()  # a fresh model each run: start from an empty compile cache
    forward = torch.compile(model) if compile_model else model
    if fp8_activations not in (None, False, True, *FP8_ACTIVATIONS):
        raise ValueError(
            f"fp8_activations must be a bool or one of {', '.join(FP8_ACTIVATIONS)}; got {fp8_activations!r}"
        )
    activations: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    if fp8_activations and name != BASELINE:
        activations = functools.partial(f8tensor.save_activations_in_float8, recompute=fp8_activations == "recompute")

    warmup = min(3, steps // 4)  # first steps (allocations, compilation) are not timed
    tokens_per_step = starts.shape[1] * size.seq_len
    losses: list[float] = []
    step_s: list[float] = []
    tokens_per_s = 0.0
    progress = Progress(name, steps)
    t_run = time.perf_counter()
    peak = 0

    def train_step(x: torch.Tensor, y: torch.Tensor) -> None:
        with activations():
            with amp:
                logits = forward(x)
            loss = _loss(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())  # synchronizes, so the step time below is complete

    for i in range(steps):
        x, y = get_batch(data, starts[i], size.seq_len)
        t0 = time.perf_counter()
        if i == steps - 1 and measure_peak:
            resident = [*model.parameters(), *model.buffers(), *_optimizer_tensors(opt), x, y]
            peak = step_peak_bytes(functools.partial(train_step, x, y), resident, device)
            progress.update(i + 1, losses[-1], tokens_per_s)
            continue
        train_step(x, y)
        if i >= warmup:
            step_s.append(time.perf_counter() - t0)
            # The median step: robust to the odd step slowed by another process.
            tokens_per_s = tokens_per_step / statistics.median(step_s)
        progress.update(i + 1, losses[-1], tokens_per_s)
    _sync(device)
    seconds = time.perf_counter() - t_run

    # Memory on the last training batch (its amax is already in any delayed-scaling
    # history), then saturation on a batch the history has not seen, as a next step's.
    saved = saved_activation_bytes(model, x, y, amp, activations)
    x_next, y_next = get_batch(data, starts[steps], size.seq_len)

    def probe_step() -> None:
        with amp:
            logits = model(x_next)
        _loss(logits, y_next).backward()
        model.zero_grad(set_to_none=True)

    saturation = _saturation_rate(model, probe_step) if name != BASELINE else None
    return RunResult(name, losses, tokens_per_s, saved, saturation, seconds, optimizer_state_bytes(opt), peak)


# ===================================================================== command line


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _allowed_runs() -> list[str]:
    return [BASELINE, *f8tensor.RECIPES]


#: The default runs: bf16 and one recipe per kind of scale (``--recipes all``: every recipe).
DEFAULT_RUNS = (BASELINE, "tensorwise", "rowwise", "delayed", "blockwise")


def build_parser() -> argparse.ArgumentParser:
    allowed = ", ".join(_allowed_runs())
    parser = argparse.ArgumentParser(
        prog="python -m f8tensor.demo",
        description=(
            "Train a small byte-level GPT on the text shipped with f8tensor, once in bf16 and once per "
            "FP8 recipe, from the same initial weights on the same batches; print a comparison table "
            "and write a loss-curve PNG."
        ),
        epilog="Example: python -m f8tensor.demo --recipes bf16,tensorwise --steps 100 --size tiny",
    )
    parser.add_argument(
        "--steps",
        type=_positive_int,
        help=f"training steps per run (default: {DEFAULT_STEPS['cpu']} on CPU, {DEFAULT_STEPS['cuda']} on GPU)",
    )
    parser.add_argument(
        "--recipes",
        default=",".join(DEFAULT_RUNS),
        help=(
            f"comma-separated runs, from: {allowed}, and the NVFP4 ablations {', '.join(ABLATIONS)}; "
            f"'all' runs every recipe (default: {','.join(DEFAULT_RUNS)})"
        ),
    )
    parser.add_argument(
        "--size",
        choices=list(SIZES),
        help="model preset (default: small on CPU, medium on GPU)",
    )
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: a CUDA GPU with FP8 support (compute capability >= 8.9) if there is one, else the CPU",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the model (default: on for GPU, off for CPU)",
    )
    parser.add_argument(
        "--fp8-activations",
        nargs="?",
        const="fp8",
        choices=list(FP8_ACTIVATIONS),
        help=(
            "FP8 runs save the activations autograd keeps for backward in FP8 (f8tensor.save_activations_in_float8); "
            "'recompute' also rebuilds norms, SiLU/GELU and the SwiGLU product in backward (recompute=True)"
        ),
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for the initial weights and the batches (default: 0)")
    parser.add_argument("--batch-size", type=_positive_int, help="sequences per step (default: from --size)")
    parser.add_argument("--seq-len", type=_positive_int, help="tokens per sequence (default: from --size)")
    parser.add_argument(
        "--optim",
        choices=list(OPTIMIZERS),
        default=DEFAULT_OPTIM,
        help=(
            "the optimizer of every run: adamw (torch.optim.AdamW, fp32 moments), adamw-bf16 or adamw-fp8 "
            f"(f8tensor.optim.AdamW with bf16 or FP8 moments) (default: {DEFAULT_OPTIM})"
        ),
    )
    parser.add_argument(
        "--threads",
        type=_positive_int,
        help=(
            "torch threads of a CPU run (default: 1, or what OMP_NUM_THREADS says; more threads help only "
            "on idle cores); a GPU run leaves torch's threads as they are"
        ),
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"where to write the loss-curve PNG (default: {DEFAULT_OUT})"
    )
    return parser


def _parse_runs(parser: argparse.ArgumentParser, text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        names = _allowed_runs()
    allowed = _allowed_runs() + list(ABLATIONS)
    if not names:
        parser.error(f"--recipes is empty; choose from: {', '.join(allowed)}")
    for n in names:
        if n not in allowed:
            parser.error(f"unknown recipe {n!r} in --recipes; choose from: {', '.join(allowed)}")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        parser.error(f"--recipes lists {', '.join(duplicates)} more than once")
    # The baseline runs first, so every later row can be compared with it as it lands.
    return sorted(names, key=lambda n: n != BASELINE)


def _fp8_gpu() -> bool:
    # The recipes use the e4m3fn/e5m2 formats of NVIDIA GPUs (ROCm builds also report
    # through torch.cuda, with other formats and capability numbers).
    return torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability() >= (8, 9)


def _resolve_device(parser: argparse.ArgumentParser, choice: str, runs: list[str]) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if _fp8_gpu() else "cpu")
    if choice == "cuda":
        if not torch.cuda.is_available():
            parser.error(
                f"--device cuda: PyTorch sees no CUDA device (torch {torch.__version__}, "
                "torch.cuda.is_available() is False); use --device cpu or --device auto"
            )
        if not _fp8_gpu() and any(r != BASELINE for r in runs):
            if torch.version.hip is not None:
                why = "this is a ROCm build, and the recipes use the FP8 formats of NVIDIA GPUs"
            else:
                major, minor = torch.cuda.get_device_capability()
                why = f"{torch.cuda.get_device_name()} has compute capability {major}.{minor}, FP8 needs 8.9 or more"
            parser.error(f"--device cuda: {why}; use --recipes bf16 or --device cpu")
    return torch.device(choice)


def cpu_threads(requested: int | None, environ: Mapping[str, str] = os.environ) -> int | None:
    """The torch threads a CPU run sets: ``--threads``, else None where ``OMP_NUM_THREADS`` is
    set (torch already follows it), else 1."""
    if requested is not None:
        return requested
    return None if environ.get("OMP_NUM_THREADS", "").strip() else 1


@contextlib.contextmanager
def _torch_threads(n: int | None) -> Iterator[None]:
    """Run with ``n`` torch threads (None: as they are), then restore the previous count."""
    previous = torch.get_num_threads()
    if n is not None:
        # A thread per core is slow on shared cores: more only when asked.
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo with command-line arguments ``argv`` (default: ``sys.argv[1:]``); return 0."""
    parser = build_parser()
    args = parser.parse_args(argv)
    runs = _parse_runs(parser, args.recipes)
    device = _resolve_device(parser, args.device, runs)
    if args.out.suffix.lower() != ".png":
        parser.error(f"--out must name a .png file; got {str(args.out)!r}")
    preset = SIZES[args.size or DEFAULT_SIZE[device.type]]
    size = dataclasses.replace(
        preset, batch_size=args.batch_size or preset.batch_size, seq_len=args.seq_len or preset.seq_len
    )
    steps = args.steps or DEFAULT_STEPS[device.type]
    compile_model = args.compile if args.compile is not None else device.type == "cuda"
    threads = cpu_threads(args.threads) if device.type == "cpu" else None
    with _torch_threads(threads):
        data = load_corpus(device)
        if size.seq_len >= len(data) - 1:
            parser.error(f"--seq-len {size.seq_len} is longer than the corpus ({len(data)} bytes)")

        torch.manual_seed(args.seed)
        base_model = GPT(size).to(device)
        # One batch more than the runs train on: the measurements after training use it.
        starts = batch_starts(len(data), steps + 1, size.batch_size, size.seq_len, args.seed)
        linears = [(name, m) for name, m in base_model.named_modules() if isinstance(m, nn.Linear)]
        n_fp8 = sum(keep_lm_head_in_high_precision(m, name) for name, m in linears)
        n_params = sum(p.numel() for p in base_model.parameters())
        print(f"f8tensor {f8tensor.__version__} demo: a byte-level GPT on {CORPUS.name} ({len(data):,} bytes)")
        print(
            f"  model   {size.n_layers} layers, d_model {size.d_model}, {size.n_heads} heads, "
            f"{n_params / 1e6:.2f}M parameters"
        )
        print(f"  FP8     {n_fp8} of {len(linears)} linears converted (lm_head stays in high precision)")
        print(
            f"  batch   {size.batch_size} x {size.seq_len} = {size.batch_size * size.seq_len} tokens/step, "
            f"{steps} steps per run, seed {args.seed}"
        )
        print(
            f"  device  {_device_name(device)}, bf16 autocast over fp32 master weights, "
            f"{'torch.compile' if compile_model else 'eager'}"
        )
        print(f"  optim   {args.optim}: {OPTIMIZERS[args.optim]}")
        if args.fp8_activations:
            print(f"  act.    FP8 runs save their activations in FP8 ({FP8_ACTIVATIONS[args.fp8_activations]})")
        print(f"  runs    {', '.join(runs)}", flush=True)

        t_all = time.perf_counter()
        results = [
            train_run(name, base_model, data, starts, size, device, compile_model, args.optim, args.fp8_activations)
            for name in runs
        ]
        last = max(1, min(50, steps // 10))
        print()
        print(format_table(results, last))
        print()
        print(table_notes(results, last, steps, device, args.fp8_activations))
        title = f"f8tensor demo: {size.n_layers}x{size.d_model} byte-level GPT, {steps} steps, {_device_name(device)}"
        if plot_losses(results, args.out, title):
            print(f"loss curves: {args.out}")
        print(f"total time: {time.perf_counter() - t_all:.0f} s")
        return 0


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    n = torch.get_num_threads()
    return f"cpu ({n} thread{'s' if n > 1 else ''})"


if __name__ == "__main__":
    sys.exit(main())
