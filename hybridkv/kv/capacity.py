"""Capacity math, one home: a request's peak, the longest request that fits, and the memory a step keeps out of
the KV cache. Admission (``KVCacheManager``), the engine's sizing and ``hybridkv plan`` all call these.

Llama-4 Scout, TP 8, block 16, 8,192-token steps (1 full + 3 chunked groups)::

    peak_blocks(layout, 131_072, 8192)     -> 8,192 + 3 x 1,024 = 11,264
    longest_fitting(layout, 11_264, 8192, 10**7) -> 131,072

Pure Python: nothing here imports torch.
"""

from __future__ import annotations

from hybridkv.kv.layout import KVLayout

GIB = 1 << 30
_STEP_SLACK_BYTES = GIB  # allocator fragmentation, cuBLAS workspaces, temporaries the counts below miss
_HIDDEN_BUFFERS = 16  # float32 hidden-size buffers per batched token (residual, norms, q/k/v/o, MLP, ...)
_SAMPLER_COPIES = 3  # float32 logits per sequence: the logits, their softmax, the sampler's sorted copy
# The CPU's default KV budget (``cpu_default_kv_bytes``): this many requests of max_model_len tokens at once, within
# a floor (a model with a short context still batches a few) and a cap (a long one's max_model_len is clamped instead)
CPU_DEFAULT_REQUESTS = 2
CPU_KV_FLOOR_BYTES = 64 << 20
CPU_KV_CAP_BYTES = 2 * GIB


def peak_blocks(layout: KVLayout, num_tokens: int, max_step_tokens: int) -> int:
    """Most blocks one request of ``num_tokens`` tokens holds at once, all groups together (each spec's own
    ``max_live_blocks``, summed over the layout's groups)."""
    bs = layout.block_size
    return sum(g.spec.max_live_blocks(num_tokens, bs, max_step_tokens) for g in layout.groups)


def pool_tokens(layout: KVLayout, usable_blocks: int) -> int:
    """Tokens each layer group holds when every group gets the same share of the pool (full-attention groups: tokens
    of context across all requests; sliding/chunked groups: of their windows)."""
    return usable_blocks // len(layout.groups) * layout.block_size


def longest_fitting(layout: KVLayout, usable_blocks: int, max_step_tokens: int, upper: int) -> int:
    """Longest request (<= ``upper``) whose peak fits ``usable_blocks``: binary search, the peak is monotone."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if peak_blocks(layout, mid, max_step_tokens) <= usable_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo


def cpu_default_kv_bytes(layout: KVLayout, max_model_len: int, max_step_tokens: int) -> int:
    """The CPU's KV budget when none is given: the null block and ``CPU_DEFAULT_REQUESTS`` requests' peaks at
    ``max_model_len``, within ``CPU_KV_FLOOR_BYTES`` .. ``CPU_KV_CAP_BYTES``. A page stays off the RSS until a
    request first writes it, but a long-running server writes every page in turn, so the budget is what it ends up
    holding.

    E.g. SmolLM2-135M (float32 cache, 30 layers x 2 x 3 KV heads x 64 x 4 B, block 16: 737,280 B a page), 8,192
    tokens, 512-token steps: (2 x 512 + 1) pages = 755,712,000 B (720.7 MiB)."""
    pages = CPU_DEFAULT_REQUESTS * peak_blocks(layout, max_model_len, max_step_tokens) + 1
    return min(max(layout.fixed_bytes + pages * layout.page_bytes, CPU_KV_FLOOR_BYTES), CPU_KV_CAP_BYTES)


def step_reserve_bytes(
    max_num_batched_tokens: int, max_num_seqs: int, hidden_size: int, vocab_size: int, segment_bytes: int = 0,
    collective_bytes: int = 0,
) -> int:
    """GPU memory kept out of the KV cache for one step's working set, per rank.

    ``segment_bytes``: the attention backend's scratch for widening an FP8 cache in segments (0 when it has
    none); 1.5x of it is kept, as the segment's FP8 gather lives beside its bf16 copy for a moment.
    ``collective_bytes``: the scratch the tensor-parallel collectives declare (``CopyEngineSums.scratch_bytes``:
    the prefill halves' copy-engine slots), kept whole.

    E.g. 8,192 batched tokens of width 2,048 and 256 sequences over a 49,152-token vocabulary: 1 GiB of slack,
    1 GiB of activations and 144 MiB of logits; 512 MiB FP8 segments add 768 MiB; TP 2's 64 MiB of slots add 64 MiB.
    """
    reserve = _STEP_SLACK_BYTES
    reserve += max_num_batched_tokens * hidden_size * 4 * _HIDDEN_BUFFERS
    reserve += max_num_seqs * vocab_size * 4 * _SAMPLER_COPIES
    reserve += segment_bytes * 3 // 2
    reserve += collective_bytes
    return reserve
