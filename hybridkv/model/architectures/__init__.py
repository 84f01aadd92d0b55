"""Model architectures: configs read from HF config.json, decoders, tensor-parallel layers."""
