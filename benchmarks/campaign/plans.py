"""The two plans, in the order their items run (by value: what is worth most runs first).

The default plan is the one command a loan surely has time for: after the smoke test it checks
the features no GPU has run yet (the fused optimizer step, the FP8 saved activations' casts),
then measures the model that represents users (the Llama-3-8B-shaped one, with CUDA graphs
too), the big linear, the MoE grouped GEMMs and the reference shapes, then the core gpu
tests; the second plan, for a loan with time left, holds the 300m overhead check
(e2e_compile 60 s, e2e_step 15 s), the eager overhead (15 s), ``recompute=True`` on the
Llama-shaped model (20 s), the rest of the tests (the
kernel and twin groups the default plan once ran among them), the profiles, ViT-Huge and the
client check.

Planned seconds are for an H100/H200, set from the first H100 run (commit 96d2fc2: what each
item took, with room for what it could not finish); each item's deadline is the cumulative sum, scaled so
that the plan fills ``--budget-s`` from process start (``runner.plan_deadlines``)."""

from __future__ import annotations

from . import activations, e2e, gpu_tests, hooks, linear, llama, moe, overhead, profiles, references, smoke, vit
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
            "llama_compile",
            120,
            llama.llama_compile,
            "the Llama-3-8B-shaped model (4 layers, 1 x 8192 tokens), bf16 / tensorwise / rowwise / "
            "blockwise / torchao tensorwise, rowwise: build, compile (per block), first step",
            min_s=40,
        ),
        Item(
            "llama_step",
            40,
            llama.llama_step,
            "the compiled Llama-shaped models interleaved: tokens/s, peak memory, host and device time, "
            "kernels per step; the profile of tensorwise and bf16",
            min_s=15,
        ),
        Item(
            "llama_graphs",
            50,
            llama.llama_graphs,
            "the Llama-shaped model with CUDA graphs (reduce-overhead per block): bf16 vs tensorwise",
            min_s=25,
        ),
        Item(
            "linear_target",
            60,
            linear.linear_target,
            "Float8Linear fwd+bwd at M=16384, K=4096, N=14336, "
            "compiled and eager: tensorwise, rowwise, blockwise vs bf16 and torchao",
            min_s=30,
        ),
        Item(
            "moe_grouped",
            25,
            moe.moe_grouped,
            "grouped GEMM fwd+bwd: float8_grouped_mm tensorwise, rowwise vs bf16 torch._grouped_mm, eager and compiled",
            min_s=15,
        ),
        Item(
            "references",
            35,
            references.references,
            "for reference: TE's getting-started layer and nanochat's d26 MLP GEMM, our FP8 speed-up "
            "beside the published one",
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
            30,
            gpu_tests.rest,
            "pytest -m gpu: the other gpu tests, on the time left (the second plan goes on from there)",
            min_s=15,
        )
    )
    return items


def second_plan() -> list[Item]:
    items = [
        Item(
            "e2e_compile",
            60,
            e2e.e2e_compile,
            "the 300m model (an overhead check), bf16 / tensorwise / rowwise: build, "
            "compile (per block) and the first step; compile seconds reported",
            min_s=25,
        ),
        Item(
            "e2e_step",
            15,
            e2e.e2e_step,
            "the compiled 300m models: tokens/s, peak memory, host and device time per step, interleaved",
            min_s=10,
        ),
        Item(
            "eager_overhead",
            15,
            overhead.eager_overhead,
            "kernels and host time per eager step of a tiny linear, per recipe, vs bf16 and torchao",
            min_s=10,
        ),
        Item(
            "recompute_step",
            20,
            activations.recompute_step,
            "the Llama-3-8B-shaped model, tensorwise, eager: step time and peak memory with "
            "save_activations_in_float8(recompute=True) against the plain step",
            min_s=15,
        ),
        Item(
            "pytest_gpu_rest",
            45,
            gpu_tests.rest,
            "pytest -m gpu: the gpu tests neither the default plan nor --figures-csv has an outcome for",
            min_s=20,
        ),
        Item(
            "profiles",
            35,
            profiles.profiles,
            "the figures of --figures-csv below target and their baselines under torch.profiler: top kernels",
            min_s=20,
        ),
        Item(
            "vit_huge",
            40,
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
