"""A checkpoint's FP8 weight held as it is in the file: never trainable, multiplied as stored.

:class:`FrozenFloat8Linear` is a :class:`~f8tensor.Float8Linear` whose ``weight`` Parameter is
a :class:`FrozenFloat8Weight` (the file's FP8 bytes and the reciprocal of its multiplier).
Where the layer's recipe casts the weight with the checkpoint's granularity, the forward
multiplies those bytes; otherwise it re-casts them per call (transient). Inputs get their
gradients; the weight none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from f8tensor.nn.linear import Float8Linear, WeightFromMethod, fresh_layer_buffer
from f8tensor.quant.config import CastConfig, Float8LinearConfig
from f8tensor.quant.specs import BlockGranularity, Granularity
from f8tensor.tensor.float8 import Float8Tensor, dequantize

__all__ = ["FrozenFloat8Linear", "FrozenFloat8Weight", "granularity_of_block", "recipe_reads"]

_FROZEN = (
    "this FP8 weight was loaded with load_fp8_pretrained(..., frozen=True) and is held as the checkpoint's "
    "FP8 bytes, which cannot train; train adapters on top (e.g. PEFT LoRA), or load with frozen=False for "
    "trainable high-precision weights"
)


class FrozenFloat8Weight(Float8Tensor):
    """A Float8Tensor that refuses to require gradients (see :data:`_FROZEN`)."""

    def requires_grad_(self, requires_grad: bool = True) -> FrozenFloat8Weight:  # type: ignore[override]
        if requires_grad:
            raise RuntimeError(f"requires_grad_(True): {_FROZEN}")
        return self

    @property  # type: ignore[override]
    def requires_grad(self) -> bool:
        return False

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        if value:
            raise RuntimeError(f"requires_grad = True: {_FROZEN}")

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: tuple, outer_size: Any, outer_stride: Any) -> FrozenFloat8Weight:
        # Traced (torch.compile), the rebuilt weight keeps this type.
        return FrozenFloat8Weight(inner["_data"], inner["_scale"], *meta)

    def detach(self) -> FrozenFloat8Weight:  # type: ignore[override]
        # nn.Parameter(x) wraps x.detach(), which must keep the type.
        return frozen_weight(self)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        copied = super().__deepcopy__(memo)
        new = frozen_weight(copied)  # type: ignore[arg-type]
        out = nn.Parameter(new, requires_grad=False) if copied.__dict__.get("_is_param", False) else new
        memo[id(self)] = out
        return out


def frozen_weight(f8: Float8Tensor) -> FrozenFloat8Weight:
    """``f8``'s fields (shared, not copied) as a :class:`FrozenFloat8Weight`."""
    return FrozenFloat8Weight(f8._data, f8._scale, f8._orig_dtype, f8._block, f8._gemm)


def granularity_of_block(block: tuple[int, ...], scale_dtype: torch.dtype) -> Granularity | BlockGranularity:
    """The weight granularity of a 2D Float8Tensor block."""
    if block == (0, 0):
        return Granularity.TENSORWISE
    if block == (1, 0):
        return Granularity.ROWWISE
    return BlockGranularity(block, scale_dtype)


def recipe_reads(w8: Float8Tensor, cast: CastConfig) -> bool:
    """Whether a weight cast per ``cast`` gives a 2D Float8Tensor ``w8``'s layout: then the product multiplies
    ``w8``'s bytes, not a re-cast."""
    return cast.dtype == w8._data.dtype and cast.granularity == granularity_of_block(w8._block, w8._scale.dtype)


class FrozenFloat8Linear(WeightFromMethod, Float8Linear):
    """A Float8Linear over a checkpoint's FP8 weight, held as FP8 and never trained.

    Fields beyond Float8Linear's: ``weight``, a :class:`FrozenFloat8Weight` Parameter;
    ``checkpoint_scale``, a non-persistent buffer with the file's multiplier (written back
    by ``save_fp8_pretrained`` while the layer holds the file's bytes).
    """

    checkpoint_scale: torch.Tensor

    @classmethod
    def from_fp8(
        cls,
        linear: nn.Linear,
        weight: Float8Tensor,
        multiplier: torch.Tensor,
        config: Float8LinearConfig,
    ) -> FrozenFloat8Linear:
        """A frozen layer with ``linear``'s bias and the FP8 ``weight`` (``multiplier``: the file's)."""
        new = cast(FrozenFloat8Linear, cls.from_float(linear, config))
        new.weight = nn.Parameter(frozen_weight(weight), requires_grad=False)
        # Built on meta: fresh state on the weight's device.
        for name, buf in list(new._buffers.items()):
            if buf is not None and buf.device != weight.device:
                new._buffers[name] = fresh_layer_buffer(name, buf, weight.device)
        new.register_buffer("checkpoint_scale", multiplier, persistent=False)
        return new

    def check_new_config(self, config: Float8LinearConfig) -> None:
        super().check_new_config(config)
        if config.uses_gemm_formats or config.weight.delayed:
            raise ValueError(
                "FrozenFloat8Linear.config: a frozen FP8 weight is cast dynamically in FP8, one format for every "
                "GEMM (no delayed weight scaling, no per-GEMM formats or FP4); load with frozen=False to train "
                "with such a recipe"
            )

    @property
    def multiplies_file_bytes(self) -> bool:
        """Whether the recipe casts the weight as the checkpoint stores it (no re-cast per call)."""
        w = self.weight
        return isinstance(w, Float8Tensor) and recipe_reads(w, self.config.weight)

    def weight_matrix(self) -> torch.Tensor:
        """The file's FP8 weight, or (another granularity) its transient dequantization."""
        w = self.weight
        if not self.multiplies_file_bytes:
            assert isinstance(w, Float8Tensor)  # the layer holds its FP8 weight
            w = dequantize(w, torch.float32).to(w.dtype)  # transient: the recipe casts it per call
        return w

    def reset_parameters(self) -> None:
        """Nothing to reset: the weight is the checkpoint's (a meta-built layer gets it assigned)."""
        if isinstance(self.__dict__.get("_parameters", {}).get("weight"), FrozenFloat8Weight):
            return
        super().reset_parameters()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> FrozenFloat8Linear:  # type: ignore[override]
        scale = self._buffers.get("checkpoint_scale")
        super()._apply(fn, recurse)
        moved = self._buffers.get("checkpoint_scale")
        if scale is not None and moved is not None and moved.dtype != scale.dtype:
            # The file's multiplier, written back as stored: model.to(dtype) moves it, never rounds it.
            self._buffers["checkpoint_scale"] = scale.to(device=moved.device)
        self._keep_frozen()
        return self

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._keep_frozen()  # unpickled, the weight is rebuilt as a plain Float8Tensor

    def _keep_frozen(self) -> None:
        """Re-wrap a weight that lost its frozen type (``_apply``, unpickling)."""
        w = self._parameters.get("weight")
        if isinstance(w, Float8Tensor) and not isinstance(w, FrozenFloat8Weight):
            self._parameters["weight"] = nn.Parameter(frozen_weight(w), requires_grad=False)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, frozen_fp8_weight"
