"""Tutorial 12: FP4 training (NVFP4, MXFP4) and what each trick buys.

    python tutorials/12_fp4.py        # CPU, a few seconds

FP4 (E2M1) has 16 codes: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives. Two bits of
exponent, one of mantissa: 8 magnitudes where e4m3 has 127. A tensor can only be stored in
it with a scale per small block, and training with it needs help. This tutorial measures,
live and at small sizes, each piece of the NVFP4 recipe and its options:

  1. the formats: NVFP4 (16-element blocks, e4m3 block scales, one fp32 tensor scale) and
     MXFP4 (32-element blocks, power-of-two e8m0 scales), packed two values per byte;
  2. a cast and its SQNR, next to FP8;
  3. the random Hadamard transform (RHT) on the weight-gradient GEMM: where it helps, where
     it does not;
  4. 2D 16x16 weight scales: the weight's two layouts quantize to the same values;
  5. stochastic rounding of gradients: unbiased on average;
  6. four-over-six: a second candidate scale per block;
  7. layer policies: the last blocks in bf16 (keep_last_blocks_in_hp, block_policy);
  8. a format per GEMM (gemm_overrides) and the late-training switch of the forward to
     high precision (set_forward_in_high_precision);
  9. the conversion report's line that says which path each FP4 GEMM runs on.

Every number is computed when the script runs, and each claim the text makes is checked
with an assert, so the script fails if a change to the library breaks one. The loss effect
of each trick on the demo GPT is in BENCHMARKS.md ("FP4 (CPU)").
"""

import copy
import logging

import torch
import torch.nn.functional as F
from torch import nn

from f8tensor import (
    FP4_CAST_DTYPE,
    CastConfig,
    Float4Tensor,
    Float8Linear,
    Float8LinearConfig,
    Float8Tensor,
    MX_1x32,
    NVFP4_1x16,
    block_policy,
    convert_to_float8_training,
    convert_with_policy,
    keep_last_blocks_in_hp,
    set_forward_in_high_precision,
    sqnr,
)
from f8tensor.kernels.fp4 import E2M1_VALUES
from f8tensor.quant.config import GEMMS
from f8tensor.quant.hadamard import apply_rht

torch.set_num_threads(1)
torch.manual_seed(0)


def section(title: str) -> None:
    print(f"\n{'-' * 8} {title} {'-' * max(0, 80 - len(title))}")


# ----------------------------------------------------------------------------- 1. the formats

section("1. the formats")
grid = torch.tensor(E2M1_VALUES)
print(f"E2M1 magnitudes: {E2M1_VALUES}; steps between them: {(grid[1:] - grid[:-1]).tolist()}")
# The 16 values cast as one NVFP4 block (its largest magnitude is 6: a scale of 1 in effect).
codes = Float4Tensor.from_hp(torch.cat([grid, -grid]).reshape(1, 16), "nvfp4").codes()
print(f"their codes (bit 3 is the sign): {codes.flatten().tolist()}")
print(
    "From one value to the next the step is a third to a half of the value (e4m3: 1/16 to 1/8):"
    "\none significant bit. All the rest is in choosing the scales: where a block's largest"
    "\nvalue lands on the grid, and how small its neighbours may be before they become 0."
)

x = torch.randn(64, 128)
nv = Float4Tensor.from_hp(x, "nvfp4")
mx = Float4Tensor.from_hp(x, "mxfp4")
for name, t in (("NVFP4", nv), ("MXFP4", mx)):
    data_bytes = t._data.numel()  # one byte holds two values
    scale_bytes = t._scale.numel() * t._scale.element_size()
    total = data_bytes + scale_bytes + (4 if name == "NVFP4" else 0)  # + NVFP4's fp32 tensor scale
    print(
        f"{name}: x {tuple(x.shape)} -> data {tuple(t._data.shape)} {t._data.dtype} (two values a byte), "
        f"block scales {tuple(t._scale.shape)} {t._scale.dtype}, tensor scale {float(t._global_scale):.3e}; "
        f"{total / x.numel():.4f} bytes per value"
    )

# Decoding by hand: value = e2m1(code) * block_scale * tensor_scale. NVFP4's block scales
# are e4m3 (3 mantissa bits, so a block's scale can sit anywhere, not only on powers of
# two); the fp32 tensor scale brings the blocks' scales into e4m3's range (448 max).
signs = torch.where(nv.codes() >= 8, -1.0, 1.0)
mags = grid[(nv.codes() % 8).long()]
by_hand = signs * mags * (nv._scale.float() * nv._global_scale).repeat_interleave(16, dim=1)
assert torch.equal(by_hand, nv.dequantize(torch.float32))
# MXFP4's scales are powers of two (e8m0: an exponent byte, no mantissa).
mx_scales = mx._scale.float()
assert torch.equal(mx_scales, torch.exp2(torch.log2(mx_scales).round()))
print("decoding by hand (code value x block scale x tensor scale) matches dequantize(): checked")

