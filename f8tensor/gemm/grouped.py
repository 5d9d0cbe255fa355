"""Grouped and batched FP8 products (MoE): ``torch._scaled_grouped_mm`` and its CPU reference.

Two front doors for Float8Tensor operands, through the one operand preparation
(``operands.prepare(..., GROUPED)``: e4m3fn operands, fp32 scales constant along K):

- :func:`grouped_mm`: ``a (M, K) @ b[g] (K, N)`` for the rows of each group (tokens sorted
  by expert, ``offs`` their cumulative counts): an MoE layer's forward and input gradient;
- :func:`batched_mm`: ``a (B, M, K) @ b (B, K, N)`` in one call (``bmm``).

And the raw kernel entry, :func:`scaled_grouped_mm`, with the signature of the kernel it
stands for (``(a, b, scale_a, scale_b, offs, out_dtype)``, scales as dequantization
factors; its three forms are described at :class:`~f8tensor.gemm.rules.GroupedMMRule`):
the rules (:data:`~f8tensor.gemm.rules.GROUPED_RULES`) are checked on every call, on every
device, and an illegal call is refused up front (``ValueError``), so a model tested on CPU
makes only calls a GPU accepts. On CUDA devices that have the kernel the call goes to
``torch._scaled_grouped_mm``; everywhere else to ``f8tensor::scaled_grouped_mm_reference``,
an exact emulation (products of the FP8 values accumulated in fp32, then the two
dequantization factors, then one rounding to ``out_dtype``: the kernel's epilogue order).
It is a custom op, opaque to torch.compile, so token counts that change every step
recompile nothing. On sm89 and sm100 there is no FP8 grouped kernel in torch 2.11-2.14
(``GROUPED_RULES`` has an sm90 row only): the reference op runs there.

Entry checks (:func:`validate_grouped_mm_args`, :func:`check_grouped_dims`): the dims every
GEMM of the product and its gradients contracts over, checked when the product is called
(so N fails in forward, not in backward), and ``float8_grouped_mm``'s arguments, as
``Float8Linear`` checks its own. Offsets values: eager on a CPU tensor; on CUDA and under
torch.compile through ``torch._assert_async`` (a device-side check: no host sync, no graph
break; a bad value stops the device, as the kernel's own device asserts would).
"""

from __future__ import annotations

from typing import cast

import torch

from f8tensor import compat
from f8tensor.gemm.check import check_grouped_rules
from f8tensor.gemm.operands import GROUPED, col_major, inverse_scale, kernel_scale, prepare, row_major
from f8tensor.gemm.rules import ALIGN, GROUPED_RULES, CudaBuild, grouped_rule_for
from f8tensor.quant.config import Float8LinearConfig
from f8tensor.quant.formats import FLOAT8_DTYPES

__all__ = [
    "MAX_GROUPS",
    "batched_mm",
    "check_grouped_dims",
    "grouped_kernel_available",
    "grouped_mm",
    "scaled_grouped_mm",
    "validate_grouped_mm_args",
]

#: The most groups (or batch entries) one grouped-kernel call takes (every row's limit).
MAX_GROUPS = min(rule.max_groups for rule in GROUPED_RULES)
_HP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

