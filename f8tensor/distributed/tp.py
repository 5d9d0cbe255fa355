"""Tensor- and sequence-parallel styles that move FP8 bytes where the communication allows.

- :class:`Float8ColwiseParallel`: its sequence-parallel input all-gather moves the input
  cast to FP8 (as ``uint8``) with its scales.
- :class:`PrepareFloat8ModuleInput`: ``Shard(d) -> Replicate()`` input moves gathered in
  FP8, once for several layers taking the same input.
- :class:`Float8RowwiseParallel`: partial sums reduced in high precision (FP8 partial sums
  would each be rounded before the sum).

Invariant: the gathered bytes and scales equal one process's cast of the full tensor
(tensorwise scales agreed by a MAX all-reduce; row and block scales per token, which a
sequence shard never cuts). Gathering along K is refused; delayed casts gather in high
precision. Backward is torch's ``Shard(d) -> Replicate()`` redistribute.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from f8tensor.compat import colwise_prepare_input, dtensor_local, functional_all_reduce_max, waited
from f8tensor.nn.linear import NOT_ON_DTENSORS, Float8Linear
from f8tensor.quant.block_quantizers import input_gather_quantizer
from f8tensor.quant.config import CastConfig, Float8LinearConfig
from f8tensor.quant.formats import FLOAT8_DTYPES
from f8tensor.quant.scaling import tensor_amax
from f8tensor.tensor.float8 import Float8Tensor

__all__ = ["Float8ColwiseParallel", "Float8RowwiseParallel", "PrepareFloat8ModuleInput", "float8_all_gather"]


class _Float8AllGather(torch.autograd.Function):
    """Cast the local shard to FP8 and all-gather bytes and scales into a ``Replicate()`` DTensor.

    Backward: torch's ``Shard(dim) -> Replicate()`` redistribute of the gradient's placement.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, local: torch.Tensor, mesh: DeviceMesh, dim: int, full_shape: tuple[int, ...], cast: CastConfig
    ) -> DTensor:
        quantizer = input_gather_quantizer(cast, local.dim())
        scale = None
        if not quantizer.spec.block:  # tensorwise: one agreed scale
            scale = quantizer.scale_for(functional_all_reduce_max(tensor_amax(local), mesh.get_group()))
        data, scale = quantizer.quantize(local, scale)
        data = _gather(data.view(torch.uint8), mesh, dim, full_shape).view(data.dtype)
        if quantizer.spec.block:
            scale_shape = list(full_shape)
            scale_shape[-1] = scale.shape[-1]
            raw = scale.view(torch.uint8) if scale.dtype != torch.float32 else scale
            scale = _gather(raw, mesh, dim, scale_shape).view(scale.dtype)
        ctx.mesh, ctx.dim, ctx.full_shape = mesh, dim, full_shape
        gathered = Float8Tensor(data, scale, local.dtype, quantizer.block_of(local.dim()))
        shape = torch.Size(full_shape)
        return DTensor.from_local(
            gathered, mesh, [Replicate()], run_check=False, shape=shape, stride=_contiguous(shape)
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:  # type: ignore[override]
        if not isinstance(grad, DTensor):
            shape = torch.Size(ctx.full_shape)
            grad = DTensor.from_local(
                grad, ctx.mesh, [Replicate()], run_check=False, shape=shape, stride=_contiguous(shape)
            )
        return waited(grad.redistribute(ctx.mesh, [Shard(ctx.dim)]).to_local()), None, None, None, None


def _gather(local: torch.Tensor, mesh: DeviceMesh, dim: int, full_shape: Sequence[int]) -> torch.Tensor:
    """All-gather a ``Shard(dim)`` local tensor (torch.chunk sizes, uneven allowed) into the full one."""
    stride = _contiguous(full_shape)
    dt = DTensor.from_local(
        local.contiguous(), mesh, [Shard(dim)], run_check=False, shape=torch.Size(full_shape), stride=stride
    )
    # full_tensor() may return an AsyncCollectiveTensor: wait, so no gather stays in flight.
    return waited(dt.full_tensor())


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    strides: list[int] = []
    acc = 1
    for s in reversed(list(shape)):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def float8_all_gather(
    x: torch.Tensor, mesh: DeviceMesh, dim: int, cast: CastConfig, *, grad_placement: Placement | None = None
) -> Float8Tensor:
    """``x`` (a ``Shard(dim)`` DTensor over a 1D mesh, or its local shard) all-gathered in FP8.

    Args:
        x: the tensor or local shard.
        mesh: the 1D tensor-parallel mesh.
        dim: the sharded dim (not the last).
        cast: the dynamic input cast.
        grad_placement: the gradient's placement, ``Partial()`` (default) or ``Replicate()``.

    Returns:
        A differentiable :class:`~f8tensor.tensor.float8.Float8Tensor` of the full shape.

    Raises:
        TypeError: another ``grad_placement``.
        ValueError: a mesh of more than 1 dim, a delayed cast, or a gather along K.
    """
    placement = Partial() if grad_placement is None else grad_placement
    if not isinstance(placement, (Partial, Replicate)):
        raise TypeError(f"float8_all_gather: grad_placement must be Partial() or Replicate(); got {placement}")
    return _float8_all_gather(x, mesh, dim, cast).to_local(grad_placements=[placement])  # type: ignore[return-value]


def _float8_all_gather(x: torch.Tensor, mesh: DeviceMesh, dim: int, cast: CastConfig) -> DTensor:
    """The FP8 gather as a replicated DTensor over the gathered Float8Tensor."""
    if mesh.ndim != 1:
        raise ValueError(f"float8_all_gather gathers over a 1D mesh (the tensor-parallel one); got {mesh.ndim} dims")
    if cast.dtype not in FLOAT8_DTYPES:
        raise NotImplementedError(f"float8_all_gather: a cast to {cast.dtype}: {NOT_ON_DTENSORS}")
    if cast.delayed:
        raise ValueError("float8_all_gather needs a dynamic cast (a delayed input cast gathers in high precision)")
    ndim = x.dim()
    dim = dim % ndim
    if dim == ndim - 1 and cast.operand_spec(ndim - 1, ndim=ndim).block:
        raise ValueError(
            "float8_all_gather along the last dim (K) would cut the per-row scales of a "
            f"{cast.granularity} cast; shard the tokens (Shard(0) or Shard(1)) instead"
        )
    if isinstance(x, DTensor):
        full_shape = tuple(x.shape)
        local = x.to_local()
    else:
        sizes = list(x.shape)
        sizes[dim] = _full_length(x.shape[dim], mesh)
        full_shape = tuple(sizes)
        local = x
    return _Float8AllGather.apply(local, mesh, dim, full_shape, cast)


def _full_length(local_len: int, mesh: DeviceMesh) -> int:
    """The gathered length of a dim of even shards."""
    return local_len * mesh.size()


def _fp8_gather_or_none(
    x: Any, mesh: DeviceMesh, layout: Placement | None, desired: Placement | None, cast: CastConfig
) -> DTensor | None:
    """The FP8-gathered input for a ``Shard(d) -> Replicate()`` move, else ``None``."""
    if not (isinstance(layout, Shard) and isinstance(desired, Replicate) and isinstance(x, torch.Tensor)):
        return None
    if _is_float8(x) or not x.is_floating_point() or cast.delayed:
        return None
    return _float8_all_gather(x, mesh, layout.dim, cast)


def _is_float8(x: Any) -> bool:
    """A Float8Tensor, or a DTensor over one."""
    return isinstance(x, Float8Tensor) or (isinstance(x, DTensor) and isinstance(dtensor_local(x), Float8Tensor))


class Float8ColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for a ``Float8Linear``, its input all-gather in FP8.

    An input gathered in FP8 already is taken as torch takes a prepared input.
    """

    @staticmethod
    def _prepare_input_fn(  # type: ignore[override]
        input_layouts: Any, desired_input_layouts: Any, mod: Float8Linear, inputs: Any, device_mesh: DeviceMesh
    ) -> Any:
        x = inputs[0]
        if isinstance(x, Float8Tensor):  # gathered in FP8 already
            return DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
        gathered = _fp8_gather_or_none(x, device_mesh, input_layouts[0], desired_input_layouts[0], mod.config.input)
        if gathered is not None:
            return gathered
        return colwise_prepare_input(input_layouts, desired_input_layouts, mod, inputs, device_mesh)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_float8_linear(self, module)
        return super()._apply(module, device_mesh)


class Float8RowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` for a ``Float8Linear``; partial sums reduced in high precision."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_float8_linear(self, module)
        return super()._apply(module, device_mesh)


class PrepareFloat8ModuleInput(PrepareModuleInput):
    """``PrepareModuleInput`` whose ``Shard(d) -> Replicate()`` input moves gather FP8 bytes.

    Args:
        config: the ``Float8LinearConfig`` whose input cast the gather uses; default: that of
            the module's ``Float8Linear`` layers (``"tensorwise"`` where it has none).
        kwargs: those of ``PrepareModuleInput``.

    Raises:
        ValueError: FP4 or per-GEMM formats; layers of the module that cast their input
            differently (at ``parallelize_module``).

    A layer given a gathered input of another cast raises ``TypeError``: never re-cast.
    """

    def __init__(self, *, config: Float8LinearConfig | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if config is not None and config.uses_gemm_formats:
            raise ValueError(f"PrepareFloat8ModuleInput: config uses FP4 or per-GEMM formats: {NOT_ON_DTENSORS}")
        self.config = config

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # One style may serve several modules: resolve the default per module, on a copy.
        style = copy.copy(self)
        style.config = self.config if self.config is not None else _consumers_config(module)
        return super(PrepareFloat8ModuleInput, style)._apply(module, device_mesh)

    def _prepare_input_arg(  # type: ignore[override]
        self, input: Any, mesh: DeviceMesh, input_layout: Placement | None, desired_layout: Placement | None
    ) -> Any:
        config = self.config if self.config is not None else Float8LinearConfig.from_recipe("tensorwise")
        gathered = _fp8_gather_or_none(input, mesh, input_layout, desired_layout, config.input)
        if gathered is not None:
            return gathered.to_local() if self.use_local_output else gathered
        return super()._prepare_input_arg(input, mesh, input_layout, desired_layout)


def _consumers_config(module: nn.Module) -> Float8LinearConfig:
    """The config whose input cast the ``Float8Linear`` layers of ``module`` share."""
    layers = [(name, m) for name, m in module.named_modules() if isinstance(m, Float8Linear)]
    casts: dict[CastConfig, list[str]] = {}
    for name, m in layers:
        if m.config.uses_gemm_formats:
            raise ValueError(f"PrepareFloat8ModuleInput: layer {name or '(the module)'!r} {NOT_ON_DTENSORS}")
        casts.setdefault(m.config.input, []).append(name or "(the module)")
    if len(casts) > 1:
        seen = "; ".join(f"{c.dtype} {c.granularity} {c.scaling} in {', '.join(names)}" for c, names in casts.items())
        raise ValueError(
            "PrepareFloat8ModuleInput: the Float8Linear layers of this module cast their input differently "
            f"({seen}); pass config= the Float8LinearConfig of the layers that take the gathered input"
        )
    if not layers:
        return Float8LinearConfig.from_recipe("tensorwise")
    return layers[0][1].config


def _check_float8_linear(style: Any, module: nn.Module) -> None:
    if not isinstance(module, Float8Linear):
        raise TypeError(
            f"{type(style).__name__} applies to a Float8Linear; got {type(module).__name__} "
            f"(use torch's {type(style).__mro__[1].__name__} for other modules)"
        )
    if module.config.uses_gemm_formats:
        raise NotImplementedError(f"{type(style).__name__}: {NOT_ON_DTENSORS}")
