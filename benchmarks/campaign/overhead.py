"""Item 3: kernels launched and host time per eager training step of a tiny linear
(``Linear(K -> K)`` on 16 tokens), per recipe, against bf16 and torchao.float8.
The step and the counting are ``bench_eager_overhead``'s."""

from __future__ import annotations

from .runner import Ctx, failure_status


def eager_overhead(ctx: Ctx) -> None:
    import _common as C
    import bench_eager_overhead as B

    float8, _ = C.load_torchao()
    variants = [("bf16", "bf16", 64), ("bf16", "bf16", 128)]
    variants += [("f8tensor", r, 128 if r in B.WIDE else 64) for r in B.RECIPES]
    variants += [("torchao", r, 64) for r in (C.TORCHAO_RECIPES if float8 is not None else ())]
    steps, kernels = {}, {}
    for library, recipe, k in variants:
        key = (f"torchao {recipe}" if library == "torchao" else recipe, k)
        try:
            step = B.make_step(B.build(library, recipe, k, ctx.device, float8), k, ctx.device)
            step()
            step()  # first-call work (lazy init, caches) is not what a step costs
            kernels[key] = B.count_leaf_kernels(step, ctx.device)[1]
            steps[key] = step
        except Exception as e:  # noqa: BLE001  (one recipe failing does not hide the others)
            ctx.row(
                recipe=key[0],
                mode="eager",
                shape=f"{B.TOKENS}x{k}x{k}",
                metric="host_us",
                unit="us",
                status=failure_status(e)[:300],
            )
    rounds, per_round = ctx.pick((5, 20), (1, 2))
    timings = C.interleaved(steps, rounds, per_round, ctx.device)
    for (name, k), t in timings.items():
        base = timings[("bf16", k)].median
        shape = f"{B.TOKENS}x{k}x{k}"
        ctx.row(
            recipe=name,
            mode="eager",
            shape=shape,
            metric="host_us",
            value=1e3 * t.median,
            unit="us",
            ratio=base / t.median,
        )
        ctx.row(
            recipe=name,
            mode="eager",
            shape=shape,
            metric="kernels",
            value=float(kernels[name, k]),
            unit="CUDA kernels" if ctx.device.type == "cuda" else "CPU kernels",
            ratio=kernels[name, k] / max(kernels["bf16", k], 1),
        )