#: The one output dtype of the grouped kernel; results are cast to the caller's dtype.
KERNEL_OUT = torch.bfloat16


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a (M, K) @ b[g] (K, N)`` for the rows of group ``g`` (``offs``: cumulative row
    counts; groups may be empty or of any size), in FP8; at least one operand a Float8Tensor
    (a plain one is cast like the other). Returned in ``out_dtype``."""
    a8, b8 = prepare(a, b, GROUPED, a_k=1, b_k=1)
    (m, k), (g, _, n) = a8.shape, b8.shape
    check_grouped_dims(k, n, "grouped product")
    a_inv = kernel_scale(inverse_scale(a8), (m, 1), (m,))
    b_inv = kernel_scale(inverse_scale(b8), (g, 1, n), (g, n))
    out = scaled_grouped_mm(row_major(a8._data), col_major(b8._data), a_inv, b_inv, offs.to(torch.int32), KERNEL_OUT)
    return out.to(out_dtype)


def batched_mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a (B, M, K) @ b (B, K, N)`` in one grouped-kernel call, in FP8: scales per batch
    row / column. Returned in ``out_dtype``. More than :data:`MAX_GROUPS` batch entries (the
    per-token route of an MoE layer reaches that) run as several calls of at most that many."""
    a8, b8 = prepare(a, b, GROUPED, a_k=2, b_k=1)
    (bsz, m, _), n = a8.shape, b8.shape[2]
    a_inv = kernel_scale(inverse_scale(a8), (bsz, m, 1), (bsz, m))
    b_inv = kernel_scale(inverse_scale(b8), (bsz, 1, n), (bsz, n))
    a_data, b_data = row_major(a8._data), col_major(b8._data)
    if bsz <= MAX_GROUPS:
        out = scaled_grouped_mm(a_data, b_data, a_inv, b_inv, None, KERNEL_OUT)
    else:
        out = torch.cat([
            scaled_grouped_mm(a_data[i:i + MAX_GROUPS], b_data[i:i + MAX_GROUPS], a_inv[i:i + MAX_GROUPS],
                              b_inv[i:i + MAX_GROUPS], None, KERNEL_OUT)
            for i in range(0, bsz, MAX_GROUPS)
        ])
    return out.to(out_dtype)


