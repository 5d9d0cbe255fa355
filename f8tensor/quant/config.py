"""The user configs: frozen dataclasses that compare by value, so they serve as compile guards.

Validation says what is wrong and what is allowed. The vocabulary (granularities,
:class:`CastSpec`, :class:`GemmConfig`) is ``specs``'s, re-exported here; recipes are built
into :data:`RECIPES`. :meth:`CastConfig.operand_spec` is the one place a granularity becomes a block.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from f8tensor.quant.formats import FLOAT8_DTYPES, FORMATS
from f8tensor.quant.hadamard import check_rht_seed
from f8tensor.quant.recipes import CAST_ROLES, RECIPE_FIELDS
from f8tensor.quant.specs import (  # noqa: F401  (the vocabulary, re-exported: importable from here as before)
    DEFAULT_GEMM,
    E8M0_SCALE_MODES,
    FP4_BLOCKS,
    FP4_CAST_DTYPE,
    HISTORY_REDUCTIONS,
    NVFP4_SCALE,
    ROUNDING_MODES,
    BLOCK_1x128,
    BLOCK_128x128,
    BlockGranularity,
    CastSpec,
    GemmConfig,
    Granularity,
    MX_1x32,
    MX_1x32_FLOOR,
    MXFP4_1x32,
    NVFP4_1x16,
    NVFP4_16x16,
    axiswise_block,
    axiswise_dim,
    block_scale_shape,
    check_bool,
    constant_along,
    is_axiswise,
    is_blockwise,
    is_tensorwise,
    parse_enum,
    parse_granularity,
    varies_along,
)

__all__ = [
    "FP4_CAST_DTYPE",
    "GEMMS",
    "RECIPES",
    "BLOCK_1x128",
    "BLOCK_128x128",
    "BlockGranularity",
    "CastConfig",
    "CastSpec",
    "DelayedScalingConfig",
    "Float8LinearConfig",
    "GemmConfig",
    "GemmOverride",
    "Granularity",
    "MXFP4_1x32",
    "MX_1x32",
    "MX_1x32_FLOOR",
    "NVFP4_1x16",
    "NVFP4_16x16",
    "ScalingType",
]


class ScalingType(str, enum.Enum):
    """Where a cast's scale comes from: the current amax (dynamic) or an amax history (delayed)."""

    DYNAMIC = "dynamic"
    DELAYED = "delayed"

    @classmethod
    def parse(cls, value: object) -> ScalingType:
        return parse_enum(cls, value, "scaling")


