"""Reading FP8 checkpoints: the ``quantization_config`` of a directory and each stored weight.

Formats read (what :func:`~f8tensor.export.save_fp8_pretrained` writes, and the same written
by others): DeepSeek-V3 blocks (``quant_method: "fp8"``, ``weight_block_size``, fp32
``weight_scale_inv``; ``scale_fmt: "ue8m0"``: every multiplier a power of two), MXFP8
(uint8 e8m0 ``weight_scale_inv``) and compressed-tensors ``float-quantized`` (``weight_scale``,
strategy tensor, channel or block). Every scale on disk is a multiplier back to high
precision; f8tensor's ``_scale`` is its reciprocal. Blocks need not divide a weight: a last
partial block has its own multiplier (a scale of ``ceil(N / rows) x ceil(K / columns)``, as
DeepSeek-V3's 576-row ``kv_a_proj_with_mqa`` stores it); MXFP8 needs K a multiple of 32.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import os
import sys
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from f8tensor.quant.config import CastConfig, Float8LinearConfig
from f8tensor.quant.formats import E8M0
from f8tensor.quant.specs import BLOCK_128x128, BlockGranularity, Granularity, MX_1x32
from f8tensor.tensor.float8 import Float8Tensor

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "CheckpointFormat",
    "ExpertRows",
    "checkpoint_names",
    "default_config",
    "expert_keys",
    "read_format",
    "read_tensors",
    "weight_of",
]

_E8M0_BIAS = 127
_FP32_MAX = torch.finfo(torch.float32).max
#: The range of an fp32 multiplier on disk: its reciprocal, and e4m3's largest value times it, finite.
_MULTIPLIER_MIN = float(torch.reciprocal(torch.tensor(_FP32_MAX)).nextafter(torch.tensor(1.0)))
_MULTIPLIER_MAX = float(torch.tensor(_FP32_MAX / 448.0, dtype=torch.float32))
_WEIGHTS, _INDEX = "model.safetensors", "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class CheckpointFormat:
    """How a checkpoint stores its FP8 weights.

    Fields: ``format`` (``"fp8_block"``, ``"mxfp8"``, ``"compressed_tensors"``), ``strategy``
    (``"block"``, ``"mx"``, ``"tensor"``, ``"channel"``), ``block`` (rows, columns) of a block
    scale, ``scale_suffix`` (the scale's name after the module's), ``ue8m0`` (multipliers are
    powers of two).
    """

    format: str
    strategy: str
    block: tuple[int, int] | None
    scale_suffix: str
    ue8m0: bool = False

    @property
    def granularity(self) -> Granularity | BlockGranularity:
        if self.strategy == "mx":
            return MX_1x32
        if self.strategy == "block":
            assert self.block is not None  # read_format sets it with the strategy
            return BLOCK_128x128 if self.block == (128, 128) else BlockGranularity(self.block)
        return Granularity.ROWWISE if self.strategy == "channel" else Granularity.TENSORWISE


def read_format(directory: str) -> CheckpointFormat:
    """The :class:`CheckpointFormat` of ``directory``'s ``config.json``.

    Raises:
        FileNotFoundError: no ``config.json``.
        ValueError: no ``quantization_config``, or one this loader does not read (named).
    """
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    q = config.get("quantization_config")
    q = q if isinstance(q, dict) else {}
    if "quant_method" not in q:
        raise ValueError(
            f"load_fp8_pretrained: {path} has no quantization_config: not an FP8 checkpoint "
            f"(load a high-precision checkpoint with from_pretrained, then convert_to_float8_training)"
        )
    method = q.get("quant_method")
    if method in ("fp8", "mxfp8"):
        fmt = q.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"load_fp8_pretrained: quantization_config fmt must be 'e4m3'; got {fmt!r}")
        block = q.get("weight_block_size")
        scale_fmt = q.get("scale_fmt")
        if method == "mxfp8":
            if block != [1, 32]:
                raise ValueError(f"load_fp8_pretrained: mxfp8 needs weight_block_size [1, 32]; got {block!r}")
            return CheckpointFormat("mxfp8", "mx", (1, 32), "weight_scale_inv", ue8m0=True)
        if block != [128, 128]:
            raise ValueError(
                f"load_fp8_pretrained: quant_method 'fp8' is read with weight_block_size [128, 128] "
                f"(DeepSeek-V3 blocks); got {block!r}"
            )
        if scale_fmt not in (None, "ue8m0"):
            raise ValueError(f"load_fp8_pretrained: scale_fmt must be absent or 'ue8m0'; got {scale_fmt!r}")
        return CheckpointFormat("fp8_block", "block", (128, 128), "weight_scale_inv", ue8m0=scale_fmt == "ue8m0")
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    raise ValueError(
        f"load_fp8_pretrained: quant_method {method!r} is not read; allowed: 'fp8' (DeepSeek-V3 blocks), "
        f"'mxfp8', 'compressed-tensors' (float-quantized)"
    )


def _compressed_tensors(q: dict[str, Any]) -> CheckpointFormat:
    if q.get("format") != "float-quantized":
        raise ValueError(
            f"load_fp8_pretrained: compressed-tensors format must be 'float-quantized'; got {q.get('format')!r}"
        )
    groups = q.get("config_groups") or {}
    schemes = [g.get("weights") for g in groups.values() if isinstance(g, dict)]
    strategies = {(w or {}).get("strategy") for w in schemes}
    if len(strategies) != 1:
        raise ValueError(
            f"load_fp8_pretrained: compressed-tensors config_groups need one weight strategy; got {strategies}"
        )
    w = schemes[0] or {}
    strategy = w.get("strategy")
    if w.get("num_bits") != 8 or w.get("type") != "float" or strategy not in ("tensor", "channel", "block"):
        raise ValueError(
            f"load_fp8_pretrained: compressed-tensors weights must be 8-bit float, strategy 'tensor', 'channel' "
            f"or 'block'; got num_bits={w.get('num_bits')!r}, type={w.get('type')!r}, strategy={strategy!r}"
        )
    block = None
    if strategy == "block":
        structure = w.get("block_structure")
        if structure != [128, 128]:
            raise ValueError(
                f"load_fp8_pretrained: compressed-tensors block_structure must be [128, 128]; got {structure!r}"
            )
        block = (128, 128)
    return CheckpointFormat("compressed_tensors", strategy, block, "weight_scale")


def default_config(fmt: CheckpointFormat) -> Float8LinearConfig:
    """The recipe whose weight granularity is the checkpoint's (power-of-two scales for ue8m0)."""
    recipe = {"block": "blockwise", "mx": "mxfp8", "channel": "rowwise", "tensor": "tensorwise"}[fmt.strategy]
    config = Float8LinearConfig.from_recipe(recipe)
    if fmt.ue8m0 and fmt.strategy == "block":
        pow2 = {
            r: dataclasses.replace(getattr(config, r), power_of_2_scale=True)
            for r in ("input", "weight", "grad_output")
        }
        config = dataclasses.replace(config, **pow2)
    assert isinstance(config.weight, CastConfig)
    return config