# The two training recipes, as configs: which block each operand is cast in, how it rounds.
for recipe in ("nvfp4", "mxfp4"):
    cfg = Float8LinearConfig.from_recipe(recipe)
    roles = ", ".join(
        f"{role} {'x'.join(map(str, getattr(cfg, role).granularity.block))} {getattr(cfg, role).rounding}"
        for role in ("input", "weight", "grad_output")
    )
    print(f"recipe {recipe}: {roles}; Hadamard transform on the weight gradient: {cfg.hadamard_wgrad}")

# ----------------------------------------------------------------------------- 2. cast and SQNR

section("2. a cast and its SQNR (x ~ N(0, 1), 256 x 256)")
x = torch.randn(256, 256)
casts = {
    "FP8 e4m3, one scale": Float8Tensor.from_hp(x).to_hp(),
    "MXFP8 e4m3, 1x32 e8m0": Float8Tensor.from_hp(x, granularity=MX_1x32).to_hp(),
    "NVFP4 1x16 e4m3 + fp32": Float4Tensor.from_hp(x, "nvfp4").to_hp(),
    "MXFP4 1x32 e8m0": Float4Tensor.from_hp(x, "mxfp4").to_hp(),
}
db = {name: sqnr(x, back) for name, back in casts.items()}
for name, value in db.items():
    print(f"  {name:<24} {value:6.2f} dB")
# Each bit of mantissa is about 6 dB: FP4 sits about 10 dB under FP8. NVFP4 beats MXFP4 by
# its smaller blocks and its finer (e4m3, not power-of-two) scales.
assert db["FP8 e4m3, one scale"] - db["NVFP4 1x16 e4m3 + fp32"] > 8.0
assert db["NVFP4 1x16 e4m3 + fp32"] > db["MXFP4 1x32 e8m0"]
print(
    "FP4 costs about 10 dB against FP8; NVFP4 is ahead of MXFP4: its blocks are half as long"
    "\nand its scale can take any e4m3 value, where MXFP4 rounds each block's scale up to a power"
    "\nof two (the block's top value lands anywhere between 3 and 6)."
)

# ----------------------------------------------------------------------------- 3. the Hadamard transform

section("3. the random Hadamard transform on the weight-gradient GEMM")
# grad_W = g.t() @ x contracts over the tokens, so both operands are cast in 16-token blocks.
# The transform multiplies each 16-token block of both by the same orthogonal 16 x 16 matrix
# (Hadamard times random signs): the product is unchanged in exact arithmetic, but a block
# that held one large token now holds 16 values of similar size.
TOKENS, COLS = 1024, 64


def wgrad_sqnr(g: torch.Tensor, x: torch.Tensor, rht: bool, draw: int) -> float:
    """NVFP4 wgrad product vs fp64, cast as the nvfp4 recipe does: x to nearest, g stochastically."""
    exact = g.double().t() @ x.double()
    if rht:
        g, x = apply_rht(g, seed=0), apply_rht(x, seed=0)
    gen = torch.Generator().manual_seed(draw)  # the same draws with and without the transform
    gq = Float4Tensor.from_hp(g, "nvfp4", block=(16, 1), pack_dim=0, rounding="stochastic", generator=gen)
    xq = Float4Tensor.from_hp(x, "nvfp4", block=(16, 1), pack_dim=0)
    return sqnr(exact, gq.to_hp().double().t() @ xq.to_hp().double())


