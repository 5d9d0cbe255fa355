"""PyTorch's own attention in FP8: the projection weights of ``nn.MultiheadAttention``.

The converter wraps the projection weights as :class:`Float8AttentionWeight`; the module,
its attributes and its state dict stay as they were. A wrapped weight's ``__torch_function__``
runs a copy of ``F.multi_head_attention_forward`` whose ``linear`` is FP8 (forward and both
backward GEMMs); softmax(q k^T) v stays in high precision. Invariant: a product that would
run in high precision with a wrapped weight raises, never upcasts silently.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from f8tensor.compat import multi_head_attention_forward_with
from f8tensor.nn.linear_autograd import LinearArgs, QuantizedLinearFn
from f8tensor.quant.config import Float8LinearConfig
from f8tensor.tensor.weights import RecipeWeight, set_recipe
from f8tensor.tensor.weights import Unwrap as _Unwrap

__all__ = [
    "Float8AttentionWeight",
    "attention_config",
    "attention_ties",
    "attention_weight_names",
    "set_attention_config",
    "wrap_attention",
]

aten = torch.ops.aten

#: The projection weights of an ``nn.MultiheadAttention`` that run in FP8, by layout.
_PACKED = ("in_proj_weight", "out_proj.weight")
_SEPARATE = ("q_proj_weight", "k_proj_weight", "v_proj_weight", "out_proj.weight")

_CONFIG = "_float8_attention_config"  # nn.MultiheadAttention attribute: the recipe of its projections


def attention_weight_names(mha: nn.MultiheadAttention) -> tuple[str, ...]:
    """The dotted names (within ``mha``) of the weights whose products run in FP8."""
    return _PACKED if mha.in_proj_weight is not None else _SEPARATE


def attention_ties(
    model: nn.Module, attentions: list[nn.MultiheadAttention], configs: list[Float8LinearConfig]
) -> tuple[frozenset[int], list[nn.MultiheadAttention]]:
    """How ties are kept when ``attentions`` of ``model`` are converted: one Parameter per user.

    Returns:
        ``(plain, all_plain)``: ids of weights tied outside these projections (left plain), and
        the attentions whose weights all are (left in high precision, reported).
    Raises:
        ValueError: a weight tied between attentions with different configs.
    """
    slots: set[tuple[int, str]] = set()
    recipe: dict[int, tuple[int, Float8LinearConfig]] = {}
    for i, (mha, config) in enumerate(zip(attentions, configs)):
        for owner, leaf, p in _weights(mha):
            slots.add((id(owner), leaf))
            first, first_config = recipe.setdefault(id(p), (i, config))
            if first_config != config:
                raise ValueError(
                    f"convert_to_float8_training: a weight tied between two nn.MultiheadAttention ({first} and {i} in "
                    "module order) would follow two configs; give tied attentions one config (nothing was changed)"
                )
    plain = frozenset(
        id(p)
        for m in model.modules()
        for name, p in m._parameters.items()
        if p is not None and id(p) in recipe and (id(m), name) not in slots
    )
    all_plain = [mha for mha in attentions if all(id(p) in plain for _, _, p in _weights(mha))]
    return plain, all_plain


def _weights(mha: nn.MultiheadAttention) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """``(owner, name, parameter)`` for each weight of ``mha`` whose products run in FP8."""
    out = []
    for dotted in attention_weight_names(mha):
        owner, leaf = _owner(mha, dotted)
        p = owner._parameters[leaf]
        assert p is not None  # attention_weight_names lists the weights this layout has
        out.append((owner, leaf, p))
    return out


def attention_config(mha: nn.Module) -> Float8LinearConfig | None:
    """The recipe of a converted ``nn.MultiheadAttention``, or None."""
    return mha.__dict__.get(_CONFIG)


def _projection(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, config: Float8LinearConfig) -> torch.Tensor:
    """``F.linear(x, w, b)`` with the GEMMs of ``config``, as ``Float8Linear`` runs them
    (under autocast: in the autocast dtype, the weight cast to FP8 from its own dtype)."""
    device_type = x.device.type
    if (
        device_type != "meta"
        and torch.amp.is_autocast_available(device_type)
        and torch.is_autocast_enabled(device_type)
    ):
        dtype = torch.get_autocast_dtype(device_type)
        with torch.autocast(device_type, enabled=False):
            return _projection(x.to(dtype), w, None if b is None else b.to(dtype), config)
    if b is not None and b.dtype != x.dtype:
        b = b.to(x.dtype)
    return QuantizedLinearFn.apply(x, w, b, LinearArgs(config))


_FORWARDS: dict[Float8LinearConfig, Callable[..., Any]] = {}


def _fp8_attention_forward(config: Float8LinearConfig) -> Callable[..., Any]:
    """``F.multi_head_attention_forward`` with every ``linear`` it calls running with
    ``config``'s GEMMs (PyTorch's own code, see
    :func:`~f8tensor.compat.multi_head_attention_forward_with`). One function per recipe, cached."""
    fn = _FORWARDS.get(config)
    if fn is None:
        fn = _FORWARDS[config] = multi_head_attention_forward_with(lambda x, w, b=None: _projection(x, w, b, config))
    return fn


_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)
_MHA_WEIGHTS = ("in_proj_weight", "out_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")


def _route_attention(args: tuple, kwargs: dict) -> Any:
    """``F.multi_head_attention_forward`` with wrapped weights: the FP8 copy, on plain weights."""
    bound = _MHA_SIGNATURE.bind(*args, **kwargs)
    found = {name: w for name in _MHA_WEIGHTS if isinstance(w := bound.arguments.get(name), Float8AttentionWeight)}
    configs = {w._config for w in found.values()}
    if len(configs) != 1:
        raise ValueError(
            "F.multi_head_attention_forward: the FP8 projection weights of one attention call follow one recipe; got "
            f"{len(configs)} ({', '.join(sorted(found))}). Convert the nn.MultiheadAttention as a whole."
        )
    for name, w in found.items():
        bound.arguments[name] = _Unwrap.apply(w)
    return _fp8_attention_forward(configs.pop())(*bound.args, **bound.kwargs)


def _route_linear(args: tuple, kwargs: dict) -> torch.Tensor:
    """``F.linear(x, w, b)`` with a wrapped weight (``out_proj`` called on its own)."""
    bound = dict(zip(("input", "weight", "bias"), args))
    bound.update(kwargs)
    x, w, b = bound["input"], bound["weight"], bound.get("bias")
    if not isinstance(w, Float8AttentionWeight) or isinstance(x, Float8AttentionWeight):
        raise NotImplementedError("F.linear with an FP8 attention weight takes it as the weight (x @ w.t())")
    return _projection(x, _Unwrap.apply(w), b, w._config)


_ROUTES: dict[Any, Callable[[tuple, dict], Any]] = {
    F.multi_head_attention_forward: _route_attention,
    F.linear: _route_linear,
}


def set_attention_config(mha: nn.MultiheadAttention, config: Float8LinearConfig) -> None:
    """Run a converted ``mha``'s projections with ``config`` (checked by the caller)."""
    mha.__dict__[_CONFIG] = config
    for _, _, p in _weights(mha):
        if isinstance(getattr(p, "_local_tensor", p), Float8AttentionWeight):  # a tied plain weight stays plain
            set_recipe(p, config)


