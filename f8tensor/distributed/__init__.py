"""Distributed training with FP8: ``fsdp`` (FSDP2 FP8 all-gather; a parameter type a layer
chooses, below the modules). Tensor and sequence parallel styles, which sit above the
modules, join as siblings.

This package imports nothing itself, so that each submodule's place in the layers holds
(``f8tensor.distributed.fsdp`` is imported by ``linear``; a TP module imports ``linear``).
"""
