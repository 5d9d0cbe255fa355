"""Second plan: places for GPU checks of features that may not exist yet. Each item is
``not run: absent (...)`` until its module exists; then it says it is present and that
its check is still to be written here."""

from __future__ import annotations

import importlib.util

from .runner import Ctx

#: (item name, the module that will hold the feature, what the check will measure)
HOOKS = (
    ("fused_optimizer_step", "f8tensor.optim", "a fused optimizer step over FP8 states vs torch.optim.AdamW"),
    ("fp8_activation_casts", "f8tensor.activations", "FP8 saved activations: bytes saved and step time vs bf16"),
    ("accelerate_fsdp2_plugin", "f8tensor.integrations.accelerate", "accelerate's FSDP2 plugin with f8tensor weights"),
)


def module_absent(name: str) -> str | None:
    try:
        found = importlib.util.find_spec(name) is not None
    except ImportError:
        found = False
    return None if found else f"module {name} does not exist yet"


def hook_fn(module: str, what: str):
    def check(ctx: Ctx) -> None:
        ctx.row(kind="check", metric=f"{module} present", status="info",
                detail=f"no GPU check written yet for {what}: add it in benchmarks/campaign/hooks.py")

    return check
