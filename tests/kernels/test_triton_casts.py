"""The fused Triton casts (``f8tensor/kernels/triton_cast.py``) against the reference casts,
bit for bit: FP8 bytes (``.view(torch.uint8)``), scales (fp32 as int32 bits, e8m0 bytes),
output strides, and the column-major copy.

On CPU the kernels run under the Triton interpreter: ``triton_cast`` loads its kernel file
a second time with ``TRITON_INTERPRET=1`` for CPU tensors, in this process (``triton.jit``
reads the variable when it decorates). Shapes are small (the interpreter runs each program
in numpy). The tests marked ``gpu`` run the compiled kernels on CUDA through
``kernels.cast``, the same comparisons, and count the CUDA kernels one cast launches.
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import interpreter_problem, skip_without_interpreter

pytest.importorskip("triton", reason="the fused casts need triton (it ships with CUDA builds of torch)")

from f8tensor import kernels
from f8tensor.kernels import reference, triton_cast
from f8tensor.quant.config import CastSpec
from f8tensor.quant.formats import E8M0, FLOAT8_DTYPES, FORMATS
from f8tensor.quant.scaling import inverse_scale_of

E4M3 = torch.float8_e4m3fn
HP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

#: Tests that never run a kernel under the interpreter (routing, the GPU compiler).
_NO_INTERPRETER = {
    "test_plan_covers_and_refuses",
    "test_cpu_casts_stay_on_the_reference",
    "test_kernels_compile_for_cuda",
}


@functools.cache
def _interpreter_problem() -> str | None:
    """None when this triton's interpreter runs the kernels on CPU tensors; else why not
    (``helpers.interpreter_problem``)."""
    return interpreter_problem(lambda: triton_cast.maybe_cast(torch.ones(40, 300), CastSpec(E4M3)))


@pytest.fixture(autouse=True)
def _needs_interpreter(request):
    skip_without_interpreter(request, _interpreter_problem, _NO_INTERPRETER)


#: name -> (block, scale dtype, e8m0 mode) of every granularity the kernels cover (2D).
GRANULARITIES = {
    "tensorwise": ((), torch.float32, "rceil"),
    "rowwise": ((1, 0), torch.float32, "rceil"),
    "colwise": ((0, 1), torch.float32, "rceil"),
    "1x128": ((1, 128), torch.float32, "rceil"),
    "128x1": ((128, 1), torch.float32, "rceil"),
    "1x32": ((1, 32), torch.float32, "rceil"),
    "mx_rceil": ((1, 32), E8M0, "rceil"),
    "mx_floor": ((1, 32), E8M0, "floor"),
    "128x128": ((128, 128), torch.float32, "rceil"),
    "32x32_e8m0": ((32, 32), E8M0, "rceil"),
}
FP32_SCALED = [name for name, (_, sd, _) in GRANULARITIES.items() if sd == torch.float32]


def spec_of(name: str, float8_dtype: torch.dtype = E4M3, *, power_of_2: bool = False) -> CastSpec:
    block, scale_dtype, mode = GRANULARITIES[name]
    return CastSpec(float8_dtype, block, scale_dtype, mode, power_of_2)


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in (torch.float32,):
        return t.view(torch.int32)
    return t.view(torch.uint8)


def assert_same(got, want, *, what: str = "") -> None:
    """Bitwise equal FP8 data (bytes, shape, strides) and scales."""
    (data, scale), (ref_data, ref_scale) = got, want
    assert data.dtype == ref_data.dtype and data.shape == ref_data.shape, what
    assert data.stride() == ref_data.stride(), f"{what}: strides {data.stride()} != {ref_data.stride()}"
    bad = (_bits(data) != _bits(ref_data)).nonzero()
    assert bad.numel() == 0, (
        f"{what}: {bad.shape[0]} bytes differ, first at {bad[0].tolist()}: "
        f"{_bits(data)[tuple(bad[0])]} != {_bits(ref_data)[tuple(bad[0])]}"
    )
    assert scale.dtype == ref_scale.dtype and scale.shape == ref_scale.shape, what
    assert torch.equal(_bits(scale), _bits(ref_scale)), f"{what}: scales differ"


def fused(hp, spec, scale=None, *, layouts=triton_cast.NATURAL):
    out = triton_cast.maybe_cast(hp, spec, scale, layouts=layouts)
    assert out is not None, f"no fused kernel for {spec} on {tuple(hp.shape)}"
    data, second, s, inverse = out
    check_inverse(inverse, s, what=str(spec))
    return data, second, s


def check_inverse(inverse, scale, *, what=""):
    """The kernel's inverse scale is ``inverse_scale_of(scale)`` (torch's fp32 reciprocal;
    e8m0: exact), bit for bit; a NaN's payload aside (what a NaN factor multiplies is NaN
    whatever its bits)."""
    want = inverse_scale_of(scale)
    assert inverse.dtype == want.dtype and inverse.shape == want.shape, what
    nan = torch.isnan(want.float())
    assert torch.equal(nan, torch.isnan(inverse.float())), f"{what}: NaN inverses differ"
    assert torch.equal(_bits(inverse)[~nan], _bits(want)[~nan]), f"{what}: inverse scales differ"


def check(hp, spec, scale=None, *, what=""):
    data, _, s = fused(hp, spec, scale)
    assert_same((data, s), reference.cast(hp, spec, scale), what=what or str(spec))


def sample(shape, dtype=torch.float32, *, seed=0) -> torch.Tensor:
    """Normal values whose rows and columns span many binades (per-block scales differ)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 12, shape, generator=g).float())
    return x.to(dtype)


