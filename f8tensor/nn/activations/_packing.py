"""The saved-tensor hooks of :func:`save_activations_in_float8`: pack, unpack, restore."""

from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from f8tensor.compat import version_counter, view_base
from f8tensor.nn.activations import _recompute as R
from f8tensor.quant.block_quantizers import BlockQuantizer, activation_quantizer
from f8tensor.quant.formats import FLOAT8_DTYPES

#: Below this many elements a saved tensor is kept as is.
DEFAULT_MIN_NUMEL = 65536
#: The largest bound on attention's logit error (nats) from FP8 q and k at which a fused
#: attention's saved tensors stay in FP8; above it (sharp attention) all of them stay exact.
ATTENTION_LOGIT_ERROR = 0.5
#: The dtypes of the saved tensors that are compressed.
COMPRESSED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)

EAGER_ONLY = (
    "save_activations_in_float8() is eager-only: its saved-tensor hooks cannot run inside a region "
    "torch.compile traces. Enter the context outside the compiled function (the tensors a compiled "
    "graph saves are then packed around it, in eager), or drop it from the compiled code"
)


class _Kept:
    """A saved tensor kept as is, with its version at save (unpack checks it: autograd does not here)."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.version = version_counter(tensor)


def _modified(t: torch.Tensor, saved: int) -> RuntimeError:
    """The error autograd gives for a saved tensor changed in place since it was saved."""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: a "
        f"{tuple(t.shape)} {t.dtype} tensor saved (under save_activations_in_float8) at version {saved} is now at "
        f"version {version_counter(t)}. Change it only after backward (an optimizer step or a weight update "
        "between forward and backward changes what backward reads)"
    )


@dataclass(eq=False)
class _Packed:
    """A saved tensor in FP8: data, scales, its quantizer, and what the restore needs.

    ``order``: the dims in memory order when the blocks follow memory order (a last dim
    shorter than the block), else None (blocks along the last dim). ``exact``: the saved
    tensor itself once :func:`keep_exact` decided it must not be rounded (data then empty).
    """

    data: torch.Tensor
    scale: torch.Tensor
    quantizer: BlockQuantizer
    shape: torch.Size
    stride: tuple[int, ...]
    order: tuple[int, ...] | None
    version: int
    # Weak: held only to read the version counter at unpack.
    refs: tuple[weakref.ReferenceType[torch.Tensor], ...]
    restored: R.Restored
    exact: torch.Tensor | None = None

    def build(self, unpack: Any = None) -> torch.Tensor:
        return self.exact if self.exact is not None else _restore(self)

    def keep_exact(self, t: torch.Tensor) -> None:
        self.exact = t
        self.data, self.scale = self.data.new_empty(0), self.scale.new_empty(0)


def _dense(t: torch.Tensor) -> bool:
    """Every element at its own address, nothing else between them."""
    if t.is_contiguous():
        return True
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda p: p[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _memory_order(t: torch.Tensor) -> tuple[int, ...]:
    """The dims of a dense ``t`` from the outermost in memory to the innermost."""
    return tuple(sorted(range(t.dim()), key=lambda d: -t.stride()[d]))


def _from_parameter(t: torch.Tensor) -> bool:
    """A parameter, a view of one, a leaf autograd accumulates into, or autocast's copy of one."""
    base = view_base(t)
    # A view is judged by its base: a view a Function makes in forward looks like a grad leaf.
    return _parameter_or_copy(t if base is None else base)


def _parameter_or_copy(t: torch.Tensor) -> bool:
    if isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad):
        return True
    fn = t.grad_fn
    if fn is not None and type(fn).__name__ == "ToCopyBackward0":
        return any(type(nxt).__name__ == "AccumulateGrad" for nxt, _ in fn.next_functions if nxt is not None)
    return False


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype in FLOAT8_DTYPES:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


class _Cache(dict[tuple[Any, ...], tuple["weakref.ReferenceType[torch.Tensor]", _Packed]]):
    """The per-storage cache (a dict subclass: a plain dict cannot be weakly referenced)."""


