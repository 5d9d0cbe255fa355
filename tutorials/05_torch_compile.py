"""Tutorial 5: torch.compile with FP8: fullgraph, checking for graph breaks, eager vs compiled.

    python tutorials/05_torch_compile.py        # CPU, under a minute (most of it compiling)

Why compile at all: in eager mode every FP8 cast is a handful of separate kernels (amax,
scale, multiply, clamp, convert), each a full pass over memory. torch.compile fuses them
into the surrounding code, and on a GPU that is where most of FP8's speed-up comes from:
without compilation the casts can eat the gain of the faster matrix products.

What you will see:
  1. fullgraph=True, and what a graph break looks like;
  2. two ways to count graphs: torch._dynamo.explain and a CompileCounter backend, for
     every recipe, forward and backward;
  3. eager vs compiled numerics: bitwise-equal casts, and a training step compared by SQNR;
  4. eager vs compiled timing, with a warning about what CPU timings mean.
"""

import copy
import time

import torch
import torch._dynamo
import torch._inductor.config
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

from f8tensor import RECIPES, Float8LinearConfig, Float8Tensor, convert_to_float8_training, sqnr
from f8tensor.compat import TORCH_VERSION

# Small matrices: a second CPU thread gains little here and, on a busy machine, makes
# every op wait for the slower thread. One thread keeps the run short and steady.
torch.set_num_threads(1)
torch.manual_seed(0)


class MLP(nn.Module):
    def __init__(self, dim: int = 128, hidden: int = 256) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def fp8_model(recipe: str, base: nn.Module) -> nn.Module:
    return convert_to_float8_training(copy.deepcopy(base), config=Float8LinearConfig.from_recipe(recipe))


base = nn.Sequential(MLP())
x = torch.randn(8, 64, 128)

# ---------------------------------------------------------------------------------------
# 1. fullgraph=True.
#
# By default torch.compile splits a function it cannot trace into several graphs with
# Python in between (a "graph break") and carries on quietly: the code runs, but the
# fusion you compiled for may be gone. fullgraph=True turns a graph break into an error,
# so you learn about it the first time the code runs. Use it for FP8 models.
#
# A common way to break a graph: a Python `if` on a tensor's value inside forward, such
# as a hand-written guard against outliers. Dynamo cannot know which branch to trace.
print("1. fullgraph=True")


class GuardedMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().max() > 1e4:  # a tensor compared in Python: data-dependent control flow
            x = x.clamp(-1e4, 1e4)
        return super().forward(x)


guarded = convert_to_float8_training(GuardedMLP())
try:
    torch.compile(guarded, backend="eager", fullgraph=True)(x)
except torch._dynamo.exc.Unsupported as err:
    print(f"   fullgraph=True refused it: {type(err).__name__}: {str(err).strip().splitlines()[0][:80]}")
else:
    raise AssertionError("fullgraph=True should refuse data-dependent control flow")
# The fix here: torch.clamp needs no `if` (clamping values already in range is a no-op).

# ---------------------------------------------------------------------------------------
# 2. Counting graphs.
#
# (a) torch._dynamo.explain(fn)(*args) traces without compiling and reports the graphs,
#     the breaks and why.
# (b) A CompileCounter backend counts the frames (graphs) dynamo hands to the backend.
#     With "aot_eager" behind it, AOTAutograd also traces the backward, so a training step
#     that runs through proves forward and backward trace without a break.
print("\n2. Counting graphs")
explanation = torch._dynamo.explain(guarded)(x)
print(f"   GuardedMLP: {explanation.graph_count} graphs, {explanation.graph_break_count} break;")
assert explanation.graph_break_count >= 1, "the `if` on a tensor breaks the graph"
reason = explanation.break_reasons[0]
where = reason.user_stack[-1] if reason.user_stack else None
at = f" at {where.filename.rsplit('/', 1)[-1]}:{where.lineno}" if where is not None else ""
print(f"   break{at}: {reason.reason.strip().splitlines()[0][:80]}")

print(f"   {'recipe':<19} {'explain: graphs':>15} {'breaks':>7} {'counter: frames':>16} {'ops':>5}")
for recipe in RECIPES:
    model = fp8_model(recipe, base)
    explanation = torch._dynamo.explain(model)(x)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    compiled(x).sum().backward()  # forward and backward, traced
    print(
        f"   {recipe:<19} {explanation.graph_count:>15} {explanation.graph_break_count:>7} "
        f"{counter.frame_count:>16} {counter.op_count:>5}"
    )
    # The claim below: one graph and no break for every recipe, forward and backward.
    assert (explanation.graph_count, explanation.graph_break_count, counter.frame_count) == (1, 0, 1), recipe
    torch._dynamo.reset()  # start the next recipe with clean caches and counters
