"""The four FP8 formats, side by side: range, precision, saturation, rounding, scaling.

Run:  python tutorials/01_fp8_formats.py
A figure of the representable values is written to $F8TENSOR_OUT (default ./out).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from f8tensor import FLOAT8_DTYPES, FORMATS, Float8Tensor, sqnr
from f8tensor.quant.formats import saturated_cast

torch.manual_seed(0)


def short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.float8_")


# ----------------------------------------------------------------------------- 1. the numbers
# FP8 packs sign, exponent and mantissa into one byte. e4m3 spends more bits on precision,
# e5m2 on range. The "fn" formats have no infinity (e4m3fn) and the "fnuz" ones (AMD MI300
# and Graphcore) have no negative zero either: their 0x80 byte is the single NaN.
print("1. The formats (from f8tensor.FORMATS)\n")
header = (
    f"{'format':<10} {'E':>2} {'M':>2} {'max':>9} {'min normal':>12} {'min subnormal':>14} "
    f"{'eps':>7} {'inf':>5} {'-0':>5}"
)
print(header)
print("-" * len(header))
for dtype in FLOAT8_DTYPES:
    f = FORMATS[dtype]
    print(
        f"{short(dtype):<10} {f.exponent_bits:>2} {f.mantissa_bits:>2} {f.max:>9g} {f.smallest_normal:>12.4g} "
        f"{f.smallest_subnormal:>14.4g} {f.eps:>7g} {f.has_inf!s:>5} {f.has_negative_zero!s:>5}"
    )

# The table's facts, checked on the bytes themselves: only e5m2 stores infinity, and the
# fnuz formats' 0x80 byte (negative zero elsewhere) is their NaN.
for dtype in FLOAT8_DTYPES:
    f = FORMATS[dtype]
    byte_0x80 = torch.tensor([0x80], dtype=torch.uint8).view(dtype).float()
    assert f.has_inf == (dtype == torch.float8_e5m2), f"{short(dtype)}: inf"
    assert bool(byte_0x80.isnan()) == (not f.has_negative_zero) == ("fnuz" in str(dtype)), f"{short(dtype)}: 0x80"

# eps is the gap between 1 and the next number up: 2**-mantissa_bits. torch.finfo agrees,
# except for e5m2fnuz, where it reports 0.125 although 1.125 cannot be stored.
finfo_eps = torch.finfo(torch.float8_e5m2fnuz).eps
stored = torch.tensor(1.125).to(torch.float8_e5m2fnuz).float().item()
print(
    f"\ntorch.finfo(float8_e5m2fnuz).eps = {finfo_eps}, but 1.125 stored as e5m2fnuz reads back as {stored}: "
    f"the spacing above 1 is {FORMATS[torch.float8_e5m2fnuz].eps}."
)
assert stored == 1.0 and FORMATS[torch.float8_e5m2fnuz].eps == 0.25, "e5m2fnuz stores 1.125 as 1: spacing 0.25"

# ----------------------------------------------------------------------------- 2. saturation
# What happens to a value beyond the range depends on the format (and on the device) with a
# plain .to(): some formats clamp, e5m2 overflows to inf, the fnuz formats turn it into NaN.
# f8tensor always clamps first (saturated_cast), so out-of-range values become exactly +-max.
print("\n2. Out-of-range values: .to() versus the saturating cast\n")
print(f"{'format':<10} {'input':>12} {'.to()':>10} {'saturated':>10}")
for dtype in FLOAT8_DTYPES:
    fmax = FORMATS[dtype].max
    values = torch.tensor([1.5 * fmax, -4 * fmax, float("inf")])
    plain = values.to(dtype).float()
    saturated = saturated_cast(values, dtype).float()
    for v, p, s in zip(values.tolist(), plain.tolist(), saturated.tolist()):
        print(f"{short(dtype):<10} {v:>12g} {p:>10g} {s:>10g}")
    assert saturated.tolist() == [fmax, -fmax, fmax], f"{short(dtype)}: the saturating cast clamps to +-max"
print(
    "\n(inf stays a problem even when clamped: Float8Tensor.from_hp turns a non-finite input into NaN\n"
    " instead, so a broken tensor never looks like a tensor full of max values.)"
)
broken = Float8Tensor.from_hp(torch.tensor([1.0, float("inf"), -2.0])).to_hp()
assert broken.isnan().all(), f"from_hp of a tensor holding inf reads back as NaN, not as max values: {broken}"

# ----------------------------------------------------------------------------- 3. rounding
# Inside the range, values round to the nearest representable number (ties to even). The
# relative error stays below eps/2 in the normal range: 6.25% for e4m3, 12.5% for e5m2.
# The last rows are beyond the e4m3 range and saturate (no scaling yet: see section 4).
print("\n3. Rounding of real values (saturating cast, relative error in %)\n")
reals = [0.1, 0.3, 1.06, 1.1, 3.3, 17.0, 100.0, 300.0, 1000.0]
print(f"{'value':>8} " + " ".join(f"{short(d):>18}" for d in FLOAT8_DTYPES))
for v in reals:
    cells = []
    for dtype in FLOAT8_DTYPES:
        q = saturated_cast(torch.tensor([v]), dtype).float().item()
        cells.append(f"{q:>10g} ({100 * (q - v) / v:+6.1f}%)")
        f = FORMATS[dtype]
        if v > f.max:  # beyond the range: saturated to max
            assert q == f.max, f"{short(dtype)}: {v} saturates to {f.max}, got {q}"
        elif v >= f.smallest_normal:  # the normal range: within half a step
            assert abs(q - v) / v <= f.eps / 2, f"{short(dtype)}: {v} -> {q} is more than eps/2 off"
    print(f"{v:>8g} " + " ".join(f"{c:>18}" for c in cells))

# ----------------------------------------------------------------------------- 4. scaling
# The range is narrow: small values fall below the smallest subnormal and flush to zero,
# large ones saturate. A scale (max / amax) moves the tensor's values onto the format's
# range before the cast, and dividing by it afterwards brings them back.
print("\n4. Scaling to use the range (a tensor of small values, amax ~ 4e-3)\n")
x = torch.randn(4096) * 1e-3
print(
    f"{'format':<10} {'zeros unscaled':>15} {'SQNR unscaled':>14} {'zeros scaled':>13} "
    f"{'SQNR scaled':>12} {'scale':>10}"
)
for dtype in FLOAT8_DTYPES:
    unscaled = saturated_cast(x, dtype).float()
    x8 = Float8Tensor.from_hp(x, dtype)  # dynamic scale: max / amax
    print(
        f"{short(dtype):<10} {int((unscaled == 0).sum()):>15} {sqnr(x, unscaled):>11.1f} dB "
        f"{int((x8._data.float() == 0).sum()):>13} {sqnr(x, x8.to_hp()):>9.1f} dB {x8._scale.item():>10.4g}"
    )
    # The claim: scaling removes the flush to zero and gives the format's full accuracy
    # (measured 31.2-31.5 dB e4m3, 25.6 dB e5m2; unscaled e4m3 5-11 dB).
    assert int((x8._data.float() == 0).sum()) == 0, f"{short(dtype)}: scaled values flushed to zero"
    assert sqnr(x, x8.to_hp()) >= (29.0 if dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz) else 23.0)
    assert sqnr(x, x8.to_hp()) >= sqnr(x, unscaled), f"{short(dtype)}: scaling made it worse"

# ----------------------------------------------------------------------------- 5. a picture
# Every positive finite value of each format, on a log2 axis: e4m3 is dense and short,
# e5m2 sparse and long.
out_dir = Path(os.environ.get("F8TENSOR_OUT", "out"))
try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    print("\n(matplotlib not installed: no figure)")
else:
    all_bytes = torch.arange(256, dtype=torch.uint8)
    fig, ax = plt.subplots(figsize=(8, 2.8))
    for row, dtype in enumerate(FLOAT8_DTYPES):
        values = all_bytes.view(dtype).float()
        positive = values[torch.isfinite(values) & (values > 0)]
        ax.scatter(torch.log2(positive), [row] * len(positive), s=6)
    ax.set_yticks(range(len(FLOAT8_DTYPES)), [short(d) for d in FLOAT8_DTYPES])
    ax.set_xlabel("log2 of each positive representable value")
    ax.set_title("FP8 formats: where the numbers are")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "01_fp8_formats.png"
    fig.savefig(path, dpi=120)
    print(f"\nwrote {path}")