class _Hooks:
    """The pack/unpack pair of one entered context, and its per-storage cache."""

    def __init__(self, float8_dtype: torch.dtype, block: int, min_numel: int, recompute: bool = False) -> None:
        self.float8_dtype = float8_dtype
        self.block = block
        self.min_numel = max(min_numel, 1)
        self.recompute = recompute
        self.cache: _Cache = _Cache()
        # The last FP8 tensor subclass saved per layout: an equal one saved next is kept once.
        self.quantized: dict[tuple[Any, ...], tuple[weakref.ReferenceType[torch.Tensor], Any, _Kept]] = {}
        # Saved shapes minus the last dim: a tensor of such a shape is a per-row statistic, kept exact.
        self.rows: set[torch.Size] = set()
        self.kept_depth = 0

    def enter_kept(self, *_: Any) -> None:
        self.kept_depth += 1

    def leave_kept(self, *_: Any) -> None:
        self.kept_depth -= 1

    def _eligible(self, t: torch.Tensor) -> bool:
        return (
            t.dtype in COMPRESSED_DTYPES
            and t.dim() > 0
            and t.numel() >= self.min_numel
            and not t.is_inference()
            and _dense(t)
            and not _from_parameter(t)
        )

    def pack(self, t: torch.Tensor) -> Any:
        if torch.compiler.is_compiling():
            raise RuntimeError(EAGER_ONLY)
        return self._pack(t)

    # Run eagerly: dynamo would otherwise trace these frames, called from a hook it runs eagerly.
    @torch.compiler.disable
    def _pack(self, t: torch.Tensor) -> Any:
        if t.is_inference():
            return t  # no version counter
        if t.dim() > 1:
            self.rows.add(t.shape[:-1])
        if self.kept_depth:
            return _Kept(t)
        if type(t) is not torch.Tensor:
            return self._subclass(t)
        if t.grad_fn is not None and t.output_nr == 0 and _is_attention(t.grad_fn):
            stored = self._attention_output(t.grad_fn, t)
            if stored is not None:
                return stored
        # A per-row statistic of a saved tensor (a logsumexp; a norm's mean or rstd) stays exact.
        if not self._eligible(t) or t.shape in self.rows or (t.shape[-1] == 1 and t.shape[:-1] in self.rows):
            return _Kept(t)
        if self.recompute:
            recomputed = R.recomputed(t)
            if recomputed is not None:
                return recomputed
        packed = self._packed(t)
        if self.recompute:
            R.note(t, packed)
        return packed

    def _attention_output(self, node: Any, out: torch.Tensor) -> Any:
        """How a fused attention's output ``out`` is stored: kept (sharp attention, its q, k,
        v already packed made exact too), recomputed in backward from the saved q, k, v
        (causal or masked attention), or None (packed as any tensor). Its mask stays exact.

        Its backward recomputes the probabilities from q, k and the exact logsumexp, so an
        FP8 error in q or k moves a logit by up to ``eps * scale * |q_i| * |k_j|`` nats. And
        ``dP - rowsum(dO * O)`` cancels in a row that attends to few keys (causal and masked
        attention have such rows) only while the output is ``P @ v`` of the v backward reads.
        """
        kind = type(node)
        saved = {name: _peek(node, name) for name in _ATTENTION_SAVES if hasattr(kind, f"_saved_{name}")}
        mask = saved.get("attn_mask") or saved.get("attn_bias")
        _keep_exact(mask)
        if self._sharp(node, saved, mask):
            return _Kept(out)
        causal = bool(getattr(node, "_saved_is_causal", False))
        if mask is None and not causal:
            return None
        recipe = _attention_recipe(node, saved, mask, causal)
        if recipe is None:  # dropout, or an input no longer alive: v and the output exact
            _keep_exact(saved.get("value"))
            return _Kept(out)
        return R.Recomputed(recipe[0], recipe[1], "attention", out)

    def _sharp(self, node: Any, saved: dict[str, Any], mask: Any) -> bool:
        """Whether the logit error FP8 q and k can cause exceeds :data:`ATTENTION_LOGIT_ERROR`;
        if so, q, k and v already packed become exact."""
        q, k = saved["query"], saved["key"]
        if q is None or k is None:
            return False
        if q[1].is_meta or k[1].is_meta:
            return False  # no values to bound
        scale = getattr(node, "_saved_scale", None)
        scale = q[1].shape[-1] ** -0.5 if scale is None else scale
        with torch.no_grad():
            # |logit| <= scale * |q_i| * |k_j| + half the mask's spread (its masked values aside).
            logits = scale * _row_norm(q[1]) * _row_norm(k[1]) + (0.0 if mask is None else _spread(mask[1]) / 2)
        bound = torch.finfo(self.float8_dtype).eps * float(logits)
        if bound <= ATTENTION_LOGIT_ERROR:  # False for NaN: kept exact
            return False
        for name in ("query", "key", "value"):
            _keep_exact(saved.get(name))
        return True

    def _packed(self, t: torch.Tensor) -> _Packed:
        key = (
            t.device,
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            t.stride(),
            t.dtype,
            version_counter(t),
        )
        hit = self.cache.get(key)
        if hit is not None and hit[0]() is not None:
            hit[1].restored.pending += 1
            return hit[1]
        order = None
        hp = t.detach()
        if t.shape[-1] < self.block:
            # Blocks follow memory order: SDPA's q, k, v, (B, H, L, D) views of (B, L, H, D)
            # storage, get blocks across heads, one scale per ``block`` stored elements.
            order = _memory_order(t)
            hp = hp.permute(order).reshape(-1, _row_length([t.shape[d] for d in order], self.block))
        quantizer = activation_quantizer(self.float8_dtype, self.block, hp.dim(), t.dtype)
        with torch.no_grad():
            data, scale = quantizer.quantize(hp)
        base = view_base(t)
        refs = (weakref.ref(t),) if base is None else (weakref.ref(t), weakref.ref(base))
        packed = _Packed(data, scale, quantizer, t.shape, t.stride(), order, version_counter(t), refs, R.Restored())
        # The entry lives while the storage's owner (a view's base) does.
        owner = t if base is None else base
        self.cache[key] = (weakref.ref(owner, self._forget(key)), packed)
        return packed

    def _subclass(self, t: torch.Tensor) -> _Kept:
        """An FP8 tensor subclass (a linear's saved input) kept as is; kept once when the
        previous one of its layout holds the same bits (q, k and v casting one input)."""
        flatten = getattr(type(t), "__tensor_flatten__", None)
        if flatten is None or _from_parameter(t):
            return _Kept(t)
        names, meta = flatten(t)
        inner = [getattr(t, name) for name in names]
        key = (type(t), t.shape, t.stride(), t.dtype, tuple((x.shape, x.stride(), x.dtype) for x in inner))
        last = self.quantized.get(key)
        if last is not None:
            ref, last_meta, kept = last
            other = ref()
            if (
                other is not None
                and version_counter(other) == kept.version
                and last_meta == meta
                and all(_same_bits(a, getattr(other, name)) for a, name in zip(inner, names))
            ):
                return kept
        kept = _Kept(t)
        self.quantized[key] = (weakref.ref(t), meta, kept)
        return kept

    def _forget(self, key: tuple[Any, ...]) -> Any:
        """The callback dropping ``key``'s entry when its storage's owner dies."""
        cache = weakref.ref(self.cache)

        def forget(ref: weakref.ReferenceType[torch.Tensor]) -> None:
            entries = cache()
            if entries is not None and key in entries and entries[key][0] is ref:
                del entries[key]

        return forget

    def clear(self) -> None:
        self.cache.clear()
        self.quantized.clear()
        self.rows.clear()

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        peeked = getattr(_PEEK, "found", None)
        if peeked is not None:
            peeked.append(packed)
            return torch.empty(0)
        if type(packed) is _Kept:
            if version_counter(packed.tensor) != packed.version:
                raise _modified(packed.tensor, packed.version)
            return packed.tensor
        if not isinstance(packed, (_Packed, R.Recomputed)):
            return packed  # type: ignore[no-any-return]
        for ref in packed.refs:
            alive = ref()
            if alive is not None and version_counter(alive) != packed.version:
                raise _modified(alive, packed.version)
        restored = packed.restored
        hp = restored.tensor
        if hp is None:
            hp = packed.build(_Hooks.unpack)
        restored.pending -= 1
        restored.tensor = hp if restored.pending > 0 else None
        return hp