def operands(kind: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    g, x = torch.randn(TOKENS, COLS, generator=gen), torch.randn(TOKENS, COLS, generator=gen)
    if kind == "shared":  # 1 token in 16 is 10x larger, the same tokens in g and x
        idx = torch.randperm(TOKENS, generator=gen)[: TOKENS // 16]
        g[idx] *= 10
        x[idx] *= 10
    elif kind == "crossed":  # in every 16-block, token 3 of x and token 7 of g are 20x larger
        x[torch.arange(3, TOKENS, 16)] *= 20
        g[torch.arange(7, TOKENS, 16)] *= 20
    return g, x


g, x = operands("gaussian", 0)
exact = g.double().t() @ x.double()
assert sqnr(exact, apply_rht(g.double(), 0).t() @ apply_rht(x.double(), 0)) > 250  # fp64 round-off only
print("exact arithmetic (fp64): the transform leaves g.t() @ x unchanged (SQNR > 250 dB)")
gains = {}
for kind, label in (
    ("shared", "10x tokens (1 in 16), same tokens in g and x"),
    ("gaussian", "Gaussian g and x"),
    ("crossed", "20x token per block in x, another in g"),
):
    per = [
        wgrad_sqnr(*operands(kind, s), True, d) - wgrad_sqnr(*operands(kind, s), False, d)
        for s in range(3)
        for d in range(3)
    ]
    gains[kind] = sum(per) / len(per)
    print(f"  {label:<46} RHT gain {gains[kind]:+5.2f} dB (mean of 3 inputs x 3 draws)")
assert gains["shared"] > 2.5
assert abs(gains["gaussian"]) < 1.0
assert gains["crossed"] < -0.5
print(
    "Where it helps: a few tokens large in both operands (the same tokens), the case the"
    "\ntransform is for. Where it does not: on Gaussian data it"
    "\nchanges nothing (it is already spread out), and where one operand has a dominant value"
    "\nin a block it hurts: without the transform that value sets its block's scale and is"
    "\nstored almost exactly; with it, the block becomes 16 values near a quarter of it, all in"
    "\nE2M1's coarsest step (4 to 6), and the small values ride on top as rounding noise."
    "\nOn the demo GPT's own layers it measured neutral (BENCHMARKS.md, benchmarks/bench_rht.py)."
)

# ----------------------------------------------------------------------------- 4. 2D weight scales

section("4. 2D 16x16 weight scales")
# The forward GEMM contracts the weight over in_features, the input-gradient GEMM over
# out_features: each casts it along its own contraction dim. With 1x16 blocks those are two
# different quantizations, so backward differentiates a weight that forward did not use.
w = torch.randn(96, 128) * torch.rand(96, 1) * 3  # rows of different sizes
for name, block in (("1x16", (1, 16)), ("16x16", (16, 16))):
    fwd = Float4Tensor.from_hp(w, "nvfp4", block=block, pack_dim=1).to_hp()  # along in_features
    bwd = Float4Tensor.from_hp(w.t(), "nvfp4", block=block, pack_dim=1).to_hp().t()  # along out_features
    differ = int((fwd != bwd).sum())
    print(
        f"  {name:<6} forward-layout vs backward-layout weight: {differ:5d} of {w.numel()} values differ; "
        f"SQNR vs w {sqnr(w, fwd):5.2f} dB"
    )
    if block == (16, 16):
        assert torch.equal(fwd, bwd)
        sqnr_2d = sqnr(w, fwd)
    else:
        assert differ > w.numel() // 4
        sqnr_1d = sqnr(w, fwd)
assert sqnr_2d < sqnr_1d  # the price: one scale covers 256 values
print(
    "With 16x16 blocks a scale belongs to a square, the same square in both layouts: the"
    "\ntwo GEMMs see one weight (and it can be cast once). The price is a scale shared by 256"
    "\nvalues instead of 16, a little lower SQNR."
)

# ----------------------------------------------------------------------------- 5. stochastic rounding

section("5. stochastic rounding: unbiased on average")
# A gradient block with one large value and many small ones: the block scale is set by the
# large one, and the small ones fall below half of E2M1's smallest step.
DRAWS = 2000
block = torch.tensor([[6.0] + [0.2] * 7 + [0.9] * 8])
nearest = Float4Tensor.from_hp(block, "nvfp4").to_hp()
gen = torch.Generator().manual_seed(0)
draws = torch.stack(
    [Float4Tensor.from_hp(block, "nvfp4", rounding="stochastic", generator=gen).to_hp() for _ in range(DRAWS)]
)
mean = draws.mean(0)
print(f"  value       nearest   stochastic: one draw, mean of {DRAWS}")
for i in (1, 8):
    print(
        f"  {float(block[0, i]):5.2f}   {float(nearest[0, i]):8.3f}   {float(draws[0, 0, i]):10.3f}   {float(mean[0, i]):8.3f}"
    )
bias_nearest = float((nearest - block)[0, 1:].abs().mean())
bias_sr = float((mean - block)[0, 1:].abs().mean())
print(f"  mean |error of the mean| over the small values: nearest {bias_nearest:.3f}, stochastic {bias_sr:.3f}")
assert float(nearest[0, 1]) == 0.0  # 0.2 always rounds to 0: a gradient that never arrives
assert bias_sr < bias_nearest / 10

# On a whole gradient: one draw is noisier than round-to-nearest, the average is better.
gy = torch.randn(256, 256) * torch.rand(256, 1)
near_db = sqnr(gy, Float4Tensor.from_hp(gy, "nvfp4").to_hp())
gen = torch.Generator().manual_seed(1)
sr = [Float4Tensor.from_hp(gy, "nvfp4", rounding="stochastic", generator=gen).to_hp() for _ in range(16)]
one_db, avg_db = sqnr(gy, sr[0]), sqnr(gy, torch.stack(sr).mean(0))
print(
    f"  a 256 x 256 gradient: nearest {near_db:.2f} dB, one stochastic draw {one_db:.2f} dB, mean of 16 draws {avg_db:.2f} dB"
)
assert one_db < near_db < avg_db
print(
    "Rounding to nearest is biased: a value under 1/24 of its block's largest (half of E2M1's"
    "\nsmallest step, once the largest is scaled to 6) is always 0; stochastic rounding picks the grid point above with a probability"
    "\nequal to the distance, so its expectation is the exact value. Each draw costs SQNR, but"
    "\nthe optimizer sums gradients over many steps and the errors average out, where a bias"
    "\nwould add up. The nvfp4 recipe rounds gradients (grad_output) stochastically, not the"
    "\nforward's inputs and weights."
)

# ----------------------------------------------------------------------------- 6. four over six

section("6. four-over-six")
x = torch.randn(256, 256)
plain = Float4Tensor.from_hp(x, "nvfp4")
fos = Float4Tensor.from_hp(x, "nvfp4", four_over_six=True)
plain_db, fos_db = sqnr(x, plain.to_hp()), sqnr(x, fos.to_hp())
chose4 = float((fos._scale.float() > plain._scale.float() * 1.25).float().mean())
print(
    f"  N(0, 1): plain {plain_db:.2f} dB, four-over-six {fos_db:.2f} dB ({fos_db - plain_db:+.2f} dB); "
    f"{chose4:.0%} of blocks took the scale to 4"
)
assert fos_db - plain_db > 0.5
print(
    "E2M1 has nothing between 4 and 6: with the block's max scaled to 6, a value at 5/6 of the"
    "\nmax is off by 1/6 of it. Scaled to 4 instead, the top of the block has steps of 1/4 of the"
    "\nmax (3, 4), finer than 1/3, while small values get a coarser grid. Each block is encoded"
    "\nboth ways and keeps the encoding with less squared error (the price: a second cast)."
)

# ----------------------------------------------------------------------------- 7. layer policies


class Blocks(nn.Module):
    """An embedding-like first layer, a stack of blocks, a head: the layout policies look for."""

    def __init__(self, n: int = 6, d: int = 64) -> None:
        super().__init__()
        self.embed = nn.Linear(32, d)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.GELU()) for _ in range(n))
        self.head = nn.Linear(d, 32)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        t = self.embed(t)
        for layer in self.layers:
            t = t + layer(t)
        return self.head(t)


