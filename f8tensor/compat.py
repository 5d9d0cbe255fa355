"""The one module that reaches into PyTorch's private APIs: thin, named wrappers.

f8tensor supports torch 2.11-2.14. Everything it needs that PyTorch does not offer as a
public API (the FP8 GEMM ops, the tensor-subclass machinery, a few autograd and
distributed internals) is reached from here and nowhere else, so that a torch release
that moves one of them is a change to one entry of this file. Each entry says what it is
and since which torch release it exists. ``tests/project/test_private_api.py`` checks the rule:
no other module of the package names a private torch attribute or module.

It also knows what each supported release has (``TORCH_VERSION`` and the ``HAS_*`` flags
below, each measured on that release's CPU build or read from its sources; README.md,
"Version matrix"), so that the package decides from data, never by catching an error.
"""

from __future__ import annotations

import shutil
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

if torch.distributed.is_available():
    from torch.distributed.tensor.parallel import ColwiseParallel
from torch._inductor import config as _inductor_config
from torch._inductor import inductor_prims as _inductor_prims
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import return_and_correct_aliasing as _return_and_correct_aliasing

if torch.distributed.is_available():
    import torch.distributed._functional_collectives as _funcol

__all__ = [
    "CPU_PRODUCTS_IN_FP32",
    "DISABLED_TORCH_FUNCTION",
    "GROUPED_MM_FUNCTIONS",
    "HAS_CPU_ROWWISE_SCALED_MM",
    "HAS_CPU_SCALED_MM_V2",
    "HAS_GROUPED_MM_FP32_META",
    "HAS_INDUCTOR_FMA",
    "META_FLOORS_BLOCK_SCALES",
    "TORCH_VERSION",
    "TorchDispatchMode",
    "assert_async",
    "block_scaled_mm",
    "colwise_prepare_input",
    "cpu_compiler",
    "cpu_scaled_mm",
    "current_graph_task_id",
    "disable_torch_function_subclass",
    "dtensor_local",
    "fma",
    "functional_all_reduce_max",
    "grouped_mm",
    "has_block_scaled_mm",
    "is_fake",
    "is_functorch_wrapped",
    "is_op_of_namespace",
    "make_wrapper_subclass",
    "make_wrapper_subclass_shaped",
    "multi_head_attention_forward_with",
    "preserve_version_counter",
    "return_and_correct_aliasing",
    "scaled_grouped_mm",
    "scaled_mm",
    "set_scaled_mm",
    "tree_map_only",
    "unlimited_recompiles",
    "version_counter",
    "view_base",
    "waited",
    "watch_c10d_writes",
    "written_arguments",
]

# ----------------------------------------------------------------------- what each release has


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


#: (major, minor) of the installed torch.
TORCH_VERSION: tuple[int, int] = _release(torch.__version__)

#: Whether the CPU ``torch._scaled_mm`` takes rowwise (outer-vector) scales: from 2.12. On
#: 2.11 it is per-tensor only (``Blas.cpp``: "Now _scaled_mm only supports per-tensor
#: scaling for CPU backend", an internal assert); :func:`scaled_mm` then computes a rowwise
#: call with the per-tensor kernel and the outer scales after (the rowwise epilogue's order).
HAS_CPU_ROWWISE_SCALED_MM: bool = TORCH_VERSION >= (2, 12)

#: Whether ``torch._scaled_mm_v2`` (``F.scaled_mm``) has a CPU kernel: from 2.12 (tensorwise
#: and rowwise only; no release has block-scaled CPU kernels, so f8tensor's block products
#: take the reference path on CPU in every release).
HAS_CPU_SCALED_MM_V2: bool = TORCH_VERSION >= (2, 12)

#: Whether ``torch._grouped_mm``'s meta registration (what torch.compile traces) takes fp32
#: operands: no release 2.11-2.14 does ("Expected inputs of BF16 type"); eager CPU does.
HAS_GROUPED_MM_FP32_META: bool = False

#: Whether inductor has a fused multiply-add prim (``torch._inductor.inductor_prims.fma``,
#: added in early 2026 for eager parity of lerp and addcmul; read from the module, not the
#: version number): its CPU and GPU code emit one fused multiply-add per element.
HAS_INDUCTOR_FMA: bool = hasattr(_inductor_prims, "fma")

