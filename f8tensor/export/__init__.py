"""Export a (trained) Hugging Face model as an FP8 checkpoint that inference engines read.

:func:`save_fp8_pretrained` writes what ``model.save_pretrained`` writes, with each FP8
linear's weight stored in FP8 next to its scale and the ``quantization_config`` of:

- ``"fp8_block"``: DeepSeek-V3 blocks (vLLM, SGLang, transformers): e4m3fn ``weight``,
  fp32 ``weight_scale_inv`` (N/128, K/128);
- ``"mxfp8"``: uint8 e8m0 ``weight_scale_inv`` (N, K/32);
- ``"compressed_tensors"``: ``float-quantized`` ``weight`` and fp32 ``weight_scale``,
  strategy ``"tensor"`` (1,), ``"channel"`` (N, 1) or ``"block"`` (N/128, K/128).

Scales on disk are multipliers (``weight.float() * scale``): the exact fp32 reciprocal of
f8tensor's ``_scale``, so a loader dequantizes bit for bit. Converted layers and expert
weights (or, unconverted, every ``nn.Linear`` and 3D expert tensor) go FP8; ``lm_head``,
embeddings, norms, routers and biases stay high precision and are listed as not converted.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from typing import Any, cast

import torch
from torch import nn

from f8tensor.export.frozen import FrozenFloat8Linear, FrozenFloat8Weight, frozen_weight, granularity_of_block
from f8tensor.export.frozen_experts import CHECKPOINT_SCALE, FrozenFloat8ExpertWeight
from f8tensor.export.load import load_fp8_pretrained
from f8tensor.moe import Float8ExpertWeight
from f8tensor.nn.linear import Float8Linear
from f8tensor.quant.block_quantizers import export_quantizer
from f8tensor.quant.formats import check_hp_dtype
from f8tensor.quant.specs import BLOCK_128x128, BlockGranularity, Granularity, MX_1x32
from f8tensor.tensor.float8 import Float8Tensor, dequantize

__all__ = ["FORMATS", "SCALE_FMTS", "STRATEGIES", "load_fp8_pretrained", "save_fp8_pretrained"]

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
# The names model.save_pretrained writes: one file, or an index naming its shards.
_WEIGHTS, _INDEX = "model.safetensors", "model.safetensors.index.json"


def _is_pretrained_model(model: object) -> bool:
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.") for c in type(model).__mro__
    )


def _default_strategy(model: nn.Module) -> str:
    """The compressed-tensors strategy matching the model's weight casts (rowwise -> channel,
    128x128 blocks -> block, anything else -> tensor)."""
    found = set()
    for mod in model.modules():
        config = mod.config if isinstance(mod, Float8Linear) else None
        for p in mod.parameters(recurse=False):
            if isinstance(p, (Float8ExpertWeight, FrozenFloat8ExpertWeight)):
                config = p._config
        if config is None:
            continue
        g = config.weight.granularity
        found.add("channel" if g is Granularity.ROWWISE else "block" if g == BLOCK_128x128 else "tensor")
    if len(found) > 1:
        raise ValueError(
            f"save_fp8_pretrained: the model's layers use different weight granularities ({sorted(found)}); "
            f"pass strategy= (one of {STRATEGIES})"
        )
    return found.pop() if found else "tensor"


def _output_embeddings(model: nn.Module) -> object:
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def _targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """{state_dict key: parameter} of the weights to write in FP8."""
    out_emb = _output_embeddings(model)
    converted = any(isinstance(m, Float8Linear) for m in model.modules()) or any(
        isinstance(p, (Float8ExpertWeight, FrozenFloat8ExpertWeight)) for p in model.parameters()
    )
    targets: dict[str, torch.Tensor] = {}
    for fqn, mod in model.named_modules():
        if mod is out_emb:
            continue
        prefix = f"{fqn}." if fqn else ""
        if isinstance(mod, nn.Linear) and (isinstance(mod, Float8Linear) or not converted):
            targets[prefix + "weight"] = mod.weight
            continue
        n = getattr(mod, "num_experts", None)
        for name, p in mod.named_parameters(recurse=False):
            is_experts = isinstance(n, int) and p.dim() == 3 and p.shape[0] == n
            if isinstance(p, (Float8ExpertWeight, FrozenFloat8ExpertWeight)) or (is_experts and not converted):
                targets[prefix + name] = p
    return targets


def _cast(
    w: torch.Tensor, granularity: Granularity | BlockGranularity, power_of_2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 data, multiplier scale with one row per data row) of a 2D weight as stored.

    Rows are repeated so that transformers' weight conversion carries scales and data alike.
    """
    data, scale = export_quantizer(granularity, power_of_2).quantize(w)
    return _stored_rows(data, _multiplier(scale), granularity)


