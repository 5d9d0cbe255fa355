"""Optimizer memory and step time: f8tensor.optim.AdamW against torch's AdamW (and torchao's
8-bit AdamWs when torchao is installed).

Per configuration, on a stack of ``--layers`` square ``--width`` x ``--width`` parameters
(10 x 1024 x 1024 = 10.5M by default):

- *state B/param*: the moments and their scales (every state tensor but ``step`` and the
  master remainder), per parameter;
- *persistent B/param*: what lives between steps, gradients excluded: the parameter, the
  remainder of ``master_weights="remainder"``, the moments and scales;
- *first step s*: the first ``optimizer.step()``, which creates the states and, for the
  compiled rows (f8tensor's ``compiled=True``, torchao's), compiles the step (inductor's C++
  build; a warm inductor cache on disk shortens it);
- *step ms*: the median time of one ``optimizer.step()`` over ``--steps`` timed steps (after
  two untimed ones), gradients set once. Configurations run in interleaved rounds, so that
  load from other processes falls on all of them alike.

f8tensor's rows run its torch-ops path (``compiled=False``) and its compiled CPU step
(``compiled=True``); ``--no-compile`` leaves the compiled rows out (``--quick`` too).

    PYTHONPATH=. python benchmarks/bench_optim.py                 # 10.5M parameters
    PYTHONPATH=. python benchmarks/bench_optim.py --quick         # a smoke run in seconds

``--quality SEEDS`` trains the demo GPT (``--size``, ``--train-steps``, bf16 autocast, fp32
master weights, the demo's own loop) once per seed and optimizer (torch AdamW, f8tensor
AdamW with FP8 states, torchao's AdamWFp8 when installed; the demo's betas and weight decay)
and prints each final loss (the demo's: the mean of the last steps), their mean and
standard deviation:

    PYTHONPATH=. python benchmarks/bench_optim.py --quality 0,1,2 --train-steps 250
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from f8tensor.optim import AdamW

FP8 = torch.float8_e4m3fn
KW = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
NOT_INSTALLED = "not installed"


@dataclass(frozen=True)
class Config:
    name: str
    param_dtype: torch.dtype
    make: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None  # None: unavailable
    note: str = ""


def _torchao_optim(name: str) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None:
    if importlib.util.find_spec("torchao") is None:
        return None
    try:
        from torchao import optim as ao_optim  # type: ignore[import-not-found]
    except ImportError:
        try:
            from torchao.prototype import low_bit_optim as ao_optim  # type: ignore[import-not-found,no-redef]
        except ImportError:
            return None
    cls = getattr(ao_optim, name, None)
    return None if cls is None else (lambda params: cls(params, **KW))


def configs(compiled: bool = True) -> list[Config]:
    """The rows: torch's AdamW, f8tensor's per state dtype (torch ops, then compiled unless
    ``compiled`` is False), torchao's."""
    f32, bf16 = torch.float32, torch.bfloat16
    ours = [
        ("f8tensor AdamW fp32 states", f32, {}),
        ("f8tensor AdamW bf16 states", f32, {"state_dtype": bf16}),
        ("f8tensor AdamW FP8 states", f32, {"state_dtype": FP8}),
        ("f8tensor bf16 + remainder, bf16 states", bf16, {"state_dtype": bf16, "master_weights": "remainder"}),
        ("f8tensor bf16 + remainder, FP8 states", bf16, {"state_dtype": FP8, "master_weights": "remainder"}),
    ]
    rows = [Config("torch AdamW (foreach)", f32, lambda ps: torch.optim.AdamW(ps, foreach=True, **KW))]
    for name, dtype, options in ours:
        for mode in (False, True) if compiled else (False,):
            suffix = ", compiled" if mode else ", torch ops"
            rows.append(Config(name + suffix, dtype, functools.partial(_ours, compiled=mode, **options)))
    rows += [
        Config("torchao AdamWFp8", f32, _torchao_optim("AdamWFp8")),
        Config("torchao AdamW8bit", f32, _torchao_optim("AdamW8bit")),
    ]
    return rows


def _ours(params: list[torch.Tensor], **options) -> torch.optim.Optimizer:
    return AdamW(params, **options, **KW)


