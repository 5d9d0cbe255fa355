"""What a compiled FP8 block costs dynamo and inductor, per recipe, counted on a CPU.

For a Llama-shaped block (RMSNorm, grouped-query attention through SDPA with rotary
positions, SwiGLU; dim 256, 4 heads, 2 KV heads, FFN 768, x (2, 256, 256) bf16: the
``tiny`` size of ``_models`` at 256 tokens) and each variant (bf16, f8tensor's recipes,
torchao.float8's tensorwise and rowwise where it is installed), in one process:

- **guards**: ``len(torch._dynamo.explain(block)(x, cos, sin).out_guards)``;
- **graph breaks** and **graphs** from the same explain;
- **kernels**: the ``cpp_fused_*`` kernels inductor's CPU back end generates for the
  block's forward and backward (``torch._inductor.utils.run_and_get_code`` over one
  forward + backward, the FX graph and AOTAutograd caches off). A coarse proxy for GPU
  launches: CPU loops fuse more than Triton kernels do.

    python benchmarks/bench_compile_counts.py               # every recipe; a few minutes on 2 cores
    python benchmarks/bench_compile_counts.py --no-kernels  # guards and breaks only (dynamo, seconds)

Prints a Markdown table for BENCHMARKS.md, with ratios to bf16 in the same run.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
import _models as M
import torch
import torch._dynamo

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed", "blockwise", "mxfp8")
TORCHAO_RECIPES = ("tensorwise", "rowwise")
#: The block measured: ``_models``' tiny Llama at 2 x 256 tokens.
BLOCK_CONFIG = M.LlamaConfig(vocab=1024, dim=256, layers=1, heads=4, kv_heads=2, ffn=768, seq=256, batch=2, lr=0.0)
_KERNEL_DEF = re.compile(r"^(cpp_fused_\w+) = async_compile", re.MULTILINE)


def build_block(variant: C.Variant, float8=None) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """The block converted for ``variant`` and its inputs ``(x, cos, sin)``."""
    cfg = BLOCK_CONFIG
    torch.manual_seed(0)
    block = M.Block(cfg).to(torch.bfloat16)
    variant.convert(block, float8)
    x = torch.randn(cfg.batch, cfg.seq, cfg.dim, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = M.rotary_tables(cfg.seq, cfg.head_dim)
    return block, (x, cos, sin)


def dynamo_counts(block: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> dict[str, int]:
    """Guards, graphs and graph breaks of the block's forward, from ``torch._dynamo.explain``."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(block)(*inputs)
    return {"guards": len(explained.out_guards), "graphs": explained.graph_count, "breaks": explained.graph_break_count}


def kernel_count(block: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> int:
    """The distinct ``cpp_fused_*`` kernels inductor generates for one forward + backward."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)

    def step() -> None:
        compiled(*inputs).float().sum().backward()

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        _, codes = run_and_get_code(step)
    return sum(len(set(_KERNEL_DEF.findall(code))) for code in codes)


def measure(variant: C.Variant, float8=None, kernels: bool = True) -> dict[str, int]:
    """Every count of one variant (``kernels`` -1 when not measured)."""
    block, inputs = build_block(variant, float8)
    counts = dynamo_counts(block, inputs)
    counts["kernels"] = kernel_count(block, inputs) if kernels else -1
    return counts


def main(argv=None) -> None:
    parser = C.BenchArgumentParser(__doc__, recipes=RECIPES)
    parser.add_argument("--no-kernels", action="store_true", help="skip inductor (guards and breaks only)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    C.setup_compile()
    env = C.environment(torch.device("cpu"), args.torchao_note)
    C.print_environment(env, "Compiled block: guards, graph breaks and generated kernels (CPU)")
    variants = [C.Variant("bf16", "")] + [C.Variant("f8tensor", r) for r in args.recipes]
    variants += [C.Variant("torchao", r) for r in args.torchao_recipes if r in TORCHAO_RECIPES]
    rows = {}
    for variant in variants:
        rows[variant.name] = measure(variant, args.torchao, kernels=not args.no_kernels)
    base = rows["bf16"]
    print(f"### CPU: Llama-shaped block ({BLOCK_CONFIG.describe()}), bf16, forward + backward")
    print()
    table = []
    for name, r in rows.items():
        kernels = "-" if r["kernels"] < 0 else r["kernels"]
        table.append([name, r["guards"], f"{r['guards'] / base['guards']:.2f}x", r["graphs"], r["breaks"], kernels])
    print(
        C.markdown_table(
            ["variant", "guards", "vs bf16", "graphs", "graph breaks", "CPU kernels"],
            table,
            numeric=[False, True, True, True, True, True],
        )
    )


if __name__ == "__main__":
    main()
