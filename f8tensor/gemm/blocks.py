"""Block-scaled FP8 products (1x128, 128x128, MX 1x32) and FP4: the kernels and the reference.

On CPU, and on CUDA with ``GemmConfig(emulate=True)``, a product is the reference:
operands dequantized per block in fp32, an fp32 matmul and bias, one cast. On CUDA
otherwise it is ``torch.nn.functional.scaled_mm`` with the scale layouts of
:data:`~f8tensor.gemm.rules.BLOCK_SCALED_MM_RULES`, or a clear error where no supported
build has the kernel. Both paths share one size decision (:func:`_padding`) and build the
kernel's arguments with the same code (:func:`_kernel_args`), so the CPU suite checks the
exact (padded) call the CUDA branch sends.
"""

from __future__ import annotations

import warnings

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from f8tensor import compat
from f8tensor.gemm.check import block_scaled_mm, check_active, record_block_reference, record_block_refusal
from f8tensor.gemm.operands import col_major, inverse_scale, prepare_fp4, row_major
from f8tensor.gemm.rules import BLOCK_SCALED_MM_RULES, BlockScaledMMRule, block_rule_for, build_of, fp4_rule_for
from f8tensor.quant.formats import E8M0
from f8tensor.quant.specs import GemmConfig
from f8tensor.tensor.float8 import Float8Tensor, dequantize, dequantize_fields
from f8tensor.tensor.fp4 import Float4Tensor, is_float4

__all__ = ["fp4_path", "fp4_product", "product"]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


#: The kinds of product already said to be emulated (one warning per process and kind).
_WARNED_EMULATED: set[str] = set()


def _warn_emulated(kind: str, device: torch.device) -> None:
    """Warn once per process and ``kind`` that a product with no kernel on ``device`` runs emulated (eager only)."""
    if torch.compiler.is_compiling() or kind in _WARNED_EMULATED:
        return
    _WARNED_EMULATED.add(kind)
    warnings.warn(
        f"f8tensor: {kind} products have no {device.type} kernel; they run emulated (dequantized per "
        "block in fp32, an fp32 matmul). Pass emulate=True (Float8LinearConfig or GemmConfig) to ask "
        "for that and silence this warning.",
        UserWarning,
        stacklevel=2,
    )


def _known_zero(n: int | torch.SymInt) -> bool:
    """Whether size ``n`` is 0 without a guard (a symbolic size is padded by its amount, maybe 0)."""
    return statically_known_true(n == 0)


def product(
    a8: Float8Tensor, b8: Float8Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype, gemm: GemmConfig
) -> torch.Tensor:
    """``a8 (M, K) @ b8 (K, N)`` (+ ``bias``) where at least one operand is block-scaled."""
    scale_dtype = a8._scale.dtype if a8._scale.dtype == b8._scale.dtype else None
    rule = block_rule_for(a8._block, b8._block, scale_dtype, None) if scale_dtype is not None else None
    on_cuda = a8._data.device.type == "cuda"
    if on_cuda and not gemm.emulate:
        return _kernel_mm(rule, a8, b8, bias, out_dtype, gemm)
    if not gemm.emulate:
        _warn_emulated("MXFP8 (e8m0 block scales)" if scale_dtype == E8M0 else "block-scaled FP8", a8._data.device)
    if rule is not None and _takes_operands(rule, a8, b8) and not gemm.emulate:
        pads = _padding(rule, a8, b8, gemm, traced=False)
        # The reference reads the same padded operand the checked call uses.
        a8_kernel, pads = _outer_rows_padded(rule, a8, pads)
        if check_active():
            fast = gemm.use_fast_accum and rule.fast_accum
            record_block_reference(rule.name, *_kernel_args(rule, a8_kernel, b8, pads), fast)
        if a8_kernel is not a8:
            return _reference_mm(a8_kernel, b8, bias, out_dtype, rows=a8.shape[0])
    elif not gemm.emulate and check_active():
        # No kernel takes these operands (the CUDA branch raises): record it as refused.
        record_block_refusal(_refusal(rule, a8, b8))
    return _reference_mm(a8, b8, bias, out_dtype)


