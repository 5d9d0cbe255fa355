"""Tensor- and sequence-parallel styles where FP8 changes the communication.

Converted models already run under ``parallelize_module`` with torch's own
``ColwiseParallel``, ``RowwiseParallel`` and ``SequenceParallel``: ``Float8Linear`` takes
DTensor weights and inputs (see :mod:`f8tensor.distributed.dtensor`), and every
collective then moves high-precision values. The styles here move FP8 bytes where the
communication allows it:

- :class:`Float8ColwiseParallel`: ``ColwiseParallel`` whose sequence-parallel input
  all-gather (``input_layouts=Shard(d)``) moves the input cast to FP8, 1 byte per element
  (as ``torch.uint8``, which every backend moves), plus its scales; the gathered
  :class:`~f8tensor.tensor.float8.Float8Tensor` feeds the layer's GEMM as is. An input that is
  already gathered in FP8 (by :class:`PrepareFloat8ModuleInput`) is taken as torch takes it.
- :class:`PrepareFloat8ModuleInput`: ``PrepareModuleInput`` whose ``Shard(d) ->
  Replicate()`` redistributions gather in FP8 the same way: gather once for a module
  whose several FP8 layers take the same input (attention's q, k, v; an MLP's w1 and w3).
- :class:`Float8RowwiseParallel`: ``RowwiseParallel`` for ``Float8Linear``. Its outputs
  are partial sums, reduced (or reduce-scattered) in high precision: FP8 partial sums
  would each be rounded before the sum. Its communication is torch's; it checks the module.

What is gathered, per recipe. The gather casts the local shard with the layer's input
cast (``config.input``): tensorwise with a scale agreed across the group (the amax
all-reduced with MAX over the mesh, then the scale rule), so the gathered bytes and scale
equal one process's cast of the full tensor, bit for bit. Rowwise, 1x128 and MX 1x32
scale each token's row along K, which the sequence shard never cuts: each rank casts its
rows with their own scales and the scales are gathered with the bytes (4 bytes, or 1 for
e8m0, per row or block); the result again equals one process's cast. Gathering along K
(the last dim) would cut those rows: refused with a ``ValueError``. Delayed input casts
take their scale from the layer's history and push the amax in backward: they gather in
high precision, as torch's styles do.

Backward: as torch's ``Shard(d) -> Replicate()`` redistribute. The gathered input is a
replicated DTensor (over the ``Float8Tensor``) and its gradient goes back per the
placement its consumers give it: a partial sum (column-parallel layers: the weight is
sharded on N) is reduce-scattered to the shards in high precision; a replicated gradient
(replicated consumers, or the plain tensor of ``use_local_output=True``) is split. The
weight-gradient GEMM reuses the gathered FP8 input when it is tensorwise (the same bytes
one process keeps); the other recipes re-cast it along the tokens from its dequantized values (one
rounding more than one process, which casts the high-precision input).
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
    """Forward: cast the local shard to FP8 and all-gather bytes and scales along ``dim``;
    the result is a ``Replicate()`` DTensor over the gathered ``Float8Tensor``.

    Backward: what torch's ``Shard(dim) -> Replicate()`` redistribute does, no more: the
    gradient comes back as a DTensor whose placement its consumers decided (``Partial``
    from column-parallel layers, ``Replicate`` from replicated ones, a plain tensor from
    ``to_local()``'s default: ``Replicate``) and is redistributed to ``Shard(dim)``: a
    reduce-scatter of a partial sum, a local split of a replicated one."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, local: torch.Tensor, mesh: DeviceMesh, dim: int, full_shape: tuple[int, ...], cast: CastConfig
    ) -> DTensor:
        quantizer = input_gather_quantizer(cast, local.dim())
        scale = None
        if not quantizer.spec.block:  # tensorwise: one scale for the whole gathered tensor, agreed
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
        return DTensor.from_local(gathered, mesh, [Replicate()], run_check=False, shape=shape, stride=_contiguous(shape))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:  # type: ignore[override]
        if not isinstance(grad, DTensor):  # a plain gradient of the replicated tensor
            shape = torch.Size(ctx.full_shape)
            grad = DTensor.from_local(grad, ctx.mesh, [Replicate()], run_check=False, shape=shape, stride=_contiguous(shape))
        return waited(grad.redistribute(ctx.mesh, [Shard(ctx.dim)]).to_local()), None, None, None, None


def _gather(local: torch.Tensor, mesh: DeviceMesh, dim: int, full_shape: Sequence[int]) -> torch.Tensor:
    """All-gather a ``Shard(dim)`` local tensor (torch.chunk sizes, uneven allowed) into the full one."""
    stride = _contiguous(full_shape)
    dt = DTensor.from_local(local.contiguous(), mesh, [Shard(dim)], run_check=False, shape=torch.Size(full_shape), stride=stride)
    # full_tensor() may hand back an AsyncCollectiveTensor (a view of it stays one): wait
    # here, so that no gather is left in flight inside the Float8Tensor built from it.
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
    """``x`` (a ``Shard(dim)`` DTensor over the 1D ``mesh``, or its local shard) all-gathered
    as FP8 bytes with the scales of ``cast`` (see the module docstring): a plain
    :class:`~f8tensor.tensor.float8.Float8Tensor` of the full shape, differentiable.

    ``grad_placement``: what the gradient of the returned tensor is, as in
    ``DTensor.to_local(grad_placements=...)``: ``Partial()`` (the default: the consumers
    are column-parallel layers, each rank's gradient a partial sum, reduce-scattered back)
    or ``Replicate()`` (replicated consumers: every rank holds the full gradient, split
    back to the shards)."""
    placement = Partial() if grad_placement is None else grad_placement
    if not isinstance(placement, (Partial, Replicate)):
        raise TypeError(f"float8_all_gather: grad_placement must be Partial() or Replicate(); got {placement}")
    return _float8_all_gather(x, mesh, dim, cast).to_local(grad_placements=[placement])  # type: ignore[return-value]


