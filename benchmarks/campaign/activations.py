"""Second plan: ``f8tensor.save_activations_in_float8`` on the device. One Llama-style
block (``bench_activations``'s, the ``100m`` shapes: 16,384 tokens) in bf16 and tensorwise:
the bytes one forward leaves for backward without and with the context, the step time
without and with it, and the kernels the context adds per tensor it packs (its target: at
most 2, the pack's cast and the unpack's dequantization)."""

from __future__ import annotations

import contextlib

from .runner import Ctx

#: Kernels the context may add per packed tensor (one cast to pack, one to restore).
KERNELS_PER_TENSOR = 2.0


def activation_casts(ctx: Ctx) -> None:
    import copy
    import statistics

    import _common as C
    import _models as M
    import bench_activations as B
    import bench_eager_overhead as E
    import torch

    from f8tensor import Float8LinearConfig, convert_to_float8_training, save_activations_in_float8
    from f8tensor.quant.block_quantizers import BlockQuantizer

    size = ctx.pick("100m", "quick")
    cfg = M.SIZES[size]
    base, cos, sin = B._block(cfg, ctx.device)
    torch.manual_seed(1)
    x0 = torch.randn(cfg.batch, cfg.seq, cfg.dim, device=ctx.device, dtype=torch.bfloat16)
    shape = f"{size} block, {cfg.batch * cfg.seq} tokens"
    rounds = ctx.pick(5, 1)
    context = save_activations_in_float8 if not ctx.dry else (lambda: save_activations_in_float8(min_numel=0, block=32))
    for recipe in ("bf16", "tensorwise"):
        model = copy.deepcopy(base)
        if recipe != "bf16":
            convert_to_float8_training(model, config=Float8LinearConfig.from_recipe(recipe))
        without = B._measure(model, x0, cos, sin, contextlib.nullcontext)
        packed_bytes = B._measure(model, x0, cos, sin, context)
        ctx.row(
            kind="measure",
            recipe=recipe,
            shape=shape,
            metric="saved bytes, context vs none",
            value=packed_bytes / without,
            unit="x",
            detail=f"{without:,} -> {packed_bytes:,} bytes",
        )

        def step(chosen, model=model) -> None:
            with chosen():
                out = model(x0 * 1, cos, sin)
            out.float().pow(2).mean().backward()
            model.zero_grad(set_to_none=True)

        casts = []
        real_cast = BlockQuantizer.quantize  # the context packs each tensor through its block quantizer

        def counting_cast(*args, casts=casts, real_cast=real_cast, **kwargs):
            casts.append(1)
            return real_cast(*args, **kwargs)

        kernels_without = E.count_leaf_kernels(lambda: step(contextlib.nullcontext), ctx.device)[1]
        BlockQuantizer.quantize = counting_cast  # type: ignore[method-assign]
        try:
            kernels_with = E.count_leaf_kernels(lambda: step(context), ctx.device)[1]
        finally:
            BlockQuantizer.quantize = real_cast  # type: ignore[method-assign]
        per = (kernels_with - kernels_without) / max(len(casts), 1)
        # The target is CUDA's (fused kernels); a CPU counts the reference cast's ops: info only.
        status = ("passed" if per <= KERNELS_PER_TENSOR else "failed") if ctx.device.type == "cuda" else "info"
        ctx.row(
            kind="check",
            recipe=recipe,
            shape=shape,
            metric="kernels added per packed tensor",
            value=per,
            target=f"<= {KERNELS_PER_TENSOR:g}",
            status=status,
            detail=f"{kernels_without} -> {kernels_with} {'CUDA' if ctx.device.type == 'cuda' else 'CPU'} "
            f"kernels per step, {len(casts)} tensors packed",
        )
        times = {"none": [], "context": []}
        for _ in range(rounds):
            for key, chosen in (("none", contextlib.nullcontext), ("context", context)):
                times[key] += C.time_steps(lambda chosen=chosen: step(chosen), 2, ctx.device)
        t_none, t_ctx = statistics.median(times["none"]), statistics.median(times["context"])
        ctx.row(
            kind="measure",
            recipe=recipe,
            shape=shape,
            metric="step ms, context vs none",
            value=t_ctx / t_none,
            unit="x",
            detail=f"{t_none:.2f} -> {t_ctx:.2f} ms" + (" (CPU)" if ctx.device.type != "cuda" else ""),
        )


def recompute_step(ctx: Ctx) -> None:
    """The Llama-3-8B-shaped model (``llama8b-4``; dry: ``quick``), tensorwise, eager: step time
    and peak memory of ``save_activations_in_float8(recompute=True)`` against the plain FP8 step,
    interleaved (the memory issue's GPU figure)."""
    import _common as C
    import _models as M
    import torch

    from f8tensor import save_activations_in_float8

    size = ctx.pick("llama8b-4", "quick")
    cfg = M.SIZES[size]
    batches = M.synthetic_batches(cfg, 2, ctx.device)
    model = M.build_model(cfg, ctx.device)
    C.f8tensor_convert(model, "tensorwise", module_filter_fn=M.fp8_filter)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    state = {"i": 0}
    kwargs = {} if not ctx.dry else {"min_numel": 0, "block": 32}

    def step(context) -> None:
        b = batches[state["i"] % len(batches)]
        state["i"] += 1
        with context():
            loss = model(b[:, :-1], b[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    variants = {
        "tensorwise": lambda: step(contextlib.nullcontext),
        "tensorwise recompute": lambda: step(lambda: save_activations_in_float8(recompute=True, **kwargs)),
    }
    for fn in variants.values():  # warm-up: the optimizer's states exist before any peak is read
        fn()
    C.sync(ctx.device)
    rounds, per_round = ctx.pick((3, 2), (1, 1))
    timings = C.interleaved(variants, rounds, per_round, ctx.device)
    base = timings["tensorwise"].median
    resident = sum(t.numel() * t.element_size() for t in C.state_tensors(model, opt))
    peaks = {name: C.measure_peak(fn, resident, ctx.device).peak / 2**20 for name, fn in variants.items()}
    for name, t in timings.items():
        ratio = t.median / base
        ctx.row(recipe=name, mode="eager", shape=size, metric="step_ms", value=t.median, unit="ms", ratio=ratio)
        ctx.row(
            recipe=name,
            mode="eager",
            shape=size,
            metric="peak_mib",
            value=peaks[name],
            unit="MiB",
            ratio=peaks[name] / peaks["tensorwise"],
            detail="ratios against the plain tensorwise step",
        )