def _multiplier(scale: torch.Tensor) -> torch.Tensor:
    """The on-disk multiplier of f8tensor's ``_scale``."""
    if scale.dtype == torch.float8_e8m0fnu:
        # 1 / 2**(c - 127) = 2**((254 - c) - 127): the inverse multiplier's code, exact.
        return (2 * _E8M0_BIAS - scale.view(torch.uint8).to(torch.int16)).to(torch.uint8)
    return torch.reciprocal(scale.to(torch.float32))


def _frozen_cast(
    w: torch.Tensor, checkpoint_scale: torch.Tensor, granularity: Granularity | BlockGranularity, power_of_2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_cast` of a frozen 2D weight: its bytes and the file's multiplier (``checkpoint_scale``) where the
    granularity is the checkpoint's (and still held), else a cast of the dequantized weight."""
    assert isinstance(w, Float8Tensor)  # a frozen layer holds its FP8 weight
    if not isinstance(w, FrozenFloat8Weight) or granularity_of_block(w._block, w._scale.dtype) != granularity:
        return _cast(dequantize(w, torch.float32), granularity, power_of_2)
    held = _multiplier(w._scale)
    m = checkpoint_scale.to(held.dtype).reshape(held.shape)
    if torch.equal(_multiplier(torch.reciprocal(m)) if m.is_floating_point() else m, held):
        held = m  # the layer still holds the file's bytes: the file's multiplier, not its fp32 round trip
    if power_of_2 and not bool((torch.frexp(held.float()).mantissa == 0.5).all()):
        raise ValueError("save_fp8_pretrained: scale_fmt='ue8m0' needs power-of-two scales; a frozen weight's are not")
    return _stored_rows(w._data, held, granularity)


def _check_power_of_2(model: nn.Module, targets: dict[str, torch.Tensor]) -> None:
    """Every FP8 weight is cast with power-of-two scales by its recipe (or held with them, frozen)."""
    recipes: dict[int, bool] = {}
    for mod in model.modules():
        if isinstance(mod, Float8Linear) and not isinstance(mod, FrozenFloat8Linear):
            recipes[id(mod.weight)] = mod.config.weight.power_of_2_scale
        for e in mod.parameters(recurse=False):
            if isinstance(e, Float8ExpertWeight):
                recipes[id(e)] = e._config.weight.power_of_2_scale
    for key, p in targets.items():
        if not isinstance(p, FrozenFloat8Weight) and not recipes.get(id(p), False):
            raise ValueError(
                f"save_fp8_pretrained: scale_fmt='ue8m0' writes the power-of-two scales a recipe cast with; {key} "
                f"is not cast with power_of_2_scale=True (convert with a config whose weight CastConfig has "
                f"power_of_2_scale=True, or pass scale_fmt=None)"
            )


def _stored_rows(
    data: torch.Tensor, inv: torch.Tensor, granularity: Granularity | BlockGranularity
) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, multiplier with one row per data row)."""
    if inv.dim() == 0:
        inv = inv.reshape(1, 1)
    if isinstance(granularity, BlockGranularity):
        inv = inv.repeat_interleave(granularity.block[0], dim=0)[: data.shape[0]]
    return data, inv.expand(data.shape[0], inv.shape[1]).contiguous()


def _squeeze_rows(scale: torch.Tensor, key: str, strategy: str) -> torch.Tensor:
    """The on-disk scale of one weight from its row-repeated form (see :func:`_cast`)."""
    if strategy == "block":
        return scale[::128].contiguous()
    if strategy == "tensor":
        if not torch.equal(scale, scale[:1, :1].expand_as(scale)):
            raise NotImplementedError(f"save_fp8_pretrained: {key}: the model's weight conversion mixes tensors")
        return scale[0, :1].contiguous()
    return scale.contiguous()


def _check_blockable(key: str, shape: torch.Size, strategy: str) -> None:
    n, k = shape
    if strategy == "block" and (n % 128 or k % 128):
        raise ValueError(
            f"save_fp8_pretrained: {key} has N={n}, K={k}: 128x128 blocks need N and K multiples of 128 "
            f"(leave the layer out of convert_to_float8_training, or pick another format/strategy)"
        )
    if strategy == "mx" and k % 32:
        raise ValueError(f"save_fp8_pretrained: {key} has N={n}, K={k}: MXFP8 blocks of 32 need K a multiple of 32")


def _quantization_config(
    format: str, strategy: str, skipped: list[str], scale_fmt: str | None = None
) -> dict[str, Any]:
    if format == "fp8_block":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": skipped,
            **({"scale_fmt": scale_fmt} if scale_fmt is not None else {}),
        }
    if format == "mxfp8":
        return {
            "quant_method": "mxfp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [1, 32],
            "scale_fmt": "ue8m0",
            "modules_to_not_convert": skipped,
        }
    block = strategy == "block"
    float8 = {"num_bits": 8, "type": "float", "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    **float8,
                    "group_size": None,
                    "strategy": strategy,
                    "block_structure": [128, 128] if block else None,
                    "dynamic": False,
                },
                # Activations cast at run time: per token, or per 1x128 tile beside 128x128 weight blocks.
                "input_activations": {
                    **float8,
                    "group_size": 128 if block else None,
                    "strategy": "group" if block else "token",
                    "dynamic": True,
                },
                "output_activations": None,
            }
        },
        "ignore": skipped,
        "kv_cache_scheme": None,
    }


def _revert_names(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' own reversal of its load-time weight conversion, found without importing transformers."""
    package = type(model).__module__.split(".", 1)[0]
    loading = sys.modules.get(f"{package}.core_model_loading")
    revert = getattr(loading, "revert_weight_conversion", None)
    return state_dict if revert is None else revert(model, state_dict)


def save_fp8_pretrained(
    model: nn.Module,
    save_directory: str | os.PathLike,
    format: str = "fp8_block",
    strategy: str | None = None,
    *,
    scale_fmt: str | None = None,
    max_shard_size: int | str = "50GB",
) -> None:
    """Write ``model`` as ``model.save_pretrained`` does, with its linear weights in FP8.

    Every cast is made and checked before anything is written, into a temporary directory
    moved in at the end: a failure leaves no partial directory. An earlier save's weight
    files are replaced; every other file is kept.

    Args:
        model: a transformers ``PreTrainedModel``.
        save_directory: where to write.
        format: ``"fp8_block"``, ``"mxfp8"`` or ``"compressed_tensors"`` (module docstring).
        strategy: compressed-tensors only: ``"tensor"``, ``"channel"`` or ``"block"``; default
            the one matching the model's recipe.
        scale_fmt: ``"ue8m0"`` (``format="fp8_block"`` only): power-of-two multipliers, named in
            the config; the model's recipe must cast weights with ``power_of_2_scale=True``.
        max_shard_size: as for ``save_pretrained``.
    Raises:
        TypeError: not a ``PreTrainedModel``, or a weight not bf16/fp16/fp32 (named).
        ValueError: an unknown ``format`` or ``strategy`` (or a strategy with another format);
            a weight the format cannot block, or with a non-finite value (named).
        NotImplementedError: a weight-name conversion that moves scales apart from their rows.

    Example::

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe("blockwise"),
                                   module_filter_fn=lambda m, fqn: fqn != "lm_head")
        ...  # train
        save_fp8_pretrained(model, "out/fp8", format="fp8_block")
        AutoModelForCausalLM.from_pretrained("out/fp8")  # vLLM / SGLang serve it as is
    """
    if format not in FORMATS:
        raise ValueError(f"save_fp8_pretrained: format must be one of {FORMATS}; got {format!r}")
    if strategy is not None and format != "compressed_tensors":
        raise ValueError(f"save_fp8_pretrained: strategy= applies to format='compressed_tensors' only; got {format=}")
    if strategy is not None and strategy not in STRATEGIES:
        raise ValueError(f"save_fp8_pretrained: strategy must be one of {STRATEGIES} or None; got {strategy!r}")
    if scale_fmt is not None and (scale_fmt not in SCALE_FMTS or format != "fp8_block"):
        raise ValueError(
            f"save_fp8_pretrained: scale_fmt must be None, or one of {SCALE_FMTS} with format='fp8_block'; "
            f"got {scale_fmt=}, {format=}"
        )
    if not _is_pretrained_model(model):
        raise TypeError(
            f"save_fp8_pretrained: model must be a transformers PreTrainedModel (it writes config.json and "
            f"the checkpoint's names); got {type(model).__name__}"
        )
    if format == "compressed_tensors":
        strategy = strategy or _default_strategy(model)
        scale_suffix = "_scale"
    else:
        strategy = "block" if format == "fp8_block" else "mx"
        scale_suffix = "_scale_inv"
    granularity = _GRANULARITY[format if format != "compressed_tensors" else strategy]

    targets = _targets(model)
    power_of_2 = scale_fmt == "ue8m0"
    if power_of_2:
        _check_power_of_2(model, targets)
    frozen = {
        id(m.weight): (m.weight, m.checkpoint_scale) for m in model.modules() if isinstance(m, FrozenFloat8Linear)
    }
    frozen_experts = {
        id(p): getattr(m, CHECKPOINT_SCALE.format(name))
        for m in model.modules()
        for name, p in m.named_parameters(recurse=False)
        if isinstance(p, FrozenFloat8ExpertWeight)
    }
    float8_buffers = {
        f"{fqn}.{name}" if fqn else name
        for fqn, mod in model.named_modules()
        if isinstance(mod, Float8Linear)
        for name, _ in mod.named_buffers(recurse=False)
    }
    state = {k: v for k, v in model.state_dict().items() if k not in float8_buffers}
    scales: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, p in targets.items():
            if id(p) in frozen:
                state[key], scales[key] = _frozen_cast(*frozen[id(p)], granularity, power_of_2)
                continue
            if id(p) in frozen_experts:  # per expert, as loaded
                m, experts = frozen_experts[id(p)], cast(FrozenFloat8ExpertWeight, p)
                pairs = [
                    _frozen_cast(frozen_weight(experts.expert(e)), m[e], granularity, power_of_2)
                    for e in range(p.shape[0])
                ]
                state[key] = torch.stack([d for d, _ in pairs])
                scales[key] = torch.stack([s for _, s in pairs])
                continue
            w = p._hp if isinstance(p, Float8ExpertWeight) else p.detach()
            w = w.as_subclass(torch.Tensor) if type(w) is not torch.Tensor else w
            if not bool(torch.isfinite(w).all()):
                raise ValueError(f"save_fp8_pretrained: {key} holds non-finite values; they have no FP8 encoding")
            check_hp_dtype(w.dtype, f"save_fp8_pretrained: {key}")
            if w.dim() == 2:
                state[key], scales[key] = _cast(w, granularity, power_of_2)
            else:  # experts (E, N, K): one cast per expert, as the training casts them
                pairs = [_cast(w[e], granularity, power_of_2) for e in range(w.shape[0])]
                state[key] = torch.stack([d for d, _ in pairs])
                scales[key] = torch.stack([s for _, s in pairs])
        disk = _revert_names(model, state)
        disk_scales = _revert_names(model, scales)
        for key, scale in disk_scales.items():
            data = disk[key]
            if not key.endswith(".weight") or data.dim() != 2 or scale.shape[0] != data.shape[0]:
                raise NotImplementedError(
                    f"save_fp8_pretrained: {type(model).__name__}'s checkpoint names {key} "
                    f"{tuple(data.shape)} do not keep a linear weight's rows; FP8 export supports "
                    f"weight conversions that split experts and concatenated projections"
                )
            _check_blockable(key, data.shape, strategy)
            disk[key + scale_suffix] = _squeeze_rows(scale, key, strategy)
    fp8_modules = {k.rsplit(".", 1)[0] for k in disk_scales}
    skipped = list(dict.fromkeys(k.rsplit(".", 1)[0] for k in disk if k.rsplit(".", 1)[0] not in fp8_modules))
    out_emb = _output_embeddings(model)
    for fqn, mod in model.named_modules():
        if mod is out_emb and fqn not in skipped:
            skipped.append(fqn)  # named even when tied (not in the file): a given list replaces the defaults
    config = _quantization_config(format, strategy if format == "compressed_tensors" else "", skipped, scale_fmt)
    _write(model, os.fspath(save_directory), disk, config, max_shard_size)


def _write(model: Any, save_directory: str, state: dict, quant_config: dict, max_shard_size: int | str) -> None:
    parent = os.path.dirname(os.path.abspath(save_directory))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".fp8-export-", dir=parent)
    try:
        model.save_pretrained(staging, state_dict=state, max_shard_size=max_shard_size, save_original_format=False)
        path = os.path.join(staging, "config.json")
        with open(path) as f:
            config = json.load(f)
        config["quantization_config"] = quant_config
        with open(path, "w") as f:
            f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if not os.path.isdir(save_directory):
            os.replace(staging, save_directory)
            return
        written = set(os.listdir(staging))
        stale = _previous_weights(save_directory) - written
        for name in written:
            os.replace(os.path.join(staging, name), os.path.join(save_directory, name))
        for name in stale:
            os.remove(os.path.join(save_directory, name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _previous_weights(directory: str) -> set[str]:
    """The weight files an earlier save wrote: the single file, or the index and its shards (others are the user's)."""
    found = {name for name in (_WEIGHTS, _INDEX) if os.path.isfile(os.path.join(directory, name))}
    if _INDEX not in found:
        return found
    try:
        with open(os.path.join(directory, _INDEX)) as f:
            shards = set(json.load(f)["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return found  # an index that names no shards readably: remove none of them
    for name in shards:
        # Only safetensors files inside the directory: an index never reaches outside it.
        if (
            isinstance(name, str)
            and name.endswith(".safetensors")
            and os.path.basename(name) == name
            and os.path.isfile(os.path.join(directory, name))
        ):
            found.add(name)
    return found