def _refusal(rule: BlockScaledMMRule | None, a8: Float8Tensor, b8: Float8Tensor) -> str:
    """Why no block-scaled kernel takes ``a8 @ b8``, in words (the CUDA branch's error)."""
    if rule is None:
        allowed = "; ".join(
            f"{r.name}: a block {r.block_a}, b block {r.block_b}, {_name(r.scale_dtype)} scales"
            for r in BLOCK_SCALED_MM_RULES
        )
        return (
            f"no CUDA kernel multiplies a block-{a8._block} ({_name(a8._scale.dtype)} scales) by a "
            f"block-{b8._block} ({_name(b8._scale.dtype)} scales) operand. Kernels: {allowed}. "
            f"Use GemmConfig(emulate=True) / Float8LinearConfig(emulate=True) for the reference path."
        )
    names = ", ".join(sorted(_name(d) for d in rule.operand_dtypes))
    return f"the {rule.name} kernel takes {names} operands; got {_name(a8._data.dtype)} x {_name(b8._data.dtype)}"


def _padding(
    rule: BlockScaledMMRule, a8: Float8Tensor, b8: Float8Tensor, gemm: GemmConfig, *, traced: bool
) -> tuple[int, int, int]:
    """Zeros to add to (M, K, N) for ``rule``'s kernel.

    M is always padded to the row's ``align_m`` (zero rows change no other row); K and N only
    with ``gemm.pad_inner_dim``, else a ``ValueError`` names each dim and its multiple.
    ``traced``: a CUDA call traced by torch.compile (the meta's own multiples may apply).
    """
    (m, k), n = a8.shape, b8.shape[1]
    sizes = {"M": m, "K": k, "N": n}
    multiples = {"M": rule.align_m, "K": rule.align_k, "N": rule.align_n}
    if traced and _meta_floors_block_scales():
        for dim, multiple in rule.compile_align:
            multiples[dim] = max(multiples[dim], multiple)
    pads = {dim: (-sizes[dim]) % multiples[dim] for dim in sizes}
    # Under dynamic shapes reading a pad guards on it (a graph per token count): only a
    # refusal reads them.
    if not gemm.pad_inner_dim:
        refusable = [dim for dim in sizes if dim != "M" or multiples["M"] != rule.align_m]
        wrong = [dim for dim in refusable if pads[dim]]
        if wrong:
            needs = ", ".join(f"{dim}={sizes[dim]} (a multiple of {multiples[dim]})" for dim in wrong)
            why = (
                "" if not traced else " under torch.compile on this torch (its meta registration floor-divides by 128)"
            )
            raise ValueError(
                f"FP8 block-scaled matmul ({rule.name} kernel) of ({m}x{k}) @ ({k}x{n}) needs {needs}{why}. "
                f"Use such shapes, or ask for zero padding with GemmConfig(pad_inner_dim=True) / "
                f"Float8LinearConfig(pad_inner_dim=True)."
            )
    return pads["M"], pads["K"], pads["N"]


# Traced, a constant (a flag read is a guard per product).
@torch.compiler.assume_constant_result
def _meta_floors_block_scales() -> bool:
    return compat.META_FLOORS_BLOCK_SCALES


def _outer_rows_padded(
    rule: BlockScaledMMRule, a8: Float8Tensor, pads: tuple[int, int, int]
) -> tuple[Float8Tensor, tuple[int, int, int]]:
    """``a8`` grown by the M padding of a 1x128 a (zero bytes, scale 1), and the padding left."""
    pm = pads[0]
    if rule.block_a[0] != 1 or _known_zero(pm):
        return a8, pads
    rows, cols = a8._scale.shape
    padded = a8._replace(data=_pad_bytes(a8._data, pm, 0), scale=_pad_scale(a8._scale, rows + pm, cols))
    inv = None if torch.compiler.is_compiling() else a8._inv_scale
    if inv is not None:  # the cast's own 1 / scale, grown alike
        padded._inv_scale = _pad_scale(inv, rows + pm, cols)
    return padded, (0, pads[1], pads[2])


def _reference_mm(
    a8: Float8Tensor, b8: Float8Tensor, bias, out_dtype: torch.dtype, *, rows: int | None = None
) -> torch.Tensor:
    """The reference: dequantize per block in fp32, fp32 matmul, fp32 bias, one cast.

    Deliberate fp32: what the block-scaled kernels accumulate in. ``rows``: multiply only
    ``a8``'s first rows (``a8`` was padded): a CPU BLAS may order sums by the row count, so
    leaving the padding out keeps the unpadded product's bits.
    """
    # One op, as a GPU's product is one kernel: traced, the dequantized fp32 operands would
    # otherwise be kernels and bytes of the graph, rounded as inductor fuses them.
    return _REFERENCE_OP(a8._data, a8._scale, a8._block, b8._data, b8._scale, b8._block, bias, out_dtype, rows)


