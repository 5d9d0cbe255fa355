"""The model converter: ``convert_to_float8_training`` swaps every linear map of a model for its
FP8 twin and wraps expert weights, and reports what it did.

The only module that knows every kind of weight: ``Float8Linear`` (and ``nn.Linear``
subclasses mixed with it), ``Float8Conv1D``, FP8 expert weights (``moe.py``) and the FSDP2
FP8 all-gather wrapper (``distributed/fsdp.py``, whose tied weights it keeps tied).

Layer: above ``linear`` and ``moe``; imports them, ``distributed.fsdp``, ``gemm`` and ``config``.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import warnings
from collections.abc import Callable

from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from f8tensor.config import Float8LinearConfig
from f8tensor.distributed.fsdp import Float8AllGatherWeight
from f8tensor.gemm.rules import ALIGN
from f8tensor.linear import Float8Conv1D, Float8Linear, check_config, dims_ok, is_transposed_linear
from f8tensor.moe import convert_experts_to_float8

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

_FLOAT8_SUBCLASSES: dict[type, type] = {}


def _float8_subclass(cls: type) -> type:
    """``Float8Linear`` mixed into an ``nn.Linear`` subclass that keeps ``nn.Linear.forward``.

    The converted layer stays an instance of ``cls`` (methods such as a library's
    ``init_weights`` and ``isinstance`` checks keep working) while ``Float8Linear``'s
    forward comes first in the MRO. One class per ``cls``, cached.
    """
    if cls is nn.Linear:
        return Float8Linear
    if cls not in _FLOAT8_SUBCLASSES:
        _FLOAT8_SUBCLASSES[cls] = type(f"Float8{cls.__name__}", (Float8Linear, cls), {"__module__": cls.__module__})
    return _FLOAT8_SUBCLASSES[cls]


def _convert_linear(mod: nn.Linear, config: Float8LinearConfig) -> Float8Linear:
    new = Float8Linear.from_float(mod, config)
    if type(mod) is not nn.Linear:
        new.__class__ = _float8_subclass(type(mod))
        # The subclass's own attributes (set by its __init__ or its library), as they were.
        for key, value in vars(mod).items():
            vars(new).setdefault(key, value)
    return new


def convert_to_float8_training(
    module: nn.Module,
    *,
    config: Float8LinearConfig | None = None,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    experts_filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> nn.Module:
    """Swap every module that computes a linear map for its FP8 twin, in place.

    Converted: ``nn.Linear`` and its subclasses that keep ``nn.Linear.forward`` (e.g.
    torchtitan's ``Linear``; the new layer is a ``Float8Linear`` that is still an
    instance of the subclass), and Hugging Face's ``Conv1D`` (as :class:`Float8Conv1D`,
    weight layout kept; see ``TRANSPOSED_LINEAR_CLASSES``). Left alone, and reported:
    ``nn.Linear`` subclasses that override ``forward`` (they may not compute
    ``x @ W.t() + b``), layers ``module_filter_fn`` rejects, and layers whose dimensions
    FP8 GEMMs cannot take (not multiples of 16) unless ``config.pad_inner_dim``.

    ``module_filter_fn(mod, fqn) -> bool`` chooses among the candidates (``fqn`` is the
    dotted name, e.g. ``"layers.0.mlp.down_proj"``). Logs one summary line on the
    ``"f8tensor"`` logger (converted N of M linear layers, skipped with reasons) and
    warns when nothing was converted. Returns ``module`` (or the new layer, when
    ``module`` is itself a linear); the names of the converted layers are on the result
    as ``float8_converted_fqns`` (a tuple; ``""`` for a bare layer).

    Mixture-of-experts weights (3D parameters of an experts module, as transformers stores
    them) become :class:`~f8tensor.moe.Float8ExpertWeight`: their grouped, batched and
    per-expert GEMMs run in FP8 (see :mod:`f8tensor.moe`; routers stay high precision).
    ``experts_filter_fn(experts_module, param_fqn) -> bool`` chooses which; return False
    for all to keep every expert in high precision. Their names join the summary and
    ``float8_converted_fqns``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"convert_to_float8_training expects an nn.Module; got {type(module).__name__}")
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise TypeError(f"module_filter_fn must be a callable (module, fqn) -> bool or None; got {module_filter_fn!r}")
    config = check_config(config)
    # Every converter appends the names it converted here; the summary reports them all.
    converted: list[str] = []
    skipped: dict[str, list[str]] = {}
    candidates = 0

    def convert_one(mod: nn.Module, fqn: str) -> nn.Module | None:
        """The FP8 replacement of ``mod``, or None (not a linear, or skipped)."""
        nonlocal candidates
        if isinstance(mod, Float8Linear):
            return None
        transposed = is_transposed_linear(mod)
        if not (transposed or isinstance(mod, nn.Linear)):
            return None
        candidates += 1
        name = fqn or "<root>"
        if not transposed and type(mod).forward is not nn.Linear.forward:
            skipped.setdefault(_SKIP_FORWARD, []).append(name)
            return None
        if module_filter_fn is not None and not module_filter_fn(mod, fqn):
            skipped.setdefault(_SKIP_FILTER, []).append(name)
            return None
        in_features, out_features = mod.weight.shape if transposed else (mod.in_features, mod.out_features)
        if not dims_ok(in_features, out_features, config):
            logger.warning(
                "f8tensor: left %s (%d -> %d) in high precision: FP8 GEMMs need dimensions that are "
                "multiples of %d (set pad_inner_dim=True to pad instead)",
                name, in_features, out_features, ALIGN,
            )
            skipped.setdefault(_SKIP_DIMS, []).append(name)
            return None
        if transposed and config.enable_fsdp_float8_all_gather:
            skipped.setdefault(_SKIP_FSDP, []).append(name)
            return None
        converted.append(fqn)
        return Float8Conv1D.from_conv1d(mod, config) if transposed else _convert_linear(mod, config)

    root = convert_one(module, "")
    if root is None:
        for fqn, mod in list(module.named_modules()):
            for name, child in list(mod.named_children()):
                new = convert_one(child, f"{fqn}.{name}" if fqn else name)
                if new is not None:
                    setattr(mod, name, new)
    # FP8 expert weights (3D parameters of MoE experts modules): their own converter.
    # Experts take FP8 casts only: under FP4 or per-GEMM formats they stay in high precision.
    skip_experts = root is not None or config.uses_gemm_formats
    experts = [] if skip_experts else convert_experts_to_float8(module, config, experts_filter_fn)
    converted.extend(experts)
    if root is None and config.enable_fsdp_float8_all_gather:
        keep_tied_weights_tied(module)
    result = module if root is None else root
    _report_conversion(converted, skipped, candidates, len(experts))
    result.float8_converted_fqns = tuple(converted)
    return result


