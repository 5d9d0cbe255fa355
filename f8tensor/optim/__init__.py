"""AdamW with fp32, bf16 or 8-bit moments, and lean master weights for bf16 parameters.

:class:`AdamW` has ``torch.optim.AdamW``'s defaults and math; what differs is where the
state lives (``state_dtype``; e4m3 moments with one fp32 scale per 128 elements of a row,
stochastically rounded by :mod:`f8tensor.optim.draws`) and how a bf16 parameter's update is
written back (:mod:`f8tensor.optim.master`). fp32 states on fp32 parameters are
bit-identical to ``torch.optim.AdamW(foreach=False)``; non-finite values propagate element
by element as in torch. The torch ops, the Triton kernel and the inductor-compiled CPU step
give the same bits.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from f8tensor.compat import cpu_compiler, unlimited_recompiles
from f8tensor.kernels import triton_adamw
from f8tensor.optim.draws import NOISE_PERIOD, noise_table, noise_table_at, seed, uniform
from f8tensor.optim.master import join_master, split_master, stochastic_bf16
from f8tensor.optim.shards import check_fp8_placements, local_shard, row_length, row_offset, wrap_like
from f8tensor.optim.step_math import (
    MASTER_WEIGHTS,
    STATE_DTYPES,
    TORCH_FIXED_OPTIONS,
    Scalars,
    check_group,
    compiled_moments,
    scalars,
)
from f8tensor.quant.block_quantizers import BlockQuantizer, moment_quantizer
from f8tensor.quant.scaling import block_abs_max

__all__ = ["COMPILE_MIN_NUMEL", "FP8_BLOCK", "MASTER_WEIGHTS", "NOISE_PERIOD", "STATE_DTYPES", "AdamW"]

#: Elements per fp32 scale of an FP8 moment (along the flattened tensor); also the size
#: below which a tensor keeps fp32 moments.
FP8_BLOCK = 128

#: How each FP8 moment is rounded to e4m3 (measurements: BENCHMARKS.md).
FP8_ROUNDING: dict[str, str] = {"exp_avg": "stochastic", "exp_avg_sq": "stochastic"}
# Blocks run along each row of the parameter as (dim 0, rest): a dim-0 shard holds whole rows.
_FP8_MOMENTS: dict[str, BlockQuantizer] = {
    name: moment_quantizer(torch.float8_e4m3fn, FP8_BLOCK, rounding) for name, rounding in FP8_ROUNDING.items()
}
#: ``compiled=None``: the smallest CPU tensor that takes the compiled step.
COMPILE_MIN_NUMEL = 1 << 20
_PLAIN = (torch.Tensor, torch.nn.Parameter)


#: torch's sqrt: the CPU's vectorized one is not always correctly rounded (CUDA's and the
#: kernel's are); the kernel tests swap in a correctly rounded one.
_sqrt = torch.sqrt


# ---------------------------------------------------------------- FP8 moments: one cast each way


def _uses_fp8(p: torch.Tensor, state_dtype: torch.dtype) -> bool:
    """FP8 moments for tensors of 2+ dims and at least :data:`FP8_BLOCK` elements."""
    return state_dtype == torch.float8_e4m3fn and p.dim() >= 2 and p.numel() >= FP8_BLOCK


class _Fp8View(NamedTuple):
    """The 2D shapes an FP8 moment's data and scales are cast in, and its ``blocks`` (stored scales).

    Rows of whole blocks are seen one block per row, so the scales broadcast.
    """

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
    """An FP8 moment in fp32, in the parameter's shape: the one way back."""
    return _FP8_MOMENTS["exp_avg"].dequantize(data.view(view.data), scale.view(view.scale)).view(data.shape)


