"""The FP8 formats PyTorch knows, their ranges, and the one saturating cast.

Every conversion to FP8 in f8tensor goes through :func:`saturated_cast`: a plain
``.to(float8_dtype)`` does not saturate consistently (e4m3fn has no inf, so
out-of-range values become NaN; e5m2 overflows to inf; fnuz formats differ again).
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
    """The numbers that describe one FP8 format (range from ``torch.finfo``, eps from the mantissa)."""

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
        """The exponent of the largest binade, ``floor(log2(max))``: 8 for e4m3fn, 15 for e5m2.

        The OCP MX spec's ``emax_elem``, which its shared-exponent rule subtracts.
        """
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
        # The smallest subnormal is one mantissa ulp below the smallest normal.
        smallest_subnormal=float(info.smallest_normal) * 2.0**-mantissa_bits,
        # Spacing above 1.0. Derived from the mantissa width, not torch.finfo: finfo reports
        # 0.125 for e5m2fnuz, yet 1.125 is not representable there (the spacing is 0.25).
        eps=2.0**-mantissa_bits,
        # Only e5m2 keeps IEEE infinities; e4m3fn and both fnuz formats have none.
        has_inf=dtype == torch.float8_e5m2,
        has_negative_zero=not fnuz,
    )


FORMATS: dict[torch.dtype, Float8Format] = {
    torch.float8_e4m3fn: _describe(torch.float8_e4m3fn, 4, 3),
    torch.float8_e5m2: _describe(torch.float8_e5m2, 5, 2),
    torch.float8_e4m3fnuz: _describe(torch.float8_e4m3fnuz, 4, 3),
    torch.float8_e5m2fnuz: _describe(torch.float8_e5m2fnuz, 5, 2),
}

# ---------------------------------------------------------------- e8m0: the MX scale format
#
# torch.float8_e8m0fnu (OCP Microscaling spec v1.0, section 5.4): 8 exponent bits, no sign,
# no mantissa; byte e stands for 2**(e - 127), so 2**-127 .. 2**127, and byte 0xFF is NaN.
# There is no zero and no infinity. f8tensor stores its own scale (the multiplier
# hp -> data, see scaling.py) in it, i.e. the reciprocal of the spec's shared scale X:
# ``data = saturate(hp * scale)``, ``hp ~= data / scale`` with ``scale = 1 / X``. Both are
# powers of two, so the reciprocal is exact, and the exponent range is symmetric.

#: The MX scale dtype.
E8M0: torch.dtype = torch.float8_e8m0fnu
#: Smallest and largest exponent an e8m0 byte holds: 2**-127 and 2**127.
E8M0_MIN_EXP: int = -127
E8M0_MAX_EXP: int = 127
#: The dtype FP4 data is stored in: ``torch.float4_e2m1fn_x2`` (two E2M1 values per byte,
#: what PyTorch's FP4 kernels take; every supported torch has it, with no conversion
#: kernels, so f8tensor packs and unpacks through ``uint8`` views), or ``uint8`` on a torch
#: without it.
FLOAT4_X2: torch.dtype = getattr(torch, "float4_e2m1fn_x2", torch.uint8)
#: Scale dtypes a Float8Tensor may carry: fp32 (any granularity) or e8m0 (block scales).
SCALE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, E8M0)

_ALLOWED_FP8 = ", ".join(str(d) for d in FLOAT8_DTYPES)
_ALLOWED_HP = ", ".join(str(d) for d in HP_DTYPES)


def float8_max(dtype: torch.dtype) -> float:
    """Largest finite value of ``dtype`` (448, 57344, 240 or 57344).

    Raises:
        TypeError: ``dtype`` is not one of the four FP8 dtypes.

    Example:
        >>> from f8tensor import float8_max
        >>> float8_max(torch.float8_e4m3fn), float8_max(torch.float8_e5m2)
        (448.0, 57344.0)
    """
    return FORMATS[check_float8_dtype(dtype)].max


def check_float8_dtype(dtype: object, what: str = "float8_dtype") -> torch.dtype:
    """Return ``dtype`` if it is one of the four FP8 dtypes, else raise ``TypeError``."""
    if not isinstance(dtype, torch.dtype) or dtype not in FORMATS:
        raise TypeError(f"{what} must be one of {_ALLOWED_FP8}; got {dtype!r}")
    return dtype  # type: ignore[return-value]


def check_hp_dtype(dtype: object, what: str = "input") -> torch.dtype:
    """Return ``dtype`` if it is bf16, fp16 or fp32, else raise ``TypeError``."""
    if not isinstance(dtype, torch.dtype) or dtype not in HP_DTYPES:
        raise TypeError(
            f"{what} must have a high-precision floating dtype ({_ALLOWED_HP}); got {dtype!r}"
        )
    return dtype  # type: ignore[return-value]


def e4m3_like(dtype: torch.dtype) -> torch.dtype:
    """The e4m3 format of the same family (fn or fnuz) as ``dtype``."""
    return torch.float8_e4m3fnuz if "fnuz" in str(dtype) else torch.float8_e4m3fn


@torch.compiler.assume_constant_result
def format_number(float8_dtype: torch.dtype, name: str) -> float:
    """``getattr(FORMATS[float8_dtype], name)`` (``"max"``, ``"smallest_subnormal"``, ``"emax"``, ...),
    a constant to torch.compile. Code that torch.compile traces reads format numbers through
    this, never as ``FORMATS[dtype].max``: under ``torch.compile(dynamic=True)`` dynamo turns a
    float read from a global (or its attribute) into a symbolic graph input, and when the
    first read happens inside one autograd Function's subgraph, the graph's next Function
    (the model's next layer) reuses a symbol bound in that finished subgraph and dynamo fails
    ("lift_tracked_freevar_to_input should not be called on root SubgraphTracer")."""
    return getattr(FORMATS[float8_dtype], name)


def saturated_cast(x: torch.Tensor, float8_dtype: torch.dtype, *, inplace: bool = False) -> torch.Tensor:
    """Clamp an already scaled fp32 tensor to the finite range of ``float8_dtype`` and convert.

    ``inplace`` clamps ``x`` itself (for a temporary the caller owns: one allocation less).
    NaN stays NaN (clamp keeps it). An infinity would become the max value here, so the
    callers guard against infinite *inputs* through the scale (see ``scaling.py``).
    """
    fmax = format_number(float8_dtype, "max")
    clamped = x.clamp_(min=-fmax, max=fmax) if inplace else x.clamp(min=-fmax, max=fmax)
    return clamped.to(float8_dtype)


def _saturation_bound(fmt: Float8Format) -> float:
    # The top binade's spacing: max = m * ulp with an integer mantissa m.
    ulp = 2.0 ** (math.floor(math.log2(fmt.max)) - fmt.mantissa_bits)
    tie = fmt.max + ulp / 2
    if int(fmt.max / ulp) % 2 == 0:
        return tie  # round-half-to-even sends the tie down to max: not clipped
    # An odd max mantissa sends the tie up, out of range: the tie itself is clipped, so
    # the bound is the fp32 number just below it (callers compare fp32 with ">").
    # Both fp32: with torch's default dtype set to float64, a plain tensor(0.0) would promote
    # the step to float64's neighbour, which is not an fp32 number.
    f32 = torch.float32
    return float(torch.nextafter(torch.tensor(tie, dtype=f32), torch.tensor(0.0, dtype=f32)))


_SATURATION_BOUNDS: dict[torch.dtype, float] = {dtype: _saturation_bound(fmt) for dtype, fmt in FORMATS.items()}


@torch.compiler.assume_constant_result  # a constant to torch.compile: see format_number
def saturation_bound(dtype: torch.dtype) -> float:
    """The largest scaled fp32 magnitude whose FP8 value the saturating clamp leaves alone.

    A scaled value ``|x| > saturation_bound(dtype)`` is *saturated*: round-to-nearest would
    take it past the format's max (to a value the format lacks, inf or NaN), so the clamp
    is what sets its FP8 value. Values in ``(max, bound]`` round to max anyway (their error
    is an ordinary rounding error of at most half a spacing) and are not counted; nor is
    max itself, which is representable. Counting ``|x| > max`` instead would report
    saturation under dynamic scaling, where ``amax * scale`` lands one fp32 ulp above max
    for roughly one tensor in ten. Bounds: 464 for e4m3fn (its max, 448, has an even
    mantissa, so the tie 464 rounds down); for e4m3fnuz, e5m2 and e5m2fnuz the ties 248 and
    61440 round up, so the bound is the fp32 number just below them.
    """
    return _SATURATION_BOUNDS[check_float8_dtype(dtype)]