def _report_conversion(converted: list[str], skipped: dict[str, list[str]], candidates: int, experts: int = 0) -> None:
    """One summary line; a warning (also through ``warnings``) when nothing converted."""

    def names(fqns: list[str]) -> str:
        return ", ".join(fqns[:4]) + (f", ... ({len(fqns) - 4} more)" if len(fqns) > 4 else "")

    reasons = "; ".join(f"{len(fqns)} {reason} [{names(fqns)}]" for reason, fqns in skipped.items())
    line = f"f8tensor: converted {len(converted) - experts} of {candidates} linear layers to FP8"
    line += f" and {experts} expert weights" if experts else ""
    line += f"; skipped {reasons}" if reasons else ""
    if converted:
        logger.info(line)
        return
    if not candidates:
        line += ": the model has no nn.Linear (or Hugging Face Conv1D) layer"
    logger.warning(line)
    warnings.warn(line + "; the model trains in high precision", UserWarning, stacklevel=3)


def keep_tied_weights_tied(module: nn.Module) -> None:
    """Undo the untying that wrapping weights for FP8 all-gather causes, in place.

    ``wrap_weight`` gives a converted layer a new Parameter over the same storage; a weight
    tied to another module (an embedding and its lm_head) would become two Parameters,
    which an optimizer then updates twice per step. Tied only among FP8 layers: they share
    one wrapped Parameter. Tied to anything else (an embedding looks rows up in high
    precision, which an FP8 all-gathered weight cannot serve): every user gets the one plain
    Parameter back, and those FP8 layers all-gather that weight in high precision (their
    config says so; a warning names them).
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
        if all_fp8:
            shared = wrapped[0]
        else:
            plain = [p for _, _, p in group if not isinstance(p, Float8AllGatherWeight)]
            shared = plain[0]
            names = sorted({type(m).__name__ for m, _, _ in group})
            logger.warning(
                "f8tensor: a weight tied between %s stays one high-precision Parameter: FP8 all-gather is "
                "off for it (only Float8Linear layers can use an FP8-gathered weight)", ", ".join(names),
            )
        for mod, name, param in group:
            if param is not shared:
                setattr(mod, name, shared)
            if not all_fp8 and isinstance(mod, Float8Linear):
                mod.config = dataclasses.replace(mod.config, enable_fsdp_float8_all_gather=False)


# ===================================================================== layer policies

#: The dotted-name pattern of a transformer block index: ``layers.3``, ``h.3``, ``blocks.3``.
BLOCK_PATTERN = r"(?:^|\.)(?:layers|h|blocks)\.(\d+)(?:\.|$)"


def _block_index(fqn: str, pattern: str) -> int | None:
    match = re.search(pattern, fqn)
    return int(match.group(1)) if match else None


def keep_last_blocks_in_hp(model: nn.Module, n: int, *, block_pattern: str = BLOCK_PATTERN) -> Callable[[nn.Module, str], bool]:
    """A ``module_filter_fn`` that leaves the layers of the last ``n`` blocks in high precision
    (the NVFP4 recipe's ~15% of blocks kept in bf16). Blocks are found by ``block_pattern``
    (default: ``layers.<i>``, ``h.<i>``, ``blocks.<i>``); layers outside any block are converted."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0; got {n!r}")
    indices = {i for name, _ in model.named_modules() if (i := _block_index(name, block_pattern)) is not None}
    cutoff = (max(indices) - n + 1) if indices and n else None

    def module_filter_fn(mod: nn.Module, fqn: str) -> bool:
        index = _block_index(fqn, block_pattern)
        return cutoff is None or index is None or index < cutoff

    return module_filter_fn