def _quantize_moment(
    value: torch.Tensor, name: str, uniform: torch.Tensor | None, view: _Fp8View
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``value`` as moment ``name``'s e4m3 data and fp32 block scales: the one cast.

    A block's scale comes from its finite elements; a non-finite one is stored as NaN (e4m3 has
    no infinity). ``uniform``: stochastic rounding's draws.
    """
    quantizer, hp = _FP8_MOMENTS[name], value.view(view.data)
    finite = torch.isfinite(hp)
    scale = quantizer.scale_for(block_abs_max(torch.where(finite, hp, 0.0), quantizer.spec.block))
    data, scale = quantizer.quantize(torch.where(finite, hp, math.nan), scale, uniform=uniform)
    return data.view(value.shape), scale.view(view.blocks)


# ---------------------------------------------------------------- one tensor's step


def _amsgrad(exp_avg_sq: torch.Tensor, max_exp_avg_sq: torch.Tensor | None) -> torch.Tensor:
    """``exp_avg_sq``, or with amsgrad its running max (updated in place)."""
    if max_exp_avg_sq is None:
        return exp_avg_sq
    return torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)


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
    max_exp_avg_sq: torch.Tensor | None = None,
) -> None:
    """One step of one tensor (a parameter or its local shard), in place, in torch ops.

    Args:
        scales: FP8 moments' block scales, else None.
        remainder: a ``"remainder"`` master's int16 low halves (or int32 values).
        tables: the draw tables of the two moments' and the parameter's roundings, or None.
        start: the global flat index of ``local``'s first element.
        max_exp_avg_sq: amsgrad's fp32 state.
    """
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
        denom = (_sqrt(_amsgrad(exp_avg_sq, max_exp_avg_sq)) / s.bias_correction2_sqrt).add_(s.eps)
        # addcdiv takes a Number: multiply by the 0-dim step size first, as the CPU's addcdiv does.
        param.add_(exp_avg.mul(s.neg_step_size).div_(denom))
    else:
        # The ops and their order are torch's single-tensor AdamW's (bit-identical in fp32).
        exp_avg.lerp_(grad, 1 - s.beta1)
        exp_avg_sq.mul_(s.beta2).addcmul_(grad, grad, value=1 - s.beta2)
        denom = (_sqrt(_amsgrad(exp_avg_sq, max_exp_avg_sq)) / s.bias_correction2_sqrt).add_(s.eps)
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

    Tensors are seen in rows of one block or flat, detached; the offset and scalars are fp32
    tensors, so nothing specializes.
    """
    flat = (-1, FP8_BLOCK) if scales is not None or local.numel() % FP8_BLOCK == 0 else (-1,)
    tensors = [t.view(flat).detach() for t in (local, grad, exp_avg_state, exp_avg_sq_state)]
    scales = None if scales is None else (scales[0].view(-1, 1).detach(), scales[1].view(-1, 1).detach())
    # int16 widened to int32: inductor's CPU code vectorizes no loop touching int16.
    wide = None if remainder is None else remainder.view(flat).to(torch.int32)
    s = s._replace(
        bias_correction2_sqrt=torch.tensor(s.bias_correction2_sqrt, dtype=torch.float32),
        neg_step_size=torch.tensor(s.neg_step_size, dtype=torch.float32),
    )
    offset = torch.tensor(start, dtype=torch.int64)
    with unlimited_recompiles():  # one graph per dtype and mode
        _compiled_step(_COMPILE_BACKEND)(*tensors, scales, wide, tables, offset, s, master_weights)
    if remainder is not None and wide is not None:
        remainder.copy_(wide.view(remainder.shape))


#: The compiled CPU step's backend (tests swap in a cheaper one).
_COMPILE_BACKEND = "inductor"


@functools.cache
def _compiled_step(backend: str) -> Callable[..., None]:
    """:func:`_tensor_step` compiled once for every shape and scalar."""
    # Draw-table indices are in range by construction: no bounds assertion.
    options: dict[str, str | int | bool | Callable[..., Any]] | None = None
    if backend == "inductor":
        options = {"assert_indirect_indexing": False}
    return torch.compile(_tensor_step, backend=backend, dynamic=True, fullgraph=True, options=options)


