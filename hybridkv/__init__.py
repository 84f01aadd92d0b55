"""hybridkv: an LLM serving engine built around a hybrid paged KV cache."""

__version__ = "0.1.0"
