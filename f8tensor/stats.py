"""Numerics you can see: accuracy measures and per-layer FP8 cast telemetry.

For every :class:`~f8tensor.Float8Linear` and operand role (``input``, ``weight``,
``grad_output``), telemetry reports the last cast's saturated and flushed elements, amax,
scale, headroom and (delayed scaling) amax history. Usage::

    enable_float8_stats(model, warn_saturation_above=1e-4)   # or config collect_stats=True
    loss.backward()
    logger.log(float8_stats(model))        # {"layers.0.mlp.up_proj/input/saturated_frac": 0.0, ...}

The counting happens inside each cast (:func:`f8tensor.kernels.cast_with_stats`), eager or
compiled; each cast overwrites its buffers; reading them is one device sync.
:func:`saved_tensor_bytes` and :func:`alive_tensor_bytes` measure what autograd keeps for
backward. This module observes the library; nothing below it imports it.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import torch
from torch import nn

from f8tensor.compat import TorchDispatchMode, tree_map_only
from f8tensor.kernels import CAST_STATS_FIELDS
from f8tensor.nn.linear import STATS_BUFFERS, STATS_ROLES, Float8Linear

__all__ = [
    "STATS_FIELDS",
    "Float8SaturationWarning",
    "alive_tensor_bytes",
    "enable_float8_stats",
    "float8_stats",
    "format_float8_stats",
    "saved_tensor_bytes",
    "sqnr",
    "tensor_bytes",
]

_T = TypeVar("_T")

#: The fields reported for every role, in this order (key suffixes of :func:`float8_stats`).
#: Roles with delayed scaling also report ``amax_history_max``.
STATS_FIELDS: tuple[str, ...] = (
    "saturated_frac",
    "saturated_count",
    "underflow_frac",
    "underflow_count",
    "amax",
    "scale",
    "headroom_log2",
)
_HISTORY_FIELD = "amax_history_max"

_COL = {name: i for i, name in enumerate(CAST_STATS_FIELDS)}
# Wrappers whose names keys skip, so keys survive compiling and checkpoint wrapping.
_WRAPPER_NAMES = frozenset({"_orig_mod", "_checkpoint_wrapped_module"})
_WARN_ATTR = "_float8_warn_saturation_above"
_warned: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class Float8SaturationWarning(RuntimeWarning):
    """A layer clipped more than the allowed fraction of an operand at the FP8 max."""


def enable_float8_stats(
    model: nn.Module, enabled: bool = True, *, warn_saturation_above: float | None = None
) -> nn.Module:
    """Switch cast telemetry on (or off) for every Float8Linear in ``model``; call between steps.

    On: ``collect_stats=True`` and fresh buffers (NaN until the first step). Off: flag and
    buffers removed, so the layers run exactly the code they run without telemetry. A
    compiled model recompiles once either way.

    Args:
        model: the model.
        enabled: on or off.
        warn_saturation_above: a fraction in ``[0, 1)``; a layer whose saturated fraction
            exceeds it gets one :class:`Float8SaturationWarning` per process, issued where the
            statistics are read (no sync, no graph break).
    Returns:
        ``model``.
    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``enabled`` is not a bool.
        ValueError: ``warn_saturation_above`` is outside ``[0, 1)``.

    Example:
        >>> from torch import nn
        >>> from f8tensor import convert_to_float8_training, enable_float8_stats, float8_stats
        >>> model = enable_float8_stats(convert_to_float8_training(nn.Sequential(nn.Linear(32, 32))))
        >>> model(torch.randn(16, 32)).sum().backward()
        >>> stats = float8_stats(model)
        >>> stats["0/input/saturated_frac"], stats["0/grad_output/underflow_frac"]
        (0.0, 0.0)
    """
    _check_model(model, "enable_float8_stats")
    if not isinstance(enabled, bool):
        raise TypeError(f"enable_float8_stats: enabled must be a bool; got {enabled!r}")
    if warn_saturation_above is not None:
        if isinstance(warn_saturation_above, bool) or not isinstance(warn_saturation_above, (int, float)):
            raise TypeError(f"warn_saturation_above must be a float in [0, 1) or None; got {warn_saturation_above!r}")
        if not 0.0 <= warn_saturation_above < 1.0:
            raise ValueError(f"warn_saturation_above must be in [0, 1); got {warn_saturation_above!r}")
    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    if not layers:
        raise ValueError("the model has no Float8Linear layers: convert it first (f8tensor.convert_to_float8_training)")
    for layer in layers:
        layer.set_collect_stats(enabled)
        threshold = float(warn_saturation_above) if enabled and warn_saturation_above is not None else None
        setattr(layer, _WARN_ATTR, threshold)
    return model


def _check_model(model: object, what: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{what} expects an nn.Module (a model with Float8Linear layers); got {type(model).__name__}")


def _stats_layers(model: nn.Module) -> list[tuple[str, Float8Linear]]:
    out = []
    for fqn, mod in model.named_modules():
        if isinstance(mod, Float8Linear) and mod.config.collect_stats:
            name = ".".join(part for part in fqn.split(".") if part not in _WRAPPER_NAMES)
            out.append((name, mod))
    return out


def _prefix(layer: str, role: str) -> str:
    return f"{layer}/{role}/" if layer else f"{role}/"


def float8_stats(model: nn.Module, *, history: bool = False) -> dict[str, float]:
    """The last step's cast statistics of every layer that collects them, as Python floats.

    Keys are ``"{layer}/{role}/{field}"`` (``layer`` without compile or checkpoint wrappers;
    omitted for a bare layer), ``field`` one of :data:`STATS_FIELDS`:

    - ``saturated_frac``/``_count``: elements clipped at the format's max (above
      :func:`~f8tensor.quant.formats.saturation_bound`).
    - ``underflow_frac``/``_count``: non-zero in high precision, zero in FP8.
    - ``amax``; ``scale`` (rowwise: the smallest).
    - ``headroom_log2``: ``log2(float8_max / max|value * scale|)``; < 0 when the amax was clipped.
    - ``amax_history_max`` (delayed roles): the window the next scale comes from; with
      ``history=True`` the whole window too, as ``.../amax_history/{i}``, newest first.

    The key set depends only on structure and configs: unmeasured roles read NaN. One
    device-to-host copy; each rank reports its own tensors (no collective).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    _check_model(model, "float8_stats")
    layers = _stats_layers(model)
    if not layers:
        return {}
    parts: list[torch.Tensor] = []
    for _, layer in layers:
        parts.extend(getattr(layer, name).detach() for name in STATS_BUFFERS)
        for role in _delayed_roles(layer):
            parts.append(getattr(layer, f"amax_history_{role}").detach())
    device = parts[0].device
    # The one sync: every buffer flattened into one float64 tensor, copied to the host once.
    flat = torch.cat([p.to(device=device, dtype=torch.float64) for p in parts]).tolist()

    out: dict[str, float] = {}
    pos = 0
    n_fields = len(CAST_STATS_FIELDS)
    for name, layer in layers:
        rows = {role: flat[pos + i * n_fields : pos + (i + 1) * n_fields] for i, role in enumerate(STATS_ROLES)}
        pos += len(STATS_ROLES) * n_fields
        histories = {}
        for role in _delayed_roles(layer):
            n = layer.config.delayed.history_len
            histories[role] = flat[pos : pos + n]
            pos += n
        for role in STATS_ROLES:
            row, prefix = rows[role], _prefix(name, role)
            numel = row[_COL["numel"]]
            # A non-finite amax makes the fractions NaN, not 0: the counts mean nothing.
            finite = math.isfinite(row[_COL["amax"]]) or numel == 0
            for field in ("saturated", "underflow"):
                count = row[_COL[f"{field}_count"]]
                out[prefix + f"{field}_frac"] = (
                    count / numel if numel > 0 and finite else (0.0 if numel == 0 else math.nan)
                )
                out[prefix + f"{field}_count"] = count
            for field in ("amax", "scale", "headroom_log2"):
                out[prefix + field] = row[_COL[field]]
            if role in histories:
                out[prefix + _HISTORY_FIELD] = max(histories[role])
                if history:
                    for i, value in enumerate(histories[role]):
                        out[prefix + f"amax_history/{i}"] = value
        _maybe_warn(name, layer, out)
    return out


