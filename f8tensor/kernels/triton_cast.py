"""Fused FP8 casts: Triton kernels behind one ``torch.library.custom_op`` (``f8tensor::fused_cast``).

A tensorwise cast is two kernels (partial amaxes, then one pass that reduces them in a
fixed order, computes the scale and writes data, scale and an optional column-major
copy); rowwise and block casts are one kernel each; a column-wise cast is two (a partial
amax per row split and column, then the cast), one where a single split covers the rows.
The custom op gives dispatch, torch.compile and export one op with known outputs; the
Triton interpreter runs the same kernels on CPU, so the CPU suite checks them bit for bit
against the reference. FP8 rounding is integer arithmetic on the fp32 bits: exact and
backend-independent.

:func:`f8tensor.kernels.cast` takes this path only for a plain CUDA tensor, outside
compilation, with round-to-nearest, a granularity :func:`plan` covers, triton importable
and ``F8TENSOR_FUSED_CASTS`` not ``0``; everything else runs the reference.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from pathlib import Path
from typing import NamedTuple

import torch

from f8tensor.kernels.layouts import empty_column_major
from f8tensor.quant.formats import E8M0, FORMATS
from f8tensor.quant.scaling import EPS
from f8tensor.quant.specs import CastSpec

__all__ = [
    "BOTH",
    "COLUMN_MAJOR",
    "ENV_VAR",
    "NATURAL",
    "Plan",
    "available",
    "enabled",
    "fused_cast",
    "maybe_cast",
    "plan",
]

#: Set to ``0`` (or ``off``, ``false``, ``no``) to keep every cast on the reference.
ENV_VAR = "F8TENSOR_FUSED_CASTS"

# Tile shapes (elements per program: 4096 for the streaming kernels).
_TENSOR_TILE = (32, 128)
_ROWS_TILE = (32, 128)
_COLS_TILE = (64, 64)
# Column-wise row splits: at least this many rows each (the partial amaxes a cast
# program reduces stay small beside its rows), and at most this many splits.
_COLS_SPLIT_ROWS = 512
_COLS_MAX_SPLITS = 16
_GROUP_ELEMENTS = 128  # G * B per row of a groups program
_GROUP_ROWS = 32
_MAX_PARTIALS = 512
_MAX_BLOCK = 1024  # the widest block (padded to a power of two) one program holds per row
# No floating-point contraction: a product rounded on its own is the reference's product.
_OPTIONS = {"enable_fp_fusion": False}


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@functools.cache
def available() -> bool:
    """Whether triton imports."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def enabled() -> bool:
    """Triton imports and ``F8TENSOR_FUSED_CASTS`` does not switch the fused path off."""
    flag = os.environ.get(ENV_VAR, "1").strip().lower()
    return flag not in ("0", "off", "false", "no") and available()


@functools.cache
def _kernels(interpret: bool, stem: str = "_triton_kernels"):
    """The kernel file ``{stem}.py`` of this folder, compiled or interpreted: ``triton.jit``
    reads ``TRITON_INTERPRET`` when it decorates, so each variant is its own module object
    (named with ``_interpreted`` for the interpreter's). The casts' kernels are loaded
    before any other file, which calls their helpers from the same variant."""
    if stem != "_triton_kernels":
        _kernels(interpret)
    name = f"{__package__}.{stem}" + ("_interpreted" if interpret else "")
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{stem}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        sys.modules[name] = module
        spec.loader.exec_module(module)
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
    return module


class _Format(NamedTuple):
    fmax: float
    bias: int
    mbits: int
    fnuz: bool
    emax: int


@functools.cache
def _format(float8_dtype: torch.dtype) -> _Format:
    fmt = FORMATS[float8_dtype]
    fnuz = not fmt.has_negative_zero
    bias = 2 ** (fmt.exponent_bits - 1) - 1 + int(fnuz)
    return _Format(fmt.max, bias, fmt.mantissa_bits, fnuz, fmt.emax)


class Plan(NamedTuple):
    """How a cast maps onto the kernels: ``kind`` is ``"tensor"``, ``"rows"`` (one scale per
    row), ``"cols"`` (one scale per column of the input flattened to 2D), ``"groups"`` (1 x
    ``block`` blocks along rows) or ``"tiles"`` (``block`` = (br, bc)); ``transpose``: the
    kernel runs on the 2D transposed views (b x 1 blocks)."""

    kind: str
    transpose: bool = False
    block: tuple[int, int] = (1, 1)


