"""Memory: saved-for-backward bytes and peak memory per training step, FP8 recipes vs bf16 vs torchao.

Two tables.

1. One linear layer (input (B, S, K), weight (N, K), bf16, with bias), one forward +
   backward: what autograd saves between them (``saved_tensors_hooks``; the parameters
   themselves are left out, their storage exists anyway; a tensor subclass such as a
   Float8Tensor counts its inner tensors, e.g. FP8 ``_data`` and fp32 ``_scale``), and the
   peak memory of the step (eager). Saved bytes are exact and device independent.
   ``tests/nn/test_saved_for_backward.py`` asserts them through :func:`saved_bytes` / :func:`measure`.
2. A training step of the Llama-style model of ``bench_e2e.py`` (forward, backward,
   AdamW step; bf16 parameters, the output projection left in bf16), eager and compiled,
   after a few warm-up steps (so the optimizer state exists): saved-for-backward bytes of
   the forward (eager) and peak memory.

3. The whole step (``--whole-step``): peak memory of one training step of the
   Llama-shaped model with 4 layers (``--size``'s shapes, batches of the demo's corpus), eager, in
   three configurations: bf16 under autocast with fp32 master weights and
   ``torch.optim.AdamW`` (the reference), bf16 parameters with ``torch.optim.AdamW``, and
   everything on: an FP8 recipe (``--recipes``' first), ``save_activations_in_float8(
   recompute=True)`` and ``f8tensor.optim.AdamW`` with FP8 (e4m3) moments and bf16 master
   weights with remainders, and the weights cast once per step
   (``f8tensor.per_step_weight_casts``, where the recipe's weights allow it): their FP8
   bytes live between steps and count as resident.

Peak memory = the bytes alive before the step (parameters, buffers, optimizer state,
the batch: counted from their storages) plus the highest point the step's own
allocations reach above that. On CUDA that rise is ``torch.cuda.max_memory_allocated``
minus the allocated bytes at the start of the step. On CPU it comes from the CPU
allocator's own allocation and free records (``torch.profiler`` with
``profile_memory=True``), summed in time order. CPU ``torch._scaled_mm`` widens its FP8
operands to fp32 in buffers it allocates and frees inside itself, which a GPU GEMM does
not; the "w/o CPU GEMM scratch" column leaves exactly those allocations out, and is the
CPU figure to compare with what a GPU would hold.

    python benchmarks/bench_memory.py [--batch 4 --seq 1024 --in-features 4096 --out-features 4096] [--size tiny]
    python benchmarks/bench_memory.py --no-linear-peak --no-model --whole-step   # table 3 alone
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
import _models as M
import torch
from torch import nn

import f8tensor.nn.weight_precast
import f8tensor.optim
from f8tensor import Float8Linear, Float8LinearConfig, convert_to_float8_training, save_activations_in_float8
from f8tensor.stats import saved_tensor_bytes

RECIPES = C.F8_RECIPES


def measure(
    batch: int,
    seq: int,
    in_features: int,
    out_features: int,
    dtype: torch.dtype = torch.bfloat16,
    torchao=None,
    torchao_recipes=(),
) -> list[tuple[str, int]]:
    """``[(name, saved bytes)]`` for ``nn.Linear``, each recipe and (given ``torchao``, the
    ``torchao.float8`` module) each torchao recipe: one forward on a 3D input."""
    return [
        (name, nbytes)
        for name, nbytes, _ in _linear_rows(
            batch, seq, in_features, out_features, dtype, torchao, torchao_recipes, peak=False
        )
    ]


def _linear_layers(in_features, out_features, dtype, device, torchao, torchao_recipes):
    torch.manual_seed(0)
    ref = nn.Linear(in_features, out_features, dtype=dtype, device=device)
    yield "nn.Linear", ref
    for recipe in RECIPES:
        yield recipe, Float8Linear.from_float(copy.deepcopy(ref), Float8LinearConfig.from_recipe(recipe))
    for recipe in torchao_recipes:
        yield f"torchao {recipe}", C.torchao_convert(torchao, copy.deepcopy(ref), recipe)


def _linear_rows(
    batch, seq, in_features, out_features, dtype, torchao, torchao_recipes, peak=True, device=None, progress=None
):
    device = torch.device("cpu") if device is None else device
    x = torch.randn(batch, seq, in_features, dtype=dtype, device=device, requires_grad=True)
    grad = torch.randn(batch, seq, out_features, dtype=dtype, device=device)
    rows = []
    for name, layer in _linear_layers(in_features, out_features, dtype, device, torchao, torchao_recipes):
        if progress is not None:
            progress.update(f"linear: {name}")
        nbytes, out = saved_tensor_bytes(layer, lambda layer=layer: layer(x))
        mem = None
        if peak:
            out.backward(grad)  # warm-up: lazily created state, gradients' first allocation

            def step(layer=layer) -> None:
                layer.zero_grad(set_to_none=True)
                x.grad = None
                layer(x).backward(grad)

            layer.zero_grad(set_to_none=True)
            x.grad = None
            resident = C.tensor_bytes(C.state_tensors(layer) + [x, grad])
            mem = C.measure_peak(step, resident, device)
        del out
        rows.append((name, nbytes, mem))
    return rows


def _model_rows(args, cfg, progress) -> list[dict]:
    batches = M.synthetic_batches(cfg, args.model_warmup + 1, args.device)
    rows = []
    for variant in C.variants(args):
        for mode in args.modes:
            progress.update(f"model: {variant.name} {mode}")
            rows.append(_model_step_memory(variant, mode, cfg, batches, args))
    return rows


def _model_step_memory(variant: C.Variant, mode: str, cfg, batches: torch.Tensor, args) -> dict:
    """Saved bytes (eager) and peak memory of training step ``args.model_warmup + 1``."""
    model = variant.convert(M.build_model(cfg, args.device), args.torchao, M.fp8_filter)
    run = torch.compile(model) if mode == "compiled" else model
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    step_index = 0

    def step() -> None:
        nonlocal step_index
        batch = batches[step_index]
        run(batch[:, :-1], batch[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_index += 1

    saved = math.nan
    if mode == "eager":
        first = batches[0]
        saved, _ = saved_tensor_bytes(model, lambda: model(first[:, :-1], first[:, 1:]))
    for _ in range(args.model_warmup):
        step()
    resident = C.tensor_bytes([*C.state_tensors(model, opt), batches[step_index]])
    mem = C.measure_peak(step, resident, args.device)
    return {
        "library": variant.library,
        "recipe": variant.recipe or "-",
        "mode": mode,
        "saved_bytes": saved,
        "resident_bytes": mem.resident,
        "peak_bytes": mem.peak,
        "peak_no_gemm_scratch_bytes": mem.peak_no_gemm_scratch,
    }


#: The whole-step table's configurations: (name, what it is).
WHOLE_STEP = {
    "autocast": "bf16 autocast, fp32 master weights, torch AdamW",
    "bf16": "bf16 parameters, torch AdamW",
    "fp8": "{recipe} + recompute=True + f8tensor AdamW (FP8 moments, bf16 + remainder masters) + per-step weight casts",
}


def whole_step_peak(config: str, cfg: M.LlamaConfig, recipe: str, device: torch.device, warmup: int = 2):
    """Peak memory (:class:`_common.PeakMemory`) of training step ``warmup + 1`` of ``cfg``'s
    model in one of :data:`WHOLE_STEP`'s configurations."""
    model = M.build_model(cfg, device, dtype=torch.float32 if config == "autocast" else torch.bfloat16)
    context = contextlib.nullcontext
    if config == "fp8":
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe(recipe), module_filter_fn=M.fp8_filter)
        context = functools.partial(save_activations_in_float8, recompute=True)
        opt: torch.optim.Optimizer = f8tensor.optim.AdamW(
            model.parameters(), lr=cfg.lr, state_dtype=torch.float8_e4m3fn, master_weights="remainder"
        )
        if f8tensor.nn.weight_precast.precast_refusal(_first_fp8_layer(model)) is None:
            f8tensor.per_step_weight_casts(model, opt)  # their bytes live between steps: counted
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    autocast = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=config == "autocast")
    batches = demo_batches(cfg, warmup + 1, device)
    step_index = 0

    def step() -> None:
        nonlocal step_index
        batch = batches[step_index]
        with autocast(), context():
            loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_index += 1

    for _ in range(warmup):
        step()
    resident = C.tensor_bytes([*C.state_tensors(model, opt), batches[step_index]])
    return C.measure_peak(step, resident, device)


