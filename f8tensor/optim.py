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
  for rows that are multiples of 128. Both go through f8tensor's one block cast
  (:func:`f8tensor.kernels.cast`, rule ``data = saturate(x * scale)``, dynamic scale
  ``448 / block amax``) with stochastic rounding, and come back through
  :func:`f8tensor.kernels.dequantize`. Tensors of one dim or with fewer than
  :data:`FP8_BLOCK` elements (biases, norms) keep fp32 moments: their states are a rounding
  error of the model's, and a 1-D tensor sharded by FSDP2 would cut its blocks.

  Blocks along dim-0 rows: FSDP2 shards dim 0, so every shard holds whole rows and its
  blocks are the blocks one process has; with stochastic draws that are a function of the
  element's global index (below), a sharded step writes the bits one process writes, on
  any number of ranks, and a DCP checkpoint reshards without touching a block.

  Stochastic rounding, without generator state: element ``i`` of a tensor draws entry
  ``i mod`` :data:`NOISE_PERIOD` of a table filled by a generator seeded with
  ``(parameter position, step, moment)``. Resume is bit-exact with nothing but the step
  counters saved, and a shard draws what one process draws at the same elements.

  Why stochastic rounding, ``v`` as is, blocks of 128, measured (final loss relative to
  fp32 moments, mean of 3 seeds; 1.0 is fp32). ``tests/modules/test_optim.py``'s MLP (16 -> 64 ->
  64 -> 4, 150 steps, lr 1e-3): round to nearest 0.917; stochastic rounding of both
  moments 0.994; stochastic ``v`` only 1.015; bf16 moments 1.000. The demo GPT (``small``,
  250 steps, bf16 autocast, betas (0.9, 0.95), seeds 0-2; fp32 moments 2.2268 / 2.2490 /
  2.2241): stochastic +0.31% / +0.02% / -0.56% (mean -0.08%), round to nearest +0.18% /
  -0.02% / -0.10% (mean +0.02%), both within the seeds' spread. Round to nearest cannot follow ``v``'s slow decay by ``beta2``: a decay of 0.1%
  per step is far below half an e4m3 spacing (3-6%), so ``v`` sticks and the updates come
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

FSDP2 (``fully_shard``) and other DTensor parameters: every op of a step is elementwise or
per row block, so the step runs on the local shards and makes no collective; the states
are DTensors with the parameter's mesh and placements (FP8 states need dim-0 sharding or
replication), so ``torch.distributed.checkpoint`` saves and reshards them. A weight wrapper
subclass as the local shard (FSDP2 FP8 all-gather) is updated in place through its own ops;
its moments are plain tensors.