@dataclasses.dataclass(frozen=True)
class CastConfig:
    """How one operand (input, weight or grad_output) of a Float8Linear is cast.

    A block granularity is written for the operand as ``(rows, contracted)`` and re-oriented
    per GEMM. ``rounding``: ``"nearest"`` or ``"stochastic"`` (torch's global generator).

    Raises:
        TypeError: ``dtype`` is not an FP8 dtype, or a flag is not a bool.
        ValueError: an unknown granularity, scaling or rounding, or delayed non-tensorwise scaling.

    Example:
        >>> from f8tensor import CastConfig
        >>> CastConfig(torch.float8_e5m2, "rowwise").granularity
        <Granularity.ROWWISE: 'rowwise'>
    """

    dtype: torch.dtype = torch.float8_e4m3fn
    granularity: Granularity | BlockGranularity = Granularity.TENSORWISE
    scaling: ScalingType = ScalingType.DYNAMIC
    power_of_2_scale: bool = False
    rounding: str = "nearest"

    def __post_init__(self) -> None:
        if self.dtype != FP4_CAST_DTYPE and not (isinstance(self.dtype, torch.dtype) and self.dtype in FORMATS):
            allowed = ", ".join(str(d) for d in FLOAT8_DTYPES)
            raise TypeError(
                f"CastConfig.dtype must be one of {allowed} (or {FP4_CAST_DTYPE}, FP4_CAST_DTYPE, with an NVFP4/MXFP4 "
                f"granularity); got {self.dtype!r}"
            )
        # Accept the strings users type; store the enums.
        object.__setattr__(self, "granularity", parse_granularity(self.granularity))
        self._check_fp4()
        object.__setattr__(self, "scaling", ScalingType.parse(self.scaling))
        check_bool("CastConfig", "power_of_2_scale", self.power_of_2_scale)
        if self.rounding not in ROUNDING_MODES:
            raise ValueError(f"CastConfig.rounding must be one of {ROUNDING_MODES}; got {self.rounding!r}")
        if self.scaling is ScalingType.DELAYED and self.granularity is not Granularity.TENSORWISE:
            raise ValueError("delayed scaling keeps one amax history per tensor: it needs granularity='tensorwise'")
        if isinstance(self.granularity, BlockGranularity) and len(self.granularity.block) != 2:
            raise ValueError(
                f"a Float8Linear operand's block has 2 entries (rows, contracted); got {self.granularity.block}"
            )

    def _check_fp4(self) -> None:
        gran = self.granularity
        fp4_gran = isinstance(gran, BlockGranularity) and gran.scale_dtype == NVFP4_SCALE
        if self.dtype == FP4_CAST_DTYPE:
            ok = isinstance(gran, BlockGranularity) and gran.block in FP4_BLOCKS.get(gran.scale_dtype, ())
            if not ok:
                raise ValueError(
                    "an FP4 CastConfig needs an FP4 granularity: NVFP4_1x16, NVFP4_16x16 (e4m3fn scales) or "
                    f"MXFP4_1x32 (e8m0 scales); got {gran!r}"
                )
            if self.scaling is not ScalingType.DYNAMIC or self.power_of_2_scale:
                raise ValueError("FP4 casts take dynamic block scales (no delayed scaling, no power_of_2_scale)")
        elif fp4_gran:
            raise ValueError(f"e4m3fn block scales are NVFP4's: use dtype=FP4_CAST_DTYPE with {gran!r}")

    @property
    def fp4(self) -> bool:
        """An FP4 cast (NVFP4 or MXFP4)."""
        return self.dtype == FP4_CAST_DTYPE

    @property
    def fp4_kind(self) -> str | None:
        """``"nvfp4"``, ``"mxfp4"``, or ``None`` for an FP8 cast."""
        if not self.fp4:
            return None
        gran = self.granularity
        assert isinstance(gran, BlockGranularity)  # an FP4 cast's granularity is a block one (_check_fp4)
        return "nvfp4" if gran.scale_dtype == NVFP4_SCALE else "mxfp4"

    def operand_spec(self, contracted_dim: int, *, ndim: int = 2, per_expert: bool = False) -> CastSpec:
        """The :class:`CastSpec` of a GEMM operand of ``ndim`` dims contracted over ``contracted_dim``.

        A block's second entry runs along the contracted dim; leading dims get 1, or with
        ``per_expert`` index expert matrices with scales of their own.
        """
        lead = ndim - 2
        contracted = contracted_dim % ndim - lead
        gran = self.granularity
        if isinstance(gran, BlockGranularity):
            matrix = gran.block if contracted == 1 else gran.block[::-1]
            block = (1,) * lead + matrix
        elif gran is Granularity.ROWWISE:
            block = tuple(0 if d == contracted_dim % ndim else 1 for d in range(ndim))
        else:
            block = (1,) * lead + (0, 0) if per_expert and lead else ()
        scale_dtype = gran.scale_dtype if isinstance(gran, BlockGranularity) else torch.float32
        scale_mode = gran.scale_mode if isinstance(gran, BlockGranularity) else "rceil"
        return CastSpec(self.dtype, block, scale_dtype, scale_mode, self.power_of_2_scale, self.rounding)

    @property
    def rowwise(self) -> bool:
        return self.granularity is Granularity.ROWWISE

    @property
    def tensorwise(self) -> bool:
        return self.granularity is Granularity.TENSORWISE

    @property
    def blockwise(self) -> bool:
        return isinstance(self.granularity, BlockGranularity)

    @property
    def delayed(self) -> bool:
        return self.scaling is ScalingType.DELAYED


_E4M3 = torch.float8_e4m3fn
_E5M2 = torch.float8_e5m2

#: The longest amax history: every delayed cast reduces the whole window.
MAX_HISTORY_LEN = 1024


def max_margin(float8_dtype: torch.dtype) -> int:
    """The largest delayed-scaling margin that keeps the amax a normal number of the format."""
    fmt = FORMATS[float8_dtype]
    return math.floor(math.log2(fmt.max / fmt.smallest_normal))


