"""Grouped and batched FP8 products (MoE): ``torch._scaled_grouped_mm`` and its CPU reference.

:func:`grouped_mm` (``a (M, K) @ b[g] (K, N)`` per group of rows) and :func:`batched_mm`
(``bmm``) prepare Float8Tensor operands (``operands.prepare(..., GROUPED)``) and call
:func:`scaled_grouped_mm`. That checks :data:`~f8tensor.gemm.rules.GROUPED_RULES` on every
device and refuses an illegal call up front, so a model tested on CPU makes only calls a
GPU accepts; it runs the kernel where one exists (sm90), else the custom op
``f8tensor::scaled_grouped_mm_reference``: an exact emulation in the kernel's epilogue
order, opaque to torch.compile so changing token counts recompile nothing.
"""

from __future__ import annotations

import torch

from f8tensor import compat
from f8tensor.gemm.check import check_grouped_rules
from f8tensor.gemm.operands import GROUPED, col_major, inverse_scale, kernel_scale, prepare, row_major
from f8tensor.gemm.rules import ALIGN, GROUPED_RULES, build_of, grouped_rule_for
from f8tensor.quant.config import Float8LinearConfig
from f8tensor.quant.formats import FLOAT8_DTYPES

__all__ = [
    "DELAYED_EXPERTS",
    "MAX_GROUPS",
    "batched_mm",
    "check_grouped_dims",
    "grouped_kernel_available",
    "grouped_mm",
    "in_dtype",
    "scaled_grouped_mm",
    "validate_grouped_mm_args",
]

#: The most groups (or batch entries) one grouped-kernel call takes (every row's limit).
MAX_GROUPS = min(rule.max_groups for rule in GROUPED_RULES)
_HP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

#: The one output dtype of the grouped kernel; results are cast to the caller's dtype.
KERNEL_OUT = torch.bfloat16


