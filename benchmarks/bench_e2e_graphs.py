"""Where an end-to-end training step's time goes, per recipe, with each block compiled on its own.

The campaign's end-to-end item compiles each transformer block of the Llama-style model
(``_models``) with ``block.compile(dynamic=False)`` and leaves embedding, final norm and
output head eager. This script builds the same models (bf16, then each f8tensor recipe)
and reports, per recipe:

- dynamo: compiles (frames), graph breaks (with their reasons), recompiles;
- host reads in the model's forward and backward (``aten::_local_scalar_dense``, ``item``,
  ``nonzero``: each one a device->host wait on a GPU), and the top-level aten ops that ran
  outside the compiled blocks (the same eager embedding/norm/head/loss for every recipe);
- the block's forward and backward graphs as AOTAutograd hands them to inductor (min-cut
  partition): nodes, FP8 products, full-tensor reductions (the per-tensor amaxes), and what
  the forward saves for backward (tensors, bytes, of which FP8);
- the step's median time, and on CUDA (``--kernels``) the device time of one step by kernel
  family: GEMMs, inductor's reductions (``triton_red``/``triton_per``), its pointwise
  kernels (``triton_poi``), attention, the rest, with kernel counts.

    python benchmarks/bench_e2e_graphs.py                       # CPU: size tiny, aot_eager
    python benchmarks/bench_e2e_graphs.py --size 300m --kernels # CUDA: inductor
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
import _models as M
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

HOST_READS = ("aten::_local_scalar_dense", "aten::item", "aten::nonzero")
COMPILED_REGIONS = ("Torch-Compiled Region", "CompiledFunction", "## Call CompiledFxGraph")
REDUCTIONS = {"amax", "amin", "aminmax", "max", "min", "sum", "mean"}


def kernel_family(name: str) -> str:
    n = name.lower()
    if "triton_red" in n or "triton_per" in n:
        return "inductor reduction"
    if "triton_poi" in n:
        return "inductor pointwise"
    if "flash" in n or "fmha" in n or "attention" in n:
        return "attention"
    if any(k in n for k in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90", "scaled_mm", "f8f8")):
        return "gemm"
    if "triton" in n:
        return "other triton"
    return "other"


def graph_stats(recipe: str, cfg: M.LlamaConfig, device: torch.device) -> dict[str, Any]:
    """The block's forward and backward graphs as inductor receives them (traced again on a
    fresh model with a recording backend: no inductor compile)."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    from f8tensor import compat

    graphs: dict[str, torch.fx.GraphModule] = {}

    def keep(name: str):
        def compiler(gm, _inputs):
            graphs.setdefault(name, gm)
            return make_boxed_func(gm.forward)

        return compiler

    backend = aot_autograd(
        fw_compiler=keep("fw"), bw_compiler=keep("bw"), partition_fn=min_cut_rematerialization_partition
    )
    cpu_products = compat.CPU_PRODUCTS_IN_FP32
    compat.CPU_PRODUCTS_IN_FP32 = False  # aten._scaled_mm in the graph, as a GPU traces it
    torch._dynamo.reset()  # the flag is a constant to traced code
    try:
        model = build(recipe, cfg, device)
        model.layers[0].compile(backend=backend, dynamic=False)
        tokens = M.synthetic_batches(cfg, 1, device)[0]
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    finally:
        compat.CPU_PRODUCTS_IN_FP32 = cpu_products
        torch._dynamo.reset()
    out: dict[str, Any] = {}
    for name, gm in graphs.items():
        ops: collections.Counter[str] = collections.Counter()
        full = 0
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            op = getattr(node.target, "__name__", str(node.target)).split(".")[0]
            ops[op] += 1
            val = node.meta.get("val")
            val = val[0] if isinstance(val, (tuple, list)) and val else val
            if op in REDUCTIONS and isinstance(val, torch.Tensor) and val.dim() == 0:
                full += 1
        out[f"{name} nodes"] = sum(ops.values())
        out[f"{name} FP8 products"] = ops["_scaled_mm"]
        out[f"{name} full-tensor reductions"] = full
    outputs = [n for n in next(iter(reversed(graphs["fw"].graph.nodes))).args[0] if n is not None]
    vals = [n.meta["val"] for n in outputs if isinstance(n.meta.get("val"), torch.Tensor)]
    out["fw outputs (saved + y)"] = len(vals)
    out["fw outputs bytes"] = sum(v.numel() * v.element_size() for v in vals)
    out["fw outputs FP8"] = sum(1 for v in vals if v.element_size() == 1 and v.is_floating_point())
    return out


