"""FSDP2 with FP8 weight all-gather: the weight wrapper and the scale precomputation.

Under ``torch.distributed.fsdp.fully_shard`` every rank holds a shard of each weight and
all-gathers the full weight before a layer runs. A :class:`Float8AllGatherWeight` makes
that all-gather move FP8 bytes instead of bf16/fp32 ones:

- ``fsdp_pre_all_gather`` casts the local shard with a scale every rank agrees on (the
  amax of the shards reduced with MAX over the mesh) and hands FSDP the FP8 bytes viewed
  as ``torch.uint8``: one byte per element, and a dtype every backend moves (gloo refuses
  the float8 dtypes).
- ``fsdp_post_all_gather`` views the gathered bytes as FP8 again and builds the tensorwise
  :class:`~f8tensor.tensor.Float8Tensor` that ``Float8Linear`` takes as its weight; from
  the second all-gather on it refreshes that same tensor in place (``out=``), so the
  unsharded parameter is one object for the whole run.

Because the scale comes from the global amax, the gathered bytes are exactly those a
single process would produce by casting the full weight: FP8 all-gather changes the
traffic, not the numerics.

:func:`precompute_float8_scales_for_fsdp` moves the amax all-reduce out of the per-layer
all-gathers: after ``optimizer.step()`` it reduces every weight's amax in one collective.

The wrapper sits below the modules: ``Float8Linear`` chooses it as its weight's type when
its config asks for FP8 all-gather; the model converter (``convert.py``) keeps tied
weights tied.

Layer: ``distributed.fsdp``, above ``weights``; imports ``weights``, ``tensor``, ``kernels``,
``scaling``, ``config``, ``compat``.
"""


from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from f8tensor import kernels
from f8tensor.compat import DISABLED_TORCH_FUNCTION, dtensor_local, preserve_version_counter
from f8tensor.config import CastConfig, CastSpec
from f8tensor.scaling import amax_to_scale, tensor_amax
from f8tensor.tensor import Float8Tensor
from f8tensor.weights import HighPrecisionWeight, WriteCount

if dist.is_available():
    from torch.distributed.tensor import DTensor
else:  # a torch build without torch.distributed: no parameter is ever a DTensor
    DTensor = ()  # type: ignore[assignment, misc]  # isinstance(x, ()) is always False

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["DTensor", "Float8AllGatherWeight", "precompute_float8_scales_for_fsdp", "wrap_weight"]

aten = torch.ops.aten
logger = logging.getLogger("f8tensor")


class Float8AllGatherWeight(HighPrecisionWeight):
    """A high-precision weight whose FSDP2 all-gather moves FP8 bytes.

    For every op it behaves like the plain tensor it wraps (optimizer steps, ``copy_``,
    ``zero_``, DTensor sharding, checkpoints: see :class:`~f8tensor.weights.HighPrecisionWeight`);
    only FSDP's all-gather hooks differ. Fields:

    - ``_hp``: the plain bf16/fp16/fp32 tensor (the whole weight, or a rank's shard).
    - ``_cast``: the weight's :class:`~f8tensor.config.CastConfig` (FP8 dtype, power-of-2
      rounding); dynamic and tensorwise, which ``Float8LinearConfig`` checks.
    - ``_writes``: a :class:`~f8tensor.weights.WriteCount` shared with every wrapper that
      views the same data; each op that writes into any of them (optimizer steps,
      ``copy_``, ``load_state_dict``, checkpoint loads) counts, whichever subclass
      dispatched it.
    - ``_precomputed``: ``None``, or ``(scale, writes)`` from
      :func:`precompute_float8_scales_for_fsdp`: a 0-dim fp32 scale and the write count
      it was computed at. A cache, not part of the tensor: used only while the count is
      unchanged; a rebuilt wrapper (a view, or flatten and unflatten under compile)
      starts without one and computes its scale afresh.

    Raises:
        ValueError: a weight cast other than dynamic tensorwise (recipe ``"tensorwise"``).
    """

    _cast: CastConfig
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
    def __new__(cls, hp: torch.Tensor, cast: CastConfig, *, writes: WriteCount | None = None) -> Float8AllGatherWeight:  # noqa: PYI034 (staticmethod: no Self)
        HighPrecisionWeight._check_hp(cls, hp)
        if not cast.tensorwise or cast.delayed:
            raise ValueError("FP8 all-gather needs a dynamic tensorwise weight cast (recipe 'tensorwise')")
        self = HighPrecisionWeight._wrap(cls, hp, writes)
        self._cast = cast
        self._precomputed = None
        return self

    def _meta(self) -> tuple:
        return (self._cast,)

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
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor]]:
        """The local shard as FP8 bytes (``torch.uint8``), padded to FSDP's shard size.

        The cast always starts from this high-precision shard (the fp32 master weight
        under a bf16 ``MixedPrecisionPolicy``), so ``mp_policy.param_dtype`` only sets the
        dtype the Float8Tensor stands for, in :meth:`fsdp_post_all_gather`.
        """
        scale = self._all_gather_scale(mesh)
        data = kernels.cast(self._hp, CastSpec(self._cast.dtype), scale)[0].view(torch.uint8)
        # FSDP pads every shard along dim 0 to the size of the first one (torch.chunk's
        # ceil(rows / world)): an uneven or empty shard is topped up with zero bytes (the
        # zero byte is +0.0 in every FP8 format). Unpadded shards (other shard dims, which
        # FSDP requires to be even) come out at their own size.
        padded_rows = -(-outer_size[0] // mesh.size()) if len(outer_size) else 0
        if data.dim() and data.shape[0] < padded_rows:
            pad = [0, 0] * (data.dim() - 1) + [0, padded_rows - data.shape[0]]
            data = torch.nn.functional.pad(data, pad)
        return (data,), (scale,)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: tuple[torch.Tensor],
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[Float8Tensor, tuple[torch.Tensor, ...]] | None:
        """Build (first call) or refresh (``out=``) the unsharded FP8 weight.

        First call: a Float8Tensor over the gathered bytes (no copy), standing for
        ``param_dtype``, and those bytes as the inner tensor FSDP frees after use and
        re-allocates before the next all-gather. With ``out`` (FSDP's unsharded parameter,
        built from the first result): the new bytes already sit in its storage, so only
        its scale is updated, in place.
        """
        (data,) = all_gather_outputs
        (scale,) = metadata
        data = data.view(self._cast.dtype)
        if out is None:
            return Float8Tensor(data, scale.clone(), param_dtype), (data,)
        if not isinstance(out, Float8Tensor) or out._orig_dtype != param_dtype:
            raise RuntimeError(f"fsdp_post_all_gather: out must be the {param_dtype} Float8Tensor built the first time")
        if out._data.untyped_storage().data_ptr() != data.untyped_storage().data_ptr():
            raise RuntimeError(
                "fsdp_post_all_gather: FSDP gathered into a new buffer; the unsharded FP8 weight would keep stale bytes"
            )
        # The scale is saved for backward by Float8Linear. With reshard_after_forward=True
        # the weight is gathered again for backward, from the same unchanged shard, so the
        # value written here equals the saved one: hide the write from autograd's check,
        # exactly as FSDP does for the gathered bytes themselves.
        with preserve_version_counter(out._scale):
            out._scale.copy_(scale)
        return None

    def _all_gather_scale(self, mesh: DeviceMesh) -> torch.Tensor:
        """The scale all ranks use for this weight: precomputed, or one all-reduce now."""
        cached = self._precomputed
        if cached is not None:
            scale, writes = cached
            if writes == self._writes.n:
                return scale
            self._precomputed = None  # the weight changed since: never use a stale scale
        amax = tensor_amax(self._hp)  # 0 for an empty shard
        _all_reduce_max(amax, mesh)
        return amax_to_scale(amax, self._cast.dtype, round_pow2=self._cast.power_of_2_scale)


def _all_reduce_max(t: torch.Tensor, mesh: DeviceMesh) -> None:
    """In place: the elementwise max of ``t`` over every rank of ``mesh`` (any number of dims)."""
    if mesh.size() == 1:
        return
    for dim in range(mesh.ndim):
        if mesh.size(dim) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))


