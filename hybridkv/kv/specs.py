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

A spec owns everything that differs between types, so a new type is a spec class here (plus, if its blocks need
another bookkeeping, a manager in ``managers.py``, and its mask in the kernel):

- bytes per token (``bytes_per_token``, ``fixed_bytes_per_layer``),
- which keys a query sees: ``first_needed_token(p)``, the lowest key the token at position p sees (vectorised),
  and ``visible(q, k)``, the mask built from it that the dense oracle and the torch backend apply,
- its peak (``max_live_blocks``), which admission and the planner sum over groups (``capacity.py``),
- the kernel's ``kernel_kind`` and ``reach``, and how a Hugging Face config sets it up (``from_hf_config``).

Visibility of a sliding window of 3 (queries down, keys across), ``spec.visible(np.arange(5), np.arange(5))``::

    q0  1 . . . .        first_needed_token(np.arange(5)) = [0, 0, 0, 1, 2]
    q1  1 1 . . .
    q2  1 1 1 . .
    q3  . 1 1 1 .
    q4  . . 1 1 1
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar

from hybridkv.kv.dtypes import DTYPE_BYTES, KV_CACHE_DTYPES

# The paged attention kernel's KIND argument: its masks (hybridkv/kernels/paged_attention.py) branch on these.
KERNEL_FULL, KERNEL_SLIDING, KERNEL_CHUNKED = 0, 1, 2
# FP8 KV carries one float32 scale for K and one for V per layer (per-tensor scaling), independent of length.
FP8_SCALE_BYTES_PER_LAYER = 2 * 4