def _loaded_state(p: torch.Tensor, group: dict[str, Any], saved: dict[str, Any], pid: Any) -> dict[str, Any]:
    """Saved state ``pid`` as :class:`AdamW` keeps it for ``p`` in ``group``.

    Raises:
        ValueError: a state it cannot take.
    """
    out = {k: v.to(device=p.device, copy=True) for k, v in saved.items() if isinstance(v, torch.Tensor)}
    for name in ("step", "exp_avg", "exp_avg_sq"):
        if name not in out:
            raise ValueError(f"the saved state of parameter {pid} has no tensor {name!r}; got keys {sorted(saved)}")
    out["step"] = saved["step"].detach().to("cpu", torch.float32, copy=True)
    state_dtype, e4m3 = group["state_dtype"], torch.float8_e4m3fn
    fp8 = _uses_fp8(p, state_dtype)
    want = torch.bfloat16 if state_dtype == torch.bfloat16 else torch.float32
    for name in ("exp_avg", "exp_avg_sq"):
        dtype = out[name].dtype
        if fp8 and (dtype != e4m3 or name + "_scale" not in out):
            raise ValueError(
                f"parameter {pid}: state_dtype={e4m3} takes e4m3 {name} with {name}_scale; the saved {name} is "
                f"{dtype}{'' if name + '_scale' in out else ' without scales'} (load it into an AdamW with "
                "state_dtype=torch.float32 or torch.bfloat16)"
            )
        if not fp8 and dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"parameter {pid}: state_dtype={state_dtype} keeps {want} {name}; the saved {name} is {dtype} "
                f"(load it into an AdamW with state_dtype={dtype})"
            )
        if not fp8:
            out[name] = out[name].to(want)
    local = local_shard(p)
    if group["master_weights"] == "remainder" and p.dtype == torch.bfloat16 and "master_remainder" not in out:
        # A bf16 parameter is the fp32 master whose low half is zero, as a new state's.
        remainder = torch.zeros(local.shape, dtype=torch.int16, device=local.device)
        out["master_remainder"] = wrap_like(remainder, p, tuple(p.shape))
    if group["amsgrad"]:
        zeros = wrap_like(torch.zeros(local.shape, dtype=torch.float32, device=local.device), p, tuple(p.shape))
        out["max_exp_avg_sq"] = out["max_exp_avg_sq"].to(torch.float32) if "max_exp_avg_sq" in out else zeros
    return out


# ---------------------------------------------------------------- the optimizer


