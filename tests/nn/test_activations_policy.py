"""save_activations_in_float8(model=..., module_filter_fn=...): the per-module policy that keeps
chosen modules' saved activations as autograd saves them (bf16 stays bf16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_sqnr
from torch import nn

from f8tensor import save_activations_in_float8
from f8tensor.quant.block_quantizers import BlockQuantizer

D, TOKENS = 128, 512


class Block(nn.Module):
    """LayerNorm, Linear, GELU, Linear, residual: the norm saves its input, fc1 the norm's
    output, GELU (called by the block itself) fc1's output, fc2 GELU's output."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 4 * D)
        self.fc2 = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def _model(n_blocks: int = 1) -> nn.Module:
    torch.manual_seed(0)
    return (Block() if n_blocks == 1 else nn.Sequential(*(Block() for _ in range(n_blocks)))).to(torch.bfloat16)


def _input() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(TOKENS, D, dtype=torch.bfloat16)


def _count_casts(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes of the tensors the context casts to FP8, in order."""
    shapes: list[tuple[int, ...]] = []
    real = BlockQuantizer.quantize

    def counting(self, hp, *args, **kwargs):
        shapes.append(tuple(hp.shape))
        return real(self, hp, *args, **kwargs)

    monkeypatch.setattr(BlockQuantizer, "quantize", counting)
    return shapes


def _grads(net: nn.Module, **context) -> dict[str, torch.Tensor]:
    """The step's gradients with the context (``context``: its keywords) around the forward."""
    net.zero_grad(set_to_none=True)
    x = _input()
    with save_activations_in_float8(min_numel=0, **context):
        out = net(x * 1)
    out.float().pow(2).mean().backward()
    return {name: p.grad.clone() for name, p in net.named_parameters()}


def _reference(model: nn.Module) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(_input() * 1).float().pow(2).mean().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_a_rejected_module_keeps_its_saved_input_in_bf16(monkeypatch):
    model = _model()
    ref = _reference(model)
    shapes = _count_casts(monkeypatch)
    seen: list[str] = []

    def keep_fc2(module: nn.Module, fqn: str) -> bool:
        seen.append(fqn)
        return fqn != "fc2"

    got = _grads(model, model=model, module_filter_fn=keep_fc2)
    assert seen == ["", "norm", "fc1", "fc2"]  # once per module, the root as ""
    # The norm's input, fc1's input and GELU's input (saved by the block, outside fc2) in
    # FP8; fc2's input (GELU's output) not.
    assert shapes == [(TOKENS, D), (TOKENS, D), (TOKENS, 4 * D)], shapes
    # fc2's weight gradient reads only its bf16 input and the loss gradient (which the
    # residual hands over unchanged): bitwise the step without the context.
    assert torch.equal(got["fc2.weight"], ref["fc2.weight"])
    assert torch.equal(got["fc2.bias"], ref["fc2.bias"])
    # fc1's read GELU's input from FP8: close, not equal (measured 36.6 dB).
    assert not torch.equal(got["fc1.weight"], ref["fc1.weight"])
    assert_sqnr(ref["fc1.weight"], got["fc1.weight"], 34.0)


def test_without_a_filter_every_module_is_compressed(monkeypatch):
    model = _model()
    shapes = _count_casts(monkeypatch)
    _grads(model, model=model)
    assert shapes == [(TOKENS, D), (TOKENS, D), (TOKENS, 4 * D), (TOKENS, 4 * D)], shapes


def test_rejecting_the_root_keeps_everything_bitwise(monkeypatch):
    model = _model()
    ref = _reference(model)
    shapes = _count_casts(monkeypatch)
    got = _grads(model, model=model, module_filter_fn=lambda m, fqn: fqn != "")
    assert shapes == []
    for name in ref:
        assert torch.equal(got[name], ref[name]), name


def test_a_rejected_container_keeps_its_submodules(monkeypatch):
    model = _model(2)
    shapes = _count_casts(monkeypatch)
    # "0" rejected: block 0 and everything inside it, whatever the filter says of "0.fc1".
    _grads(model, model=model, module_filter_fn=lambda m, fqn: not fqn.startswith("0") or fqn == "0.fc1")
    assert shapes == [(TOKENS, D), (TOKENS, D), (TOKENS, 4 * D), (TOKENS, 4 * D)], shapes  # block 1's four


def test_a_filter_by_type_and_a_module_called_twice(monkeypatch):
    torch.manual_seed(0)
    lin = nn.Linear(256, 256)
    model = nn.ModuleDict({"lin": lin, "norm": nn.LayerNorm(256)})
    shapes = _count_casts(monkeypatch)
    x = torch.randn(64, 256)
    with save_activations_in_float8(
        min_numel=0, model=model, module_filter_fn=lambda m, fqn: not isinstance(m, nn.Linear)
    ):
        h = model["norm"](x * 1)  # the norm saves its input (one cast)
        y = lin(lin(h))  # both calls of the rejected linear keep their inputs
        y = y.exp()  # outside every module: compressed
    assert shapes == [(64, 256), (64, 256)], shapes
    (g,) = torch.autograd.grad(y.sum(), lin.weight)
    assert torch.isfinite(g).all()


def test_hooks_are_removed_at_exit_also_on_an_exception(monkeypatch):
    model = _model()
    with save_activations_in_float8(model=model, module_filter_fn=lambda m, fqn: fqn != "fc2"):
        assert len(model.fc2._forward_pre_hooks) == 1 and len(model.fc2._forward_hooks) == 1
        assert not model.fc1._forward_pre_hooks  # only the rejected modules get hooks
    assert not model.fc2._forward_pre_hooks and not model.fc2._forward_hooks
    with (
        pytest.raises(ZeroDivisionError),
        save_activations_in_float8(model=model, module_filter_fn=lambda m, fqn: fqn != "fc2"),
    ):
        1 / 0  # noqa: B018
    assert not model.fc2._forward_pre_hooks and not model.fc2._forward_hooks

    # An exception inside the rejected module's forward: the next forward is not stuck in
    # "keep" (always_call), so the context compresses again.
    shapes = _count_casts(monkeypatch)
    context = save_activations_in_float8(min_numel=0, model=model, module_filter_fn=lambda m, fqn: fqn != "fc2")
    with context:
        with pytest.raises(RuntimeError):
            model.fc2(torch.randn(3, 5, dtype=torch.bfloat16))  # wrong width
        model(_input() * 1)
        assert context._entered[-1][0].kept_depth == 0
    assert len(shapes) == 3, shapes


def test_a_filter_that_raises_leaves_no_hooks():
    model = _model()

    def broken(module: nn.Module, fqn: str) -> bool:
        if fqn == "fc2":
            raise KeyError(fqn)
        return fqn != "norm"

    with pytest.raises(KeyError), save_activations_in_float8(model=model, module_filter_fn=broken):
        pass
    assert not model.norm._forward_pre_hooks and not model.norm._forward_hooks


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"module_filter_fn": lambda m, fqn: True}, ValueError, "module_filter_fn needs model="),
        ({"model": nn.Linear(2, 2), "module_filter_fn": "fc2"}, TypeError, "module_filter_fn must be a callable"),
        ({"model": {"fc2": nn.Linear(2, 2)}}, TypeError, "model must be an nn.Module or None; got dict"),
    ],
)
def test_bad_policy_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        save_activations_in_float8(**kwargs)
