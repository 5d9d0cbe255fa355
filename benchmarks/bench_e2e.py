"""End to end: train a small Llama-style model for a fixed number of steps, bf16 vs FP8 recipes vs torchao.

Every configuration (bf16; each f8tensor recipe; torchao.float8's recipes when installed;
each eager and compiled, ``torch.compile(model)`` with inductor) starts from the same
weights and trains on the same synthetic batches (a sparse Markov chain: loss floor
about ln 4 = 1.386, see ``_models.synthetic_batches``) with AdamW, bf16 parameters and
activations, the output projection left in bf16. FP8 conversion happens before compile.

A run of ``--steps`` steps: the first ``--warmup`` (compilation happens there) are not
timed, the next one is measured for peak memory (see ``_common.measure_peak``) and not
timed either, the rest are timed. Reported: tokens/s (tokens per step / median step
time), its spread over rounds, the speed-up against bf16 in the same mode, peak memory,
and the final loss (mean of the last ``min(10, steps)`` steps).

With ``--rounds R > 1`` all configurations are kept in memory and their timed steps are
interleaved in R rounds (default on CPU, where other processes share the cores); with
``--rounds 1`` (default on CUDA) they run one after another, one model in memory at a time.

    python benchmarks/bench_e2e.py                    # CPU: --size tiny; CUDA: --size 300m
    python benchmarks/bench_e2e.py --size 300m --modes compiled --csv e2e.csv
    python benchmarks/bench_e2e.py --quick
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
import _models as M
import torch


class Run:
    """One configuration's model, optimizer and training state."""

    def __init__(self, variant: C.Variant, mode: str, cfg: M.LlamaConfig, batches: torch.Tensor, args) -> None:
        self.variant, self.mode, self.cfg, self.batches, self.args = variant, mode, cfg, batches, args
        self.model = variant.convert(M.build_model(cfg, args.device), args.torchao, M.fp8_filter)
        self.run = torch.compile(self.model) if mode == "compiled" else self.model
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
        self.i = 0
        self.losses: list[torch.Tensor] = []
        self.timing = C.Timing()
        self.warmup_s = math.nan
        self.memory: C.PeakMemory | None = None

    def lr(self, i: int) -> float:
        warm = max(1, min(20, self.args.steps // 10))
        return self.cfg.lr * min(1.0, (i + 1) / warm)

    def step(self) -> None:
        batch = self.batches[self.i]
        for group in self.opt.param_groups:
            group["lr"] = self.lr(self.i)
        loss = self.run(batch[:, :-1], batch[:, 1:])
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.losses.append(loss.detach())
        self.i += 1

    def warm_and_measure(self) -> None:
        t0 = time.perf_counter()
        for _ in range(self.args.warmup):
            self.step()
        C.sync(self.args.device)
        self.warmup_s = time.perf_counter() - t0
        resident = C.tensor_bytes(C.state_tensors(self.model, self.opt) + [self.batches[self.i]])
        self.memory = C.measure_peak(self.step, resident, self.args.device)

    def timed(self, steps: int) -> None:
        self.timing.rounds.append(C.time_steps(self.step, steps, self.args.device))

    def result(self) -> dict:
        tokens = self.cfg.batch * self.cfg.seq
        losses = torch.stack(self.losses).float().cpu()
        tail = min(10, len(losses))
        mem = self.memory
        return {
            "library": self.variant.library,
            "recipe": self.variant.recipe or "-",
            "mode": self.mode,
            "steps": len(losses),
            "timed_steps": len(self.timing.all),
            "step_ms": self.timing.median,
            "spread": self.timing.spread,
            "tokens_per_s": tokens / (self.timing.median / 1e3),
            "peak_mib": mem.peak / 2**20,
            "peak_no_gemm_scratch_mib": mem.peak_no_gemm_scratch / 2**20,
            "resident_mib": mem.resident / 2**20,
            "first_loss": losses[0].item(),
            "final_loss": losses[-tail:].mean().item(),
            "finite": bool(torch.isfinite(losses).all()),
            "warmup_s": self.warmup_s,
        }


def main(argv=None) -> None:
    parser = C.BenchArgumentParser(__doc__)
    parser.add_modes()
    parser.add_argument(
        "--size",
        choices=sorted(M.SIZES),
        default=None,
        help="model size (default: tiny on CPU, 300m on CUDA, quick with --quick)",
    )
    parser.add_argument("--steps", type=int, default=None, help="training steps per configuration (fixed)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed first steps (compilation happens there)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="interleaved timing rounds (1: run configurations one by one)"
    )
    parser.add_argument("--batch", type=int, default=None, help="override the size's batch (sequences per step)")
    parser.add_argument("--seq", type=int, default=None, help="override the size's sequence length")
    args = parser.parse_args(argv)
    cuda = args.device.type == "cuda"
    size = args.size or ("quick" if args.quick else ("300m" if cuda else "tiny"))
    cfg = M.SIZES[size]
    if args.batch is not None or args.seq is not None:
        import dataclasses

        cfg = dataclasses.replace(cfg, batch=args.batch or cfg.batch, seq=args.seq or cfg.seq)
    if cfg.batch < 1 or cfg.seq < 2:
        parser.error("--batch must be >= 1 and --seq >= 2")
    default_steps = 6 if args.quick else (200 if cuda else 60)
    args.steps = default_steps if args.steps is None else args.steps
    args.warmup = (2 if args.quick else (10 if cuda else 4)) if args.warmup is None else args.warmup
    args.rounds = (1 if cuda or args.quick else 4) if args.rounds is None else args.rounds
    timed = args.steps - args.warmup - 1
    if args.warmup < 1 or args.rounds < 1 or timed < args.rounds:
        parser.error(
            f"need --warmup >= 1, --rounds >= 1 and --steps >= warmup + 1 + rounds "
            f"(got steps {args.steps}, warmup {args.warmup}, rounds {args.rounds})"
        )
    if "compiled" in args.modes:
        C.setup_compile()
    chunks = [timed // args.rounds + (1 if r < timed % args.rounds else 0) for r in range(args.rounds)]

    env = C.environment(args.device, args.torchao_note)
    C.print_environment(env, f"End to end: Llama-style model ({size}), bf16 vs f8tensor vs torchao.float8")
    probe = M.build_model(cfg, torch.device("meta"))
    print(
        f"model: {M.count_parameters(probe) / 1e6:.1f}M parameters ({cfg.describe()}); AdamW lr {cfg.lr}, "
        f"bf16 parameters and activations; FP8: every linear of the blocks, not the output projection"
    )
    print(
        f"{args.steps} steps per configuration: {args.warmup} warm-up, 1 measured for memory, {timed} timed "
        f"in {args.rounds} round(s); tokens/s from the median step; same weights and batches everywhere"
    )
    print()
    del probe
    batches = M.synthetic_batches(cfg, args.steps, args.device)
    configs = [(v, mode) for v in C.variants(args) for mode in args.modes]
    progress = C.Progress(len(configs) * (1 + args.rounds), "bench_e2e")
    results = []
    if args.rounds == 1:
        for variant, mode in configs:
            progress.update(f"{variant.name} {mode}: warm-up")
            run = Run(variant, mode, cfg, batches, args)
            run.warm_and_measure()
            progress.update(f"{variant.name} {mode}: {timed} timed steps")
            run.timed(timed)
            results.append(run.result())
            del run
            if cuda:
                torch.cuda.empty_cache()
    else:
        runs = []
        for variant, mode in configs:
            progress.update(f"{variant.name} {mode}: warm-up")
            run = Run(variant, mode, cfg, batches, args)
            run.warm_and_measure()
            runs.append(run)
        for r, chunk in enumerate(chunks):
            for run in runs:
                progress.update(f"round {r + 1}/{args.rounds}: {run.variant.name} {run.mode}")
                run.timed(chunk)
        results = [run.result() for run in runs]
    progress.close()

    base = {r["mode"]: r for r in results if r["library"] == "bf16"}
    for r in results:
        r["speedup_vs_bf16"] = r["tokens_per_s"] / base[r["mode"]]["tokens_per_s"]
        r["peak_vs_bf16"] = r["peak_mib"] / base[r["mode"]]["peak_mib"]
    scratch_col = args.device.type == "cpu"
    headers = ["configuration", "mode", "tokens/s", "spread", "speed-up vs bf16", "peak MiB", "vs bf16"]
    if scratch_col:
        headers.append("peak MiB w/o CPU GEMM scratch")
    headers += ["loss: first", "final"]
    table = []
    for r in results:
        name = "bf16" if r["library"] == "bf16" else f"{r['library']} {r['recipe']}"
        row = [
            name,
            r["mode"],
            round(r["tokens_per_s"]),
            "-" if math.isnan(r["spread"]) else f"±{100 * r['spread']:.0f}%",
            f"{r['speedup_vs_bf16']:.2f}x",
            r["peak_mib"],
            f"{r['peak_vs_bf16']:.2f}x",
        ]
        if scratch_col:
            row.append(r["peak_no_gemm_scratch_mib"])
        row += [f"{r['first_loss']:.3f}", f"{r['final_loss']:.3f}" + ("" if r["finite"] else " (non-finite)")]
        table.append(row)
    print(C.markdown_table(headers, table, numeric=[False, False] + [True] * (len(headers) - 2)))
    print()
    print(
        "final loss: mean of the last min(10, steps) steps; ln(vocab) at the start "
        f"= {math.log(cfg.vocab):.3f}, floor about ln 4 = {math.log(4):.3f}"
    )
    C.write_csv(args.csv, [{"table": "e2e", "size": size, **r} for r in results], env)


if __name__ == "__main__":
    main()
