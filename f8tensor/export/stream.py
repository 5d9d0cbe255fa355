"""The tensors of an FP8 checkpoint, made one layer at a time, in memory.

The one place they are made: ``save_fp8_pretrained`` writes what :func:`iter_fp8_weights` yields,
so a file and an in-memory hand-off to a rollout engine hold the same bytes.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from f8tensor.compat import dtensor_local, dtensor_local_offset
from f8tensor.export.frozen import FrozenFloat8Linear, FrozenFloat8Weight, frozen_weight, granularity_of_block
from f8tensor.export.frozen_experts import CHECKPOINT_SCALE, FrozenFloat8ExpertWeight
from f8tensor.moe import Float8ExpertWeight
from f8tensor.nn.linear import Float8Linear
from f8tensor.quant.block_quantizers import export_quantizer
from f8tensor.quant.formats import check_hp_dtype
from f8tensor.quant.specs import BLOCK_128x128, BlockGranularity, Granularity, MX_1x32
from f8tensor.tensor.float8 import Float8Tensor, dequantize
from f8tensor.tensor.weights import HighPrecisionWeight

__all__ = ["FORMATS", "SCALE_FMTS", "STRATEGIES", "fp8_state_dict", "iter_fp8_weights"]

#: The checkpoint formats :func:`save_fp8_pretrained` writes.
FORMATS = ("fp8_block", "mxfp8", "compressed_tensors")
#: compressed-tensors weight strategies.
STRATEGIES = ("tensor", "channel", "block")
#: ``scale_fmt`` values beside ``None``: ``"ue8m0"``, fp32 multipliers that are all powers of two.
SCALE_FMTS = ("ue8m0",)

_GRANULARITY: dict[str, Granularity | BlockGranularity] = {
    "fp8_block": BLOCK_128x128,
    "mxfp8": MX_1x32,
    "tensor": Granularity.TENSORWISE,
    "channel": Granularity.ROWWISE,
    "block": BLOCK_128x128,
}
_E8M0_BIAS = 127
# A repeated block of the model ("model.layers.3"): the unit whose tensors are made together.
_LAYER = re.compile(r"^(.*?\.\d+)(?:\.|$)")


class _Export(NamedTuple):
    """One export's arguments, checked: ``strategy`` is ``"block"``/``"mx"`` for the block formats."""

    format: str
    strategy: str
    scale_fmt: str | None
    scale_suffix: str
    granularity: Granularity | BlockGranularity
    power_of_2: bool


def _is_pretrained_model(model: object) -> bool:
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.") for c in type(model).__mro__
    )


def _weight_configs(model: nn.Module) -> dict[str, Any]:
    """{name: Float8LinearConfig} of every converted layer and expert weight."""
    found: dict[str, Any] = {}
    for fqn, mod in model.named_modules():
        if isinstance(mod, Float8Linear):
            found[fqn] = mod.config
        for name, p in mod.named_parameters(recurse=False):
            local = dtensor_local(p) if _is_dtensor(p) else p
            if isinstance(local, (Float8ExpertWeight, FrozenFloat8ExpertWeight)):
                found[f"{fqn}.{name}"] = local._config
    return found


def _default_strategy(model: nn.Module, who: str) -> str:
    """The compressed-tensors strategy matching the model's weight casts (rowwise -> channel,
    128x128 blocks -> block, anything else -> tensor)."""
    found = set()
    for config in _weight_configs(model).values():
        g = config.weight.granularity
        found.add("channel" if g is Granularity.ROWWISE else "block" if g == BLOCK_128x128 else "tensor")
    if len(found) > 1:
        raise ValueError(
            f"{who}: the model's layers use different weight granularities ({sorted(found)}); "
            f"pass strategy= (one of {STRATEGIES})"
        )
    return found.pop() if found else "tensor"


def _check_power_of_2(model: nn.Module, who: str) -> None:
    """Every FP8 weight is cast with power-of-two scales by its recipe (a frozen one: checked at its cast)."""
    configs = _weight_configs(model)
    for key, p in _targets(model).items():
        name = key.removesuffix(".weight") if key.endswith(".weight") and key not in configs else key
        if isinstance(p, FrozenFloat8Weight) or (name in configs and configs[name].weight.power_of_2_scale):
            continue
        raise ValueError(
            f"{who}: scale_fmt='ue8m0' writes the power-of-two scales a recipe cast with; {key} "
            f"is not cast with power_of_2_scale=True (convert with a config whose weight CastConfig has "
            f"power_of_2_scale=True, or pass scale_fmt=None)"
        )