# ------------------------------------------------------------ every format x granularity


@pytest.mark.parametrize("hp_dtype", HP_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", list(GRANULARITIES))
@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=lambda d: str(d)[6:])
def test_bit_exact(float8_dtype, name, hp_dtype):
    # 130 x 200: partial edge blocks along both dims for 128-blocks, 32-blocks and tiles.
    hp = sample((130, 200), hp_dtype)
    check(hp, spec_of(name, float8_dtype))


@pytest.mark.parametrize("name", FP32_SCALED)
@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=lambda d: str(d)[6:])
def test_power_of_2_scales(float8_dtype, name):
    check(sample((70, 150), seed=1), spec_of(name, float8_dtype, power_of_2=True))


@pytest.mark.parametrize("name", list(GRANULARITIES))
def test_given_scales(name):
    """Delayed scaling and re-casts: a given scale is used as is (and returned as is)."""
    spec = spec_of(name, torch.float8_e5m2)
    hp = sample((70, 150), torch.bfloat16, seed=2)
    _, scale = reference.cast(hp * 0.25, spec)  # some other tensor's scale: saturation happens
    data, _, s = fused(hp, spec, scale)
    assert s is scale
    assert_same((data, s), reference.cast(hp, spec, scale), what=name)


@pytest.mark.parametrize("name", ["1x128", "128x128", "mx_rceil"])
def test_given_scales_of_another_layout(name):
    """A given block scale laid out column-major: read through its strides, and its inverse
    written with the same layout."""
    spec = spec_of(name)
    hp = sample((260, 300), torch.bfloat16, seed=18)
    scale = reference.cast(hp * 0.5, spec)[1]
    strided = scale.t().contiguous().t()
    assert strided.stride() != scale.stride() and torch.equal(_bits(strided), _bits(scale))
    data, _, s = fused(hp, spec, strided)
    assert_same((data, s), reference.cast(hp, spec, scale), what=name)


@pytest.mark.parametrize("name", list(GRANULARITIES))
def test_transposed_and_sliced_inputs(name):
    """Arbitrary input strides; the data keeps the layout the reference gives it."""
    base = sample((160, 140), seed=3)
    check(base.t(), spec_of(name), what=f"{name} transposed")  # column-major input
    check(base[5:150, 3:133], spec_of(name), what=f"{name} sliced")  # not dense
    check(base.t()[2:130, 7:], spec_of(name), what=f"{name} transposed slice")


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (33, 1), (1, 257), (129, 33)])
@pytest.mark.parametrize("name", list(GRANULARITIES))
def test_odd_shapes(name, shape):
    check(sample(shape, seed=4), spec_of(name), what=f"{name} {shape}")