def plan(hp: torch.Tensor, spec: CastSpec) -> Plan | None:
    """The kernels' plan for casting ``hp`` per ``spec``, or None where the reference runs
    (stochastic rounding, 0-dim inputs, blocks the kernels do not cover, zero (broadcast)
    strides, inputs of more than 2 dims that are not dense, or that are dense but not
    contiguous with a granularity other than 1 x b blocks along the last dim)."""
    if spec.rounding != "nearest" or hp.dim() == 0 or spec.float8_dtype not in FORMATS:
        return None
    if hp.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    if any(st == 0 and n > 1 for st, n in zip(hp.stride(), hp.shape)):
        return None  # broadcast: one element read for several (a size-1 dim's stride addresses nothing)
    # A dense N-D tensor in any dim order: the groups kernel addresses its rows through its
    # memory order (see ``_rows_of``); the other kernels take contiguous N-D inputs.
    strided = hp.dim() > 2 and not hp.is_contiguous()
    if strided and _memory_order(hp) is None:
        return None
    block = spec.block
    e8m0 = spec.scale_dtype == E8M0
    if not block:
        return None if (e8m0 or strided) else Plan("tensor")
    if len(block) != hp.dim() or any(b < 0 for b in block):
        return None
    lead, last = block[:-1], block[-1]
    if last == 1 and hp.dim() >= 2 and all(b == 0 for b in lead):
        # Column-wise: one scale per element of the last dim, the leading dims flattened.
        return None if (e8m0 or strided) else Plan("cols")
    if all(b == 1 for b in lead):
        if last == 0:
            return None if (e8m0 or strided) else Plan("rows")
        if 1 < last and _next_pow2(last) <= _MAX_BLOCK:
            return Plan("groups", False, (1, last))
        return None
    if hp.dim() != 2:
        return None
    first = block[0]
    if last == 1:  # b x 1 blocks: the groups kernels on the transposed views
        if 1 < first and _next_pow2(first) <= _MAX_BLOCK:
            return Plan("groups", True, (1, first))
        return None
    if first > 1 and last > 1 and _next_pow2(last) <= _MAX_BLOCK:
        return Plan("tiles", False, (first, last))
    return None


def _memory_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The dims of ``t`` from the outermost to the innermost in memory (identity for a
    contiguous tensor), or None where ``t`` is not dense (gaps or overlaps in its storage)."""
    if t.is_contiguous():
        return tuple(range(t.dim()))
    strides = t.stride()
    order = tuple(sorted(range(t.dim()), key=lambda d: -strides[d]))
    return order if t.permute(order).is_contiguous() else None


def _empty_in_order(shape: tuple[int, ...], order: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialized tensor of logical ``shape`` laid out densely in memory order
    ``order`` (what a dense input of that order gives elementwise ops)."""
    inverse = sorted(range(len(order)), key=lambda i: order[i])
    return torch.empty([shape[d] for d in order], dtype=dtype, device=device).permute(inverse)


class _Rows(NamedTuple):
    """A tensor as the 2D problem of the groups kernels, ``R`` rows of ``C`` elements (its
    last dim): row ``q`` starts at ``(q // nr) * outer + (q % nr) * inner``; consecutive
    elements of a row are ``col`` apart."""

    R: int
    C: int
    nr: int
    outer: int
    inner: int
    col: int


def _rows_of(t: torch.Tensor, order: tuple[int, ...] | None) -> _Rows:
    """``t`` (of at most 2 dims: any strides; else dense in memory order ``order``, which
    its input's memory order gives every tensor of an op) as :class:`_Rows`. The leading
    dims that lie outside the last dim in memory collapse into the outer index, those
    inside it into the inner one (a contiguous tensor: all outer, ``nr == 1``)."""
    if t.dim() <= 2:
        x = _as_2d(t)
        return _Rows(x.shape[0], x.shape[1], max(x.shape[0], 1), 0, x.stride(0), x.stride(1))
    assert order is not None
    k = order.index(t.dim() - 1)
    inner = 1
    for d in order[k + 1 :]:
        inner *= t.shape[d]
    C = t.shape[-1]
    rows = 1
    for d in range(t.dim() - 1):
        rows *= t.shape[d]
    # Dense in ``order``: the inner dims are contiguous below the last dim, which is
    # ``inner`` elements apart, and the outer dims are contiguous above it.
    return _Rows(rows, C, max(inner, 1), C * inner, 1, inner)


