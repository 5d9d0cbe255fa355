"""The fused 1 x b block cast of N-D tensors in any dense layout, and the fused
dequantization (``triton_dequantize.maybe_dequantize``), against the reference, bit for bit.

These are the two kernels ``save_activations_in_float8`` runs per saved tensor on CUDA.
On CPU they run under the Triton interpreter (as in ``test_triton_casts.py``); the tests
skip, with the reason, where this triton's interpreter cannot run them.
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import interpreter_problem, skip_without_interpreter

pytest.importorskip("triton", reason="the fused casts need triton (it ships with CUDA builds of torch)")

from f8tensor import kernels
from f8tensor.kernels import reference, triton_cast, triton_dequantize
from f8tensor.quant.config import CastSpec
from f8tensor.quant.formats import FLOAT8_DTYPES

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


#: Tests that never run a kernel under the interpreter (routing, the GPU compiler).
_NO_INTERPRETER = {"test_plan_refuses_what_is_not_dense", "test_dequantize_kernel_compiles_for_cuda"}


@functools.cache
def _interpreter_problem() -> str | None:
    """None when this triton's interpreter runs the kernels on CPU tensors; else why not."""
    return interpreter_problem(lambda: triton_cast.maybe_cast(torch.ones(40, 300), CastSpec(E4M3)))


@pytest.fixture(autouse=True)
def _needs_interpreter(request):
    skip_without_interpreter(request, _interpreter_problem, _NO_INTERPRETER)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def sample(shape, dtype=torch.float32, *, seed=0) -> torch.Tensor:
    """Normal values spanning many binades (every block's scale differs)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 12, shape, generator=g).float())
    return x.to(dtype)


#: name -> (logical shape, permutation of a contiguous tensor giving it, block): 2D, 3D and
#: 4D; contiguous, transposed with the last dim innermost (attention's q/k/v), and with the
#: last dim outside other dims in memory; last dims that are, and are not, multiples of the
#: block (the short last block has its own scale); ragged row counts.
LAYOUTS = {
    "2d": ((37, 96), None, 32),
    "2d_transposed": ((40, 64), (1, 0), 32),
    "3d": ((3, 5, 80), None, 32),
    "3d_last_not_innermost": ((4, 6, 48), (0, 2, 1), 16),
    "3d_last_outermost": ((5, 3, 70), (1, 2, 0), 32),
    "4d_heads_transposed": ((2, 3, 5, 64), (0, 2, 1, 3), 32),
    "4d_contiguous_ragged": ((2, 3, 7, 100), None, 128),
}


def _tensor(name: str, dtype: torch.dtype, *, seed: int = 0) -> torch.Tensor:
    shape, perm, _ = LAYOUTS[name]
    if perm is None:
        return sample(shape, dtype, seed=seed)
    stored = [0] * len(shape)
    for i, p in enumerate(perm):
        stored[p] = shape[i]
    return sample(tuple(stored), dtype, seed=seed).permute(perm)


def _spec(name: str, float8_dtype: torch.dtype) -> CastSpec:
    shape, _, block = LAYOUTS[name]
    return CastSpec(float8_dtype, (1,) * (len(shape) - 1) + (block,))


# ---------------------------------------------------------------------------- the pack


@pytest.mark.parametrize("hp_dtype", HP_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("float8_dtype", (E4M3, E5M2), ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_block_cast_of_every_dense_layout_matches_reference(name, float8_dtype, hp_dtype):
    """One fused kernel takes the tensor (no reference fallback), with the reference's FP8
    bytes and scales; the data laid out as the input (as the reference's elementwise ops
    lay it out), the scales in the input's memory order."""
    hp = _tensor(name, hp_dtype)
    hp[..., 1, 3] = float("nan")  # a block with a NaN amax: NaN scale, NaN data
    hp[..., -1, -1] = float("inf")
    spec = _spec(name, float8_dtype)
    got = triton_cast.maybe_cast(hp, spec)
    assert got is not None, f"no fused kernel for {name} (shape {tuple(hp.shape)}, strides {hp.stride()})"
    data, _, scale, _ = got
    want_data, want_scale = reference.cast(hp, spec)
    assert data.shape == want_data.shape and data.stride() == hp.stride(), (data.stride(), hp.stride())
    assert torch.equal(_bits(data), _bits(want_data)), f"{name}: FP8 bytes differ"
    assert scale.shape == want_scale.shape
    assert torch.equal(_bits(scale), _bits(want_scale)), f"{name}: scales differ"


