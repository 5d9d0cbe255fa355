"""Activations saved for backward in FP8: :func:`save_activations_in_float8`.

Each qualifying saved tensor is cast by its block quantizer and restored once per backward;
what stays exact, and why: docs/activations.rst.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.nn.modules import module as nn_module
from typing_extensions import Self

from f8tensor.nn.activations._packing import (
    ATTENTION_LOGIT_ERROR,
    COMPRESSED_DTYPES,
    DEFAULT_MIN_NUMEL,
    EAGER_ONLY,
    _Hooks,
    _Kept,
    _Packed,
    _restore,
)
from f8tensor.nn.activations._recompute import NormHooks
from f8tensor.quant.formats import FLOAT8_DTYPES

__all__ = ["ATTENTION_LOGIT_ERROR", "COMPRESSED_DTYPES", "DEFAULT_MIN_NUMEL", "save_activations_in_float8"]
# Private names the tests reach through this module.
_INTERNALS = (_Hooks, _Kept, _Packed, _restore)


class save_activations_in_float8:
    """Store the tensors autograd saves for backward in FP8 while the context is active.

    Args:
        float8_dtype: an FP8 dtype (default e4m3fn).
        block: elements per fp32 scale along the last dim, or along memory order where the
            last dim is shorter (attention's q, k, v: blocks across heads); default 128.
        min_numel: the smallest tensor compressed (default :data:`DEFAULT_MIN_NUMEL`).
            A fused attention (SDPA) keeps its mask and logsumexp exact, and its q, k, v and
            output too unless ``eps * (scale * max|q_i| * max|k_j| + mask spread / 2)``, the
            bound on the logit error FP8 q and k can cause, is at most
            :data:`ATTENTION_LOGIT_ERROR` nats (its backward recomputes the probabilities).
            A causal or masked one's output is rebuilt in backward from its saved q, k, v
            (one attention forward more; with dropout, v and the output stay exact).
        model, module_filter_fn: ``fn(module, fqn) -> False`` keeps what that module saves as is.
        recompute: also store the outputs of cheap modules as recipes recomputed in backward
            from what is saved in FP8 anyway (default False). Covered: ``nn.RMSNorm``,
            ``nn.LayerNorm`` and leaf modules whose class name ends in ``RMSNorm`` (Hugging
            Face's ``LlamaRMSNorm`` and its copies, torchtitan's ``RMSNorm``), called on one
            tensor: they save only their input and run again in backward; SiLU and GELU
            outputs (modules or functions) of an input saved in FP8; the product of such an
            output with another saved tensor (the SwiGLU product). Everything else is saved
            in FP8 as without it. An FP8 tensor that a linear saves, with the same bits as the
            one saved before it (q, k and v casting one input), is kept once. The norms are
            found by global module hooks: while the context is active they fire for modules
            run on every thread (a norm another thread runs is rewritten too); norms in a
            checkpointed region, and norms with forward pre-hooks or backward hooks, run as they are.
            A norm's weights are saved with it (changed in place before backward: autograd's
            error) and its backward supports ``create_graph``. Backward then reruns what it rebuilds
            (``benchmarks/bench_activations.py`` reports its FLOPs and time).
    Raises:
        ValueError: a bad ``float8_dtype``, ``block`` or ``min_numel``, or a filter without ``model``.
        TypeError: ``recompute`` not a bool.
        TypeError: ``model`` not an ``nn.Module`` or ``module_filter_fn`` not callable.
        RuntimeError: entered inside a region torch.compile traces (eager only).

    >>> import torch, f8tensor
    >>> lin = torch.nn.Linear(256, 256)
    >>> x = torch.randn(512, 256)
    >>> with f8tensor.save_activations_in_float8():
    ...     y = torch.nn.functional.gelu(lin(x))
    >>> y.sum().backward()  # backward may run outside the context
    >>> lin.weight.grad.shape
    torch.Size([256, 256])
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    >>> keep_last = lambda module, fqn: fqn != "2"  # the second linear's input stays high precision
    >>> with f8tensor.save_activations_in_float8(model=mlp, module_filter_fn=keep_last):
    ...     loss = mlp(x).sum()
    >>> loss.backward()
    >>> norm_mlp = torch.nn.Sequential(torch.nn.RMSNorm(256), torch.nn.Linear(256, 512), torch.nn.SiLU())
    >>> with f8tensor.save_activations_in_float8(recompute=True):  # RMSNorm and SiLU recomputed
    ...     loss = norm_mlp(x).pow(2).sum()
    >>> loss.backward()
    """

    def __init__(
        self,
        *,
        float8_dtype: torch.dtype = torch.float8_e4m3fn,
        block: int = 128,
        min_numel: int = DEFAULT_MIN_NUMEL,
        model: nn.Module | None = None,
        module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
        recompute: bool = False,
    ) -> None:
        if float8_dtype not in FLOAT8_DTYPES:
            allowed = ", ".join(str(d) for d in FLOAT8_DTYPES)
            raise ValueError(f"float8_dtype must be one of {allowed}; got {float8_dtype!r}")
        if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
            raise ValueError(f"block must be a positive int (elements per scale along the last dim); got {block!r}")
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"min_numel must be an int >= 0; got {min_numel!r}")
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module or None; got {type(model).__name__}")
        if module_filter_fn is not None and not callable(module_filter_fn):
            raise TypeError(
                f"module_filter_fn must be a callable (module, fqn) -> bool or None; got {module_filter_fn!r}"
            )
        if module_filter_fn is not None and model is None:
            raise ValueError("module_filter_fn needs model= (the module whose submodules it chooses among)")
        if not isinstance(recompute, bool):
            raise TypeError(f"recompute must be a bool; got {recompute!r}")
        self.recompute = recompute
        self.model = model
        self.module_filter_fn = module_filter_fn
        self.float8_dtype = float8_dtype
        self.block = block
        self.min_numel = min_numel
        self._entered: list[tuple[_Hooks, saved_tensors_hooks, list[Any]]] = []

    def __enter__(self) -> Self:
        if torch.compiler.is_compiling():
            raise RuntimeError(EAGER_ONLY)
        hooks = _Hooks(self.float8_dtype, self.block, self.min_numel, self.recompute)
        rejected: set[int] = set()
        handles = self._policy_hooks(hooks, rejected)
        if self.recompute:
            norms = NormHooks(hooks.pack, lambda module: bool(hooks.kept_depth) or id(module) in rejected)
            handles.append(nn_module.register_module_forward_pre_hook(norms.before))
            handles.append(nn_module.register_module_forward_hook(norms.after, always_call=True))
        manager = saved_tensors_hooks(hooks.pack, hooks.unpack)
        manager.__enter__()
        self._entered.append((hooks, manager, handles))
        return self

    def _policy_hooks(self, hooks: _Hooks, rejected_ids: set[int]) -> list[Any]:
        """Forward hooks on the outermost modules ``module_filter_fn`` rejects: while one of
        them runs, ``hooks`` packs nothing (their submodules need no hooks of their own)."""
        if self.model is None or self.module_filter_fn is None:
            return []
        rejected: list[str] = []
        handles: list[Any] = []
        try:
            for fqn, module in self.model.named_modules():
                if self.module_filter_fn(module, fqn):
                    continue
                if any(fqn.startswith(outer + ".") or outer == "" for outer in rejected):
                    continue
                rejected.append(fqn)
                rejected_ids.add(id(module))
                handles.append(module.register_forward_pre_hook(hooks.enter_kept))
                handles.append(module.register_forward_hook(hooks.leave_kept, always_call=True))
        except BaseException:
            for handle in handles:
                handle.remove()
            raise
        return handles

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        hooks, manager, handles = self._entered.pop()
        for handle in handles:
            handle.remove()
        hooks.clear()
        manager.__exit__(exc_type, exc, tb)

    def __repr__(self) -> str:
        return (
            f"save_activations_in_float8(float8_dtype={self.float8_dtype}, block={self.block}, "
            f"min_numel={self.min_numel}"
            + (", recompute=True" if self.recompute else "")
            + ("" if self.module_filter_fn is None else f", module_filter_fn={self.module_filter_fn!r}")
            + ")"
        )