def _scale_shape(shape: tuple[int, ...], spec_block: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(1 if b == 0 else -(-s // b) for s, b in zip(shape, spec_block))


def _data_like(hp: torch.Tensor, float8_dtype: torch.dtype) -> torch.Tensor:
    """The FP8 output in the layout the reference's elementwise ops give it: column-major
    for a 2D input whose dim 0 is the inner one, the input's own memory order for a dense
    N-D one, else contiguous. (The strides of a size-1 dim, which address nothing, may
    differ from the reference's.)"""
    if hp.dim() == 2 and hp.shape[0] > 1 and hp.shape[1] > 1 and hp.stride(0) < hp.stride(1):
        return empty_column_major(hp.shape, float8_dtype, hp.device)
    order = _memory_order(hp) if hp.dim() > 2 else None
    if order is not None:
        return _empty_in_order(tuple(hp.shape), order, float8_dtype, hp.device)
    return torch.empty(hp.shape, dtype=float8_dtype, device=hp.device)


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2D view; a non-contiguous N-D tensor as it is (only the groups kernels
    take one, and address its rows through :func:`_rows_of`)."""
    if t.dim() == 1:
        return t.unsqueeze(0)
    if t.dim() > 2:
        return t.view(-1, t.shape[-1]) if t.is_contiguous() else t
    return t


def _allocate(
    hp: torch.Tensor, float8_dtype: torch.dtype, block: list[int], e8m0: bool, scale: torch.Tensor | None, layouts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's outputs: data (column-major for ``layouts == COLUMN_MAJOR``), the
    column-major copy (``layouts == BOTH``; else an empty placeholder), the scale (an empty
    placeholder when ``scale`` was given) and the scale's inverse, laid out as the scale
    in use (the dequantization factors the GEMMs read)."""
    device = hp.device
    if layouts == COLUMN_MAJOR:
        data = empty_column_major(hp.shape, float8_dtype, device)
    else:
        data = _data_like(hp, float8_dtype)
    second = (
        empty_column_major(hp.shape, float8_dtype, device)
        if layouts == BOTH
        else torch.empty(0, dtype=float8_dtype, device=device)
    )
    scale_dtype = E8M0 if e8m0 else torch.float32
    if scale is not None:
        out_scale = torch.empty(0, dtype=torch.float32, device=device)
        inverse = torch.empty_strided(scale.shape, scale.stride(), dtype=scale_dtype, device=device)
    elif hp.dim() > 2 and block:
        # Per block of a dense N-D input: the scales in the input's memory order, so that the
        # kernels address their rows as the data's (see ``_rows_of``).
        shape = _scale_shape(tuple(hp.shape), tuple(block))
        order = _memory_order(hp) or tuple(range(hp.dim()))
        out_scale = _empty_in_order(shape, order, scale_dtype, device)
        inverse = _empty_in_order(shape, order, scale_dtype, device)
    else:
        shape = _scale_shape(tuple(hp.shape), tuple(block)) if block else ()
        out_scale = torch.empty(shape, dtype=scale_dtype, device=device)
        inverse = torch.empty(shape, dtype=scale_dtype, device=device)
    return data, second, out_scale, inverse


#: ``layouts`` of the op: the data as the reference lays it out; that and a column-major
#: copy; the data column-major only (what the weight-gradient GEMM alone reads).
NATURAL, BOTH, COLUMN_MAJOR = 0, 1, 2

_SCHEMA = (
    "(Tensor hp, Tensor? scale, ScalarType float8_dtype, int[] block, bool e8m0, str scale_mode, "
    "bool power_of_2, int layouts) -> (Tensor, Tensor, Tensor, Tensor)"
)


@torch.library.custom_op("f8tensor::fused_cast", mutates_args=(), schema=_SCHEMA)
def fused_cast(
    hp: torch.Tensor,
    scale: torch.Tensor | None,
    float8_dtype: torch.dtype,
    block: list[int],
    e8m0: bool,
    scale_mode: str,
    power_of_2: bool,
    layouts: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(data, column-major copy or empty, scale or empty, inverse scale)``: the
    cast of ``hp`` per the CastSpec fields given, by the Triton kernels (interpreted for
    CPU tensors). ``layouts``: :data:`NATURAL`, :data:`BOTH` or :data:`COLUMN_MAJOR`."""
    spec = CastSpec(float8_dtype, tuple(block), E8M0 if e8m0 else torch.float32, scale_mode, power_of_2)
    how = plan(hp, spec)
    if how is None:
        raise ValueError(f"fused_cast: no kernel for a {tuple(hp.shape)} {hp.dtype} input with {spec}")
    if layouts not in (NATURAL, BOTH, COLUMN_MAJOR):
        raise ValueError(f"fused_cast: layouts must be 0 (natural), 1 (both) or 2 (column-major); got {layouts}")
    if layouts == BOTH and (hp.dim() != 2 or how.kind not in ("tensor", "tiles")):
        raise ValueError(f"fused_cast: the column-major copy needs a 2D tensorwise or block cast; got {spec}")
    if layouts == COLUMN_MAJOR and hp.dim() != 2:
        raise ValueError(f"fused_cast: column-major data needs a 2D input; got shape {tuple(hp.shape)}")
    data, second, out_scale, inverse = _allocate(hp, float8_dtype, block, e8m0, scale, layouts)
    _launch(how, hp, scale, spec, data, second if layouts == BOTH else None, out_scale, inverse)
    return data, second, out_scale, inverse


@fused_cast.register_fake
def _(hp, scale, float8_dtype, block, e8m0, scale_mode, power_of_2, layouts):
    return _allocate(hp, float8_dtype, block, e8m0, scale, layouts)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _launch(
    how: Plan,
    hp: torch.Tensor,
    scale: torch.Tensor | None,
    spec: CastSpec,
    data: torch.Tensor,
    second: torch.Tensor | None,
    out_scale: torch.Tensor,
    inverse: torch.Tensor,
) -> None:
    if hp.device.type == "cuda" and hp.device.index != torch.cuda.current_device():
        # Triton launches on the current device.
        with torch.cuda.device(hp.device):
            _launch(how, hp, scale, spec, data, second, out_scale, inverse)
        return
    interpret = hp.device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    k = _kernels(interpret)
    f = _format(spec.float8_dtype)
    fmt = {"FMAX": f.fmax, "BIAS": f.bias, "MBITS": f.mbits, "FNUZ": f.fnuz, "EPS": EPS}
    has_scale = scale is not None
    x, out = _as_2d(hp), _bytes(_as_2d(data))
    out2 = _bytes(second) if second is not None else out
    if how.kind == "tensor":
        if x.stride(0) < x.stride(1) and x.shape[0] > 1 and x.shape[1] > 1:
            # Layout-agnostic: read along the inner dim.
            x, out, out2 = x.t(), out.t(), out2.t()
        R, C = x.shape
        br, bc = _TENSOR_TILE
        tiles_c = max(1, -(-C // bc))  # a divisor in the kernels, also for C = 0
        tiles = -(-R // br) * tiles_c
        parts = max(1, min(tiles, _MAX_PARTIALS))
        partials = torch.empty(parts, dtype=torch.float32, device=hp.device)
        if not has_scale:
            per = max(1, -(-tiles // parts))
            k.amax_partials_kernel[(parts,)](
                x, partials, R, C, x.stride(0), x.stride(1), tiles_c, tiles, per, BR=br, BC=bc, **_OPTIONS
            )
        k.cast_tensor_kernel[(max(tiles, 1),)](
            x, partials, parts, scale if has_scale else partials, out, out2, out_scale, inverse,
            R, C, x.stride(0), x.stride(1), out.stride(0), out.stride(1), out2.stride(0), out2.stride(1), tiles_c,
            HAS_SCALE=has_scale, WRITE2=second is not None, POW2=spec.power_of_2, **fmt,
            BR=br, BC=bc, BP=_next_pow2(parts), **_OPTIONS,
        )  # fmt: skip
        return
    # The scale read (given) or written (computed): e8m0 bytes through a uint8 view.
    s = scale if scale is not None else out_scale
    s2 = _as_2d(s.view(torch.uint8) if s.dtype == E8M0 else s)
    # The inverse has the scale's shape and strides: the same offsets address both.
    inv2 = _as_2d(inverse.view(torch.uint8) if inverse.dtype == E8M0 else inverse)
    if how.kind == "cols":
        _launch_cols(_kernels(interpret, "_triton_col_kernels"), x, out, s2, inv2, has_scale, spec.power_of_2, fmt)
        return
    e8m0 = spec.scale_dtype == E8M0
    floor = spec.scale_mode == "floor"
    if how.transpose:
        x, out, s2, inv2 = x.t(), out.t(), s2.t(), inv2.t()
    if how.kind == "groups":
        if x.dim() != 2:  # a dense N-D input that is not contiguous: the tensors as they are
            s_nd = s.view(torch.uint8) if s.dtype == E8M0 else s
            i_nd = inverse.view(torch.uint8) if inverse.dtype == E8M0 else inverse
            x, out, s2, inv2 = hp, _bytes(data), s_nd, i_nd
        _launch_groups(k, how.block[1], x, out, s2, inv2, has_scale, e8m0, floor, spec, f.emax, fmt)
        return
    R, C = x.shape
    if how.kind == "rows":
        br, bc = _ROWS_TILE
        if R:
            k.cast_rows_kernel[(-(-R // br),)](
                x, s2, out, s2, inv2, R, C, x.stride(0), x.stride(1), out.stride(0), out.stride(1), s2.stride(0),
                HAS_SCALE=has_scale, POW2=spec.power_of_2, **fmt, BR=br, BC=bc, **_OPTIONS,
            )  # fmt: skip
        return
    blk_r, blk_c = how.block
    grid = (-(-R // blk_r), -(-C // blk_c))
    if not (R and C):
        return
    k.cast_tiles_kernel[grid](
        x, s2, out, out2, s2, inv2, R, C, blk_r, blk_c,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), out2.stride(0), out2.stride(1),
        s2.stride(0), s2.stride(1),
        HAS_SCALE=has_scale, WRITE2=second is not None, E8M0=e8m0, FLOOR=floor, POW2=spec.power_of_2,
        EMAX=f.emax, **fmt, SUB=min(32, _next_pow2(blk_r)), BC=_next_pow2(blk_c),
        num_warps=8, **_OPTIONS,
    )  # fmt: skip


def _col_splits(R: int) -> tuple[int, int]:
    """``(splits, rows per split)`` of the column-wise cast over ``R`` rows: whole tiles, at
    least ``_COLS_SPLIT_ROWS`` rows per split (one split below that), at most
    ``_COLS_MAX_SPLITS`` splits, none empty."""
    br = _COLS_TILE[0]
    splits = min(_COLS_MAX_SPLITS, max(1, R // _COLS_SPLIT_ROWS))
    per = -(-max(1, -(-R // br)) // splits) * br
    return max(1, -(-R // per)), per


def _launch_cols(
    k, x: torch.Tensor, out: torch.Tensor, s2: torch.Tensor, inv2: torch.Tensor, has_scale: bool, pow2: bool, fmt: dict
) -> None:
    """The column-wise cast of the 2D ``x`` (fp32 scales ``s2``, given or written, and
    ``inv2``: ``(1, C)``): a partial amax per (row split, column), then the cast; one
    launch where one split covers the rows or the scale is given."""
    R, C = x.shape
    if not C:
        return
    br, bc = _COLS_TILE
    splits, per = _col_splits(R)
    grid = (splits, -(-C // bc))
    measure = not has_scale and splits == 1
    partials = s2  # a placeholder where no partials are read
    if not (has_scale or measure):
        partials = torch.empty((splits, C), dtype=torch.float32, device=x.device)
        k.col_amax_kernel[grid](x, partials, R, C, per, x.stride(0), x.stride(1), BR=br, BC=bc, **_OPTIONS)
    k.cast_cols_kernel[grid](
        x, partials, splits, s2, out, s2, inv2, R, C, per,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), s2.stride(1),
        HAS_SCALE=has_scale, MEASURE=measure, POW2=pow2, **fmt, BR=br, BC=bc, BP=_next_pow2(splits), **_OPTIONS,
    )  # fmt: skip


def _groups_grid(R: int, C: int, blk: int) -> tuple[int, int, int, tuple[int, int]]:
    """``(groups per row, the group's power-of-two width, groups per program, grid)`` of the
    1 x ``blk`` groups kernels (cast and dequantize) over ``R`` rows of ``C`` elements."""
    nb = -(-C // blk)
    b = _next_pow2(blk)
    g = max(1, _GROUP_ELEMENTS // b)
    return nb, b, g, (-(-R // _GROUP_ROWS), -(-nb // g))


def _launch_groups(
    k, blk: int, x: torch.Tensor, out: torch.Tensor, s2: torch.Tensor, inv2: torch.Tensor,
    has_scale: bool, e8m0: bool, floor: bool, spec: CastSpec, emax: int, fmt: dict,
) -> None:  # fmt: skip
    """The groups kernel on 2D views (any strides, transposed views included), or on a
    dense N-D input given as it is (``x``: not contiguous), with its data, scale and
    inverse (byte views where FP8 or e8m0) laid out in its memory order (see
    ``_allocate``): rows addressed through :func:`_rows_of`."""
    order = None if x.dim() == 2 else _memory_order(x)
    if x.dim() != 2 and (order is None or not all(t.permute(order).is_contiguous() for t in (out, s2, inv2))):
        raise ValueError("fused_cast: a dense N-D input needs its data and scales laid out in its memory order")
    rx, ro, rs = (_rows_of(t, order) for t in (x, out, s2))
    R, C = rx.R, rx.C
    nb, b, g, grid = _groups_grid(R, C, blk)
    if not (R and nb):
        return
    # The inverse has the scale's shape and strides: the scale's row offsets address both.
    k.cast_groups_kernel[grid](
        x, s2, out, s2, inv2, R, C, nb, blk, rx.nr, rx.outer, rx.inner, rx.col, ro.outer, ro.inner, ro.col,
        rs.outer, rs.inner, rs.col,
        HAS_SCALE=has_scale, E8M0=e8m0, FLOOR=floor, POW2=spec.power_of_2, EMAX=emax, **fmt,
        BR=_GROUP_ROWS, G=g, B=b, **_OPTIONS,
    )  # fmt: skip


def _given_scale_fits(hp: torch.Tensor, spec: CastSpec, scale: torch.Tensor) -> bool:
    if type(scale) is not torch.Tensor or scale.device != hp.device:
        return False
    if not spec.block:
        return scale.dim() == 0 and scale.dtype == torch.float32
    if scale.dim() > 2 and not scale.is_contiguous():
        return False
    if hp.dim() > 2 and not hp.is_contiguous():
        return False  # the kernels' N-D scales follow a non-contiguous input's memory order
    expected = _scale_shape(tuple(hp.shape), spec.block)
    return tuple(scale.shape) == expected and scale.dtype == spec.scale_dtype


# Tensors the kernels take as they are (a weight is an nn.Parameter); subclasses with
# dispatch of their own (DTensor, fake tensors, the package's wrappers) take the reference.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def maybe_cast(
    hp: torch.Tensor, spec: CastSpec, scale: torch.Tensor | None = None, *, layouts: int = NATURAL
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None] | None:
    """``(data, column-major copy or None, scale, inverse scale or None)`` by the fused
    kernels, or None where the reference must run (see the module docstring for when).
    ``layouts``: :data:`NATURAL`, :data:`BOTH` (2D tensorwise or tile casts) or
    :data:`COLUMN_MAJOR` (2D: ``data`` itself column-major). The scale's inverse (the
    factor the GEMMs read) comes from the same kernel."""
    if torch.compiler.is_compiling() or type(hp) not in _PLAIN or not enabled():
        return None
    if hp.requires_grad and torch.is_grad_enabled():
        return None
    how = plan(hp, spec)
    if how is None or (layouts != NATURAL and hp.dim() != 2):
        return None
    if layouts == BOTH and how.kind not in ("tensor", "tiles"):
        return None
    if scale is not None and not _given_scale_fits(hp, spec, scale):
        return None
    data, second, out_scale, inverse = torch.ops.f8tensor.fused_cast(
        hp, scale, spec.float8_dtype, list(spec.block), spec.scale_dtype == E8M0, spec.scale_mode,
        spec.power_of_2, layouts,
    )  # fmt: skip
    return data, second if layouts == BOTH else None, scale if scale is not None else out_scale, inverse