def test_plan_refuses_what_is_not_dense():
    """Gaps (a strided slice), broadcasts and granularities other than 1 x b groups of a
    non-contiguous N-D tensor stay on the reference."""
    x = torch.zeros(2, 4, 6, 64).transpose(1, 2)
    assert triton_cast.plan(x, CastSpec(E4M3, (1, 1, 1, 32))) is not None
    assert triton_cast.plan(torch.zeros(2, 4, 128)[..., ::2], CastSpec(E4M3, (1, 1, 32))) is None
    assert triton_cast.plan(torch.zeros(4, 64).expand(3, 4, 64), CastSpec(E4M3, (1, 1, 32))) is None
    assert triton_cast.plan(x, CastSpec(E4M3, (1, 1, 1, 0))) is None
    assert triton_cast.plan(x, CastSpec(E4M3)) is None


# -------------------------------------------------------------------------- the unpack


def _every_code_data(name: str, float8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, CastSpec]:
    """FP8 data holding every byte (NaNs, e5m2 infinities, both zeros, subnormals) in the
    layout the fused cast of ``name`` writes (its scales in the data's memory order), and
    scales spanning binades with special blocks: a NaN scale, a tiny one (quotients past
    every dtype's max: the clamp), zero and infinity."""
    spec = _spec(name, float8_dtype)
    hp = _tensor(name, torch.float32)
    got = triton_cast.maybe_cast(hp, spec)
    assert got is not None
    data, scale = got[0], got[2]
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, data.shape, generator=g, dtype=torch.uint8)
    codes.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    data = torch.empty_like(data).copy_(codes.view(float8_dtype))
    assert data.stride() == hp.stride()
    magnitudes = torch.exp2(torch.randint(-30, 30, scale.shape, generator=g).float())
    scale = torch.empty_like(scale).copy_(magnitudes * (1 + torch.rand(scale.shape, generator=g)))
    for i, special in enumerate((float("nan"), 1e-37, 0.0, float("inf"))):
        scale[tuple(torch.unravel_index(torch.tensor(i), scale.shape))] = special
    return data, scale, spec