def read_tensors(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of ``directory``'s ``model.safetensors`` (or the shards its index names)."""
    from safetensors import safe_open

    index = os.path.join(directory, _INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(directory, _WEIGHTS)):
        files = [_WEIGHTS]
    else:
        raise FileNotFoundError(f"load_fp8_pretrained: no {_WEIGHTS} or {_INDEX} in {directory!r}")
    found: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(os.path.join(directory, name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                found[key] = f.get_tensor(key)
    return found


def weight_of(
    key: str, data: torch.Tensor, scale: torch.Tensor, fmt: CheckpointFormat, dtype: torch.dtype
) -> tuple[Float8Tensor, torch.Tensor]:
    """(the Float8Tensor of one stored weight, its on-disk multiplier), checked.

    The Float8Tensor holds ``data`` itself and ``1 / multiplier`` (e8m0: the inverse code, exact).

    Raises:
        ValueError: a weight not e4m3 2D, a scale of the wrong dtype or shape (blocks: one per
            ``ceil(N / rows) x ceil(K / columns)``; MXFP8 needs K a multiple of 32), a non-finite
            or non-positive multiplier, or (ue8m0) one that is not a power of two; the tensor is named.
    """
    if data.dtype != torch.float8_e4m3fn or data.dim() != 2:
        raise ValueError(
            f"load_fp8_pretrained: {key} must be a 2D float8_e4m3fn weight; got {data.dtype} {tuple(data.shape)}"
        )
    n, k = data.shape
    name = key[: -len("weight")] + fmt.scale_suffix
    if fmt.strategy == "mx":
        if k % 32:
            raise ValueError(f"load_fp8_pretrained: {key} has K={k}: MXFP8 blocks of 32 need K a multiple of 32")
        _check_shape(name, scale, (n, k // 32))
        if scale.dtype != torch.uint8:
            raise ValueError(f"load_fp8_pretrained: {name} must be uint8 e8m0 codes; got {scale.dtype}")
        if bool((scale == 255).any()):
            raise ValueError(f"load_fp8_pretrained: {name} holds the e8m0 NaN code 255; every block needs a scale")
        # 1 / 2**(c - 127) = 2**((254 - c) - 127): the inverse code, exact.
        inv = (2 * _E8M0_BIAS - scale.to(torch.int16)).to(torch.uint8).view(E8M0)
        return Float8Tensor(data, inv, dtype, (1, 32)), scale
    if not scale.is_floating_point() or scale.dtype == torch.float64:
        raise ValueError(f"load_fp8_pretrained: {name} must be an fp32 (or bf16/fp16) multiplier; got {scale.dtype}")
    m = scale.to(torch.float32)  # exact from bf16/fp16
    if fmt.strategy == "block":
        bn, bk = fmt.block  # type: ignore[misc]  # set with strategy "block"
        # A last block of fewer rows or columns has its own multiplier, as both block formats store it.
        _check_shape(name, m, (-(-n // bn), -(-k // bk)))
        block: tuple[int, int] = (bn, bk)
    elif fmt.strategy == "channel":
        _check_shape(name, m, (n, 1))
        block = (1, 0)
    else:
        if m.numel() != 1:
            raise ValueError(
                f"load_fp8_pretrained: {name} must hold one multiplier (strategy 'tensor'); got {tuple(m.shape)}"
            )
        m = m.reshape(())
        block = (0, 0)
    # The held scale 1 / m must be finite, and 448 * m too: else weights silently become 0 or inf.
    ok = torch.isfinite(m) & (m >= _MULTIPLIER_MIN) & (m <= _MULTIPLIER_MAX)
    if not bool(ok.all()):
        bad = m[~ok].flatten()[0].item()
        raise ValueError(
            f"load_fp8_pretrained: {name} must hold finite positive multipliers in [{_MULTIPLIER_MIN:.3g}, "
            f"{_MULTIPLIER_MAX:.3g}] (so that 1 / multiplier and 448 * multiplier are finite in fp32); got {bad!r}"
        )
    if fmt.ue8m0 and not bool((torch.frexp(m).mantissa == 0.5).all()):
        raise ValueError(f"load_fp8_pretrained: {name}: scale_fmt 'ue8m0' needs every multiplier a power of two")
    return Float8Tensor(data, torch.reciprocal(m), dtype, block), scale


def _check_shape(name: str, scale: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(scale.shape) != expected:
        raise ValueError(f"load_fp8_pretrained: {name} has shape {tuple(scale.shape)}; the weight needs {expected}")


class ExpertRows(NamedTuple):
    """Where a checkpoint tensor lies in a model's expert tensor (E, N, K): ``key``'s expert ``expert``, rows
    ``row`` to ``row + rows``."""

    key: str
    expert: int
    row: int
    rows: int


def expert_keys(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """{state key: shape} of the model's expert tensors: 3D parameters whose first dim is their module's
    ``num_experts`` (as the converter finds them)."""
    found = {}
    for fqn, mod in model.named_modules():
        n = getattr(mod, "num_experts", None)
        if not isinstance(n, int) or isinstance(n, bool):
            continue
        for name, p in mod.named_parameters(recurse=False):
            if p.dim() == 3 and p.shape[0] == n:
                found[f"{fqn}.{name}" if fqn else name] = tuple(p.shape)
    return found


def checkpoint_names(model: nn.Module, state: dict[str, torch.Tensor]) -> tuple[dict[str, str], dict[str, ExpertRows]]:
    """({checkpoint key: state key} of renamed tensors, {checkpoint key: its :class:`ExpertRows`}).

    The names are transformers' own reversal of its load-time conversion (the one
    ``save_pretrained`` writes), run on probes: one id per tensor, one per expert row. A model
    without a conversion reads every key as its own.

    Raises:
        NotImplementedError: a conversion that is not a rename or a split of expert tensors into
            whole rows (e.g. experts stored transposed), the tensor named.
    """
    package = type(model).__module__.split(".", 1)[0]
    revert = getattr(sys.modules.get(f"{package}.core_model_loading"), "revert_weight_conversion", None)
    if revert is None:
        return {k: k for k in state}, {}
    experts = expert_keys(model)
    starts: list[int] = []
    owners: list[tuple[str, int]] = []  # (state key, rows per expert; 0: not an expert tensor)
    probes: dict[str, torch.Tensor] = {}
    base = 0
    for key, value in state.items():
        starts.append(base)
        if key in experts:
            e, n = experts[key][:2]
            probes[key] = torch.arange(base, base + e * n).reshape(e, n, 1)
            owners.append((key, n))
            base += e * n
        else:
            probes[key] = torch.full((1,) * value.dim(), base, dtype=torch.int64)
            owners.append((key, 0))
            base += 1
    names: dict[str, str] = {}
    rows: dict[str, ExpertRows] = {}
    try:
        reverted = revert(model, probes)
    except (RuntimeError, ValueError, IndexError, KeyError) as err:
        raise NotImplementedError(
            f"load_fp8_pretrained: {type(model).__name__}'s checkpoint conversion is not a rename or a split of "
            f"expert tensors into rows; its names are not read ({type(err).__name__}: {err})"
        ) from err
    for disk, ids in reverted.items():
        first = int(ids.reshape(-1)[0])
        key, n = owners[bisect.bisect_right(starts, first) - 1]
        if n == 0 and ids.numel() == 1:
            names[disk] = key
            continue
        offset = first - starts[bisect.bisect_right(starts, first) - 1]
        e, row = divmod(offset, max(n, 1))
        count = ids.shape[0] if ids.dim() == 2 else 0
        want = torch.arange(first, first + count).reshape(count, 1)
        if n == 0 or ids.dim() != 2 or ids.shape[1] != 1 or row + count > n or not torch.equal(ids, want):
            raise NotImplementedError(
                f"load_fp8_pretrained: {type(model).__name__}'s checkpoint name {disk} is not a rename of one of its "
                f"tensors nor whole rows of one expert of {key}; FP8 loading reads renames and experts split per "
                f"expert into linear weights (fused or transposed experts on disk are not read)"
            )
        rows[disk] = ExpertRows(key, e, row, count)
    return names, rows