def _first_fp8_layer(model: nn.Module) -> nn.Module:
    return next(m for m in model.modules() if isinstance(m, Float8Linear))


def demo_batches(cfg: M.LlamaConfig, steps: int, device: torch.device) -> torch.Tensor:
    """``(steps, batch, seq + 1)`` byte ids of the demo's corpus, as the demo draws them (seed 0)."""
    from f8tensor.demo.gpt import batch_starts, load_corpus

    data = load_corpus(torch.device("cpu"))
    starts = batch_starts(len(data), steps, cfg.batch, cfg.seq, seed=0)
    offsets = torch.arange(cfg.seq + 1)
    return data[starts[..., None] + offsets].to(device)


def _whole_step_table(size: str, recipe: str, device: torch.device, warmup: int, csv_rows: list) -> None:
    cfg = dataclasses.replace(M.SIZES[size], layers=4)
    print(
        f"### Whole training step: Llama-style model {size} with 4 layers ({cfg.describe()}), eager, step {warmup + 1}"
    )
    print()
    peaks = {name: whole_step_peak(name, cfg, recipe, device, warmup) for name in WHOLE_STEP}
    scratch = device.type == "cpu"
    headers = ["configuration", "resident MiB", "peak MiB", "vs autocast", "vs bf16"]
    table = []
    for name, what in WHOLE_STEP.items():
        mem = peaks[name]
        peak = {key: m.peak_no_gemm_scratch if scratch else m.peak for key, m in peaks.items()}
        table.append(
            [
                what.format(recipe=recipe),
                mem.resident / 2**20,
                peak[name] / 2**20,
                f"{peak[name] / peak['autocast']:.3f}x",
                f"{peak[name] / peak['bf16']:.3f}x",
            ]
        )
        csv_rows.append(
            {
                "table": "whole_step",
                "size": size,
                "configuration": name,
                "recipe": recipe if name == "fp8" else "-",
                "resident_bytes": mem.resident,
                "peak_bytes": mem.peak,
                "peak_no_gemm_scratch_bytes": mem.peak_no_gemm_scratch,
                "peak_vs_autocast": peak[name] / peak["autocast"],
                "peak_vs_bf16": peak[name] / peak["bf16"],
            }
        )
    print(C.markdown_table(headers, table, numeric=[False, True, True, False, False]))
    print()
    print(
        "peak: "
        + ("without CPU GEMM scratch (what a GPU would hold); " if scratch else "")
        + "no per-step FP8 weight cache exists yet (each FP8 linear casts its weight in its forward)"
    )
    print()


