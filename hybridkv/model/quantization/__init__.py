"""Quantized linear weights: quantizing a bf16 checkpoint at load, reading quantized checkpoints (compressed-tensors,
AWQ) into one layout, and the linear layers that keep them quantized on a GPU (``kv/weight_formats.py`` says which
format a model's weights take)."""
