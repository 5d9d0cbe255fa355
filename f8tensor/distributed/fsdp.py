"""FSDP2 with FP8 weight all-gather: the weight wrapper and the scale precomputation.

Under ``torch.distributed.fsdp.fully_shard`` every rank holds a shard of each weight (rows,
dim 0) and all-gathers the full weight before a layer runs. A :class:`Float8AllGatherWeight`
makes that all-gather move FP8 bytes instead of bf16/fp32 ones, for every recipe:

- ``fsdp_pre_all_gather`` casts the local shard as the layer's forward would cast the full
  weight and hands FSDP the FP8 bytes viewed as ``torch.uint8`` (one byte per element, a
  dtype every backend moves; gloo refuses the float8 dtypes), plus, where the scales vary
  along the rows, the shard's scales.
- ``fsdp_post_all_gather`` views the gathered bytes as FP8 again and builds the
  :class:`~f8tensor.tensor.Float8Tensor` that ``Float8Linear`` takes as its weight; from
  the second all-gather on it refreshes that same tensor in place (``out=``), so the
  unsharded parameter is one object for the whole run.

What each weight cast gathers, and why the gathered bytes are exactly those a single
process would produce by casting the full weight (FP8 all-gather changes the traffic, not
the numerics of the forward):

- dynamic tensorwise: one scale from the amax of the shards reduced with MAX over the mesh
  (one all-reduce, or none after :func:`precompute_float8_scales_for_fsdp`).
- delayed tensorwise: the scale from the layer's weight amax history, which every rank
  holds alike (histories are fed all-reduced amaxes), so no collective decides it; the
  shard's amax goes to the layer, which reduces it over all ranks in forward and pushes
  it into the history in backward, as it does for a weight it casts itself.
- rowwise: one scale per row, and a row never spans two shards: each shard is cast on its
  own and its row scales travel with it (4 bytes per row), in FSDP's own all-gather when
  the shards are even, in an all-gather of their own when they are not (FSDP takes only
  inputs of the padded shard's size from a rank with padding).
- blocks (128x128, MX 1x32, any block): the same, one scale per block, as long as no
  shard cuts a block. FSDP shards rows in chunks of ``ceil(rows / world)``; when that is
  not a multiple of the block's rows the all-gather raises a ``ValueError`` naming the
  shapes (no padding: padding a weight's rows inside a shard would need FSDP to shard a
  padded parameter, which changes its shape for the optimizer and checkpoints). A 1xB
  block (MX) is never cut by a row shard.

The backward's ``grad_x = grad_output @ W`` contracts over the rows (N), which these scales
vary along for rowwise and 1x32 blocks; the linear Function handles that on the gathered
bytes (see ``functions.py``): rowwise folds the row scales into grad_output before its
per-token cast, 1x32 blocks re-quantize the gathered weight to 32x1 blocks (a second
rounding, in the backward only), 128x128 blocks serve both products as they are.

:func:`precompute_float8_scales_for_fsdp` moves the amax all-reduce out of the per-layer
all-gathers: after ``optimizer.step()`` it reduces every dynamic tensorwise weight's amax in
one collective; delayed, rowwise and block scales need no collective at all.

The wrapper sits below the modules: ``Float8Linear`` chooses it as its weight's type when
its config asks for FP8 all-gather (and, for delayed scaling, hands it a reference to
itself, where the history lives); the model converter (``convert.py``) keeps tied weights
tied.

Layer: ``distributed.fsdp``, above ``weights``; imports ``weights``, ``tensor``, ``kernels``,
``scaling``, ``config``, ``compat``.
"""


from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from f8tensor import kernels
from f8tensor.compat import DISABLED_TORCH_FUNCTION, dtensor_local, preserve_version_counter
from f8tensor.config import CastConfig, CastSpec
from f8tensor.scaling import amax_to_scale, delayed_scale, tensor_amax
from f8tensor.tensor import Float8Tensor
from f8tensor.weights import HighPrecisionWeight, WriteCount

if dist.is_available():
    from torch.distributed.tensor import DTensor
else:  # a torch build without torch.distributed: no parameter is ever a DTensor
    DTensor = ()  # type: ignore[assignment, misc]  # isinstance(x, ()) is always False

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["DTensor", "DelayedWeightSource", "Float8AllGatherWeight", "precompute_float8_scales_for_fsdp", "wrap_weight"]

aten = torch.ops.aten
logger = logging.getLogger("f8tensor")


