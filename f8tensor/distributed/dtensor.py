"""The FP8 linear product on DTensors: tensor and sequence parallel below the styles.

:func:`dtensor_linear` runs ``QuantizedLinearFn`` on the local shards and wraps the result
with the placements of the product's algebra (registered in ``linear`` on import):

===============  ===============  ===============  ================
input ``x``      weight (N, K)    output ``y``     bias
===============  ===============  ===============  ================
``Replicate``    ``Shard(0)``     ``Shard(-1)``    ``Shard(0)``
``Shard(-1)``    ``Shard(1)``     ``Partial``      added after, once
``Shard(d)``     ``Replicate``    ``Shard(d)``     ``Replicate``
``Replicate``    ``Replicate``    ``Replicate``    ``Replicate``
===============  ===============  ===============  ================

Other input placements are redistributed first; a plain input stands for a replicated one.
Each rank casts its own shards; a block (1x128, 128x128, MX) is never cut by a shard, so
each rank writes the bytes one process would (else ``ValueError``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from f8tensor.compat import dtensor_local
from f8tensor.nn.linear import set_dtensor_linear
from f8tensor.nn.linear_autograd import LinearArgs, QuantizedLinearFn
from f8tensor.quant.config import CastConfig

if dist.is_available():
    from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
else:
    DTensor = ()  # type: ignore[misc,assignment]  # isinstance(x, ()) is always False

__all__ = ["check_blocks_unbroken", "check_token_blocks_unbroken", "dtensor_linear"]


def dtensor_linear(x, weight, bias, args: LinearArgs) -> torch.Tensor:
    """``QuantizedLinearFn.apply(x, weight, bias, args)`` on local shards, the result a DTensor.

    A DTensor weight is never cached: ``args.weight_casts`` is ignored.
    """
    config, delayed, stats = args.config, args.delayed, args.stats
    # Buffers are replicated DTensors: the Function updates their local tensors in place.
    if delayed is not None:
        delayed = (_local_buffer(delayed[0]), _local_buffer(delayed[1]))
    if stats is not None:
        stats = type(stats)(*(_local_buffer(b) for b in stats))
    local_args = LinearArgs(config, delayed, stats, args.weight_amax)
    mesh = next(t.device_mesh for t in (weight, x, bias) if isinstance(t, DTensor))
    n_dims = mesh.ndim
    x_ndim = x.dim()
    last = x_ndim - 1
    w_pl = _placements(weight, n_dims)
    if any(p.is_partial() for p in w_pl):
        weight = weight.redistribute(mesh, [Replicate() if p.is_partial() else p for p in w_pl])
        w_pl = weight.placements
    x_pl = _placements(x, n_dims)

    want_x: list[Placement] = []
    out_pl: list[Placement] = []
    grad_x_pl: list[Placement] = []
    grad_w_pl: list[Placement] = []
    bias_pl: list[Placement] = []
    bias_after = False
    for wp, xp in zip(w_pl, x_pl):
        x_shard = xp.dim % x_ndim if isinstance(xp, Shard) else None
        if isinstance(wp, Shard) and wp.dim % 2 == 0:  # W sharded on N: column parallel
            want_x.append(Replicate())
            out_pl.append(Shard(last))
            grad_x_pl.append(Partial())
            grad_w_pl.append(wp)
            bias_pl.append(Shard(0))
        elif isinstance(wp, Shard):  # W sharded on K: row parallel, partial sums out
            want_x.append(Shard(last))
            out_pl.append(Partial())
            grad_x_pl.append(Shard(last))
            grad_w_pl.append(wp)
            bias_pl.append(Replicate())
            bias_after = True
        elif x_shard is not None and x_shard != last:  # tokens sharded, W replicated
            want_x.append(Shard(x_shard))
            out_pl.append(Shard(x_shard))
            grad_x_pl.append(Shard(x_shard))
            grad_w_pl.append(Partial())
            bias_pl.append(Replicate())
        else:
            want_x.append(Replicate())
            out_pl.append(Replicate())
            grad_x_pl.append(Replicate())
            grad_w_pl.append(Replicate())
            bias_pl.append(Replicate())

    if isinstance(x, DTensor):
        if tuple(x.placements) != tuple(want_x):
            x = x.redistribute(mesh, want_x)
        full_x_shape = x.shape
        x_local = x.to_local(grad_placements=grad_x_pl)
    elif all(isinstance(p, Replicate) for p in want_x):
        full_x_shape = x.shape
        x_local = x
    else:  # a plain tensor stands for a replicated one
        x = DTensor.from_local(x, mesh, [Replicate()] * n_dims, run_check=False).redistribute(mesh, want_x)
        full_x_shape = x.shape
        x_local = x.to_local(grad_placements=grad_x_pl)

    if isinstance(weight, DTensor):
        full_w_shape = weight.shape
        w_local = weight.to_local(grad_placements=grad_w_pl)
    else:
        full_w_shape = weight.shape
        w_local = weight
    _check_operands(config, mesh, full_x_shape, want_x, full_w_shape, w_pl, out_pl)

    b_local = None
    if bias is not None and not bias_after:
        if isinstance(bias, DTensor):
            if tuple(bias.placements) != tuple(bias_pl):
                bias = bias.redistribute(mesh, bias_pl)
            b_grad = [
                Partial() if isinstance(g, Partial) and isinstance(b, Replicate) else b
                for g, b in zip(grad_w_pl, bias_pl)
            ]
            b_local = bias.to_local(grad_placements=b_grad)
        else:
            b_local = bias
    y_local = QuantizedLinearFn.apply(x_local, w_local, b_local, local_args)
    out_shape = (*full_x_shape[:-1], full_w_shape[0])
    y = DTensor.from_local(
        y_local, mesh, out_pl, run_check=False, shape=torch.Size(out_shape), stride=_contiguous(out_shape)
    )
    if bias is not None and bias_after:
        if not isinstance(bias, DTensor):
            bias = DTensor.from_local(bias, mesh, [Replicate()] * n_dims, run_check=False)
        y = y + bias
    return y


def _local_buffer(t: torch.Tensor) -> torch.Tensor:
    """A replicated buffer's local tensor, or the plain buffer."""
    return dtensor_local(t) if isinstance(t, DTensor) else t