# A fused attention's node: its backward recomputes the softmax from these saves.
_ATTENTION_SAVES = ("query", "key", "value", "attn_mask", "attn_bias")
# Autograd node classes -> whether they are a fused attention's.
_ATTENTION_CLASSES: dict[type, bool] = {}
# The packed form of a saved tensor, read back through its node (see _peek).
_PEEK = threading.local()


def _is_attention(node: Any) -> bool:
    """A fused attention's node (SDPA's flash, efficient, cuDNN, CPU kernels, flash
    attention's own): it saves query, key and a logsumexp."""
    kind = type(node)
    found = _ATTENTION_CLASSES.get(kind)
    if found is None:
        # Read on the class: reading a saved tensor on the node unpacks it.
        names = [name for name in dir(kind) if name.startswith("_saved_")]
        found = _ATTENTION_CLASSES[kind] = (
            "_saved_query" in names
            and "_saved_key" in names
            and any(name.endswith(("logsumexp", "log_sumexp")) for name in names)
        )
    return found


def _peek(node: Any, name: str) -> tuple[Any, torch.Tensor] | None:
    """What ``node`` saved as ``name``: (its packed form, the live tensor), or None where
    nothing was saved or the tensor is no longer alive (a copy made inside the op)."""
    found: list[Any] = []
    _PEEK.found = found
    try:
        getattr(node, f"_saved_{name}")
    except RuntimeError:
        return None  # nothing saved (an optional tensor)
    finally:
        _PEEK.found = None
    if not found:
        return None
    packed = found[0]
    if type(packed) is _Kept:
        return packed, packed.tensor
    refs = getattr(packed, "refs", None)
    alive = None if refs is None else refs[0]()
    return None if alive is None else (packed, alive)