class DelayedWeightSource:
    """Where a delayed-scaled weight's all-gather finds its scale and leaves its amax: the
    layer that owns the weight (held weakly), whose ``amax_history_weight`` buffer gives the
    scale and whose ``fsdp_weight_amax`` attribute receives the shard's amax, for the layer
    to reduce and push into that history.

    Compared by identity (one per layer); its repr names no object, so fingerprints of the
    wrapper stay stable across processes."""

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

    For every op it behaves like the plain tensor it wraps (optimizer steps, ``copy_``,
    ``zero_``, DTensor sharding, checkpoints: see :class:`~f8tensor.weights.HighPrecisionWeight`);
    only FSDP's all-gather hooks differ. Fields:

    - ``_hp``: the plain bf16/fp16/fp32 tensor (the whole weight, or a rank's shard).
    - ``_cast``: the weight's :class:`~f8tensor.config.CastConfig` (FP8 dtype, granularity,
      scaling, power-of-2 rounding), any recipe's.
    - ``_source``: for a delayed cast, its :class:`DelayedWeightSource`; else ``None``.
    - ``_writes``: a :class:`~f8tensor.weights.WriteCount` shared with every wrapper that
      views the same data; each op that writes into any of them (optimizer steps,
      ``copy_``, ``load_state_dict``, checkpoint loads) counts, whichever subclass
      dispatched it.
    - ``_precomputed``: ``None``, or ``(amax, writes)`` from
      :func:`precompute_float8_scales_for_fsdp`: a 0-dim fp32 amax reduced over the mesh
      (dynamic tensorwise casts only) and the write count it was computed at. A cache,
      not part of the tensor: used only while the count is unchanged; a rebuilt wrapper
      (a view, or flatten and unflatten under compile) starts without one and computes
      its scale afresh.
    """

    _cast: CastConfig
    _source: DelayedWeightSource | None
    _precomputed: tuple[torch.Tensor, int] | None

    # Ops whose result is still "the weight", only stored differently, stay wrapped: the
    # views and copies FSDP uses to shard and pad a parameter, DTensor's local views, device
    # and dtype moves, and the buffers checkpoint loading allocates. Every other op
    # (arithmetic, reductions, the optimizer's math) sees and returns plain tensors.
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
        """The local shard as FP8 bytes (``torch.uint8``), padded to FSDP's shard size, and,
        for row or block scales, the shard's scales (as bytes, padded alike).

        The cast always starts from this high-precision shard (the fp32 master weight
        under a bf16 ``MixedPrecisionPolicy``), so ``mp_policy.param_dtype`` only sets the
        dtype the Float8Tensor stands for, in :meth:`fsdp_post_all_gather`.
        """
        rows = outer_size[0] if len(outer_size) else 0
        # FSDP pads every shard along dim 0 to the size of the first one (torch.chunk's
        # ceil(rows / world)): an uneven or empty shard is topped up with zero bytes (the
        # zero byte is +0.0 in every FP8 format). Unpadded shards (other shard dims, which
        # FSDP requires to be even) come out at their own size.
        padded_rows = -(-rows // mesh.size())
        cast = self._cast
        if cast.tensorwise:
            scale = self._tensorwise_scale(mesh)
            hp = torch.where(torch.isinf(self._hp), torch.nan, self._hp) if cast.delayed else self._hp
            data = kernels.cast(hp, CastSpec(cast.dtype), scale)[0].view(torch.uint8)
            return (_pad_rows(data, padded_rows),), (scale,)
        # Row and block scales: computed from the shard alone, equal to the full weight's
        # when no shard cuts a block (checked here, on every rank alike).
        spec = cast.operand_spec(1)
        block_rows = spec.block[0] if spec.block[0] else 1  # rowwise: (1, 0)
        if mesh.size() > 1 and padded_rows % block_rows:
            raise ValueError(
                f"FP8 all-gather of {tuple(outer_size)} weights with {spec.block[0]}x{spec.block[1]} blocks over "
                f"{mesh.size()} FSDP ranks: each rank holds ceil({rows} / {mesh.size()}) = {padded_rows} rows, which "
                f"cuts a block of {block_rows} rows. Allowed: a row count whose per-rank chunk is a multiple of "
                f"{block_rows} (e.g. a multiple of {block_rows * mesh.size()}), another number of ranks, or "
                f"enable_fsdp_float8_all_gather=False for this layer."
            )
        data, scale = kernels.cast(self._hp, spec)
        scale_rows = -(-rows // block_rows)
        if scale.numel() == 0:  # an empty shard's scales: standard strides, for the byte view
            scale = torch.empty(scale.shape, dtype=scale.dtype, device=scale.device)
        scale_bytes = scale.contiguous().view(torch.uint8)
        if scale_bytes.shape[0] < padded_rows // block_rows:
            # Pad with real scales (1.0): a padded block's bytes are zero and never read.
            filler = torch.ones(
                (padded_rows // block_rows - scale.shape[0], *scale.shape[1:]), dtype=torch.float32, device=scale.device
            ).to(scale.dtype)
            scale_bytes = torch.cat([scale_bytes, filler.view(torch.uint8)])
        data_bytes = _pad_rows(data.view(torch.uint8), padded_rows)
        if rows % mesh.size() == 0:
            # Even shards: the scales ride in FSDP's own all-gather, as a second input.
            return (data_bytes, scale_bytes), (rows, scale_rows, scale.dtype, spec.block, None)
        # Uneven shards: FSDP takes only inputs of the padded shard's size from a rank with
        # padding, so the scales (a few bytes per row or block) get an all-gather of their own.
        gathered = torch.empty((mesh.size() * scale_bytes.shape[0], *scale_bytes.shape[1:]), dtype=torch.uint8, device=scale.device)
        dist.all_gather_into_tensor(gathered, scale_bytes, group=mesh.get_group())
        return (data_bytes,), (rows, scale_rows, scale.dtype, spec.block, gathered)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: tuple,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[Float8Tensor, tuple[torch.Tensor, ...]] | None:
        """Build (first call) or refresh (``out=``) the unsharded FP8 weight.

        First call: a Float8Tensor over the gathered bytes (no copy), standing for
        ``param_dtype``, and the gathered buffers as the inner tensors FSDP frees after use
        and re-allocates before the next all-gather. With ``out`` (FSDP's unsharded
        parameter, built from the first result): the new bytes (and row or block scales)
        already sit in its storage, so only a tensorwise scale is updated, in place.
        """
        data = all_gather_outputs[0].view(self._cast.dtype)
        if len(metadata) == 1:  # tensorwise: the scale came as metadata
            (scale,) = metadata
            f8 = None if out is not None else Float8Tensor(data, scale.clone(), param_dtype)
        else:
            rows, scale_rows, scale_dtype, block, gathered = metadata
            # Even shards: the scales are FSDP's second output; uneven: gathered apart.
            scale_bytes = all_gather_outputs[1] if gathered is None else gathered
            scale = scale_bytes.view(scale_dtype)[:scale_rows]
            # The gathered buffers hold every rank's padded chunk: the weight is their first
            # `rows` rows (a view: FSDP refills these buffers in place for later gathers).
            f8 = None if out is not None else Float8Tensor(data[:rows], scale, param_dtype, block)
        if out is None:
            assert f8 is not None  # built above whenever out is None
            return f8, tuple(all_gather_outputs)
        if isinstance(out, DTensor):  # 2D (FSDP2 x TP): the unsharded parameter is a TP DTensor
            out = dtensor_local(out)
        if not isinstance(out, Float8Tensor) or out._orig_dtype != param_dtype:
            raise RuntimeError(f"fsdp_post_all_gather: out must be the {param_dtype} Float8Tensor built the first time")
        in_buffers = len(all_gather_outputs) > 1  # the scales sit in FSDP's buffers as well
        if out._data.untyped_storage().data_ptr() != data.untyped_storage().data_ptr() or (
            in_buffers and out._scale.untyped_storage().data_ptr() != scale.untyped_storage().data_ptr()
        ):
            raise RuntimeError(
                "fsdp_post_all_gather: FSDP gathered into a new buffer; the unsharded FP8 weight would keep stale bytes"
            )
        if not in_buffers:
            # The scale is saved for backward by Float8Linear. With reshard_after_forward=True
            # the weight is gathered again for backward, from the same unchanged shard, so the
            # value written here equals the saved one: hide the write from autograd's check,
            # exactly as FSDP does for the gathered bytes themselves.
            with preserve_version_counter(out._scale):
                out._scale.copy_(scale)
        return None

    def _tensorwise_scale(self, mesh: DeviceMesh) -> torch.Tensor:
        """The scale all ranks use for this tensorwise weight. Dynamic: from the amax reduced
        over the mesh (precomputed, or one all-reduce now). Delayed: from the layer's
        history, the same on every rank, with no collective; the shard's own amax goes to
        the layer (``fsdp_weight_amax``), whose Function reduces it over all ranks and
        pushes it into that history in backward, as it does for a weight it casts itself."""
        if not self._cast.delayed:
            amax = self._reduced_amax(mesh)
            return amax_to_scale(amax, self._cast.dtype, round_pow2=self._cast.power_of_2_scale)
        source = self._source
        assert source is not None  # a delayed cast always has its source (checked in __new__)
        layer = source.layer()
        amax = tensor_amax(self._hp)  # 0 for an empty shard
        held = layer.__dict__.get("fsdp_weight_amax")
        if isinstance(held, torch.Tensor) and held.device == amax.device:
            held.copy_(amax)  # in place: one tensor for the whole run (compile guards on it)
        else:
            layer.fsdp_weight_amax = amax
        history = layer.amax_history_weight
        assert isinstance(history, torch.Tensor)  # a buffer of the layer
        if isinstance(history, DTensor):  # tensor parallel replicates the layer's buffers
            history = dtensor_local(history)
        return delayed_scale(
            history,
            self._cast.dtype,
            reduction=source.reduction,
            margin=source.margin,
            round_pow2=self._cast.power_of_2_scale,
        )

    def _reduced_amax(self, mesh: DeviceMesh) -> torch.Tensor:
        """The amax of the whole weight: precomputed, or one all-reduce now."""
        cached = self._precomputed
        if cached is not None:
            amax, writes = cached
            if writes == self._writes.n:
                return amax
            self._precomputed = None  # the weight changed since: never use a stale amax
        amax = tensor_amax(self._hp)  # 0 for an empty shard
        _all_reduce_max(amax, mesh)
        return amax


def _pad_rows(data: torch.Tensor, rows: int) -> torch.Tensor:
    """``data`` topped up with zero rows (dim 0) to ``rows``."""
    if data.dim() and data.shape[0] < rows:
        pad = [0, 0] * (data.dim() - 1) + [0, rows - data.shape[0]]
        data = torch.nn.functional.pad(data, pad)
    return data


def _all_reduce_max(t: torch.Tensor, mesh: DeviceMesh) -> None:
    """In place: the elementwise max of ``t`` over every rank of ``mesh`` (any number of dims)."""
    if mesh.size() == 1:
        return
    for dim in range(mesh.ndim):
        if mesh.size(dim) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))


def wrap_weight(weight: torch.Tensor, cast: CastConfig, source: DelayedWeightSource | None = None) -> nn.Parameter:
    """``weight`` as a Parameter over a :class:`Float8AllGatherWeight` sharing its storage
    (``source``: the layer's :class:`DelayedWeightSource`, for a delayed cast).

    A new Parameter object: build the optimizer after the conversion (and after
    ``fully_shard``, which replaces every parameter anyway).
    """
    if isinstance(weight, Float8AllGatherWeight):
        return weight  # type: ignore[return-value]  # already a Parameter over a Float8AllGatherWeight
    return nn.Parameter(Float8AllGatherWeight(weight.detach(), cast, source), requires_grad=weight.requires_grad)


def _local_of(t: Any) -> Any:
    """The local tensor of a DTensor, else ``None``."""
    return dtensor_local(t) if isinstance(t, DTensor) else None


@torch.no_grad()
def precompute_float8_scales_for_fsdp(module: nn.Module) -> None:
    """Decide the next FP8 all-gather of every sharded weight in ``module`` at once.

    Call it after ``optimizer.step()``. It takes the amax of every dynamic tensorwise
    :class:`Float8AllGatherWeight` shard, reduces them all with one all-reduce (MAX) per
    device mesh, and stores them on the weights, so the next all-gathers need no
    collective of their own. The other casts need none to begin with: a delayed weight's
    scale comes from its layer's history (the same on every rank), rowwise and block
    scales are local to a shard; they are left as they are. Optional: without it each
    all-gather reduces its own amax, with
    identical results. A stored amax serves every all-gather (forward, and the backward
    re-gather under ``reshard_after_forward=True``) while its weight is unchanged; once the
    weight is written (another step, ``load_state_dict``) the next all-gather reduces a
    fresh amax instead. Weights that are not FSDP-sharded (not DTensors) are skipped:
    nothing all-gathers them.

    Each rank decides from its own shard whether a stored amax still holds, so weights
    must change on all ranks alike, as in any data-parallel loop. One way to break that:
    ``torch.distributed.checkpoint.load`` writes in place only into shards that hold
    elements; follow it with ``model.load_state_dict`` (or ``set_state_dict``), as the
    checkpoint documentation does, which writes every shard, empty ones included.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"precompute_float8_scales_for_fsdp expects an nn.Module; got {type(module).__name__}")
    by_mesh: dict[DeviceMesh, list[Float8AllGatherWeight]] = {}
    for param in module.parameters():
        local = _local_of(param)
        if isinstance(local, Float8AllGatherWeight) and local._cast.tensorwise and not local._cast.delayed:
            # A DTensor parameter (it has a local tensor); nn.Module.parameters() types it as Parameter.
            by_mesh.setdefault(param.device_mesh, []).append(local)  # type: ignore[attr-defined]
    for mesh, weights in by_mesh.items():
        amaxes = torch.stack([tensor_amax(w._hp) for w in weights])
        _all_reduce_max(amaxes, mesh)
        for w, amax in zip(weights, amaxes.unbind()):
            w._precomputed = (amax, w._writes.n)
