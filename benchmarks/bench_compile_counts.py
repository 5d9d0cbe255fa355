"""What a compiled FP8 block costs dynamo and inductor, per recipe, counted on a CPU.

Three workloads: a Llama-shaped block (RMSNorm, grouped-query attention through SDPA with
rotary positions, SwiGLU; dim 256, 4 heads, 2 KV heads, FFN 768, x (2, 256, 256) bf16: the
``tiny`` size of ``_models`` at 256 tokens), the 300m's block (dim 1024 at 2 x 128 tokens)
and the MoE grouped GEMM step (4 experts, 512 tokens, 256 -> 512). Each variant (bf16,
f8tensor's recipes, ``tensorwise+step_casts`` and ``delayed+step_casts``, the weights cast once
per optimizer step outside the block (``f8tensor.per_step_weight_casts``), torchao.float8's
tensorwise and rowwise where it has a CPU path; "n/a" and the reason where not), in one process:

- **guards**: ``len(torch._dynamo.explain(block)(x, cos, sin).out_guards)``;
- **graph breaks** and **graphs** from the same explain;
- **kernels**: the ``cpp_fused_*`` kernels inductor's CPU back end generates for the
  block's forward and backward (``torch._inductor.utils.run_and_get_code`` over one
  forward + backward, the FX graph and AOTAutograd caches off). A coarse proxy for GPU
  launches: CPU loops fuse more than Triton kernels do.
- **bytes outside GEMMs**: what the generated kernels read and write, counted as
  ``bench_cast_traffic`` counts them (each pass reads and writes each buffer it touches
  once), against bf16's, and against the **floor** (:data:`FLOOR_PER_ELEMENT`): the bytes the
  unique FP8 operands must move at least. With ``--scalar-codegen`` kernels and bytes are read
  from code generated with vectorization off (``cpp.simdlen=1``): the vectorized C++ splits a
  row's amax from its cast by loop step alone, which is no fusion decision and which the
  floor's rowwise rule (a row reduced, then cast, in one loop) does not count; this reading
  is ``bench_cast_traffic --scalar-codegen``'s, the closer one to a GPU back end's fusion.

The CUDA path (fake CUDA tensors, an sm90 capability) is traced by :func:`cuda_trace`
(``tests/nn/test_compile_cuda_path.py``): graph breaks, graphs and host reads there.

    python benchmarks/bench_compile_counts.py               # every workload; ~10 minutes on 2 cores
    python benchmarks/bench_compile_counts.py --no-kernels  # guards and breaks only (dynamo, seconds)
    python benchmarks/bench_compile_counts.py --scalar-codegen  # kernels and bytes, vectorization off

Prints a Markdown table for BENCHMARKS.md, with ratios to bf16 in the same run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
import _models as M
import torch
import torch._dynamo
import torch._dynamo.testing

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed", "blockwise", "mxfp8")
TORCHAO_RECIPES = ("tensorwise", "rowwise")
#: The block measured: ``_models``' tiny Llama at 2 x 256 tokens.
BLOCK_CONFIG = M.LlamaConfig(vocab=1024, dim=256, layers=1, heads=4, kv_heads=2, ffn=768, seq=256, batch=2, lr=0.0)
#: The 300m's block (``_models`` size ``300m``: dim 1024, 16 heads / 8 KV, SwiGLU 2816) at 2 x 128 tokens.
BLOCK_300M = dataclasses.replace(M.SIZES["300m"], layers=1, seq=128, batch=2)
#: The MoE grouped step: (experts, tokens, K, N), tokens split evenly.
MOE_SHAPE = (4, 512, 256, 512)
WORKLOADS = ("llama", "300m", "moe")
_KERNEL_DEF = re.compile(r"^(cpp_fused_\w+) = async_compile", re.MULTILINE)
#: Where torchao has no CPU path: the reason printed for its row.
TORCHAO_NA = {"moe": "torchao's FP8 grouped GEMM (prototype.moe_training) needs CUDA"}
#: Where an f8tensor recipe has no such workload: the reason printed for its row.
F8TENSOR_NA = {("moe", "delayed"): "delayed scaling is not supported for expert GEMMs (experts stay bf16)"}


def build_block(variant: C.Variant, float8=None, cfg: M.LlamaConfig = BLOCK_CONFIG):
    """The block converted for ``variant`` and its inputs ``(x, cos, sin)``."""
    torch.manual_seed(0)
    block = M.Block(cfg).to(torch.bfloat16)
    variant.convert(block, float8)
    x = torch.randn(cfg.batch, cfg.seq, cfg.dim, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = M.rotary_tables(cfg.seq, cfg.head_dim)
    return block, (x, cos, sin)


class GroupedStep(torch.nn.Module):
    """The MoE experts' grouped GEMM ``x @ w[e].T`` per expert: bf16 ``torch._grouped_mm`` or
    ``float8_grouped_mm`` under a recipe."""

    def __init__(self, recipe: str | None) -> None:
        super().__init__()
        from f8tensor import Float8LinearConfig

        experts, tokens, k, n = MOE_SHAPE
        self.weight = torch.nn.Parameter(torch.randn(experts, n, k, dtype=torch.bfloat16) * k**-0.5)
        self.register_buffer("offs", torch.arange(1, experts + 1, dtype=torch.int32) * (tokens // experts))
        self.config = None if recipe is None else Float8LinearConfig.from_recipe(recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from f8tensor import float8_grouped_mm

        if self.config is None:
            return torch._grouped_mm(x, self.weight.transpose(-2, -1), offs=self.offs)
        return float8_grouped_mm(x, self.weight.transpose(-2, -1), self.offs, self.config)


#: A recipe name's suffix: its weights cast once per step (``f8tensor.per_step_weight_casts``).
STEP_CASTS = "+step_casts"


def build(workload: str, variant: C.Variant, float8=None):
    """``(module, inputs)`` of ``workload`` converted for ``variant``."""
    if variant.recipe.endswith(STEP_CASTS):
        import f8tensor

        module, inputs = build(workload, dataclasses.replace(variant, recipe=variant.recipe[: -len(STEP_CASTS)]))
        f8tensor.per_step_weight_casts(module)  # the per-step pass itself runs outside the block
        return module, inputs
    if workload == "llama":
        return build_block(variant, float8)
    if workload == "300m":
        return build_block(variant, float8, BLOCK_300M)
    if variant.library == "torchao":
        raise NotImplementedError(TORCHAO_NA["moe"])
    if (workload, variant.recipe) in F8TENSOR_NA:
        raise NotImplementedError(F8TENSOR_NA[workload, variant.recipe])
    torch.manual_seed(0)
    step = GroupedStep(None if variant.library == "bf16" else variant.recipe)
    x = torch.randn(MOE_SHAPE[1], MOE_SHAPE[2], dtype=torch.bfloat16, requires_grad=True)
    return step, (x,)


def linear_operands(workload: str) -> tuple[list[int], list[int], list[int]]:
    """Element counts of the FP8 operands: unique inputs, weights, output gradients (one per product)."""
    if workload == "moe":
        experts, tokens, k, n = MOE_SHAPE
        return [tokens * k], [experts * n * k], [tokens * n]
    cfg = BLOCK_CONFIG if workload == "llama" else BLOCK_300M
    t, d, kv, f = cfg.batch * cfg.seq, cfg.dim, cfg.kv_heads * cfg.head_dim, cfg.ffn
    # (in, out) of wq, wk, wv (one input), wo, w1, w3 (one input), w2.
    shapes = [(d, d), (d, kv), (d, kv), (d, d), (d, f), (d, f), (f, d)]
    inputs = [t * d, t * d, t * d, t * f]  # attention's x, wo's, the MLP's x, w2's
    return inputs, [i * o for i, o in shapes], [t * o for _, o in shapes]


#: Bytes per element of the floor, per recipe: (per unique input, per weight, per output
#: gradient). Each is the reads-per-cast rule (h = 2 bytes per high-precision read) plus one
#: byte per FP8 layout consumed, as ``bench_cast_traffic`` argues for one linear: tensorwise
#: reads twice (amax, then cast) and writes two layouts; delayed reads once; rowwise reads
#: once more for the column amax of the weight-gradient operands; with the weight gradient in
#: high precision only the row layout is cast; the weight is cast in forward and again in
#: backward. Blockwise and MX: a block's amax and cast share one pass, and both layouts of a
#: tile come from that pass: input and gradient 2 + 2, weight twice 2 + 1.
FLOOR_PER_ELEMENT = {
    "tensorwise": (6, 8, 6),
    "delayed": (4, 6, 4),
    "rowwise": (6, 8, 6),
    "rowwise_with_gw_hp": (3, 8, 3),
    "blockwise": (4, 6, 4),
    "mxfp8": (4, 6, 4),
}


def floor_bytes(workload: str, recipe: str) -> int:
    """The least bytes outside the GEMMs FP8 adds to ``workload`` under ``recipe``
    (:data:`FLOOR_PER_ELEMENT` over its unique FP8 operands; weights cast once per step: the
    recipe's floor, as if cast in the block)."""
    x, w, g = FLOOR_PER_ELEMENT[recipe.removesuffix(STEP_CASTS)]
    inputs, weights, grads = linear_operands(workload)
    return x * sum(inputs) + w * sum(weights) + g * sum(grads)


def dynamo_counts(block: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> dict[str, int]:
    """Guards, graphs and graph breaks of the block's forward, from ``torch._dynamo.explain``."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(block)(*inputs)
    return {"guards": len(explained.out_guards), "graphs": explained.graph_count, "breaks": explained.graph_break_count}


def compiled_codes(block: torch.nn.Module, inputs: tuple[torch.Tensor, ...], scalar: bool = False) -> list[str]:
    """Inductor's output code for one compiled forward + backward (FX and AOTAutograd caches off;
    ``scalar``: vectorization off, ``bench_cast_traffic --scalar-codegen``'s reading)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    _fallbacks_as_after_first_graph()
    torch._dynamo.reset()
    compiled = torch.compile(block)  # a graph break shows in the counts, not as an error
    torch.manual_seed(1)
    grad = torch.randn_like(block(*inputs))

    def step() -> None:
        compiled(*inputs).backward(grad)

    simd = {"cpp.simdlen": 1} if scalar else {}
    with inductor_config.patch(fx_graph_cache=False, **simd), functorch_config.patch(enable_autograd_cache=False):
        _, codes = run_and_get_code(step)
    return codes


def _fallbacks_as_after_first_graph() -> None:
    """Mark f8tensor's ops as inductor marks an op without a lowering once a graph used it.

    Inductor makes such an op's fallback on first meeting it, and only then realizes a
    buffer read by several of them once (q/k/v's shared FP8 input): a process's first graph
    would write it per reader, later ones once. Marked up front, the counts do not depend on
    what the process compiled before.
    """
    from torch._inductor import lowering

    lowering.add_needs_realized_inputs([getattr(torch.ops.f8tensor, name) for name in torch.ops.f8tensor])


def kernel_count(block: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> int:
    """The distinct ``cpp_fused_*`` kernels inductor generates for one forward + backward."""
    return _kernels(compiled_codes(block, inputs))


def _kernels(codes: list[str]) -> int:
    return sum(len(set(_KERNEL_DEF.findall(code))) for code in codes)


def outside_gemm_bytes(codes: list[str]) -> int:
    """Bytes read and written outside the GEMMs, ``bench_cast_traffic``'s reading of the code."""
    import bench_cast_traffic as T

    graphs = [T.parse_graph_code(code, 1) for code in codes]
    return sum(g.read_bytes + g.written_bytes for g in graphs)


def measure(
    variant: C.Variant, float8=None, kernels: bool = True, workload: str = "llama", scalar: bool = False
) -> dict[str, int]:
    """Every count of one variant on ``workload`` (``kernels`` and ``bytes`` -1 when not measured;
    ``scalar``: the generated code read with vectorization off)."""
    block, inputs = build(workload, variant, float8)
    counts = dynamo_counts(block, inputs)
    counts["kernels"] = counts["bytes"] = -1
    if kernels:
        codes = compiled_codes(block, inputs, scalar)
        counts["kernels"], counts["bytes"] = _kernels(codes), outside_gemm_bytes(codes)
    return counts


# ------------------------------------------------------------ the CUDA path, traced on a CPU
#
# A CPU build of torch runs dynamo over fake CUDA tensors (FakeTensorMode: metadata only)
# given two stand-ins, each for a piece of torch a CPU build lacks, none for f8tensor:
# - a no-op CUDA device guard (a small C++ library, built once): torch's Python bindings and
#   autograd take a device guard per CUDA tensor, and a CPU build registers none ("PyTorch is
#   not linked with support for cuda devices"). Torch installs the same no-op guard itself
#   when a CUDA build has no device (``ensureCUDADeviceGuardSet``);
# - the capability query and ``torch.version.cuda`` (no driver): the GPU asked for.
# Autograd is on, so dynamo traces every autograd Function's backward too; nothing runs.
#: GPU per recipe for the fake CUDA trace: sm90 (H100) by default, MX needs sm100.
FAKE_GPU = {"mxfp8": (10, 0)}
#: The blockwise kernels' minimum CUDA.
FAKE_CUDA_VERSION = "12.9"
_NO_OP_CUDA_GUARD = """
#include <c10/core/impl/DeviceGuardImplInterface.h>
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA>);
"""


def _register_cuda_guard() -> None:
    """Give a CPU build a no-op CUDA device guard (once per process; a CUDA build keeps its own)."""
    if torch.version.cuda is not None or getattr(_register_cuda_guard, "done", False):
        return
    from torch.utils.cpp_extension import load_inline

    load_inline("f8tensor_no_op_cuda_guard", cpp_sources=[_NO_OP_CUDA_GUARD], is_python_module=False)
    _register_cuda_guard.done = True  # type: ignore[attr-defined]


@contextlib.contextmanager
def fake_cuda(capability: tuple[int, int]):
    """A fake tensor mode whose ``device="cuda"`` tensors trace the CUDA path of a ``capability`` GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _register_cuda_guard()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch("torch.cuda.get_device_capability", lambda device=None: capability))
        stack.enter_context(mock.patch("torch.version.cuda", FAKE_CUDA_VERSION))
        yield mode


def _to_fake_cuda(module: torch.nn.Module, mode) -> None:
    """Every parameter and buffer of ``module`` replaced by a fake CUDA tensor alike."""
    with mode:
        for mod in module.modules():
            for name, p in list(mod.named_parameters(recurse=False)):
                fake = torch.empty(p.shape, dtype=p.dtype, device="cuda")
                setattr(mod, name, torch.nn.Parameter(fake, requires_grad=p.requires_grad))
            for name, b in list(mod.named_buffers(recurse=False)):
                mod._buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device="cuda")


#: The FP8 kernels a traced graph may call (dense, block-scaled, grouped).
_FP8_KERNELS = frozenset({"_scaled_mm", "_scaled_mm_v2", "_scaled_grouped_mm", "scaled_mm", "scaled_grouped_mm"})
#: Calls that read a device value on the host: a step with one cannot be captured in a CUDA
#: graph and stalls the host each step.
HOST_READS = frozenset({"item", "tolist", "_local_scalar_dense", "nonzero", "is_nonzero", "cpu", "numpy", "equal"})


def _on_device(arg) -> bool:
    """Whether an FX argument is a tensor on the (fake) GPU (dynamo's own host scalars are not)."""
    value = arg.meta.get("example_value") if isinstance(arg, torch.fx.Node) else None
    return isinstance(value, torch.Tensor) and value.device.type == "cuda"


def _graph_calls(gm: torch.fx.GraphModule) -> dict[str, int]:
    """FP8 kernel calls, host reads and host tensors in ``gm`` and its subgraphs (autograd
    Functions' forward and backward)."""
    found = {"fp8_kernels": 0, "host_reads": 0, "host_tensors": 0}
    for sub in gm.modules():
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        for node in sub.graph.nodes:
            name = getattr(node.target, "__name__", node.target) if node.op != "call_method" else node.target
            name = name.removesuffix(".default") if isinstance(name, str) else name  # an aten overload
            found["fp8_kernels"] += name in _FP8_KERNELS
            found["host_reads"] += name in HOST_READS and _on_device(node.args[0] if node.args else None)
            value = node.meta.get("example_value")
            found["host_tensors"] += isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dim() > 0
    return found


def cuda_trace(variant: C.Variant, tokens=(128, 96, 160), float8=None, workload: str = "llama") -> dict[str, int]:
    """What dynamo traces of the block's CUDA path: graphs, graph breaks, FP8 kernel calls,
    host reads and host tensors (the last three summed over the graphs, forward and backward),
    and guards (``torch._dynamo.explain``'s, at ``tokens[0]``, as :func:`dynamo_counts`).

    The block runs at each of ``tokens`` (``dynamic=True``: a recompile counts a graph) over
    fake CUDA tensors, scalar outputs not captured (an ``.item()`` breaks the graph).
    ``workload="moe"``: the MoE grouped step instead, ``tokens`` its rows (split evenly
    over the experts).
    """
    from torch._dynamo.utils import counters
    from torch._subclasses.fake_tensor import DataDependentOutputException

    cfg = BLOCK_CONFIG
    torch.manual_seed(0)
    if workload == "moe":
        block = GroupedStep(None if variant.library == "bf16" else variant.recipe)
    else:
        block = M.Block(cfg).to(torch.bfloat16)
        variant.convert(block, float8)

    def inputs(n: int) -> tuple[torch.Tensor, ...]:
        if workload == "moe":
            experts = MOE_SHAPE[0]
            block.offs = torch.arange(1, experts + 1, dtype=torch.int32, device="cuda") * (n // experts)
            return (torch.empty(n, MOE_SHAPE[2], dtype=torch.bfloat16, device="cuda", requires_grad=True),)
        x = torch.empty(cfg.batch, n, cfg.dim, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        return (x, *(torch.empty(n, cfg.head_dim // 2, device="cuda") for _ in range(2)))

    graphs: list[dict[str, int]] = []
    guards = -1

    def backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(_graph_calls(gm))
        return gm.forward

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(block, backend=backend, dynamic=True)
    no_scalars = torch._dynamo.config.patch(capture_scalar_outputs=False)
    with no_scalars, fake_cuda(FAKE_GPU.get(variant.recipe, (9, 0))) as mode:
        _to_fake_cuda(block, mode)
        read_back = 0
        try:
            with mode:
                for n in tokens:
                    args = inputs(n)
                    if guards < 0:
                        guards = len(torch._dynamo.explain(block)(*args).out_guards)
                        torch._dynamo.reset()
                        counters.clear()
                    compiled(*args)
        except DataDependentOutputException:
            read_back = 1  # eager code between graphs read a device value (fake tensors have none)
    found = {"graphs": len(graphs), "breaks": sum(counters["graph_break"].values()), "guards": guards}
    for key in ("fp8_kernels", "host_reads", "host_tensors"):
        found[key] = sum(g[key] for g in graphs)
    found["host_reads"] += read_back
    return found


def _row(name: str, r: dict, base: dict, floor: int | None) -> list:
    """One table row; ``floor`` None for bf16."""
    mib = 2**20
    kernels = "-" if r["kernels"] < 0 else r["kernels"]
    if r["bytes"] < 0:
        nbytes = over = floor_text = ratio = "-"
    else:
        extra = r["bytes"] - base["bytes"]
        nbytes, over = f"{r['bytes'] / mib:.1f}", f"{extra / mib:+.1f}"
        floor_text = "-" if floor is None else f"{floor / mib:.1f}"
        ratio = "-" if floor is None else f"{extra / floor:.2f}"
    guards = f"{r['guards'] / base['guards']:.2f}x"
    return [name, r["guards"], guards, r["graphs"], r["breaks"], kernels, nbytes, over, floor_text, ratio]


def main(argv=None) -> None:
    parser = C.BenchArgumentParser(__doc__, recipes=RECIPES)
    parser.add_argument("--no-kernels", action="store_true", help="skip inductor (guards and breaks only)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {WORKLOADS}")
    parser.add_argument(
        "--scalar-codegen", action="store_true", help="kernels and bytes with inductor's C++ vectorization off"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    C.setup_compile()
    env = C.environment(torch.device("cpu"), args.torchao_note)
    C.print_environment(env, "Compiled block: guards, graph breaks, generated kernels, bytes outside GEMMs (CPU)")
    variants = [C.Variant("bf16", "")] + [C.Variant("f8tensor", r) for r in args.recipes]
    variants += [C.Variant("f8tensor", r + STEP_CASTS) for r in ("tensorwise", "delayed") if r in args.recipes]
    variants += [C.Variant("torchao", r) for r in args.torchao_recipes if r in TORCHAO_RECIPES]
    titles = {
        "llama": f"Llama-shaped block ({BLOCK_CONFIG.describe()})",
        "300m": f"the 300m's block ({BLOCK_300M.describe()})",
        "moe": "MoE grouped GEMM step ({} experts, {} tokens, K {}, N {})".format(*MOE_SHAPE),
    }
    for workload in args.workloads.split(","):
        rows, missing = {}, {}
        for variant in variants:
            try:
                rows[variant.name] = measure(variant, args.torchao, not args.no_kernels, workload, args.scalar_codegen)
            except Exception as e:  # noqa: BLE001  (one variant failing is said in its row)
                # "n/a": no such path (torchao's on a CPU, a recipe's); anything else is a failure of ours.
                why = " ".join(str(e).split())[:120]
                na = variant.library == "torchao" or (workload, variant.recipe.removesuffix(STEP_CASTS)) in F8TENSOR_NA
                missing[variant.name] = f"n/a: {why}" if na else f"fails: {why}"
        base = rows["bf16"]
        reading = ", scalar codegen (cpp.simdlen=1)" if args.scalar_codegen else ""
        print(f"### CPU: {titles[workload]}, bf16, forward + backward{reading}")
        print()
        table = [
            _row(n, r, base, None if n == "bf16" else floor_bytes(workload, n.split()[1])) for n, r in rows.items()
        ]
        table += [[name, why, "", "", "", "", "", "", "", ""] for name, why in missing.items()]
        headers = ["variant", "guards", "vs bf16", "graphs", "graph breaks", "CPU kernels", "MiB outside GEMMs"]
        headers += ["over bf16 MiB", "floor MiB", "over bf16 / floor"]
        print(C.markdown_table(headers, table, numeric=[False] + [True] * 9))
        print()


if __name__ == "__main__":
    main()
