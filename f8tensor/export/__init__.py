"""Export a (trained) Hugging Face model as an FP8 checkpoint that inference engines read.

:func:`save_fp8_pretrained` writes what ``model.save_pretrained`` writes, with each FP8
linear's weight stored in FP8 next to its scale and the ``quantization_config`` of:

- ``"fp8_block"``: DeepSeek-V3 blocks (vLLM, SGLang, transformers): e4m3fn ``weight``,
  fp32 ``weight_scale_inv`` (ceil(N/128), ceil(K/128): a last partial block has its own);
- ``"mxfp8"``: uint8 e8m0 ``weight_scale_inv`` (N, K/32);
- ``"compressed_tensors"``: ``float-quantized`` ``weight`` and fp32 ``weight_scale``,
  strategy ``"tensor"`` (1,), ``"channel"`` (N, 1) or ``"block"`` (ceil(N/128), ceil(K/128)).

Scales on disk are multipliers (``weight.float() * scale``): the exact fp32 reciprocal of
f8tensor's ``_scale``, so a loader dequantizes bit for bit. Converted layers and expert
weights (or, unconverted, every ``nn.Linear`` and 3D expert tensor) go FP8; ``lm_head``,
embeddings, norms, routers and biases stay high precision and are listed as not converted.
``scale_fmt="ue8m0"`` (``"fp8_block"``) writes the same fp32 scales, powers of two, from weight
casts with ``power_of_2_scale=True`` (DeepSeek V3.2's variant).

:func:`iter_fp8_weights` and :func:`fp8_state_dict` (``stream.py``) give the same tensors in
memory, one layer at a time, e.g. for a rollout engine's ``load_weights``; the file is written
from that same generator.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

from torch import nn

from f8tensor.export.load import load_fp8_pretrained
from f8tensor.export.stream import (
    FORMATS,
    SCALE_FMTS,
    STRATEGIES,
    _output_embeddings,
    export_options,
    fp8_state_dict,
    generate_fp8_weights,
    iter_fp8_weights,
)

__all__ = [
    "FORMATS",
    "SCALE_FMTS",
    "STRATEGIES",
    "fp8_state_dict",
    "iter_fp8_weights",
    "load_fp8_pretrained",
    "save_fp8_pretrained",
]

# The names model.save_pretrained writes: one file, or an index naming its shards.
_WEIGHTS, _INDEX = "model.safetensors", "model.safetensors.index.json"


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
    options = export_options(model, format, strategy, scale_fmt, "save_fp8_pretrained")
    # The file holds what iter_fp8_weights yields: one generator makes both.
    disk = dict(generate_fp8_weights(model, options, True, "save_fp8_pretrained"))
    fp8_modules = {k[: -len(options.scale_suffix)].rsplit(".", 1)[0] for k in disk if k.endswith(options.scale_suffix)}
    skipped = list(dict.fromkeys(k.rsplit(".", 1)[0] for k in disk if k.rsplit(".", 1)[0] not in fp8_modules))
    out_emb = _output_embeddings(model)
    for fqn, mod in model.named_modules():
        if mod is out_emb and fqn not in skipped:
            skipped.append(fqn)  # named even when tied (not in the file): a given list replaces the defaults
    config = _quantization_config(
        format, options.strategy if format == "compressed_tensors" else "", skipped, options.scale_fmt
    )
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
