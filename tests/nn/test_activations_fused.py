"""save_activations_in_float8 on the fused path: one kernel to pack each saved tensor, one
to restore it, whatever its layout (attention's transposed 4D q/k/v included), and the
gradients of the reference path bit for bit.

The CUDA routing of ``f8tensor.kernels`` (``_fused_device``) is pointed at the CPU, so the
context runs the same Triton kernels through the interpreter; the launches are counted at
the interpreted kernels themselves. On CUDA the context then adds two kernels per packed
tensor (what the campaign's ``fp8_activation_casts`` check counts). Skipped, with the
reason, where this triton's interpreter cannot run the kernels.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("triton", reason="the fused casts need triton (it ships with CUDA builds of torch)")

from f8tensor import kernels, save_activations_in_float8
from f8tensor.kernels import reference, triton_cast
from f8tensor.nn import activations
from f8tensor.quant.block_quantizers import BlockQuantizer
from f8tensor.quant.config import CastSpec

KERNELS = (
    "amax_partials_kernel",
    "cast_tensor_kernel",
    "cast_rows_kernel",
    "cast_groups_kernel",
    "cast_tiles_kernel",
    "dequantize_groups_kernel",
)


@functools.cache
def _interpreter_problem() -> str | None:
    """None when this triton's interpreter runs the kernels on CPU tensors; else why not."""
    import triton

    try:
        triton_cast.maybe_cast(torch.ones(40, 300), CastSpec(torch.float8_e4m3fn))
    except Exception as error:  # noqa: BLE001 (the interpreter's own error types differ by release)
        return f"triton {triton.__version__}'s interpreter cannot run the kernels here: {error!r}"
    return None


@pytest.fixture(autouse=True)
def _needs_interpreter():
    problem = _interpreter_problem()
    if problem is not None:
        pytest.skip(problem)


class _Launches:
    """Counts the launches of one interpreted kernel (``kernel[grid](...)``)."""

    def __init__(self, kernel) -> None:
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


class Block(nn.Module):
    """A Llama-like block at toy size: separate q/k/v projections reading one normed input,
    heads transposed for SDPA (it saves non-contiguous 4D q/k/v), a SwiGLU MLP whose gate
    and up projections read one normed input."""

    def __init__(self, dim: int = 64, heads: int = 2, ffn: int = 128) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(dim, ffn, bias=False), nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.norm1(x)
        q, k, v = (w(h).view(b, s, self.heads, d // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        x = x + self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))
        h = self.norm2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def _step(model: nn.Module, x: torch.Tensor, context) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with context:
        out = model(x * 1)
    out.float().pow(2).mean().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _context():
    return save_activations_in_float8(block=32, min_numel=0)


def test_one_kernel_per_pack_and_one_per_restore(monkeypatch):
    torch.manual_seed(0)
    model = Block().to(torch.bfloat16)
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    want = _step(copy.deepcopy(model), x, _context())  # the reference path (the CPU's)

    module = triton_cast._kernels(True)
    launches = {name: _Launches(getattr(module, name)) for name in KERNELS}
    for name, counter in launches.items():
        monkeypatch.setattr(module, name, counter)
    monkeypatch.setattr(kernels, "_fused_device", lambda t: True)
    fallbacks = []
    for name in ("cast", "dequantize"):
        real_reference = getattr(reference, name)
        monkeypatch.setattr(
            reference, name, lambda *a, _r=real_reference, _n=name, **k: fallbacks.append(_n) or _r(*a, **k)
        )
    packed, saves = [], []
    real_cast, real_pack = BlockQuantizer.quantize, activations._Hooks.pack

    def counting_cast(quantizer, t, *args, **kwargs):
        packed.append((tuple(t.shape), t.is_contiguous()))
        return real_cast(quantizer, t, *args, **kwargs)

    def counting_pack(self, t):
        out = real_pack(self, t)
        saves.append(isinstance(out, activations._Packed))
        return out

    monkeypatch.setattr(BlockQuantizer, "quantize", counting_cast)
    monkeypatch.setattr(activations._Hooks, "pack", counting_pack)

    got = _step(model, x, _context())

    assert not fallbacks, f"the reference ran: {fallbacks}"
    # Every layout the block saves, attention's transposed 4D q/k/v included.
    assert any(len(shape) == 4 and not contiguous for shape, contiguous in packed), packed
    assert sum(saves) > len(packed), "no packed copy is shared (the test needs q/k/v reading one input)"
    counts = {name: c.count for name, c in launches.items()}
    assert counts["cast_groups_kernel"] == len(packed), counts
    # One restore per packed tensor, also where several ops saved it.
    assert counts["dequantize_groups_kernel"] == len(packed), counts
    assert sum(counts.values()) == 2 * len(packed), counts  # measured: 2 x 13 packed tensors (16 saves)
    for name, grad in want.items():
        assert torch.equal(got[name].view(torch.int16), grad.view(torch.int16)), f"{name}: gradients differ"


def test_restored_copy_is_dropped_after_its_last_unpack(monkeypatch):
    """A copy three ops saved is restored once, shared, and released once the last save
    unpacked it; a second backward through a retained graph restores again."""
    monkeypatch.setattr(kernels, "_fused_device", lambda t: True)
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(64, 64), nn.Linear(64, 64)
    x = torch.randn(8, 64, requires_grad=True)
    restores, casts = [], []
    real_restore, real_cast = activations._restore, BlockQuantizer.quantize
    monkeypatch.setattr(activations._packing, "_restore", lambda p: restores.append(p) or real_restore(p))
    monkeypatch.setattr(
        BlockQuantizer, "quantize", lambda q, t, *a, **k: casts.append(t.shape) or real_cast(q, t, *a, **k)
    )
    with _context():
        h = torch.tanh(x)  # tanh saves its output, both linears save it as their input
        out = (lin1(h) * lin2(h)).sum()  # the product saves both outputs
    out.backward(retain_graph=True)
    assert len(casts) == 3 and len(restores) == 3, (casts, len(restores))
    assert all(p.restored.tensor is None for p in restores), "a restored copy outlived its last unpack"
    out.backward()
    assert len(restores) == 3 + 5  # without the count of pending saves: one restore per save
