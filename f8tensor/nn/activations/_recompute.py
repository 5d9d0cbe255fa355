"""``save_activations_in_float8(recompute=True)``: outputs of cheap modules rebuilt in backward.

A norm runs without autograd and is wrapped in :class:`_Norm`, which saves only its input
(packed by the context) and recomputes the norm in backward. A saved tensor that is a norm's
output, SiLU's or GELU's output (module or function) of an input already packed, or the
product of such an output with another packed tensor (SwiGLU), is stored as a
:class:`Recomputed` recipe: its inputs' packed forms and the function, run when backward
reads it. Which packed tensor an autograd node output holds is recorded in the node's
``metadata`` (it lives and dies with the graph).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from f8tensor.compat import global_module_backward_hooks, innermost_pack_hook, reparametrized, version_counter

_KEY = "f8tensor.saved_activations"
_ACTIVATIONS = ("SiluBackward0", "GeluBackward0")


class Restored:
    """How many saves have not unpacked a packed tensor yet, and the copy restored for them."""

    __slots__ = ("pending", "tensor")

    def __init__(self) -> None:
        self.pending = 1
        self.tensor: torch.Tensor | None = None


def with_strides(hp: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """``hp`` with ``stride`` (a view where only size-1 dims differ, else a copy)."""
    if hp.stride() == stride:
        return hp
    if all(a == b or n == 1 for a, b, n in zip(hp.stride(), stride, hp.shape)):
        # Only size-1 dims' strides differ: the same storage serves.
        return hp.as_strided(hp.shape, stride)
    return torch.empty_strided(hp.shape, stride, dtype=hp.dtype, device=hp.device).copy_(hp)


class Recomputed:
    """A saved tensor stored as ``fn(*inputs)``, ``inputs`` packed by the context.

    Fields: ``fn``, ``inputs`` (packed forms, each holding one pending unpack for this
    recipe), ``kind`` (``"norm"``, ``"activation"`` or ``"product"``), ``shape``, ``stride``,
    ``version`` and weak ``refs`` (checked at unpack as for a packed tensor), ``restored``,
    ``exact`` (the tensor itself once :meth:`keep_exact` dropped the recipe).
    """

    __slots__ = ("exact", "fn", "inputs", "kind", "refs", "restored", "shape", "stride", "version")

    def __init__(self, fn: Callable[..., torch.Tensor], inputs: tuple[Any, ...], kind: str, t: torch.Tensor) -> None:
        self.fn = fn
        self.inputs = inputs
        self.kind = kind
        self.shape = t.shape
        self.stride = t.stride()
        self.version = version_counter(t)
        self.refs = (weakref.ref(t),)
        self.restored = Restored()
        self.exact: torch.Tensor | None = None
        for packed in inputs:
            if hasattr(packed, "restored"):
                packed.restored.pending += 1

    def keep_exact(self, t: torch.Tensor) -> None:
        """Keep ``t`` itself instead of the recipe (its inputs lose this recipe's unpack)."""
        self.exact = t
        for packed in self.inputs:
            if hasattr(packed, "restored"):
                packed.restored.pending -= 1
        self.inputs = ()

    def build(self, unpack: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        """The tensor, recomputed from its inputs (each unpacked once)."""
        if self.exact is not None:
            return self.exact
        with torch.no_grad():
            hp = self.fn(*(unpack(packed) for packed in self.inputs))
        return with_strides(hp, self.stride)


def note(t: torch.Tensor, packed: Any) -> None:
    """Record on ``t``'s autograd node that ``packed`` holds ``t``."""
    node: Any = t.grad_fn  # Node.metadata: a dict attribute (typed as a method)
    if node is not None:
        node.metadata.setdefault(_KEY, {})[t.output_nr] = packed


def _held(node: Any, output_nr: int) -> Any:
    """The packed form recorded for ``node``'s output ``output_nr``, or None."""
    if node is None:
        return None
    entries = node.metadata.get(_KEY)
    return None if entries is None else entries.get(output_nr)


def _input(node: Any, index: int) -> Any:
    nxt, nr = node.next_functions[index]
    return _held(nxt, nr)


def recomputed(t: torch.Tensor) -> Recomputed | None:
    """``t`` as a recipe (charged one more pending unpack), or None where it is not one."""
    node: Any = t.grad_fn
    if node is None:
        return None
    found = _held(node, t.output_nr)
    if isinstance(found, Recomputed) and found.version == version_counter(t) and found.shape == t.shape:
        found.restored.pending += 1
        return found
    name = type(node).__name__
    recipe = None
    if name in _ACTIVATIONS:
        source = _input(node, 0)
        if source is not None and source.shape == t.shape:
            fn = F.silu if name == "SiluBackward0" else functools.partial(F.gelu, approximate=node._saved_approximate)
            recipe = Recomputed(fn, (source,), "activation", t)
    elif name == "MulBackward0" and len(node.next_functions) == 2:
        a, b = _input(node, 0), _input(node, 1)
        swiglu = any(isinstance(p, Recomputed) and p.kind == "activation" for p in (a, b))
        if swiglu and a is not None and b is not None and a.shape == b.shape == t.shape:
            recipe = Recomputed(torch.mul, (a, b), "product", t)
    if recipe is not None:
        note(t, recipe)
    return recipe


def is_norm(module: nn.Module) -> bool:
    """``nn.RMSNorm``, ``nn.LayerNorm``, or a leaf module whose class name ends in ``RMSNorm``
    (Hugging Face's ``LlamaRMSNorm`` and its copies, torchtitan's ``RMSNorm``)."""
    return isinstance(module, (nn.RMSNorm, nn.LayerNorm)) or (
        type(module).__name__.endswith("RMSNorm") and next(module.children(), None) is None
    )


class _Call:
    """One norm call: the bound forward, the autocast state it ran under, its output."""

    __slots__ = ("autocast", "fn", "module", "names", "output", "params", "state")

    def __init__(self, module: nn.Module, x: torch.Tensor) -> None:
        self.fn = module.forward
        device = x.device.type
        self.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        self.module = module
        trained = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self.names = tuple(name for name, _ in trained)
        self.params = tuple(p for _, p in trained)
        # Saved beside the input: backward reads them again, so a change in place since raises.
        self.state = tuple(module.parameters())
        self.output: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        device, dtype, enabled = self.autocast
        # The recomputation saves nothing the context should pack.
        with torch.autocast(device, dtype=dtype, enabled=enabled), saved_tensors_hooks(_same, _same):
            out: torch.Tensor = self.fn(x)
        return out


def _same(t: Any) -> Any:
    return t


class _Norm(torch.autograd.Function):
    """A norm's output computed without autograd; backward recomputes it from the saved input."""

    @staticmethod
    def forward(ctx: Any, call: _Call, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.call = call
        ctx.save_for_backward(x, *call.state)
        assert call.output is not None
        return call.output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x = ctx.saved_tensors[0]
        call: _Call = ctx.call
        wants_x = ctx.needs_input_grad[1]
        # Grad mode is on here only under create_graph=True: then the gradients are differentiated
        # again, through the saved input's own graph.
        create_graph = torch.is_grad_enabled()
        with torch.enable_grad():
            xd = x if create_graph and x.requires_grad else x.detach().requires_grad_(wants_x)
            # The recomputation differentiates views of the weights: the weights' own gradient
            # hooks run once, when autograd passes them the gradient returned here.
            views = tuple(p.view_as(p) for p in call.params)
            with reparametrized(call.module, dict(zip(call.names, views, strict=True))):
                out = call(xd)
        inputs = ((xd,) if wants_x else ()) + views
        grads = list(torch.autograd.grad(out, inputs, grad, allow_unused=True, create_graph=create_graph))
        gx = grads.pop(0) if wants_x else None
        return (None, gx, *grads)


def _own_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has forward pre-hooks or backward hooks of its own (or global backward
    hooks apply): they run after the global pre-hook and must see grad mode as the caller set it."""
    return bool(
        module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or global_module_backward_hooks()
    )


class NormHooks:
    """Global module hooks: a norm called with grad enabled runs without autograd, then
    becomes a :class:`_Norm` output (``pack``: the context's pack, for the recipe's input)."""

    def __init__(self, pack: Callable[[torch.Tensor], Any], skip: Callable[[nn.Module], bool]) -> None:
        self.pack = pack
        self.skip = skip
        self.calls: list[tuple[nn.Module, _Call | None]] = []

    def before(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not is_norm(module):
            return
        call = None
        x = args[0] if len(args) == 1 else None
        # Inside a checkpoint region (its own saved-tensor hooks innermost) the norm runs as
        # is: the region saves nothing, and its recomputation must save what it saved.
        if (
            type(x) is torch.Tensor
            and torch.is_grad_enabled()
            and innermost_pack_hook() == self.pack
            and not self.skip(module)
            and not _own_hooks(module)
        ):
            call = _Call(module, x)
            if x.requires_grad or call.params:
                torch.set_grad_enabled(False)
            else:
                call = None
        self.calls.append((module, call))

    def after(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if not self.calls or self.calls[-1][0] is not module:
            return None
        _, call = self.calls.pop()
        if call is None:
            return None
        torch.set_grad_enabled(True)
        if output is None:
            return None  # its forward raised: nothing to wrap, nothing to run again
        if type(output) is not torch.Tensor:
            return call(args[0])  # not a plain tensor: run it again, with autograd
        call.output = output
        out: torch.Tensor = _Norm.apply(call, args[0], *call.params)
        source = self.pack(args[0])
        call.output = None
        note(out, Recomputed(call, (source,), "norm", out))
        # The recipe holds its own pending unpack of the input; drop the one pack() added.
        if hasattr(source, "restored"):
            source.restored.pending -= 1
        return out