def _assert_dequantized_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bitwise equal, NaN for NaN. (A NaN's payload aside: the reference's own NaN bits
    depend on which CPU code path ran, e.g. bf16 ``0xFFFF`` from the vectorized conversion,
    ``0x7FC0`` from the scalar one.)"""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    nan = torch.isnan(want)
    assert torch.equal(nan, torch.isnan(got)), f"{what}: NaN positions differ"
    bad = (_bits(got) != _bits(want)) & ~nan
    assert not bad.any(), f"{what}: {int(bad.sum())} values differ, first at {bad.nonzero()[0].tolist()}"


@pytest.mark.parametrize("dtype", HP_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dequantize_matches_reference_for_every_code(name, float8_dtype, dtype):
    data, scale, spec = _every_code_data(name, float8_dtype)
    got = triton_dequantize.maybe_dequantize(data, scale, spec.block, dtype)
    assert got is not None, f"no fused dequantization for {name}"
    want = reference.dequantize(data, scale, spec.block, dtype)
    _assert_dequantized_equal(got, want, f"{name} {float8_dtype} -> {dtype}")
    assert got.stride() == data.stride(), "the output is laid out as the data"
    if float8_dtype == E5M2:  # an FP8 infinity stays infinite, with its sign
        inf = torch.isinf(data.float())
        assert inf.any() and torch.equal(got[inf], data.float()[inf].to(dtype))


@pytest.mark.parametrize("dtype", HP_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("float8_dtype", (E4M3, E5M2), ids=lambda d: str(d)[6:])
def test_round_trip_of_casts_matches_reference(float8_dtype, dtype):
    """The cast and the way back of the context, both fused, against both reference ops:
    ragged rows (37), a short last block, a NaN block and an infinite element."""
    hp = sample((37, 80), dtype, seed=3)
    hp[5, 40] = float("nan")
    hp[9, 2] = float("-inf")
    spec = CastSpec(float8_dtype, (1, 32))
    got = triton_cast.maybe_cast(hp, spec)
    assert got is not None
    back = triton_dequantize.maybe_dequantize(got[0], got[2], spec.block, dtype)
    assert back is not None
    data, scale = reference.cast(hp, spec)
    _assert_dequantized_equal(back, reference.dequantize(data, scale, spec.block, dtype), f"{float8_dtype} {dtype}")
    assert torch.isnan(back[5, 32:64]).all() and torch.isnan(back[9, :32]).all()


class _Launches:
    """Counts the launches of one interpreted kernel (``kernel[grid](...)``)."""

    def __init__(self, kernel) -> None:
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


def test_kernels_dequantize_routes_block_scales_to_the_kernel(monkeypatch):
    """``kernels.dequantize`` on a device of the fused path launches the kernel once for 1 x b
    fp32 block scales, and leaves every other layout (tensorwise, 2D tiles) on the reference."""
    module = triton_cast._kernels(True)
    launches = _Launches(module.dequantize_groups_kernel)
    monkeypatch.setattr(module, "dequantize_groups_kernel", launches)
    monkeypatch.setattr(kernels, "_fused_device", lambda t: True)
    data, scale = reference.cast(sample((16, 64)), CastSpec(E4M3, (1, 32)))
    _assert_dequantized_equal(
        kernels.dequantize(data, scale, (1, 32), torch.bfloat16),
        reference.dequantize(data, scale, (1, 32), torch.bfloat16),
        "routed",
    )
    assert launches.count == 1
    for block in ((), (16, 16)):
        d, s = reference.cast(sample((32, 64)), CastSpec(E4M3, block))
        assert torch.equal(
            kernels.dequantize(d, s, block, torch.float32), reference.dequantize(d, s, block, torch.float32)
        )
    assert launches.count == 1


def test_dequantize_op_registration():
    """One op with a fake implementation: shape, dtype and strides (the data's) without
    running it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.f8tensor.fused_dequantize.default
    args = []
    for name in ("2d", "2d_transposed", "4d_heads_transposed"):
        data, _, scale, _ = triton_cast.maybe_cast(_tensor(name, torch.float32), _spec(name, E4M3))
        args.append((data, scale, list(_spec(name, E4M3).block), torch.bfloat16))
    for a in args:
        real = op(*a)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = op(mode.from_tensor(a[0]), mode.from_tensor(a[1]), *a[2:])
        assert (real.shape, real.stride(), real.dtype) == (fake.shape, fake.stride(), fake.dtype)
    # (test_schema compares the inputs with ops FP8 tensors lack on CPU.)
    torch.library.opcheck(op, args[2], test_utils=("test_faketensor",))


@pytest.mark.parametrize("arch", [89, 90])
def test_dequantize_kernel_compiles_for_cuda(arch):
    """The kernel compiles to a cubin for sm89 and sm90 for every output dtype (what the
    interpreter cannot show), and its PTX divides as the reference does: a correctly
    rounded float64 division rounded once to fp32, no approximate or flush-to-zero op."""
    import re

    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia import compiler  # noqa: F401
    except ImportError:
        pytest.skip("triton's NVIDIA backend is not installed")
    kernel = triton_cast._kernels(False).dequantize_groups_kernel
    for out, pointer in ((0, "*fp32"), (1, "*i16"), (2, "*i16")):
        constants = {"BIAS": 15, "MBITS": 2, "FNUZ": False, "INF": True, "SUB_UNIT": 2.0**-16, "OUT": out,
                     "LIMIT": float(torch.finfo(torch.float16).max), "BR": 32, "G": 4, "B": 32}  # fmt: skip
        pointers = {"d_ptr": "*u8", "s_ptr": "*fp32", "o_ptr": pointer}
        signature = {n: "constexpr" if n in constants else pointers.get(n, "i32") for n in kernel.arg_names}
        source = triton.compiler.ASTSource(kernel, signature, constexprs=constants)
        built = triton.compile(
            source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4, **triton_cast._OPTIONS}
        )
        assert built.asm["cubin"]
        ptx = built.asm["ptx"]
        assert "div.rn.f64" in ptx and "cvt.rn.f32.f64" in ptx
        assert not re.search(r"\b(?:mul|fma|div)\.\w*ftz", ptx) and "div.full" not in ptx and "div.approx" not in ptx


# ------------------------------------------------------------------------------ on CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("float8_dtype", (E4M3, E5M2), ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cuda_block_layouts_bit_exact_and_one_kernel_each(name, float8_dtype):
    """On CUDA: the cast and the way back against the reference's CUDA ops, one kernel each."""
    from torch.profiler import ProfilerActivity, profile

    hp = _tensor(name, torch.bfloat16).cuda()
    hp[..., 1, 3] = float("nan")
    spec = _spec(name, float8_dtype)
    data, scale = kernels.cast(hp, spec)
    want_data, want_scale = reference.cast(hp, spec)
    assert torch.equal(_bits(data), _bits(want_data)) and torch.equal(_bits(scale), _bits(want_scale))
    for dtype in HP_DTYPES:
        got = kernels.dequantize(data, scale, spec.block, dtype)
        _assert_dequantized_equal(got, reference.dequantize(data, scale, spec.block, dtype), f"{name} {dtype}")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        data, scale = kernels.cast(hp, spec)
        kernels.dequantize(data, scale, spec.block, torch.bfloat16)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(names) == 2 and "cast_groups_kernel" in names[0] and "dequantize_groups_kernel" in names[1], names