# Products reaching dispatch would run in high precision: refused, never silently upcast.
_REFUSED = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten.matmul.default,
        aten._native_multi_head_attention.default,
    }
)


class Float8AttentionWeight(RecipeWeight):
    """A projection weight of ``nn.MultiheadAttention`` whose products run in FP8.

    Fields: ``_hp``, the plain (out, in) matrix; ``_config``, its :class:`Float8LinearConfig`.
    Every other op acts on ``_hp``; a state dict holds the plain tensor.

    Raises:
        NotImplementedError: a matrix product that would run in high precision with it.
        ValueError: one attention call with weights of two recipes.
        TypeError: its data set to a tensor of another dtype.
    """

    _config: Float8LinearConfig

    VIEWS = frozenset(
        {
            aten.detach.default,
            aten.alias.default,
            aten.view.default,
            aten._unsafe_view.default,
            aten.as_strided.default,
            aten.slice.Tensor,
            aten.select.int,
            aten.transpose.int,
            aten.t.default,
            aten.split.Tensor,
            aten.split_with_sizes.default,
            aten.unbind.int,
        }
    )
    COPIES = frozenset(
        {
            aten.clone.default,
            aten._to_copy.default,
            aten.empty_like.default,
            aten._pin_memory.default,
            aten.new_empty.default,
            aten.new_zeros.default,  # FSDP2's padded shards
        }
    )

    @classmethod
    def _route(cls, func: Any) -> Any:
        return _ROUTES.get(func)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func in _REFUSED:
            raise NotImplementedError(
                f"{func} with an FP8 attention weight would run in high precision. Its products run through "
                "nn.MultiheadAttention (F.multi_head_attention_forward) or F.linear; use w._hp for a "
                "high-precision product."
            )
        return super().__torch_dispatch__(func, types, args, kwargs)


