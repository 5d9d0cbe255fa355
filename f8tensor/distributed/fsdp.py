"""FSDP2 with FP8 weight all-gather: the weight wrapper and the scale precomputation.

Under ``fully_shard`` a :class:`Float8AllGatherWeight` makes the all-gather move FP8 bytes
(as ``uint8``: gloo refuses float8 dtypes) and builds the
:class:`~f8tensor.tensor.float8.Float8Tensor` weight from them, refreshed in place later.

Invariant: the gathered bytes and scales are bit for bit those of one process casting the
full weight. Tensorwise scales come from amaxes all-reduced with MAX (or the delayed
history); row and block scales no shard cuts travel with their shard; blocks the shards cut
get their amax grid all-reduced. A NaN amax becomes inf before any MAX collective (which may
drop a NaN), so a NaN still gives a NaN scale.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from f8tensor.compat import DISABLED_TORCH_FUNCTION, dtensor_local, preserve_version_counter
from f8tensor.quant.block_quantizers import BlockQuantizer, weight_gather_quantizer
from f8tensor.quant.config import CastConfig
from f8tensor.quant.scaling import amax_to_scale, block_amax, delayed_scale, tensor_amax
from f8tensor.tensor.float8 import Float8Tensor
from f8tensor.tensor.weights import HighPrecisionWeight, WriteCount

if dist.is_available():
    from torch.distributed.tensor import DTensor, Shard
else:
    DTensor = ()  # type: ignore[assignment, misc]  # isinstance(x, ()) is always False
    Shard = ()  # type: ignore[assignment, misc]

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = [
    "DTensor",
    "DelayedWeightSource",
    "Float8AllGatherWeight",
    "precompute_float8_scales_for_fsdp",
    "wrap_weight",
]

aten = torch.ops.aten
logger = logging.getLogger("f8tensor")


class DelayedWeightSource:
    """The layer owning a delayed-scaled weight (held weakly): its history gives the scale, its
    ``fsdp_weight_amax`` receives the shard's amax. Compared by identity; a repr that names no object.
    """

    __slots__ = ("_layer", "margin", "reduction")

    def __init__(self, layer: nn.Module, reduction: str, margin: int) -> None:
        self._layer = weakref.ref(layer)
        self.reduction = reduction
        self.margin = margin

    def layer(self) -> nn.Module:
        layer = self._layer()
        if layer is None:
            raise RuntimeError("the layer owning this delayed-scaled FP8 all-gather weight no longer exists")
        return layer

    def __repr__(self) -> str:
        return f"DelayedWeightSource(reduction={self.reduction!r}, margin={self.margin})"


class Float8AllGatherWeight(HighPrecisionWeight):
    """A high-precision weight whose FSDP2 all-gather moves FP8 bytes.

    Otherwise a :class:`~f8tensor.tensor.weights.HighPrecisionWeight`. Fields:

    - ``_hp``: the plain tensor (the whole weight, or a rank's shard).
    - ``_cast``: the weight's :class:`~f8tensor.quant.config.CastConfig`.
    - ``_source``: a delayed cast's :class:`DelayedWeightSource`, else ``None``.
    - ``_writes``: the :class:`~f8tensor.tensor.weights.WriteCount` shared with its views.
    - ``_precomputed``: ``None`` or ``(amax, writes)`` from
      :func:`precompute_float8_scales_for_fsdp`: a cache used only while the write count is
      unchanged; a rebuilt wrapper starts without one.
    """

    _cast: CastConfig
    _source: DelayedWeightSource | None
    _precomputed: tuple[torch.Tensor, int] | None

    # Results that are still the weight stored differently stay wrapped (FSDP's shard and pad
    # views, device and dtype moves, checkpoint buffers); every other op sees plain tensors.
    VIEWS = frozenset(
        {
            aten.detach.default,
            aten.alias.default,
            aten.view.default,
            aten._unsafe_view.default,
            aten.as_strided.default,
            aten.slice.Tensor,
            aten.split.Tensor,
            aten.split_with_sizes.default,
        }
    )
    COPIES = frozenset(
        {
            aten.clone.default,
            aten._to_copy.default,
            aten._pin_memory.default,
            aten.new_zeros.default,
            aten.new_empty.default,
            aten.empty_like.default,
        }
    )

    __torch_function__ = DISABLED_TORCH_FUNCTION

    @staticmethod
    def __new__(  # noqa: PYI034 (typing.Self needs Python 3.11)
        cls,
        hp: torch.Tensor,
        cast: CastConfig,
        source: DelayedWeightSource | None = None,
        *,
        writes: WriteCount | None = None,
    ) -> Float8AllGatherWeight:
        HighPrecisionWeight._check_hp(cls, hp)
        if cast.delayed and not isinstance(source, DelayedWeightSource):
            raise ValueError("a delayed-scaled FP8 all-gather weight needs the DelayedWeightSource of its layer")
        if cast.delayed and not cast.tensorwise:
            raise ValueError(f"delayed scaling is tensorwise; got granularity {cast.granularity}")
        self = HighPrecisionWeight._wrap(cls, hp, writes)
        self._cast = cast
        self._source = source if cast.delayed else None
        self._precomputed = None
        return self

    def _meta(self) -> tuple:
        return (self._cast, self._source)

    def __repr__(self) -> str:  # type: ignore[override]
        fp8 = str(self._cast.dtype).removeprefix("torch.")
        return f"Float8AllGatherWeight({fp8}, {self._hp!r})"

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: tuple, outer_size: Any, outer_stride: Any) -> Float8AllGatherWeight:
        return Float8AllGatherWeight(inner["_hp"], *meta)

    # ----------------------------------------------------------------- FSDP2 extension

    def fsdp_pre_all_gather(
        self,
        mesh: DeviceMesh,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: MixedPrecisionPolicy,
    ) -> tuple[tuple[torch.Tensor, ...], tuple]:
        """The local shard as FP8 bytes padded to FSDP's shard size, with its row or block scales.

        The cast starts from this high-precision shard; ``mp_policy.param_dtype`` only sets the
        dtype the gathered Float8Tensor stands for.
        """
        rows = outer_size[0] if len(outer_size) else 0
        # FSDP pads every shard along dim 0 to the first's size (the zero byte is +0.0 in every FP8 format).
        padded_rows = -(-rows // mesh.size())
        cast = self._cast
        quantizer = weight_gather_quantizer(cast)
        if cast.tensorwise:
            scale = self._tensorwise_scale(mesh)
            hp = torch.where(torch.isinf(self._hp), torch.nan, self._hp) if cast.delayed else self._hp
            data = quantizer.quantize(hp, scale)[0].view(torch.uint8)
            return (_pad_rows(data, padded_rows),), (scale,)
        block = quantizer.spec.block
        if self._cuts_blocks(outer_size, mesh.size()):
            # Blocks span ranks: agreed amaxes, the whole weight's scales on every rank, sent as metadata.
            scale = quantizer.scale_for(self._reduced_amax(mesh, outer_size))
            data = self._cast_rows(quantizer, scale, mesh.get_local_rank() * padded_rows)
            return (_pad_rows(data.view(torch.uint8), padded_rows),), (rows, scale.shape[0], scale.dtype, block, scale)
        block_rows = block[0] if block[0] else 1  # rowwise: (1, 0)
        data, scale = quantizer.quantize(self._hp)
        scale_rows = -(-rows // block_rows)
        if scale.numel() == 0:  # standard strides for the byte view
            scale = torch.empty(scale.shape, dtype=scale.dtype, device=scale.device)
        scale_bytes = scale.contiguous().view(torch.uint8)
        if scale_bytes.shape[0] < padded_rows // block_rows:
            # Pad with real scales (1.0): a padded block's bytes are zero and never read.
            filler = torch.ones(
                (padded_rows // block_rows - scale.shape[0], *scale.shape[1:]), dtype=torch.float32, device=scale.device
            ).to(scale.dtype)
            scale_bytes = torch.cat([scale_bytes, filler.view(torch.uint8)])
        data_bytes = _pad_rows(data.view(torch.uint8), padded_rows)
        if mesh.size() == 1:
            # FSDP2 on one rank copies only the first all-gather input: the scales go as metadata.
            return (data_bytes,), (rows, scale_rows, scale.dtype, block, scale_bytes)
        if rows % mesh.size() == 0:
            return (data_bytes, scale_bytes), (rows, scale_rows, scale.dtype, block, None)
        # Uneven shards: FSDP takes only padded-size inputs, so the scales are gathered apart.
        gathered = torch.empty(
            (mesh.size() * scale_bytes.shape[0], *scale_bytes.shape[1:]), dtype=torch.uint8, device=scale.device
        )
        dist.all_gather_into_tensor(gathered, scale_bytes, group=mesh.get_group())
        return (data_bytes,), (rows, scale_rows, scale.dtype, block, gathered)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: tuple,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[Float8Tensor, tuple[torch.Tensor, ...]] | None:
        """Build (first call) or refresh (``out=``) the unsharded FP8 weight over the gathered buffers.

        With ``out`` the bytes and row or block scales already sit in its storage; only a
        tensorwise scale is updated, in place.
        """
        data = all_gather_outputs[0].view(self._cast.dtype)
        if len(metadata) == 1:  # tensorwise
            (scale,) = metadata
            f8 = None if out is not None else Float8Tensor(data, scale.clone(), param_dtype)
        else:
            rows, scale_rows, scale_dtype, block, gathered = metadata
            scale_bytes = all_gather_outputs[1] if gathered is None else gathered
            scale = scale_bytes.view(scale_dtype)[:scale_rows]
            # The weight is the first `rows` rows, a view: FSDP refills these buffers in place.
            f8 = None if out is not None else Float8Tensor(data[:rows], scale, param_dtype, block)
        if out is None:
            assert f8 is not None
            return f8, tuple(all_gather_outputs)
        if isinstance(out, DTensor):  # 2D (FSDP2 x TP)
            out = dtensor_local(out)
        if not isinstance(out, Float8Tensor) or out._orig_dtype != param_dtype:
            raise RuntimeError(f"fsdp_post_all_gather: out must be the {param_dtype} Float8Tensor built the first time")
        in_buffers = len(all_gather_outputs) > 1
        if out._data.untyped_storage().data_ptr() != data.untyped_storage().data_ptr() or (
            in_buffers and out._scale.untyped_storage().data_ptr() != scale.untyped_storage().data_ptr()
        ):
            raise RuntimeError(
                "fsdp_post_all_gather: FSDP gathered into a new buffer; the unsharded FP8 weight would keep stale bytes"
            )
        if not in_buffers:
            # Saved for backward; a re-gather writes the same value, so hide the write from autograd's
            # check as FSDP does for the bytes.
            with preserve_version_counter(out._scale):
                out._scale.copy_(scale)
        return None

    def _tensorwise_scale(self, mesh: DeviceMesh) -> torch.Tensor:
        """The scale all ranks use: the mesh-reduced amax's, or (delayed) the layer history's.

        A delayed cast hands the shard's amax to the layer (``fsdp_weight_amax``), which reduces it
        and pushes it into the history in backward.
        """
        if not self._cast.delayed:
            amax = self._reduced_amax(mesh)
            return amax_to_scale(amax, self._cast.dtype, round_pow2=self._cast.power_of_2_scale)
        source = self._source
        assert source is not None
        layer = source.layer()
        amax = tensor_amax(self._hp)
        held = layer.__dict__.get("fsdp_weight_amax")
        if isinstance(held, torch.Tensor) and held.device == amax.device:
            # In place: compile guards on it. Saved for backward on one rank (no all-reduce copies
            # it); a backward re-gather writes the same value, so hide the write from autograd's check.
            with preserve_version_counter(held):
                held.copy_(amax)
        else:
            layer.fsdp_weight_amax = amax
        history = layer.amax_history_weight
        assert isinstance(history, torch.Tensor)
        if isinstance(history, DTensor):
            history = dtensor_local(history)
        return delayed_scale(
            history,
            self._cast.dtype,
            reduction=source.reduction,
            margin=source.margin,
            round_pow2=self._cast.power_of_2_scale,
        )

    def _reduced_amax(self, mesh: DeviceMesh, outer_size: torch.Size | None = None) -> torch.Tensor:
        """The amax the ranks agree on: precomputed, or one all-reduce now."""
        cached = self._precomputed
        if cached is not None:
            amax, writes = cached
            if writes == self._writes.n:
                return amax
            self._precomputed = None  # never a stale amax
        rank = mesh.get_local_rank() if outer_size is not None else 0
        amax = self._shard_amax(outer_size, rank, mesh.size())
        _all_reduce_max(amax, mesh)
        return amax

    def _cuts_blocks(self, outer_size: torch.Size | tuple[int, ...], world: int) -> bool:
        """Whether FSDP's row chunks cut this weight's blocks (global facts: every rank agrees)."""
        if self._cast.tensorwise or world == 1 or not len(outer_size):
            return False
        block_rows = self._cast.operand_spec(1).block[0]
        return block_rows > 1 and (-(-outer_size[0] // world)) % block_rows != 0

    def _shard_amax(self, outer_size: torch.Size | tuple[int, ...] | None, rank: int, world: int) -> torch.Tensor:
        """This shard's part of the amax all ranks agree on, fp32.

        Tensorwise: the shard's amax. Cut blocks: the whole block grid, this shard's amaxes and 0
        elsewhere; its first rows may finish a block begun on an earlier rank.
        """
        hp = self._hp
        if self._cast.tensorwise:
            return tensor_amax(hp)
        assert outer_size is not None
        block = self._cast.operand_spec(1).block
        rows, block_rows = outer_size[0], block[0]
        start = rank * -(-rows // world)
        own = max(0, min(-(-rows // world), rows - start))
        if tuple(hp.shape) != (own, *outer_size[1:]):
            raise ValueError(
                f"FP8 all-gather of a {tuple(outer_size)} weight with {block[0]}x{block[1]} blocks: rank {rank} of "
                f"{world} holds a shard of shape {tuple(hp.shape)}; expected its torch.chunk share of dim 0, "
                f"{(own, *outer_size[1:])}. Allowed: FSDP2's default Shard(0) sharding."
            )
        head = min(own, -start % block_rows)
        grid = torch.zeros(
            [1 if b == 0 else -(-n // b) for n, b in zip(outer_size, block)], dtype=torch.float32, device=hp.device
        )
        local = torch.cat([block_amax(hp[:head], (block_rows, *block[1:])), block_amax(hp[head:], block)])
        first = start // block_rows
        grid[first : first + local.shape[0]] = local
        return grid

    def _cast_rows(self, quantizer: BlockQuantizer, scale: torch.Tensor, start: int) -> torch.Tensor:
        """This shard (rows ``start`` on) cast with the whole weight's block scales, row by row."""
        hp = self._hp
        block = quantizer.spec.block
        index = torch.arange(start, start + hp.shape[0], device=scale.device) // block[0]
        # Through bytes: index_select takes e8m0 that way.
        row_scale = scale.view(torch.uint8).index_select(0, index).view(scale.dtype)
        return quantizer.with_block((1, *block[1:])).quantize(hp, row_scale)[0]


def _pad_rows(data: torch.Tensor, rows: int) -> torch.Tensor:
    """``data`` topped up with zero rows to ``rows``."""
    if data.dim() and data.shape[0] < rows:
        pad = [0, 0] * (data.dim() - 1) + [0, rows - data.shape[0]]
        data = torch.nn.functional.pad(data, pad)
    return data


def _all_reduce_max(t: torch.Tensor, mesh: DeviceMesh) -> None:
    """In place: the elementwise max of ``t`` over ``mesh``.

    A NaN becomes inf first: MAX collectives may drop a NaN, inf always wins and gives the same NaN scale.
    """
    if mesh.size() == 1:
        return
    t.masked_fill_(torch.isnan(t), float("inf"))
    for dim in range(mesh.ndim):
        if mesh.size(dim) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))