def in_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``, ``t`` itself if it is: compiled, torch 2.11 zeroes the gradient of a
    Function output aliasing an intermediate, as a no-op ``.to`` does (pytorch#180642)."""
    return t if t.dtype == dtype else t.to(dtype)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a (M, K) @ b[g] (K, N)`` for the rows of group ``g``, in FP8, returned in ``out_dtype``.

    Args:
        a, b: the operands, at least one a Float8Tensor (a plain one is cast like the other).
        offs: cumulative row counts (groups may be empty).
        out_dtype: the result's dtype.
    """
    a8, b8 = prepare(a, b, GROUPED, a_k=1, b_k=1)
    (m, k), (g, _, n) = a8.shape, b8.shape
    check_grouped_dims(k, n, "grouped product")
    a_inv = kernel_scale(inverse_scale(a8), (m, 1), (m,))
    b_inv = kernel_scale(inverse_scale(b8), (g, 1, n), (g, n))
    compiling = torch.compiler.is_compiling()
    a_data, b_data = row_major(a8._data, compiling), col_major(b8._data, compiling)
    out = scaled_grouped_mm(a_data, b_data, a_inv, b_inv, offs.to(torch.int32), KERNEL_OUT)
    return in_dtype(out, out_dtype)


def batched_mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a (B, M, K) @ b (B, K, N)`` in FP8, in one kernel call per :data:`MAX_GROUPS` entries."""
    a8, b8 = prepare(a, b, GROUPED, a_k=2, b_k=1)
    (bsz, m, _), n = a8.shape, b8.shape[2]
    a_inv = kernel_scale(inverse_scale(a8), (bsz, m, 1), (bsz, m))
    b_inv = kernel_scale(inverse_scale(b8), (bsz, 1, n), (bsz, n))
    compiling = torch.compiler.is_compiling()
    a_data, b_data = row_major(a8._data, compiling), col_major(b8._data, compiling)
    if bsz <= MAX_GROUPS:
        out = scaled_grouped_mm(a_data, b_data, a_inv, b_inv, None, KERNEL_OUT)
    else:
        out = torch.cat(
            [
                scaled_grouped_mm(
                    a_data[i : i + MAX_GROUPS],
                    b_data[i : i + MAX_GROUPS],
                    a_inv[i : i + MAX_GROUPS],
                    b_inv[i : i + MAX_GROUPS],
                    None,
                    KERNEL_OUT,
                )
                for i in range(0, bsz, MAX_GROUPS)
            ]
        )
    return in_dtype(out, out_dtype)


def check_grouped_dims(k: int, n: int, what: str) -> None:
    """Refuse a grouped product whose K or N is not a multiple of 16 (so N fails in forward).

    Args:
        k: the contraction dim.
        n: the output dim (the input gradient contracts over it).
        what: names the product in the message.
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
    # 16: ALIGN (see dense.py).
    wrong = [f"{name}={size}" for name, size in (("K (contraction)", k), ("N (output)", n)) if size % 16]
    if wrong:
        raise ValueError(
            f"FP8 {what}: {' and '.join(wrong)}; each must be a multiple of {ALIGN} (torch._scaled_grouped_mm's "
            f"rule; the input gradient contracts over N)"
        )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


#: Why an expert GEMM refuses a delayed config.
DELAYED_EXPERTS = (
    "delayed scaling is not supported for expert GEMMs (they keep no amax history); use a dynamic recipe "
    "(tensorwise, rowwise, rowwise_with_gw_hp) or keep the experts in high precision, as "
    "convert_to_float8_training does under a delayed recipe"
)


@compat.constant_per_config
def _delayed(config: Float8LinearConfig) -> bool:
    """``config.any_delayed``; traced, a constant (its reads unguarded)."""
    return config.any_delayed


def validate_grouped_mm_args(x: torch.Tensor, w: torch.Tensor, offs: object, config: object) -> torch.Tensor:
    """The checks ``Float8Linear`` makes, for ``x (M, K) @ w[g] (K, N)`` grouped by ``offs``.

    Offsets values are checked here on a CPU tensor in eager; on CUDA and while compiling by
    ``torch._assert_async`` (no host sync, no graph break).

    Args:
        x, w: bf16/fp16/fp32 tensors, ``x (M, K)``, ``w (G, K, N)``; K and N multiples of 16.
        offs: an integer tensor or list of ints, ``(G,)``, non-decreasing, in [0, M].
        config: a :class:`Float8LinearConfig`.
    Returns:
        ``offs`` as an int32 tensor on ``x``'s device.
    Raises:
        TypeError: ``config``, ``x``, ``w`` or ``offs`` of the wrong type or dtype (named).
        ValueError: a delayed ``config``, wrong shapes, ``offs`` on another device, K or N not a
            multiple of 16, or ``offs`` decreasing or outside [0, M].

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
    if _delayed(config):
        raise ValueError(f"float8_grouped_mm: {DELAYED_EXPERTS}")
    for name, t in (("x", x), ("w", w)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"float8_grouped_mm: {name} must be a tensor; got {type(t).__name__}")
        if t.dtype not in _HP_DTYPES:
            kind = (
                "an FP8"
                if t.dtype in FLOAT8_DTYPES
                else "a complex"
                if t.dtype.is_complex
                else "a bool"
                if t.dtype == torch.bool
                else "an integer"
                if not t.dtype.is_floating_point
                else "a"
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
        # Values on the host: a plain CPU tensor outside tracing (fake tensors hold none).
        if offs.device.type == "cpu" and type(offs) is torch.Tensor and not torch.compiler.is_compiling():
            if bool((o[1:] < o[:-1]).any()) or int(o[0]) < 0 or int(o[-1]) > m:
                raise ValueError(
                    f"float8_grouped_mm: offs must be non-decreasing cumulative counts in [0, M={m}]; got {o.tolist()}"
                )
        else:
            ok = (o[1:] >= o[:-1]).all() & (o[0] >= 0) & (o[-1] <= m)
            compat.assert_async(ok, "float8_grouped_mm: offs must be non-decreasing cumulative counts in [0, M]")
    return offs.to(torch.int32)


@torch.compiler.assume_constant_result
def grouped_kernel_available(device: torch.device) -> bool:
    """Whether ``torch._scaled_grouped_mm`` runs on ``device`` (a build a grouped rule covers)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return grouped_rule_for(build_of(device)) is not None


def scaled_grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    out_dtype: torch.dtype = KERNEL_OUT,
) -> torch.Tensor:
    """``torch._scaled_grouped_mm``'s signature and forms (:class:`~f8tensor.gemm.rules.GroupedMMRule`): rules checked, routed by device."""
    check_grouped_rules(a, b, scale_a, scale_b, offs, out_dtype)
    if grouped_kernel_available(a.device):
        out = compat.scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype)
        if b.dim() == 2:
            assert offs is not None  # check_grouped_rules: the 2D-by-2D form takes offs
            # The output is empty_strided: an empty group may be left unwritten. Zero it.
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
            # Empty groups: zeros, never stale memory.
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
