"""Optional integrations: ``torchtitan``, ``lightning``, ``hf``.

Each submodule imports its framework when imported itself; this package needs torch alone.
"""
