"""FP8 quantization: formats, the block vocabulary, configs, recipes, scaling and quantizers."""
