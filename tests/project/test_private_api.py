"""Private PyTorch APIs are reached from ``f8tensor/compat.py`` only.

Any other module of the package that names a private torch module or attribute (one whose
name starts with an underscore: ``torch._scaled_mm``, ``torch.utils._pytree``,
``torch._C``, ``Tensor._make_wrapper_subclass``, ``DTensor._local_tensor``, ...) fails this
test: route it through a named wrapper in ``compat.py``, which says what it is and since
which torch release it exists. Read from the syntax tree, so docstrings and comments may
name them. Op names (``torch.ops.aten._to_copy``) are names of aten ops, not private APIs.
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import dotted_name

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "f8tensor"
COMPAT = PACKAGE / "compat.py"

# Private attributes of torch objects, reached through a tensor, an op or a module object
# rather than a dotted torch name.
PRIVATE_ATTRIBUTES = frozenset(
    {
        "_C",
        "_base",
        "_dynamo",
        "_guards",
        "_inductor",
        "_local_tensor",
        "_make_wrapper_subclass",
        "_ops",
        "_qualified_op_name",
        "_schema",
        "_subclasses",
        "_version",
    }
)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _torch_aliases(tree: ast.Module) -> set[str]:
    """Names bound to torch or one of its modules (``torch``, ``nn``, ``F``, ``dist``, ...)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    names.add(alias.asname or "torch")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def private_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    roots = _torch_aliases(tree)
    found = []
    for node in ast.walk(tree):
        where = f"{path.name if ROOT not in path.parents else path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names if any(map(_private, a.name.split(".")))]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            if any(map(_private, node.module.split("."))) or any(_private(a.name) for a in node.names):
                found.append(f"{where}: from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Attribute):
            if node.attr in PRIVATE_ATTRIBUTES:
                found.append(f"{where}: .{node.attr}")
                continue
            parts = dotted_name(node)
            if parts and parts[0] in roots and parts[1:2] != ["ops"] and _private(parts[-1]):
                found.append(f"{where}: {'.'.join(parts)}")
    return found


def test_private_torch_apis_only_in_compat():
    found = [use for path in sorted(PACKAGE.rglob("*.py")) if path != COMPAT for use in private_uses(path)]
    assert found == [], "private torch APIs outside f8tensor/compat.py:\n" + "\n".join(found)


def test_the_check_catches_each_kind_of_use(tmp_path):
    """The test itself: each spelling of a private use is found, public ones are not."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch\n"
        "import torch.nn.functional as F\n"
        "from torch.utils._pytree import tree_map\n"
        "from torch import _dynamo\n"
        "x = torch._scaled_mm\n"
        "y = torch.Tensor._make_wrapper_subclass\n"
        "z = F._something\n"
        "w = some_tensor._base\n"
        "ok = torch.ops.aten._to_copy.default, torch.compiler.allow_in_graph, F.scaled_mm, torch.__version__\n"
    )
    found = private_uses(sample)
    assert len(found) == 6, found
    assert not any("aten" in f or "allow_in_graph" in f or "__version__" in f for f in found), found
