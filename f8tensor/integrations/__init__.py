"""Optional integrations with training frameworks. Each submodule imports its framework
when it is imported itself; importing ``f8tensor`` (or this package) needs torch alone.

- ``f8tensor.integrations.torchtitan``: a torchtitan model converter (and config override).
- ``f8tensor.integrations.lightning``: a Lightning ``Precision`` plugin.
- ``f8tensor.integrations.hf``: Hugging Face helpers (``from_pretrained`` with the FP8
  scaling state, the accelerate / Trainer recipe).
"""