class AdamW(torch.optim.Optimizer):
    """AdamW (``torch.optim.AdamW``'s defaults and math) with moments in ``state_dtype``.

    Args:
        params: parameters or groups; a later group inherits the constructor's options.
        lr, betas, eps, weight_decay, amsgrad, maximize: torch's (amsgrad only with fp32 states).
        state_dtype: the moments' dtype, in :data:`STATE_DTYPES`.
        master_weights: a bf16 parameter's write-back, in :data:`MASTER_WEIGHTS`, or None.
        fused: None: the Triton kernel for CUDA tensors; True: also CPU (slow); False: never.
        compiled: None: the inductor step for CPU tensors of at least
            :data:`COMPILE_MIN_NUMEL` elements whose torch-ops step is slow; True: every
            CPU tensor; False: never.
        torch_options: torch's ``foreach``/``fused`` (ignored) and the fixed values of
            :data:`f8tensor.optim.step_math.TORCH_FIXED_OPTIONS`.

    Raises:
        TypeError: an unknown keyword.
        ValueError: a bad option value, naming the key.

    State per parameter (plain tensors: ``state_dict()`` loads with ``weights_only=True``):
    ``step`` (0-dim fp32, CPU), ``exp_avg``, ``exp_avg_sq``; for FP8 states ``exp_avg_scale``,
    ``exp_avg_sq_scale`` (``(rows, blocks per row)``); ``master_remainder`` (int16);
    ``max_exp_avg_sq``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        state_dtype: torch.dtype = torch.float32,
        master_weights: str | None = None,
        fused: bool | None = None,
        compiled: bool | None = None,
        **torch_options: Any,
    ) -> None:
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, "amsgrad": amsgrad}
        defaults |= {"maximize": maximize, "state_dtype": state_dtype, "master_weights": master_weights}
        for key in torch_options:
            if key not in TORCH_FIXED_OPTIONS:
                raise TypeError(f"AdamW got an unexpected keyword argument {key!r}")
        check_group(defaults | torch_options)
        if fused not in (None, True, False):
            raise ValueError(f"fused must be None (automatic), True or False; got {fused!r}")
        if fused and not triton_adamw.available():
            raise ValueError("fused=True needs triton (it ships with CUDA builds of torch); use fused=None or False")
        self.fused = fused
        if compiled not in (None, True, False):
            raise ValueError(f"compiled must be None (automatic), True or False; got {compiled!r}")
        if compiled and cpu_compiler() is None:
            raise ValueError(
                "compiled=True needs a C++ compiler for inductor's CPU code (g++, or the one CXX names) and none "
                "is on the PATH; use compiled=None (the torch-ops path without one) or False"
            )
        self.compiled = compiled
        self._compiler = compiled is not False and cpu_compiler() is not None
        super().__init__(params, defaults | torch_options)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, refused (the optimizer left as it was) when an option or a parameter is
        one AdamW does not take."""
        super().add_param_group(param_group)
        try:
            self._check(self.param_groups[-1])
        except Exception:
            self.param_groups.pop()
            raise

    @staticmethod
    def _check(group: dict[str, Any]) -> None:
        check_group(group)
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
                # torch.zeros: a weight wrapper must not make its moments wrappers.
                state[name] = wrap_like(torch.zeros(local.shape, dtype=dtype, device=local.device), p, tuple(p.shape))
        if group["master_weights"] == "remainder":
            remainder = torch.zeros(local.shape, dtype=torch.int16, device=local.device)
            state["master_remainder"] = wrap_like(remainder, p, tuple(p.shape))
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = wrap_like(torch.zeros_like(state["exp_avg_sq"]), p, tuple(p.shape))
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, also for ``torch.optim.AdamW``'s, keeping each state tensor's saved dtype.

        A missing group option takes the constructor's value; fp32/bf16/fp16 moments convert to an
        fp32 or bf16 ``state_dtype``; a missing ``master_remainder`` or ``max_exp_avg_sq`` starts at 0.

        Raises:
            ValueError: an option or state AdamW cannot take; the optimizer is left as it was.
        """
        groups = [self.defaults | saved for saved in state_dict["param_groups"]]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"the state dict has {len(groups)} param groups; this optimizer has {len(self.param_groups)}"
            )
        loaded: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}
        for group, saved, mine in zip(groups, state_dict["param_groups"], self.param_groups):
            self._check(group | {"params": mine["params"]})
            for p, pid in zip(mine["params"], saved["params"]):
                if pid in state_dict["state"]:
                    loaded[pid] = p, _loaded_state(p, group, state_dict["state"][pid], pid)
        super().load_state_dict(state_dict | {"param_groups": groups})
        for p, entries in loaded.values():
            self.state[p].update(entries)

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
                index += 1  # part of the rounding's seed
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
        """One step of one parameter on its local shard (elementwise: no collective)."""
        step_t = state["step"]
        step_t += 1
        local, grad = local_shard(p), local_shard(grad)
        if group["maximize"]:
            grad = torch.neg(grad)
        compiling = torch.compiler.is_compiling()
        # Eager: the count as a Python float (a CPU tensor: no sync). Compiled: a tensor (a read
        # breaks the graph, a constant recompiles every step).
        step = step_t.to(torch.float64) if compiling else step_t.item()
        if not compiling and not group["amsgrad"] and self._takes_kernel(local, grad, state):
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
            local_shard(state["max_exp_avg_sq"]) if group["amsgrad"] else None,
        )  # fmt: skip
        if compiling or group["amsgrad"] or not self._takes_compiled(local, grad, state, group):
            _tensor_step(*args)
        else:
            _run_compiled(*args[:-1])

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
        """Whether ``local`` takes the compiled CPU step (plain contiguous CPU tensors)."""
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
        """:meth:`_update` by one Triton launch: the same ops, seeds and draws."""
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