def export_options(model: nn.Module, format: str, strategy: str | None, scale_fmt: str | None, who: str) -> _Export:
    """The checked arguments of one export (``who`` names the caller in errors); raises as
    :func:`save_fp8_pretrained`."""
    if format not in FORMATS:
        raise ValueError(f"{who}: format must be one of {FORMATS}; got {format!r}")
    if strategy is not None and format != "compressed_tensors":
        raise ValueError(f"{who}: strategy= applies to format='compressed_tensors' only; got {format=}")
    if strategy is not None and strategy not in STRATEGIES:
        raise ValueError(f"{who}: strategy must be one of {STRATEGIES} or None; got {strategy!r}")
    if scale_fmt is not None and (scale_fmt not in SCALE_FMTS or format != "fp8_block"):
        raise ValueError(
            f"{who}: scale_fmt must be None, or one of {SCALE_FMTS} with format='fp8_block'; "
            f"got {scale_fmt=}, {format=}"
        )
    if not _is_pretrained_model(model):
        raise TypeError(
            f"{who}: model must be a transformers PreTrainedModel (the checkpoint's names and tied weights "
            f"are its); got {type(model).__name__}"
        )
    if scale_fmt is not None:
        _check_power_of_2(model, who)
    if format == "compressed_tensors":
        chosen = strategy or _default_strategy(model, who)
        return _Export(format, chosen, None, "_scale", _GRANULARITY[chosen], False)
    chosen = "block" if format == "fp8_block" else "mx"
    return _Export(format, chosen, scale_fmt, "_scale_inv", _GRANULARITY[format], scale_fmt is not None)


def _is_dtensor(t: object) -> bool:
    return isinstance(t, DTensor)


def _output_embeddings(model: nn.Module) -> object:
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def _targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """{state_dict key: parameter} of the weights to write in FP8."""
    out_emb = _output_embeddings(model)
    configs = _weight_configs(model)
    targets: dict[str, torch.Tensor] = {}
    for fqn, mod in model.named_modules():
        if mod is out_emb:
            continue
        prefix = f"{fqn}." if fqn else ""
        if isinstance(mod, nn.Linear) and (isinstance(mod, Float8Linear) or not configs):
            targets[prefix + "weight"] = mod.weight
            continue
        n = getattr(mod, "num_experts", None)
        for name, p in mod.named_parameters(recurse=False):
            is_experts = isinstance(n, int) and p.dim() == 3 and p.shape[0] == n
            if prefix + name in configs or (is_experts and not configs):
                targets[prefix + name] = p
    return targets


def _cast(w: torch.Tensor, options: _Export) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 data, multiplier scale with one row per data row) of a 2D weight as stored.

    Rows are repeated so that transformers' weight conversion carries scales and data alike.
    """
    data, scale = export_quantizer(options.granularity, options.power_of_2).quantize(w)
    return _stored_rows(data, _multiplier(scale), options.granularity)


def _multiplier(scale: torch.Tensor) -> torch.Tensor:
    """The on-disk multiplier of f8tensor's ``_scale``."""
    if scale.dtype == torch.float8_e8m0fnu:
        # 1 / 2**(c - 127) = 2**((254 - c) - 127): the inverse multiplier's code, exact.
        return (2 * _E8M0_BIAS - scale.view(torch.uint8).to(torch.int16)).to(torch.uint8)
    return torch.reciprocal(scale.to(torch.float32))


