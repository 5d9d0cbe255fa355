"""Float8Tensor: cast a weight to FP8, multiply with it, choose the output dtype, know the limits.

Run:  python tutorials/02_float8tensor.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from f8tensor import Float8Tensor, GemmConfig, float8_mm, sqnr

torch.manual_seed(0)

w = torch.randn(256, 512, dtype=torch.bfloat16)  # a weight (out_features, in_features)
x = torch.randn(4, 64, 512, dtype=torch.bfloat16)  # activations (batch, sequence, features)

# A bf16 reference, and an fp32 one to judge it by.
ref_bf16 = x @ w.t()
ref_fp32 = x.float() @ w.float().t()
print(f"bf16 matmul itself vs fp32: {sqnr(ref_fp32, ref_bf16):.1f} dB\n")

# ----------------------------------------------------------------------------- 1. the cast
# from_hp computes a scale from the current amax (max / amax), multiplies, and stores one
# byte per element. Tensorwise: one scale. Rowwise: one scale per row (per output feature).
print("1. from_hp")
w8 = Float8Tensor.from_hp(w)
w8_row = Float8Tensor.from_hp(w, granularity="rowwise")
print("  ", w8)
print("  ", w8_row)
print(
    f"   data {w8._data.dtype} {tuple(w8._data.shape)}, tensorwise scale {tuple(w8._scale.shape)}, "
    f"rowwise scale {tuple(w8_row._scale.shape)}"
)
print(f"   it still looks like the weight: dtype={w8.dtype}, shape={tuple(w8.shape)}")
print(f"   round trip: tensorwise {sqnr(w, w8.to_hp()):.1f} dB, rowwise {sqnr(w, w8_row.to_hp()):.1f} dB\n")
# One byte per element, the scales' shapes, the weight's own dtype and shape outside; the
# round trips at e4m3's accuracy (measured 31.5 dB tensorwise, 31.6 dB rowwise).
assert w8._data.dtype == torch.float8_e4m3fn and w8._data.element_size() == 1
assert w8._scale.shape == () and w8_row._scale.shape == (256, 1)
assert (w8.dtype, w8.shape, w8_row.dtype, w8_row.shape) == (w.dtype, w.shape, w.dtype, w.shape)
assert sqnr(w, w8.to_hp()) >= 29.0 and sqnr(w, w8_row.to_hp()) >= 29.0

# ----------------------------------------------------------------------------- 2. products
# x @ w8.t() and F.linear run through torch._scaled_mm. The plain operand (x) is cast to FP8
# on the fly with its own dynamic scale; 3D activations are folded to 2D and back.
print("2. Matrix products (SQNR against the bf16 and the fp32 references)")
products = {
    "x @ w8.t()  (tensorwise)": x @ w8.t(),
    "x @ w8.t()  (rowwise)": x @ w8_row.t(),
    "F.linear(x, w8, bias)": F.linear(x, w8, torch.zeros(256, dtype=torch.bfloat16)),
    "transposed x (bmm path)": (x.transpose(0, 1) @ w8.t()).transpose(0, 1),
}
for name, y in products.items():
    print(
        f"   {name:<26} {y.dtype!s:<15} {tuple(y.shape)}  "
        f"vs bf16 {sqnr(ref_bf16, y):5.1f} dB, vs fp32 {sqnr(ref_fp32, y):5.1f} dB"
    )
    # Measured 28.5-28.6 dB: FP8 (e4m3) accuracy, in the activation's dtype.
    assert y.dtype == torch.bfloat16 and y.shape == (4, 64, 256) and sqnr(ref_fp32, y) >= 26.0, name
print()

# ----------------------------------------------------------------------------- 3. output dtype
# By default the product has the first operand's dtype. A GemmConfig carried by the weight
# asks for another one; it is written straight from the fp32 accumulator.
print("3. Output dtype")
w8_fp32_out = Float8Tensor.from_hp(w, gemm_config=GemmConfig(out_dtype=torch.float32))
y32 = x @ w8_fp32_out.t()
print(f"   GemmConfig(out_dtype=float32): {y32.dtype}, vs fp32 {sqnr(ref_fp32, y32):.1f} dB")
assert y32.dtype == torch.float32 and sqnr(ref_fp32, y32) >= 26.0  # measured 28.5 dB

# float8_mm takes the output dtype per call, 2D operands. An FP8 output needs its own scale
# (chosen here from the known output range) and comes back as a Float8Tensor; values beyond
# the range saturate to the format's max instead of overflowing.
x2d = x.reshape(-1, 512)
ref2d = ref_fp32.reshape(-1, 256)
y_f32 = float8_mm(x2d, w8.t(), out_dtype=torch.float32)
out_scale = 448.0 / ref2d.abs().max().item()
y_f8 = float8_mm(x2d, w8.t(), out_dtype=torch.float8_e4m3fn, out_scale=out_scale)
print(f"   float8_mm(out_dtype=float32): {y_f32.dtype}, {sqnr(ref2d, y_f32):.1f} dB")
print(
    f"   float8_mm(out_dtype=float8_e4m3fn, out_scale={out_scale:.3g}): {type(y_f8).__name__} "
    f"({y_f8._data.dtype}), {sqnr(ref2d, y_f8.to_hp()):.1f} dB"
)
# The dtypes asked for; the FP8 output at FP8 accuracy (measured 28.5 and 26.7 dB).
assert y_f32.dtype == torch.float32 and isinstance(y_f8, Float8Tensor) and y_f8._data.dtype == torch.float8_e4m3fn
assert sqnr(ref2d, y_f32) >= 26.0 and sqnr(ref2d, y_f8.to_hp()) >= 24.0
y_sat = float8_mm(x2d, w8.t(), out_dtype=torch.float8_e4m3fn, out_scale=100.0)  # far too large
sat_data = y_sat._data.float()
print(
    f"   with out_scale=100, {100 * (sat_data.abs() == 448).float().mean().item():.0f}% of the outputs saturate "
    f"to exactly 448; non-finite values: {int((~torch.isfinite(sat_data)).sum())}\n"
)
assert torch.isfinite(sat_data).all() and (sat_data.abs() == 448).any(), "a too-large out_scale saturates, finitely"

# ----------------------------------------------------------------------------- 4. refusals
# FP8 data only takes part in matrix products and layout ops (t, view, slice, cat, ...).
# Anything else fails loudly instead of silently computing in high precision.
print("4. What the op table refuses")
for name, fn in {"torch.sin(w8)": lambda: torch.sin(w8), "w8 + 1": lambda: w8 + 1}.items():
    try:
        fn()
    except NotImplementedError as e:
        print(f"   {name}: NotImplementedError: {e}")
        assert "call .to_hp() first" in str(e), "the refusal says what to do"
    else:
        raise AssertionError(f"{name} should be refused")
print(f"   the way out, .to_hp(): torch.sin(w8.to_hp()) has shape {tuple(torch.sin(w8.to_hp()).shape)}\n")

# ----------------------------------------------------------------------------- 5. alignment
# torch._scaled_mm needs K and N to be multiples of 16. Other shapes raise, unless the
# weight's GemmConfig asks for zero padding (exact: the padded bytes are zeros).
print("5. The 16-alignment rule")
w_odd = torch.randn(24, 40, dtype=torch.bfloat16)  # N = 24, K = 40
x_odd = torch.randn(8, 40, dtype=torch.bfloat16)
try:
    x_odd @ Float8Tensor.from_hp(w_odd).t()
except ValueError as e:
    print(f"   ValueError: {e}")
    assert "multiples of 16" in str(e), "the refusal names the rule"
else:
    raise AssertionError("an unaligned FP8 product should be refused")
w_pad = Float8Tensor.from_hp(w_odd, gemm_config=GemmConfig(pad_inner_dim=True))
y_pad = x_odd @ w_pad.t()
print(
    f"   with GemmConfig(pad_inner_dim=True): shape {tuple(y_pad.shape)}, "
    f"{sqnr(x_odd.float() @ w_odd.float().t(), y_pad):.1f} dB vs fp32"
)
assert y_pad.shape == (8, 24) and sqnr(x_odd.float() @ w_odd.float().t(), y_pad) >= 24.0  # measured 27.0
# Exact: the zeros change no scale (amax) and add nothing to the sums, so the padded product
# is the product of operands padded by hand to K = N = 48, its first 24 columns.
x_48 = F.pad(x_odd, (0, 8))
y_by_hand = (x_48 @ Float8Tensor.from_hp(F.pad(w_odd, (0, 8, 0, 24))).t())[:, :24]
assert torch.equal(y_pad, y_by_hand), "zero padding changes the product"
