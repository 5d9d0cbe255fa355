"""What save_activations_in_float8 stores, counted from the storages a forward creates
(``f8tensor.stats.alive_tensor_bytes``) while the context is active: per recipe, for
f8tensor's own Functions (FP8 data and scales, never quantized again), and for autocast's
weight copies (left alone, also when a linear saves them transposed)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from f8tensor import RECIPES, Float8Linear, Float8LinearConfig, save_activations_in_float8
from f8tensor.quant.block_quantizers import BlockQuantizer
from f8tensor.stats import alive_tensor_bytes, saved_tensor_bytes

M, K, N = 512, 256, 256


def _bytes(layer: nn.Module, x0: torch.Tensor, context) -> int:
    """Bytes one forward of ``layer`` leaves alive, its input made inside (``x0 * 1``, as a
    previous layer would make it), after one step (nothing a first call allocates counts)."""
    layer(x0 * 1).float().sum().backward()

    def forward() -> torch.Tensor:
        with context():
            return layer(x0 * 1)

    return alive_tensor_bytes(layer, forward)[0]


def _x() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(M, K, dtype=torch.bfloat16)


def test_alive_bytes_are_exact_and_see_the_context():
    torch.manual_seed(0)
    lin = nn.Linear(K, N, dtype=torch.bfloat16)
    x = _x()
    # The bf16 input, 2 bytes per element, nothing else (the weight is a parameter): the
    # same figure a counting saved-tensor hook gives.
    assert _bytes(lin, x, contextlib.nullcontext) == 2 * M * K == saved_tensor_bytes(lin, lambda: lin(x * 1))[0]
    # Under the context: FP8 data and one fp32 scale per 128 elements of a row. A counting
    # hook would have switched the FP8 hooks off (torch applies only the innermost pair).
    assert _bytes(lin, x, save_activations_in_float8) == M * K + 4 * M * K // 128


def test_autocast_weight_copies_are_left_out():
    torch.manual_seed(0)
    lin = nn.Linear(K, N)  # fp32 master weight; autocast saves a bf16 copy of it (transposed)

    def forward() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return lin(torch.randn(M, K) * 1)

    forward().sum().backward()
    nbytes, _ = alive_tensor_bytes(lin, forward)
    assert nbytes == 2 * M * K  # the input's bf16 copy; the weight's is excluded


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_saves_its_linear_input_in_at_most_055_of_bf16(recipe):
    torch.manual_seed(0)
    x = _x()
    bf16 = _bytes(nn.Linear(K, N, dtype=torch.bfloat16), x, contextlib.nullcontext)
    layer = Float8Linear.from_float(nn.Linear(K, N, dtype=torch.bfloat16), Float8LinearConfig.from_recipe(recipe))
    alone = _bytes(layer, x, contextlib.nullcontext)
    with_context = _bytes(layer, x, save_activations_in_float8)
    # Measured (bf16: 262,144 bytes): tensorwise 0.5000x and delayed 0.5001x alone (FP8
    # data and scale), unchanged by the context; every other recipe (including the FP4
    # ones and rowwise_with_gw_hp, whose Functions save the bf16 input) 1.0x alone and
    # 0.5156x with the context (1 byte per element plus an fp32 scale per 128).
    assert with_context <= 0.55 * bf16, with_context / bf16
    if alone <= 0.55 * bf16:
        # What an f8tensor Function already saves in FP8 is left exactly as it is: never
        # quantized again, no scale added.
        assert with_context == alone, (alone, with_context)


def test_an_fp8_input_saved_by_a_float8_linear_is_not_quantized_again(monkeypatch):
    casts = []
    real = BlockQuantizer.quantize
    monkeypatch.setattr(
        BlockQuantizer, "quantize", lambda q, hp, *a, **k: casts.append(hp.shape) or real(q, hp, *a, **k)
    )
    torch.manual_seed(0)
    layer = Float8Linear.from_float(nn.Linear(K, N, dtype=torch.bfloat16), Float8LinearConfig.from_recipe("tensorwise"))
    x = _x()

    def grads(context) -> list[torch.Tensor]:
        layer.zero_grad(set_to_none=True)
        with context(min_numel=0) if context is save_activations_in_float8 else context():
            out = layer(x * 1)
        out.float().pow(2).sum().backward()
        return [layer.weight.grad.clone(), layer.bias.grad.clone()]

    ref, got = grads(contextlib.nullcontext), grads(save_activations_in_float8)
    assert casts == []
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


def test_a_transposed_autocast_weight_copy_is_left_alone():
    """nn.Linear under autocast saves ``W_bf16.t()`` (a view of the copy): the input
    gradient reads it, so it must stay exact (it is weight memory, not an activation)."""
    torch.manual_seed(0)
    lin = nn.Linear(K, 2 * K)
    x_leaf = torch.randn(M, K, requires_grad=True)

    def step(context):
        lin.zero_grad(set_to_none=True)
        x = x_leaf * 1  # not a leaf: its bf16 copy is an activation the context packs
        with context, torch.autocast("cpu", dtype=torch.bfloat16):
            out = lin(x)
        (gx,) = torch.autograd.grad(out.float().sum(), x_leaf, retain_graph=True)
        out.float().sum().backward()
        return gx, lin.weight.grad.clone()

    gx_ref, gw_ref = step(contextlib.nullcontext())
    gx, gw = step(save_activations_in_float8(min_numel=0))
    assert torch.equal(gx, gx_ref)  # grad_output (ones) @ the exact bf16 weight
    assert not torch.equal(gw, gw_ref)  # the input was packed: the context did act


@pytest.mark.parametrize("recipe", ["rowwise_with_gw_hp", "nvfp4"])
def test_the_high_precision_input_a_linear_function_saves_is_packed(recipe):
    """The recipes that keep the input in high precision for backward (``rowwise_with_gw_hp``
    by design, the FP4 recipes, whose weight-gradient casts happen in backward) save
    ``x.reshape(-1, K)``, made inside their forward: a view that autograd flags as a leaf
    requiring grad. It is an activation (its base is), and the context packs it. (rowwise,
    blockwise and MX save their FP8 cast already: tests/nn/test_saved_inputs_fp8.py.)"""
    torch.manual_seed(0)
    layer = Float8Linear.from_float(nn.Linear(K, N, dtype=torch.bfloat16), Float8LinearConfig.from_recipe(recipe))
    x0 = torch.randn(4, M // 4, K, dtype=torch.bfloat16, requires_grad=True)

    def forward(context):
        def run() -> torch.Tensor:
            with context():
                return layer(x0 * 1)  # an input that requires grad, 3D, as in a model

        return run

    layer(x0 * 1).float().sum().backward()
    alone = alive_tensor_bytes(layer, forward(contextlib.nullcontext))[0]
    packed = alive_tensor_bytes(layer, forward(save_activations_in_float8))[0]
    extra = alone - 2 * M * K  # the recipe's own few bytes beside the input (measured: 8)
    assert 0 <= extra <= 64, alone
    # Before the fix: alone (the view was left as it is, as if it were a parameter).
    assert packed == M * K + 4 * M * K // 128 + extra, (alone, packed)