def wrap_weight(weight: torch.Tensor, cast: CastConfig, source: DelayedWeightSource | None = None) -> nn.Parameter:
    """``weight`` as a Parameter over a :class:`Float8AllGatherWeight` sharing its storage.

    A new Parameter: build the optimizer after the conversion.
    """
    if isinstance(weight, Float8AllGatherWeight):
        return weight  # type: ignore[return-value]
    return nn.Parameter(Float8AllGatherWeight(weight.detach(), cast, source), requires_grad=weight.requires_grad)


def _row_sharded(param: Any) -> bool:
    """A DTensor parameter sharded along dim 0 on every mesh dim (FSDP2's default)."""
    return all(isinstance(p, Shard) and p.dim == 0 for p in param.placements)


def _local_of(t: Any) -> Any:
    """The local tensor of a DTensor, else ``None``."""
    return dtensor_local(t) if isinstance(t, DTensor) else None


@torch.no_grad()
def precompute_float8_scales_for_fsdp(module: nn.Module) -> None:
    """Reduce the amaxes of every sharded weight's next FP8 all-gather at once.

    Call it after ``optimizer.step()``: one all-reduce per mesh for every dynamic tensorwise
    weight and every block grid the shards cut, so the next all-gathers need none. Optional:
    results are identical without it. A stored amax serves while its weight is unchanged.
    Weights must change on all ranks alike (follow ``torch.distributed.checkpoint.load`` with
    ``model.load_state_dict``).

    Args:
        module: the model.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"precompute_float8_scales_for_fsdp expects an nn.Module; got {type(module).__name__}")
    by_mesh: dict[DeviceMesh, list[tuple[Float8AllGatherWeight, torch.Size | None]]] = {}
    for param in module.parameters():
        local = _local_of(param)
        if not isinstance(local, Float8AllGatherWeight):
            continue
        mesh = param.device_mesh  # type: ignore[attr-defined]
        if local._cast.tensorwise and not local._cast.delayed:
            by_mesh.setdefault(mesh, []).append((local, None))
        elif mesh.ndim == 1 and _row_sharded(param) and local._cuts_blocks(param.shape, mesh.size()):
            # 1-D meshes only; others reduce in each all-gather.
            by_mesh.setdefault(mesh, []).append((local, param.shape))
    for mesh, weights in by_mesh.items():
        rank = mesh.get_local_rank() if mesh.ndim == 1 else 0
        amaxes = [w._shard_amax(shape, rank, mesh.size()) for w, shape in weights]
        flat = torch.cat([a.reshape(-1) for a in amaxes])
        _all_reduce_max(flat, mesh)
        for (w, _), local, agreed in zip(weights, amaxes, flat.split([a.numel() for a in amaxes])):
            w._precomputed = (agreed.view(local.shape), w._writes.n)
