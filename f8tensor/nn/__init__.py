"""The FP8 modules: the linear layer and its autograd Function, attention, saved activations."""
