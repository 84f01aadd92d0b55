from hybridkv.model.attention.base import AttentionBackend

__all__ = ["AttentionBackend"]