_MAX_ANY_MARGIN = max(max_margin(d) for d in FLOAT8_DTYPES)


@dataclasses.dataclass(frozen=True)
class DelayedScalingConfig:
    """The amax history of delayed scaling (defaults: 16 steps, max, margin 0).

    Raises:
        ValueError: ``history_len`` outside ``[1, MAX_HISTORY_LEN]``, an unknown reduction or a negative margin.
    """

    history_len: int = 16
    reduction: str = "max"
    margin: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.history_len, bool) or not isinstance(self.history_len, int) or self.history_len < 1:
            raise ValueError(f"DelayedScalingConfig.history_len must be an int >= 1; got {self.history_len!r}")
        if self.history_len > MAX_HISTORY_LEN:
            raise ValueError(
                f"DelayedScalingConfig.history_len must be in [1, {MAX_HISTORY_LEN}] (every delayed cast reduces "
                f"the whole window, and each layer keeps three); got {self.history_len!r}"
            )
        if self.reduction not in HISTORY_REDUCTIONS:
            raise ValueError(
                f"DelayedScalingConfig.reduction must be one of {HISTORY_REDUCTIONS}; got {self.reduction!r}"
            )
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"DelayedScalingConfig.margin must be an int >= 0; got {self.margin!r}")
        if self.margin > _MAX_ANY_MARGIN:
            raise ValueError(
                f"DelayedScalingConfig.margin must be in [0, {_MAX_ANY_MARGIN}] (and at most "
                f"{max_margin(_E4M3)} for e4m3fn); got {self.margin!r}"
            )


#: The three GEMMs of a linear layer and the operand roles each multiplies.
GEMMS: dict[str, tuple[str, str]] = {
    "forward": ("input", "weight"),
    "grad_input": ("grad_output", "weight"),
    "grad_weight": ("grad_output", "input"),
}


class GemmOverride(NamedTuple):
    """The cast of one operand of one GEMM, overriding its role's; ``None``: that GEMM in high precision."""

    gemm: str
    operand: str
    cast: CastConfig | None


_OVERRIDES_FORM = (
    "a dict {(gemm, operand): CastConfig or None} or a sequence of GemmOverride(gemm, operand, cast) "
    "(or (gemm, operand, cast) tuples), e.g. {('forward', 'input'): None}"
)


def _parse_overrides(value: dict[Any, Any] | Iterable[Any], field: str = "gemm_overrides") -> tuple[GemmOverride, ...]:
    """``{(gemm, operand): cast}`` or :class:`GemmOverride` tuples -> a sorted tuple; errors name ``field``."""
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{field} must be {_OVERRIDES_FORM}; got {value!r}")
    else:
        items = []
        for o in value:
            if not (isinstance(o, (tuple, list)) and len(o) == 3):
                raise TypeError(
                    f"{field}: each entry must be a GemmOverride(gemm, operand, cast) or a (gemm, operand, cast) tuple; got {o!r} ({field} must be {_OVERRIDES_FORM})"
                )
            items.append(((o[0], o[1]), o[2]))
    out = {}
    for key, cast in items:
        if not (isinstance(key, tuple) and len(key) == 2):
            raise TypeError(
                f"{field}: a GEMM override is keyed by (gemm, operand); got {key!r} ({field} must be {_OVERRIDES_FORM})"
            )
        gemm, operand = key
        if gemm not in GEMMS:
            raise ValueError(f"{field}: unknown GEMM {gemm!r}; GEMMs are {', '.join(GEMMS)}")
        if operand not in GEMMS[gemm]:
            raise ValueError(
                f"{field}: the {gemm} GEMM multiplies {' and '.join(GEMMS[gemm])}; got operand {operand!r}"
            )
        if cast is not None and not isinstance(cast, CastConfig):
            raise TypeError(f"{field}: a GEMM override's cast is a CastConfig or None (high precision); got {cast!r}")
        if cast is not None and cast.delayed:
            raise ValueError(
                f"{field}: per-GEMM formats use dynamic scaling; a delayed CastConfig cannot be an override"
            )
        out[(gemm, operand)] = cast
    return tuple(GemmOverride(g, o, c) for (g, o), c in sorted(out.items()))