def _owner(mha: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module holding the parameter ``name`` (dotted within ``mha``) and its own name."""
    path, _, leaf = name.rpartition(".")
    return (mha.get_submodule(path) if path else mha), leaf


def _plain_state(mha: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """state_dict post-hook: the projection weights are saved as the plain tensors they
    wrap (ordinary storages, what every checkpoint writer expects)."""
    if attention_config(mha) is None:
        return
    for name in attention_weight_names(mha):  # type: ignore[arg-type]  # only set on nn.MultiheadAttention
        value = state_dict.get(prefix + name)
        if isinstance(value, Float8AttentionWeight) and not isinstance(value, nn.Parameter):
            state_dict[prefix + name] = value._hp.detach()


def _rewrap_after_load(mha: nn.Module, incompatible_keys: Any) -> None:
    """load_state_dict post-hook: ``assign=True`` puts the loaded plain tensors in place of the
    parameters; they are wrapped again, so the projections keep running in FP8."""
    config = attention_config(mha)
    if config is None:
        return
    for name in attention_weight_names(mha):  # type: ignore[arg-type]  # only set on nn.MultiheadAttention
        owner, leaf = _owner(mha, name)
        p = owner._parameters.get(leaf)
        if p is not None and not isinstance(p, Float8AttentionWeight):
            owner._parameters[leaf] = nn.Parameter(Float8AttentionWeight(p.data, config), requires_grad=p.requires_grad)


def wrap_attention(
    mha: nn.MultiheadAttention,
    config: Float8LinearConfig,
    shared: dict[int, tuple[nn.Parameter, nn.Parameter]] | None = None,
    plain: frozenset[int] = frozenset(),
) -> list[str]:
    """Wrap ``mha``'s projection weights in place for ``config``; returns their dotted names.

    Args:
        shared: ``{id(plain): (plain, wrapped)}`` so a tied weight is wrapped once.
        plain: ids of Parameters left as they are (tied to another module).
    """
    names = attention_weight_names(mha)
    shared = {} if shared is None else shared
    for name in names:
        owner, leaf = _owner(mha, name)
        p = owner._parameters[leaf]
        assert p is not None  # attention_weight_names lists the weights this layout has
        if id(p) in plain:
            continue
        if id(p) not in shared:
            shared[id(p)] = (p, nn.Parameter(Float8AttentionWeight(p.data, config), requires_grad=p.requires_grad))
        owner._parameters[leaf] = shared[id(p)][1]
    if _CONFIG not in mha.__dict__:
        mha.register_state_dict_post_hook(_plain_state)
        mha.register_load_state_dict_post_hook(_rewrap_after_load)
    mha.__dict__[_CONFIG] = config
    return list(names)
