"""Load an FP8 checkpoint into a Hugging Face model as f8tensor's FP8 layers: no dequantizing pass.

:func:`load_fp8_pretrained` reads every format :mod:`f8tensor.export.checkpoint` reads. Frozen,
each quantized weight stays the file's FP8 bytes (:class:`~f8tensor.export.frozen.FrozenFloat8Linear`);
trainable, it becomes a high-precision master ``(fp8.float() * multiplier).to(dtype)``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from f8tensor.convert import convert_to_float8_training
from f8tensor.export.checkpoint import CheckpointFormat, default_config, read_format, read_tensors, weight_of
from f8tensor.export.frozen import FrozenFloat8Linear
from f8tensor.quant.config import Float8LinearConfig
from f8tensor.tensor.float8 import Float8Tensor

__all__ = ["load_fp8_pretrained"]


def load_fp8_pretrained(
    model: nn.Module,
    directory: str | os.PathLike,
    *,
    config: Float8LinearConfig | None = None,
    frozen: bool = True,
) -> nn.Module:
    """Load the FP8 checkpoint in ``directory`` into ``model``, converting its linears to FP8, in place.

    Everything is read and checked before the model changes.

    Args:
        model: a Hugging Face model built from the checkpoint's config (random weights, or on the
            meta device: then materialised from the file, with no high-precision copy of FP8 weights).
        directory: a checkpoint ``save_fp8_pretrained`` writes, DeepSeek-V3 blocks (also
            ``scale_fmt: "ue8m0"``) or compressed-tensors ``float-quantized``.
        config: the layers' recipe; default the one whose weight granularity is the checkpoint's.
        frozen: keep the FP8 weights as the file's bytes, never trainable; ``False``: trainable
            high-precision masters.

    Returns:
        ``model``, with ``float8_converted_fqns`` naming its FP8 layers.

    Raises:
        ValueError: no quantization config, a missing or malformed scale, a shape mismatch, a block
            that does not divide a weight, non-finite or non-positive scales, a tensor the model or
            the file lacks, or a ``config`` that cannot hold a frozen weight (each named).
        NotImplementedError: a quantized tensor that is not an ``nn.Linear`` weight (e.g. fused experts).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_fp8_pretrained: model must be an nn.Module; got {type(model).__name__}")
    if not isinstance(frozen, bool):
        raise TypeError(f"load_fp8_pretrained: frozen must be a bool; got {frozen!r}")
    directory = os.fspath(directory)
    fmt = read_format(directory)
    config = default_config(fmt) if config is None else config
    if not isinstance(config, Float8LinearConfig):
        raise TypeError(f"load_fp8_pretrained: config must be a Float8LinearConfig; got {type(config).__name__}")
    if frozen and (config.uses_gemm_formats or config.weight.delayed or config.enable_fsdp_float8_all_gather):
        raise ValueError(
            "load_fp8_pretrained(frozen=True): the config must cast the weight dynamically in FP8, one format for "
            "every GEMM and no FP8 all-gather (a frozen weight is the file's bytes); pass such a config or frozen=False"
        )
    tensors = read_tensors(directory)
    quantized, plain = _plan(model, tensors, fmt)
    dtype = _model_dtype(model)
    built = {
        fqn: weight_of(fqn + ".weight", tensors[fqn + ".weight"], scale, fmt, dtype) for fqn, scale in quantized.items()
    }
    with torch.no_grad():
        _assign_plain(model, plain)
        if frozen:
            for fqn, (w8, m) in built.items():
                linear = model.get_submodule(fqn)
                assert isinstance(linear, nn.Linear)  # checked by _plan
                _set_submodule(model, fqn, FrozenFloat8Linear.from_fp8(linear, w8, m, config))
            model.float8_converted_fqns = tuple(sorted(built))  # type: ignore[assignment]
        else:
            masters = {fqn + ".weight": _master(w8, m, dtype) for fqn, (w8, m) in built.items()}
            _assign_plain(model, masters)
            convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn in built)
        _materialise_buffers(model)
    return model