def _nbytes(t: torch.Tensor) -> int:
    # A torchao state may be a tensor subclass holding codes and scales: count what it holds.
    inner = getattr(t, "__tensor_flatten__", None)
    if inner is not None and type(t) is not torch.Tensor:
        names, _ = inner()
        return sum(_nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def state_bytes(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> tuple[int, int]:
    """(moment bytes incl. scales, persistent bytes: parameters + every state tensor but step)."""
    moments = persistent = sum(_nbytes(p) for p in params) * 0
    persistent += sum(_nbytes(p) for p in params)
    for p in params:
        for key, value in opt.state[p].items():
            if not isinstance(value, torch.Tensor) or key == "step":
                continue
            persistent += _nbytes(value)
            if key != "master_remainder":
                moments += _nbytes(value)
    return moments, persistent


@dataclass
class Row:
    name: str
    state_bpp: float | None
    persistent_bpp: float | None
    step_ms: float | None
    note: str = ""
    first_s: float | None = None


def run(layers: int, width: int, steps: int, rounds: int, compiled: bool = True) -> tuple[list[Row], int]:
    g = torch.Generator().manual_seed(0)
    master = [torch.randn(width, width, generator=g) * 0.02 for _ in range(layers)]
    grads = [torch.randn(width, width, generator=g) * 1e-3 for _ in range(layers)]
    numel = layers * width * width
    setups = []
    rows = []
    for config in configs(compiled):
        if config.make is None:
            rows.append(Row(config.name, None, None, None, NOT_INSTALLED))
            continue
        params = [torch.nn.Parameter(m.to(config.param_dtype)) for m in master]
        for p, grad in zip(params, grads):
            p.grad = grad.to(config.param_dtype)
        opt = config.make(params)
        t0 = time.perf_counter()
        opt.step()  # untimed: state allocation, compilation
        first = time.perf_counter() - t0
        opt.step()  # untimed: first-call costs
        moments, persistent = state_bytes(opt, params)
        row = Row(config.name, moments / numel, persistent / numel, None, first_s=first)
        rows.append(row)
        setups.append((row, opt, []))
    per_round = max(1, steps // rounds)
    for _ in range(rounds):
        for _row, opt, times in setups:
            for _ in range(per_round):
                t0 = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - t0)
    for row, _opt, times in setups:
        row.step_ms = statistics.median(times) * 1e3
    return rows, numel


def format_table(rows: Sequence[Row], device_label: str) -> str:
    base = next(r.step_ms for r in rows if r.name.startswith("torch AdamW"))
    header = (
        f"{'optimizer':<52}{'state B/param':>15}{'persistent B/param':>20}{'first step s':>14}"
        f"{f'step ms ({device_label})':>17}{'vs torch':>10}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        if r.step_ms is None:
            lines.append(f"{r.name:<52}{r.note:>15}{r.note:>20}{r.note:>14}{r.note:>17}{'-':>10}")
            continue
        rel = f"{r.step_ms / base:.2f}x" if base else "-"
        first = f"{r.first_s:.1f}" if r.first_s is not None else "-"
        lines.append(f"{r.name:<52}{r.state_bpp:>15.4f}{r.persistent_bpp:>20.4f}{first:>14}{r.step_ms:>17.1f}{rel:>10}")
    return "\n".join(lines)


def quality_optimizers() -> list[tuple[str, Callable | None]]:
    """``(name, (params, lr) -> optimizer or None when unavailable)``, the demo's hyperparameters."""
    from f8tensor import demo

    hyper = {"betas": demo.ADAMW_BETAS, "weight_decay": demo.ADAMW_WEIGHT_DECAY}
    torchao = _torchao_optim("AdamWFp8")
    return [
        ("torch AdamW (fp32 states)", lambda ps, lr: torch.optim.AdamW(ps, lr=lr, **hyper)),
        ("f8tensor AdamW, FP8 states", lambda ps, lr: AdamW(ps, lr=lr, state_dtype=FP8, **hyper)),
        (
            "torchao AdamWFp8",
            None if torchao is None else (lambda ps, lr: _torchao_class("AdamWFp8")(ps, lr=lr, **hyper)),
        ),
    ]


def _torchao_class(name: str):
    try:
        from torchao import optim as ao_optim  # type: ignore[import-not-found]
    except ImportError:
        from torchao.prototype import low_bit_optim as ao_optim  # type: ignore[import-not-found,no-redef]
    return getattr(ao_optim, name)


def quality(seeds: Sequence[int], steps: int, size_name: str) -> dict[str, list[float]]:
    """Final demo loss per optimizer, one per seed (the demo's loop, bf16 model, CPU)."""
    from f8tensor import demo

    device = torch.device("cpu")
    size = demo.SIZES[size_name]
    data = demo.load_corpus(device)
    last = max(1, min(50, steps // 10))  # the demo's "final loss": the mean of the last steps
    finals: dict[str, list[float]] = {}
    for seed in seeds:
        torch.manual_seed(seed)
        base = demo.GPT(size).to(device)
        starts = demo.batch_starts(len(data), steps + 1, size.batch_size, size.seq_len, seed)
        for name, build in quality_optimizers():
            if build is None:
                finals.setdefault(name, [])
                continue
            # No peak: it is not reported here, and torchao's AdamW (compiled, fullgraph) refuses
            # the dispatch mode a CPU peak is read under.
            result = demo.train_run(demo.BASELINE, base, data, starts, size, device, False, build, measure_peak=False)
            finals.setdefault(name, []).append(statistics.fmean(result.losses[-last:]))
            print(f"  seed {seed}, {name}: final loss {finals[name][-1]:.4f} ({result.seconds:.0f} s)", flush=True)
    return finals


def format_quality(finals: dict[str, list[float]], seeds: Sequence[int]) -> str:
    base = finals.get("torch AdamW (fp32 states)") or []
    header = (
        f"{'optimizer':<30}" + "".join(f"{f'seed {s}':>10}" for s in seeds) + f"{'mean':>10}{'std':>9}{'vs torch':>10}"
    )
    lines = [header, "-" * len(header)]
    for name, values in finals.items():
        if not values:
            lines.append(f"{name:<30}{NOT_INSTALLED:>{10 * len(seeds) + 29}}")
            continue
        mean = statistics.fmean(values)
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        rel = f"{100 * (mean / statistics.fmean(base) - 1):+.2f}%" if base else "-"
        lines.append(f"{name:<30}" + "".join(f"{v:>10.4f}" for v in values) + f"{mean:>10.4f}{std:>9.4f}{rel:>10}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=10, help="square parameters (default: 10)")
    parser.add_argument("--width", type=int, default=1024, help="their side (default: 1024)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration (default: 20)")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds (default: 4)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default: 1)")
    parser.add_argument("--quick", action="store_true", help="2 x 256 x 256 parameters, 2 timed steps, no compile")
    parser.add_argument("--no-compile", action="store_true", help="leave out f8tensor's compiled rows")
    parser.add_argument("--quality", metavar="SEEDS", help="comma-separated seeds: train the demo GPT per optimizer")
    parser.add_argument("--train-steps", type=int, default=250, help="--quality: steps per run (default: 250)")
    parser.add_argument("--size", default="small", help="--quality: the demo's model size (default: small)")
    args = parser.parse_args(argv)
    if args.quality is not None:
        try:
            seeds = [int(s) for s in args.quality.split(",")]
        except ValueError:
            parser.error(f"--quality takes comma-separated integer seeds; got {args.quality!r}")
        if args.train_steps < 2:
            parser.error(f"--train-steps must be at least 2; got {args.train_steps}")
        torch.set_num_threads(args.threads)
        print(
            f"demo GPT '{args.size}', {args.train_steps} steps, seeds {seeds}, CPU "
            f"({platform.processor() or platform.machine()}, {args.threads} thread(s)), torch {torch.__version__}"
        )
        print(format_quality(quality(seeds, args.train_steps, args.size), seeds))
        return 0
    if args.quick:
        args.layers, args.width, args.steps, args.rounds, args.no_compile = 2, 256, 2, 1, True
    for flag in ("layers", "width", "steps", "rounds", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be a positive integer; got {getattr(args, flag)}")
    torch.set_num_threads(args.threads)
    rows, numel = run(args.layers, args.width, args.steps, args.rounds, compiled=not args.no_compile)
    label = "CPU"
    print(
        f"optimizer step, {args.layers} x ({args.width} x {args.width}) = {numel / 1e6:.1f}M parameters, "
        f"{label} ({platform.processor() or platform.machine()}, {args.threads} thread(s)), torch {torch.__version__}"
    )
    print(format_table(rows, label))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
