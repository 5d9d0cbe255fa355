"""Distributed training with FP8: FSDP2 all-gather (``fsdp``), TP styles (``tp``, ``dtensor``).

Imports nothing itself, so each submodule keeps its place in the layers.
"""