#: Whether the meta registration of ``F.scaled_mm`` (torch.compile's tracing of a CUDA call)
#: floor-divides K, M, N by 128 for the DeepSeek scales, refusing dims that are not multiples
#: of 128 (``_check_scaled_mm_sizes_v2``, 2.11-2.13); 2.14's meta is shape-only.
META_FLOORS_BLOCK_SCALES: bool = TORCH_VERSION < (2, 14)


def assert_async(condition: torch.Tensor, message: str) -> None:
    """``torch._assert_async(condition, message)`` (torch >= 1.11; the message from 2.1): a
    device-side check of a one-element boolean tensor, no host sync; on CPU it raises at
    once. Traceable by torch.compile.

    Raises:
        RuntimeError: on CPU, ``condition`` is False (with ``message``); on CUDA a false
            condition stops the device, and the error surfaces at the next synchronisation.
    """
    torch._assert_async(condition, message)


# ----------------------------------------------------------------------- FP8 GEMM ops
#
# The originals, captured when f8tensor is imported: ``install_rules_check`` may later
# replace ``torch._scaled_mm`` / ``F.scaled_mm`` with checking wrappers for a user's own
# calls, while f8tensor's products are checked where gemm makes them (exactly once).

#: AMD's FP8 formats (oneDNN's CPU kernel refuses them; see :func:`scaled_mm`).
_FNUZ = (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
#: ``torch._scaled_mm`` (torch >= 2.1; the ``scale_a``/``scale_b`` signature since 2.4).
_SCALED_MM = torch._scaled_mm
#: ``torch.nn.functional.scaled_mm``: public, torch >= 2.10; block-scaled (1x128, 128x128,
#: MX) kernels by named scaling recipes. ``None`` on a build without it.
_F_SCALED_MM = getattr(torch.nn.functional, "scaled_mm", None)
#: ``torch._scaled_grouped_mm`` (torch >= 2.8): grouped FP8 GEMMs (CUDA sm90/sm100).
_SCALED_GROUPED_MM = torch._scaled_grouped_mm
#: ``torch._grouped_mm`` (torch >= 2.8; CPU kernels from 2.9): grouped high-precision GEMMs.
_GROUPED_MM = torch._grouped_mm


#: Whether :func:`scaled_mm` sends the CPU products it lists to :func:`cpu_scaled_mm` (the
#: default) or every product to ``torch._scaled_mm`` (False: for a benchmark that reads
#: compiled CPU graphs as a GPU runs them, one ``_scaled_mm`` per product).
CPU_PRODUCTS_IN_FP32: bool = True


def scaled_mm(
    mat1: torch.Tensor, mat2: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, *,
    bias: torch.Tensor | None = None, scale_result: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
    use_fast_accum: bool = False, **kwargs: Any,
) -> torch.Tensor:
    """``torch._scaled_mm`` (the original op). ``kwargs``: passed through (inductor's CPU
    extern-kernel call adds ``out=``).

    On a CPU the product runs as :func:`cpu_scaled_mm` (one op in eager and compiled graphs,
    the same bits in both) where torch's own kernel is slow or refuses: per-tensor scales
    (torch hands those to oneDNN on CPUs with AMX or AVX512-FP16, measured about 400x slower
    than its reference kernel at test sizes), fnuz operands (oneDNN refuses them) and outer-
    vector scales on a torch without a rowwise CPU kernel (:data:`HAS_CPU_ROWWISE_SCALED_MM`).
    While torch.export traces, the call stays ``aten._scaled_mm``: an exported program runs
    where it is loaded.

    Raises:
        RuntimeError, ValueError: on a CPU, or with K = 0 (products computed here), what
            ``torch._scaled_mm`` refuses on CUDA (:func:`_check_scaled_mm_args`)."""
    if (mat1.device.type == "cpu" or mat1.shape[-1] == 0) and not torch.compiler.is_compiling():
        # Traced, the ops' own fake kernels check (aten's meta kernel, cpu_scaled_mm's below):
        # the same refusals without guards on the checks' Python.
        _check_scaled_mm_args(mat1, mat2, scale_a, scale_b, bias, out_dtype)
    if mat1.shape[-1] == 0:
        # K = 0 (an empty batch's weight gradient contracts over no tokens): the product is
        # zeros (+ the bias). torch's CPU per-tensor kernel returns its output uninitialized
        # then (torch 2.13), so no kernel is asked.
        acc = torch.zeros(mat1.shape[0], mat2.shape[1], dtype=torch.float32, device=mat1.device)
        return _fp32_epilogue(acc, bias, out_dtype or mat1.dtype, kwargs.get("out"))
    if (
        mat1.device.type == "cpu"
        and CPU_PRODUCTS_IN_FP32
        and scale_result is None
        and not torch.compiler.is_exporting()
        and (
            (scale_a.numel() == 1 and scale_b.numel() == 1)
            or not HAS_CPU_ROWWISE_SCALED_MM
            or mat1.dtype in _FNUZ
            or mat2.dtype in _FNUZ
        )
    ):
        acc = cpu_scaled_mm(mat1, mat2, scale_a, scale_b)
        return _fp32_epilogue(acc, bias, out_dtype or mat1.dtype, kwargs.get("out"))
    kwargs.update(bias=bias, scale_result=scale_result, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    return _SCALED_MM(mat1, mat2, scale_a, scale_b, **kwargs)


#: The operand dtypes :func:`scaled_mm` takes: torch's FP8 formats (the fnuz pair computed
#: by :func:`cpu_scaled_mm` on a CPU; on a GPU only ROCm has them).
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, *_FNUZ)
_OUT = (torch.bfloat16, torch.float16, torch.float32, *_FP8)


def _check_scaled_mm_args(mat1, mat2, scale_a, scale_b, bias=None, out_dtype=None) -> None:
    """Raise what ``torch._scaled_mm`` raises on CUDA (``ScaledBlas.cpp``, torch 2.11-2.14)
    unless: 2-D FP8 operands with a common K, fp32 scales of one element each (tensorwise) or
    ``(M, 1)`` and ``(1, N)`` (rowwise), a bias of N elements, a float or FP8 output. Sizes go into a message only
    once it is raised (formatting a torch.compile(dynamic=True) size pins it). The kernels'
    alignment, layout and bias-dtype rules are ``f8tensor.gemm``'s check mode."""
    if mat1.dim() != 2 or mat2.dim() != 2:
        raise RuntimeError(f"mat1 and mat2 must be matrices (2-D); got shapes {tuple(mat1.shape)} and {tuple(mat2.shape)}")
    if mat1.dtype not in _FP8 or mat2.dtype not in _FP8:
        names = ", ".join(str(d) for d in _FP8)
        raise RuntimeError(f"mat1 and mat2 must be FP8 ({names}); got {mat1.dtype} and {mat2.dtype}")
    (m, k), n = mat1.shape, mat2.shape[1]
    if mat2.shape[0] != k:
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({m}x{k} and {mat2.shape[0]}x{n})")
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
        raise ValueError(f"scale_a and scale_b must be float32; got {scale_a.dtype} and {scale_b.dtype}")
    tensorwise = scale_a.numel() == 1 and scale_b.numel() == 1
    if not tensorwise and (tuple(scale_a.shape) != (m, 1) or tuple(scale_b.shape) != (1, n)):
        raise ValueError(
            f"Invalid scaling configuration: scale_a {tuple(scale_a.shape)} and scale_b {tuple(scale_b.shape)} "
            f"for ({m}x{k}) @ ({k}x{n}); allowed: one element each (tensorwise), or ({m}, 1) and (1, {n}) (rowwise)"
        )
    if bias is not None and bias.numel() != n:
        raise RuntimeError(f"Bias must be size {n} (N) but got shape {tuple(bias.shape)}")
    if out_dtype is not None and out_dtype not in _OUT:
        raise RuntimeError(f"out_dtype must be one of {', '.join(map(str, _OUT))}; got {out_dtype}")


@torch.library.custom_op("f8tensor::cpu_scaled_mm", mutates_args=(), device_types="cpu")
def cpu_scaled_mm(mat1: torch.Tensor, mat2: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
    """An FP8 product on a CPU, in fp32, computed as torch's reference CPU kernel computes it:
    the exact fp32 values times their per-tensor scales, one fp32 product (with the bias in
    fp32 and one cast after, :func:`scaled_mm`'s epilogue: bitwise that kernel's result,
    measured). Outer-vector scales (``(M, 1)``, ``(1, N)``) multiply the fp32 product instead,
    the rowwise epilogue's order. A custom op, so that torch.compile keeps the product whole
    (eager's bits) instead of re-fusing its parts."""
    _check_scaled_mm_args(mat1, mat2, scale_a, scale_b)  # as the fake kernel: an (M, N) result
    # Deliberate fp32 throughout: FP8 values are exact in it. The operands' layouts as given
    # (the reference kernel's GEMM sees them so too; its bits depend on them).
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        acc = (mat1.float() * scale_a.float()) @ (mat2.float() * scale_b.float())
    else:
        acc = (mat1.float() @ mat2.float()) * scale_a.float() * scale_b.float()
    return acc


@cpu_scaled_mm.register_fake
def _(mat1, mat2, scale_a, scale_b):
    _check_scaled_mm_args(mat1, mat2, scale_a, scale_b)
    return mat1.new_empty((mat1.shape[0], mat2.shape[1]), dtype=torch.float32)


def _fp32_epilogue(
    acc: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype, out: torch.Tensor | None
) -> torch.Tensor:
    """The fp32 product ``acc`` (scales applied) plus the bias in fp32, one cast, into ``out``
    when the caller (inductor's extern-kernel call) gave one."""
    if bias is not None:
        acc = acc + bias.float()
    result = acc.to(out_dtype)
    return out.copy_(result) if out is not None else result


def set_scaled_mm(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Make ``torch._scaled_mm`` ``fn`` (the rules check's wrapper for a user's own calls, or
    the function it replaced); returns what it was."""
    previous, torch._scaled_mm = torch._scaled_mm, fn
    return previous


def has_block_scaled_mm() -> bool:
    """Whether this torch has ``torch.nn.functional.scaled_mm`` (torch >= 2.10)."""
    return _F_SCALED_MM is not None


def block_scaled_mm(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``torch.nn.functional.scaled_mm`` (the original function; public, torch >= 2.10).

    Raises:
        RuntimeError: this torch has no ``F.scaled_mm`` (the message names the version).
    """
    if _F_SCALED_MM is None:
        raise RuntimeError(f"torch.nn.functional.scaled_mm needs torch >= 2.10; this is torch {torch.__version__}")
    return _F_SCALED_MM(*args, **kwargs)


def scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype) -> torch.Tensor:
    """``torch._scaled_grouped_mm`` (torch >= 2.8)."""
    return _SCALED_GROUPED_MM(a, b, scale_a, scale_b, offs=offs, out_dtype=out_dtype)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` (torch >= 2.8; fp32 CPU kernels from 2.9)."""
    return _GROUPED_MM(a, b, offs=offs)


#: The functions a model calls for a grouped GEMM: ``torch._grouped_mm`` (torch >= 2.8) and
#: the public ``torch.nn.functional.grouped_mm`` where it exists (torch >= 2.10).
GROUPED_MM_FUNCTIONS: tuple[Callable[..., torch.Tensor], ...] = (_GROUPED_MM,) + (
    (torch.nn.functional.grouped_mm,) if hasattr(torch.nn.functional, "grouped_mm") else ()
)

# ----------------------------------------------------------------------- tensor subclasses

_WEIGHTS_ONLY_LOAD_CODE: types.CodeType | None
try:  # torch >= 2.1: the unpickler of torch.load(weights_only=True)
    from torch._weights_only_unpickler import Unpickler as _WeightsOnlyUnpickler

    _WEIGHTS_ONLY_LOAD_CODE = _WeightsOnlyUnpickler.load.__code__
except (ImportError, AttributeError):  # pragma: no cover - older torch
    _WEIGHTS_ONLY_LOAD_CODE = None


def called_by_weights_only_load() -> bool:
    """Whether the caller's caller is ``torch.load(weights_only=True)``'s unpickler itself
    (its NEWOBJ or REDUCE calling an allowlisted class with a checkpoint's arguments).
    One frame lookup, no tensor op."""
    return _WEIGHTS_ONLY_LOAD_CODE is not None and sys._getframe(2).f_code is _WEIGHTS_ONLY_LOAD_CODE



def make_wrapper_subclass(cls: type, like: torch.Tensor, *, dtype: torch.dtype, requires_grad: bool) -> Any:
    """``torch.Tensor._make_wrapper_subclass`` (torch >= 1.12; the documented way to build a
    wrapper subclass): an instance of ``cls`` with ``like``'s shape, strides, storage
    offset, layout and device, and the outer ``dtype``."""
    return torch.Tensor._make_wrapper_subclass(
        cls,
        like.shape,
        strides=like.stride(),
        storage_offset=like.storage_offset(),
        dtype=dtype,
        layout=like.layout,
        device=like.device,
        requires_grad=requires_grad,
    )


def make_wrapper_subclass_shaped(
    cls: type, shape: tuple[int, ...], strides: tuple[int, ...], *, device: torch.device, dtype: torch.dtype
) -> Any:
    """:func:`make_wrapper_subclass` with an outer shape and strides of its own (packed FP4
    data holds two elements per byte, so its shape is not the outer one)."""
    return torch.Tensor._make_wrapper_subclass(
        cls, shape, strides=strides, dtype=dtype, layout=torch.strided, device=device, requires_grad=False
    )


#: ``torch._C._disabled_torch_function_impl`` (torch >= 1.7): a subclass's
#: ``__torch_function__`` that leaves every call to ``__torch_dispatch__``.
DISABLED_TORCH_FUNCTION: Any = torch._C._disabled_torch_function_impl


def disable_torch_function_subclass():
    """``torch._C.DisableTorchFunctionSubclass()`` (torch >= 2.0): a context in which
    subclasses' ``__torch_function__`` is skipped (call the plain function)."""
    return torch._C.DisableTorchFunctionSubclass()


def return_and_correct_aliasing(func: Any, args: Any, kwargs: Any, out: Any) -> Any:
    """``torch.utils._python_dispatch.return_and_correct_aliasing`` (torch >= 2.1): give a
    view op's subclass result the aliasing its schema promises (autograd, functionalization)."""
    return _return_and_correct_aliasing(func, args, kwargs, out)


def tree_map_only(cls: type | tuple[type, ...], fn: Callable[[Any], Any], tree: Any) -> Any:
    """``torch.utils._pytree.tree_map_only`` (torch >= 2.0): ``fn`` on the leaves of type ``cls``."""
    return _pytree.tree_map_only(cls, fn, tree)


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no values (a ``FakeTensor`` of torch.compile's tracing, from
    ``torch._subclasses.fake_tensor``, torch >= 2.0; or a meta tensor)."""
    return isinstance(t, FakeTensor) or t.device.type == "meta"


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """``Tensor._base`` (torch >= 1.0): the tensor ``t`` is a view of, or ``None``."""
    return t._base


def written_arguments(func: Any, args: tuple, kwargs: dict) -> Iterator[Any]:
    """The arguments an aten op writes into (its schema's ``Tensor(a!)``: in-place and
    ``out=`` arguments), read from ``OpOverload._schema`` (torch >= 1.13)."""
    where = _WRITES.get(func)
    if where is None:
        where = tuple(
            (i, arg.name)
            for i, arg in enumerate(func._schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write
        )
        _WRITES[func] = where
    for i, name in where:
        value = args[i] if i < len(args) else kwargs.get(name)
        yield from value if isinstance(value, (list, tuple)) else (value,)


_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}


def is_op_of_namespace(func: Any, namespace: str) -> bool:
    """Whether ``func`` is a ``torch.ops.<namespace>`` op, overload packet or overload
    (``torch._ops.OpOverloadPacket`` / ``OpOverload``, torch >= 1.13)."""
    if isinstance(func, torch._ops.OpOverloadPacket):
        return func._qualified_op_name.startswith(f"{namespace}::")
    return isinstance(func, torch._ops.OpOverload) and func.namespace == namespace


# ----------------------------------------------------------------------- autograd


def current_graph_task_id() -> int:
    """``torch._C._current_graph_task_id()`` (torch >= 2.0): -1 outside a backward pass."""
    return torch._C._current_graph_task_id()


def preserve_version_counter(t: torch.Tensor):
    """``torch.autograd._unsafe_preserve_version_counter`` (torch >= 2.1): a context in which
    writes to ``t`` leave its version counter (autograd's saved-tensor check) unchanged."""
    return torch.autograd._unsafe_preserve_version_counter(t)


def version_counter(t: torch.Tensor) -> int:
    """``Tensor._version`` (torch >= 1.0): the count of in-place writes to ``t`` autograd has
    seen (writes through ``t.data`` and under ``preserve_version_counter`` are not counted)."""
    return t._version


def is_functorch_wrapped(t: torch.Tensor) -> bool:
    """``torch._C._functorch.is_functorch_wrapped_tensor`` (torch >= 2.0): ``t`` is a
    ``torch.func`` transform's wrapper (``grad``, ``vmap``), valid inside that transform only."""
    return torch._C._functorch.is_functorch_wrapped_tensor(t)


# ----------------------------------------------------------------------- distributed


def functional_all_reduce_max(t: torch.Tensor, group: Any) -> torch.Tensor:
    """``torch.distributed._functional_collectives.all_reduce(t, "max", group)`` (torch >=
    2.1): an all-reduce that returns a new tensor, traceable by torch.compile; waited (see
    :func:`waited`).

    NaN-preserving: a MAX collective may drop a NaN that one rank holds (gloo measured:
    ``max(nan, 1)`` is nan, ``max(1, nan)`` is 1), which would give every rank a finite
    amax, hence a finite scale, where one process casting the whole tensor gets NaN. The
    NaN flags are reduced beside the values in the same collective (``[t, isnan(t)]``,
    NaN counted as inf in the values) and put back after, so the result is what one
    process computes: NaN where any rank had NaN, else the largest value (inf included).
    """
    n = t.numel()
    flags = t.isnan()
    inf = float("inf")
    values = torch.nan_to_num(t, nan=inf, posinf=inf, neginf=-inf)  # nan_to_num's defaults would clamp inf
    packed = torch.cat([values.reshape(-1), flags.reshape(-1).to(t.dtype)])
    out = waited(_funcol.all_reduce(packed, "max", group))
    return torch.where(out[n:] > 0, torch.full_like(out[:n], float("nan")), out[:n]).reshape(t.shape)


def waited(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its collective finished: eager functional collectives (and DTensor's
    ``redistribute``/``full_tensor``, which use them) return an ``AsyncCollectiveTensor``
    (torch >= 2.1) whose collective runs until its first use, and a view of one stays one.
    One that is stored (inside a ``Float8Tensor``, as a gradient) or never used can still be
    in flight when the process group is destroyed, and gloo then aborts the process at exit
    ("terminate called without an active exception"). Traced code gets plain tensors (the
    compiler places the waits): they pass through."""
    if isinstance(t, _funcol.AsyncCollectiveTensor):
        return t.wait()
    return t


#: The c10d ops (``torch.distributed``'s collectives and point-to-point ops) that can write
#: into a tensor argument. Their schemas carry no alias annotation, so autograd's version
#: counter never sees these writes (torch 2.x).
_C10D_WRITING_OPS = (
    "broadcast_", "allreduce_", "allreduce_coalesced_", "reduce_", "allgather_", "_allgather_base_",
    "allgather_coalesced_", "allgather_into_tensor_coalesced_", "reduce_scatter_", "_reduce_scatter_base_",
    "reduce_scatter_tensor_coalesced_", "gather_", "scatter_", "alltoall_", "alltoall_base_", "recv_",
    "recv_any_source_",
)


def watch_c10d_writes(callback: Callable[[list[torch.Tensor]], None]) -> Callable[[], None]:
    """Call ``callback(tensors)`` (every tensor argument, written or read) before each
    ``torch.distributed`` collective or receive runs, until the returned function is called.

    A kernel for the ``ADInplaceOrView`` dispatch key of each c10d op (``torch.library``,
    torch >= 2.0; those ops have none of their own): it calls back, then dispatches on below
    that key, so the collective itself runs unchanged. Ops another library already claimed
    at that key are not watched."""
    if not torch.distributed.is_available():
        return lambda: None
    lib = torch.library.Library("c10d", "IMPL")  # noqa: TOR901 (kernels for existing ops)

    def watcher(op: Any) -> Callable[..., Any]:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            callback([t for t in _pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)])
            with torch._C._AutoDispatchBelowADInplaceOrView():
                return op(*args, **kwargs)

        return kernel

    for name in _C10D_WRITING_OPS:
        packet = getattr(torch.ops.c10d, name, None)
        if packet is None:
            continue
        try:
            lib.impl(name, watcher(packet.default), "ADInplaceOrView")
        except RuntimeError:  # a kernel is registered there already
            continue
    return lib._destroy


def cpu_compiler() -> str | None:
    """The C++ compiler inductor builds CPU code with, when one is on the PATH: the names
    of ``torch._inductor.config.cpp.cxx`` (torch >= 2.0; ``CXX`` or ``g++``; a None entry
    is a conda download inductor makes only when asked to), else None."""
    names = _inductor_config.cpp.cxx
    for name in names if isinstance(names, (list, tuple)) else (names,):
        if name and shutil.which(name):
            return name
    return None


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` rounded once, for compiled code: ``inductor_prims.fma`` (see
    :data:`HAS_INDUCTOR_FMA`), which inductor turns into a fused multiply-add on CPU and
    GPU. Run eagerly (or by a non-inductor backend) the prim rounds twice, as does the
    fallback on a release without it."""
    if HAS_INDUCTOR_FMA:
        return _inductor_prims.fma(a, b, c)
    return a * b + c


def unlimited_recompiles() -> Any:
    """``torch._dynamo.utils.disable_cache_limit()`` (torch >= 2.1): a context in which dynamo
    compiles a function once more for every new set of guards, past its recompile limit (8
    per function by default, after which a ``fullgraph=True`` function fails). For a
    function whose graphs are bounded by configurations, never by shapes or steps: the
    optimizer's compiled step (one graph per dtype and mode)."""
    return torch._dynamo.utils.disable_cache_limit()


def dtensor_local(t: Any) -> torch.Tensor:
    """``DTensor._local_tensor`` (torch >= 2.4): a DTensor's local shard itself (the object
    FSDP2 keeps; ``to_local()`` would return a differentiable alias)."""
    return t._local_tensor


def colwise_prepare_input(input_layouts: Any, desired_input_layouts: Any, mod: Any, inputs: Any, device_mesh: Any) -> Any:
    """``ColwiseParallel._prepare_input_fn`` (torch >= 2.3): the input move torch's column
    style hooks before the layer. f8tensor's ``Float8ColwiseParallel`` overrides that hook
    (the name ``ColwiseParallel._apply`` registers) and falls back to torch's own here."""
    return ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)


# ----------------------------------------------------------------------- PyTorch's attention

#: The functions of ``torch.nn.functional`` through which ``multi_head_attention_forward``
#: reaches its projections (it calls the two in-projection helpers; all three call ``linear``).
_MHA_FUNCTIONS = ("_in_projection_packed", "_in_projection", "multi_head_attention_forward")


def multi_head_attention_forward_with(linear: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    """``F.multi_head_attention_forward`` with every ``linear`` it calls (directly and through
    ``_in_projection_packed`` / ``_in_projection``) replaced by ``linear(x, w, b=None)``.

    PyTorch's own code: its bytecode, rebound to a copy of ``torch.nn.functional``'s globals
    in which ``linear`` (and the helpers) are the replacements, so masks, dropout,
    ``bias_k``/``bias_v``, ``add_zero_attn``, ``need_weights`` and the attention itself behave
    exactly as in the release that runs. Present in torch 2.11-2.14 under these names; a
    release whose functions no longer call ``linear`` by that name is refused (its
    projections would bypass the replacement silently).

    Raises:
        NotImplementedError: one of the functions no longer names ``linear``.
    """
    functional = torch.nn.functional
    scope = dict(vars(functional))
    scope["linear"] = linear
    for name in _MHA_FUNCTIONS:
        original = getattr(functional, name)
        if "linear" not in original.__code__.co_names:
            raise NotImplementedError(
                f"torch {torch.__version__}: F.{name} no longer calls F.linear by that name; FP8 "
                "nn.MultiheadAttention needs an update of f8tensor.compat for this torch"
            )
        copy = types.FunctionType(original.__code__, scope, original.__name__, original.__defaults__, original.__closure__)
        copy.__kwdefaults__ = original.__kwdefaults__
        scope[name] = copy
    return scope["multi_head_attention_forward"]