Positions = TypeVar("Positions")  # an int, a numpy array or a torch tensor of token positions


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
    kernel_kind: ClassVar[int]
    hf_layer_type: ClassVar[str]  # its name in an HF config's ``layer_types``

    def __post_init__(self) -> None:
        if self.dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown KV cache dtype {self.dtype!r}; choose one of {sorted(KV_CACHE_DTYPES)}")
        if self.num_kv_heads < 1 or self.head_dim < 1:
            raise ValueError(f"num_kv_heads and head_dim must be >= 1, got {self.num_kv_heads}, {self.head_dim}")

    @classmethod
    @abstractmethod
    def from_hf_config(cls, num_kv_heads: int, head_dim: int, dtype: str, text_config: dict[str, Any]):
        """This type's spec for a layer of a Hugging Face text config (window, chunk read from it)."""

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token costs in one layer: K and V for every KV head on this rank."""
        return 2 * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def fixed_bytes_per_layer(self) -> int:
        """Bytes a layer needs whatever the length (FP8 scales)."""
        return FP8_SCALE_BYTES_PER_LAYER if self.dtype.startswith("fp8") else 0

    @property
    @abstractmethod
    def reach(self) -> int:
        """Most keys one query sees, itself included; 0: no bound (every earlier token). The kernel's REACH."""

    @property
    def keeps_every_token(self) -> bool:
        """Whether the layer needs every token for good (KV memory bounds the length only through such layers)."""
        return self.reach == 0

    @abstractmethod
    def first_needed_token(self, pos: Positions) -> Positions:
        """Lowest key position the token at ``pos`` sees: an int, or elementwise over a numpy array or torch tensor.

        With ``n`` tokens processed the next token is at position ``n`` and no later one sees further back, so
        ``first_needed_token(n)`` is also the lowest position still needed: the managers free what lies below.
        """

    def needed_until(self, token: int) -> int:
        """Fewest processed tokens ``n`` with ``first_needed_token(n) > token``: until then ``token`` is still needed.
        A type without its own answer gives ``token + 1``, a lower bound (a token sees itself), which only makes the
        managers look again sooner."""
        return token + 1

    def visible(self, q_pos: Positions, k_pos: Positions) -> Positions:
        """[Q, K] bool mask: query i sees key j. ``q_pos`` and ``k_pos`` are 1-D numpy arrays or torch tensors.

        Causal, intersected with the type's reach: ``first_needed_token(q) <= k <= q``.
        """
        q, k = q_pos[:, None], k_pos[None, :]
        return (k <= q) & (k >= self.first_needed_token(q))

    def tokens_kept(self, num_processed: int) -> int:
        """Tokens that must stay cached for a sequence of ``num_processed`` processed tokens."""
        return num_processed - self.first_needed_token(num_processed)

    @abstractmethod
    def max_live_blocks(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        """The peak: most blocks one request of ``num_tokens`` tokens holds at once in one layer group.

        ``max_step_tokens`` is the most tokens computed in one step (the prefill chunk): their slots are
        allocated before they are processed, so they are live together with the tokens they attend to.
        """

    @property
    def label(self) -> str:
        return self.kind


@dataclass(frozen=True, slots=True)
class FullAttentionSpec(AttentionSpec):
    kind: ClassVar[str] = "full"
    hf_layer_type: ClassVar[str] = "full_attention"
    kernel_kind: ClassVar[int] = KERNEL_FULL

    @classmethod
    def from_hf_config(cls, num_kv_heads: int, head_dim: int, dtype: str, text_config: dict[str, Any]):
        return cls(num_kv_heads, head_dim, dtype)

    @property
    def reach(self) -> int:
        return 0

    def first_needed_token(self, pos: Positions) -> Positions:
        return pos * 0

    def max_live_blocks(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        return cdiv(num_tokens, block_size)


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec(AttentionSpec):
    window: int = 4096

    kind: ClassVar[str] = "sliding"
    hf_layer_type: ClassVar[str] = "sliding_attention"
    kernel_kind: ClassVar[int] = KERNEL_SLIDING

    def __post_init__(self) -> None:
        AttentionSpec.__post_init__(self)
        if self.window < 1:
            raise ValueError(f"sliding window must be >= 1, got {self.window}")

    @classmethod
    def from_hf_config(cls, num_kv_heads: int, head_dim: int, dtype: str, text_config: dict[str, Any]):
        return cls(num_kv_heads, head_dim, dtype, window=int(text_config["sliding_window"]))

    @property
    def reach(self) -> int:
        return self.window

    def first_needed_token(self, pos: Positions) -> Positions:
        lo = pos - (self.window - 1)
        return (lo + abs(lo)) // 2  # max(lo, 0), on ints and arrays alike

    def needed_until(self, token: int) -> int:
        return token + self.window

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
    hf_layer_type: ClassVar[str] = "chunked_attention"
    kernel_kind: ClassVar[int] = KERNEL_CHUNKED

    def __post_init__(self) -> None:
        AttentionSpec.__post_init__(self)
        if self.chunk < 1:
            raise ValueError(f"attention chunk must be >= 1, got {self.chunk}")

    @classmethod
    def from_hf_config(cls, num_kv_heads: int, head_dim: int, dtype: str, text_config: dict[str, Any]):
        return cls(num_kv_heads, head_dim, dtype, chunk=int(text_config["attention_chunk_size"]))

    @property
    def reach(self) -> int:
        return self.chunk

    def first_needed_token(self, pos: Positions) -> Positions:
        return pos // self.chunk * self.chunk

    def needed_until(self, token: int) -> int:
        return (token // self.chunk + 1) * self.chunk

    def max_live_blocks(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        # Worst case: the step starts at the last token of a chunk, so the whole chunk but one is still live.
        span = self.chunk - 1 + max(1, max_step_tokens)
        aligned = self.chunk % block_size == 0
        return min(cdiv(num_tokens, block_size), max_blocks_spanned(span, block_size, aligned=aligned))

    @property
    def label(self) -> str:
        return f"chunked({self.chunk})"


# Every attention type by its name, in the order reports list them.
SPEC_TYPES: MappingProxyType[str, type[AttentionSpec]] = MappingProxyType(
    {cls.kind: cls for cls in (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalSpec)}
)
ATTENTION_KINDS = tuple(SPEC_TYPES)
