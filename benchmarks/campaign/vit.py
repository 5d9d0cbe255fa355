"""Second plan: a timm ViT-Huge (``vit_huge_patch14_224``, random init, no class token)
training step, bf16 vs tensorwise vs rowwise, each block compiled: step time. Needs timm."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

from .measure import timed_configs, timing_rows
from .runner import Ctx


def import_timm(ctx: Ctx):
    """timm; with tutorial 10's stand-in when torchvision is absent or broken. A missing timm
    raises ``ModuleNotFoundError`` (the runner reports the item ``not run: absent (timm)``)."""
    try:
        import timm

        return timm
    except ModuleNotFoundError as e:
        if e.name != "torchvision":
            raise
    except RuntimeError as e:
        if "torchvision" not in str(e):
            raise
    ctx.note("torchvision absent or broken: timm imported through tutorials/10_vit_timm.py's stand-in")
    path = Path(__file__).resolve().parents[2] / "tutorials" / "10_vit_timm.py"
    spec = importlib.util.spec_from_file_location("_tutorial_10", path)
    module = importlib.util.module_from_spec(spec)
    import torch

    threads = torch.get_num_threads()
    spec.loader.exec_module(module)
    torch.set_num_threads(threads)  # the tutorial pins one thread at import
    return module.import_timm()


def vit(ctx: Ctx) -> None:
    import _common as C
    import torch
    import torch.nn.functional as F

    timm = import_timm(ctx)
    dev = ctx.device
    tiny = {"img_size": 32, "patch_size": 8, "embed_dim": 64, "depth": 2, "num_heads": 4} if ctx.dry else {}
    torch.manual_seed(0)
    base = timm.create_model(
        "vit_huge_patch14_224", pretrained=False, class_token=False, global_pool="avg", num_classes=1000, **tiny
    ).to(dev, torch.bfloat16)
    batch, image = ctx.pick((32, 224), (4, 32))
    images = torch.randn(batch, 3, image, image, device=dev, dtype=torch.bfloat16)
    labels = torch.randint(0, 1000, (batch,), device=dev)
    steps = {}
    for recipe in ("bf16", "tensorwise", "rowwise"):
        model = copy.deepcopy(base)
        if recipe != "bf16":
            C.f8tensor_convert(model, recipe, module_filter_fn=lambda m, fqn: fqn != "head")
        # Each block compiled on its own, as e2e does: the 32 identical blocks share one graph,
        # where compiling the whole model traces and compiles all 32 (over 80 s per recipe).
        for block in model.blocks:
            block.compile(dynamic=False)

        def step(model=model):
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(images).float(), labels).backward()

        steps[recipe, "compiled"] = step
    timings, failed = timed_configs(ctx, steps, 2, *ctx.pick((3, 5), (1, 1)))
    timing_rows(ctx, f"{batch}x3x{image}x{image}", timings, failed)