def _float8_all_gather(x: torch.Tensor, mesh: DeviceMesh, dim: int, cast: CastConfig) -> DTensor:
    """The FP8 gather as torch's ``Shard(dim) -> Replicate()`` redistribute: a replicated
    DTensor over the gathered Float8Tensor, whose backward follows its gradient's placement."""
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
    """The gathered length of a dim whose local length is ``local_len`` on every rank (even
    shards: a plain local tensor does not say how an uneven one was cut)."""
    return local_len * mesh.size()


def _fp8_gather_or_none(
    x: Any, mesh: DeviceMesh, layout: Placement | None, desired: Placement | None, cast: CastConfig
) -> DTensor | None:
    """The FP8-gathered input (a replicated DTensor) for a ``Shard(d) -> Replicate()`` move
    of a floating tensor with a dynamic cast; ``None`` where the move is another one
    (torch's styles do it)."""
    if not (isinstance(layout, Shard) and isinstance(desired, Replicate) and isinstance(x, torch.Tensor)):
        return None
    if _is_float8(x) or not x.is_floating_point() or cast.delayed:
        return None
    return _float8_all_gather(x, mesh, layout.dim, cast)


def _is_float8(x: Any) -> bool:
    """A Float8Tensor, or a DTensor over one (an input gathered in FP8 already)."""
    return isinstance(x, Float8Tensor) or (isinstance(x, DTensor) and isinstance(dtensor_local(x), Float8Tensor))


class Float8ColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for a ``Float8Linear`` whose sequence-parallel input all-gather
    moves FP8 bytes (see the module docstring). Arguments: those of ``ColwiseParallel``.

    An input gathered in FP8 already (by :class:`PrepareFloat8ModuleInput`) is taken as
    torch's ``ColwiseParallel`` takes a prepared input: a replicated DTensor as it is (its
    gradient leaves as a partial sum), a plain tensor as a replicated one (its gradient is
    all-reduced, as ``DTensor.from_local`` does)."""

    @staticmethod
    def _prepare_input_fn(  # type: ignore[override]
        input_layouts: Any, desired_input_layouts: Any, mod: Float8Linear, inputs: Any, device_mesh: DeviceMesh
    ) -> Any:
        x = inputs[0]
        if isinstance(x, Float8Tensor):  # gathered in FP8 already, handed over as a plain tensor
            return DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
        gathered = _fp8_gather_or_none(x, device_mesh, input_layouts[0], desired_input_layouts[0], mod.config.input)
        if gathered is not None:
            return gathered
        return colwise_prepare_input(input_layouts, desired_input_layouts, mod, inputs, device_mesh)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_float8_linear(self, module)
        return super()._apply(module, device_mesh)


class Float8RowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` for a ``Float8Linear`` (see the module docstring: its partial sums
    are reduced in high precision). Arguments: those of ``RowwiseParallel``."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_float8_linear(self, module)
        return super()._apply(module, device_mesh)


class PrepareFloat8ModuleInput(PrepareModuleInput):
    """``PrepareModuleInput`` whose ``Shard(d) -> Replicate()`` input moves gather FP8 bytes.

    The prepared input is what torch's ``PrepareModuleInput`` hands over, in FP8: a
    replicated DTensor over the gathered ``Float8Tensor``, or its local tensor with
    ``use_local_output=True``; its gradient goes back exactly as torch's does (reduce-
    scattered where the consumers' gradients are partial sums, split where they are
    replicated or where a plain tensor was handed over).

    ``config``: the ``Float8LinearConfig`` whose ``input`` cast the gather uses. A
    ``Float8Linear`` takes a ``Float8Tensor`` input as it is, so the cast must be its own.
    Default (``None``): the input cast of the ``Float8Linear`` layers of the module the
    style is applied to (what a user who converted the model with one recipe expects);
    the ``"tensorwise"`` recipe's where the module holds none. Layers with different input
    casts in that module raise a ``ValueError`` at ``parallelize_module`` (pass ``config``).
    A layer that gets a gathered input of another cast raises a ``TypeError`` naming both
    casts: it is never silently re-cast (one more rounding, and bytes that no longer equal
    one process's). FP4 and per-GEMM-format configs are refused (no DTensor support).
    Other arguments: those of ``PrepareModuleInput``.
    """

    def __init__(self, *, config: Float8LinearConfig | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if config is not None and config.uses_gemm_formats:
            raise ValueError(f"PrepareFloat8ModuleInput: config uses FP4 or per-GEMM formats: {NOT_ON_DTENSORS}")
        self.config = config

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # One style may be applied to several modules (a plan with wildcards): the default
        # config is resolved per module, on a copy.
        style = copy.copy(self)
        style.config = self.config if self.config is not None else _consumers_config(module)
        return super(PrepareFloat8ModuleInput, style)._apply(module, device_mesh)  # torch's, on the copy

    def _prepare_input_arg(  # type: ignore[override]
        self, input: Any, mesh: DeviceMesh, input_layout: Placement | None, desired_layout: Placement | None
    ) -> Any:
        config = self.config if self.config is not None else Float8LinearConfig.from_recipe("tensorwise")
        gathered = _fp8_gather_or_none(input, mesh, input_layout, desired_layout, config.input)
        if gathered is not None:
            # to_local() as torch's: the plain tensor's gradient is a replicated one.
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