def _plan(
    model: nn.Module, tensors: dict[str, torch.Tensor], fmt: CheckpointFormat
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """({linear fqn: its stored scale}, {state key: plain tensor}) of the file, checked against the model."""
    suffix = "." + fmt.scale_suffix
    scales = {k[: -len(suffix)]: v for k, v in tensors.items() if k.endswith(suffix)}
    modules = dict(model.named_modules())
    for fqn in scales:
        if fqn + ".weight" not in tensors:
            raise ValueError(f"load_fp8_pretrained: {fqn}{suffix} has no {fqn}.weight beside it")
        mod = modules.get(fqn)
        if not isinstance(mod, nn.Linear) or isinstance(mod, FrozenFloat8Linear):
            what = "is not in the model" if mod is None else f"is a {type(mod).__name__}, not an nn.Linear"
            raise NotImplementedError(
                f"load_fp8_pretrained: the checkpoint quantizes {fqn}.weight, which {what}; FP8 weights load into "
                f"nn.Linear layers (fused MoE experts and renamed checkpoints are not read yet)"
            )
        shape = tuple(tensors[fqn + ".weight"].shape)
        if shape != (mod.out_features, mod.in_features):
            raise ValueError(
                f"load_fp8_pretrained: {fqn}.weight has shape {shape}; the model's layer needs "
                f"{(mod.out_features, mod.in_features)}"
            )
    state = model.state_dict(keep_vars=True)
    fp8_keys = {f"{fqn}.{name}" for fqn in scales for name in ("weight", fmt.scale_suffix)}
    plain: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        if key in fp8_keys:
            continue
        if value.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(
                f"load_fp8_pretrained: {key} is stored in {value.dtype} with no {fmt.scale_suffix} beside it"
            )
        if key not in state:
            raise ValueError(
                f"load_fp8_pretrained: {key} in the checkpoint is not in the model (a model built from another config?)"
            )
        if tuple(value.shape) != tuple(state[key].shape):
            raise ValueError(
                f"load_fp8_pretrained: {key} has shape {tuple(value.shape)}; the model needs {tuple(state[key].shape)}"
            )
        plain[key] = value.to(state[key].dtype)
    loaded = {id(state[k]) for k in plain} | {id(state[f"{fqn}.weight"]) for fqn in scales}
    quantized_keys = {f"{fqn}.weight" for fqn in scales}
    missing = [k for k, v in state.items() if k not in plain and k not in quantized_keys and id(v) not in loaded]
    if missing:
        shown = ", ".join(missing[:4]) + (f", ... ({len(missing) - 4} more)" if len(missing) > 4 else "")
        raise ValueError(f"load_fp8_pretrained: the checkpoint lacks {len(missing)} of the model's tensors: {shown}")
    return scales, plain


def _model_dtype(model: nn.Module) -> torch.dtype:
    config = getattr(model, "config", None)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    for p in model.parameters():
        if p.is_floating_point() and not isinstance(p, Float8Tensor):
            return p.dtype
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _master(w8: Float8Tensor, multiplier: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(fp8.float() * multiplier).to(dtype)``, the multiplier broadcast over its block."""
    data = w8._data.float()
    if w8._block in ((0, 0), (1, 0)):
        return (data * multiplier.float().reshape(-1, 1)[: data.shape[0]]).to(dtype)
    if multiplier.dtype == torch.uint8:  # e8m0 codes: 2**(c - 127), exact in fp32
        m = torch.ldexp(torch.ones_like(multiplier, dtype=torch.float32), multiplier.to(torch.int32) - 127)
    else:
        m = multiplier.float()
    bn, bk = w8._block
    m = m.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    return (data * m).to(dtype)


def _assign_plain(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Write ``values`` into the model's parameters and buffers (replacing those on the meta device)."""
    for key, value in values.items():
        fqn, _, name = key.rpartition(".")
        mod = model.get_submodule(fqn)
        old = mod._parameters.get(name) if name in mod._parameters else mod._buffers.get(name)
        if old is None or old.device.type == "meta" or old.shape != value.shape:
            if name in mod._parameters:
                mod._parameters[name] = nn.Parameter(value, requires_grad=True if old is None else old.requires_grad)
            else:
                mod._buffers[name] = value
        else:
            old.copy_(value)
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()


def _set_submodule(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent, _, name = fqn.rpartition(".")
    setattr(model.get_submodule(parent), name, new)


def _materialise_buffers(model: nn.Module) -> None:
    """Non-persistent buffers left on the meta device (e.g. RoPE's), built by the model's own init."""
    init: Any = getattr(model, "_init_weights", None)
    for mod in model.modules():
        meta = [n for n, b in mod._buffers.items() if b is not None and b.device.type == "meta"]
        if not meta:
            continue
        for n in meta:
            mod._buffers[n] = torch.empty_like(mod._buffers[n], device="cpu")  # type: ignore[arg-type]
        if not callable(init):
            raise NotImplementedError(
                f"load_fp8_pretrained: buffers {meta} of {type(mod).__name__} are on meta and the model has no _init_weights"
            )
        init(mod)