def main(argv=None) -> None:
    parser = C.BenchArgumentParser(__doc__)
    parser.add_modes()
    parser.add_argument("--batch", type=int, default=None, help="linear input (BATCH, SEQ, IN); default 4")
    parser.add_argument("--seq", type=int, default=None, help="default 1024")
    parser.add_argument("--in-features", type=int, default=None, help="default 4096")
    parser.add_argument("--out-features", type=int, default=None, help="default 4096")
    parser.add_argument("--no-linear-peak", action="store_true", help="linear table: saved bytes only (fast)")
    parser.add_argument(
        "--size",
        choices=sorted(M.SIZES),
        default=None,
        help="model for the training-step table (default: tiny on CPU, 300m on CUDA; quick with --quick)",
    )
    parser.add_argument("--no-model", action="store_true", help="skip the training-step table")
    parser.add_argument("--model-warmup", type=int, default=2, help="training steps before the measured one")
    parser.add_argument(
        "--whole-step",
        action="store_true",
        help="also the whole-step table: 4 layers, FP8 + recompute=True + FP8-moment AdamW vs bf16",
    )
    args = parser.parse_args(argv)
    quick = args.quick
    batch = args.batch or (2 if quick else 4)
    seq = args.seq or (16 if quick else 1024)
    k = args.in_features or (64 if quick else 4096)
    n = args.out_features or (128 if quick else 4096)
    if min(batch, seq, k, n) < 1 or k % 16 or n % 16:
        parser.error("--batch/--seq must be >= 1; --in-features/--out-features positive multiples of 16")
    if args.model_warmup < 1:
        parser.error("--model-warmup must be >= 1 (the optimizer state is created by the first step)")
    cuda = args.device.type == "cuda"
    size = args.size or ("quick" if quick else ("300m" if cuda else "tiny"))
    if "compiled" in args.modes:
        C.setup_compile()

    env = C.environment(args.device, args.torchao_note)
    C.print_environment(env, "Memory: saved-for-backward bytes and peak memory per training step")
    dtype = torch.bfloat16
    n_linear = 1 + len(RECIPES) + len(args.torchao_recipes)
    n_model = 0 if args.no_model else len(C.variants(args)) * len(args.modes)
    progress = C.Progress(n_linear + n_model, "bench_memory")
    linear = _linear_rows(
        batch,
        seq,
        k,
        n,
        dtype,
        args.torchao,
        args.torchao_recipes,
        peak=not args.no_linear_peak,
        device=args.device,
        progress=progress,
    )
    csv_rows = []
    elements = batch * seq * k
    base = linear[0]
    scratch = args.device.type == "cpu"
    print(
        f"### One linear layer: input ({batch}, {seq}, {k}) bf16, weight ({n}, {k}) bf16 + bias; forward + backward, eager"
    )
    print()
    headers = ["layer", "saved bytes", "bytes / input element", "vs nn.Linear"]
    if not args.no_linear_peak:
        headers += ["peak MiB", "vs nn.Linear"] + (["peak MiB w/o CPU GEMM scratch", "vs nn.Linear"] if scratch else [])
    table = []
    for name, nbytes, mem in linear:
        row = [
            name if name != "nn.Linear" else "bf16 nn.Linear",
            nbytes,
            f"{nbytes / elements:.4f}",
            f"{nbytes / base[1]:.3f}x",
        ]
        csv_row = {"table": "linear", "layer": name, "batch": batch, "seq": seq, "K": k, "N": n, "saved_bytes": nbytes}
        if mem is not None:
            row += [mem.peak / 2**20, f"{mem.peak / base[2].peak:.2f}x"]
            if scratch:
                row += [
                    mem.peak_no_gemm_scratch / 2**20,
                    f"{mem.peak_no_gemm_scratch / base[2].peak_no_gemm_scratch:.2f}x",
                ]
            csv_row.update(
                peak_bytes=mem.peak, peak_no_gemm_scratch_bytes=mem.peak_no_gemm_scratch, resident_bytes=mem.resident
            )
        table.append(row)
        csv_rows.append(csv_row)
    print(C.markdown_table(headers, table, numeric=[False] + [True] * (len(headers) - 1)))
    print()
    if not args.no_model:
        cfg = M.SIZES[size]
        probe = M.build_model(cfg, torch.device("meta"))
        print(
            f"### Training step: Llama-style model {size}, {M.count_parameters(probe) / 1e6:.1f}M parameters "
            f"({cfg.describe()}); AdamW; bf16 parameters; step {args.model_warmup + 1}"
        )
        print()
        rows = _model_rows(args, cfg, progress)
        bases = {r["mode"]: r for r in rows if r["library"] == "bf16"}
        headers = ["configuration", "mode", "saved MiB (forward)", "vs bf16", "resident MiB", "peak MiB", "vs bf16"]
        if scratch:
            headers += ["peak MiB w/o CPU GEMM scratch", "vs bf16"]
        table = []
        for r in rows:
            b = bases[r["mode"]]
            name = "bf16" if r["library"] == "bf16" else f"{r['library']} {r['recipe']}"
            saved = r["saved_bytes"]
            row = [
                name,
                r["mode"],
                saved / 2**20,
                "-" if math.isnan(saved) else f"{saved / b['saved_bytes']:.3f}x",
                r["resident_bytes"] / 2**20,
                r["peak_bytes"] / 2**20,
                f"{r['peak_bytes'] / b['peak_bytes']:.2f}x",
            ]
            if scratch:
                row += [
                    r["peak_no_gemm_scratch_bytes"] / 2**20,
                    f"{r['peak_no_gemm_scratch_bytes'] / b['peak_no_gemm_scratch_bytes']:.2f}x",
                ]
            table.append(row)
            csv_rows.append({"table": "model", "size": size, **r})
        print(C.markdown_table(headers, table, numeric=[False, False] + [True] * (len(headers) - 2)))
        print()
        print(
            "saved: what autograd keeps from forward to backward (eager only: compiled graphs save "
            "inside the compiled function); resident: parameters, buffers, AdamW state and the batch"
        )
    if args.whole_step:
        recipe = args.recipes[0] if args.recipes else "tensorwise"
        _whole_step_table(size, recipe, args.device, args.model_warmup, csv_rows)
    progress.close()
    C.write_csv(args.csv, csv_rows, env)


if __name__ == "__main__":
    main()
