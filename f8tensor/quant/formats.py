"""The FP8 formats PyTorch knows, their ranges, and the one saturating cast.

Every conversion to FP8 goes through :func:`saturated_cast`: a plain ``.to(float8_dtype)``
does not saturate consistently across formats.
"""

from __future__ import annotations

import dataclasses
import math

import torch

__all__ = [
    "E8M0",
    "E8M0_MAX_EXP",
    "E8M0_MIN_EXP",
    "FLOAT4_X2",
    "FLOAT8_DTYPES",
    "FORMATS",
    "HP_DTYPES",
    "SCALE_DTYPES",
    "Float8Format",
    "check_float8_dtype",
    "check_hp_dtype",
    "e4m3_like",
    "float8_max",
    "format_number",
    "saturated_cast",
    "saturation_bound",
]

FLOAT8_DTYPES: tuple[torch.dtype, ...] = (
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
)

#: High-precision dtypes a Float8Tensor can stand for (its outer dtype).
HP_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)


@dataclasses.dataclass(frozen=True)
class Float8Format:
    """The numbers that describe one FP8 format."""

    dtype: torch.dtype
    exponent_bits: int
    mantissa_bits: int
    max: float
    smallest_normal: float
    smallest_subnormal: float
    eps: float
    has_inf: bool
    has_negative_zero: bool

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def emax(self) -> int:
        """``floor(log2(max))``, the OCP MX spec's ``emax_elem``."""
        return math.floor(math.log2(self.max))


def _describe(dtype: torch.dtype, exponent_bits: int, mantissa_bits: int) -> Float8Format:
    info = torch.finfo(dtype)
    fnuz = "fnuz" in str(dtype)
    return Float8Format(
        dtype=dtype,
        exponent_bits=exponent_bits,
        mantissa_bits=mantissa_bits,
        max=float(info.max),
        smallest_normal=float(info.smallest_normal),
        smallest_subnormal=float(info.smallest_normal) * 2.0**-mantissa_bits,
        # Not torch.finfo's: it reports 0.125 for e5m2fnuz, whose spacing is 0.25.
        eps=2.0**-mantissa_bits,
        has_inf=dtype == torch.float8_e5m2,
        has_negative_zero=not fnuz,
    )


FORMATS: dict[torch.dtype, Float8Format] = {
    torch.float8_e4m3fn: _describe(torch.float8_e4m3fn, 4, 3),
    torch.float8_e5m2: _describe(torch.float8_e5m2, 5, 2),
    torch.float8_e4m3fnuz: _describe(torch.float8_e4m3fnuz, 4, 3),
    torch.float8_e5m2fnuz: _describe(torch.float8_e5m2fnuz, 5, 2),
}

#: The MX scale dtype; holds f8tensor's scale, the reciprocal of the spec's X (exact).
E8M0: torch.dtype = torch.float8_e8m0fnu
#: Exponent range of e8m0.
E8M0_MIN_EXP: int = -127
E8M0_MAX_EXP: int = 127
#: The dtype of FP4 data (two E2M1 per byte), packed through ``uint8`` views.
FLOAT4_X2: torch.dtype = getattr(torch, "float4_e2m1fn_x2", torch.uint8)
#: Scale dtypes: fp32, or e8m0 for block scales.
SCALE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, E8M0)

_ALLOWED_FP8 = ", ".join(str(d) for d in FLOAT8_DTYPES)
_ALLOWED_HP = ", ".join(str(d) for d in HP_DTYPES)


def float8_max(dtype: torch.dtype) -> float:
    """Largest finite value of ``dtype``.

    Raises:
        TypeError: ``dtype`` is not an FP8 dtype.

    Example:
        >>> from f8tensor import float8_max
        >>> float8_max(torch.float8_e4m3fn), float8_max(torch.float8_e5m2)
        (448.0, 57344.0)
    """
    return FORMATS[check_float8_dtype(dtype)].max


def check_float8_dtype(dtype: object, what: str = "float8_dtype") -> torch.dtype:
    """``dtype`` if an FP8 dtype, else ``TypeError``."""
    if not isinstance(dtype, torch.dtype) or dtype not in FORMATS:
        raise TypeError(f"{what} must be one of {_ALLOWED_FP8}; got {dtype!r}")
    return dtype  # type: ignore[return-value]


def check_hp_dtype(dtype: object, what: str = "input") -> torch.dtype:
    """``dtype`` if bf16, fp16 or fp32, else ``TypeError``."""
    if not isinstance(dtype, torch.dtype) or dtype not in HP_DTYPES:
        raise TypeError(f"{what} must have a high-precision floating dtype ({_ALLOWED_HP}); got {dtype!r}")
    return dtype  # type: ignore[return-value]


def e4m3_like(dtype: torch.dtype) -> torch.dtype:
    """The e4m3 format of ``dtype``'s family (fn or fnuz)."""
    return torch.float8_e4m3fnuz if "fnuz" in str(dtype) else torch.float8_e4m3fn


@torch.compiler.assume_constant_result
def format_number(float8_dtype: torch.dtype, name: str) -> float:
    """``getattr(FORMATS[float8_dtype], name)`` as a torch.compile constant; traced code reads formats so."""
    return getattr(FORMATS[float8_dtype], name)


def saturated_cast(
    x: torch.Tensor, float8_dtype: torch.dtype, *, inplace: bool = False, fmax: float | None = None
) -> torch.Tensor:
    """Clamp scaled fp32 ``x`` to the format's range and convert; NaN stays NaN.

    Args:
        inplace: clamp ``x`` itself.
        fmax: the format's largest value, where the caller read it already.
    """
    if fmax is None:
        fmax = format_number(float8_dtype, "max")
    clamped = x.clamp_(min=-fmax, max=fmax) if inplace else x.clamp(min=-fmax, max=fmax)
    return clamped.to(float8_dtype)


def _saturation_bound(fmt: Float8Format) -> float:
    ulp = 2.0 ** (math.floor(math.log2(fmt.max)) - fmt.mantissa_bits)
    tie = fmt.max + ulp / 2
    if int(fmt.max / ulp) % 2 == 0:
        return tie  # rounds down to max (half to even)
    # An odd max mantissa rounds the tie up: the bound is the fp32 number below it (both
    # fp32: a float64 default dtype would promote the step).
    f32 = torch.float32
    return float(torch.nextafter(torch.tensor(tie, dtype=f32), torch.tensor(0.0, dtype=f32)))


_SATURATION_BOUNDS: dict[torch.dtype, float] = {dtype: _saturation_bound(fmt) for dtype, fmt in FORMATS.items()}


@torch.compiler.assume_constant_result  # a constant to torch.compile: see format_number
def saturation_bound(dtype: torch.dtype) -> float:
    """The largest scaled fp32 magnitude the saturating clamp leaves alone.

    Values above it would round past max; ``(max, bound]`` rounds to max anyway.
    """
    return _SATURATION_BOUNDS[check_float8_dtype(dtype)]