@pytest.mark.parametrize(
    "shape, block",
    [
        ((300,), ()),
        ((300,), (0,)),
        ((300,), (128,)),
        ((2, 3, 64), ()),
        ((2, 3, 64), (1, 1, 0)),
        ((2, 3, 70), (1, 1, 32)),
    ],
)
def test_other_ranks(shape, block):
    check(sample(shape, seed=5), CastSpec(E4M3, block))
    if len(block) and block[-1] == 32:
        check(sample(shape, seed=5), CastSpec(E4M3, block, E8M0))


@pytest.mark.parametrize("shape", [(0, 64), (64, 0), (0, 0)])
@pytest.mark.parametrize("name", list(GRANULARITIES))
def test_empty(name, shape):
    check(torch.empty(shape), spec_of(name), what=f"{name} {shape}")


@pytest.mark.parametrize("name", list(GRANULARITIES))
@pytest.mark.parametrize(
    "case", ["zeros", "tiny", "fp32_subnormal", "fp16_tiny", "huge", "nan", "inf", "-inf", "nan_given_scale"]
)
def test_special_values(name, case):
    hp_dtype = torch.float16 if case == "fp16_tiny" else torch.float32
    hp = sample((64, 96), seed=6)
    if case == "zeros":
        hp = torch.zeros(64, 96)
    elif case == "tiny":
        hp = hp * 1e-34  # amax below EPS: the clamped scale
    elif case == "fp32_subnormal":
        hp = hp * 1e-42
    elif case == "fp16_tiny":
        hp = hp * 2e-9  # fp16 subnormals
    elif case == "huge":
        hp = hp * 1e30
    elif case in ("nan", "inf", "-inf", "nan_given_scale"):
        value = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}.get(case, float("nan"))
        hp[3, 40] = value
        hp[50, 5] = -value
        hp[:, 70] = value  # a whole column: every row block and tile sees one
    hp = hp.to(hp_dtype)
    spec = spec_of(name, torch.float8_e5m2 if case == "huge" else E4M3)
    scale = reference.cast(sample((64, 96), seed=7), spec)[1] if case == "nan_given_scale" else None
    check(hp, spec, scale, what=f"{name} {case}")


# ----------------------------------------------------------- the FP8 rounding, exhaustively


def _boundary_values(float8_dtype: torch.dtype) -> torch.Tensor:
    """Every finite FP8 value, every midpoint between neighbours (the rounding ties), the
    values past max, and the 4 fp32 numbers on each side of each: the rounding's every
    decision point, subnormals included; both signs, infinities and NaNs."""
    codes = torch.arange(256, dtype=torch.uint8).view(float8_dtype).float()
    pos = codes[torch.isfinite(codes) & (codes >= 0)].unique()
    fmax = FORMATS[float8_dtype].max
    above = torch.tensor([fmax * 1.03125, fmax * 1.0625, fmax * 1.5, fmax * 2, fmax * 1e3, 3.4e38])
    centers = torch.cat([pos, (pos[1:] + pos[:-1]) / 2, above])
    values, up, down = [centers], centers, centers
    for _ in range(4):
        up = torch.nextafter(up, torch.tensor(float("inf")))
        down = torch.nextafter(down, torch.tensor(float("-inf")))
        values += [up, down]
    v = torch.cat(values)
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), -float("nan"), 0.0, -0.0, 1e-45, -1e-45])
    return torch.cat([v, -v, special])


def _random_bit_patterns(n: int, seed: int) -> torch.Tensor:
    """fp32 values with random mantissas and exponents around the FP8 ranges (2**-30..2**20)."""
    g = torch.Generator().manual_seed(seed)
    sign = torch.randint(0, 2, (n,), generator=g, dtype=torch.int32) << 31
    exponent = torch.randint(127 - 30, 127 + 20, (n,), generator=g, dtype=torch.int32) << 23
    mantissa = torch.randint(0, 1 << 23, (n,), generator=g, dtype=torch.int32)
    return (sign | exponent | mantissa).view(torch.float32)


@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=lambda d: str(d)[6:])
def test_rounding_at_every_code_boundary(float8_dtype):
    """With a given unit scale the cast is ``saturate(x)`` itself: the bits of the integer
    rounding against torch's conversion at every boundary of the format."""
    values = torch.cat([_boundary_values(float8_dtype), _random_bit_patterns(1 << 15, seed=8)])
    hp = torch.nn.functional.pad(values, (0, -values.numel() % 128)).reshape(-1, 128)
    spec = CastSpec(float8_dtype)
    check(hp, spec, torch.tensor(1.0), what=f"{float8_dtype} boundaries")


