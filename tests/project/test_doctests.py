"""The examples in the public API's docstrings run (doctest), at CPU sizes.

Every ``>>>`` example in the modules that define the names of ``f8tensor.__all__`` (and
``f8tensor.gemm``'s public modules) is one test; a new example is picked up without
editing this file. Examples compare printed output exactly (``doctest`` with
``ELLIPSIS`` and ``NORMALIZE_WHITESPACE``), so keep them deterministic: seed, small,
printing shapes, dtypes or rounded numbers.
"""

from __future__ import annotations

import doctest
import importlib

import pytest
import torch

PUBLIC_MODULES = (
    "f8tensor",
    "f8tensor.nn.activations",
    "f8tensor.quant.config",
    "f8tensor.convert",
    "f8tensor.distributed.fsdp",
    "f8tensor.distributed.tp",
    "f8tensor.quant.formats",
    "f8tensor.tensor.fp4",
    "f8tensor.gemm.check",
    "f8tensor.gemm.dense",
    "f8tensor.gemm.front",
    "f8tensor.gemm.grouped",
    "f8tensor.nn.linear",
    "f8tensor.moe",
    "f8tensor.moe.autograd",
    "f8tensor.moe.planning",
    "f8tensor.moe.weight",
    "f8tensor.quant.policies",
    "f8tensor.quant.specs",
    "f8tensor.stats",
    "f8tensor.tensor",
    "f8tensor.tensor.float8",
    "f8tensor.nn.weight_cache",
    "f8tensor.nn.weight_precast",
)

_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _examples() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    found: dict[str, doctest.DocTest] = {}
    for name in PUBLIC_MODULES:
        module = importlib.import_module(name)
        for test in finder.find(module, name, globs={}):
            if not test.examples:
                continue
            # A name re-exported by several modules is found once, under its own module.
            found.setdefault(test.name.split(".")[-1] + f"@{test.filename}:{test.lineno}", test)
    return sorted(found.values(), key=lambda test: test.name)


EXAMPLES = _examples()


def test_public_api_has_examples():
    assert len(EXAMPLES) >= 8, [test.name for test in EXAMPLES]


@pytest.mark.parametrize("example", EXAMPLES, ids=[test.name for test in EXAMPLES])
def test_docstring_example(example: doctest.DocTest):
    torch.manual_seed(0)
    example.globs = {"torch": torch}
    runner = doctest.DocTestRunner(optionflags=_FLAGS)
    report: list[str] = []
    runner.run(example, out=report.append)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, "".join(report)
