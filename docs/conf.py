"""Sphinx configuration of f8tensor's API reference.

Build (offline, warnings are errors):  sphinx-build -W -b html docs docs/_build/html
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent / "_ext"))

import f8tensor

project = "f8tensor"
author = "f8tensor contributors"
copyright = "f8tensor contributors"
release = version = f8tensor.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "f8tensor_recipes",
]

# Docstrings are Google style ("Args:", "Returns:", "Raises:", "Example:") or prose.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_class_signature = "separated"
autodoc_default_options = {"exclude-members": "__init__, __new__"}
add_module_names = False


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


# The optional integrations document their own frameworks' classes: where a framework is
# not installed (or does not import), its modules are stood in for so the reference still
# builds offline.
autodoc_mock_imports = [
    name
    for name in ("transformers", "accelerate", "lightning", "pytorch_lightning", "torchtitan")
    if not _importable(name)
]

html_theme = "alabaster"
html_static_path: list[str] = []
html_theme_options = {"description": "FP8 training in plain PyTorch", "fixed_sidebar": True}
html_show_sourcelink = False

exclude_patterns = ["_build"]
