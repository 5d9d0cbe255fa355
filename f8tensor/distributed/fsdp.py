"""FSDP2 with FP8 weight all-gather: the weight wrapper and the scale precomputation.

Under ``torch.distributed.fsdp.fully_shard`` every rank holds a shard of each weight (rows,
dim 0) and all-gathers the full weight before a layer runs. A :class:`Float8AllGatherWeight`
makes that all-gather move FP8 bytes instead of bf16/fp32 ones, for every recipe:

- ``fsdp_pre_all_gather`` casts the local shard as the layer's forward would cast the full
  weight and hands FSDP the FP8 bytes viewed as ``torch.uint8`` (one byte per element, a
  dtype every backend moves; gloo refuses the float8 dtypes), plus, where the scales vary
  along the rows, the shard's scales.
- ``fsdp_post_all_gather`` views the gathered bytes as FP8 again and builds the
  :class:`~f8tensor.tensor.float8.Float8Tensor` that ``Float8Linear`` takes as its weight; from
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
- blocks (128x128, MX 1x32, any block) that no shard cuts: the same as rowwise, one
  scale per block, computed from the shard alone. A 1xB block (MX) is never cut by a row
  shard.
- blocks that the shards cut: FSDP shards rows in chunks of ``ceil(rows / world)`` (the
  last chunks short or empty), so unless that chunk is a multiple of the block's rows
  (128 rows over 2 ranks: 64 each; 4096 over 64 ranks) some blocks span two or more
  ranks. Those ranks agree on the block's amax the way tensorwise ranks agree on theirs:
  each rank writes its shard's block amaxes into the full ``ceil(rows / B) x
  ceil(cols / B)`` grid (zero elsewhere; a block it shares gets the amax of its part),
  one all-reduce (MAX) of that grid gives every block's amax (4 bytes per block: 4 KiB
  for a 4096x4096 weight), and every rank derives the whole weight's scales from it, as
  one process casting the full weight does. Each rank casts its rows with its blocks'
  agreed scales, so the gathered bytes and scales are, bit for bit, those of one process.
  The scales then need no all-gather (every rank holds them all): one collective per
  weight and all-gather, or none after :func:`precompute_float8_scales_for_fsdp`, which
  reduces these grids together with the tensorwise amaxes.

Every amax all-reduce first turns NaN amaxes into inf: a MAX collective may drop a NaN
(gloo keeps ``max(nan, 1)`` but not ``max(1, nan)``), while inf always wins, and both
give the NaN scale one process would compute.

The backward's ``grad_x = grad_output @ W`` contracts over the rows (N), which these scales
vary along for rowwise and 1x32 blocks; the linear Function handles that on the gathered
bytes (see ``linear_autograd.py``): rowwise folds the row scales into grad_output before its
per-token cast, 1x32 blocks re-quantize the gathered weight to 32x1 blocks (a second
rounding, in the backward only), 128x128 blocks serve both products as they are.

:func:`precompute_float8_scales_for_fsdp` moves the amax all-reduce out of the per-layer
all-gathers: after ``optimizer.step()`` it reduces every dynamic tensorwise weight's amax,
and every block grid of a weight whose shards cut blocks, in one collective; delayed,
rowwise and uncut block scales need no collective at all.

The wrapper sits below the modules: ``Float8Linear`` chooses it as its weight's type when
its config asks for FP8 all-gather (and, for delayed scaling, hands it a reference to
itself, where the history lives); the model converter (``convert.py``) keeps tied weights
tied.
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
else:  # a torch build without torch.distributed: no parameter is ever a DTensor
    DTensor = ()  # type: ignore[assignment, misc]  # isinstance(x, ()) is always False
    Shard = ()  # type: ignore[assignment, misc]

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
    ``zero_``, DTensor sharding, checkpoints: see :class:`~f8tensor.tensor.weights.HighPrecisionWeight`);
    only FSDP's all-gather hooks differ. Fields:

    - ``_hp``: the plain bf16/fp16/fp32 tensor (the whole weight, or a rank's shard).
    - ``_cast``: the weight's :class:`~f8tensor.quant.config.CastConfig` (FP8 dtype, granularity,
      scaling, power-of-2 rounding), any recipe's.
    - ``_source``: for a delayed cast, its :class:`DelayedWeightSource`; else ``None``.
    - ``_writes``: a :class:`~f8tensor.tensor.weights.WriteCount` shared with every wrapper that
      views the same data; each op that writes into any of them (optimizer steps,
      ``copy_``, ``load_state_dict``, checkpoint loads) counts, whichever subclass
      dispatched it.
    - ``_precomputed``: ``None``, or ``(amax, writes)`` from
      :func:`precompute_float8_scales_for_fsdp`: the fp32 amax reduced over the mesh (a
      0-dim one for a dynamic tensorwise cast; the full block grid for blocks that the
      shards cut, see :meth:`_shard_amax`) and the write count it was computed at. A cache,
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
        for row or block scales, the shard's scales (as bytes, padded alike), or, for
        blocks that the shards cut, the whole weight's scales (agreed by one all-reduce
        of the block amaxes, see :meth:`_shard_amax`) as metadata.

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
        quantizer = weight_gather_quantizer(cast)
        if cast.tensorwise:
            scale = self._tensorwise_scale(mesh)
            hp = torch.where(torch.isinf(self._hp), torch.nan, self._hp) if cast.delayed else self._hp
            data = quantizer.quantize(hp, scale)[0].view(torch.uint8)
            return (_pad_rows(data, padded_rows),), (scale,)
        block = quantizer.spec.block
        if self._cuts_blocks(outer_size, mesh.size()):
            # Blocks span ranks: their amaxes agreed by one all-reduce (or precomputed), the
            # whole weight's scales derived on every rank alike, this shard cast with them.
            # The scales travel as metadata: no gather of their own.
            scale = quantizer.scale_for(self._reduced_amax(mesh, outer_size))
            data = self._cast_rows(quantizer, scale, mesh.get_local_rank() * padded_rows)
            return (_pad_rows(data.view(torch.uint8), padded_rows),), (rows, scale.shape[0], scale.dtype, block, scale)
        # Row and block scales that no shard cuts: computed from the shard alone, equal to
        # the full weight's.
        block_rows = block[0] if block[0] else 1  # rowwise: (1, 0)
        data, scale = quantizer.quantize(self._hp)
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
            return (data_bytes, scale_bytes), (rows, scale_rows, scale.dtype, block, None)
        # Uneven shards: FSDP takes only inputs of the padded shard's size from a rank with
        # padding, so the scales (a few bytes per row or block) get an all-gather of their own.
        gathered = torch.empty((mesh.size() * scale_bytes.shape[0], *scale_bytes.shape[1:]), dtype=torch.uint8, device=scale.device)
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
            # Even shards: the scales are FSDP's second output; uneven: gathered apart;
            # blocks the shards cut: the whole weight's scales, the same on every rank.
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

    def _reduced_amax(self, mesh: DeviceMesh, outer_size: torch.Size | None = None) -> torch.Tensor:
        """The amax the ranks agree on (see :meth:`_shard_amax`): precomputed, or one
        all-reduce now. ``outer_size``: the whole weight's shape (for block grids)."""
        cached = self._precomputed
        if cached is not None:
            amax, writes = cached
            if writes == self._writes.n:
                return amax
            self._precomputed = None  # the weight changed since: never use a stale amax
        rank = mesh.get_local_rank() if outer_size is not None else 0  # block grids: FSDP's 1-D shard mesh
        amax = self._shard_amax(outer_size, rank, mesh.size())
        _all_reduce_max(amax, mesh)
        return amax

    def _cuts_blocks(self, outer_size: torch.Size | tuple[int, ...], world: int) -> bool:
        """Whether FSDP's row chunks (``ceil(rows / world)``) of a weight of ``outer_size``
        cut this weight's blocks (more than one row per block, a chunk not a multiple of
        them). Global facts only: every rank decides alike."""
        if self._cast.tensorwise or world == 1 or not len(outer_size):
            return False
        block_rows = self._cast.operand_spec(1).block[0]
        return block_rows > 1 and (-(-outer_size[0] // world)) % block_rows != 0

    def _shard_amax(self, outer_size: torch.Size | tuple[int, ...] | None, rank: int, world: int) -> torch.Tensor:
        """This shard's part of the amax all ranks agree on (by an all-reduce MAX), fp32.

        Tensorwise: the shard's amax (0-dim; 0 for an empty shard). Blocks that the shards
        cut: the whole weight's block grid (the scale's shape, ``ceil(size / b)`` per dim),
        holding the amax of this shard's part of each block it touches and 0 elsewhere.
        The shard is rows ``[rank * chunk, rank * chunk + len)`` of the weight (FSDP's
        torch.chunk split of dim 0, ``chunk = ceil(rows / world)``); its first rows may
        finish a block that starts on an earlier rank, and are measured as that block.
        """
        hp = self._hp
        if self._cast.tensorwise:
            return tensor_amax(hp)
        assert outer_size is not None  # the all-gather passes the weight's shape
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
        head = min(own, -start % block_rows)  # rows that finish a block begun on an earlier rank
        grid = torch.zeros([1 if b == 0 else -(-n // b) for n, b in zip(outer_size, block)], dtype=torch.float32, device=hp.device)
        local = torch.cat([block_amax(hp[:head], (block_rows, *block[1:])), block_amax(hp[head:], block)])
        first = start // block_rows
        grid[first : first + local.shape[0]] = local
        return grid

    def _cast_rows(self, quantizer: BlockQuantizer, scale: torch.Tensor, start: int) -> torch.Tensor:
        """This shard (rows ``start`` on of the weight) cast by ``quantizer`` with the whole
        weight's block scales ``scale``: each row with its blocks' scales, so a block shared
        with another rank is cast with the one scale both use (a 1-row block, given scales)."""
        hp = self._hp
        block = quantizer.spec.block
        index = torch.arange(start, start + hp.shape[0], device=scale.device) // block[0]
        # Through bytes: index_select takes every dtype's bytes (e8m0 scales included).
        row_scale = scale.view(torch.uint8).index_select(0, index).view(scale.dtype)
        return quantizer.with_block((1, *block[1:])).quantize(hp, row_scale)[0]


def _pad_rows(data: torch.Tensor, rows: int) -> torch.Tensor:
    """``data`` topped up with zero rows (dim 0) to ``rows``."""
    if data.dim() and data.shape[0] < rows:
        pad = [0, 0] * (data.dim() - 1) + [0, rows - data.shape[0]]
        data = torch.nn.functional.pad(data, pad)
    return data


def _all_reduce_max(t: torch.Tensor, mesh: DeviceMesh) -> None:
    """In place: the elementwise max of the amaxes ``t`` over every rank of ``mesh`` (any
    number of dims). A NaN amax becomes inf first: MAX collectives may drop a NaN (gloo
    keeps ``max(nan, x)`` but not ``max(x, nan)``), inf always wins, and the scale of an inf
    amax is the NaN scale of a NaN one (:func:`~f8tensor.quant.scaling.amax_to_scale`), so a NaN
    on one rank still makes the whole weight (or block) NaN, as in one process."""
    if mesh.size() == 1:
        return
    t.masked_fill_(torch.isnan(t), float("inf"))
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


def _row_sharded(param: Any) -> bool:
    """A DTensor parameter sharded along dim 0 on every mesh dim (FSDP2's default)."""
    return all(isinstance(p, Shard) and p.dim == 0 for p in param.placements)


def _local_of(t: Any) -> Any:
    """The local tensor of a DTensor, else ``None``."""
    return dtensor_local(t) if isinstance(t, DTensor) else None


@torch.no_grad()
def precompute_float8_scales_for_fsdp(module: nn.Module) -> None:
    """Decide the next FP8 all-gather of every sharded weight in ``module`` at once.

    Call it after ``optimizer.step()``. It takes the amax of every dynamic tensorwise
    :class:`Float8AllGatherWeight` shard, and the block amax grid of every block-scaled
    weight whose shards cut its blocks (a 128x128 weight of 4096 rows over 64 ranks; 1-D
    meshes), reduces them all with one all-reduce (MAX) per device mesh (one flat fp32
    buffer: 4 bytes per weight, or per block), and stores them on the weights, so the next
    all-gathers need no collective of their own. The other casts need none to begin
    with: a delayed weight's scale comes from its layer's history (the same on every
    rank), rowwise scales and blocks that no shard cuts are local to a shard; they are
    left as they are. Optional: without it each all-gather reduces its own amax, with
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
    # Per mesh: the weights, each with the whole weight's shape for a block grid (else None).
    by_mesh: dict[DeviceMesh, list[tuple[Float8AllGatherWeight, torch.Size | None]]] = {}
    for param in module.parameters():
        local = _local_of(param)
        if not isinstance(local, Float8AllGatherWeight):
            continue
        # A DTensor parameter (it has a local tensor); nn.Module.parameters() types it as Parameter.
        mesh = param.device_mesh  # type: ignore[attr-defined]
        if local._cast.tensorwise and not local._cast.delayed:
            by_mesh.setdefault(mesh, []).append((local, None))
        elif mesh.ndim == 1 and _row_sharded(param) and local._cuts_blocks(param.shape, mesh.size()):
            # FSDP-only (1-D mesh, dim 0): the all-gather's shard mesh and row split are the
            # parameter's own. Other meshes leave it to each all-gather (one all-reduce).
            by_mesh.setdefault(mesh, []).append((local, param.shape))
    for mesh, weights in by_mesh.items():
        rank = mesh.get_local_rank() if mesh.ndim == 1 else 0
        amaxes = [w._shard_amax(shape, rank, mesh.size()) for w, shape in weights]
        flat = torch.cat([a.reshape(-1) for a in amaxes])
        _all_reduce_max(flat, mesh)
        for (w, _), local, agreed in zip(weights, amaxes, flat.split([a.numel() for a in amaxes])):
            w._precomputed = (agreed.view(local.shape), w._writes.n)