def formats(model: nn.Module) -> str:
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, Float8Linear):
            out.append(f"{name}={mod.config.weight.fp4_kind or 'fp8'}")
        elif isinstance(mod, nn.Linear):
            out.append(f"{name}=hp")
    return ", ".join(out)


section("7. layer policies: keep the last blocks in high precision")
nvfp4 = Float8LinearConfig.from_recipe("nvfp4")
model = Blocks()
convert_to_float8_training(model, config=nvfp4, module_filter_fn=keep_last_blocks_in_hp(model, 1))
print("  keep_last_blocks_in_hp(model, 1):", formats(model))
assert not isinstance(model.layers[5][0], Float8Linear) and isinstance(model.layers[4][0], Float8Linear)
model = Blocks()
convert_with_policy(
    model, block_policy(model, nvfp4, hp_last_blocks=1, edge_config=Float8LinearConfig.from_recipe("mxfp8"))
)
print("  block_policy(hp_last_blocks=1, edge_config=mxfp8):", formats(model))
assert model.embed.config.weight.fp4_kind is None and model.layers[0][0].config.weight.fp4_kind == "nvfp4"
print(
    "The NVFP4 training paper keeps the last ~15% of a model's blocks in bf16: the layers"
    "\nnearest the loss are the most sensitive, and their share of the compute is small."
    "\nblock_policy also gives the first and last layers their own (FP8) config."
)

# ----------------------------------------------------------------------------- 8. per-GEMM formats