def _delayed_roles(layer: Float8Linear) -> list[str]:
    return [role for role in STATS_ROLES if getattr(layer.config, role).delayed]


def _maybe_warn(name: str, layer: Float8Linear, stats: Mapping[str, float]) -> None:
    threshold = getattr(layer, _WARN_ATTR, None)
    if threshold is None or layer in _warned:
        return
    over = [
        (role, stats[_prefix(name, role) + "saturated_frac"])
        for role in STATS_ROLES
        if stats[_prefix(name, role) + "saturated_frac"] > threshold
    ]
    if over:
        _warned.add(layer)
        what = ", ".join(f"{role} {frac:.3g}" for role, frac in over)
        hint = (
            " Its scale is delayed (an amax history that missed a jump): consider dynamic scaling for this layer."
            if any(getattr(layer.config, role).delayed for role, _ in over)
            else ""
        )
        warnings.warn(
            f"f8tensor: layer {name or '<root>'!r} clipped more than {threshold:g} of an operand's elements "
            f"at the FP8 max ({what}).{hint} (Warned once per layer.)",
            Float8SaturationWarning,
            stacklevel=3,
        )


def format_float8_stats(stats: nn.Module | Mapping[str, float]) -> str:
    """A fixed-width table of :func:`float8_stats` (given a model, or the dict it returned).

    Fractions in percent, headroom in powers of two, ``-`` for not measured.

    Raises:
        TypeError: neither a module nor a mapping of ``float8_stats`` keys to numbers.
        ValueError: a key that is not ``"{layer}/{role}/{field}"``.

    Example:
        >>> from f8tensor import format_float8_stats
        >>> print(format_float8_stats({"up/input/saturated_frac": 0.0, "up/input/saturated_count": 0.0}))
        layer  role    sat %  sat # ...
        up     input  0.0000      0 ...
    """
    if isinstance(stats, nn.Module):
        stats = float8_stats(stats)
    if not isinstance(stats, Mapping):
        raise TypeError(
            f"format_float8_stats expects a model or the dict float8_stats returns; got {type(stats).__name__}"
        )
    if not stats:
        return "(no FP8 statistics: call f8tensor.enable_float8_stats(model) and run a step)"
    rows: dict[tuple[str, str], dict[str, float]] = {}
    value: float | None
    for key, value in stats.items():
        parts = key.split("/") if isinstance(key, str) else []
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if len(parts) < 2 or parts[-2] not in STATS_ROLES + ("amax_history",) or not number:
            raise ValueError(
                f"format_float8_stats expects the dict float8_stats returns, keys '[layer/]role/field' with a role "
                f"in {STATS_ROLES} and number values; got {key!r}: {value!r}"
            )
        if len(parts) >= 3 and parts[-2] == "amax_history":  # .../amax_history/{i}: not tabulated
            continue
        if len(parts) == 2:
            parts = [""] + parts
        layer, role, field = "/".join(parts[:-2]), parts[-2], parts[-1]
        rows.setdefault((layer, role), {})[field] = value
    columns = [
        ("saturated_frac", "sat %", lambda v: f"{100 * v:.4f}"),
        ("saturated_count", "sat #", lambda v: f"{v:.0f}"),
        ("underflow_frac", "uflow %", lambda v: f"{100 * v:.4f}"),
        ("underflow_count", "uflow #", lambda v: f"{v:.0f}"),
        ("amax", "amax", lambda v: f"{v:.4g}"),
        ("scale", "scale", lambda v: f"{v:.4g}"),
        ("headroom_log2", "headroom log2", lambda v: f"{v + 0.0:+.2f}" if abs(v) >= 0.005 or math.isinf(v) else "0.00"),
        (_HISTORY_FIELD, "history amax", lambda v: f"{v:.4g}"),
    ]
    header = ["layer", "role"] + [title for _, title, _ in columns]
    table = [header]
    for (layer, role), fields in rows.items():
        line = [layer or "<root>", role]
        # Measured iff its counts are numbers: a cast of a NaN tensor still counts (zero).
        count = fields.get("saturated_count")
        measured = count is not None and not math.isnan(count)
        for field, _, fmt in columns:
            value = fields.get(field)
            if value is None or (math.isnan(value) and not measured):
                line.append("-")
            elif not math.isfinite(value):
                line.append(f"{value}")
            else:
                line.append(fmt(value))
        table.append(line)
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = []
    for n, r in enumerate(table):
        cells = [r[0].ljust(widths[0]), r[1].ljust(widths[1])] + [c.rjust(w) for c, w in zip(r[2:], widths[2:])]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def sqnr(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``actual`` against ``reference``, in dB.

    ``10 * log10(sum(ref**2) / sum((ref - actual)**2))``, computed in float64. Equal
    tensors give ``inf``; a NaN anywhere gives NaN (so a threshold check fails loudly).

    Raises:
        ValueError: the shapes differ.

    Example:
        >>> from f8tensor import Float8Tensor, sqnr
        >>> x = torch.randn(256, 256)
        >>> 25 < sqnr(x, Float8Tensor.from_hp(x).to_hp()) < 40  # e4m3, one scale
        True
    """
    if reference.shape != actual.shape:
        raise ValueError(f"sqnr needs equal shapes; got {tuple(reference.shape)} and {tuple(actual.shape)}")
    ref = _plain(reference).detach().to(torch.float64)
    act = _plain(actual).detach().to(torch.float64)
    signal = ref.pow(2).sum()
    noise = (ref - act).pow(2).sum()
    return float(10.0 * torch.log10(signal / noise))


def _plain(t: torch.Tensor) -> torch.Tensor:
    to_hp = getattr(type(t), "to_hp", None)
    return to_hp(t) if to_hp is not None else t


# memory


def saved_tensor_bytes(module: nn.Module, fn: Callable[[], _T]) -> tuple[int, _T]:
    """Run ``fn()`` (a forward through ``module``); return the bytes autograd saved meanwhile, and its result.

    Each storage counts once; ``module``'s parameters and their dtype copies are left out; a
    subclass counts its inner tensors.
    """
    params = list(module.parameters())
    param_ids = {id(p) for p in params}
    seen = {part.untyped_storage().data_ptr() for p in params for part in storage_parts(p)}
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if not _is_parameter_copy(t, param_ids):
            total += tensor_bytes([t], seen)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total, out


def tensor_bytes(tensors: Iterable[torch.Tensor], seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors``, skipping (and extending) ``seen``,
    a set of storage addresses already counted."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        for part in storage_parts(t):
            storage = part.untyped_storage()
            key = storage.data_ptr()
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            total += storage.nbytes()
    return total


def storage_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s bytes: itself, or a subclass's inner tensors."""
    if type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [p for name in names for p in storage_parts(getattr(t, name))]
    return [t]


# Autograd nodes of views, walked through to find the cast a saved tensor comes from.
_VIEW_NODES = frozenset({"TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0", "ExpandBackward0"})


def _is_parameter_copy(t: torch.Tensor, param_ids: set[int]) -> bool:
    """True for a dtype cast of a parameter, or a view of one (autocast's bf16 weights)."""
    fn = t.grad_fn
    while fn is not None and type(fn).__name__ in _VIEW_NODES:
        fn = fn.next_functions[0][0]
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    source = fn.next_functions[0][0]
    return source is not None and id(getattr(source, "variable", None)) in param_ids


def alive_tensor_bytes(module: nn.Module, fn: Callable[[], _T]) -> tuple[int, _T]:
    """Run ``fn()`` (a forward through ``module``); return the bytes it allocated still alive after, and its result.

    What autograd keeps for backward, as stored, saved-tensor hooks included (read from the
    storages ops create, not from a hook). Left out: the result, parameters and their dtype
    copies. Anything else ``fn`` keeps counts: measure a forward that has run before.
    """
    params = {part.untyped_storage().data_ptr() for p in module.parameters() for part in storage_parts(p)}
    watch = _NewStorages(params)
    with watch:
        out = fn()
    results = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
    seen = {part.untyped_storage().data_ptr() for t in results for part in storage_parts(t)}
    return watch.alive_bytes(seen), out


def _storages(tree: Any) -> list[torch.UntypedStorage]:
    found: list[torch.UntypedStorage] = []
    tree_map_only(torch.Tensor, lambda t: found.extend(part.untyped_storage() for part in storage_parts(t)), tree)
    return found


class _NewStorages(TorchDispatchMode):
    """Records (weakly) each new storage an op returns; a parameter's dtype copy apart."""

    def __init__(self, param_storages: set[int]) -> None:
        super().__init__()
        self.param_storages = param_storages
        self.new: list[weakref.ReferenceType[torch.UntypedStorage]] = []
        self.copies: list[weakref.ReferenceType[torch.UntypedStorage]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        held = {s.data_ptr() for s in _storages((args, kwargs))}
        is_copy = (
            func is torch.ops.aten._to_copy.default
            and type(args[0]) in (torch.Tensor, nn.Parameter)
            and args[0].untyped_storage().data_ptr() in self.param_storages
        )
        for s in _storages(out):
            if s.data_ptr() not in held and s.nbytes() > 0:
                (self.copies if is_copy else self.new).append(weakref.ref(s))
        return out

    def alive_bytes(self, skip: set[int]) -> int:
        """Bytes of the recorded storages still alive, each once, but copies and ``skip``'s addresses."""
        skip = skip | {s.data_ptr() for s in (ref() for ref in self.copies) if s is not None}
        total = 0
        for s in (ref() for ref in self.new):
            if s is not None and s.data_ptr() not in skip:
                skip.add(s.data_ptr())
                total += s.nbytes()
        return total
