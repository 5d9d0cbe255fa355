"""The one module that reaches into PyTorch's private APIs: thin, named wrappers.

f8tensor supports torch 2.11-2.14; each entry names what it wraps and since which release,
so a torch that moves one is a change here (``tests/project/test_private_api.py`` holds the
rule). ``TORCH_VERSION`` and the ``HAS_*`` flags say what each release has, so the package
decides from data, never by catching an error.
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
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.nn.modules import module as _nn_module
from torch.nn.utils.stateless import _reparametrize_module
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
    "WRAPPER_SUBCLASS",
    "TorchDispatchMode",
    "assert_async",
    "colwise_prepare_input",
    "cpu_compiler",
    "cpu_scaled_mm",
    "current_graph_task_id",
    "disable_torch_function_subclass",
    "dtensor_local",
    "fma",
    "functional_all_reduce_max",
    "grouped_mm",
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


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


#: (major, minor) of the installed torch.
TORCH_VERSION: tuple[int, int] = _release(torch.__version__)

#: Whether the CPU ``torch._scaled_mm`` takes rowwise scales (from 2.12).
HAS_CPU_ROWWISE_SCALED_MM: bool = TORCH_VERSION >= (2, 12)

#: ``assume_constant_result`` for a function of a config (traced on 2.11: frozen dataclass args).
constant_per_config: Callable = torch.compiler.assume_constant_result if TORCH_VERSION >= (2, 12) else (lambda fn: fn)
#: ``torch.compiler.is_exporting`` (2.11's dynamo: True when compiling).
is_exporting: Callable[[], bool] = (
    torch.compiler.is_exporting if TORCH_VERSION >= (2, 12) else (lambda: torch.compiler._is_exporting_flag)
)


#: Whether ``F.scaled_mm`` has a CPU kernel (from 2.12; never block-scaled).
HAS_CPU_SCALED_MM_V2: bool = TORCH_VERSION >= (2, 12)

#: Whether ``torch._grouped_mm``'s meta registration takes fp32 (none of 2.11-2.14).
HAS_GROUPED_MM_FP32_META: bool = False

#: Whether inductor has the ``inductor_prims.fma`` prim (read from the module).
HAS_INDUCTOR_FMA: bool = hasattr(_inductor_prims, "fma")

#: Whether ``F.scaled_mm``'s meta refuses DeepSeek-scale dims not multiples of 128 (2.11-2.13).
META_FLOORS_BLOCK_SCALES: bool = TORCH_VERSION < (2, 14)


def assert_async(condition: torch.Tensor, message: str) -> None:
    """``torch._assert_async(condition, message)``: a device-side check, no host sync; traceable.

    Raises:
        RuntimeError: on CPU, ``condition`` is False; on CUDA at the next synchronisation.
    """
    torch._assert_async(condition, message)


# The originals, captured at import: install_rules_check may later wrap the public names.
_FNUZ = (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
#: ``torch._scaled_mm`` (torch >= 2.4 signature).
_SCALED_MM = torch._scaled_mm
#: ``torch._scaled_grouped_mm`` (torch >= 2.8).
_SCALED_GROUPED_MM = torch._scaled_grouped_mm
#: ``torch._grouped_mm`` (torch >= 2.8, CPU from 2.9).
_GROUPED_MM = torch._grouped_mm


@torch.compiler.assume_constant_result
def _has_cpu_rowwise_scaled_mm() -> bool:
    """:data:`HAS_CPU_ROWWISE_SCALED_MM`: a constant to torch.compile (no guard)."""
    return HAS_CPU_ROWWISE_SCALED_MM


#: False: CPU products torch's kernel takes go to ``torch._scaled_mm`` (graph benchmarks). Read
#: when traced, as a constant: set it before compiling (or ``torch._dynamo.reset()``).
CPU_PRODUCTS_IN_FP32: bool = True


@torch.compiler.assume_constant_result
def _cpu_products_in_fp32() -> bool:
    """:data:`CPU_PRODUCTS_IN_FP32`; traced, a constant (a global read is a guard per product)."""
    return CPU_PRODUCTS_IN_FP32


def scaled_mm(
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    scale_result: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    use_fast_accum: bool = False,
    **kwargs: Any,
) -> torch.Tensor:
    """``torch._scaled_mm`` (the original op); ``kwargs`` pass through (inductor adds ``out=``).

    On a CPU, per-tensor, fnuz and (before 2.12) rowwise products run as :func:`cpu_scaled_mm`,
    not torch's slow or refusing kernels; torch.export keeps ``aten._scaled_mm``.

    Raises:
        RuntimeError, ValueError: on CPU or with K = 0, what ``torch._scaled_mm`` refuses on CUDA.
    """
    on_cpu = mat1.device.type == "cpu"
    checked = on_cpu or mat1.shape[-1] == 0
    compiling = checked and torch.compiler.is_compiling()
    if checked and not compiling:
        # Traced, the fake kernels check: no guards on this Python.
        _check_scaled_mm_args(mat1, mat2, scale_a, scale_b, bias, out_dtype)
    if mat1.shape[-1] == 0:
        # K = 0: zeros (+ bias); torch 2.13's CPU kernel returns uninitialized memory.
        acc = torch.zeros(mat1.shape[0], mat2.shape[1], dtype=torch.float32, device=mat1.device)
        return _fp32_epilogue(acc, bias, out_dtype or mat1.dtype, kwargs.get("out"))
    if (
        on_cpu
        and (
            (_cpu_products_in_fp32() if compiling else CPU_PRODUCTS_IN_FP32)
            # What torch's CPU kernel refuses, whatever the flag.
            or (not _has_cpu_rowwise_scaled_mm() and (scale_a.numel() > 1 or scale_b.numel() > 1))
            or "fnuz" in str(mat1.dtype)
            or "fnuz" in str(mat2.dtype)
        )
        and scale_result is None
        and (
            (scale_a.numel() == 1 and scale_b.numel() == 1)
            or not _has_cpu_rowwise_scaled_mm()
            # By name, not membership in _FNUZ: traced, each read of a global tuple is a guard.
            or "fnuz" in str(mat1.dtype)
            or "fnuz" in str(mat2.dtype)
        )
        and not is_exporting()
    ):
        acc = cpu_scaled_mm(mat1, mat2, scale_a, scale_b)
        return _fp32_epilogue(acc, bias, out_dtype or mat1.dtype, kwargs.get("out"))
    kwargs.update(bias=bias, scale_result=scale_result, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    return _SCALED_MM(mat1, mat2, scale_a, scale_b, **kwargs)


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, *_FNUZ)
_OUT = (torch.bfloat16, torch.float16, torch.float32, *_FP8)


def _check_scaled_mm_args(mat1, mat2, scale_a, scale_b, bias=None, out_dtype=None) -> None:
    """Raise what ``torch._scaled_mm`` raises on CUDA (``ScaledBlas.cpp``, 2.11-2.14).

    Sizes enter a message only once raised (formatting a dynamic size pins it).
    """
    if mat1.dim() != 2 or mat2.dim() != 2:
        raise RuntimeError(
            f"mat1 and mat2 must be matrices (2-D); got shapes {tuple(mat1.shape)} and {tuple(mat2.shape)}"
        )
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


# Registered as a plain CPU kernel, not ``torch.library.custom_op``: an eager call is then one
# dispatcher hop, not custom_op's Python autograd and dispatch wrappers (FP8 operands carry no grad).
_LIB = torch.library.Library("f8tensor", "DEF")  # noqa: TOR901 (kept for the process's lifetime)
_LIB.define("cpu_scaled_mm(Tensor mat1, Tensor mat2, Tensor scale_a, Tensor scale_b) -> Tensor")


def _cpu_scaled_mm(
    mat1: torch.Tensor, mat2: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor
) -> torch.Tensor:
    """An FP8 product on a CPU in fp32, bitwise torch's reference CPU kernel; a custom op so
    compile keeps it whole (eager's bits)."""
    _check_scaled_mm_args(mat1, mat2, scale_a, scale_b)  # as the fake kernel
    if (scale_a.requires_grad or scale_b.requires_grad or mat1.requires_grad or mat2.requires_grad) and (
        torch.is_grad_enabled()
    ):
        # aten::_scaled_mm has no derivative; autograd would otherwise record this body's fp32 ops.
        raise RuntimeError(
            "f8tensor::cpu_scaled_mm has no derivative (as aten::_scaled_mm): its operands and scales must not "
            "require grad (detach them, or call it under torch.no_grad())"
        )
    # Deliberate fp32: FP8 values are exact in it. Layouts as given: the reference's bits depend on them.
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        acc = (mat1.float() * scale_a.float()) @ (mat2.float() * scale_b.float())
    else:
        acc = (mat1.float() @ mat2.float()) * scale_a.float() * scale_b.float()
    return acc


def _cpu_scaled_mm_fake(mat1, mat2, scale_a, scale_b):
    _check_scaled_mm_args(mat1, mat2, scale_a, scale_b)
    return mat1.new_empty((mat1.shape[0], mat2.shape[1]), dtype=torch.float32)


_LIB.impl("cpu_scaled_mm", _cpu_scaled_mm, "CPU")
torch.library.register_fake("f8tensor::cpu_scaled_mm", _cpu_scaled_mm_fake, lib=_LIB)
#: ``f8tensor::cpu_scaled_mm``: :func:`_cpu_scaled_mm` as one op.
cpu_scaled_mm = torch.ops.f8tensor.cpu_scaled_mm.default


def _fp32_epilogue(
    acc: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype, out: torch.Tensor | None
) -> torch.Tensor:
    """``acc`` plus the bias in fp32, one cast, into ``out`` if given (resized as torch's ``out=`` is)."""
    if bias is not None:
        acc = acc + bias.float()
    result = acc.to(out_dtype)
    if out is None:
        return result
    if out.dtype != out_dtype:
        raise RuntimeError(f"out_dtype must match output matrix type: out is {out.dtype}, out_dtype {out_dtype}")
    if out.shape != result.shape:
        out.resize_(result.shape)
    return out.copy_(result)


def set_scaled_mm(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Make ``torch._scaled_mm`` ``fn``; returns what it was."""
    previous, torch._scaled_mm = torch._scaled_mm, fn
    return previous


def scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype) -> torch.Tensor:
    """``torch._scaled_grouped_mm`` (torch >= 2.8)."""
    return _SCALED_GROUPED_MM(a, b, scale_a, scale_b, offs=offs, out_dtype=out_dtype)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` (torch >= 2.8; fp32 CPU kernels from 2.9)."""
    return _GROUPED_MM(a, b, offs=offs)


#: The functions a model calls for a grouped GEMM.
GROUPED_MM_FUNCTIONS: tuple[Callable[..., torch.Tensor], ...] = (_GROUPED_MM,) + (
    (torch.nn.functional.grouped_mm,) if hasattr(torch.nn.functional, "grouped_mm") else ()
)

_WEIGHTS_ONLY_LOAD_CODE: types.CodeType | None
try:  # torch >= 2.1: the unpickler of torch.load(weights_only=True)
    from torch._weights_only_unpickler import Unpickler as _WeightsOnlyUnpickler

    _WEIGHTS_ONLY_LOAD_CODE = _WeightsOnlyUnpickler.load.__code__
except (ImportError, AttributeError):  # pragma: no cover - older torch
    _WEIGHTS_ONLY_LOAD_CODE = None


def called_by_weights_only_load() -> bool:
    """Whether the caller's caller is ``torch.load(weights_only=True)``'s unpickler."""
    return _WEIGHTS_ONLY_LOAD_CODE is not None and sys._getframe(2).f_code is _WEIGHTS_ONLY_LOAD_CODE


def make_wrapper_subclass(cls: type, like: torch.Tensor, *, dtype: torch.dtype, requires_grad: bool) -> Any:
    """``torch.Tensor._make_wrapper_subclass`` (torch >= 1.12) with ``like``'s geometry, outer ``dtype``."""
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


#: ``torch.Tensor._make_wrapper_subclass`` itself (torch >= 1.12), for the one caller that
#: builds every FP8 tensor and saves the wrapper's call: ``(cls, shape, *, strides,
#: storage_offset, dtype, layout, device, requires_grad)``.
WRAPPER_SUBCLASS: Any = torch.Tensor._make_wrapper_subclass


def make_wrapper_subclass_shaped(
    cls: type, shape: tuple[int, ...], strides: tuple[int, ...], *, device: torch.device, dtype: torch.dtype
) -> Any:
    """:func:`make_wrapper_subclass` with its own outer shape and strides (packed FP4)."""
    return torch.Tensor._make_wrapper_subclass(
        cls, shape, strides=strides, dtype=dtype, layout=torch.strided, device=device, requires_grad=False
    )


#: A ``__torch_function__`` leaving every call to ``__torch_dispatch__`` (torch >= 1.7).
DISABLED_TORCH_FUNCTION: Any = torch._C._disabled_torch_function_impl


def disable_torch_function_subclass():
    """``torch._C.DisableTorchFunctionSubclass()`` (torch >= 2.0)."""
    return torch._C.DisableTorchFunctionSubclass()


def return_and_correct_aliasing(func: Any, args: Any, kwargs: Any, out: Any) -> Any:
    """``torch.utils._python_dispatch.return_and_correct_aliasing`` (torch >= 2.1)."""
    return _return_and_correct_aliasing(func, args, kwargs, out)


def tree_map_only(cls: type | tuple[type, ...], fn: Callable[[Any], Any], tree: Any) -> Any:
    """``torch.utils._pytree.tree_map_only`` (torch >= 2.0)."""
    return _pytree.tree_map_only(cls, fn, tree)


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no values (a ``FakeTensor`` or a meta tensor)."""
    return isinstance(t, FakeTensor) or t.device.type == "meta"


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """``Tensor._base`` (torch >= 1.0): the tensor ``t`` is a view of, or ``None``."""
    return t._base


def written_arguments(func: Any, args: tuple, kwargs: dict) -> Iterator[Any]:
    """The arguments an aten op writes into (``Tensor(a!)`` in ``OpOverload._schema``)."""
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
    """Whether ``func`` is a ``torch.ops.<namespace>`` op, packet or overload."""
    if isinstance(func, torch._ops.OpOverloadPacket):
        return func._qualified_op_name.startswith(f"{namespace}::")
    return isinstance(func, torch._ops.OpOverload) and func.namespace == namespace


def current_graph_task_id() -> int:
    """``torch._C._current_graph_task_id()`` (torch >= 2.0): -1 outside a backward pass."""
    return torch._C._current_graph_task_id()


def preserve_version_counter(t: torch.Tensor):
    """``torch.autograd._unsafe_preserve_version_counter`` (torch >= 2.1)."""
    return torch.autograd._unsafe_preserve_version_counter(t)


def version_counter(t: torch.Tensor) -> int:
    """``Tensor._version``: in-place writes autograd has seen (not through ``.data``)."""
    return t._version


def innermost_pack_hook() -> Callable[[torch.Tensor], Any] | None:
    """The pack hook of the innermost active ``saved_tensors_hooks`` (a checkpoint region's
    inside one), or None (``torch._C._autograd._top_saved_tensors_default_hooks``)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return None if top is None else top[0]


def reparametrized(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> Any:
    """A context in which ``module``'s parameters named in ``tensors`` are those tensors
    (``torch.nn.utils.stateless._reparametrize_module``, what ``torch.func.functional_call`` uses)."""
    return _reparametrize_module(module, tensors)


def global_module_backward_hooks() -> bool:
    """Whether global module backward hooks are registered (``torch.nn.modules.module``'s
    ``_global_backward_hooks`` and ``_global_backward_pre_hooks``)."""
    return bool(_nn_module._global_backward_hooks or _nn_module._global_backward_pre_hooks)


def is_functorch_wrapped(t: torch.Tensor) -> bool:
    """``torch._C._functorch.is_functorch_wrapped_tensor`` (torch >= 2.0)."""
    return torch._C._functorch.is_functorch_wrapped_tensor(t)


def functional_all_reduce_max(t: torch.Tensor, group: Any) -> torch.Tensor:
    """A traceable MAX all-reduce (``_functional_collectives``, torch >= 2.1), waited.

    NaN-preserving: NaN flags travel beside the values (a MAX collective may drop a NaN), so
    the result is what one process computes.
    """
    n = t.numel()
    flags = t.isnan()
    inf = float("inf")
    values = torch.nan_to_num(t, nan=inf, posinf=inf, neginf=-inf)  # defaults would clamp inf
    packed = torch.cat([values.reshape(-1), flags.reshape(-1).to(t.dtype)])
    out = waited(_funcol.all_reduce(packed, "max", group))
    return torch.where(out[n:] > 0, torch.full_like(out[:n], float("nan")), out[:n]).reshape(t.shape)


def waited(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its collective finished (an ``AsyncCollectiveTensor`` is waited).

    One left in flight at process-group teardown makes gloo abort the process.
    """
    if isinstance(t, _funcol.AsyncCollectiveTensor):
        return t.wait()
    return t


#: c10d ops that write a tensor argument unseen by version counters (no alias annotation).
_C10D_WRITING_OPS = (
    "broadcast_",
    "allreduce_",
    "allreduce_coalesced_",
    "reduce_",
    "allgather_",
    "_allgather_base_",
    "allgather_coalesced_",
    "allgather_into_tensor_coalesced_",
    "reduce_scatter_",
    "_reduce_scatter_base_",
    "reduce_scatter_tensor_coalesced_",
    "gather_",
    "scatter_",
    "alltoall_",
    "alltoall_base_",
    "recv_",
    "recv_any_source_",
)


def watch_c10d_writes(callback: Callable[[list[torch.Tensor]], None]) -> Callable[[], None]:
    """Call ``callback(tensors)`` before each ``torch.distributed`` collective or receive.

    An ``ADInplaceOrView`` kernel per c10d op; returns the function that removes them.
    """
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
    """The C++ compiler on the PATH inductor builds CPU code with, else None."""
    names = _inductor_config.cpp.cxx
    for name in names if isinstance(names, (list, tuple)) else (names,):
        if name and shutil.which(name):
            return name
    return None


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` rounded once in compiled code (``inductor_prims.fma``); eager rounds twice."""
    if HAS_INDUCTOR_FMA:
        return _inductor_prims.fma(a, b, c)
    return a * b + c


def unlimited_recompiles() -> Any:
    """``torch._dynamo.utils.disable_cache_limit()``: for graphs bounded by configs, not shapes."""
    return torch._dynamo.utils.disable_cache_limit()


def dtensor_local(t: Any) -> torch.Tensor:
    """``DTensor._local_tensor`` (torch >= 2.4): the shard itself, not a differentiable alias."""
    return t._local_tensor


def colwise_prepare_input(
    input_layouts: Any, desired_input_layouts: Any, mod: Any, inputs: Any, device_mesh: Any
) -> Any:
    """``ColwiseParallel._prepare_input_fn`` (torch >= 2.3), torch's own input hook."""
    return ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)


#: The functions through which ``multi_head_attention_forward`` calls ``linear``.
_MHA_FUNCTIONS = ("_in_projection_packed", "_in_projection", "multi_head_attention_forward")


def multi_head_attention_forward_with(linear: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    """``F.multi_head_attention_forward`` with every ``linear`` it calls replaced.

    PyTorch's own bytecode, rebound to globals where ``linear`` is the replacement.

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
        copy = types.FunctionType(
            original.__code__, scope, original.__name__, original.__defaults__, original.__closure__
        )
        copy.__kwdefaults__ = original.__kwdefaults__
        scope[name] = copy
    return scope["multi_head_attention_forward"]


def dtensor_local_offset(t: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``compute_local_shape_and_global_offset`` (torch >= 2.4): a DTensor piece's shape and start."""
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(shape), tuple(offset)
