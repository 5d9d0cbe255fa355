"""The column-wise cast's tiled kernels (``f8tensor/kernels/_triton_col_kernels.py``: one
scale per column, the rowwise recipe's weight-gradient operands) against the reference
cast, bit for bit, under the Triton interpreter: several row splits (small tiles and split
sizes patched in, so small shapes have them), partial tiles, both output layouts, 3D
inputs, non-finite values; and the bytes the kernels move per element, counted from the
interpreter's loads and stores.

``test_triton_casts.py`` runs the same kernels through its granularity table ("colwise").
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from helpers import interpreter_problem, skip_without_interpreter

pytest.importorskip("triton", reason="the fused casts need triton (it ships with CUDA builds of torch)")

from f8tensor.kernels import reference, triton_cast
from f8tensor.quant.config import CastSpec
from f8tensor.quant.formats import E8M0, FLOAT8_DTYPES, FORMATS
from f8tensor.quant.scaling import inverse_scale_of

E4M3 = torch.float8_e4m3fn
HP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
COLWISE = (0, 1)


@functools.cache
def _interpreter_problem() -> str | None:
    return interpreter_problem(lambda: triton_cast.maybe_cast(torch.ones(40, 30), CastSpec(E4M3, COLWISE)))


@pytest.fixture(autouse=True)
def _needs_interpreter(request):
    skip_without_interpreter(request, _interpreter_problem, {"test_plan", "test_splits"})


#: name -> (tile, rows per split at least, splits at most) patched into triton_cast.
SPLITTINGS = {
    "default": (triton_cast._COLS_TILE, triton_cast._COLS_SPLIT_ROWS, triton_cast._COLS_MAX_SPLITS),
    "small_tiles": ((32, 64), 32, 16),
    "capped": ((32, 64), 16, 3),
}


@pytest.fixture(params=list(SPLITTINGS))
def splitting(request, monkeypatch):
    tile, rows, most = SPLITTINGS[request.param]
    monkeypatch.setattr(triton_cast, "_COLS_TILE", tile)
    monkeypatch.setattr(triton_cast, "_COLS_SPLIT_ROWS", rows)
    monkeypatch.setattr(triton_cast, "_COLS_MAX_SPLITS", most)
    return request.param


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.uint8)


def check(hp, spec, scale=None, *, layouts=triton_cast.NATURAL, what=""):
    """The fused cast of ``hp`` equals the reference bit for bit (data, its strides, scale,
    and the inverse as ``inverse_scale_of``, NaN payloads aside); returns the fused data."""
    what = what or f"{spec} {tuple(hp.shape)}"
    out = triton_cast.maybe_cast(hp, spec, scale, layouts=layouts)
    assert out is not None, f"no fused kernel: {what}"
    data, second, s, inverse = out
    ref_data, ref_scale = reference.cast(hp, spec, scale)
    assert second is None and data.dtype == ref_data.dtype and data.shape == ref_data.shape, what
    if layouts == triton_cast.COLUMN_MAJOR:
        assert data.stride() == (1, hp.shape[0]), what
    elif hp.numel():
        assert data.stride() == ref_data.stride(), what
    bad = (_bits(data) != _bits(ref_data)).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} bytes differ, first at {bad[0].tolist()}"
    assert s.shape == ref_scale.shape and torch.equal(_bits(s), _bits(ref_scale)), f"{what}: scales differ"
    want = inverse_scale_of(s)
    nan = torch.isnan(want)
    assert torch.equal(nan, torch.isnan(inverse)) and torch.equal(_bits(inverse)[~nan], _bits(want)[~nan]), what
    return data


def sample(shape, dtype=torch.float32, *, seed=0) -> torch.Tensor:
    """Normal values spanning many binades, and one large value per column at a row that
    moves with the column: a split or tile whose amax is lost costs that column its scale."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 12, shape, generator=g).float())
    if x.dim() == 2 and x.numel():
        cols = torch.arange(shape[1])
        x[(cols * 37) % shape[0], cols] = 2.0**20 * (1 + cols.float() / shape[1])
    return x.to(dtype)


# --------------------------------------------------------------------------- routing


def test_plan():
    hp = torch.zeros(256, 96)
    assert triton_cast.plan(hp, CastSpec(E4M3, COLWISE)) == triton_cast.Plan("cols")
    assert triton_cast.plan(hp.t(), CastSpec(E4M3, COLWISE)) == triton_cast.Plan("cols")
    assert triton_cast.plan(torch.zeros(2, 3, 8), CastSpec(E4M3, (0, 0, 1))) == triton_cast.Plan("cols")
    # The reference's: e8m0 column scales, a 3D input that is not contiguous, per-element (1D) scales.
    assert triton_cast.plan(hp, CastSpec(E4M3, COLWISE, E8M0)) is None
    assert triton_cast.plan(torch.zeros(4, 6, 8).transpose(0, 1), CastSpec(E4M3, (0, 0, 1))) is None
    assert triton_cast.plan(torch.zeros(8), CastSpec(E4M3, (1,))) is None