def block_policy(
    model: nn.Module,
    config: Float8LinearConfig,
    *,
    hp_last_blocks: int = 0,
    edge_config: Float8LinearConfig | None = None,
    block_pattern: str = BLOCK_PATTERN,
) -> Callable[[nn.Module, str], Float8LinearConfig | None]:
    """A layer policy for :func:`convert_with_policy`: ``config`` for every linear layer,
    except the layers of the last ``hp_last_blocks`` blocks (high precision: ``None``) and,
    with ``edge_config``, the first and the last linear layer of the model (e.g. an FP8
    recipe around an FP4 body)."""
    keep = keep_last_blocks_in_hp(model, hp_last_blocks, block_pattern=block_pattern)
    linears = [name for name, mod in model.named_modules() if isinstance(mod, nn.Linear) or is_transposed_linear(mod)]
    edges = {linears[0], linears[-1]} if linears and edge_config is not None else set()

    def policy(mod: nn.Module, fqn: str) -> Float8LinearConfig | None:
        if fqn in edges:
            return edge_config
        return config if keep(mod, fqn) else None

    return policy


def convert_with_policy(
    module: nn.Module, policy: Callable[[nn.Module, str], Float8LinearConfig | None], **kwargs: object
) -> nn.Module:
    """:func:`convert_to_float8_training` with a config per layer: ``policy(mod, fqn)`` returns
    the layer's config, or ``None`` to keep it in high precision. One conversion per distinct
    config (each converts the layers the policy gives it)."""
    choices = {fqn: policy(mod, fqn) for fqn, mod in module.named_modules()
               if isinstance(mod, nn.Linear) or is_transposed_linear(mod)}
    configs = list(dict.fromkeys(c for c in choices.values() if c is not None))
    for config in configs:
        convert_to_float8_training(
            module, config=config, module_filter_fn=lambda mod, fqn, c=config: choices.get(fqn) == c, **kwargs
        )
    return module


def set_gemm_formats(model: nn.Module, overrides: dict) -> int:
    """Merge per-GEMM format ``overrides`` (see ``Float8LinearConfig.gemm_overrides``) into
    the config of every Float8Linear of a running model. Parameters, buffers and the
    optimizer are untouched (the layers stay the same objects). Returns how many layers changed."""
    count = 0
    for mod in model.modules():
        if isinstance(mod, Float8Linear):
            mod.config = mod.config.with_gemm_formats(overrides)
            count += 1
    return count


def set_forward_in_high_precision(model: nn.Module) -> int:
    """Run the forward GEMM of every Float8Linear in high precision from now on (the NVFP4
    recipe's late-training switch: the last stretch of tokens with a bf16 forward); the
    backward GEMMs keep their formats. Returns how many layers changed."""
    return set_gemm_formats(model, {("forward", "input"): None, ("forward", "weight"): None})
