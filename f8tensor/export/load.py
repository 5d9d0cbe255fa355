"""Load an FP8 checkpoint into a Hugging Face model as f8tensor's FP8 layers: no dequantizing pass.

:func:`load_fp8_pretrained` reads every format :mod:`f8tensor.export.checkpoint` reads. Frozen,
each quantized weight stays the file's FP8 bytes (:class:`~f8tensor.export.frozen.FrozenFloat8Linear`;
expert tensors :class:`~f8tensor.export.frozen_experts.FrozenFloat8ExpertWeight`, assembled from
the per-expert linears the checkpoint stores); trainable, it becomes a high-precision master
``(fp8.float() * multiplier).to(dtype)``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

from f8tensor.convert import convert_to_float8_training
from f8tensor.export.checkpoint import (
    CheckpointFormat,
    ExpertRows,
    checkpoint_names,
    default_config,
    expert_keys,
    read_format,
    read_tensors,
    weight_of,
)
from f8tensor.export.frozen import FrozenFloat8Linear
from f8tensor.export.frozen_experts import CHECKPOINT_SCALE, FrozenFloat8ExpertWeight
from f8tensor.gemm.rules import ALIGN
from f8tensor.nn.linear import dims_ok
from f8tensor.quant.config import Float8LinearConfig
from f8tensor.tensor.float8 import Float8Tensor

__all__ = ["load_fp8_pretrained"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def load_fp8_pretrained(
    model: nn.Module,
    directory: str | os.PathLike,
    *,
    config: Float8LinearConfig | None = None,
    frozen: bool = True,
) -> nn.Module:
    """Load the FP8 checkpoint in ``directory`` into ``model``, converting its linears and experts to FP8, in place.

    Everything is read and checked before the model changes. Expert tensors (3D, first dim the
    module's ``num_experts``, e.g. transformers' fused ``gate_up_proj``/``down_proj``) are read
    from the per-expert linear weights the checkpoint stores under transformers' names.

    Args:
        model: a Hugging Face model built from the checkpoint's config (random weights, or on the
            meta device: then materialised from the file, with no high-precision copy of FP8 weights).
        directory: a checkpoint ``save_fp8_pretrained`` writes, DeepSeek-V3 blocks (also
            ``scale_fmt: "ue8m0"``) or compressed-tensors ``float-quantized``.
        config: the layers' recipe; default the one whose weight granularity is the checkpoint's.
        frozen: keep the FP8 weights as the file's bytes, never trainable
            (:class:`~f8tensor.export.frozen.FrozenFloat8Linear`,
            :class:`~f8tensor.export.frozen_experts.FrozenFloat8ExpertWeight`); ``False``:
            trainable high-precision masters, converted as ``convert_to_float8_training`` does.

    Returns:
        ``model``, with ``float8_converted_fqns`` naming its FP8 layers and expert tensors.

    Raises:
        ValueError: no quantization config, a missing or malformed scale (a block scale is
            ``ceil(N / rows) x ceil(K / columns)``: partial last blocks load), a shape mismatch, an
            MXFP8 weight whose K is not a multiple of 32, non-finite or non-positive scales, a
            tensor the model or the file lacks, an expert stored partly in FP8, a frozen expert
            tensor whose last two dims are not multiples of 16 or of its blocks, or a ``config``
            that cannot hold a frozen weight (each named).
        NotImplementedError: a quantized tensor that is neither an ``nn.Linear`` weight nor rows of
            an expert tensor, or checkpoint names that are not renames or per-expert splits (e.g.
            experts stored fused or transposed on disk).
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
    plan = _plan(model, tensors, fmt)
    if frozen:
        _check_frozen_dims(model, plan.linears, config)
    dtype = _model_dtype(model)
    built = {fqn: weight_of(key, tensors[key], scale, fmt, dtype) for fqn, (key, scale) in plan.linears.items()}
    experts = {
        key: _fused_experts(key, shape, pieces, tensors, fmt, dtype, frozen)
        for key, (shape, pieces) in plan.experts.items()
    }
    with torch.no_grad():
        _assign_plain(model, plan.plain)
        if frozen:
            for fqn, (w8, m) in built.items():
                linear = model.get_submodule(fqn)
                assert isinstance(linear, nn.Linear)  # checked by _plan
                _set_submodule(model, fqn, FrozenFloat8Linear.from_fp8(linear, w8, m, config))
            for key, (fused, mult) in experts.items():
                _set_frozen_experts(model, key, fused, mult, config)
            model.float8_converted_fqns = tuple(sorted([*built, *experts]))  # type: ignore[assignment]
        else:
            masters = {fqn + ".weight": _master(w8, m, dtype) for fqn, (w8, m) in built.items()}
            masters.update({key: w8 for key, (w8, _) in experts.items()})  # dequantized by _fused_experts
            _assign_plain(model, masters)
            convert_to_float8_training(
                model,
                config=config,
                module_filter_fn=lambda _, fqn: fqn in built,
                experts_filter_fn=lambda _, fqn: fqn in experts,
            )
        _materialise_buffers(model)
    return model