# One graph and no break for every recipe: the casts, the scale math, the delayed-scaling
# buffer updates and the FP8 matrix products all trace.

# ---------------------------------------------------------------------------------------
# 3. Eager vs compiled numerics (inductor, the default backend: real code generation).
#
# The casts are written so that eager and compiled agree bit for bit: the same FP8 bytes
# and the same scale. The rest of a training step may round differently once fused, so
# it is compared by SQNR.
print("\n3. Eager vs compiled numerics")


def cast(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    f8 = Float8Tensor.from_hp(t, granularity="rowwise")
    return f8._data, f8._scale


w = torch.randn(256, 128, dtype=torch.bfloat16)
data_eager, scale_eager = cast(w)
data_comp, scale_comp = torch.compile(cast, fullgraph=True)(w)
same = torch.equal(data_eager.view(torch.uint8), data_comp.view(torch.uint8)) and torch.equal(scale_eager, scale_comp)
print(f"   rowwise cast of a bf16 weight, eager vs compiled: bitwise equal = {same}")
assert same, "the compiled cast gives eager's FP8 bytes and scale"

model = fp8_model("tensorwise", base)


def train_step(m: nn.Module, inp: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward and backward of ``m`` (``model`` or a compiled ``model``) under bf16 autocast."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(inp)
    out.float().pow(2).mean().backward()
    return out, [p.grad.clone() for p in model.parameters()]


def compare(label: str | None) -> tuple[nn.Module, float, float]:
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    t0 = time.perf_counter()
    out_comp, grads_comp = train_step(compiled, x)
    seconds = time.perf_counter() - t0
    out_eager, grads_eager = train_step(model, x)
    worst = min(sqnr(a, b) for a, b in zip(grads_eager, grads_comp))
    if label is not None:
        print(
            f"   {label:<34} output {sqnr(out_eager, out_comp):5.1f} dB, "
            f"worst gradient {worst:5.1f} dB  (compiled in {seconds:.0f} s)"
        )
    return compiled, sqnr(out_eager, out_comp), worst


print("   a training step under bf16 autocast, compiled vs eager (SQNR; inf = bitwise equal):")
_, out_db, worst_db = compare("default")
assert out_db >= 25.0 and worst_db >= 25.0, "compiled and eager differ by FP8 rounding steps, not more"
# Not bitwise, and the gradients only ~30-50 dB apart: where inductor fuses a chain of
# pointwise ops under bf16 autocast (layer norm, gelu and their backward) it keeps the
# intermediates in fp32 instead of rounding each to bf16 as eager does. An input to an
# FP8 cast that differs by one bf16 ulp sometimes lands on the other side of an FP8
# rounding boundary, and then differs by a whole FP8 step. Neither side is wrong; the
# compiled one is slightly more precise. To get eager's rounding exactly, ask for it:
torch._inductor.config.emulate_precision_casts = True
_, out_db, worst_db = compare("emulate_precision_casts=True")
torch._inductor.config.emulate_precision_casts = False
if TORCH_VERSION >= (2, 13):
    assert out_db == float("inf") and worst_db > 60.0, "with eager's roundings: the same output, gradients to fp32"
# Now the output is bitwise equal and the gradients agree to fp32 rounding (a reduction
# may still sum in another order). Before torch 2.13 the flag left one rounding out:
# inductor folded a round trip through bf16 (autocast's bf16 output read back in fp32 by
# a cast's amax) into the fp32 value, so the printed figures stay the default's there.
# Worth knowing when a compiled run must reproduce an eager one, or a test compares them;
# otherwise compare a compiled FP8 run with a compiled bf16 twin, and leave the flag off.

# ---------------------------------------------------------------------------------------
# 4. Timing, eager vs compiled.
#
# WARNING: this is a CPU. It has no FP8 matrix unit; torch._scaled_mm runs a reference
# kernel here. What you see is how much Python and cast overhead compilation removes (or
# adds: inductor's CPU code is not tuned for FP8), not FP8 speed. Measure FP8 speed-ups
# on a GPU with compute capability >= 8.9, where compiling is what makes them.
print("\n4. Timing (CPU: overhead only, see the comment)")


def time_steps(m: nn.Module, n: int = 10) -> float:
    train_step(m, x)  # warm-up
    t0 = time.perf_counter()
    for _ in range(n):
        train_step(m, x)
    return (time.perf_counter() - t0) / n


eager_s, comp_s = time_steps(model), time_steps(compare(None)[0])
print(f"   eager {1e3 * eager_s:.1f} ms/step, compiled {1e3 * comp_s:.1f} ms/step ({eager_s / comp_s:.2f}x)")
