"""Tutorial 13: the memory of a training step, and what 8-bit optimizer states save.

    python tutorials/13_optimizer_memory.py        # CPU, under a minute

A training step holds four kinds of memory: the weights, their gradients, the optimizer's
state, and the activations autograd keeps for the backward. FP8 matrix products shrink
the last one (a Float8Linear saves its input in FP8); the optimizer holds the largest
block of the other three. torch's AdamW on fp32 parameters keeps 4 bytes of weight and 8
bytes of moments per parameter; ``f8tensor.optim.AdamW`` can keep:

  - the moments in FP8 (e4m3, one fp32 scale per 128 elements of a row): 2.06 bytes;
  - bf16 parameters with ``master_weights="remainder"``: the low 16 bits of the fp32 master
    next to each bf16 weight, 2 + 2 bytes, and the fp32 master is recovered exactly.

This script builds the demo GPT twice, measures each kind of memory in both set-ups, and
trains both a few steps. Every number is computed here; each claim is an assert.
"""

import copy

import torch

from f8tensor import convert_to_float8_training, demo
from f8tensor.optim import AdamW

torch.manual_seed(0)
torch.set_num_threads(1)
MiB = 2**20
size = demo.SIZES["small"]
data = demo.load_corpus(torch.device("cpu"))
starts = demo.batch_starts(len(data), 6, size.batch_size, size.seq_len, seed=0)
base = demo.GPT(size)
n_params = sum(p.numel() for p in base.parameters())


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def budget(model, opt, amp) -> tuple[dict[str, int], list[float]]:
    """Train 5 steps; then measure the four kinds of memory."""
    losses = []
    for i in range(5):
        x, y = demo.get_batch(data, starts[i], size.seq_len)
        with amp:
            logits = model(x)
        loss = demo._loss(logits, y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    states = [v for s in opt.state.values() for k, v in s.items() if k not in ("step", "master_remainder")]
    remainders = [s["master_remainder"] for s in opt.state.values() if "master_remainder" in s]
    return {
        "weights": nbytes(model.parameters()) + nbytes(remainders),
        "gradients": nbytes(p.grad for p in model.parameters()),
        "optimizer states": nbytes(states),
        "activations": demo.saved_activation_bytes(model, x, y, amp),
    }, losses


# Before: fp32 weights, torch's AdamW, bf16 autocast (the usual mixed precision).
before_model = copy.deepcopy(base)
before_opt = torch.optim.AdamW(before_model.parameters(), lr=size.lr, betas=(0.9, 0.95), weight_decay=0.1)
before, before_losses = budget(before_model, before_opt, torch.autocast("cpu", dtype=torch.bfloat16))

# After: bf16 weights with their fp32 master's low halves, FP8 moments, FP8 linears.
after_model = copy.deepcopy(base).to(torch.bfloat16)
convert_to_float8_training(after_model, module_filter_fn=demo.keep_lm_head_in_high_precision)
after_opt = AdamW(
    after_model.parameters(),
    lr=size.lr,
    betas=(0.9, 0.95),
    weight_decay=0.1,
    state_dtype=torch.float8_e4m3fn,
    master_weights="remainder",
)
after, after_losses = budget(after_model, after_opt, torch.autocast("cpu", enabled=False))

print(f"demo GPT 'small': {n_params / 1e6:.2f}M parameters, batch {size.batch_size} x {size.seq_len}")
print(f"{'':<18}{'before MiB':>12}{'after MiB':>12}{'B/param before':>16}{'B/param after':>15}")
for key in before:
    print(
        f"{key:<18}{before[key] / MiB:>12.2f}{after[key] / MiB:>12.2f}"
        f"{before[key] / n_params:>16.2f}{after[key] / n_params:>15.2f}"
    )
total_before, total_after = sum(before.values()), sum(after.values())
print(f"{'total':<18}{total_before / MiB:>12.2f}{total_after / MiB:>12.2f}")
print(f"losses before: {[round(v, 3) for v in before_losses]}")
print(f"losses after:  {[round(v, 3) for v in after_losses]}")

# fp32 weights and moments: 4 + 8 bytes per parameter.
assert before["weights"] == 4 * n_params and before["optimizer states"] == 8 * n_params
# bf16 weights + remainders: 4 bytes per parameter, the fp32 master exactly.
assert after["weights"] == 4 * n_params
# FP8 moments: about 2 bytes per parameter; the 1-D biases and norms keep fp32 moments
# (8 bytes each), and rows of 128 add two fp32 scales: at most 2.2 bytes in all here.
assert after["optimizer states"] <= 2.2 * n_params, after["optimizer states"] / n_params
# Gradients follow the parameters' dtype: half the bytes.
assert after["gradients"] * 2 == before["gradients"]
# Weights + states (what persists between steps, gradients excluded): 12 -> under 6.2 bytes.
persistent_after = (after["weights"] + after["optimizer states"]) / n_params
assert persistent_after <= 6.2, persistent_after
# FP8 linears save their inputs in FP8: fewer activation bytes.
assert after["activations"] < before["activations"]
# At this small size the activations are most of the step (measured 0.66x in all; the
# weights, gradients and states alone go from 16 to 8.1 bytes per parameter).
assert total_after < 0.7 * total_before, total_after / total_before
assert (after["weights"] + after["gradients"] + after["optimizer states"]) / n_params <= 8.2
# Both set-ups train (5 steps at the demo's learning rate, the same batches).
assert before_losses[-1] < before_losses[0] and after_losses[-1] < after_losses[0]
print(
    f"persistent bytes per parameter: 12.00 -> {persistent_after:.2f}; the step's total: {total_after / total_before:.2f}x"
)