def test_splits(monkeypatch):
    """Whole tiles per split, at least ``_COLS_SPLIT_ROWS`` rows each, at most
    ``_COLS_MAX_SPLITS``, none empty; one split (one launch) below two splits' rows."""
    br = triton_cast._COLS_TILE[0]
    assert triton_cast._col_splits(0) == (1, br)
    assert triton_cast._col_splits(2 * triton_cast._COLS_SPLIT_ROWS - 1)[0] == 1
    for rows in (1, 63, 64, 65, 1000, 1024, 1100, 8192, 100_000):
        splits, per = triton_cast._col_splits(rows)
        assert per % br == 0 and 1 <= splits <= triton_cast._COLS_MAX_SPLITS, rows
        assert (splits - 1) * per < rows <= splits * per, rows
    assert triton_cast._col_splits(8192) == (16, 512)


# ------------------------------------------------------------------ bit for bit, split


@pytest.mark.parametrize("layouts", [triton_cast.NATURAL, triton_cast.COLUMN_MAJOR], ids=["natural", "colmajor"])
@pytest.mark.parametrize("hp_dtype", HP_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=lambda d: str(d)[6:])
def test_bit_exact(splitting, float8_dtype, hp_dtype, layouts):
    # 197 x 75: a partial last split, row tile and column tile in every splitting.
    check(sample((197, 75), hp_dtype), CastSpec(float8_dtype, COLWISE), layouts=layouts)


@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=lambda d: str(d)[6:])
def test_power_of_2_scales(splitting, float8_dtype):
    check(sample((150, 70), seed=1), CastSpec(float8_dtype, COLWISE, power_of_2=True))


def test_given_scales(splitting):
    """A given (delayed) per-column scale is read through its strides and returned as is."""
    spec = CastSpec(torch.float8_e5m2, COLWISE)
    hp = sample((150, 70), torch.bfloat16, seed=2)
    scale = reference.cast(hp * 0.25, spec)[1]  # saturation happens
    strided = torch.empty(70, 2)[:, 0].unsqueeze(0).copy_(scale)  # every other float
    assert strided.stride() != scale.stride()
    for given in (scale, strided):
        check(hp, spec, given, layouts=triton_cast.COLUMN_MAJOR)
        assert triton_cast.maybe_cast(hp, spec, given)[2] is given


def test_strided_inputs(splitting):
    base = sample((160, 140), seed=3)
    for hp, what in ((base.t(), "transposed"), (base[5:150, 3:133], "sliced"), (base.t()[2:130, 7:], "both")):
        check(hp, CastSpec(E4M3, COLWISE), what=what)
        check(hp, CastSpec(E4M3, COLWISE), layouts=triton_cast.COLUMN_MAJOR, what=f"{what} column-major")


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (65, 1), (1, 65), (129, 63), (0, 7), (7, 0), (0, 0)])
def test_odd_shapes(splitting, shape):
    check(sample(shape, seed=4), CastSpec(E4M3, COLWISE))
    if 0 not in shape:
        check(sample(shape, seed=4), CastSpec(E4M3, COLWISE), layouts=triton_cast.COLUMN_MAJOR)


@pytest.mark.parametrize("shape", [(2, 3, 70), (3, 70, 33), (1, 1, 5)])
def test_3d_inputs_flattened(splitting, shape):
    """A (batch, tokens, features) input with one scale per feature: the 2D cast of its
    flattened rows, as a linear flattens its input."""
    hp = sample(shape, torch.bfloat16, seed=5)
    data = check(hp, CastSpec(E4M3, (0, 0, 1)))
    flat = reference.cast(hp.reshape(-1, shape[-1]), CastSpec(E4M3, COLWISE))[0]
    assert torch.equal(_bits(data).reshape(-1, shape[-1]), _bits(flat))