def _attention_recipe(node: Any, saved: dict[str, Any], mask: Any, causal: bool) -> tuple[Any, tuple[Any, ...]] | None:
    """(fn, packed inputs) recomputing a fused attention's output from its saved q, k, v
    (and mask), or None where it cannot (dropout, a missing input, a mask with is_causal)."""
    if getattr(node, "_saved_dropout_p", 0.0) or (mask is not None and causal):
        return None
    names = ("query", "key", "value")
    if any(saved.get(name) is None for name in names):
        return None
    q, k = saved["query"][1], saved["key"][1]
    options = {
        "is_causal": causal,
        "scale": getattr(node, "_saved_scale", None),
        "enable_gqa": q.shape[-3] != k.shape[-3],
    }
    inputs = tuple(saved[name][0] for name in names)
    if mask is not None:
        inputs += (mask[0],)
    return functools.partial(_attention, **options), inputs


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, **options: Any
) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **options)


def _keep_exact(saved: tuple[Any, torch.Tensor] | None) -> None:
    if saved is not None and isinstance(saved[0], (_Packed, R.Recomputed)):
        saved[0].keep_exact(saved[1])


def _row_norm(t: torch.Tensor) -> torch.Tensor:
    """The largest L2 norm along the last dim, in fp32."""
    return torch.linalg.vector_norm(t, dim=-1, dtype=torch.float32).amax()


def _spread(mask: torch.Tensor) -> torch.Tensor:
    """Max minus min of a float mask's values above its dtype's minimum (masked-out
    positions: -inf, or the dtype's minimum as Hugging Face writes them); 0 for a bool mask."""
    if not mask.is_floating_point():
        return torch.zeros(())
    for dim in range(mask.dim()):
        if mask.stride(dim) == 0:  # a broadcast dim: its values repeat
            mask = mask.narrow(dim, 0, 1)
    kept = mask > torch.finfo(mask.dtype).min
    if not bool(kept.any()):
        return torch.zeros(())
    high = torch.where(kept, mask, float("-inf")).amax().float()
    low = torch.where(kept, mask, float("inf")).amin().float()
    return high - low


def _row_length(sizes: list[int], block: int) -> int:
    """Elements per row of a memory-ordered tensor: its innermost dims merged until they
    hold ``block`` elements (or all of them)."""
    inner = 1
    for size in reversed(sizes):
        if inner >= block:
            break
        inner *= size
    return inner


def _restore(packed: _Packed) -> torch.Tensor:
    """The saved tensor back in its dtype and strides."""
    hp = packed.quantizer.dequantize(packed.data, packed.scale)
    if packed.order is not None:
        order = packed.order
        hp = hp.view([packed.shape[d] for d in order]).permute([order.index(d) for d in range(len(order))])
    return R.with_strides(hp, packed.stride)
