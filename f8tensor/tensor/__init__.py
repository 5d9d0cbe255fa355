"""The quantized tensor subclasses, their op tables and the weight wrappers.

Every name of :mod:`f8tensor.tensor.float8` is importable from here (checkpoints name it).
"""

from f8tensor.tensor import float8 as _float8
from f8tensor.tensor.float8 import Float8Tensor, _rebuild_float8_tensor, cast_to_float8, cast_to_float8_with_stats

__all__ = ["Float8Tensor", "_rebuild_float8_tensor", "cast_to_float8", "cast_to_float8_with_stats"]


def __getattr__(name: str) -> object:
    """Any other name of :mod:`f8tensor.tensor.float8` (``f8tensor.tensor.to_float8``, ...)."""
    return getattr(_float8, name)