@pytest.mark.parametrize("given", [False, True], ids=["dynamic", "given"])
@pytest.mark.parametrize("float8_dtype", FLOAT8_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("case", ["nan", "inf", "-inf", "zeros", "tiny", "huge"])
@pytest.mark.parametrize("splitting", ["small_tiles"], indirect=True)
def test_special_values(splitting, case, float8_dtype, given):
    """NaN stays NaN; an infinity makes its column's dynamic scale NaN (all NaN), and
    saturates with a given finite scale, exactly as the reference; each in a late split."""
    hp = sample((150, 40), seed=6)
    if case in ("nan", "inf", "-inf"):
        value = float(case)
        hp[140, 3] = value  # the last split
        hp[70, 9] = -value
        hp[:, 20] = value  # a whole column
    elif case == "zeros":
        hp[:, 5:9] = 0
    elif case == "tiny":
        hp = hp * 1e-34  # amax below EPS: the clamped scale
    else:
        hp = hp * 1e30
    spec = CastSpec(float8_dtype, COLWISE)
    scale = reference.cast(sample((150, 40), seed=7), spec)[1] if given else None
    data = check(hp, spec, scale, layouts=triton_cast.COLUMN_MAJOR, what=f"{case} {float8_dtype}")
    values = data.float()
    if case == "nan":
        assert torch.isnan(values[:, 20]).all() and torch.isnan(values[140, 3])
    elif case in ("inf", "-inf") and given:
        fmax = FORMATS[float8_dtype].max
        assert values[140, 3].abs() == fmax and values[70, 9].abs() == fmax


# ------------------------------------------------------------------ bytes per element


class _Traffic:
    """The interpreter's memory calls, counted: per buffer (by address range), bytes read
    and written, and how often each address was read and written."""

    def __init__(self, inner):
        self._inner, self.events = inner, []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def load(self, ptrs, mask, *args):
        out = self._inner.load(ptrs, mask, *args)
        self.events.append(("read", ptrs[mask].copy(), out.itemsize))
        return out

    def store(self, ptrs, value, mask):
        self.events.append(("write", ptrs[mask].copy(), value.itemsize))
        return self._inner.store(ptrs, value, mask)


def bytes_moved(monkeypatch, hp, spec, layouts=triton_cast.COLUMN_MAJOR):
    """``{(buffer, "read" | "write"): (bytes per element of hp, most touches of one
    address)}`` of one fused cast, ``buffer``: ``"input"``, ``"fp8"``, ``"scales"`` (scale
    and inverse), ``"partials"`` (anything else: the partial amaxes)."""
    from triton.runtime import interpreter

    traffic = _Traffic(interpreter._interpreter)
    with monkeypatch.context() as m:
        m.setattr(interpreter, "_interpreter", traffic)
        data, _, scale, inverse = triton_cast.maybe_cast(hp, spec, layouts=layouts)
    buffers = {"input": hp, "fp8": data, "scales": scale, "inverse": inverse}
    grouped: dict[tuple[str, str], list] = {}
    for kind, ptrs, size in traffic.events:
        if ptrs.size:
            grouped.setdefault((_owner(ptrs, buffers), kind), []).append((ptrs, size))
    moved = {}
    for key, chunks in grouped.items():
        total = sum(p.size * size for p, size in chunks)
        counts = np.unique(np.concatenate([p for p, _ in chunks]), return_counts=True)[1]
        moved[key] = (total / hp.numel(), int(counts.max()))
    return moved


def _owner(ptrs, buffers) -> str:
    for name, t in buffers.items():
        start = t.data_ptr()
        if start <= ptrs.min() and ptrs.max() < start + t.untyped_storage().nbytes():
            return "scales" if name == "inverse" else name
    return "partials"


def expected_bytes(rows: int, cols: int, itemsize: int, splits: int) -> dict[tuple[str, str], float]:
    """The kernels' traffic per element: the input read twice (amax, cast), one FP8 byte
    written; split partials written once and read by every split's cast programs (one
    split: none); the scale and its inverse written once per column."""
    per = {("input", "read"): 2.0 * itemsize, ("fp8", "write"): 1.0, ("scales", "write"): 8 / rows}
    if splits > 1:
        per[("partials", "write")] = 4 * splits / rows
        per[("partials", "read")] = 4 * splits * splits / rows
    return per


@pytest.mark.parametrize(
    "shape, hp_dtype, splitting",
    [
        ((100, 70), torch.bfloat16, "default"),  # one split: one launch measures its own amax
        ((1100, 70), torch.bfloat16, "default"),  # two splits
        ((197, 75), torch.float32, "small_tiles"),  # four splits, partial tiles
        ((197, 75), torch.bfloat16, "capped"),
    ],
    indirect=["splitting"],
)
def test_bytes_per_element(monkeypatch, splitting, shape, hp_dtype):
    """Each input element read exactly twice, each FP8 byte written exactly once, the
    partials and scales as :func:`expected_bytes` counts them (nothing else moves)."""
    hp = sample(shape, hp_dtype, seed=8)
    splits = triton_cast._col_splits(shape[0])[0]
    moved = bytes_moved(monkeypatch, hp, CastSpec(E4M3, COLWISE))
    want = expected_bytes(*shape, hp.element_size(), splits)
    assert {k: v[0] for k, v in moved.items()} == pytest.approx(want, rel=1e-12)
    assert moved[("input", "read")][1] == 2 and moved[("fp8", "write")][1] == 1


# ------------------------------------------------------------------------------ on CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("given", [False, True], ids=["dynamic", "given"])
@pytest.mark.parametrize("float8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=lambda d: str(d)[6:])
def test_cuda_many_splits(float8_dtype, given):
    """A weight-gradient operand at training size (the most splits, a partial last one) on
    the compiled kernels, column-major, bit for bit; an infinity in the last split."""
    from f8tensor import kernels

    hp = sample((8192 + 37, 1000), torch.bfloat16, seed=9).cuda()
    hp[8200, 11] = float("inf")
    spec = CastSpec(float8_dtype, COLWISE)
    assert triton_cast._col_splits(hp.shape[0])[0] == triton_cast._COLS_MAX_SPLITS
    scale = reference.cast(hp * 2, spec)[1] if given else None
    got = kernels.cast_for_gemm(hp, spec, scale, layouts="column_major")
    ref_data, ref_scale = reference.cast(hp, spec, scale)
    assert got.data.stride() == (1, hp.shape[0])
    assert torch.equal(_bits(got.data), _bits(ref_data)) and torch.equal(_bits(got.scale), _bits(ref_scale))
