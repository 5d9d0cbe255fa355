"""DTensor parameters in :class:`f8tensor.optim.AdamW`: local shards, row offsets, states
with the parameter's placements.

Every op of a step is elementwise or per row block, so a step runs on the local shards and
makes no collective; the states are DTensors with the parameter's mesh and placements, so
``torch.distributed.checkpoint`` saves and reshards them. FP8 moments keep one scale per
128 elements of each dim-0 row: a DTensor parameter with FP8 states must be sharded on
dim 0 (FSDP2's) or replicated, so that a shard holds whole rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from f8tensor.compat import dtensor_local

if dist.is_available():
    from torch.distributed.tensor import DTensor, Replicate, Shard
else:  # a torch build without torch.distributed: nothing is ever a DTensor
    DTensor = ()  # type: ignore[misc,assignment]  # isinstance(x, ()) is always False

__all__ = ["check_fp8_placements", "local_shard", "row_length", "row_offset", "wrap_like"]


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor FSDP2 keeps; in-place updates reach the
    parameter), any other tensor itself."""
    return dtensor_local(t) if isinstance(t, DTensor) else t


def check_fp8_placements(p: torch.Tensor) -> None:
    if not isinstance(p, DTensor):
        return
    for placement in p.placements:
        if not (isinstance(placement, Replicate) or (isinstance(placement, Shard) and placement.dim == 0)):
            raise ValueError(
                "state_dtype=torch.float8_e4m3fn keeps one scale per 128 elements of each dim-0 row, so a "
                f"DTensor parameter must be sharded on dim 0 or replicated; got placements {p.placements} for a "
                f"parameter of shape {tuple(p.shape)} (use state_dtype=torch.bfloat16 for it)"
            )


def row_offset(p: torch.Tensor) -> int:
    """The global index of the first dim-0 row of ``p``'s local shard (0 for a plain tensor).

    DTensor's ``Shard(0)`` splits as ``torch.chunk`` does, one mesh dim after the other:
    chunks of ``ceil(rows / n)``, the last ones short or empty."""
    if not isinstance(p, DTensor):
        return 0
    coordinate = p.device_mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the mesh
        return 0
    offset, rows = 0, p.shape[0]
    for mesh_dim, placement in enumerate(p.placements):
        if isinstance(placement, Shard):
            n = p.device_mesh.size(mesh_dim)
            chunk = -(-rows // n)
            start = min(chunk * coordinate[mesh_dim], rows)
            offset += start
            rows = min(rows, start + chunk) - start
    return offset


def wrap_like(local: torch.Tensor, p: torch.Tensor, global_shape: tuple[int, ...]) -> torch.Tensor:
    """``local`` as a DTensor with ``p``'s mesh and placements (no collective), when ``p``
    is one; ``local`` itself otherwise."""
    if not isinstance(p, DTensor):
        return local
    stride = torch.empty(global_shape, device="meta").stride()
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=torch.Size(global_shape), stride=stride
    )


def row_length(p: torch.Tensor) -> int:
    """The elements of one dim-0 row of ``p`` (the stride of a shard's offset)."""
    return p.numel() // p.shape[0] if p.dim() and p.shape[0] else 0