@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=lambda d: str(d)[6:])
def test_boundaries_through_block_scales(float8_dtype):
    """The same values through per-row fp32 and e8m0 block scales (dynamic): every row's
    products land at other points of the format's grid."""
    hp = _boundary_values(float8_dtype)
    hp = hp[torch.isfinite(hp)][: 64 * (hp.numel() // 64)].reshape(-1, 64) * 0.7
    check(hp, CastSpec(float8_dtype, (1, 0)), what="rowwise")
    check(hp, CastSpec(float8_dtype, (1, 32), E8M0), what="mx")


def test_bf16_nan_payloads_and_signs():
    """NaN bit patterns of the input reach the FP8 NaN the reference gives (given scale)."""
    raw = torch.tensor([0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0x7F80, 0xFF80, 0x0001, 0x8001], dtype=torch.int32)
    hp = raw.to(torch.int16).view(torch.bfloat16).reshape(1, -1)
    for float8_dtype in FLOAT8_DTYPES:
        check(hp, CastSpec(float8_dtype), torch.tensor(3.0), what=str(float8_dtype))


# ------------------------------------------------------------------ the column-major copy


@pytest.mark.parametrize("given", [False, True])
@pytest.mark.parametrize("name", ["tensorwise", "128x128"])
@pytest.mark.parametrize("shape", [(130, 200), (48, 16), (1, 7)])
def test_column_major_copy(name, given, shape):
    spec = spec_of(name)
    hp = sample(shape, torch.bfloat16, seed=9)
    scale = reference.cast(hp * 3, spec)[1] if given else None
    data, cm, s = fused(hp, spec, scale, layouts=triton_cast.BOTH)
    ref = kernels.cast_for_gemm(hp, spec, scale, layouts="both")  # CPU: the reference
    assert_same((data, s), (ref.data, ref.scale), what=name)
    assert cm.stride() == ref.column_major.stride() == (1, shape[0])
    assert torch.equal(_bits(cm), _bits(ref.column_major)) and torch.equal(_bits(cm), _bits(data))


@pytest.mark.parametrize("given", [False, True])
@pytest.mark.parametrize("name", list(GRANULARITIES))
def test_column_major_data(name, given):
    """``layouts=COLUMN_MAJOR``: the cast writes its bytes column-major, every granularity
    (the weight-gradient GEMM's operands, which nothing else reads)."""
    spec = spec_of(name)
    hp = sample((130, 200), torch.bfloat16, seed=17)
    scale = reference.cast(hp * 3, spec)[1] if given else None
    data, second, s = fused(hp, spec, scale, layouts=triton_cast.COLUMN_MAJOR)
    ref = kernels.cast_for_gemm(hp, spec, scale, layouts="column_major")
    assert second is None and data.stride() == ref.data.stride() == (1, 130)
    assert_same((data, s), (ref.data, ref.scale), what=name)
    assert torch.equal(_bits(data), _bits(reference.cast(hp, spec, scale)[0]))


def test_cast_for_gemm_reference():
    """The reference: the cast's bytes (in a (1, rows)-strided buffer where asked), and a
    per-tensor scale's inverse."""
    hp = sample((40, 24), seed=10)
    ref_data, ref_scale = reference.cast(hp, CastSpec(E4M3))
    natural = kernels.cast_for_gemm(hp, CastSpec(E4M3))
    both = kernels.cast_for_gemm(hp, CastSpec(E4M3), layouts="both")
    cm = kernels.cast_for_gemm(hp, CastSpec(E4M3), layouts="column_major")
    assert natural.column_major is None and cm.column_major is None
    assert both.column_major.stride() == cm.data.stride() == (1, 40) and natural.data.stride() == (24, 1)
    for data in (natural.data, both.data, both.column_major, cm.data):
        assert torch.equal(_bits(data), _bits(ref_data))
    for out in (natural, both, cm):
        assert torch.equal(_bits(out.scale), _bits(ref_scale))
        assert torch.equal(_bits(out.inverse), _bits(ref_scale.reciprocal()))
    assert kernels.cast_for_gemm(hp, CastSpec(E4M3, (1, 0))).inverse is None  # row scales: per GEMM
    with pytest.raises(ValueError, match="takes a 2D tensor; got shape"):
        kernels.cast_for_gemm(hp.reshape(2, 20, 24), CastSpec(E4M3), layouts="both")
    with pytest.raises(ValueError, match="layouts must be one of"):
        kernels.cast_for_gemm(hp, CastSpec(E4M3), layouts="transposed")


# ------------------------------------------------------------------------------ routing


def test_plan_covers_and_refuses():
    hp = torch.zeros(256, 256)
    assert triton_cast.plan(hp, CastSpec(E4M3)) == triton_cast.Plan("tensor")
    assert triton_cast.plan(hp, CastSpec(E4M3, (1, 0))) == triton_cast.Plan("rows")
    assert triton_cast.plan(hp, CastSpec(E4M3, (0, 1))) == triton_cast.Plan("cols")
    assert triton_cast.plan(hp, CastSpec(E4M3, (1, 128))) == triton_cast.Plan("groups", False, (1, 128))
    assert triton_cast.plan(hp, CastSpec(E4M3, (128, 1))) == triton_cast.Plan("groups", True, (1, 128))
    assert triton_cast.plan(hp, CastSpec(E4M3, (1, 32), E8M0)) == triton_cast.Plan("groups", False, (1, 32))
    assert triton_cast.plan(hp, CastSpec(E4M3, (128, 128))) == triton_cast.Plan("tiles", False, (128, 128))
    # The reference's: stochastic rounding, e8m0 axiswise, 0-dim, per-element, non-contiguous 3D.
    assert triton_cast.plan(hp, CastSpec(E4M3, rounding="stochastic")) is None
    assert triton_cast.plan(hp, CastSpec(E4M3, (1, 0), E8M0)) is None
    assert triton_cast.plan(torch.zeros(()), CastSpec(E4M3)) is None
    assert triton_cast.plan(hp, CastSpec(E4M3, (1, 1))) is None
    assert triton_cast.plan(torch.zeros(4, 6, 8).transpose(0, 1), CastSpec(E4M3)) is None
    assert triton_cast.plan(torch.zeros(4, 1).expand(4, 8), CastSpec(E4M3)) is None


def test_maybe_cast_declines(monkeypatch):
    hp = torch.randn(8, 16)
    assert triton_cast.maybe_cast(hp, CastSpec(E4M3, rounding="stochastic")) is None
    # A given scale of another shape or dtype: the reference (which broadcasts or raises).
    assert triton_cast.maybe_cast(hp, CastSpec(E4M3), torch.ones(1)) is None
    assert triton_cast.maybe_cast(hp, CastSpec(E4M3, (1, 0)), torch.ones(8, 1, dtype=torch.float64)) is None
    # Inputs that autograd records: the reference's differentiable ops.
    assert triton_cast.maybe_cast(hp.requires_grad_(), CastSpec(E4M3)) is None
    hp = hp.detach()
    assert triton_cast.maybe_cast(hp, CastSpec(E4M3)) is not None
    with torch.no_grad():  # a weight, cast inside an autograd Function's forward
        assert triton_cast.maybe_cast(torch.nn.Parameter(hp), CastSpec(E4M3)) is not None
    monkeypatch.setenv(triton_cast.ENV_VAR, "0")
    assert not triton_cast.enabled()
    assert triton_cast.maybe_cast(hp, CastSpec(E4M3)) is None


def test_cpu_casts_stay_on_the_reference(monkeypatch):
    """``kernels.cast`` never takes the fused path for a CPU tensor (the CPU path and its op
    counts are the reference's)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the fused path was taken for a CPU tensor")

    monkeypatch.setattr(triton_cast, "maybe_cast", refuse)
    hp = sample((64, 64), seed=11)
    for name in GRANULARITIES:
        assert_same(kernels.cast(hp, spec_of(name)), reference.cast(hp, spec_of(name)), what=name)
    for layouts in ("natural", "both", "column_major"):
        kernels.cast_for_gemm(hp, spec_of("tensorwise"), layouts=layouts)


def test_custom_op_registration():
    """One op with a fake implementation: shapes, dtypes and strides without running it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.f8tensor.fused_cast.default
    hp = sample((130, 200), torch.bfloat16, seed=12)
    args = [
        (hp, None, E4M3, [], False, "rceil", False, triton_cast.BOTH),
        (hp.t(), None, E4M3, [1, 0], False, "rceil", False, triton_cast.NATURAL),
        (hp, None, E4M3, [1, 32], True, "floor", False, triton_cast.COLUMN_MAJOR),
        (hp, None, E4M3, [128, 128], False, "rceil", True, triton_cast.BOTH),
    ]
    for a in args:
        real = op(*a)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = op(mode.from_tensor(a[0]), *a[1:])
        for r, f in zip(real, fake):
            assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)
    torch.library.opcheck(op, args[0], test_utils=("test_schema", "test_faketensor"))


# --------------------------------------------------------- compiled for GPUs, without one


def _compile_for(arch: int, kernel, pointers: dict, constants: dict, num_warps: int = 4):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    signature = {name: "constexpr" if name in constants else pointers.get(name, "i32") for name in kernel.arg_names}
    source = triton.compiler.ASTSource(kernel, signature, constexprs=constants)
    options = {"num_warps": num_warps, **triton_cast._OPTIONS}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


@pytest.mark.parametrize("arch", [89, 90])
def test_kernels_compile_for_cuda(arch):
    """Every kernel compiles to a cubin for sm89 and sm90 with triton's own ptxas (what the
    interpreter cannot show: the kernels are valid Triton for the GPU compiler), and its PTX
    does the scale math as the reference does: a correctly rounded float64 division, a
    round-to-nearest float64 -> fp32 conversion, no flush-to-zero multiply."""
    import re

    try:
        from triton.backends.nvidia import compiler  # noqa: F401
    except ImportError:
        pytest.skip("triton's NVIDIA backend is not installed")
    k, cols = triton_cast._kernels(False), triton_cast._kernels(False, "_triton_col_kernels")
    fmt = {"FMAX": 448.0, "BIAS": 7, "MBITS": 3, "FNUZ": False, "EPS": 2.0**-100}
    bf16, f32, u8 = "*bf16", "*fp32", "*u8"
    io = {"x_ptr": bf16, "out_ptr": u8, "out2_ptr": u8}
    built = [
        _compile_for(arch, k.amax_partials_kernel, {"x_ptr": bf16, "part_ptr": f32}, {"BR": 32, "BC": 128}),
        _compile_for(
            arch, k.cast_tensor_kernel, {**io, "part_ptr": f32, "scale_in_ptr": f32, "scale_ptr": f32, "inv_ptr": f32},
            {"HAS_SCALE": False, "WRITE2": True, "POW2": False, **fmt, "BR": 32, "BC": 128, "BP": 512},
        ),
        _compile_for(
            arch, k.cast_rows_kernel, {**io, "scale_in_ptr": f32, "scale_ptr": f32, "inv_ptr": f32},
            {"HAS_SCALE": False, "POW2": True, **fmt, "BR": 32, "BC": 128},
        ),
        _compile_for(
            arch, k.cast_groups_kernel, {**io, "scale_in_ptr": u8, "scale_ptr": u8, "inv_ptr": u8},
            {"HAS_SCALE": False, "E8M0": True, "FLOOR": False, "POW2": False, "EMAX": 8, **fmt,
             "BR": 32, "G": 4, "B": 32},
        ),
        _compile_for(
            arch, k.cast_tiles_kernel, {**io, "scale_in_ptr": f32, "scale_ptr": f32, "inv_ptr": f32},
            {"HAS_SCALE": False, "WRITE2": True, "E8M0": False, "FLOOR": False, "POW2": False, "EMAX": 8, **fmt,
             "SUB": 32, "BC": 128},
            num_warps=8,
        ),
        _compile_for(arch, cols.col_amax_kernel, {"x_ptr": bf16, "part_ptr": f32}, {"BR": 64, "BC": 64}),
        _compile_for(
            arch, cols.cast_cols_kernel,
            {**io, "part_ptr": f32, "scale_in_ptr": f32, "scale_ptr": f32, "inv_ptr": f32},
            {"HAS_SCALE": False, "MEASURE": False, "POW2": True, **fmt, "BR": 64, "BC": 64, "BP": 16},
        ),
    ]  # fmt: skip
    for kernel in built:
        assert kernel.asm["cubin"], kernel.name
    for ptx in (built[1].asm["ptx"], built[-1].asm["ptx"]):
        assert "div.rn.f64" in ptx and "cvt.rn.f32.f64" in ptx
        assert not re.search(r"\b(?:mul|fma)\.\w*ftz", ptx) and "div.full" not in ptx and "div.approx" not in ptx


# ------------------------------------------------------------------------------ on CUDA


def _cuda_kernels(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    fn()  # compile and warm up
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.gpu
@pytest.mark.parametrize("hp_dtype", HP_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", list(GRANULARITIES))
@pytest.mark.parametrize("float8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=lambda d: str(d)[6:])
def test_cuda_bit_exact(float8_dtype, name, hp_dtype):
    hp = sample((1030, 700), hp_dtype, seed=13).cuda()
    hp[7, 9] = float("inf")  # one block / row / tile with a NaN scale
    spec = spec_of(name, float8_dtype)
    assert triton_cast.maybe_cast(hp, spec) is not None
    assert_same(kernels.cast(hp, spec), reference.cast(hp, spec), what=name)
    assert_same(kernels.cast(hp.t(), spec), reference.cast(hp.t(), spec), what=f"{name} transposed")
    scale = reference.cast(hp * 2, spec)[1]
    assert_same(kernels.cast(hp, spec, scale), reference.cast(hp, spec, scale), what=f"{name} given scale")


@pytest.mark.gpu
@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=lambda d: str(d)[6:])
def test_cuda_rounding_at_every_code_boundary(float8_dtype):
    values = torch.cat([_boundary_values(float8_dtype), _random_bit_patterns(1 << 20, seed=14)])
    hp = torch.nn.functional.pad(values, (0, -values.numel() % 128)).reshape(-1, 128).cuda()
    one = torch.tensor(1.0, device="cuda")
    assert_same(kernels.cast(hp, CastSpec(float8_dtype), one), reference.cast(hp, CastSpec(float8_dtype), one))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tensorwise", "128x128"])
def test_cuda_column_major_copy(name):
    hp = sample((1030, 700), torch.bfloat16, seed=15).cuda()
    data, cm, scale, _ = kernels.cast_for_gemm(hp, spec_of(name), layouts="both")
    ref_data, ref_scale = reference.cast(hp, spec_of(name))
    assert_same((data, scale), (ref_data, ref_scale), what=name)
    assert cm.stride() == (1, 1030) and torch.equal(_bits(cm), _bits(ref_data))
    only = kernels.cast_for_gemm(hp, spec_of(name), layouts="column_major").data
    assert only.stride() == (1, 1030) and torch.equal(_bits(only), _bits(ref_data))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name, given, column_major, expected",
    [
        ("tensorwise", False, False, 2),  # partial amax, then scale-and-cast
        ("tensorwise", False, True, 2),  # ... writing both layouts
        ("tensorwise", True, False, 1),  # a given (delayed) scale: the cast kernel alone
        ("rowwise", False, False, 1),
        ("colwise", False, False, 2),  # partial amaxes per row split, then scale-and-cast
        ("colwise", True, False, 1),
        ("1x128", False, False, 1),
        ("128x1", False, False, 1),
        ("mx_rceil", False, False, 1),
        ("128x128", False, False, 1),
        ("128x128", False, True, 1),
    ],
)
def test_cuda_kernels_per_cast(name, given, column_major, expected):
    hp = sample((4096, 2048), torch.bfloat16, seed=16).cuda()
    spec = spec_of(name)
    scale = reference.cast(hp, spec)[1] if given else None
    if column_major:
        launched = _cuda_kernels(lambda: kernels.cast_for_gemm(hp, spec, scale, layouts="both"))
    else:
        launched = _cuda_kernels(lambda: kernels.cast(hp, spec, scale))
    assert len(launched) == expected, launched
    # The reference launches several (the count the fused path saves).
    assert len(_cuda_kernels(lambda: reference.cast(hp, spec, scale))) > expected