def _frozen_cast(
    w: torch.Tensor, checkpoint_scale: torch.Tensor, options: _Export, who: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_cast` of a frozen 2D weight: its bytes and the file's multiplier (``checkpoint_scale``) where
    the granularity is the checkpoint's (and still held), else a cast of the dequantized weight."""
    assert isinstance(w, Float8Tensor)  # a frozen layer holds its FP8 weight
    granularity = options.granularity
    if not isinstance(w, FrozenFloat8Weight) or granularity_of_block(w._block, w._scale.dtype) != granularity:
        return _cast(dequantize(w, torch.float32), options)
    held = _multiplier(w._scale)
    m = checkpoint_scale.to(held.dtype).reshape(held.shape)
    if torch.equal(_multiplier(torch.reciprocal(m)) if m.is_floating_point() else m, held):
        held = m  # the layer still holds the file's bytes: the file's multiplier, not its fp32 round trip
    if options.power_of_2 and not bool((torch.frexp(held.float()).mantissa == 0.5).all()):
        raise ValueError(f"{who}: scale_fmt='ue8m0' needs power-of-two scales; a frozen weight's are not")
    return _stored_rows(w._data, held, granularity)


def _stored_rows(
    data: torch.Tensor, inv: torch.Tensor, granularity: Granularity | BlockGranularity
) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, multiplier with one row per data row)."""
    if inv.dim() == 0:
        inv = inv.reshape(1, 1)
    if isinstance(granularity, BlockGranularity):
        inv = inv.repeat_interleave(granularity.block[0], dim=0)[: data.shape[0]]
    return data, inv.expand(data.shape[0], inv.shape[1]).contiguous()


def _squeeze_rows(scale: torch.Tensor, key: str, strategy: str, who: str) -> torch.Tensor:
    """The on-disk scale of one weight from its row-repeated form (see :func:`_cast`)."""
    if strategy == "block":
        squeezed = scale[::128].contiguous()
        # A piece of a weight the model's conversion split: its blocks must be the model's blocks.
        if not torch.equal(squeezed.repeat_interleave(128, dim=0)[: scale.shape[0]], scale):
            raise ValueError(
                f"{who}: {key}: the model's weight conversion cuts it out of a larger tensor at a row inside a "
                f"128x128 scale block, which its own scale cannot express (leave the layer out of "
                f"convert_to_float8_training, or pick another format/strategy)"
            )
        return squeezed
    if strategy == "tensor":
        if not torch.equal(scale, scale[:1, :1].expand_as(scale)):
            raise NotImplementedError(f"{who}: {key}: the model's weight conversion mixes tensors")
        return scale[0, :1].contiguous()
    return scale.contiguous()


def _check_blockable(key: str, shape: tuple[int, ...], strategy: str, who: str) -> None:
    """Refuse a weight its format's readers cannot block: MXFP8 needs K a multiple of 32 (128x128 blocks
    take any shape: a last partial block has its own scale, as DeepSeek-V3 and compressed-tensors store it)."""
    n, k = shape
    if strategy == "mx" and k % 32:
        raise ValueError(f"{who}: {key} has N={n}, K={k}: MXFP8 blocks of 32 need K a multiple of 32")


def _transformers(model: nn.Module, name: str) -> Any:
    """``transformers.<name>`` of the model's own transformers (FSDP2 renames the model's class), or None."""
    found = next(c for c in type(model).__mro__ if c.__name__ == "PreTrainedModel")
    return sys.modules.get(f"{found.__module__.split('.', 1)[0]}.{name}")


def _revert_names(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' own reversal of its load-time weight conversion, found without importing transformers."""
    revert = getattr(_transformers(model, "core_model_loading"), "revert_weight_conversion", None)
    return state_dict if revert is None else revert(model, state_dict)


def _saved_keys(model: nn.Module) -> dict[str, torch.Tensor]:
    """{key: tensor} of the state dict ``save_pretrained`` writes: no Float8Linear delayed state, no
    ``_keys_to_ignore_on_save``, one name per tied tensor (transformers' own choice of it)."""
    float8_buffers = {
        f"{fqn}.{name}" if fqn else name
        for fqn, mod in model.named_modules()
        if isinstance(mod, Float8Linear)
        for name in mod.float8_state()
    }
    state = {k: v for k, v in model.state_dict().items() if k not in float8_buffers}
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    untie = getattr(_transformers(model, "modeling_utils"), "remove_tied_weights_from_state_dict", None)
    if untie is None:
        return state
    # Ties are storage shared: a DTensor's shards, and a weight subclass's plain tensor, share it too.
    kept = untie({k: _storage_of(v) for k, v in state.items()}, model)
    return {k: v for k, v in state.items() if k in kept}


def _units(keys: list[str]) -> list[list[str]]:
    """Consecutive keys grouped by layer ("model.layers.3"), or by module outside repeated layers."""
    units: list[list[str]] = []
    last = None
    for key in keys:
        match = _LAYER.match(key)
        unit = match.group(1) if match else key.rsplit(".", 1)[0]
        if unit != last:
            units.append([])
            last = unit
        units[-1].append(key)
    return units


def _plain(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if isinstance(t, HighPrecisionWeight):
        return t._hp.detach()
    return t.as_subclass(torch.Tensor) if type(t) is not torch.Tensor else t


def _storage_of(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor on ``t``'s storage (a DTensor's shard, a wrapper's data)."""
    t = dtensor_local(t) if _is_dtensor(t) else t
    return t._data if isinstance(t, Float8Tensor) else _plain(t)


def _full(t: Any) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective: every rank calls it), plain."""
    local = _plain(dtensor_local(t))
    return DTensor.from_local(
        local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
    ).full_tensor()


def _check_local(key: str, t: torch.Tensor, options: _Export, who: str) -> None:
    """Refuse a rank's piece of an FP8 weight that cuts a scale block."""
    shape, offset = dtensor_local_offset(t)
    if shape == tuple(t.shape):
        return
    block = {"block": (128, 128), "mx": (1, 32), "channel": (1, t.shape[-1]), "tensor": tuple(t.shape[-2:])}
    for size, start, full, b in zip(shape[-2:], offset[-2:], t.shape[-2:], block[options.strategy], strict=True):
        if size and (start % b or ((start + size) % b and start + size != full)):
            raise ValueError(
                f"{who}: {key}: this rank holds [{start}:{start + size}] of a dimension of {full}, which cuts "
                f"a scale block of {b} ({options.strategy}); pass gather=True for the whole weight"
            )


def _check_renamed_only(model: nn.Module, key: str, t: torch.Tensor, who: str) -> None:
    """Refuse a rank's piece whose checkpoint names are not one tensor of the same shape."""
    if not _is_dtensor(t) or dtensor_local_offset(t)[0] == tuple(t.shape):
        return
    probe = _revert_names(model, {key: torch.empty(t.shape, dtype=torch.uint8, device="meta")})
    if len(probe) != 1 or next(iter(probe.values())).shape != t.shape:
        raise NotImplementedError(
            f"{who}: {key}: its checkpoint names ({sorted(probe)[:2]}...) split the tensor, and this rank holds a "
            f"piece of it; pass gather=True for the whole tensor"
        )


class _Sources(NamedTuple):
    """The model's tensors by state_dict key: all saved ones, those written in FP8, frozen weights with the
    file's multipliers."""

    saved: dict[str, torch.Tensor]
    targets: dict[str, torch.Tensor]
    frozen: dict[str, tuple[torch.Tensor, torch.Tensor]]


def _unit(
    model: nn.Module, keys: list[str], sources: _Sources, options: _Export, gather: bool, who: str
) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint tensors of one unit's keys, in order, each scale after its weight."""
    targets = sources.targets
    state: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for key in keys:
        t = targets.get(key, sources.saved[key])
        if t.is_meta:
            raise ValueError(
                f"{who}: {key} is on the meta device and has no values to write; materialise the model "
                f"(load or initialise its weights) first"
            )
        if key in sources.frozen:
            if _is_dtensor(t):
                raise NotImplementedError(f"{who}: {key}: a frozen FP8 layer sharded by FSDP2/TP is not exported")
            w, m = sources.frozen[key]
            if isinstance(w, FrozenFloat8ExpertWeight):  # per expert, as loaded
                pairs = [_frozen_cast(frozen_weight(w.expert(e)), m[e], options, who) for e in range(w.shape[0])]
                state[key] = torch.stack([d for d, _ in pairs])
                scales[key] = torch.stack([s for _, s in pairs])
            else:
                state[key], scales[key] = _frozen_cast(w, m, options, who)
            continue
        if not gather:
            _check_renamed_only(model, key, t, who)
        if key not in targets:
            state[key] = (_full(t) if gather else dtensor_local(t).detach()) if _is_dtensor(t) else t.detach()
            continue
        if _is_dtensor(t) and not gather:
            if t.dim() == 2:
                _check_blockable(key, tuple(t.shape), options.strategy, who)
            _check_local(key, t, options, who)
        w = (_full(t) if gather else _plain(dtensor_local(t))) if _is_dtensor(t) else _plain(t)
        if not bool(torch.isfinite(w).all()):
            raise ValueError(f"{who}: {key} holds non-finite values; they have no FP8 encoding")
        check_hp_dtype(w.dtype, f"{who}: {key}")
        if w.dim() == 2:
            state[key], scales[key] = _cast(w, options)
        else:  # experts (E, N, K): one cast per expert, as the training casts them
            pairs = [_cast(w[e], options) for e in range(w.shape[0])]
            state[key] = torch.stack([d for d, _ in pairs])
            scales[key] = torch.stack([s for _, s in pairs])
        del w
    disk = _revert_names(model, state)
    disk_scales = _revert_names(model, scales)
    out: list[tuple[str, torch.Tensor]] = []
    for key, data in disk.items():
        out.append((key, data))
        scale = disk_scales.get(key)
        if scale is None:
            continue
        if not key.endswith(".weight") or data.dim() != 2 or scale.shape[0] != data.shape[0]:
            raise NotImplementedError(
                f"{who}: {type(model).__name__}'s checkpoint names {key} "
                f"{tuple(data.shape)} do not keep a linear weight's rows; FP8 export supports "
                f"weight conversions that split experts and concatenated projections"
            )
        # A rank's piece passes where its whole weight did (_check_local keeps its cuts on blocks).
        _check_blockable(key, tuple(data.shape), options.strategy, who)
        out.append((key + options.scale_suffix, _squeeze_rows(scale, key, options.strategy, who)))
    return out


def generate_fp8_weights(
    model: nn.Module, options: _Export, gather: bool, who: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """The generator of :func:`iter_fp8_weights`, for checked ``options``."""
    saved = _saved_keys(model)
    targets = _targets(model)
    frozen = {
        f"{fqn}.weight": (m.weight, m.checkpoint_scale)
        for fqn, m in model.named_modules()
        if isinstance(m, FrozenFloat8Linear)
    }
    for fqn, mod in model.named_modules():
        for name, p in mod.named_parameters(recurse=False):
            if isinstance(p, FrozenFloat8ExpertWeight):
                frozen[f"{fqn}.{name}" if fqn else name] = (p, getattr(mod, CHECKPOINT_SCALE.format(name)))
    for keys in _units(list(saved)):
        # no_grad around the work only: a context held across a yield would reach the caller's code.
        with torch.no_grad():
            pairs = _unit(model, keys, _Sources(saved, targets, frozen), options, gather, who)
        # Popped as yielded: once the next unit starts, the generator holds none of this one's.
        pairs.reverse()
        while pairs:
            yield pairs.pop()


def iter_fp8_weights(
    model: nn.Module,
    *,
    format: str = "fp8_block",
    strategy: str | None = None,
    scale_fmt: str | None = None,
    gather: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every tensor :func:`save_fp8_pretrained` writes, one layer at a time.

    Names, dtypes, shapes and bytes are the file's; a layer's tensors are made when the first of
    them is asked for and dropped by the generator when the next layer starts (hold on to them
    only as long as needed). High-precision tensors are the model's own (detached, not copies).

    Args:
        model: a transformers ``PreTrainedModel``, converted or not, possibly FSDP2/TP-sharded.
        format, strategy, scale_fmt: as for :func:`save_fp8_pretrained`.
        gather: for DTensor parameters: ``True`` yields whole tensors (every rank must iterate,
            in step: each layer gathers); ``False`` yields this rank's piece of each tensor.
    Returns:
        A generator; the arguments are checked when it is made.
    Raises:
        TypeError, ValueError: as :func:`save_fp8_pretrained` (at the call, or at the weight).
        ValueError: ``gather=False`` and this rank's piece of an FP8 weight cuts a scale block.
        NotImplementedError: ``gather=False`` and a piece whose checkpoint names split it.
    """
    return _checked_generator(model, format, strategy, scale_fmt, gather, "iter_fp8_weights")


def _checked_generator(
    model: nn.Module, format: str, strategy: str | None, scale_fmt: str | None, gather: bool, who: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`generate_fp8_weights` after checking the arguments (``who`` names the caller in errors)."""
    options = export_options(model, format, strategy, scale_fmt, who)
    if not isinstance(gather, bool):
        raise TypeError(f"{who}: gather must be a bool; got {gather!r}")
    return generate_fp8_weights(model, options, gather, who)


def fp8_state_dict(
    model: nn.Module, *, format: str = "fp8_block", strategy: str | None = None, scale_fmt: str | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor :func:`save_fp8_pretrained` writes with the same arguments, in memory.

    Under FSDP2/TP the tensors are whole (every rank calls it). High-precision tensors are the
    model's own, as :func:`iter_fp8_weights` yields them. Raises as :func:`iter_fp8_weights`.
    """
    return dict(_checked_generator(model, format, strategy, scale_fmt, True, "fp8_state_dict"))