def _placements(t: torch.Tensor, n_dims: int) -> Sequence[Placement]:
    return tuple(t.placements) if isinstance(t, DTensor) else (Replicate(),) * n_dims


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def _check_operands(config, mesh, x_shape, x_pl, w_shape, w_pl, y_pl) -> None:
    """Every GEMM operand's shards keep its blocks whole."""
    x2 = (math.prod(x_shape[:-1]), x_shape[-1])
    layer = f"Float8Linear(in_features={w_shape[1]}, out_features={w_shape[0]})"
    y_shape = (*x_shape[:-1], w_shape[0])
    # Token shards are checked on the N-D shape; the 2D checks see only feature shards.
    check_token_blocks_unbroken(f"{layer} input", config.input, x_shape, x_pl, mesh)
    check_token_blocks_unbroken(f"{layer} grad_output", config.grad_output, y_shape, y_pl, mesh)

    def features_only(pl, ndim):
        return [
            Shard(1)
            if isinstance(p, Shard) and p.dim % ndim == ndim - 1
            else (p if not isinstance(p, Shard) else Replicate())
            for p in pl
        ]

    check_blocks_unbroken(f"{layer} input", config.input, x2, features_only(x_pl, len(x_shape)), mesh)
    check_blocks_unbroken(f"{layer} weight", config.weight, tuple(w_shape), list(w_pl), mesh)
    check_blocks_unbroken(
        f"{layer} grad_output", config.grad_output, (x2[0], w_shape[0]), features_only(y_pl, len(x_shape)), mesh
    )


def check_token_blocks_unbroken(what: str, cast: CastConfig, shape: Sequence[int], placements, mesh) -> None:
    """Raise ``ValueError`` unless each rank's token blocks are blocks of the full tokens view.

    Every run boundary of a rank's rows in the ``(prod(shape[:-1]), shape[-1])`` view must
    fall on a block boundary (a rank's block must not mix batch entries).
    """
    row_blocks = {
        b
        for spec in (cast.operand_spec(1), cast.operand_spec(0))
        for b, along in _true_blocks(spec.block)
        if along == 0
    }
    if not row_blocks:
        return
    sizes = list(shape)
    ndim = len(sizes)
    for mesh_dim, p in enumerate(placements):
        if not isinstance(p, Shard) or p.dim % ndim == ndim - 1:
            continue
        d = p.dim % ndim
        n = mesh.size(mesh_dim)
        outer, inner = math.prod(sizes[:d]), math.prod(sizes[d + 1 : -1])
        chunks = [len(c) for c in torch.arange(sizes[d]).chunk(n)] if sizes[d] else []
        total = outer * sizes[d] * inner
        for b in sorted(row_blocks):
            pos = 0
            for _ in range(outer):
                for c in chunks:
                    pos += c * inner
                    if pos % b and pos != total:
                        raise ValueError(
                            f"{what}: Shard({p.dim}) of shape {tuple(shape)} over {n} ranks gives each rank runs of "
                            f"{chunks[0] * inner} rows of the ({total}, {sizes[-1]}) tokens view"
                            + (
                                f", one per batch entry (the {outer} indices of dims before {d}), "
                                if outer > 1
                                else ", "
                            )
                            + f"which cut its {b}-row scaling blocks: a rank's blocks would "
                            + (
                                "mix batch entries, unlike one process's. "
                                if outer > 1
                                else "differ from one process's. "
                            )
                            + f"Make each rank's share of dim {d} times {inner} a multiple of {b} (e.g. a longer "
                            f"sequence or fewer ranks), or shard dim 0 instead"
                        )
        sizes[d] = chunks[0] if chunks else 0


def check_blocks_unbroken(what: str, cast: CastConfig, shape: Sequence[int], placements, mesh) -> None:
    """Raise ``ValueError`` unless every shard of a 2D operand starts on a block boundary."""
    blocks = {b for spec in (cast.operand_spec(1), cast.operand_spec(0)) for b in _true_blocks(spec.block)}
    if not blocks:
        return
    sizes = list(shape)
    for mesh_dim, p in enumerate(placements):
        if not isinstance(p, Shard):
            continue
        dim = p.dim % len(sizes)
        n = mesh.size(mesh_dim)
        chunk = -(-sizes[dim] // n) if n else sizes[dim]
        for b, along in blocks:
            if along == dim and chunk % b and sizes[dim] > chunk:
                raise ValueError(
                    f"{what}: sharding dim {dim} (size {sizes[dim]}) over {n} ranks gives shards of {chunk}, "
                    f"which cut its {b}-element scaling blocks; make the size a multiple of {b * n} (or shard fewer "
                    f"ways) so that every shard holds whole blocks"
                )
        sizes[dim] = chunk


def _true_blocks(block: tuple[int, ...]) -> list[tuple[int, int]]:
    """(size, dim) of the entries of a block that group more than one element."""
    return [(b, d) for d, b in enumerate(block) if b > 1]


set_dtensor_linear(dtensor_linear)