def wrap_weight(weight: torch.Tensor, cast: CastConfig) -> nn.Parameter:
    """``weight`` as a Parameter over a :class:`Float8AllGatherWeight` sharing its storage.

    A new Parameter object: build the optimizer after the conversion (and after
    ``fully_shard``, which replaces every parameter anyway).
    """
    if isinstance(weight, Float8AllGatherWeight):
        return weight  # type: ignore[return-value]  # already a Parameter over a Float8AllGatherWeight
    return nn.Parameter(Float8AllGatherWeight(weight.detach(), cast), requires_grad=weight.requires_grad)


def _local_of(t: Any) -> Any:
    """The local tensor of a DTensor, else ``None``."""
    return dtensor_local(t) if isinstance(t, DTensor) else None


@torch.no_grad()
def precompute_float8_scales_for_fsdp(module: nn.Module) -> None:
    """Compute the next FP8 all-gather scale of every sharded weight in ``module`` at once.

    Call it after ``optimizer.step()``. It takes the amax of every
    :class:`Float8AllGatherWeight` shard, reduces them all with one all-reduce (MAX) per
    device mesh, and stores the scales on the weights, so the next all-gathers need no
    collective of their own. Optional: without it each all-gather reduces its own amax,
    with identical results. A stored scale serves every all-gather (forward, and the
    backward re-gather under ``reshard_after_forward=True``) while its weight is
    unchanged; once the weight is written (another step, ``load_state_dict``) the next
    all-gather reduces a fresh amax instead. Weights that are not FSDP-sharded (not
    DTensors) are skipped: nothing all-gathers them.

    Each rank decides from its own shard whether a stored scale still holds, so weights
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
        if isinstance(local, Float8AllGatherWeight):
            # A DTensor parameter (it has a local tensor); nn.Module.parameters() types it as Parameter.
            by_mesh.setdefault(param.device_mesh, []).append(local)  # type: ignore[attr-defined]
    for mesh, weights in by_mesh.items():
        amaxes = torch.stack([tensor_amax(w._hp) for w in weights])
        _all_reduce_max(amaxes, mesh)
        # One amax -> scale per (format, rounding) group: usually a single vector op.
        groups: dict[tuple[torch.dtype, bool], list[int]] = {}
        for i, w in enumerate(weights):
            groups.setdefault((w._cast.dtype, w._cast.power_of_2_scale), []).append(i)
        for (dtype, pow2), indices in groups.items():
            index = torch.tensor(indices, device=amaxes.device)
            scales = amax_to_scale(amaxes.index_select(0, index), dtype, round_pow2=pow2)
            for i, scale in zip(indices, scales.unbind()):
                weights[i]._precomputed = (scale, weights[i]._writes.n)