def _reference(a, a_scale, a_block, b, b_scale, b_block, bias, out_dtype: torch.dtype, rows) -> torch.Tensor:
    """:func:`_reference_mm` on the operands' fields (data, scale, block)."""
    a = dequantize_fields(a, a_scale, tuple(a_block), torch.float32)
    if rows is not None:
        a = a[:rows]
    acc = a @ dequantize_fields(b, b_scale, tuple(b_block), torch.float32)
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc.to(out_dtype)


def _reference_fake(a, a_scale, a_block, b, b_scale, b_block, bias, out_dtype: torch.dtype, rows) -> torch.Tensor:
    return a.new_empty((a.shape[0] if rows is None else rows, b.shape[1]), dtype=out_dtype)


# A plain kernel for every device, not torch.library.custom_op (one dispatcher hop; FP8
# operands carry no grad).
_LIB = torch.library.Library("f8tensor", "FRAGMENT")  # noqa: TOR901 (kept for the process's lifetime)
_LIB.define(
    "block_scaled_mm_reference(Tensor a, Tensor a_scale, int[] a_block, Tensor b, Tensor b_scale, int[] b_block, "
    "Tensor? bias, ScalarType out_dtype, SymInt? rows) -> Tensor",
    # The operands' strides as eager has them: a CPU BLAS orders its sums by the layout.
    tags=(torch.Tag.needs_exact_strides,),
)
_LIB.impl("block_scaled_mm_reference", _reference, "CompositeExplicitAutograd")
torch.library.register_fake("f8tensor::block_scaled_mm_reference", _reference_fake, lib=_LIB)
_REFERENCE_OP = torch.ops.f8tensor.block_scaled_mm_reference.default


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _swizzle_32_4_4(scale: torch.Tensor) -> torch.Tensor:
    """A one-byte (R, C) scale in cuBLAS's tiled block-scale layout.

    Padded to 128 x 4 tiles in row-major order; inside a tile, (r, c) lands at
    ``(r % 32) * 16 + (r // 32) * 4 + c``.
    """
    rows, cols = scale.shape
    pr, pc = _round_up(rows, 128), _round_up(cols, 4)
    raw = scale.view(torch.uint8)
    if not (_known_zero(pr - rows) and _known_zero(pc - cols)):
        # Pad byte: 127 is 2**0 in e8m0; in e4m3fn 127 is NaN, so 0 there.
        pad = 127 if scale.dtype == torch.float8_e8m0fnu else 0
        raw = torch.constant_pad_nd(raw, (0, pc - cols, 0, pr - rows), pad)
    tiles = raw.reshape(pr // 128, 4, 32, pc // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().reshape(-1).view(scale.dtype)


def _pad_scale(inv: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A 2-D inverse scale grown to (rows, cols) with 1 (the padding's data is zero)."""
    pr, pc = rows - inv.shape[0], cols - inv.shape[1]
    if _known_zero(pr) and _known_zero(pc):
        return inv
    if inv.dtype == torch.float32:
        return torch.constant_pad_nd(inv, (0, pc, 0, pr), 1.0)
    # e8m0 has no fill kernel: through its bytes, 127 is 2**0.
    return torch.constant_pad_nd(inv.view(torch.uint8), (0, pc, 0, pr), 127).view(inv.dtype)


def _block_kernel_scales(rule: BlockScaledMMRule, a8: Float8Tensor, b8: Float8Tensor, pads=(0, 0, 0)):
    """The two scale tensors in ``rule``'s layouts, for operands padded by ``pads`` (M, K, N)."""
    (m, k), n = a8.shape, b8.shape[1]
    m, k, n = m + pads[0], k + pads[1], n + pads[2]
    (ba_m, ba_k), (bb_k, bb_n) = rule.block_a, rule.block_b
    compiling = torch.compiler.is_compiling()  # a default read is a guard
    a_inv = _pad_scale(inverse_scale(a8), -(-m // ba_m), -(-k // ba_k))
    b_inv = _pad_scale(inverse_scale(b8), -(-k // bb_k), -(-n // bb_n))
    if rule.recipe_a == "BlockWise1x32":
        # a: (M, K/32) as is; b: its (K/32, N) scales read per column of b, i.e. (N, K/32).
        return _swizzle_32_4_4(a_inv), _swizzle_32_4_4(b_inv.t().contiguous())
    if rule.block_a == (1, 128):
        sa = col_major(a_inv, compiling)  # (M, K/128), strides (1, M)
    else:  # 128x128 a: (M/128, K/128) -> (round_up(K/128, 4), M/128), column-major
        t = a_inv.t()
        sa = col_major(torch.constant_pad_nd(t, (0, 0, 0, _round_up(t.shape[0], 4) - t.shape[0])), compiling)
    if rule.block_b == (128, 1):
        sb = b_inv.contiguous().t()  # (K/128, N) row-major, read as (N, K/128) with strides (1, N)
    else:  # 128x128 b: (K/128, N/128) -> (round_up(K/128, 4), N/128), column-major
        pad = (0, 0, 0, _round_up(b_inv.shape[0], 4) - b_inv.shape[0])
        sb = col_major(torch.constant_pad_nd(b_inv, pad), compiling)
    return sa, sb


def _takes_operands(rule: BlockScaledMMRule, a8: Float8Tensor, b8: Float8Tensor) -> bool:
    return _takes_dtypes(rule.name, a8._data.dtype, b8._data.dtype)


#: The rows of BLOCK_SCALED_MM_RULES by name.
_RULES_BY_NAME = {r.name: r for r in BLOCK_SCALED_MM_RULES}


# A constant to torch.compile: dynamo cannot guard a set test on a constant row.
@torch.compiler.assume_constant_result
def _takes_dtypes(rule_name: str, a: torch.dtype, b: torch.dtype) -> bool:
    dtypes = _RULES_BY_NAME[rule_name].operand_dtypes
    return a in dtypes and b in dtypes


# Constants to torch.compile: dynamo cannot guard a set test on a constant row (nor format one).
@torch.compiler.assume_constant_result
def _runs_here(rule_name: str, device: torch.device) -> bool:
    return build_of(device) in _RULES_BY_NAME[rule_name].builds


@torch.compiler.disable
def _no_kernel_here(rule_name: str, device: torch.device) -> str:
    builds, (major, minor) = _RULES_BY_NAME[rule_name].builds, build_of(device).sm
    return (
        f"the {rule_name} kernel needs {builds} and torch.nn.functional.scaled_mm; this is "
        f"sm{major}{minor} with CUDA {torch.version.cuda}. Use emulate=True for the reference path."
    )


def _kernel_args(rule: BlockScaledMMRule, a8: Float8Tensor, b8: Float8Tensor, pads=(0, 0, 0)):
    """The operands (A row-major, B column-major, padded by ``pads``) and scales of ``rule``'s kernel."""
    pm, pk, pn = pads
    compiling = torch.compiler.is_compiling()
    a_data, b_data = row_major(a8._data, compiling), col_major(b8._data, compiling)
    if not (_known_zero(pm) and _known_zero(pk)):
        a_data = _pad_bytes(a_data, pm, pk)
    if not (_known_zero(pk) and _known_zero(pn)):
        b_data = _pad_bytes(b_data.t(), pn, pk).t()
    return (a_data, b_data, *_block_kernel_scales(rule, a8, b8, pads))


def _pad_bytes(x: torch.Tensor, pad_rows: int, pad_cols: int) -> torch.Tensor:
    # Through uint8: constant_pad_nd has no FP8 kernels; the zero byte is +0.0 in e4m3fn.
    raw = torch.constant_pad_nd(x.contiguous().view(torch.uint8), (0, pad_cols, 0, pad_rows))
    return raw.view(x.dtype)


def _kernel_mm(
    rule: BlockScaledMMRule | None, a8: Float8Tensor, b8: Float8Tensor, bias, out_dtype: torch.dtype, gemm: GemmConfig
) -> torch.Tensor:
    """``torch.nn.functional.scaled_mm`` with block scales, or a clear error."""
    if rule is None:
        raise NotImplementedError(_refusal(rule, a8, b8))
    if not _runs_here(rule.name, a8._data.device):
        raise NotImplementedError(_no_kernel_here(rule.name, a8._data.device))
    if not _takes_operands(rule, a8, b8):
        raise ValueError(_refusal(rule, a8, b8))
    pads = _padding(rule, a8, b8, gemm, traced=torch.compiler.is_compiling())
    a8_kernel, pads = _outer_rows_padded(rule, a8, pads)
    a_data, b_data, sa, sb = _kernel_args(rule, a8_kernel, b8, pads)
    swz = "SWIZZLE_32_4_4" if rule.recipe_a == "BlockWise1x32" else "NO_SWIZZLE"
    out = block_scaled_mm(
        a_data,
        b_data,
        sa,
        rule.recipe_a,
        sb,
        rule.recipe_b,
        swizzle_a=swz,
        swizzle_b=swz,
        bias=None,
        output_dtype=out_dtype,
        contraction_dim=(),
        use_fast_accum=gemm.use_fast_accum and rule.fast_accum,
    )
    if not (_known_zero(pads[0]) and _known_zero(pads[2])) or a8_kernel is not a8:
        out = out[: a8.shape[0], : b8.shape[1]]
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out


# FP4 (NVFP4, MXFP4)


def fp4_product(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype, gemm: GemmConfig
) -> torch.Tensor:
    """``a (M, K) @ b (K, N)`` (+ ``bias``) where at least one operand is a Float4Tensor.

    The reference on CPU or with ``emulate``; otherwise the sm100 kernel of
    :data:`~f8tensor.gemm.rules.FP4_SCALED_MM_RULES` (unverified).
    """
    kernel = a.device.type == "cuda" and not gemm.emulate
    if not (kernel or gemm.emulate):
        kinds = sorted({x._kind.upper() for x in (a, b) if is_float4(x)})
        _warn_emulated("/".join(kinds) or "FP4", a.device)
    a4, b4 = prepare_fp4(a, b, a_k=1, b_k=0, kernel=kernel)
    if kernel:
        # prepare_fp4 with kernel=True returns two Float4Tensors (it raises otherwise).
        assert is_float4(a4) and is_float4(b4)
        return _fp4_kernel_mm(a4, b4, bias, out_dtype)
    # Deliberate fp32 throughout, as in _reference_mm.
    acc = _dequantized(a4) @ _dequantized(b4)
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc.to(out_dtype)


def fp4_path(kind_a: str | None, kind_b: str | None, device: torch.device | str, emulate: bool) -> str:
    """The path :func:`fp4_product` takes for these FP4 kinds (None: FP8 or plain), in words."""
    device = torch.device(device)
    if device.type != "cuda" or emulate:
        why = "emulate=True" if device.type == "cuda" else f"no FP4 kernel on {device.type}"
        return f"reference (emulated: dequantized per block, fp32 matmul; {why})"
    if kind_a is None or kind_a != kind_b:
        return (
            f"none: no kernel multiplies {kind_a or 'FP8/plain'} x {kind_b or 'FP8/plain'}; the first product "
            "raises (emulate=True runs the reference)"
        )
    rule = fp4_rule_for(kind_a)
    build = build_of(device)
    if build not in rule.builds:
        major, minor = build.sm
        return (
            f"none: the {rule.name} kernel needs {rule.builds}, this is sm{major}{minor}; the first product raises "
            "(emulate=True runs the reference)"
        )
    return f"sm100 F.scaled_mm, {rule.name} (unverified)"


def _dequantized(x: Float4Tensor | Float8Tensor) -> torch.Tensor:
    return x.dequantize(torch.float32) if is_float4(x) else dequantize(x, torch.float32)


def _fp4_kernel_args(a4: Float4Tensor, b4: Float4Tensor):
    """The FP4 kernel's operands and scale lists (NVFP4's global scales beside the block scales)."""
    sa, sb = _swizzle_32_4_4(a4._scale.contiguous()), _swizzle_32_4_4(b4._scale.t().contiguous())
    compiling = torch.compiler.is_compiling()
    a_data, b_data = row_major(a4._data, compiling), col_major(b4._data, compiling)
    if a4._kind == "nvfp4":
        return a_data, b_data, [sa, a4._global_scale.reshape(1)], [sb, b4._global_scale.reshape(1)]
    return a_data, b_data, sa, sb


def _fp4_kernel_mm(a4: Float4Tensor, b4: Float4Tensor, bias, out_dtype: torch.dtype) -> torch.Tensor:
    rule = fp4_rule_for(a4._kind)
    if not _runs_here(rule.name, a4.device):
        raise NotImplementedError(_no_kernel_here(rule.name, a4.device))
    a_data, b_data, sa, sb = _fp4_kernel_args(a4, b4)
    recipe: str | list[str]
    swz: str | list[str]
    if a4._kind == "nvfp4":
        recipe, swz = ["BlockWise1x16", "TensorWise"], ["SWIZZLE_32_4_4", "NO_SWIZZLE"]
    else:
        recipe, swz = "BlockWise1x32", "SWIZZLE_32_4_4"
    # MXFP4's kernel writes bf16 only; NVFP4's output dtype other than bf16 is unverified.
    out = block_scaled_mm(
        a_data,
        b_data,
        sa,
        recipe,
        sb,
        recipe,
        swizzle_a=swz,
        swizzle_b=swz,
        bias=None,
        output_dtype=torch.bfloat16,
        contraction_dim=(),
        use_fast_accum=False,
    ).to(out_dtype)
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out