@dataclasses.dataclass(frozen=True)
class Float8LinearConfig:
    """Everything a Float8Linear needs to know; build one with :meth:`from_recipe`.

    - ``input``, ``weight``, ``grad_output``: per-operand :class:`CastConfig`.
    - ``weight_grad_in_hp``: compute ``grad_W`` in high precision.
    - ``delayed``: history settings for operands with ``scaling="delayed"``.
    - ``pad_inner_dim``: zero-pad K and N to multiples of 16 instead of refusing a layer.
    - ``use_fast_accum``: Hopper fast accumulation in the forward GEMM.
    - ``enable_fsdp_float8_all_gather``: under FSDP2, all-gather weights in FP8.
    - ``collect_stats``: saturation/underflow telemetry per cast.
    - ``emulate``: block-scaled GEMMs on the reference path; a device without their kernels
      (every CPU) emulates them anyway and warns once unless this is set.
    - ``gemm_overrides``: per-GEMM formats (see :meth:`cast_for`).
    - ``hadamard_wgrad``, ``hadamard_seed``: the random Hadamard transform before FP4 wgrad casts.
    - ``four_over_six``: NVFP4 casts also try 4 as each block's largest value.

    Raises:
        TypeError: a field of the wrong type.
        ValueError: a combination the GEMMs cannot run (the message says which).
    """

    input: CastConfig = CastConfig(_E4M3)
    weight: CastConfig = CastConfig(_E4M3)
    grad_output: CastConfig = CastConfig(_E5M2)
    weight_grad_in_hp: bool = False
    delayed: DelayedScalingConfig = DelayedScalingConfig()
    pad_inner_dim: bool = False
    use_fast_accum: bool = True
    enable_fsdp_float8_all_gather: bool = False
    collect_stats: bool = False
    emulate: bool = False
    gemm_overrides: tuple[GemmOverride, ...] = ()
    hadamard_wgrad: bool = False
    hadamard_seed: int = 0
    four_over_six: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "gemm_overrides", _parse_overrides(self.gemm_overrides))
        for name in ("hadamard_wgrad", "four_over_six"):
            check_bool("Float8LinearConfig", name, getattr(self, name))
        check_rht_seed(self.hadamard_seed, "Float8LinearConfig.hadamard_seed")
        for name in ("input", "weight", "grad_output"):
            if not isinstance(getattr(self, name), CastConfig):
                raise TypeError(f"Float8LinearConfig.{name} must be a CastConfig; got {getattr(self, name)!r}")
        if not isinstance(self.delayed, DelayedScalingConfig):
            raise TypeError(f"Float8LinearConfig.delayed must be a DelayedScalingConfig; got {self.delayed!r}")
        for name in (
            "weight_grad_in_hp",
            "pad_inner_dim",
            "use_fast_accum",
            "enable_fsdp_float8_all_gather",
            "collect_stats",
            "emulate",
        ):
            check_bool("Float8LinearConfig", name, getattr(self, name))
        # cuBLASLt multiplies no two e5m2 operands; name the GEMM that would hit it.
        for name, (ra, rb) in GEMMS.items():
            a, b = self.cast_for(name, ra), self.cast_for(name, rb)
            if a is not None and b is not None and _is_e5m2(a.dtype) and _is_e5m2(b.dtype):
                raise ValueError(
                    f"the {name} ({ra} x {rb}) GEMM would multiply two e5m2 tensors, which torch._scaled_mm "
                    f"refuses; use e4m3 for one of them"
                )
        roles = tuple(r for r in ("input", "weight", "grad_output") if not getattr(self, r).fp4)
        families = {role: "fnuz" if "fnuz" in str(getattr(self, role).dtype) else "fn" for role in roles}
        if len(set(families.values())) > 1:
            raise ValueError(
                "every operand must use one FP8 family, fn (e4m3fn, e5m2) or fnuz (e4m3fnuz, e5m2fnuz): "
                f"the GEMMs multiply them together; got {', '.join(f'{r}={getattr(self, r).dtype}' for r in families)}"
            )
        for role in ("input", "weight", "grad_output"):
            cast = getattr(self, role)
            if cast.delayed and self.delayed.margin > max_margin(cast.dtype):
                raise ValueError(
                    f"DelayedScalingConfig.margin={self.delayed.margin} would scale the {role}'s amax below the "
                    f"smallest normal {cast.dtype} number (flushing the tensor to zero); the most {cast.dtype} "
                    f"allows is {max_margin(cast.dtype)}"
                )
        if self.uses_gemm_formats and self.any_delayed:
            raise ValueError(
                "FP4 casts and per-GEMM formats use dynamic scaling; this config also asks for delayed scaling"
            )
        if self.uses_gemm_formats and self.enable_fsdp_float8_all_gather:
            raise ValueError(
                "enable_fsdp_float8_all_gather gathers FP8 weights; FP4 casts and per-GEMM formats are not "
                "gathered in low precision (leave it False: FSDP2 gathers these weights in high precision)"
            )

    @property
    def any_delayed(self) -> bool:
        return self.input.delayed or self.weight.delayed or self.grad_output.delayed

    @property
    def any_fp4(self) -> bool:
        casts = [self.input, self.weight, self.grad_output] + [o.cast for o in self.gemm_overrides]
        return any(c is not None and c.fp4 for c in casts)

    @property
    def uses_gemm_formats(self) -> bool:
        """Whether this config runs the per-GEMM-formats linear."""
        return bool(self.gemm_overrides) or self.any_fp4

    def cast_for(self, gemm: str, operand: str) -> CastConfig | None:
        """The cast of ``operand`` in ``gemm``: its override, else the role's; ``None``: high precision.

        Raises:
            ValueError: an unknown ``gemm``, or an ``operand`` it does not multiply.
        """
        if operand not in GEMMS.get(gemm, ()):
            raise ValueError(
                f"cast_for: no operand {operand!r} of GEMM {gemm!r}; the GEMMs and their operands are "
                + "; ".join(f"{g}: {' and '.join(roles)}" for g, roles in GEMMS.items())
            )
        for o in self.gemm_overrides:
            if o.gemm == gemm and o.operand == operand:
                return o.cast
        if gemm == "grad_weight" and self.weight_grad_in_hp:
            return None
        return getattr(self, operand)

    def with_gemm_formats(self, overrides: dict | tuple = (), **fields: Any) -> Float8LinearConfig:
        """A copy with ``overrides`` merged into :attr:`gemm_overrides` and ``fields`` replaced."""
        merged = {(o.gemm, o.operand): o.cast for o in self.gemm_overrides}
        merged.update(
            {
                (o[0], o[1]): o[2]
                for o in _parse_overrides(overrides, "with_gemm_formats(overrides) (merged into gemm_overrides)")
            }
        )
        return dataclasses.replace(self, gemm_overrides=_parse_overrides(merged), **fields)

    @classmethod
    def from_recipe(cls, name: str, **overrides: Any) -> Float8LinearConfig:
        """A named recipe (see :doc:`recipes`), with top-level fields replaced by ``overrides``.

        Raises:
            ValueError: an unknown recipe name, or an override the config refuses.
            TypeError: an override that names no field.

        Example:
            >>> from f8tensor import Float8LinearConfig
            >>> config = Float8LinearConfig.from_recipe("rowwise", pad_inner_dim=True)
            >>> config.input.granularity.value, config.pad_inner_dim
            ('rowwise', True)
            >>> Float8LinearConfig.from_recipe("fast")
            Traceback (most recent call last):
            ...
            ValueError: unknown recipe 'fast'; choose one of [...]
        """
        if not isinstance(name, str) or name not in RECIPES:
            raise ValueError(f"unknown recipe {name!r}; choose one of {sorted(RECIPES)}")
        fields = [f.name for f in dataclasses.fields(cls)]
        for key in overrides:
            if key not in fields:
                raise TypeError(f"unknown Float8LinearConfig field {key!r}; fields are {', '.join(fields)}")
        return dataclasses.replace(RECIPES[name], **overrides)


def _is_e5m2(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e5m2, torch.float8_e5m2fnuz)


def _recipe(fields: dict[str, Any]) -> Float8LinearConfig:
    built: dict[str, Any] = {k: CastConfig(**v) if k in CAST_ROLES else v for k, v in fields.items()}
    return Float8LinearConfig(**built)


#: The named recipes (``recipes.py``), validated.
RECIPES: dict[str, Float8LinearConfig] = {name: _recipe(fields) for name, fields in RECIPE_FIELDS.items()}
