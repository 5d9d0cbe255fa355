"""AdamW with fp32, bf16 or 8-bit moments, and lean master weights for bf16 parameters.

:class:`AdamW` has the defaults and the math of ``torch.optim.AdamW`` (decoupled weight
decay, bias correction); what differs is where the state lives:

- ``state_dtype=torch.float32``: both moments in fp32. For fp32 parameters every step is
  bit-identical to ``torch.optim.AdamW(foreach=False)`` (the same ops in the same order).
- ``state_dtype=torch.bfloat16``: both moments stored in bf16 (2 + 2 bytes per parameter);
  each step widens them to fp32, updates and stores them back rounded to nearest.
- ``state_dtype=torch.float8_e4m3fn``: both moments ``m`` and ``v`` in e4m3, stored in the
  parameter's shape, with one fp32 scale per :data:`FP8_BLOCK` (128) consecutive elements of
  each dim-0 row (the parameter seen as ``(shape[0], numel / shape[0])``; a row's last block
  may be short): 1 + 1 bytes per parameter plus 2 * 4 / 128 for the scales, 2.0625 in all
  for rows that are multiples of 128. Both are cast by their block quantizer
  (:func:`f8tensor.block_quantizers.moment_quantizer`, over :func:`f8tensor.kernels.cast`:
  rule ``data = saturate(x * scale)``, dynamic scale ``448 / block amax``) with stochastic
  rounding, and come back through its ``dequantize``. Tensors of one dim or with fewer than
  :data:`FP8_BLOCK` elements (biases, norms) keep fp32 moments: their states are a rounding
  error of the model's, and a 1-D tensor sharded by FSDP2 would cut its blocks.

  Blocks along dim-0 rows: FSDP2 shards dim 0, so every shard holds whole rows and its
  blocks are the blocks one process has; with stochastic draws that are a function of the
  element's global index (below), a sharded step writes the bits one process writes, on
  any number of ranks, and a DCP checkpoint reshards without touching a block.

  Stochastic rounding, without generator state (:mod:`f8tensor.optim_draws`): resume is
  bit-exact with the step counters saved, a shard draws what one process draws.

  Why stochastic rounding, ``v`` as is, blocks of 128, measured (final loss relative to
  fp32 moments, mean of 3 seeds; 1.0 is fp32). ``tests/modules/test_optim.py``'s MLP (16 -> 64 ->
  64 -> 4, 150 steps, lr 1e-3): round to nearest 0.917; stochastic rounding of both
  moments 0.994; stochastic ``v`` only 1.015; bf16 moments 1.000. The demo GPT (``small``,
  250 steps, bf16 autocast, betas (0.9, 0.95), seeds 0-2; fp32 moments 2.2268 / 2.2490 /
  2.2241): stochastic +0.31% / +0.02% / -0.56% (mean -0.08%), round to nearest +0.18% /
  -0.02% / -0.10% (mean +0.02%), both within the seeds' spread. Round to nearest cannot
  follow ``v``'s slow decay by ``beta2``: a decay of 0.1% per step is far below half an
  e4m3 spacing (3-6%), so ``v`` sticks and the updates come
  out too small (the MLP's lower loss, consistently across seeds); stochastic rounding
  keeps every moment's expectation. Earlier flat-block measurements on a 32 -> 256 -> 256
  -> 8 MLP: blocks of 32 / 128 / 256 gave 0.942 / 0.950 / 0.957 and ``sqrt(v)`` stored
  instead 0.911 / 0.918 / 0.920 (half the dynamic range, but each e4m3 spacing then costs
  twice the relative error in ``v``), so ``v`` is stored as is and 128 keeps an outlier's
  reach small.

``master_weights`` (bf16 parameters only):

- ``None``: the update is computed in fp32 from the bf16 parameter and written back
  rounded to nearest (torch's own AdamW on bf16 parameters computes in bf16).
- ``"stochastic"``: written back with stochastic rounding (unbiased; its draws come from
  the same seeded table as the FP8 moments', so a resumed or sharded run repeats its bits).
- ``"remainder"``: the low 16 bits of an fp32 master copy are kept next to the parameter
  (state ``"master_remainder"``, int16). The bf16 parameter is the master rounded to
  nearest with ties away from zero (the rounding that makes the pair an exact encoding),
  so the fp32 master is recovered exactly every step: the trajectory is that of fp32
  parameters, at 2 extra bytes per parameter instead of 4.

Non-finite gradients propagate as in torch: a NaN or inf gradient element makes its
moments and its parameter NaN (inf / inf) and the step is not skipped; with FP8 states the
NaN reaches the whole block of its moments (the block's scale is NaN). No moment is ever
a finite value computed from a non-finite gradient.

FSDP2 (``fully_shard``) and other DTensor parameters (:mod:`f8tensor.optim_shards`): the
step runs on the local shards, no collective; the states are DTensors with the parameter's
placements. A weight wrapper subclass as the local shard (FSDP2 FP8 all-gather) is updated
in place through its own ops; its moments are plain tensors.

Speed: one pass per tensor where it can be had. The torch-ops path (:func:`_tensor_step`)
is the reference: about 60 elementwise passes over an FP8-state tensor (dequantization,
update, block amaxes, stochastic rounding, casts; the moments in rows of one block, so that
their scales broadcast). Two fused forms give its bits:

- CUDA tensors (a DTensor's local shard included), eager, triton importable: one Triton
  kernel per tensor (:mod:`f8tensor.kernels.triton_adamw`) reads the parameter (and its
  remainder), the gradient and both moments once, computes the update in fp32 and writes
  everything once, requantizing FP8 moments per block with the same seeded draws (a
  ``NOISE_PERIOD`` table per moment made on the device before the launch). It follows
  torch's CUDA or CPU rounding of each op; on CPU the one difference is torch's vectorized
  square root, which is not always correctly rounded (666 of 100003 fp32 inputs 1 ulp off).
  ``fused=None`` (default): CUDA tensors; ``False``: never; ``True``: also CPU tensors,
  through the Triton interpreter (the CPU tests' way in; slow).
- CPU tensors: :func:`_tensor_step` compiled by inductor (``compiled=``), one C++ loop nest
  per tensor and one graph per kind of tensor (dtype, mode, FP8 rows or flat), never one
  per shape, step or lr. It writes the torch-ops path's bits with a correctly rounded
  square root: the compiled code spells out the fused multiply-adds of ATen's CPU lerp and
  addcmul (:func:`f8tensor.compat.fma`); a ``"remainder"`` parameter that is NaN is
  stored as bf16's canonical NaN. ``compiled=None`` (default): when a C++ compiler is
  found, CPU tensors of at least :data:`COMPILE_MIN_NUMEL` (2**20) elements whose
  torch-ops step is slow (FP8 moments, a ``"remainder"`` or ``"stochastic"`` master); fp32
  and bf16 moments keep torch's bits (and speed), and small tensors (the demo's, the
  tests') never pay a compile. The first step compiles (tens of seconds on a small CPU,
  less from inductor's cache on disk); BENCHMARKS.md ("Optimizer states in 8 bits") has
  the step times against torch's and torchao's. ``compiled=True``: every CPU tensor it
  takes (FP8 moments: rows of whole blocks); ``False``: never.

Under ``torch.compile`` the torch-ops path is traced whole: the step counter stays a 0-dim
tensor (eager reads it as a Python float), the scalars that depend on it are tensors, the
draw tables come from a custom op that reads the counter when the graph runs
(``f8tensor::adamw_noise_table``): no graph break, one graph after the step that creates
the states; inductor gives it the compiled step's bits. No host sync on any path: the step
counter is a CPU tensor, as torch's, and nothing else is read back.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from f8tensor.block_quantizers import BlockQuantizer, moment_quantizer
from f8tensor.compat import cpu_compiler, unlimited_recompiles
from f8tensor.kernels import triton_adamw
from f8tensor.optim_draws import NOISE_PERIOD, noise_table, noise_table_at, seed, uniform
from f8tensor.optim_master import join_master, split_master, stochastic_bf16
from f8tensor.optim_math import Scalars, compiled_moments, scalars
from f8tensor.optim_shards import check_fp8_placements, local_shard, row_length, row_offset, wrap_like

__all__ = ["COMPILE_MIN_NUMEL", "FP8_BLOCK", "MASTER_WEIGHTS", "NOISE_PERIOD", "STATE_DTYPES", "AdamW"]

#: The moment dtypes :class:`AdamW` accepts.
STATE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)
#: The ``master_weights`` values :class:`AdamW` accepts.
MASTER_WEIGHTS: tuple[str | None, ...] = (None, "stochastic", "remainder")
#: Elements per fp32 scale of an FP8 moment (along the flattened tensor); also the size
#: below which a tensor keeps fp32 moments.
FP8_BLOCK = 128

#: How each FP8 moment is rounded to e4m3 (see the module docstring for the measurements).
FP8_ROUNDING: dict[str, str] = {"exp_avg": "stochastic", "exp_avg_sq": "stochastic"}
# Each moment's block quantizer: the blocks run along each row of the parameter seen as
# (dim 0, everything else), so a shard along dim 0 (FSDP2's) holds whole rows and its
# blocks are the one-process blocks.
_FP8_MOMENTS: dict[str, BlockQuantizer] = {
    name: moment_quantizer(torch.float8_e4m3fn, FP8_BLOCK, rounding) for name, rounding in FP8_ROUNDING.items()
}
#: ``compiled=None``: the smallest CPU tensor that takes the compiled step (see "Speed").
COMPILE_MIN_NUMEL = 1 << 20
_PLAIN = (torch.Tensor, torch.nn.Parameter)


#: The square root of the torch-ops step: torch's own. (CUDA's is correctly rounded, and so
#: is the fused kernel's; the CPU's vectorized one is not always: 666 of 100003 fp32 inputs
#: measured 1 ulp off. The kernel tests swap this for a correctly rounded one to compare
#: the two paths bit for bit.)
_sqrt = torch.sqrt


def _check_hyper(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    if not isinstance(lr, (int, float)) or not lr >= 0.0:
        raise ValueError(f"lr must be a float >= 0; got {lr!r}")
    if not isinstance(eps, (int, float)) or not eps >= 0.0:
        raise ValueError(f"eps must be a float >= 0; got {eps!r}")
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two floats in [0, 1); got {betas!r}")
    if not isinstance(weight_decay, (int, float)) or not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be a float >= 0; got {weight_decay!r}")


def _check_options(state_dtype: Any, master_weights: Any) -> None:
    if state_dtype not in STATE_DTYPES:
        allowed = ", ".join(str(d) for d in STATE_DTYPES)
        raise ValueError(f"state_dtype must be one of {allowed}; got {state_dtype!r}")
    if master_weights not in MASTER_WEIGHTS:
        raise ValueError(f"master_weights must be one of {MASTER_WEIGHTS}; got {master_weights!r}")


# ---------------------------------------------------------------- FP8 moments: one cast each way


def _uses_fp8(p: torch.Tensor, state_dtype: torch.dtype) -> bool:
    """FP8 moments for tensors of two or more dims and at least :data:`FP8_BLOCK` elements;
    the rest (biases, norms, scalars) keep fp32 moments."""
    return state_dtype == torch.float8_e4m3fn and p.dim() >= 2 and p.numel() >= FP8_BLOCK


class _Fp8View(NamedTuple):
    """The 2D views an FP8 moment is cast in, of its data and of its scales (stored as
    ``blocks``: ``(rows, blocks per row)``). Rows of whole blocks are seen one block per
    row, ``(numel / 128, 128)``, scales ``(numel / 128, 1)``: the scales broadcast instead
    of being expanded over the elements. Other rows (a short last block) as they are."""

    data: tuple[int, int]
    scale: tuple[int, int]
    blocks: tuple[int, int]


def _fp8_view(shape: tuple[int, ...]) -> _Fp8View:
    rows, row = shape[0], math.prod(shape[1:])
    blocks = (rows, -(-row // FP8_BLOCK))
    if row % FP8_BLOCK == 0:
        n = rows * (row // FP8_BLOCK)
        return _Fp8View((n, FP8_BLOCK), (n, 1), blocks)
    return _Fp8View((rows, row), blocks, blocks)


def _dequantize_moment(data: torch.Tensor, scale: torch.Tensor, view: _Fp8View) -> torch.Tensor:
    """An FP8 moment (e4m3 ``data`` in the parameter's shape, its fp32 block ``scale``) in fp32,
    in the parameter's shape: the one way back of every FP8 moment."""
    return _FP8_MOMENTS["exp_avg"].dequantize(data.view(view.data), scale.view(view.scale)).view(data.shape)


def _quantize_moment(
    value: torch.Tensor, name: str, uniform: torch.Tensor | None, view: _Fp8View
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``value`` (the parameter's shape) as moment ``name``'s e4m3 data (the same shape)
    and fp32 scales (``view.blocks``): the one cast of every FP8 moment (rule
    ``data = saturate(x * scale)``, dynamic block scale). ``uniform``: the draws of a
    stochastic rounding, in ``view.data``'s shape."""
    data, scale = _FP8_MOMENTS[name].quantize(value.view(view.data), uniform=uniform)
    return data.view(value.shape), scale.view(view.blocks)


# ---------------------------------------------------------------- one tensor's step


def _tensor_step(
    local: torch.Tensor,
    grad: torch.Tensor,
    exp_avg_state: torch.Tensor,
    exp_avg_sq_state: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None,
    remainder: torch.Tensor | None,
    tables: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    start: int | torch.Tensor,
    s: Scalars,
    master_weights: str | None,
) -> None:
    """One step of one tensor (a parameter or its local shard), in place, in torch ops: the
    torch-ops path, and what :func:`_compiled_step` compiles.

    ``scales``: FP8 moments' block scales (the states then e4m3 data, cast in the views of
    :func:`_fp8_view`), else None (fp32 or bf16 moments). ``remainder``: the int16 low halves
    of a ``"remainder"`` master (or their int32 values). ``tables``: the draws (one :data:`NOISE_PERIOD` table each,
    or None) of the two moments' and the parameter's stochastic roundings; ``start``: the
    global flat index of ``local``'s first element."""
    # The fp32 tensor the update is applied to: the parameter itself when it is fp32.
    if local.dtype == torch.float32:
        param = local
    elif master_weights == "remainder":
        assert remainder is not None
        param = join_master(local, remainder)
    else:
        # Deliberate upcast: the update is computed in fp32 from the low-precision parameter.
        param = local.to(torch.float32)
    grad = grad if grad.dtype == torch.float32 else grad.to(torch.float32)

    if s.weight_decay != 0:
        param.mul_(1 - s.lr * s.weight_decay)
    if scales is not None:
        view = _fp8_view(tuple(local.shape))
        exp_avg = _dequantize_moment(exp_avg_state, scales[0], view)
        exp_avg_sq = _dequantize_moment(exp_avg_sq_state, scales[1], view)
    elif exp_avg_state.dtype != torch.float32:
        exp_avg, exp_avg_sq = exp_avg_state.to(torch.float32), exp_avg_sq_state.to(torch.float32)
    else:
        exp_avg, exp_avg_sq = exp_avg_state, exp_avg_sq_state

    if isinstance(s.neg_step_size, torch.Tensor):
        exp_avg, exp_avg_sq = compiled_moments(grad, exp_avg, exp_avg_sq, s)
        if exp_avg_state.dtype == torch.float32 and scales is None:
            exp_avg_state.copy_(exp_avg)
            exp_avg_sq_state.copy_(exp_avg_sq)
        denom = (_sqrt(exp_avg_sq) / s.bias_correction2_sqrt).add_(s.eps)
        # addcdiv takes a Number: the 0-dim step size multiplies first, as the CPU's addcdiv
        # computes ``p + (s * m) / d`` (two roundings, then the sum's).
        param.add_(exp_avg.mul(s.neg_step_size).div_(denom))
    else:
        # The ops and their order are torch's single-tensor AdamW's (bit-identical in fp32).
        exp_avg.lerp_(grad, 1 - s.beta1)
        exp_avg_sq.mul_(s.beta2).addcmul_(grad, grad, value=1 - s.beta2)
        denom = (_sqrt(exp_avg_sq) / s.bias_correction2_sqrt).add_(s.eps)
        param.addcdiv_(exp_avg, denom, value=s.neg_step_size)

    if scales is not None:
        moments = (("exp_avg", exp_avg_state, exp_avg), ("exp_avg_sq", exp_avg_sq_state, exp_avg_sq))
        for (name, state, value), table, scale in zip(moments, tables, scales):
            draws = None if table is None else uniform(table, start, view.data)
            data, new_scale = _quantize_moment(value, name, draws, view)
            state.copy_(data)
            scale.copy_(new_scale)
    elif exp_avg_state.dtype != torch.float32:
        exp_avg_state.copy_(exp_avg)
        exp_avg_sq_state.copy_(exp_avg_sq)

    if param is not local:
        if master_weights == "remainder":
            assert remainder is not None
            high, low = split_master(param)
            local.copy_(high)
            remainder.copy_(low)
        elif master_weights == "stochastic":
            assert tables[2] is not None
            local.copy_(stochastic_bf16(param, uniform(tables[2], start, tuple(local.shape))))
        else:
            local.copy_(param)


def _run_compiled(
    local: torch.Tensor,
    grad: torch.Tensor,
    exp_avg_state: torch.Tensor,
    exp_avg_sq_state: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None,
    remainder: torch.Tensor | None,
    tables: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    start: int,
    s: Scalars,
    master_weights: str | None,
) -> None:
    """:func:`_tensor_step` through :func:`_compiled_step`, one graph for every shape.

    Every tensor is seen in rows of one block (FP8 moments; others when they divide into
    them: one draw-table offset per row) or flat, the scales as a column; detached (a view's
    base shape would be guarded on). The offset and the step's scalars are tensors, no
    constants to specialize on (fp32, as the eager ops round the Python floats)."""
    flat = (-1, FP8_BLOCK) if scales is not None or local.numel() % FP8_BLOCK == 0 else (-1,)
    tensors = [t.view(flat).detach() for t in (local, grad, exp_avg_state, exp_avg_sq_state)]
    scales = None if scales is None else (scales[0].view(-1, 1).detach(), scales[1].view(-1, 1).detach())
    # The int16 remainder widened to int32 around the compiled step: inductor's CPU code
    # vectorizes no loop that touches int16, and this one is every pass over the tensor.
    wide = None if remainder is None else remainder.view(flat).to(torch.int32)
    s = s._replace(
        bias_correction2_sqrt=torch.tensor(s.bias_correction2_sqrt, dtype=torch.float32),
        neg_step_size=torch.tensor(s.neg_step_size, dtype=torch.float32),
    )
    offset = torch.tensor(start, dtype=torch.int64)
    with unlimited_recompiles():  # one graph per dtype and mode, never one per shape or step
        _compiled_step(_COMPILE_BACKEND)(*tensors, scales, wide, tables, offset, s, master_weights)
    if remainder is not None and wide is not None:
        remainder.copy_(wide.view(remainder.shape))  # int32 -> int16: the low 16 bits, the value


#: The backend of the compiled CPU step (the tests swap in a cheaper one to check the logic).
_COMPILE_BACKEND = "inductor"


@functools.cache
def _compiled_step(backend: str) -> Callable[..., None]:
    """:func:`_tensor_step` compiled once for every shape (``dynamic=True``; the Python
    float scalars are graph inputs, so neither a new step nor a new lr recompiles)."""
    # The draw tables' indices are in range by construction (a remainder by the period), so
    # inductor's per-index bounds assertion is left out of this graph.
    options: dict[str, str | int | bool | Callable[..., Any]] | None = None
    if backend == "inductor":
        options = {"assert_indirect_indexing": False}
    return torch.compile(_tensor_step, backend=backend, dynamic=True, fullgraph=True, options=options)


# ---------------------------------------------------------------- the optimizer


class AdamW(torch.optim.Optimizer):
    """AdamW (``torch.optim.AdamW``'s defaults and math) with moments in ``state_dtype`` and,
    for bf16 parameters, a choice of ``master_weights``. See the module docstring.

    Group options: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``state_dtype``,
    ``master_weights`` (a group added later inherits the constructor's unless it sets them).
    ``fused`` and ``compiled`` (the whole optimizer): None, True or False, see the module
    docstring's "Speed".

    State per parameter: ``step`` (a 0-dim fp32 CPU tensor, as torch's); ``exp_avg`` and
    ``exp_avg_sq`` (the parameter's shape, in ``state_dtype``: e4m3 data for FP8 states,
    fp32 for a tensor that keeps fp32 moments); for FP8 states ``exp_avg_scale`` and
    ``exp_avg_sq_scale`` (fp32, one per block: ``(rows, blocks per row)``); with
    ``master_weights="remainder"`` ``master_remainder`` (int16, the parameter's shape).
    Every entry is a plain tensor, so ``state_dict()`` loads with ``torch.load(weights_only=True)``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        state_dtype: torch.dtype = torch.float32,
        master_weights: str | None = None,
        fused: bool | None = None,
        compiled: bool | None = None,
    ) -> None:
        _check_hyper(lr, betas, eps, weight_decay)
        _check_options(state_dtype, master_weights)
        if fused not in (None, True, False):
            raise ValueError(f"fused must be None (automatic), True or False; got {fused!r}")
        if fused and not triton_adamw.available():
            raise ValueError("fused=True needs triton (it ships with CUDA builds of torch); use fused=None or False")
        #: None: the fused kernel for CUDA tensors (eager, triton importable); True: wherever
        #: it takes the tensor (CPU tensors through the Triton interpreter: slow, for tests);
        #: False: never (the torch-ops path, or the compiled CPU step: ``compiled``).
        self.fused = fused
        if compiled not in (None, True, False):
            raise ValueError(f"compiled must be None (automatic), True or False; got {compiled!r}")
        if compiled and cpu_compiler() is None:
            raise ValueError(
                "compiled=True needs a C++ compiler for inductor's CPU code (g++, or the one CXX names) and none "
                "is on the PATH; use compiled=None (the torch-ops path without one) or False"
            )
        #: None: the compiled CPU step where the torch-ops step is slow (see "Speed"), when a
        #: C++ compiler is found; True: every CPU tensor it takes; False: never.
        self.compiled = compiled
        self._compiler = compiled is not False and cpu_compiler() is not None
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults | {"state_dtype": state_dtype, "master_weights": master_weights})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        _check_options(group["state_dtype"], group["master_weights"])
        for p in group["params"]:
            if p.is_complex():
                raise ValueError(f"AdamW takes real parameters; got a {p.dtype} parameter of shape {tuple(p.shape)}")
            if not p.is_floating_point():
                raise ValueError(f"AdamW takes floating-point parameters; got {p.dtype}")
            if group["master_weights"] is not None and p.dtype != torch.bfloat16:
                raise ValueError(
                    f"master_weights={group['master_weights']!r} applies to bf16 parameters only; got a {p.dtype} "
                    f"parameter of shape {tuple(p.shape)} (put it in a param group with master_weights=None)"
                )

    # ------------------------------------------------------------ state

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[p]
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        local = local_shard(p)
        state_dtype = group["state_dtype"]
        if _uses_fp8(p, state_dtype):
            check_fp8_placements(p)
            view = _fp8_view(tuple(local.shape))
            scale_shape = (p.shape[0], view.blocks[1])
            zeros = torch.zeros(local.shape, dtype=torch.float32, device=local.device)
            for name in ("exp_avg", "exp_avg_sq"):
                data, scale = _quantize_moment(zeros, name, torch.zeros(view.data, device=local.device), view)
                state[name] = wrap_like(data, p, tuple(p.shape))
                state[name + "_scale"] = wrap_like(scale, p, scale_shape)
        else:
            dtype = torch.bfloat16 if state_dtype == torch.bfloat16 else torch.float32
            for name in ("exp_avg", "exp_avg_sq"):
                # torch.zeros, not zeros_like: a weight wrapper subclass (FSDP2 FP8 all-gather)
                # must not make its moments wrappers too.
                state[name] = wrap_like(torch.zeros(local.shape, dtype=dtype, device=local.device), p, tuple(p.shape))
        if group["master_weights"] == "remainder":
            # A bf16 parameter is an fp32 master whose low half is zero: the remainder starts at 0.
            remainder = torch.zeros(local.shape, dtype=torch.int16, device=local.device)
            state["master_remainder"] = wrap_like(remainder, p, tuple(p.shape))
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, but every state tensor keeps the dtype it was saved in (torch's casts
        floating-point state to the parameter's dtype, which would undo 8-bit and bf16
        states and round fp32 moments of a bf16 parameter)."""
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        super().load_state_dict(state_dict)
        for group, saved in zip(self.param_groups, saved_groups):
            for p, pid in zip(group["params"], saved["params"]):
                if pid not in saved_state:
                    continue
                for key, value in saved_state[pid].items():
                    if isinstance(value, torch.Tensor) and key != "step":
                        self.state[p][key] = value.to(device=p.device, copy=True)

    # ------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = -1
        for group in self.param_groups:
            for p in group["params"]:
                index += 1  # the parameter's position: part of its stochastic rounding's seed
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW does not support sparse gradients; got a sparse gradient")
                state = self.state[p]
                if len(state) == 0:
                    state = self._init_state(p, group)
                self._update(p, p.grad, index, state, group)
        return loss

    def _update(
        self, p: torch.Tensor, grad: torch.Tensor, index: int, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        """One step of one parameter, on its local shard: every op is elementwise or per row
        block, so a sharded step makes no collective and computes what one process does."""
        step_t = state["step"]
        step_t += 1
        local, grad = local_shard(p), local_shard(grad)
        compiling = torch.compiler.is_compiling()
        # Eager: the count as a Python float (a CPU tensor, as torch's: no device sync), for
        # torch's float64 scalar math. Under torch.compile the counter stays a tensor: a
        # read would break the graph, and a constant would recompile every step.
        step = step_t.to(torch.float64) if compiling else step_t.item()
        if not compiling and self._takes_kernel(local, grad, state):
            self._fused_update(p, local, grad, index, int(step), state, group)
            return
        master_weights = group["master_weights"] if local.dtype == torch.bfloat16 else None
        fp8 = "exp_avg_scale" in state

        def table(moment: int, stochastic: bool) -> torch.Tensor | None:
            # The draws of moment 0 (exp_avg), 1 (exp_avg_sq) or 2 (the bf16 parameter).
            if not stochastic:
                return None
            if compiling:
                return noise_table_at(step_t, index, moment, local.device)
            return noise_table(seed(index, int(step), moment), local.device)

        tables = (
            table(0, fp8 and _FP8_MOMENTS["exp_avg"].spec.rounding == "stochastic"),
            table(1, fp8 and _FP8_MOMENTS["exp_avg_sq"].spec.rounding == "stochastic"),
            table(2, master_weights == "stochastic"),
        )
        args = (
            local, grad, local_shard(state["exp_avg"]), local_shard(state["exp_avg_sq"]),
            (local_shard(state["exp_avg_scale"]), local_shard(state["exp_avg_sq_scale"])) if fp8 else None,
            local_shard(state["master_remainder"]) if master_weights == "remainder" else None,
            tables, row_offset(p) * row_length(p), scalars(group, step), master_weights,
        )  # fmt: skip
        if compiling or not self._takes_compiled(local, grad, state, group):
            _tensor_step(*args)
        else:
            _run_compiled(*args)

    # ------------------------------------------------------------ the fused and compiled steps

    def _takes_kernel(self, local: torch.Tensor, grad: torch.Tensor, state: dict[str, Any]) -> bool:
        if self.fused is False:
            return False
        if self.fused is None and not (local.is_cuda and triton_adamw.available()):
            return False
        names = ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale", "master_remainder")
        states = tuple(local_shard(state[name]) for name in names if name in state)
        return triton_adamw.supports(local, grad, states)

    def _takes_compiled(
        self, local: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> bool:
        """Whether ``local`` takes the compiled CPU step: plain contiguous CPU tensors (FP8
        moments: rows of whole blocks), with ``compiled=True``; with None, when a C++
        compiler is found, tensors of at least :data:`COMPILE_MIN_NUMEL` elements whose
        torch-ops step is slow (FP8 moments, a "remainder" or "stochastic" master)."""
        if not self._compiler or local.numel() == 0:
            return False
        fp8 = "exp_avg_scale" in state
        if self.compiled is None:
            slow = fp8 or (local.dtype == torch.bfloat16 and group["master_weights"] is not None)
            if not slow or local.numel() < COMPILE_MIN_NUMEL:
                return False
        tensors = (local, grad, *(local_shard(v) for v in state.values() if isinstance(v, torch.Tensor)))
        if any(type(t) not in _PLAIN or not t.is_contiguous() or t.device.type != "cpu" for t in tensors[:2]):
            return False
        if any(type(t) not in _PLAIN or not t.is_contiguous() for t in tensors[2:]):
            return False
        return not fp8 or _fp8_view(tuple(local.shape)).data[1] == FP8_BLOCK

    def _fused_update(
        self,
        p: torch.Tensor,
        local: torch.Tensor,
        grad: torch.Tensor,
        index: int,
        step: int,
        state: dict[str, Any],
        group: dict[str, Any],
    ) -> None:
        """:meth:`_update` by one kernel launch (``f8tensor.kernels.triton_adamw``): the same
        ops, seeds and draws, on the local shard."""
        beta1, beta2 = group["betas"]
        scalars = triton_adamw.AdamWScalars(group["lr"], beta1, beta2, group["eps"], group["weight_decay"], step)
        master_weights = group["master_weights"] if local.dtype == torch.bfloat16 else None
        fp8 = "exp_avg_scale" in state
        start = row_offset(p) * row_length(p)
        m_table = v_table = p_table = None
        if fp8:
            stochastic = (
                _FP8_MOMENTS["exp_avg"].spec.rounding == "stochastic",
                _FP8_MOMENTS["exp_avg_sq"].spec.rounding == "stochastic",
            )
            if stochastic[0]:
                m_table = noise_table(seed(index, step, 0), local.device)
            if stochastic[1]:
                v_table = noise_table(seed(index, step, 1), local.device)
        if master_weights == "stochastic":
            p_table = noise_table(seed(index, step, 2), local.device)
        triton_adamw.adamw_step(
            local, grad, local_shard(state["exp_avg"]), local_shard(state["exp_avg_sq"]), scalars,
            scales=(local_shard(state["exp_avg_scale"]), local_shard(state["exp_avg_sq_scale"])) if fp8 else None,
            block=FP8_BLOCK, stochastic=stochastic if fp8 else (False, False), tables=(m_table, v_table, p_table),
            start=start, master=master_weights,
            remainder=local_shard(state["master_remainder"]) if master_weights == "remainder" else None,
        )  # fmt: skip
