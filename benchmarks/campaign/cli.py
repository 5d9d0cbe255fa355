"""The command line of ``benchmarks/gpu_campaign.py``: parse, set up, run one plan."""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

from . import plans

NAME_OK = re.compile(r"^[A-Za-z0-9._-]+$")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="gpu_campaign.py",
        description="f8tensor's GPU campaign: one plan per command",
        epilog="Details: BENCHMARKS.md, 'GPU campaign: how to run it'.",
    )
    p.add_argument(
        "--second",
        action="store_true",
        help=f"run the second plan (at most {plans.COMMAND_LIMIT_S['second']} s) instead of the default",
    )
    p.add_argument(
        "--plan",
        "--list",
        dest="show_plan",
        action="store_true",
        help="print the plan's items with planned seconds and deadlines, and the planned total; run nothing",
    )
    p.add_argument("--out", type=Path, help="folder for the run's files (created)")
    p.add_argument("--dry-run", action="store_true", help="the same items on the CPU at tiny sizes")
    p.add_argument(
        "--dry-compile",
        choices=("off", "aot_eager", "inductor"),
        default="off",
        help="dry run only: how torch.compile runs (off: eagerly; default)",
    )
    p.add_argument(
        "--torchao-wheel-dir",
        metavar="DIR",
        help="a folder with torchao-*.whl or an unpacked site (pip --target) holding torchao/",
    )
    p.add_argument(
        "--figures-csv",
        "--results-csv",
        dest="figures_csv",
        metavar="PATH",
        help="second plan: the results.csv of a default run (comma-separated for several), to profile "
        "its figures below target",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="seconds from process start for the whole run (default: "
        + ", ".join(f"{k} {v:.0f}" for k, v in plans.DEFAULT_BUDGET_S.items())
        + ")",
    )
    p.add_argument("--items", help="comma-separated item names: run only these (in plan order)")
    p.add_argument("--stage", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.stage is not None:
        p.error(
            "--stage: the three stages are gone; run the default plan (no flag) and, optionally, --second "
            "(--plan prints each)"
        )
    args.plan_name = "second" if args.second else "default"
    if args.budget_s is None:
        args.budget_s = plans.DEFAULT_BUDGET_S[args.plan_name]
    if args.budget_s <= 0:
        p.error(f"--budget-s must be positive; got {args.budget_s}")
    if not args.show_plan and args.out is None:
        p.error("--out is required")
    if args.out is not None:
        bad = [part for part in args.out.parts[-2:] if part not in ("/", ".", "..") and not NAME_OK.match(part)]
        if bad:
            p.error(
                f"--out: use letters, digits, '.', '_', '-' in names (the device brings back only those); got {bad}"
            )
    return args


def select(items, names: str | None, parser_error=None):
    if not names:
        return items
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in {i.name for i in items}]
    if unknown:
        raise SystemExit(f"--items: unknown item(s) {', '.join(unknown)}; known: {', '.join(i.name for i in items)}")
    return [i for i in items if i.name in wanted]


def print_plan(args, items) -> int:
    from .runner import plan_deadlines

    print(
        f"{args.plan_name} plan (budget {args.budget_s:.0f} s from process start; GPU command limit "
        f"{plans.COMMAND_LIMIT_S[args.plan_name]} s):"
    )
    for item, dl in zip(items, plan_deadlines(items, args.budget_s)):
        print(f"  {item.name:24s} plan {item.plan_s:4.0f} s  deadline +{dl:4.0f} s  {item.what}")
    print(f"planned total: {sum(i.plan_s for i in items):.0f} s")
    return 0


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


def setup_compile(args) -> None:
    """One inductor cache for the process and its children (later items reuse what earlier ones
    compiled); the dry run's ``torch.compile``: eager (off), aot_eager, or inductor."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "f8tensor_campaign_inductor"))
    import _common as C
    import torch

    C.setup_compile()
    if not args.dry_run or args.dry_compile == "inductor":
        return
    original = torch.compile

    def compile_dry(model=None, **kwargs):
        if args.dry_compile == "off":
            return model if model is not None else (lambda fn: fn)
        kwargs["backend"] = "aot_eager"
        return original(model, **kwargs) if model is not None else original(**kwargs)

    torch.compile = compile_dry


def main(argv: list[str] | None = None, start: float | None = None) -> int:
    import time

    start = time.monotonic() if start is None else start
    args = parse_args(argv)
    items = select(plans.PLANS[args.plan_name](), args.items)
    if args.show_plan:
        return print_plan(args, items)
    from . import environment
    from .runner import Runner

    absent = environment.setup_torchao(args.torchao_wheel_dir)
    setup_compile(args)
    device = resolve_device(args)
    env = environment.environment(device, environment.torchao_note(absent))
    runner = Runner(args.plan_name, items, args.out, args, start, device, env)
    runner.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