class _Plan(NamedTuple):
    """What a checkpoint loads into: ``linears`` {linear fqn: (checkpoint weight key, its stored scale)},
    ``experts`` {expert tensor key: (shape, {checkpoint weight key: (its rows, stored scale or None)})},
    ``plain`` {state key: high-precision tensor}."""

    linears: dict[str, tuple[str, torch.Tensor]]
    experts: dict[str, tuple[tuple[int, ...], dict[str, tuple[ExpertRows, torch.Tensor | None]]]]
    plain: dict[str, torch.Tensor]


def _plan(model: nn.Module, tensors: dict[str, torch.Tensor], fmt: CheckpointFormat) -> _Plan:
    """The file's tensors placed in the model, checked against it."""
    fused = next((k for k, v in tensors.items() if v.dtype in _FP8 and v.dim() != 2), None)
    if fused is not None:
        raise NotImplementedError(
            f"load_fp8_pretrained: {fused} is a {tensors[fused].dim()}D FP8 tensor; FP8 weights are read as 2D linear "
            f"weights, experts split per expert under transformers' names (fused experts on disk are not read)"
        )
    state = model.state_dict(keep_vars=True)
    names, rows = checkpoint_names(model, state)
    shapes = expert_keys(model)
    suffix = "." + fmt.scale_suffix
    scales = {k[: -len(suffix)]: v for k, v in tensors.items() if k.endswith(suffix)}
    modules = dict(model.named_modules())
    linears: dict[str, tuple[str, torch.Tensor]] = {}
    experts: dict[str, tuple[tuple[int, ...], dict[str, tuple[ExpertRows, torch.Tensor | None]]]] = {}
    for disk_fqn, scale in scales.items():
        key = disk_fqn + ".weight"
        if key not in tensors:
            raise ValueError(f"load_fp8_pretrained: {disk_fqn}{suffix} has no {key} beside it")
        if key in rows:
            experts.setdefault(rows[key].key, (shapes[rows[key].key], {}))[1][key] = (rows[key], scale)
            continue
        fqn = names.get(key, key).removesuffix(".weight")
        mod = modules.get(fqn)
        if mod is None:
            raise ValueError(
                f"load_fp8_pretrained: {key} in the checkpoint is not in the model (a model built from another config?)"
            )
        if isinstance(mod, FrozenFloat8Linear):
            raise NotImplementedError(
                f"load_fp8_pretrained: the checkpoint quantizes {key}, whose layer already holds a frozen FP8 "
                f"weight (load into a freshly built model)"
            )
        if not isinstance(mod, nn.Linear):
            raise NotImplementedError(
                f"load_fp8_pretrained: the checkpoint quantizes {key}, which is a {type(mod).__name__}, not an "
                f"nn.Linear; FP8 weights load into nn.Linear layers and the rows of expert tensors (3D, first dim "
                f"the module's num_experts)"
            )
        shape = tuple(tensors[key].shape)
        if shape != (mod.out_features, mod.in_features):
            raise ValueError(
                f"load_fp8_pretrained: {key} has shape {shape}; the model's layer needs "
                f"{(mod.out_features, mod.in_features)}"
            )
        linears[fqn] = (key, scale)
    fp8_keys = {f"{fqn}.{name}" for fqn in scales for name in ("weight", fmt.scale_suffix)}
    plain: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        if key in fp8_keys:
            continue
        if value.dtype in _FP8:
            raise ValueError(
                f"load_fp8_pretrained: {key} is stored in {value.dtype} with no {fmt.scale_suffix} beside it"
            )
        if key in rows:  # an expert stored in high precision
            experts.setdefault(rows[key].key, (shapes[rows[key].key], {}))[1][key] = (rows[key], None)
            continue
        target = names.get(key, key)
        if target not in state:
            raise ValueError(
                f"load_fp8_pretrained: {key} in the checkpoint is not in the model (a model built from another config?)"
            )
        if tuple(value.shape) != tuple(state[target].shape):
            raise ValueError(
                f"load_fp8_pretrained: {key} has shape {tuple(value.shape)}; the model needs {tuple(state[target].shape)}"
            )
        plain[target] = value.to(state[target].dtype)
    for key, (_, pieces) in experts.items():
        lacking = sorted(k for k, r in rows.items() if r.key == key and k not in pieces)
        if lacking:
            raise ValueError(f"load_fp8_pretrained: the checkpoint lacks {lacking[0]} (rows of the model's {key})")
        for disk, (where, _) in pieces.items():
            want = (where.rows, shapes[key][2])
            if tuple(tensors[disk].shape) != want:
                raise ValueError(
                    f"load_fp8_pretrained: {disk} has shape {tuple(tensors[disk].shape)}; the model's {key} needs {want}"
                )
        quantized = [k for k, (_, scale) in pieces.items() if scale is not None]
        if quantized and len(quantized) != len(pieces):
            hp = next(k for k, (_, scale) in pieces.items() if scale is None)
            raise ValueError(
                f"load_fp8_pretrained: the model's {key} is stored partly in FP8 ({quantized[0]}) and partly in "
                f"high precision ({hp}); an expert tensor loads whole in one of them"
            )
        if not quantized:  # high precision: assembled as from_pretrained would
            e, n = shapes[key][:2]
            plain[key] = _assemble(e, n, [(r, tensors[k].to(state[key].dtype)) for k, (r, _) in pieces.items()])
    experts = {k: v for k, v in experts.items() if k not in plain}
    loaded = {id(state[k]) for k in plain} | {id(state[f"{fqn}.weight"]) for fqn in linears}
    done = set(plain) | {f"{fqn}.weight" for fqn in linears} | set(experts)
    missing = [k for k, v in state.items() if k not in done and id(v) not in loaded]
    if missing:
        shown = ", ".join(missing[:4]) + (f", ... ({len(missing) - 4} more)" if len(missing) > 4 else "")
        raise ValueError(f"load_fp8_pretrained: the checkpoint lacks {len(missing)} of the model's tensors: {shown}")
    return _Plan(linears, experts, plain)


