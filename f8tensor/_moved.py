"""Old module paths (before the package was cut by concern) import the modules that moved.

``import f8tensor.linear`` or a pickle naming ``f8tensor.config.CastConfig`` get the module
now at ``f8tensor.nn.linear`` / ``f8tensor.quant.config``: the same module object, so
classes compare equal and ``isinstance`` holds.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

#: old module -> new module (both under ``f8tensor.``).
MOVED = {
    "formats": "quant.formats",
    "specs": "quant.specs",
    "config": "quant.config",
    "recipes": "quant.recipes",
    "scaling": "quant.scaling",
    "hadamard": "quant.hadamard",
    "quantizers": "quant.quantizers",
    "block_quantizers": "quant.block_quantizers",
    "policies": "quant.policies",
    "layouts": "kernels.layouts",
    "fp4": "tensor.fp4",
    "subclass": "tensor.subclass",
    "validation": "tensor.validation",
    "ops": "tensor.ops",
    "product_ops": "tensor.product_ops",
    "weights": "tensor.weights",
    "linear": "nn.linear",
    "linear_autograd": "nn.linear_autograd",
    "attention": "nn.attention",
    "activations": "nn.activations",
    "weight_cache": "nn.weight_cache",
    "optim_math": "optim.step_math",
    "optim_draws": "optim.draws",
    "optim_master": "optim.master",
    "optim_shards": "optim.shards",
    "demo_gpt": "demo.gpt",
    "demo_report": "demo.report",
}


class _OldPathFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        old = fullname.removeprefix("f8tensor.")
        if fullname.startswith("f8tensor.") and old in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return importlib.import_module("f8tensor." + MOVED[spec.name.removeprefix("f8tensor.")])

    def exec_module(self, module):
        pass  # the new module is already executed


def install_old_paths() -> None:
    """Let the old module paths import the moved modules (once per process)."""
    if not any(isinstance(f, _OldPathFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _OldPathFinder())