def check_grouped_dims(k: int, n: int, what: str) -> None:
    """Refuse a grouped product whose contraction dim ``k`` or output dim ``n`` is not a
    multiple of 16: the kernel checks both on the host (``mat_a.size(-1)``, ``mat_b``'s
    dims), and the input gradient contracts over ``n``. Called at the entry of a product, so
    a bad N fails in forward, not in backward. ``what`` names the product in the message.

    Raises:
        ValueError: ``k`` or ``n`` is not a multiple of 16 (each wrong dim named).

    Example:
        >>> from f8tensor.gemm.grouped import check_grouped_dims
        >>> check_grouped_dims(64, 32, "expert GEMM")  # fine: returns None
        >>> check_grouped_dims(64, 40, "expert GEMM")
        Traceback (most recent call last):
            ...
        ValueError: FP8 expert GEMM: N (output)=40; each must be a multiple of 16 ...
    """
    wrong = [f"{name}={size}" for name, size in (("K (contraction)", k), ("N (output)", n)) if size % ALIGN]
    if wrong:
        raise ValueError(
            f"FP8 {what}: {' and '.join(wrong)}; each must be a multiple of {ALIGN} (torch._scaled_grouped_mm's "
            f"rule; the input gradient contracts over N)"
        )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def validate_grouped_mm_args(x: torch.Tensor, w: torch.Tensor, offs: object, config: object) -> torch.Tensor:
    """The checks ``Float8Linear`` makes, for ``x (M, K) @ w[g] (K, N)`` grouped by ``offs``:
    shapes, high-precision float dtypes (int, bool, FP8, complex refused by name), K and N
    multiples of 16, ``config`` a :class:`Float8LinearConfig`, and ``offs``: an integer
    tensor or a list/tuple of ints, 1-D, one entry per group, non-decreasing, in [0, M].
    Returns ``offs`` as an int32 tensor on ``x``'s device.

    Offsets values: on a CPU tensor outside torch.compile they are checked here (a clear
    ``ValueError``); on a CUDA tensor, and while compiling, by ``torch._assert_async`` (no host
    sync, no graph break: a bad value stops the device with this message).

    Raises:
        TypeError: ``config`` is not a :class:`~f8tensor.Float8LinearConfig`; ``x`` or ``w``
            is not a tensor, or not bf16/fp16/fp32 (the wrong kind named); ``offs`` is
            neither an integer tensor nor a list/tuple of ints.
        ValueError: shapes other than ``x (M, K)``, ``w (G, K, N)``, ``offs (G,)``; ``offs``
            on another device than ``x``; K or N not a multiple of 16; ``offs`` decreasing
            or outside [0, M] (a CPU tensor; see above for CUDA).

    Example:
        >>> from f8tensor import Float8LinearConfig
        >>> from f8tensor.gemm.grouped import validate_grouped_mm_args
        >>> x, w = torch.randn(48, 32), torch.randn(3, 32, 64)
        >>> validate_grouped_mm_args(x, w, [16, 16, 48], Float8LinearConfig())
        tensor([16, 16, 48], dtype=torch.int32)
        >>> validate_grouped_mm_args(x, w, [16, 8, 48], Float8LinearConfig())
        Traceback (most recent call last):
            ...
        ValueError: float8_grouped_mm: offs must be non-decreasing cumulative counts in [0, M=48]; got [16, 8, 48]
    """
    if not isinstance(config, Float8LinearConfig):
        raise TypeError(f"float8_grouped_mm: config must be a Float8LinearConfig; got {type(config).__name__}")
    for name, t in (("x", x), ("w", w)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"float8_grouped_mm: {name} must be a tensor; got {type(t).__name__}")
        if t.dtype not in _HP_DTYPES:
            kind = (
                "an FP8" if t.dtype in FLOAT8_DTYPES else "a complex" if t.dtype.is_complex
                else "a bool" if t.dtype == torch.bool else "an integer" if not t.dtype.is_floating_point else "a"
            )
            raise TypeError(
                f"float8_grouped_mm: {name} is {kind} tensor ({_dtype_name(t.dtype)}); it must be bfloat16, "
                f"float16 or float32"
            )
    if isinstance(offs, (list, tuple)):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in offs):
            raise TypeError(f"float8_grouped_mm: offs as a list must hold ints; got {offs!r}")
        offs = torch.tensor(offs, dtype=torch.int32, device=x.device)
    if not isinstance(offs, torch.Tensor):
        raise TypeError(f"float8_grouped_mm: offs must be an int tensor or a list of ints; got {type(offs).__name__}")
    if offs.dtype == torch.bool or offs.dtype.is_floating_point or offs.dtype.is_complex:
        raise TypeError(f"float8_grouped_mm: offs must be an integer tensor; got {_dtype_name(offs.dtype)}")
    if x.dim() != 2 or w.dim() != 3 or offs.dim() != 1 or offs.shape[0] != w.shape[0] or x.shape[1] != w.shape[1]:
        raise ValueError(
            f"float8_grouped_mm: expected x (M, K), w (G, K, N), offs (G,); got {tuple(x.shape)}, "
            f"{tuple(w.shape)}, {tuple(offs.shape)}"
        )
    if offs.device != x.device:
        raise ValueError(f"float8_grouped_mm: offs is on {offs.device}, x on {x.device}")
    check_grouped_dims(x.shape[1], w.shape[2], "float8_grouped_mm")
    m = x.shape[0]
    if offs.numel():
        o = offs.to(torch.int64)
        # Values on the host: a plain CPU tensor outside any tracing (a FakeTensor, or the
        # FunctionalTensor of a custom op's trace, holds none).
        if offs.device.type == "cpu" and type(offs) is torch.Tensor and not torch.compiler.is_compiling():
            if bool((o[1:] < o[:-1]).any()) or int(o[0]) < 0 or int(o[-1]) > m:
                raise ValueError(
                    f"float8_grouped_mm: offs must be non-decreasing cumulative counts in [0, M={m}]; got {o.tolist()}"
                )
        else:
            ok = (o[1:] >= o[:-1]).all() & (o[0] >= 0) & (o[-1] <= m)
            compat.assert_async(ok, "float8_grouped_mm: offs must be non-decreasing cumulative counts in [0, M]")
    return offs.to(torch.int32)


