"""The model converter: ``convert_to_float8_training`` swaps every linear map for its FP8
twin, wraps expert weights, and reports what it did.

The only module that knows every kind of weight (FP8 linears, ``Float8Conv1D``, expert
weights, the FSDP2 FP8 all-gather wrapper, whose tied weights it keeps tied).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable
from typing import cast

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from f8tensor.distributed.fsdp import Float8AllGatherWeight
from f8tensor.gemm.blocks import fp4_path
from f8tensor.gemm.rules import ALIGN, FP4_ALIGN
from f8tensor.moe import Float8ExpertWeight, expert_path, plan_experts, wrap_experts
from f8tensor.nn.attention import attention_config, attention_ties, attention_weight_names, wrap_attention
from f8tensor.nn.linear import Float8Conv1D, Float8Linear, check_config, dims_ok, is_transposed_linear
from f8tensor.quant.config import GEMMS, Float8LinearConfig
from f8tensor.quant.policies import (  # noqa: F401  (re-exported)
    BLOCK_PATTERN,
    attention_dims_ok,
    block_policy,
    keep_last_blocks_in_hp,
    set_forward_in_high_precision,
    set_gemm_formats,
)

_FSDPModule: type | None
if torch.distributed.is_available():
    from torch.distributed.fsdp import FSDPModule

    _FSDPModule = FSDPModule
else:  # a build without torch.distributed: nothing can be sharded
    _FSDPModule = None

__all__ = [
    "block_policy",
    "convert_to_float8_training",
    "convert_with_policy",
    "keep_last_blocks_in_hp",
    "keep_tied_weights_tied",
    "set_forward_in_high_precision",
    "set_gemm_formats",
]

logger = logging.getLogger("f8tensor")

# Why a candidate stayed in high precision, as the summary line words it.
_SKIP_FILTER = "rejected by module_filter_fn"
_SKIP_DIMS = f"dims not multiples of {ALIGN}"
_SKIP_FORWARD = "nn.Linear subclass overriding forward"
_SKIP_FSDP = "Conv1D with FP8 all-gather (needs an (out, in) weight)"
_SKIP_FP4_DIMS = f"dims not multiples of {FP4_ALIGN} (whole FP4 blocks)"
_SKIP_POLICY = "kept in high precision by the layer policy"
_SKIP_EXPERTS_NO_CONFIG = "expert weights (convert_with_policy without experts_config)"
_SKIP_MHA_DELAYED = "nn.MultiheadAttention (delayed scaling is not supported for attention projections)"
_SKIP_MHA_TIED = "nn.MultiheadAttention whose projection weights are all tied to other modules"
_SKIP_MHA_FSDP = "nn.MultiheadAttention with FP8 all-gather (its projection weights gather in high precision only)"

_FLOAT8_SUBCLASSES: dict[type, type[Float8Linear]] = {}


def _new_float8_subclass_instance(base: type) -> nn.Module:
    """Unpickle a converted ``nn.Linear`` subclass: an empty instance of its FP8 class."""
    cls = _float8_subclass(base)
    return cls.__new__(cls)


def _reduce_float8_subclass(self: nn.Module, protocol: int) -> tuple:
    # A run-time class: pickle its (importable) base and the state.
    return (_new_float8_subclass_instance, (type(self)._float8_base,), self.__dict__.copy())  # type: ignore[attr-defined]  # set by _float8_subclass


def _float8_subclass(cls: type) -> type[Float8Linear]:
    """``Float8Linear`` mixed into an ``nn.Linear`` subclass that keeps ``nn.Linear.forward``.

    The layer stays an instance of ``cls``; one cached class per ``cls``, pickled through ``cls``.
    """
    if cls is nn.Linear:
        return Float8Linear
    if cls not in _FLOAT8_SUBCLASSES:
        _FLOAT8_SUBCLASSES[cls] = cast(
            "type[Float8Linear]",
            type(
                f"Float8{cls.__name__}",
                (Float8Linear, cls),
                {"__module__": cls.__module__, "_float8_base": cls, "__reduce_ex__": _reduce_float8_subclass},
            ),
        )
    return _FLOAT8_SUBCLASSES[cls]


def _convert_linear(mod: nn.Linear, config: Float8LinearConfig) -> Float8Linear:
    new = Float8Linear.from_float(mod, config)
    if type(mod) is not nn.Linear:
        new.__class__ = _float8_subclass(type(mod))
        for key, value in vars(mod).items():
            vars(new).setdefault(key, value)
    _keep_children(mod, new)
    return new


def _keep_children(old: nn.Module, new: nn.Module) -> None:
    """Child modules, and parameters and buffers other than weight and bias, move to ``new``."""
    for key, child in old._modules.items():
        new._modules.setdefault(key, child)
    for key, param in old._parameters.items():
        new._parameters.setdefault(key, param)
    for key, buf in old._buffers.items():
        if key not in new._buffers:
            new.register_buffer(key, buf, persistent=key not in old._non_persistent_buffers_set)


def _fp8_config(mod: nn.Module) -> Float8LinearConfig | None:
    """The recipe of an already converted layer, or None."""
    return mod.config if isinstance(mod, (Float8Linear, Float8Conv1D)) else None


def _check_not_sharded(module: nn.Module) -> None:
    if _FSDPModule is None:
        return
    sharded = [fqn or "<root>" for fqn, m in module.named_modules() if isinstance(m, _FSDPModule)]
    if sharded:
        raise ValueError(
            f"convert_to_float8_training: the model is already sharded by fully_shard ({', '.join(sharded[:4])}); "
            "FP8 layers cannot be swapped into sharded modules. Convert first, then call fully_shard."
        )


LayerConfig = Callable[[nn.Module, str], "Float8LinearConfig | None"]


def _check_same_recipe(
    module: nn.Module,
    layer_config: LayerConfig,
    experts_config: Float8LinearConfig | None,
    module_filter_fn: Callable[[nn.Module, str], bool] | None,
    experts_filter_fn: Callable[[nn.Module, str], bool] | None,
) -> tuple[list[str], list[str]]:
    """``(same, kept)``: fqns already FP8 with the config they would get now, and those with
    another config the filters leave out. Another config the filters select is refused.
    """
    same: list[str] = []
    kept: list[str] = []
    other: list[str] = []
    for fqn, m in module.named_modules():
        found = _fp8_config(m)
        if found is not None:
            if module_filter_fn is not None and not module_filter_fn(m, fqn):
                kept.append(fqn)
            else:
                (same if found == layer_config(m, fqn) else other).append(fqn)
        mha_config = attention_config(m)
        if mha_config is not None:  # a converted nn.MultiheadAttention: its projection weights
            pfqns = [f"{fqn}.{n}" if fqn else n for n in attention_weight_names(m)]  # type: ignore[arg-type]  # set on nn.MultiheadAttention only
            if module_filter_fn is not None and not module_filter_fn(m, fqn):
                kept.extend(pfqns)
            else:
                (same if mha_config == layer_config(m, fqn) else other).extend(pfqns)
        for name, p in m.named_parameters(recurse=False):
            if isinstance(p, Float8ExpertWeight):
                pfqn = f"{fqn}.{name}" if fqn else name
                if p._config == experts_config:
                    same.append(pfqn)
                elif experts_filter_fn is not None and not experts_filter_fn(m, pfqn):
                    kept.append(pfqn)
                else:
                    other.append(pfqn)
    if other:
        names = ", ".join((n or "<root>") for n in other[:4]) + (
            f", ... ({len(other) - 4} more)" if len(other) > 4 else ""
        )
        raise ValueError(
            f"convert_to_float8_training: {len(other)} layers or expert weights are already FP8 with another recipe "
            f"[{names}]; converting them again with a different config is refused. Convert an unconverted model "
            "(load this one's state_dict into it), pass the same config, or leave those layers out with "
            "module_filter_fn / experts_filter_fn (one recipe per layer is allowed)."
        )
    return same, kept


def _disable_encoder_fast_path(module: nn.Module) -> None:
    """Send a ``TransformerEncoderLayer`` holding FP8 linears down its standard path.

    Its fused fast path reads the weights directly; a false ``activation_relu_or_gelu`` declines it.
    """
    for m in module.modules():
        if isinstance(m, nn.TransformerEncoderLayer) and any(isinstance(c, Float8Linear) for c in m.children()):
            m.activation_relu_or_gelu = 0


def convert_to_float8_training(
    module: nn.Module,
    *,
    config: Float8LinearConfig | None = None,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    experts_filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> nn.Module:
    """Swap every module that computes a linear map for its FP8 twin, in place.

    Converted: ``nn.Linear`` and subclasses keeping its ``forward`` (still instances of the
    subclass), Hugging Face's ``Conv1D`` (as :class:`Float8Conv1D`), the projection weights of
    ``nn.MultiheadAttention`` (:class:`~f8tensor.nn.attention.Float8AttentionWeight`, one
    decision per attention), and expert weights (:class:`~f8tensor.moe.Float8ExpertWeight`).
    Left alone and reported: subclasses overriding ``forward``, filtered layers, and dims that
    are not multiples of 16 (32 for FP4) unless ``config.pad_inner_dim``. Everything is checked
    and every filter called before the model changes; converting again with the same config
    changes nothing. Logs one summary line on the ``"f8tensor"`` logger and warns when no layer
    is FP8 or an FP4 GEMM has no path.

    Args:
        module: the model (or one linear layer).
        config: the recipe (default: tensorwise).
        module_filter_fn: ``(mod, fqn) -> bool``, which layers to convert.
        experts_filter_fn: ``(experts_module, param_fqn) -> bool``, which expert weights.

    Returns:
        ``module`` (or the new layer), with ``float8_converted_fqns``, the names of its FP8 layers.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, a filter is not callable, or a bad ``config``.
        ValueError: the model is already sharded by ``fully_shard``, or holds FP8 layers or
            expert weights converted with another config (named).

    Example:
        >>> from torch import nn
        >>> from f8tensor import convert_to_float8_training
        >>> model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
        >>> model = convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn != "2")
        >>> model.float8_converted_fqns, type(model[0]).__name__, model(torch.randn(8, 32)).shape
        (('0',), 'Float8Linear', torch.Size([8, 16]))
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"convert_to_float8_training expects an nn.Module; got {type(module).__name__}")
    for fn_name, fn in (("module_filter_fn", module_filter_fn), ("experts_filter_fn", experts_filter_fn)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{fn_name} must be a callable (module, fqn) -> bool or None; got {fn!r}")
    config = check_config(config)
    return _convert(module, lambda mod, fqn: config, config, module_filter_fn, experts_filter_fn)


def _convert(
    module: nn.Module,
    layer_config: LayerConfig,
    experts_config: Float8LinearConfig | None,
    module_filter_fn: Callable[[nn.Module, str], bool] | None,
    experts_filter_fn: Callable[[nn.Module, str], bool] | None,
) -> nn.Module:
    """The converter: plan (every check, filter and policy call), then apply.

    ``layer_config(mod, fqn)``: a candidate's config (``None``: high precision);
    ``experts_config``: the expert weights' (``None``: none converted).
    """
    _check_not_sharded(module)
    already, kept = _check_same_recipe(module, layer_config, experts_config, module_filter_fn, experts_filter_fn)
    skipped: dict[str, list[str]] = {}
    candidates = 0

    def wants(mod: nn.Module, fqn: str, parent: nn.Module | None) -> Float8LinearConfig | None:
        """The config ``mod`` is converted with, or None (counted and, when skipped, reported)."""
        nonlocal candidates
        if _fp8_config(mod) is not None:
            candidates += 1
            return None
        transposed = is_transposed_linear(mod)
        if not (transposed or isinstance(mod, nn.Linear)):
            return None
        if isinstance(parent, nn.MultiheadAttention) and mod is parent.out_proj:
            return None  # converted (or not) with its attention: see attention_wants
        candidates += 1
        name = fqn or "<root>"
        if not transposed and type(mod).forward is not nn.Linear.forward:
            skipped.setdefault(_SKIP_FORWARD, []).append(name)
            return None
        if module_filter_fn is not None and not module_filter_fn(mod, fqn):
            skipped.setdefault(_SKIP_FILTER, []).append(name)
            return None
        config = layer_config(mod, fqn)
        if config is None:
            skipped.setdefault(_SKIP_POLICY, []).append(name)
            return None
        config = check_config(config)
        # `mod` is an nn.Linear or a transformers Conv1D (checked above); nn.Module types neither.
        in_features, out_features = mod.weight.shape if transposed else (mod.in_features, mod.out_features)  # type: ignore[misc]
        if not dims_ok(in_features, out_features, config):  # type: ignore[arg-type]
            multiple = FP4_ALIGN if config.any_fp4 else ALIGN
            logger.warning(
                "f8tensor: left %s (%d -> %d) in high precision: %s GEMMs need dimensions that are multiples of %d%s",
                name,
                in_features,
                out_features,
                "FP4" if config.any_fp4 else "FP8",
                multiple,
                "" if config.any_fp4 else " (set pad_inner_dim=True to pad instead)",
            )
            skipped.setdefault(_SKIP_FP4_DIMS if config.any_fp4 else _SKIP_DIMS, []).append(name)
            return None
        if transposed and config.enable_fsdp_float8_all_gather:
            skipped.setdefault(_SKIP_FSDP, []).append(name)
            return None
        return config

    attention_candidates = 0

    def attention_wants(mha: nn.MultiheadAttention, fqn: str) -> Float8LinearConfig | None:
        """The config of ``mha``'s projections (one decision for the attention), or None."""
        nonlocal attention_candidates
        if attention_config(mha) is not None:
            return None
        attention_candidates += 1
        name = fqn or "<root>"
        if module_filter_fn is not None and not module_filter_fn(mha, fqn):
            skipped.setdefault(_SKIP_FILTER, []).append(name)
            return None
        config = layer_config(mha, fqn)
        if config is None:
            skipped.setdefault(_SKIP_POLICY, []).append(name)
            return None
        config = check_config(config)
        if config.any_delayed:
            skipped.setdefault(_SKIP_MHA_DELAYED, []).append(name)
            return None
        if not attention_dims_ok(mha, config):
            logger.warning(
                "f8tensor: left %s (embed_dim %d, kdim %d, vdim %d) in high precision: %s GEMMs need dimensions "
                "that are multiples of %d",
                name,
                mha.embed_dim,
                mha.kdim,
                mha.vdim,
                "FP4" if config.any_fp4 else "FP8",
                FP4_ALIGN if config.any_fp4 else ALIGN,
            )
            skipped.setdefault(_SKIP_FP4_DIMS if config.any_fp4 else _SKIP_DIMS, []).append(name)
            return None
        if config.enable_fsdp_float8_all_gather:
            skipped.setdefault(_SKIP_MHA_FSDP, []).append(name)
            return None
        return config

    # Plan: every check, filter and policy call, nothing changed yet.
    swaps: list[tuple[nn.Module | None, str, str, nn.Module, Float8LinearConfig]] = []  # pre-order
    attentions: list[tuple[nn.MultiheadAttention, str, Float8LinearConfig]] = []
    if (config := wants(module, "", None)) is not None:
        swaps.append((None, "", "", module, config))
    for fqn, mod in module.named_modules():
        if isinstance(mod, nn.MultiheadAttention) and (config := attention_wants(mod, fqn)) is not None:
            attentions.append((mod, fqn, config))
        for name, child in mod.named_children():
            child_fqn = f"{fqn}.{name}" if fqn else name
            if (config := wants(child, child_fqn, mod)) is not None:
                swaps.append((mod, name, child_fqn, child, config))
    plain, all_plain = attention_ties(module, [mha for mha, _, _ in attentions], [c for _, _, c in attentions])
    if all_plain:
        skipped.setdefault(_SKIP_MHA_TIED, []).extend(fqn or "<root>" for mha, fqn, _ in attentions if mha in all_plain)
        attentions = [a for a in attentions if a[0] not in all_plain]
    expert_todo, expert_skipped = _plan_experts(module, experts_config, experts_filter_fn)
    for reason, fqns in expert_skipped.items():
        skipped.setdefault(reason, []).extend(fqns)

    # Apply, children first: a converted layer takes its (already converted) children along.
    result = module
    paths: dict[str, list[str]] = {}
    for parent, name, fqn, mod, config in reversed(swaps):
        new = Float8Conv1D.from_conv1d(mod, config) if is_transposed_linear(mod) else _convert_linear(mod, config)  # type: ignore[arg-type]  # wants(): an nn.Linear
        if parent is None:
            result = new
        else:
            setattr(parent, name, new)
        for path in _fp4_gemm_paths(config, new.weight.device):
            paths.setdefault(path, []).insert(0, fqn or "<root>")
    # _plan_experts plans expert weights only under an experts_config (without one it plans
    # none), so where there are expert weights to wrap there is a config for them.
    experts: list[str] = []
    experts_gathered = False
    if expert_todo:
        assert experts_config is not None
        experts = wrap_experts(expert_todo, experts_config)
        experts_gathered = bool(experts) and experts_config.enable_fsdp_float8_all_gather
    attention: list[str] = []
    shared: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # one wrapped Parameter per tied weight
    for mha, fqn, config in attentions:
        attention += [f"{fqn}.{name}" if fqn else name for name in wrap_attention(mha, config, shared, plain)]
    if any(config.enable_fsdp_float8_all_gather for *_, config in swaps) or experts_gathered:
        keep_tied_weights_tied(result)
    _disable_encoder_fast_path(result)
    converted = [fqn for _, _, fqn, _, _ in swaps]
    experts_path = None
    if experts:
        assert experts_config is not None  # expert weights are wrapped only under one (above)
        experts_path = expert_path(experts_config, result.get_parameter(experts[0]).device)
    _report_conversion(
        converted,
        skipped,
        candidates,
        experts,
        already,
        experts_path,
        kept,
        paths,
        attention,
        len(attentions),
        attention_candidates,
    )
    fp8 = already + kept + converted + attention + experts
    result.float8_converted_fqns = tuple(sorted(set(fp8), key=fp8.index))  # type: ignore[assignment]  # a plain attribute, not a submodule
    return result


def _plan_experts(
    module: nn.Module, config: Float8LinearConfig | None, experts_filter_fn: Callable[[nn.Module, str], bool] | None
) -> tuple[list, dict[str, list[str]]]:
    """:func:`~f8tensor.moe.plan_experts`; without a config experts stay high precision (reported)."""
    if config is not None:
        return plan_experts(module, config, experts_filter_fn)
    todo, _ = plan_experts(module, Float8LinearConfig(), None)
    return [], ({_SKIP_EXPERTS_NO_CONFIG: [fqn for _, _, fqn in todo]} if todo else {})


def _fp4_gemm_paths(config: Float8LinearConfig, device: torch.device) -> list[str]:
    """``"<gemms> <path>"`` for ``config``'s GEMMs with an FP4 operand on ``device``."""
    by_path: dict[str, list[str]] = {}
    for gemm, (ra, rb) in GEMMS.items():
        a, b = config.cast_for(gemm, ra), config.cast_for(gemm, rb)
        if a is None or b is None or not (a.fp4 or b.fp4):
            continue
        by_path.setdefault(fp4_path(a.fp4_kind, b.fp4_kind, device, config.emulate), []).append(gemm)
    return [f"{'/'.join(gemms)} {path}" for path, gemms in by_path.items()]


def _report_conversion(
    converted: list[str],
    skipped: dict[str, list[str]],
    candidates: int,
    experts: list[str],
    already: list[str],
    expert_path: str | None,
    kept: list[str],
    fp4_paths: dict[str, list[str]] | None = None,
    attention: list[str] | None = None,
    attention_modules: int = 0,
    attention_candidates: int = 0,
) -> None:
    """Log one summary line; warn when no layer is FP8 or an FP4 path has no kernel."""

    def names(fqns: list[str]) -> str:
        return ", ".join(fqns[:4]) + (f", ... ({len(fqns) - 4} more)" if len(fqns) > 4 else "")

    reasons = "; ".join(f"{len(fqns)} {reason} [{names(fqns)}]" for reason, fqns in skipped.items())
    attention = attention or []
    line = f"f8tensor: converted {len(converted)} of {candidates} linear layers to FP8"
    if attention_candidates:
        line += (
            f", {attention_modules} of {attention_candidates} nn.MultiheadAttention (in- and out-projections, "
            f"{len(attention)} weights{f' [{names(attention)}]' if attention else ''})"
        )
    line += f" and {len(experts)} expert weights (expert GEMMs: {expert_path})" if experts else ""
    line += f"; {len(already)} layers or expert weights were already FP8 with this recipe" if already else ""
    line += f"; {len(kept)} FP8 with another recipe left as they are [{names(kept)}]" if kept else ""
    for path, fqns in (fp4_paths or {}).items():
        line += f"; FP4 {path}: {len(fqns)} layers [{names(fqns)}]"
    line += f"; skipped {reasons}" if reasons else ""
    if converted or attention or experts or already or kept:
        if any(" none:" in path for path in (fp4_paths or {})):
            logger.warning(line)
            warnings.warn(line, UserWarning, stacklevel=3)
        else:
            logger.info(line)
        return
    if not candidates and not attention_candidates:
        line += ": the model has no nn.Linear (or Hugging Face Conv1D) layer"
    logger.warning(line)
    warnings.warn(line + "; the model trains in high precision", UserWarning, stacklevel=3)


def keep_tied_weights_tied(module: nn.Module) -> None:
    """Undo the untying that wrapping weights for FP8 all-gather causes, in place.

    Tied among FP8 layers only: one wrapped Parameter. Tied to anything else: the one plain
    Parameter for every user, and those FP8 layers all-gather it in high precision (warned).
    """
    users: dict[tuple, list[tuple[nn.Module, str, nn.Parameter]]] = {}
    for mod in module.modules():
        for name, param in mod._parameters.items():
            if param is None:
                continue
            hp = param._hp if isinstance(param, Float8AllGatherWeight) else param
            key = (StorageWeakRef(hp.untyped_storage()), hp.storage_offset(), tuple(hp.shape), hp.stride())
            users.setdefault(key, []).append((mod, name, param))
    for group in users.values():
        if len({id(p) for _, _, p in group}) < 2:
            continue
        wrapped = [p for _, _, p in group if isinstance(p, Float8AllGatherWeight)]
        if not wrapped:
            continue
        all_fp8 = all(isinstance(m, Float8Linear) and n == "weight" for m, n, _ in group)
        shared: nn.Parameter
        if all_fp8:
            shared = wrapped[0]
        else:
            plain = [p for _, _, p in group if not isinstance(p, Float8AllGatherWeight)]
            shared = plain[0]
            names = sorted({type(m).__name__ for m, _, _ in group})
            logger.warning(
                "f8tensor: a weight tied between %s stays one high-precision Parameter: FP8 all-gather is "
                "off for it (only Float8Linear layers can use an FP8-gathered weight)",
                ", ".join(names),
            )
        for mod, name, param in group:
            if param is not shared:
                setattr(mod, name, shared)
            if not all_fp8 and isinstance(mod, Float8Linear):
                mod.config = dataclasses.replace(mod.config, enable_fsdp_float8_all_gather=False)


# ===================================================================== layer policies
# (the policies themselves: policies.py, re-exported here)


def convert_with_policy(
    module: nn.Module,
    policy: LayerConfig,
    *,
    experts_config: Float8LinearConfig | None = None,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    experts_filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> nn.Module:
    """:func:`convert_to_float8_training` with a config per layer.

    Args:
        module: the model.
        policy: ``(mod, fqn) -> Float8LinearConfig | None`` (None: high precision, reported).
        experts_config: the expert weights' FP8 recipe (None: high precision, reported).
        module_filter_fn, experts_filter_fn: as in :func:`convert_to_float8_training`.

    Raises:
        TypeError: a bad module, policy or filter.
        ValueError: a layer already FP8 with another config than its policy's.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"convert_with_policy expects an nn.Module; got {type(module).__name__}")
    for fn_name, fn in (
        ("policy", policy),
        ("module_filter_fn", module_filter_fn),
        ("experts_filter_fn", experts_filter_fn),
    ):
        if fn is not None and not callable(fn):
            raise TypeError(f"{fn_name} must be a callable (module, fqn) -> ... or None; got {fn!r}")
    if policy is None:
        raise TypeError("convert_with_policy needs a policy: a callable (module, fqn) -> Float8LinearConfig | None")
    if experts_config is not None:
        experts_config = check_config(experts_config)
    return _convert(module, policy, experts_config, module_filter_fn, experts_filter_fn)
