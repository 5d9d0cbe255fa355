"""CPU overhead and saved-activation bytes of one MoE layer in FP8, per recipe and experts path, vs bf16.

    python benchmarks/bench_moe.py                    # CPU, a few minutes
    python benchmarks/bench_moe.py --quick            # smoke run, seconds

The layer is transformers' Qwen3-MoE sparse block (router + experts, bf16), run through
each experts implementation transformers offers on CPU: ``grouped_mm``
(``torch._grouped_mm`` with token offsets), ``batched_mm`` (``torch.bmm`` over gathered
expert weights) and ``eager`` (a Python loop over experts). f8tensor converts the 3D
expert weights (``convert_experts_to_float8``); the router stays bf16.

Per row: the median time of one forward + backward step (ms), its ratio to bf16, and the
bytes autograd saves for backward in the forward (``f8tensor.stats.saved_tensor_bytes``:
activations, not weights). On CPU the FP8 grouped kernel is emulated (fp32 products of
the FP8 values), so times show the FP8 path's overhead, never a GPU speed-up. torchao is
not compared: torchao.float8's converter does not take 3D expert weights.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C

from f8tensor import Float8LinearConfig, convert_experts_to_float8
from f8tensor.stats import saved_tensor_bytes

MOE_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # delayed scaling: not for experts
IMPLS = ("grouped_mm", "batched_mm", "eager")


def _block(hidden: int, inter: int, experts: int, top_k: int, impl: str, recipe: str | None, device):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts, num_experts_per_tok=top_k
    )
    config._experts_implementation = impl
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    block = block.to(device=device, dtype=torch.bfloat16)
    if recipe is not None:
        convert_experts_to_float8(block, Float8LinearConfig.from_recipe(recipe))
    return block


def main(argv=None) -> None:
    parser = C.BenchArgumentParser(__doc__)
    parser.add_argument(
        "--impls", default=",".join(IMPLS), help=f"experts implementations (default: {','.join(IMPLS)})"
    )
    parser.add_argument("--shape", default=None, help="TOKENSxHIDDENxINTERxEXPERTSxTOPK (default 256x256x128x8x2)")
    args = parser.parse_args(argv)
    impls = C.parse_list(args.impls, IMPLS, "--impls", parser)
    recipes = [r for r in args.recipes if r in MOE_RECIPES]
    shape = args.shape or ("32x32x32x4x2" if args.quick else "256x256x128x8x2")
    try:
        tokens, hidden, inter, experts, top_k = (int(v) for v in shape.split("x"))
    except ValueError:
        parser.error(f"--shape: expected TOKENSxHIDDENxINTERxEXPERTSxTOPK, e.g. 256x256x128x8x2; got {shape!r}")
    rounds, per_round = (2, 2) if args.quick else (3, 3)
    device = args.device
    not_compared = "not compared (torchao.float8 does not convert 3D expert weights)"
    env = C.environment(device, f"{args.torchao_note}; {not_compared}" if args.torchao_note else not_compared)
    C.print_environment(env, "MoE layer: FP8 experts vs bf16 (Qwen3-MoE sparse block, forward + backward)")

    x = torch.randn(1, tokens, hidden, device=device, dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    steps, saved = {}, {}
    for impl in impls:
        for recipe in [None, *recipes]:
            block = _block(hidden, inter, experts, top_k, impl, recipe, device)
            inp = x.clone().requires_grad_()

            def step(block=block, inp=inp):
                out = block(inp)
                out = out[0] if isinstance(out, tuple) else out
                out.backward(grad)

            step()  # warm-up
            key = (impl, recipe or "bf16")
            steps[key] = step
            saved[key], _ = saved_tensor_bytes(block, lambda block=block, inp=inp: block(inp))
    progress = C.Progress(len(steps) * rounds, "bench_moe")
    timings = C.interleaved(steps, rounds, per_round, device, progress)
    progress.close()

    rows, csv_rows = [], []
    for (impl, recipe), timing in timings.items():
        base = timings[impl, "bf16"].median
        ms = timing.median
        rows.append([impl, recipe, ms, base / ms, saved[impl, recipe], saved[impl, recipe] / saved[impl, "bf16"]])
        csv_rows.append(
            {
                "impl": impl,
                "recipe": recipe,
                "tokens": tokens,
                "hidden": hidden,
                "inter": inter,
                "experts": experts,
                "top_k": top_k,
                "ms": ms,
                "speedup_vs_bf16": base / ms,
                "spread": timing.spread,
                "saved_bytes": saved[impl, recipe],
                "saved_vs_bf16": saved[impl, recipe] / saved[impl, "bf16"],
            }
        )
    print(
        f"tokens {tokens}, hidden {hidden}, expert intermediate {inter}, {experts} experts, top-{top_k}; "
        f"median of {rounds} interleaved rounds x {per_round} steps"
    )
    print()
    print(
        C.markdown_table(
            ["experts path", "recipe", "ms / step", "speed-up vs bf16", "saved bytes", "saved vs bf16"], rows
        )
    )
    C.write_csv(args.csv, csv_rows, env)


if __name__ == "__main__":
    main()
