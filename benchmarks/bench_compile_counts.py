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

import contextlib
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
            found["fp8_kernels"] += name in _FP8_KERNELS
            found["host_reads"] += name in HOST_READS and _on_device(node.args[0] if node.args else None)
            value = node.meta.get("example_value")
            found["host_tensors"] += isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dim() > 0
    return found


def cuda_trace(variant: C.Variant, tokens=(128, 96, 160), float8=None) -> dict[str, int]:
    """What dynamo traces of the block's CUDA path: graphs, graph breaks, FP8 kernel calls,
    host reads and host tensors (the last three summed over the graphs, forward and backward).

    The block runs at each of ``tokens`` (``dynamic=True``: a recompile counts a graph) over
    fake CUDA tensors, scalar outputs not captured (an ``.item()`` breaks the graph).
    """
    from torch._dynamo.utils import counters
    from torch._subclasses.fake_tensor import DataDependentOutputException

    cfg = BLOCK_CONFIG
    torch.manual_seed(0)
    block = M.Block(cfg).to(torch.bfloat16)
    variant.convert(block, float8)
    graphs: list[dict[str, int]] = []

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
                    x = torch.empty(cfg.batch, n, cfg.dim, dtype=torch.bfloat16, device="cuda", requires_grad=True)
                    cos, sin = (torch.empty(n, cfg.head_dim // 2, device="cuda") for _ in range(2))
                    compiled(x, cos, sin)
        except DataDependentOutputException:
            read_back = 1  # eager code between graphs read a device value (fake tensors have none)
    found = {"graphs": len(graphs), "breaks": sum(counters["graph_break"].values())}
    for key in ("fp8_kernels", "host_reads", "host_tensors"):
        found[key] = sum(g[key] for g in graphs)
    found["host_reads"] += read_back
    return found


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
