"""Activations in FP8: what a transformer block saves for backward, per recipe, with and
without ``f8tensor.save_activations_in_float8()``, and what the context does to the gradients.

One Llama-style block (``_models.Block``: RMSNorm, grouped-query attention with rotary
positions through ``F.scaled_dot_product_attention``, RMSNorm, SwiGLU MLP; bf16 weights and
activations, no autocast), its linears plain (``bf16``) or converted with each recipe.
Per row:

- *saved*: the bytes one forward leaves alive for backward, read from the storages
  the forward creates (``f8tensor.stats.alive_tensor_bytes``, so the FP8 copies the
  context stores are what is counted; the block's input is made inside the
  measured forward, as a previous layer would make it; parameters are not counted), without
  and with the context (e4m3; ``--block`` elements per scale, default 128; ``--min-numel``,
  default 65,536), and each against the bf16 block without the context.
- *linear input*: what one linear of the block's width saves for its input, alone,
  against ``nn.Linear``'s bf16 input (the recipe's own choice, no context).
- *grad SQNR*: the block's parameter gradients of one step (loss ``mean(out**2)``) with the
  context against the same step without it (same seed: the FP4 recipes' stochastic
  rounding draws the same numbers): all parameters together, and the worst one.
- *step*: median time of forward + backward without and with the context (interleaved
  rounds; on a CPU the FP8 products run in software, so compare the two columns of a row).
- *recompute*: the same with ``recompute=True``: saved bytes, gradient SQNR, and the extra
  compute of one backward: the outputs rebuilt (norms, SiLU/GELU, the SwiGLU product) in
  estimated FLOPs (elements x per-element cost: RMSNorm 4, LayerNorm 7, SiLU 4, GELU 8,
  product 1; a causal or masked attention's output, rebuilt under the context with or
  without recompute=True: 2 x its multiply-adds) and the CPU time spent rebuilding them,
  against the step's time.

    python benchmarks/bench_activations.py                   # CPU: the "tiny" block, 1,024 tokens
    python benchmarks/bench_activations.py --size 100m       # a GPU-sized block (16,384 tokens)
    python benchmarks/bench_activations.py --checkpoint      # also: the block under activation checkpointing

``--checkpoint`` adds a table: the block (bf16 and each recipe) wrapped in
``torch.utils.checkpoint`` (reentrant and not), ``checkpoint_wrapper`` and selective
activation checkpointing (the products' outputs saved, the rest recomputed); the bytes it
keeps for backward without and with ``save_activations_in_float8(recompute=True)``, and
the gradient SQNR of the step with the context against the step without it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
import _models as M
import torch
from torch import nn

from f8tensor import (
    RECIPES,
    Float8Linear,
    Float8LinearConfig,
    convert_to_float8_training,
    save_activations_in_float8,
    sqnr,
)
from f8tensor.nn.activations import DEFAULT_MIN_NUMEL
from f8tensor.nn.activations import _recompute as R
from f8tensor.stats import alive_tensor_bytes

BASELINE = "bf16"


def _block(cfg: M.LlamaConfig, device: torch.device) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    block = M.Block(cfg).to(device=device, dtype=torch.bfloat16)
    for name, p in block.named_parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    cos, sin = M.rotary_tables(cfg.seq, cfg.head_dim)
    return block, cos.to(device), sin.to(device)


def _measure(model: nn.Module, x0: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context) -> int:
    def forward() -> torch.Tensor:
        with context():
            return model(x0 * 1, cos, sin)

    forward().float().pow(2).mean().backward()  # what a first call allocates and keeps is not an activation
    model.zero_grad(set_to_none=True)
    return alive_tensor_bytes(model, forward)[0]


def _grads(
    model: nn.Module, x0: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context
) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(2)  # the same stochastic rounding (FP4 recipes) with and without the context
    with context():
        out = model(x0 * 1, cos, sin)
    out.float().pow(2).mean().backward()
    return {name: p.grad.float().clone() for name, p in model.named_parameters()}


def _linear_input_ratio(recipe: str, k: int, tokens: int, device: torch.device) -> float:
    torch.manual_seed(0)
    ref = nn.Linear(k, k, bias=False, device=device, dtype=torch.bfloat16)
    x0 = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
    ratios = []
    for layer in (ref, Float8Linear.from_float(copy.deepcopy(ref), Float8LinearConfig.from_recipe(recipe))):
        layer(x0 * 1).float().sum().backward()
        ratios.append(alive_tensor_bytes(layer, lambda layer=layer: layer(x0 * 1))[0])
    return ratios[1] / ratios[0]


def _times(model, x0, cos, sin, rounds: int, device: torch.device, context) -> tuple[float, float]:
    def step(chosen) -> None:
        with chosen():
            out = model(x0 * 1, cos, sin)
        out.float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)

    runs: dict[str, list[float]] = {"without": [], "with": []}
    for _ in range(rounds):
        for key, chosen in (("without", contextlib.nullcontext), ("with", context)):
            C.sync(device)
            t0 = time.perf_counter()
            step(chosen)
            C.sync(device)
            runs[key].append(time.perf_counter() - t0)
    return statistics.median(runs["without"]), statistics.median(runs["with"])


# Estimated FLOPs per element of what recompute=True rebuilds in backward.
_FLOPS_PER_ELEMENT = {"RMSNorm": 4, "LayerNorm": 7, "silu": 4, "gelu": 8, "product": 1}


def _flops_per_element(fn) -> int:
    owner = getattr(fn, "__self__", None) or getattr(getattr(fn, "fn", None), "__self__", None)
    if owner is not None:
        return _FLOPS_PER_ELEMENT["LayerNorm" if isinstance(owner, nn.LayerNorm) else "RMSNorm"]
    name = getattr(getattr(fn, "func", fn), "__name__", "")
    return _FLOPS_PER_ELEMENT.get(name, _FLOPS_PER_ELEMENT["product"])


def _attention_flops(recipe, out: torch.Tensor) -> float:
    """Multiply-adds x 2 of a rebuilt attention output: q k^T and P v, half of them causal."""
    key = recipe.inputs[1]
    lk, d = (key.shape if hasattr(key, "shape") else key.tensor.shape)[-2:]
    rows = out.numel() // out.shape[-1]
    return 2.0 * rows * lk * (d + out.shape[-1]) * (0.5 if recipe.fn.keywords.get("is_causal") else 1.0)


@contextlib.contextmanager
def _recompute_cost(totals: dict[str, float]):
    """Adds to ``totals`` the FLOPs (estimated) and seconds of what recompute=True rebuilds."""
    call, build = R._Call.__call__, R.Recomputed.build

    def timed_call(self, x):
        t0 = time.perf_counter()
        out = call(self, x)
        totals["seconds"] += time.perf_counter() - t0
        totals["flops"] += out.numel() * _flops_per_element(self.fn)
        return out

    def timed_build(self, unpack):
        if self.kind == "norm" or self.exact is not None:
            return build(self, unpack)  # a norm's time is counted in its call
        t0 = time.perf_counter()
        out = build(self, unpack)
        totals["seconds"] += time.perf_counter() - t0
        totals["flops"] += (
            _attention_flops(self, out) if self.kind == "attention" else out.numel() * _flops_per_element(self.fn)
        )
        return out

    R._Call.__call__, R.Recomputed.build = timed_call, timed_build
    try:
        yield
    finally:
        R._Call.__call__, R.Recomputed.build = call, build


def _recompute_step(model, x0, cos, sin, rounds: int, device: torch.device, context) -> tuple[float, float]:
    """Median (estimated FLOPs, seconds) that recompute=True rebuilds in one backward."""
    flops, seconds = [], []
    for _ in range(rounds):
        totals = {"flops": 0.0, "seconds": 0.0}
        with context():
            out = model(x0 * 1, cos, sin)
        with _recompute_cost(totals):
            out.float().pow(2).mean().backward()
        C.sync(device)
        model.zero_grad(set_to_none=True)
        flops.append(totals["flops"])
        seconds.append(totals["seconds"])
    return statistics.median(flops), statistics.median(seconds)


CHECKPOINTS = ("reentrant", "non-reentrant", "checkpoint_wrapper", "selective")


def _save_products(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    products = (torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default)
    return CheckpointPolicy.MUST_SAVE if op in products else CheckpointPolicy.PREFER_RECOMPUTE


class _Checkpointed(nn.Module):
    """``block`` run under one of :data:`CHECKPOINTS`."""

    def __init__(self, block: nn.Module, mode: str) -> None:
        super().__init__()
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        self.mode = mode
        self.block = checkpoint_wrapper(block) if mode == "checkpoint_wrapper" else block

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        if self.mode == "checkpoint_wrapper":
            return self.block(x, cos, sin) * 1
        kwargs: dict = {"use_reentrant": self.mode == "reentrant"}
        if self.mode == "selective":
            kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _save_products)
        # "* 1": the next op reads the block's output and lets it go.
        return checkpoint(self.block, x, cos, sin, **kwargs) * 1


def _checkpoint_table(base, variants, x0, cos, sin, context) -> None:
    print("\n### Under activation checkpointing: bytes kept for backward (the block's input, what the policy saves)\n")
    rows = []
    x0 = x0.detach().requires_grad_()
    for name in variants:
        for mode in CHECKPOINTS:
            model = copy.deepcopy(base)
            if name != BASELINE:
                convert_to_float8_training(model, config=Float8LinearConfig.from_recipe(name))
            wrapped = _Checkpointed(model, mode)
            plain = _measure(wrapped, x0, cos, sin, contextlib.nullcontext)
            packed = _measure(wrapped, x0, cos, sin, context)
            ref, got = (_grads(wrapped, x0, cos, sin, c) for c in (contextlib.nullcontext, context))
            db = sqnr(torch.cat([g.flatten() for g in ref.values()]), torch.cat([g.flatten() for g in got.values()]))
            rows.append([name, mode, plain, packed, f"{packed / plain:.3f}x", f"{db:.1f}"])
    headers = ["variant", "checkpointing", "kept", "kept (recompute=True)", "vs without", "grad SQNR (dB)"]
    print(C.markdown_table(headers, rows))


def main(argv=None) -> None:
    parser = C.BenchArgumentParser(__doc__.splitlines()[0], recipes=RECIPES)
    parser.add_argument(
        "--size", choices=list(M.SIZES), help="block shapes (default: tiny on CPU, 100m on CUDA; --quick: quick)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="timed steps per variant and context (interleaved)")
    parser.add_argument("--checkpoint", action="store_true", help="also the block under activation checkpointing")
    parser.add_argument("--block", type=int, help="the context's block (default: 128; --quick: 32)")
    parser.add_argument(
        "--min-numel", type=int, help=f"the context's min_numel (default: {DEFAULT_MIN_NUMEL:,}; --quick: 0)"
    )
    args = parser.parse_args(argv)
    try:
        block = args.block if args.block is not None else (32 if args.quick else 128)
        min_numel = args.min_numel if args.min_numel is not None else (0 if args.quick else DEFAULT_MIN_NUMEL)
        context = functools.partial(save_activations_in_float8, block=block, min_numel=min_numel)
        context()
        recompute = functools.partial(context, recompute=True)
    except ValueError as error:
        parser.error(f"--block / --min-numel: {error}")
    device = args.device
    size = "quick" if args.quick else args.size or ("100m" if device.type == "cuda" else "tiny")
    cfg = M.SIZES[size]
    rounds = 1 if args.quick else args.rounds
    tokens = cfg.batch * cfg.seq
    base, cos, sin = _block(cfg, device)
    torch.manual_seed(1)
    x0 = torch.randn(cfg.batch, cfg.seq, cfg.dim, device=device, dtype=torch.bfloat16)

    env = C.environment(device, args.torchao_note)
    C.print_environment(env, "Activations in FP8: saved bytes and gradient SQNR of one transformer block")
    print(
        f"Block: {size} ({cfg.describe()}), {tokens:,} tokens, bf16 weights and activations, eager; "
        f"context: save_activations_in_float8(block={block}, min_numel={min_numel:,}).\n"
    )
    variants = [BASELINE, *args.recipes]
    progress = C.Progress(len(variants), "bench_activations")
    rows, csv_rows = [], []
    bf16_bytes = None
    for name in variants:
        model = copy.deepcopy(base)
        if name != BASELINE:
            convert_to_float8_training(model, config=Float8LinearConfig.from_recipe(name))
        alone = _measure(model, x0, cos, sin, contextlib.nullcontext)
        packed = _measure(model, x0, cos, sin, context)
        bf16_bytes = alone if name == BASELINE else bf16_bytes
        ref = _grads(model, x0, cos, sin, contextlib.nullcontext)
        got = _grads(model, x0, cos, sin, context)
        total = sqnr(torch.cat([g.flatten() for g in ref.values()]), torch.cat([g.flatten() for g in got.values()]))
        per = {n: sqnr(ref[n], got[n]) for n in ref}
        worst = min(per, key=lambda n: per[n])
        linear = 1.0 if name == BASELINE else _linear_input_ratio(name, cfg.dim, tokens, device)
        t_without, t_with = _times(model, x0, cos, sin, rounds, device, context)
        rebuilt = _measure(model, x0, cos, sin, recompute)
        rebuilt_db = sqnr(
            torch.cat([g.flatten() for g in ref.values()]),
            torch.cat([g.flatten() for g in _grads(model, x0, cos, sin, recompute).values()]),
        )
        _, t_recompute = _times(model, x0, cos, sin, rounds, device, recompute)
        flops, seconds = _recompute_step(model, x0, cos, sin, rounds, device, recompute)
        assert bf16_bytes is not None
        rows.append(
            [
                name,
                alone,
                f"{alone / bf16_bytes:.3f}x",
                packed,
                f"{packed / bf16_bytes:.3f}x",
                f"{linear:.3f}x",
                f"{total:.1f}",
                f"{per[worst]:.1f} ({worst})",
                f"{t_without * 1e3:.1f}",
                f"{t_with * 1e3:.1f}",
                f"{rebuilt / bf16_bytes:.3f}x",
                f"{rebuilt_db:.1f}",
                f"{flops / 1e6:.1f}",
                f"{seconds * 1e3:.1f} / {t_recompute * 1e3:.1f}",
            ]
        )
        csv_rows.append(
            {
                "variant": name,
                "size": size,
                "tokens": tokens,
                "saved_bytes": alone,
                "saved_bytes_context": packed,
                "saved_vs_bf16": alone / bf16_bytes,
                "saved_context_vs_bf16": packed / bf16_bytes,
                "linear_input_vs_bf16": linear,
                "grad_sqnr_db": total,
                "worst_param": worst,
                "worst_param_sqnr_db": per[worst],
                "step_ms": t_without * 1e3,
                "step_context_ms": t_with * 1e3,
                "saved_bytes_recompute": rebuilt,
                "saved_recompute_vs_bf16": rebuilt / bf16_bytes,
                "grad_sqnr_recompute_db": rebuilt_db,
                "recomputed_mflop": flops / 1e6,
                "recompute_ms": seconds * 1e3,
                "step_recompute_ms": t_recompute * 1e3,
            }
        )
        progress.update(name)
    progress.close()
    headers = [
        "variant",
        "saved",
        "vs bf16",
        "saved (context)",
        "vs bf16",
        "linear input vs bf16",
        "grad SQNR (dB)",
        "worst parameter (dB)",
        "step ms",
        "step ms (context)",
        "recompute=True vs bf16",
        "grad SQNR (dB)",
        "recomputed MFLOP",
        "recompute ms / step ms",
    ]
    print(C.markdown_table(headers, rows))
    if args.checkpoint:
        _checkpoint_table(base, variants, x0, cos, sin, recompute)
    C.write_csv(args.csv, csv_rows, env)


if __name__ == "__main__":
    main()
