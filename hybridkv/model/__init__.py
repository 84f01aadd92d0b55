"""Models (Llama, Llama-4 text, Gemma-3), their weight loaders and the attention backends."""
