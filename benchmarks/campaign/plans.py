"""The two plans, in the order their items run (by value: what is worth most runs first).

The default plan is the one command a loan surely has time for: after the smoke test it checks
the features no GPU has run yet (the fused optimizer step, the FP8 saved activations' casts)
before it re-measures the figures of the first H100 run; the second plan, for a loan with
time left, holds the rest of the tests, the profiles, ViT-Huge and the client check.

Planned seconds are for an H100/H200, set from the first H100 run (commit 96d2fc2: what each
item took, with room for what it could not finish); each item's deadline is the cumulative sum, scaled so
that the plan fills ``--budget-s`` from process start (``runner.plan_deadlines``)."""

from __future__ import annotations

from . import e2e, gpu_tests, hooks, linear, moe, overhead, profiles, smoke, vit
from .runner import Item

#: The GPU command's wall-clock limit (s) for each plan, the installs of its wheels included.
COMMAND_LIMIT_S = {"default": 480, "second": 240}
#: The runner's budget from process start: the limit less the wheel install, the interpreter
#: start and a margin for the watchdog's last write.
DEFAULT_BUDGET_S = {"default": 450.0, "second": 220.0}


def default_plan() -> list[Item]:
    items = [
        Item(
            "smoke",
            20,
            smoke.smoke,
            "every recipe's forward + backward on the device vs the CPU (SQNR), "
            "and the first kernel each recipe launches",
            min_s=10,
        ),
        *_hook_items(DEFAULT_HOOKS),
        Item(
            "linear_target",
            60,
            linear.linear_target,
            "Float8Linear fwd+bwd at M=16384, K=4096, N=14336, "
            "compiled and eager: tensorwise, rowwise, blockwise vs bf16 and torchao",
            min_s=30,
        ),
        Item(
            "eager_overhead",
            15,
            overhead.eager_overhead,
            "kernels and host time per eager step of a tiny linear, per recipe, vs bf16 and torchao",
            min_s=10,
        ),
        Item(
            "e2e_compile",
            75,
            e2e.e2e_compile,
            "the 300m model, bf16 / tensorwise / rowwise: build, "
            "compile (per block) and the first step; compile seconds reported",
            min_s=30,
        ),
        Item("e2e_step", 15, e2e.e2e_step, "the compiled 300m models: tokens/s and peak memory, interleaved", min_s=15),
        Item(
            "moe_grouped",
            25,
            moe.moe_grouped,
            "grouped GEMM fwd+bwd: float8_grouped_mm tensorwise, rowwise vs bf16 torch._grouped_mm, eager and compiled",
            min_s=15,
        ),
    ]
    items += [
        Item(name, plan_s, gpu_tests.group_fn(paths), f"pytest -m gpu {' '.join(paths)}", min_s=15)
        for name, paths, plan_s in gpu_tests.GROUPS
    ]
    # Whatever time is left runs the other gpu tests; the second plan deselects what ran here.
    items.append(
        Item(
            "pytest_gpu_rest",
            40,
            gpu_tests.rest,
            "pytest -m gpu: the other gpu tests, on the time left (the second plan goes on from there)",
            min_s=15,
        )
    )
    return items


def second_plan() -> list[Item]:
    items = [
        Item(
            "pytest_gpu_rest",
            100,
            gpu_tests.rest,
            "pytest -m gpu: the gpu tests neither the default plan nor --figures-csv has an outcome for",
            min_s=30,
        ),
        Item(
            "profiles",
            55,
            profiles.profiles,
            "the figures of --figures-csv below target and their baselines under torch.profiler: top kernels",
            min_s=20,
        ),
        Item(
            "vit_huge",
            55,
            vit.vit,
            "timm ViT-Huge training step, compiled: bf16 vs tensorwise vs rowwise",
            min_s=20,
            requires=("timm",),
        ),
    ]
    items += _hook_items(tuple(name for name, _, _ in hooks.HOOKS if name not in DEFAULT_HOOKS))
    return items


#: The feature checks the default plan runs (right after the smoke test); the second plan runs the others.
DEFAULT_HOOKS = ("fused_optimizer_step", "fp8_activation_casts")


def _hook_items(names: tuple[str, ...]) -> list[Item]:
    """The feature checks ``names`` (``hooks.HOOKS``), in that table's order."""
    return [
        Item(
            name,
            hooks.PLANNED_S.get(name, 2),
            hooks.hook_fn(name, module, what),
            what,
            min_s=0,
            absent=lambda module=module: hooks.module_absent(module),
        )
        for name, module, what in hooks.HOOKS
        if name in names
    ]


PLANS = {"default": default_plan, "second": second_plan}
