"""Layer policies: which config each linear layer of a model gets, by its name, and the
setters that change the recipes of a converted model in place.

Transformer blocks are found by name (:data:`BLOCK_PATTERN`); ``convert`` applies the result.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from functools import partial

from torch import nn

from f8tensor.moe import check_expert_config, expert_configs, set_expert_config
from f8tensor.nn.attention import attention_config, set_attention_config
from f8tensor.nn.linear import Float8Linear, dims_ok, is_transposed_linear
from f8tensor.quant.config import Float8LinearConfig

__all__ = [
    "BLOCK_PATTERN",
    "attention_dims_ok",
    "block_policy",
    "keep_last_blocks_in_hp",
    "set_forward_in_high_precision",
    "set_gemm_formats",
]

#: The dotted-name pattern of a transformer block index: ``layers.3``, ``h.3``, ``blocks.3``.
BLOCK_PATTERN = r"(?:^|\.)(?:layers|h|blocks)\.(\d+)(?:\.|$)"


def _block_index(fqn: str, pattern: str) -> int | None:
    match = re.search(pattern, fqn)
    return int(match.group(1)) if match else None


def keep_last_blocks_in_hp(
    model: nn.Module, n: int, *, block_pattern: str = BLOCK_PATTERN
) -> Callable[[nn.Module, str], bool]:
    """A ``module_filter_fn`` keeping the last ``n`` blocks (by ``block_pattern``) in high precision."""
    _check_block_args("keep_last_blocks_in_hp", model, "n", n, block_pattern)
    return _keep_last_blocks(model, n, block_pattern)


def _check_block_args(fn: str, model: object, count_name: str, count: object, block_pattern: object) -> None:
    """Validate the arguments shared by :func:`keep_last_blocks_in_hp` and :func:`block_policy`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}: model must be an nn.Module; got {type(model).__name__}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(
            f"{fn}: {count_name} must be an int >= 0 (how many trailing blocks stay in high precision); got {count!r}"
        )
    if not isinstance(block_pattern, str):
        raise TypeError(
            f"{fn}: block_pattern must be a regular expression (str) with one group capturing the block index; got {block_pattern!r}"
        )
    try:
        groups = re.compile(block_pattern).groups
    except re.error as e:
        raise ValueError(f"{fn}: block_pattern is not a valid regular expression ({e}); got {block_pattern!r}") from e
    if groups < 1:
        raise ValueError(
            f"{fn}: block_pattern must have a group capturing the block index (e.g. r'layers\\.(\\d+)'); got {block_pattern!r}"
        )


def _keep_last_blocks(model: nn.Module, n: int, block_pattern: str) -> Callable[[nn.Module, str], bool]:
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
    except the last ``hp_last_blocks`` blocks (``None``: high precision) and, with
    ``edge_config``, the model's first and last linear layer.

    Raises:
        TypeError: ``model``, ``config``, ``edge_config`` or ``block_pattern`` of the wrong type.
        ValueError: ``hp_last_blocks`` is not an int >= 0, or ``block_pattern`` has no index group.
    """
    _check_block_args("block_policy", model, "hp_last_blocks", hp_last_blocks, block_pattern)
    for arg, value in (("config", config), ("edge_config", edge_config)):
        if not isinstance(value, Float8LinearConfig) and not (arg == "edge_config" and value is None):
            allowed = "a Float8LinearConfig" + (" or None" if arg == "edge_config" else "")
            raise TypeError(
                f"block_policy: {arg} must be {allowed} (e.g. Float8LinearConfig.from_recipe('rowwise')); got {value!r}"
            )
    keep = _keep_last_blocks(model, hp_last_blocks, block_pattern)
    linears = [name for name, mod in model.named_modules() if isinstance(mod, nn.Linear) or is_transposed_linear(mod)]
    edges = {linears[0], linears[-1]} if linears and edge_config is not None else set()

    def policy(mod: nn.Module, fqn: str) -> Float8LinearConfig | None:
        if fqn in edges:
            return edge_config
        return config if keep(mod, fqn) else None

    return policy


# ===================================================================== the recipes of a converted model


def attention_dims_ok(mha: nn.MultiheadAttention, config: Float8LinearConfig) -> bool:
    """Whether ``config``'s GEMMs take ``mha``'s projection dims."""
    e = mha.embed_dim
    return all(dims_ok(k, e, config) for k in (e, mha.kdim, mha.vdim))


def _check_attention(mha: nn.MultiheadAttention, config: Float8LinearConfig) -> None:
    if not attention_dims_ok(mha, config):
        raise ValueError(
            f"its dims (embed_dim {mha.embed_dim}, kdim {mha.kdim}, vdim {mha.vdim}) do not fit these GEMMs"
        )


def _fp8_gemm_owners(model: nn.Module) -> Iterator[tuple[str, Float8LinearConfig, Callable, Callable]]:
    """``(what, recipe, check, set)`` per recipe holder of ``model``."""
    for name, mod in model.named_modules():
        if isinstance(mod, Float8Linear):
            yield f"layer {name!r}", mod.config, mod.check_new_config, partial(setattr, mod, "config")
        elif (config := attention_config(mod)) is not None:
            yield (
                f"attention {name!r}",
                config,
                partial(_check_attention, mod),
                partial(set_attention_config, mod),
            )
        for p, config in expert_configs(mod).items():
            what = f"expert weight {name + '.' + p if name else p!r}"
            yield what, config, partial(check_expert_config, mod, p), partial(set_expert_config, mod, p)


def set_gemm_formats(model: nn.Module, overrides: dict) -> int:
    """Merge per-GEMM format ``overrides`` into every FP8 recipe of ``model`` (layers, attentions,
    expert weights), all or nothing.

    Returns:
        How many changed.

    Raises:
        TypeError, ValueError: one of them refuses the overrides (named; nothing was changed).
    """
    planned = []
    for what, config, check, apply in _fp8_gemm_owners(model):
        try:
            config = config.with_gemm_formats(overrides)
            check(config)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{what} refuses the per-GEMM formats {overrides!r} (nothing was changed): {e}") from e
        planned.append((apply, config))
    for apply, config in planned:
        apply(config)
    return len(planned)


def set_forward_in_high_precision(model: nn.Module) -> int:
    """Run every FP8 forward GEMM of ``model`` in high precision (backward keeps its formats).

    Returns:
        How many layers, attentions and expert weights changed.
    """
    return set_gemm_formats(model, {("forward", "input"): None, ("forward", "weight"): None})
