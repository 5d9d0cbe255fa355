"""The base of the quantized tensor subclasses: each class owns an op table.

``__torch_dispatch__`` runs an op's handler or refuses it by name (never silently in high
precision); no import and no allocation on that path.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import torch

from f8tensor.compat import DISABLED_TORCH_FUNCTION

__all__ = ["OpHandler", "QuantizedTensor"]

#: A handler: ``handler(func, types, args, kwargs)``, kwargs a read-only mapping.
OpHandler = Callable[[Any, Any, tuple, Mapping[str, Any]], Any]
_NO_KWARGS: types.MappingProxyType[str, Any] = types.MappingProxyType({})


class QuantizedTensor(torch.Tensor):
    """A tensor subclass whose ops are its own table's handlers.

    A subclass sets ``_OPS = {}`` and ``_UNSUPPORTED`` (the refusal, ``{func}`` for the op).
    """

    _OPS: ClassVar[dict[Any, OpHandler]]
    _UNSUPPORTED: ClassVar[str]

    __torch_function__ = DISABLED_TORCH_FUNCTION

    @classmethod
    def implements(cls, ops: Iterable[Any]) -> Callable[[OpHandler], OpHandler]:
        """Register a handler for aten ops; registering an op twice is an error."""

        def register(handler: OpHandler) -> OpHandler:
            for op in ops:
                if op in cls._OPS:
                    raise RuntimeError(f"{cls.__name__}: {op} already has a handler ({cls._OPS[op].__name__})")
                cls._OPS[op] = handler
            return handler

        return register

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        handler = cls._OPS.get(func)
        if handler is not None:
            return handler(func, types, args, kwargs if kwargs is not None else _NO_KWARGS)
        raise NotImplementedError(cls._UNSUPPORTED.format(func=func))