def grouped_kernel_available(device: torch.device) -> bool:
    """Whether ``torch._scaled_grouped_mm`` runs on ``device`` (a build a row of
    :data:`~f8tensor.gemm.rules.GROUPED_RULES` covers: CUDA sm90)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    cuda = cast("tuple[int, int]", tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2]))
    here = CudaBuild(compat.TORCH_VERSION, cuda, torch.cuda.get_device_capability(device))
    return grouped_rule_for(here) is not None


def scaled_grouped_mm(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
    offs: torch.Tensor | None = None, out_dtype: torch.dtype = KERNEL_OUT,
) -> torch.Tensor:
    """The grouped FP8 product (see the module docstring), rules checked, routed by device."""
    check_grouped_rules(a, b, scale_a, scale_b, offs, out_dtype)
    if grouped_kernel_available(a.device):
        out = compat.scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype)
        if b.dim() == 2:
            assert offs is not None  # check_grouped_rules: the 2D-by-2D form takes offs
            # The weight-gradient form's output is allocated with empty_strided: a group with
            # no rows is not provably written by the kernel. Zero it (the reference does too).
            sizes = torch.diff(offs, prepend=offs.new_zeros(1))
            out = torch.where((sizes > 0)[:, None, None], out, 0.0)
        return out
    return torch.ops.f8tensor.scaled_grouped_mm_reference(a, b, scale_a, scale_b, offs, out_dtype)


@torch.library.custom_op("f8tensor::scaled_grouped_mm_reference", mutates_args=())
def _reference(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offs: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    # Deliberate upcast: every FP8 value is exact in fp32, and so is every product of two;
    # the fp32 sums are what the tensor cores accumulate.
    af, bf = a.float(), b.float()
    if offs is None:
        acc = torch.bmm(af, bf) * scale_a[:, :, None] * scale_b[:, None, :]
        return acc.to(out_dtype)
    g = offs.shape[0]
    if b.dim() == 3:
        acc = _grouped(af, bf, offs)  # (M, N)
        rows = torch.arange(a.shape[0], device=a.device)
        gid = torch.searchsorted(offs, rows.to(offs.dtype), right=True)
        inside = gid < g  # rows past offs[-1] belong to no group: the kernel leaves them, we zero them
        sb = scale_b[gid.clamp(max=g - 1)]
        acc = torch.where(inside[:, None], acc * scale_a[:, None] * sb, 0.0)
        return acc.to(out_dtype)
    acc = _grouped(af, bf, offs)  # (G, K, N)
    acc = acc * scale_a.view(g, -1, 1) * scale_b.view(g, 1, -1)
    return acc.to(out_dtype)


def _grouped(af: torch.Tensor, bf: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """fp32 grouped product: torch._grouped_mm where the device has an fp32 kernel, else a loop."""
    if af.device.type == "cpu":
        out = compat.grouped_mm(af, bf, offs)
        if bf.dim() == 2:
            # Groups with no rows contribute nothing: make that explicit (never stale memory).
            sizes = torch.diff(offs, prepend=offs.new_zeros(1))
            out = torch.where((sizes > 0)[:, None, None], out, 0.0)
        return out
    start = 0
    if bf.dim() == 3:
        out = af.new_zeros(af.shape[0], bf.shape[2])
        for i, end in enumerate(offs.tolist()):
            out[start:end] = af[start:end] @ bf[i]
            start = end
        return out
    out = af.new_zeros(offs.shape[0], af.shape[0], bf.shape[1])
    for i, end in enumerate(offs.tolist()):
        out[i] = af[:, start:end] @ bf[start:end]
        start = end
    return out


@_reference.register_fake
def _reference_fake(a, b, scale_a, scale_b, offs, out_dtype):
    if offs is None:
        return a.new_empty(a.shape[0], a.shape[1], b.shape[2], dtype=out_dtype)
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[2], dtype=out_dtype)
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1], dtype=out_dtype)
