"""DTensor parameters in :class:`f8tensor.optim.AdamW`: local shards, row offsets, states.

A step is elementwise or per row block, so it runs on local shards with no collective;
states are DTensors placed like their parameter. FP8 states need dim-0 shards or replication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from f8tensor.compat import dtensor_local

if dist.is_available():
    from torch.distributed.tensor import DTensor, Replicate, Shard
else:
    DTensor = ()  # type: ignore[misc,assignment]  # isinstance(x, ()) is always False

__all__ = ["check_fp8_placements", "local_shard", "row_length", "row_offset", "wrap_like"]


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (updates in place reach the parameter), else the tensor."""
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
    """The global index of the first dim-0 row of ``p``'s local shard (torch.chunk splits)."""
    if not isinstance(p, DTensor):
        return 0
    coordinate = p.device_mesh.get_coordinate()
    if coordinate is None:
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
    """``local`` as a DTensor placed like ``p`` when ``p`` is one (no collective)."""
    if not isinstance(p, DTensor):
        return local
    stride = torch.empty(global_shape, device="meta").stride()
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=torch.Size(global_shape), stride=stride
    )


def row_length(p: torch.Tensor) -> int:
    """The elements of one dim-0 row of ``p``."""
    return p.numel() // p.shape[0] if p.dim() and p.shape[0] else 0
