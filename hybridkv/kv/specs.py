"""Attention-type specs: what one layer of each type keeps in the KV cache.

Three types, one vocabulary everywhere:

- ``full``: every token attends to every earlier token; all tokens are kept.
- ``sliding``: a token at position p attends to positions ``p - window + 1 .. p`` (the window counts
  the token itself, as in vLLM and transformers' Gemma/Mistral masks).
- ``chunked``: the sequence is cut into chunks of ``chunk`` tokens (Llama-4's ``attention_chunk_size``);
  a token attends only to earlier tokens of its own chunk.

"Processed" below means: tokens whose KV has been written. With ``n`` tokens processed, the next token
to compute is at position ``n``; everything it (and any later token) can see starts at
``first_needed_token(n)``. Blocks wholly below that position can go back to the pool.

Worked example (sliding, window 4, block 2)::

    n = 5  -> first needed token 2 -> block 0 (tokens 0, 1) can be freed
    n = 7  -> first needed token 4 -> blocks 0-1 can be freed
    n = 11 -> first needed token 8 -> blocks 0-3 can be freed

Chunked, chunk 4, block 2: n = 4 -> first needed 4 -> blocks 0-1; n = 12 -> blocks 0-5.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

# Bytes of one element of the KV cache per dtype name. "auto" is resolved against the model dtype by the caller.
KV_DTYPE_BYTES = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "fp8_e4m3": 1,
}
# FP8 KV carries one float32 scale for K and one for V per layer (per-tensor scaling), independent of length.
FP8_SCALE_BYTES_PER_LAYER = 2 * 4


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_blocks_spanned(num_tokens: int, block_size: int, aligned: bool) -> int:
    """Most blocks a run of ``num_tokens`` consecutive tokens can touch.

    A run that starts on a block boundary touches ``cdiv(num_tokens, block_size)`` blocks; one that may start
    anywhere touches at most one more (e.g. 4 tokens at positions 3..6 with block 4 touch blocks 0 and 1).
    """
    if num_tokens <= 0:
        return 0
    if aligned:
        return cdiv(num_tokens, block_size)
    return cdiv(num_tokens + block_size - 1, block_size)


@dataclass(frozen=True, slots=True)
class AttentionSpec(ABC):
    """KV layout of one attention layer: heads on this tensor-parallel rank, head size and cache dtype."""

    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"

    kind: ClassVar[str] = "abstract"

    def __post_init__(self) -> None:
        if self.dtype not in KV_DTYPE_BYTES:
            raise ValueError(f"unknown KV cache dtype {self.dtype!r}; choose one of {sorted(KV_DTYPE_BYTES)}")
        if self.num_kv_heads < 1 or self.head_dim < 1:
            raise ValueError(f"num_kv_heads and head_dim must be >= 1, got {self.num_kv_heads}, {self.head_dim}")

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token costs in one layer: K and V for every KV head on this rank."""
        return 2 * self.num_kv_heads * self.head_dim * KV_DTYPE_BYTES[self.dtype]

    @property
    def fixed_bytes_per_layer(self) -> int:
        """Bytes a layer needs whatever the length (FP8 scales)."""
        return FP8_SCALE_BYTES_PER_LAYER if self.dtype.startswith("fp8") else 0

    @abstractmethod
    def first_needed_token(self, num_processed: int) -> int:
        """Lowest position any future token can attend to once ``num_processed`` tokens are processed."""

    def tokens_kept(self, num_processed: int) -> int:
        """Tokens that must stay cached for a sequence of ``num_processed`` processed tokens."""
        return num_processed - self.first_needed_token(num_processed)

    @abstractmethod
    def max_live_blocks(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        """Most blocks one request of ``num_tokens`` tokens holds at once in one layer group.

        ``max_step_tokens`` is the most tokens computed in one step (the prefill chunk): their slots are
        allocated before they are processed, so they are live together with the tokens they attend to.
        """

    @property
    def label(self) -> str:
        return self.kind


@dataclass(frozen=True, slots=True)
class FullAttentionSpec(AttentionSpec):
    kind: ClassVar[str] = "full"

    def first_needed_token(self, num_processed: int) -> int:
        return 0

    def max_live_blocks(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        return cdiv(num_tokens, block_size)


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec(AttentionSpec):
    window: int = 4096

    kind: ClassVar[str] = "sliding"

    def __post_init__(self) -> None:
        AttentionSpec.__post_init__(self)
        if self.window < 1:
            raise ValueError(f"sliding window must be >= 1, got {self.window}")

    def first_needed_token(self, num_processed: int) -> int:
        return max(0, num_processed - self.window + 1)

    def max_live_blocks(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        # A step of k new tokens sees the window - 1 tokens before it plus itself; the run need not be aligned.
        span = self.window - 1 + max(1, max_step_tokens)
        return min(cdiv(num_tokens, block_size), max_blocks_spanned(span, block_size, aligned=False))

    @property
    def label(self) -> str:
        return f"sliding({self.window})"


@dataclass(frozen=True, slots=True)
class ChunkedLocalSpec(AttentionSpec):
    chunk: int = 8192

    kind: ClassVar[str] = "chunked"

    def __post_init__(self) -> None:
        AttentionSpec.__post_init__(self)
        if self.chunk < 1:
            raise ValueError(f"attention chunk must be >= 1, got {self.chunk}")

    def first_needed_token(self, num_processed: int) -> int:
        return (num_processed // self.chunk) * self.chunk

    def max_live_blocks(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        # Worst case: the step starts at the last token of a chunk, so the whole chunk but one is still live.
        span = self.chunk - 1 + max(1, max_step_tokens)
        aligned = self.chunk % block_size == 0
        return min(cdiv(num_tokens, block_size), max_blocks_spanned(span, block_size, aligned=aligned))

    @property
    def label(self) -> str:
        return f"chunked({self.chunk})"


ATTENTION_KINDS = ("full", "sliding", "chunked")