Speed: a fused step. On CUDA tensors (a DTensor's local shard included), in eager mode, with
triton importable, each parameter tensor takes one Triton kernel
(:mod:`f8tensor.kernels.triton_adamw`) that reads the parameter (and its remainder), the
gradient and both moments once (dequantizing FP8 moments with their block scales),
computes the update in fp32 and writes everything back once, requantizing FP8 moments per
block in the same program, with the same seeded draws (a ``NOISE_PERIOD`` table per moment
made on the device before the launch). Its bits are the torch-ops path's on the same device
(the kernel follows torch's CUDA or CPU rounding of each op; on CPU the one difference is
torch's vectorized CPU square root, which is not always correctly rounded). Elsewhere (CPU
tensors, fp16 parameters, non-contiguous tensors, a weight wrapper subclass as the local
shard, under ``torch.compile``, which fuses the torch ops itself) the torch-ops path runs:
about 10 elementwise passes per FP8 moment. The switch: ``AdamW(..., fused=None)``
(the default: as above), ``fused=False`` (the torch-ops path everywhere), ``fused=True``
(the kernel wherever it takes the tensor, CPU tensors through the Triton interpreter: the
CPU tests' way in; slow). No host sync on either path: the step counter is a CPU tensor,
as torch's, and nothing else is read back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from f8tensor.compat import dtensor_local
from f8tensor.kernels import cast, dequantize, triton_adamw
from f8tensor.specs import CastSpec

if dist.is_available():
    from torch.distributed.tensor import DTensor, Replicate, Shard
else:  # a torch build without torch.distributed: nothing is ever a DTensor
    DTensor = ()  # type: ignore[misc,assignment]  # isinstance(x, ()) is always False

__all__ = ["FP8_BLOCK", "MASTER_WEIGHTS", "STATE_DTYPES", "AdamW"]

#: The moment dtypes :class:`AdamW` accepts.
STATE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)
#: The ``master_weights`` values :class:`AdamW` accepts.
MASTER_WEIGHTS: tuple[str | None, ...] = (None, "stochastic", "remainder")
#: Elements per fp32 scale of an FP8 moment (along the flattened tensor); also the size
#: below which a tensor keeps fp32 moments.
FP8_BLOCK = 128

# The blocks run along each row of the parameter seen as (dim 0, everything else): a shard
# along dim 0 (FSDP2's) holds whole rows, so its blocks are the one-process blocks.
_FP8_BLOCK_2D = (1, FP8_BLOCK)
#: How each FP8 moment is rounded to e4m3 (see the module docstring for the measurements).
FP8_ROUNDING: dict[str, str] = {"exp_avg": "stochastic", "exp_avg_sq": "stochastic"}
_FP8_SPECS = {
    name: CastSpec(torch.float8_e4m3fn, _FP8_BLOCK_2D, rounding=rounding) for name, rounding in FP8_ROUNDING.items()
}
_MASK32 = 0xFFFFFFFF
#: The period of the stochastic-rounding draws along a tensor's flattened elements (a prime).
NOISE_PERIOD = 65537


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


# ---------------------------------------------------------------- the bf16 master encodings


def _halves(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int16 (low, high) halves of each fp32 element of ``master`` (views of its bytes:
    little-endian, as every host and GPU torch runs on)."""
    pairs = master.reshape(-1).view(torch.int16).view(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def _split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``master`` -> (bf16 rounded to nearest, ties away from zero; int16 low half).

    The bf16 bits are the master's high 16 bits plus one when its low half is >= 0x8000
    (its int16 is negative; on the sign-magnitude pattern: one ulp away from zero). The low
    half is stored as is, so the high half is the bf16's minus that carry, which the low
    half's top bit says. int16 arithmetic throughout (a finite master never carries past
    0x7F80, inf's pattern; only NaN patterns could wrap, and stay NaN or become inf).
    """
    low, high = _halves(master)
    bf16 = (high + (low < 0).to(torch.int16)).view(torch.bfloat16).view(master.shape)
    return bf16, low.clone().view(master.shape)


def _join_master(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master that :func:`_split_master` split into ``param`` and ``remainder``."""
    low = remainder.reshape(-1)
    high = param.reshape(-1).view(torch.int16) - (low < 0).to(torch.int16)
    return torch.stack((low, high), dim=-1).view(torch.int32).view(torch.float32).view(param.shape)


def _stochastic_bf16(x: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to bf16 stochastically: up (in magnitude) with probability equal to
    the dropped low half's fraction of a bf16 ulp (``uniform``: draws in ``[0, 1)`` with 24
    bits, ``x``'s shape). NaN stays NaN; inf stays inf."""
    noise = (uniform * (1 << 16)).to(torch.int32)  # exact: uniform integers in [0, 2**16)
    bits = (x.view(torch.int32) + noise) & ~0xFFFF
    out = bits.view(torch.float32)
    out = torch.where(torch.isfinite(x), out, x)
    return out.to(torch.bfloat16)


# ---------------------------------------------------------------- sharded parameters and FP8 layout


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor FSDP2 keeps; in-place updates reach the
    parameter), any other tensor itself."""
    return dtensor_local(t) if isinstance(t, DTensor) else t


def _uses_fp8(p: torch.Tensor, state_dtype: torch.dtype) -> bool:
    """FP8 moments for tensors of two or more dims and at least :data:`FP8_BLOCK` elements;
    the rest (biases, norms, scalars) keep fp32 moments."""
    return state_dtype == torch.float8_e4m3fn and p.dim() >= 2 and p.numel() >= FP8_BLOCK


def _check_fp8_placements(p: torch.Tensor) -> None:
    if not isinstance(p, DTensor):
        return
    for placement in p.placements:
        if not (isinstance(placement, Replicate) or (isinstance(placement, Shard) and placement.dim == 0)):
            raise ValueError(
                "state_dtype=torch.float8_e4m3fn keeps one scale per 128 elements of each dim-0 row, so a "
                f"DTensor parameter must be sharded on dim 0 or replicated; got placements {p.placements} for a "
                f"parameter of shape {tuple(p.shape)} (use state_dtype=torch.bfloat16 for it)"
            )


def _row_offset(p: torch.Tensor) -> int:
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


def _wrap_like(local: torch.Tensor, p: torch.Tensor, global_shape: tuple[int, ...]) -> torch.Tensor:
    """``local`` as a DTensor with ``p``'s mesh and placements (no collective), when ``p``
    is one; ``local`` itself otherwise."""
    if not isinstance(p, DTensor):
        return local
    stride = torch.empty(global_shape, device="meta").stride()
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=torch.Size(global_shape), stride=stride
    )


def _hash32(x: int) -> int:
    """A 32-bit integer mix (two rounds of multiply and xor-shift)."""
    for _ in range(2):
        x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def _uniform(start: int, shape: tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    """Uniform fp32 draws in ``[0, 1)`` for the elements ``start, start + 1, ...`` (global
    flat indices) of a tensor: element ``i`` draws entry ``i mod`` :data:`NOISE_PERIOD` of a
    table that a generator seeded with ``seed`` fills. A function of ``(seed, i)`` only: a
    shard draws what one process draws at the same elements, and a resumed run repeats its
    draws with no generator state to restore. Elements a period apart share a draw within
    a step (a prime period, so never along one column of a power-of-two width); each
    element's draws over the steps are independent, which is what unbiased rounding needs.
    One table of the period per call, then one copy: no per-element hashing."""
    n = math.prod(shape)
    table = _noise_table(seed, device)
    first = start % NOISE_PERIOD
    reps = -(-(first + n) // NOISE_PERIOD)
    return table.repeat(reps)[first : first + n].reshape(shape)


def _noise_table(seed: int, device: torch.device) -> torch.Tensor:
    """The :data:`NOISE_PERIOD` uniform fp32 draws of ``seed`` (the table :func:`_uniform`
    repeats; the fused kernel indexes it directly)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return torch.rand(NOISE_PERIOD, generator=generator, device=device)


def _seed(param_index: int, step: int, moment: int) -> int:
    return _hash32(_hash32(_hash32(param_index) ^ step) ^ moment)


# ---------------------------------------------------------------- the optimizer


class AdamW(torch.optim.Optimizer):
    """AdamW (``torch.optim.AdamW``'s defaults and math) with moments in ``state_dtype`` and,
    for bf16 parameters, a choice of ``master_weights``. See the module docstring.

    Group options: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``state_dtype``,
    ``master_weights`` (a group added later inherits the constructor's unless it sets them).
    ``fused`` (the whole optimizer): None, True or False, see the module docstring's "Speed".

    State per parameter: ``step`` (a 0-dim fp32 tensor, as torch's); ``exp_avg`` and
    ``exp_avg_sq`` (the parameter's shape, in ``state_dtype``; fp32 for FP8 states of a
    tensor under :data:`FP8_BLOCK` elements); for FP8 states ``exp_avg`` (flat e4m3 data),
    ``exp_avg_scale``, ``exp_avg_sq`` (flat e4m3 data) and ``exp_avg_sq_scale``
    (fp32, one per block of :data:`FP8_BLOCK`); with ``master_weights="remainder"``
    ``master_remainder`` (int16, the parameter's shape). Every entry is a plain tensor, so
    ``state_dict()`` loads with ``torch.load(weights_only=True)``.

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
    ) -> None:
        _check_hyper(lr, betas, eps, weight_decay)
        _check_options(state_dtype, master_weights)
        if fused not in (None, True, False):
            raise ValueError(f"fused must be None (automatic), True or False; got {fused!r}")
        if fused and not triton_adamw.available():
            raise ValueError("fused=True needs triton (it ships with CUDA builds of torch); use fused=None or False")
        #: None: the fused kernel for CUDA tensors (eager, triton importable), the torch-ops
        #: path elsewhere; True: the kernel wherever it takes the tensor (CPU tensors through
        #: the Triton interpreter: slow, for tests); False: the torch-ops path everywhere.
        self.fused = fused
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "state_dtype": state_dtype,
            "master_weights": master_weights,
        }
        super().__init__(params, defaults)

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
        local = _local(p)
        state_dtype = group["state_dtype"]
        if _uses_fp8(p, state_dtype):
            _check_fp8_placements(p)
            row = p.numel() // p.shape[0]
            scale_shape = (p.shape[0], -(-row // FP8_BLOCK))
            zeros = torch.zeros(local.shape[0], row, dtype=torch.float32, device=local.device)
            for name in ("exp_avg", "exp_avg_sq"):
                data, scale = cast(zeros, _FP8_SPECS[name], uniform=torch.zeros_like(zeros))
                state[name] = _wrap_like(data.view(local.shape), p, tuple(p.shape))
                state[name + "_scale"] = _wrap_like(scale, p, scale_shape)
        else:
            dtype = torch.bfloat16 if state_dtype == torch.bfloat16 else torch.float32
            for name in ("exp_avg", "exp_avg_sq"):
                # torch.zeros, not zeros_like: a weight wrapper subclass (FSDP2 FP8 all-gather)
                # must not make its moments wrappers too.
                state[name] = _wrap_like(torch.zeros(local.shape, dtype=dtype, device=local.device), p, tuple(p.shape))
        if group["master_weights"] == "remainder":
            # A bf16 parameter is an fp32 master whose low half is zero: the remainder starts at 0.
            remainder = torch.zeros(local.shape, dtype=torch.int16, device=local.device)
            state["master_remainder"] = _wrap_like(remainder, p, tuple(p.shape))
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
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        master_weights = group["master_weights"]
        step_t = state["step"]
        step_t += 1
        step = step_t.item()  # a CPU tensor, as torch's: no device sync
        local = _local(p)
        grad = _local(grad)
        if self._takes_kernel(local, grad, state):
            self._fused_update(p, local, grad, index, int(step), state, group)
            return

        # The fp32 tensor the update is applied to: the parameter itself when it is fp32.
        if p.dtype == torch.float32:
            param = local
        elif master_weights == "remainder":
            param = _join_master(local, _local(state["master_remainder"]))
        else:
            # Deliberate upcast: the update is computed in fp32 from the low-precision parameter.
            param = local.to(torch.float32)
        grad = grad if grad.dtype == torch.float32 else grad.to(torch.float32)

        if weight_decay != 0:
            param.mul_(1 - lr * weight_decay)

        fp8 = "exp_avg_scale" in state
        if fp8:
            rows = (local.shape[0], p.numel() // p.shape[0])
            m_data, v_data = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
            exp_avg = dequantize(m_data.view(rows), _local(state["exp_avg_scale"]), _FP8_BLOCK_2D, torch.float32)
            exp_avg_sq = dequantize(v_data.view(rows), _local(state["exp_avg_sq_scale"]), _FP8_BLOCK_2D, torch.float32)
            exp_avg, exp_avg_sq = exp_avg.view(local.shape), exp_avg_sq.view(local.shape)
        else:
            exp_avg, exp_avg_sq = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
            if exp_avg.dtype != torch.float32:
                exp_avg, exp_avg_sq = exp_avg.to(torch.float32), exp_avg_sq.to(torch.float32)

        # The ops and their order are torch's single-tensor AdamW's (bit-identical in fp32).
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        denom = (_sqrt(exp_avg_sq) / bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)

        if fp8:
            start = _row_offset(p) * rows[1]
            for moment, (name, value) in enumerate((("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq))):
                spec = _FP8_SPECS[name]
                uniform = None
                if spec.rounding == "stochastic":
                    uniform = _uniform(start, rows, _seed(index, int(step), moment), local.device)
                data, scale = cast(value.reshape(rows), spec, uniform=uniform)
                _local(state[name]).copy_(data.view(local.shape))
                _local(state[name + "_scale"]).copy_(scale)
        elif state["exp_avg"].dtype != torch.float32:
            _local(state["exp_avg"]).copy_(exp_avg)
            _local(state["exp_avg_sq"]).copy_(exp_avg_sq)

        if param is not local:
            if master_weights == "remainder":
                high, low = _split_master(param)
                local.copy_(high)
                _local(state["master_remainder"]).copy_(low)
            elif master_weights == "stochastic":
                start = _row_offset(p) * (p.numel() // max(p.shape[0], 1)) if p.dim() else 0
                uniform = _uniform(start, tuple(local.shape), _seed(index, int(step), 2), local.device)
                local.copy_(_stochastic_bf16(param, uniform))
            else:
                local.copy_(param)

    # ------------------------------------------------------------ the fused step

    def _takes_kernel(self, local: torch.Tensor, grad: torch.Tensor, state: dict[str, Any]) -> bool:
        if self.fused is False or torch.compiler.is_compiling():
            return False
        if self.fused is None and not (local.is_cuda and triton_adamw.available()):
            return False
        names = ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale", "master_remainder")
        states = tuple(_local(state[name]) for name in names if name in state)
        return triton_adamw.supports(local, grad, states)

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
        row = p.numel() // max(p.shape[0], 1) if p.dim() else 1
        start = _row_offset(p) * row
        m_table = v_table = p_table = None
        if fp8:
            stochastic = (
                _FP8_SPECS["exp_avg"].rounding == "stochastic",
                _FP8_SPECS["exp_avg_sq"].rounding == "stochastic",
            )
            if stochastic[0]:
                m_table = _noise_table(_seed(index, step, 0), local.device)
            if stochastic[1]:
                v_table = _noise_table(_seed(index, step, 1), local.device)
        if master_weights == "stochastic":
            p_table = _noise_table(_seed(index, step, 2), local.device)
        triton_adamw.adamw_step(
            local, grad, _local(state["exp_avg"]), _local(state["exp_avg_sq"]), scalars,
            scales=(_local(state["exp_avg_scale"]), _local(state["exp_avg_sq_scale"])) if fp8 else None,
            block=FP8_BLOCK, stochastic=stochastic if fp8 else (False, False), tables=(m_table, v_table, p_table),
            start=start, master=master_weights,
            remainder=_local(state["master_remainder"]) if master_weights == "remainder" else None,
        )  # fmt: skip