def _assemble(e: int, n: int, pieces: list[tuple[ExpertRows, torch.Tensor]], per: int = 1) -> torch.Tensor:
    """An (e, n // per, ...) tensor of pieces, each at its expert and row // ``per`` (rows sharing a piece row)."""
    first = pieces[0][1]
    out = torch.empty((e, n // per, *first.shape[1:]), dtype=first.dtype)
    raw = out.view(torch.uint8) if out.element_size() == 1 else out  # FP8 placed through its bytes
    for where, piece in pieces:
        part = piece.view(torch.uint8) if piece.element_size() == 1 else piece
        raw[where.expert, where.row // per : where.row // per + part.shape[0]] = part
    return out


def _fused_experts(
    key: str,
    shape: tuple[int, ...],
    pieces: dict[str, tuple[ExpertRows, torch.Tensor | None]],
    tensors: dict[str, torch.Tensor],
    fmt: CheckpointFormat,
    dtype: torch.dtype,
    frozen: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's expert tensor ``key`` (E, N, K) from the checkpoint's pieces, each checked by :func:`weight_of`.

    Frozen: (a Float8Tensor of the file's bytes, one scale set per expert; the file's multipliers
    in the same layout). Else: (the dequantized master, None).
    """
    e, n, k = shape
    read = []
    for disk, (where, scale) in pieces.items():
        assert scale is not None  # pieces in high precision are assembled by _plan
        read.append((where, *weight_of(disk, tensors[disk], scale, fmt, dtype)))
    if not frozen:
        return _assemble(e, n, [(where, _master(w8, m, dtype)) for where, w8, m in read]), None
    if n % ALIGN or k % ALIGN:
        raise ValueError(
            f"load_fp8_pretrained(frozen=True): the model's {key} has shape {tuple(shape)}; FP8 expert GEMMs need "
            f"its last two dims multiples of {ALIGN} (load with frozen=False to keep it in high precision)"
        )
    block = read[0][1]._block
    bn, bk = block
    whole = f"{bn}x{bk} blocks do not tile; frozen expert tensors need whole blocks (load with frozen=False)"
    if bk and k % bk:
        raise ValueError(f"load_fp8_pretrained(frozen=True): the model's {key} {tuple(shape)} has K={k}, which {whole}")
    for disk, (where, _) in pieces.items():
        if bn and (where.row % bn or where.rows % bn):
            raise ValueError(
                f"load_fp8_pretrained(frozen=True): the model's {key} {tuple(shape)} takes {disk} as rows "
                f"{where.row}:{where.row + where.rows} of expert {where.expert}, which {whole}"
            )
    per = max(bn, 1)  # rows sharing one scale row

    def rows(t: torch.Tensor, where: ExpertRows) -> torch.Tensor:
        return t.reshape(1, 1).expand(where.rows, 1) if t.numel() == 1 and not any(block) else t

    data = _assemble(e, n, [(where, w8._data) for where, w8, _ in read])
    scale = _assemble(e, n, [(where, rows(w8._scale, where)) for where, w8, _ in read], per)
    mult = _assemble(e, n, [(where, rows(m, where)) for where, _, m in read], per)
    full = (1, *block)
    if not any(block):  # tensor strategy: one scale per expert where its pieces share one, else per row
        full = (1, 1, 0)
        if torch.equal(scale, scale[:, :1].expand_as(scale)) and torch.equal(mult, mult[:, :1].expand_as(mult)):
            full, scale, mult = (1, 0, 0), scale[:, :1].contiguous(), mult[:, :1].contiguous()
    return Float8Tensor(data, scale, dtype, full), mult


def _set_frozen_experts(
    model: nn.Module, key: str, w8: torch.Tensor, multiplier: torch.Tensor | None, config: Float8LinearConfig
) -> None:
    assert isinstance(w8, Float8Tensor) and multiplier is not None  # frozen: built by _fused_experts
    parent, _, name = key.rpartition(".")
    mod = model.get_submodule(parent)
    mod._parameters[name] = nn.Parameter(FrozenFloat8ExpertWeight.of(w8, config), requires_grad=False)
    mod.register_buffer(CHECKPOINT_SCALE.format(name), multiplier, persistent=False)


def _check_frozen_dims(model: nn.Module, fqns: Iterable[str], config: Float8LinearConfig) -> None:
    """Refuse, before the model changes, a frozen layer whose dims ``config``'s GEMMs cannot take."""
    for fqn in fqns:
        mod = model.get_submodule(fqn)
        assert isinstance(mod, nn.Linear)  # checked by _plan
        if not dims_ok(mod.in_features, mod.out_features, config):
            raise ValueError(
                f"load_fp8_pretrained: {fqn} ({mod.in_features} -> {mod.out_features}) has dims the config's FP8 "
                f"GEMMs cannot take (multiples of 16; FP4: of 32); pass a config with pad_inner_dim=True, or "
                f"frozen=False (such layers then stay in high precision)"
            )


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
    n, k = data.shape
    m = m.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]  # a last partial block: cut
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