def build(recipe: str, cfg: M.LlamaConfig, device: torch.device) -> M.Llama:
    model = M.build_model(cfg, device)
    if recipe != "bf16":
        C.f8tensor_convert(model, recipe, module_filter_fn=M.fp8_filter)
    return model


def measure(
    recipe: str, cfg: M.LlamaConfig, device: torch.device, backend: str, steps: int, kernels: bool
) -> dict[str, Any]:
    torch._dynamo.reset()
    counters.clear()
    model = build(recipe, cfg, device)
    for block in model.layers:
        block.compile(backend=backend, dynamic=False)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    batches = M.synthetic_batches(cfg, 4, device)
    state = {"i": 0}

    def step() -> None:
        b = batches[state["i"] % len(batches)]
        state["i"] += 1
        model(b[:, :-1], b[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    step()
    C.sync(device)
    times = C.time_steps(step, steps, device)
    row: dict[str, Any] = {
        "recipe": recipe,
        "frames": counters["frames"]["ok"],
        "graph breaks": sum(counters["graph_break"].values()),
        "recompiles": sum(counters["recompiles"].values()),
        "unique graphs": counters["stats"]["unique_graphs"],
        "ms/step": statistics.median(times),
    }
    reasons = [f"{n}x {r[:160]}" for r, n in counters["graph_break"].items()]

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if kernels and device.type == "cuda" else [])
    b = batches[state["i"] % len(batches)]
    with profile(activities=activities) as prof:
        model(b[:, :-1], b[:, 1:]).backward()
        C.sync(device)
    reads: collections.Counter[str] = collections.Counter()
    eager_ops = 0
    families: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.name in HOST_READS:
            reads[event.name] += 1
        if event.name.startswith("aten::") and not _under(event, ("aten::",)) and not _under(event, COMPILED_REGIONS):
            eager_ops += 1
        if event.device_type == torch.autograd.DeviceType.CUDA:
            fam = families[kernel_family(event.name)]
            fam[0] += event.device_time / 1e3
            fam[1] += 1
    row["host reads"] = sum(reads.values())
    row["eager top-level aten ops"] = eager_ops
    for fam, (ms, n) in sorted(families.items()):
        row[f"{fam} ms (kernels)"] = f"{ms:.2f} ({n})"
    row.update(graph_stats(recipe, cfg, device))
    return row | {"_reasons": reasons}


def _under(event, prefixes: tuple[str, ...]) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(prefixes):
            return True
        parent = parent.cpu_parent
    return False


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    parser.add_argument("--size", choices=sorted(M.SIZES), default=None, help="model size (CPU: tiny, CUDA: 300m)")
    parser.add_argument("--layers", type=int, default=None, help="override the size's number of blocks")
    parser.add_argument(
        "--recipes", default="bf16,tensorwise,rowwise", help="comma-separated: bf16 and f8tensor recipes"
    )
    parser.add_argument("--backend", default=None, help="torch.compile backend (CPU: aot_eager, CUDA: inductor)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (CPU: 2, CUDA: 10)")
    parser.add_argument("--kernels", action="store_true", help="CUDA: device time of one step by kernel family")
    args = parser.parse_args(argv)
    device = C.resolve_device(args.device, parser)
    cuda = device.type == "cuda"
    cfg = M.SIZES[args.size or ("300m" if cuda else "tiny")]
    if args.layers is not None:
        cfg = M.LlamaConfig(**{**cfg.__dict__, "layers": args.layers})
    backend = args.backend or ("inductor" if cuda else "aot_eager")
    steps = args.steps or (10 if cuda else 2)
    C.setup_compile()
    env = C.environment(device)
    C.print_environment(env, f"End-to-end graphs per recipe, blocks compiled one by one ({backend})")
    print(f"model: {cfg.describe()}")
    rows = []
    for recipe in args.recipes.split(","):
        row = measure(recipe.strip(), cfg, device, backend, steps, args.kernels)
        for reason in row.pop("_reasons"):
            print(f"  {recipe} graph break: {reason}")
        rows.append(row)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print()
    print(
        C.markdown_table(
            ["", *(r["recipe"] for r in rows)], [[k, *(C.fmt(r.get(k, "")) for r in rows)] for k in keys[1:]]
        )
    )


if __name__ == "__main__":
    main()