section("8. a format per GEMM, and switching the forward to high precision")
NV = CastConfig(FP4_CAST_DTYPE, NVFP4_1x16)
MX8 = CastConfig(torch.float8_e4m3fn, MX_1x32)
mixed = Float8LinearConfig(
    input=MX8,
    weight=MX8,
    grad_output=NV,
    gemm_overrides={("grad_input", "weight"): NV, ("grad_weight", "grad_output"): None, ("grad_weight", "input"): None},
)


def describe(cast: CastConfig | None) -> str:
    return {None: "high precision", NV: "NVFP4 1x16", MX8: "MXFP8 (e4m3, 1x32)"}[cast]


for gemm, (a, b) in GEMMS.items():
    first = f"{a} as {describe(mixed.cast_for(gemm, a))}"
    print(f"  {gemm:<12} {first:<36} {b} as {describe(mixed.cast_for(gemm, b))}")

ref = nn.Linear(128, 96)
xin = torch.randn(64, 128)


def grads(layer: nn.Module) -> tuple[torch.Tensor, ...]:
    xr = xin.clone().requires_grad_()
    layer.zero_grad()
    y = layer(xr)
    y.square().sum().backward()
    return y.detach(), xr.grad, layer.weight.grad.clone()


want = grads(ref)
print(f"  SQNR vs fp32 {'':<22} {'y':>6} {'grad_x':>7} {'grad_W':>7}")
results = {}
for name, cfg in (("nvfp4", nvfp4), ("MXFP8 fwd / NVFP4 dgrad / hp wgrad", mixed)):
    layer = Float8Linear.from_float(copy.deepcopy(ref), cfg)
    results[name] = [sqnr(a, b) for a, b in zip(want, grads(layer))]
    print(f"  {name:<35} " + " ".join(f"{v:6.1f}" for v in results[name]))
assert results["MXFP8 fwd / NVFP4 dgrad / hp wgrad"][0] > results["nvfp4"][0] + 5
print(
    "Each GEMM of a linear has its own sensitivity: the forward decides the loss, the"
    "\nweight gradient goes to the optimizer, the input gradient flows to every layer below."
    "\ngemm_overrides names the format of any operand of any GEMM (None: high precision)."
)

# The late-training switch: the NVFP4 paper finishes training with a bf16 forward. Here the
# layers keep their parameters and the optimizer its state; only their configs change.
torch.manual_seed(0)
teacher, student = Blocks(n=3), Blocks(n=3)
convert_to_float8_training(student, config=nvfp4)
params = list(student.parameters())
opt = torch.optim.AdamW(student.parameters(), lr=3e-3)
data = [torch.randn(64, 32) for _ in range(4)]
losses = []
for step in range(40):
    xb = data[step % 4]
    loss = F.mse_loss(student(xb), teacher(xb).detach())
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    if step == 29:
        changed = set_forward_in_high_precision(student)
        print(f"  step 30: set_forward_in_high_precision switched {changed} layers")
assert all(a is b for a, b in zip(params, student.parameters()))
assert opt.state[params[0]]["step"] == 40  # the optimizer kept its state across the switch
probe = torch.randn(8, 32)
assert torch.equal(student.embed(probe), F.linear(probe, student.embed.weight, student.embed.bias))
assert student.embed.config.cast_for("grad_input", "grad_output").fp4_kind == "nvfp4"
print(
    f"  loss: step 1 {losses[0]:.4f}, step 30 {losses[29]:.4f}, step 40 {losses[-1]:.4f}; same Parameters and"
    "\n  optimizer state; the forward is now exactly F.linear, the backward GEMMs still NVFP4"
)

# ----------------------------------------------------------------------------- 9. the conversion report

section("9. the conversion report names the path of each FP4 GEMM")


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


log = logging.getLogger("f8tensor")
capture, level = Capture(), log.level
log.addHandler(capture)
log.setLevel(logging.INFO)
model = Blocks(n=2)
convert_to_float8_training(model, config=nvfp4)
log.removeHandler(capture)
log.setLevel(level)
print(" ", capture.lines[-1].replace("; ", ";\n    "))
assert "FP4 forward/grad_input/grad_weight reference (emulated" in capture.lines[-1]
print(
    "On this CPU every FP4 product takes the reference path (dequantize per block, fp32"
    "\nmatmul). On CUDA with emulate=True the same; on sm100, torch.nn.functional.scaled_mm"
    "\n(marked unverified: no sm100 machine has run it); on other GPUs with emulate off the"
    "\nline says 'none' and warns, before a first product would raise."
)
