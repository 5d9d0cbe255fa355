"""f8tensor in Lightning: the ``Float8Precision`` plugin.

``convert_module`` converts the LightningModule; ``forward_context`` runs each step under
bf16 (or ``autocast_dtype``) autocast around the FP8 products. Works with ``lightning`` or
the standalone ``pytorch_lightning`` (one of them per process).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any

import torch
from torch import nn

from f8tensor.convert import convert_to_float8_training
from f8tensor.nn.linear import Float8Conv1D, Float8Linear
from f8tensor.quant.config import Float8LinearConfig

try:
    from lightning.pytorch.plugins.precision import Precision
except ImportError:  # the standalone package
    try:
        from pytorch_lightning.plugins.precision import Precision  # type: ignore[assignment]  # same class, other package
    except ImportError as exc:  # neither: say what is absent and how to install it
        raise ModuleNotFoundError(
            "f8tensor.integrations.lightning needs Lightning, which is not installed: "
            "pip install lightning (or pip install 'f8tensor[integrations]')",
            name="lightning",
        ) from exc

__all__ = ["Float8Precision"]

_FP8_STATE = "f8tensor_fp8_state"  # the checkpoint key of the FP8 layers' own state
_RNG_STATE = "f8tensor_rng_state"  # torch's global CPU generator, for stochastic rounding


def _fp8_state_keys(module: nn.Module) -> list[str]:
    """The state_dict keys only FP8 layers have (:meth:`Float8Linear.float8_state`)."""
    keys: list[str] = []
    for fqn, mod in module.named_modules():
        if isinstance(mod, (Float8Linear, Float8Conv1D)):
            prefix = f"{fqn}." if fqn else ""
            keys.extend(prefix + name for name in mod.float8_state())
    return keys


_AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)


class Float8Precision(Precision):
    """FP8 linear layers (f8tensor) with the rest of the model under autocast.

    Args:
        config: the :class:`Float8LinearConfig` (default: tensorwise).
        module_filter_fn: as for :func:`f8tensor.convert_to_float8_training`.
        autocast_dtype: bf16 (default), fp16 (no gradient scaler runs) or ``None``.
        device: the autocast device type.

    Raises:
        TypeError: ``config`` is not a :class:`~f8tensor.Float8LinearConfig`.
        ValueError: ``autocast_dtype`` is not bf16, fp16 or None.
        RuntimeError: at resume, the checkpoint's FP8 state does not match the model.
    """

    def __init__(
        self,
        config: Float8LinearConfig | None = None,
        *,
        module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
        autocast_dtype: torch.dtype | None = torch.bfloat16,
        device: str = "cuda",
    ) -> None:
        if config is not None and not isinstance(config, Float8LinearConfig):
            raise TypeError(f"config must be a Float8LinearConfig; got {type(config).__name__}")
        if autocast_dtype is not None and autocast_dtype not in _AUTOCAST_DTYPES:
            raise ValueError(f"autocast_dtype must be torch.bfloat16, torch.float16 or None; got {autocast_dtype}")
        self.config = config if config is not None else Float8LinearConfig()
        self.module_filter_fn = module_filter_fn
        self.autocast_dtype = autocast_dtype
        self.device = device
        self._module: nn.Module | None = None  # the model convert_module converted
        # What Lightning logs: the precision of everything around the FP8 GEMMs.
        self.precision = {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed", None: "32-true"}[autocast_dtype]  # type: ignore[assignment]  # Lightning's literals

    def convert_module(self, module: nn.Module) -> nn.Module:
        # Called in every setup: the same config again changes nothing.
        self._module = convert_to_float8_training(module, config=self.config, module_filter_fn=self.module_filter_fn)
        return self._module

    # Lightning loads state_dict before convert_module, into the unconverted model: the FP8 state
    # travels under the plugin's key and is loaded once the model is converted.

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("state_dict")
        if state is None or self._module is None:
            return
        checkpoint[_FP8_STATE] = {key: state.pop(key) for key in _fp8_state_keys(self._module) if key in state}
        if self._stochastic():
            # Stochastic rounding draws from the global generator: save it to resume exactly.
            checkpoint[_RNG_STATE] = torch.get_rng_state()

    def _stochastic(self) -> bool:
        casts = [self.config.input, self.config.weight, self.config.grad_output]
        casts += [o.cast for o in self.config.gemm_overrides if o.cast is not None]
        return any(c.rounding == "stochastic" for c in casts)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        rng = checkpoint.get(_RNG_STATE)
        if rng is not None:
            torch.set_rng_state(rng)
        saved = checkpoint.get(_FP8_STATE)
        if not saved or self._module is None:
            return
        missing = [key for key in _fp8_state_keys(self._module) if key not in saved]
        unexpected = sorted(set(saved) - set(_fp8_state_keys(self._module)))
        if missing or unexpected:
            raise RuntimeError(
                f"Float8Precision: the checkpoint's FP8 state does not match the converted model (missing "
                f"{missing[:4]}, unexpected {unexpected[:4]}): resume with the recipe and module_filter_fn it was saved with"
            )
        self._module.load_state_dict(saved, strict=False)

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.autocast_dtype is None:
            yield
            return
        with torch.autocast(self.device, dtype=self.autocast_dtype):
            yield
