"""The paged torch backend against attention computed the slow, obvious way over whole sequences."""

import math

import pytest
import torch

from hybridkv.kv import CacheRequest, KVCacheManager, plan_layout
from hybridkv.kv.specs import ChunkedLocalSpec, FullAttentionSpec, SlidingWindowSpec
from hybridkv.model.attention.base import StepSequence
from hybridkv.model.attention import torch_paged
from hybridkv.model.attention.torch_paged import TorchPagedAttention

HQ, HKV, D = 4, 2, 8


def reference(spec, q, k, v, scale):
    """One query at a time, keys chosen by the attention type's rule written out literally."""
    out = torch.zeros_like(q)
    for p in range(q.shape[0]):
        if isinstance(spec, SlidingWindowSpec):
            keys = [j for j in range(p + 1) if p - j < spec.window]
        elif isinstance(spec, ChunkedLocalSpec):
            keys = [j for j in range(p + 1) if j // spec.chunk == p // spec.chunk]
        else:
            keys = list(range(p + 1))
        for h in range(HQ):
            kh = h // (HQ // HKV)
            s = torch.stack([q[p, h] @ k[j, kh] for j in keys]) * scale
            w = torch.softmax(s, 0)
            out[p, h] = sum(w[i] * v[j, kh] for i, j in enumerate(keys))
    return out


def layer_specs():
    full = FullAttentionSpec(HKV, D, "float32")
    sliding = SlidingWindowSpec(HKV, D, "float32", window=5)
    chunked = ChunkedLocalSpec(HKV, D, "float32", chunk=6)
    return [sliding, chunked, full, sliding, chunked, full]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("chunks", [[23], [7, 9, 7], [1] * 23, [10, 1, 1, 11]])
def test_chunked_prefill_and_decode_match_whole_sequence_attention(block_size, chunks):
    check_against_reference(block_size, chunks)


@pytest.mark.parametrize("query_tile", [1, 3, 4, 7])
@pytest.mark.parametrize("chunks", [[41], [13, 28], [9, 1, 31]])
def test_query_tiles_spanning_windows_and_chunks_match_reference(query_tile, chunks):
    """Prefills of many query tiles: a tile's keys start at its first query's reach (window 5, chunk 6), tiles
    that straddle a chunk boundary or start mid-window included."""
    check_against_reference(4, chunks, query_tile)


def test_a_tile_reads_only_the_keys_its_queries_reach(monkeypatch):
    """Sliding window 5, tiles of 4 queries over a 41-token prefill: every SDPA call sees at most 4 + 5 - 1 keys,
    not the whole prefix (what keeps a long prompt's mask and working set bounded)."""
    spec = SlidingWindowSpec(HKV, D, "float32", window=5)
    layout = plan_layout([spec], 4)
    kv = KVCacheManager(layout, num_blocks=40, enable_prefix_caching=False)
    backend = TorchPagedAttention(layout, 40, "float32", query_tile=4)
    req = CacheRequest("0", list(range(41)))
    assert kv.allocate_slots(req, 41)
    backend.begin_step([StepSequence(0, 41, kv.block_tables("0"))])
    seen = []
    real = torch_paged._sdpa

    def spy(q, k, v, mask, scale):
        seen.append((q.shape[0], k.shape[0]))
        return real(q, k, v, mask, scale)

    monkeypatch.setattr(torch_paged, "_sdpa", spy)
    q, k, v = torch.randn(41, HQ, D), torch.randn(41, HKV, D), torch.randn(41, HKV, D)
    out = backend.attend(0, q, k, v, 1 / math.sqrt(D))
    assert [n for n, _ in seen] == [4] * 10 + [1]
    assert max(keys for _, keys in seen) == 4 + 5 - 1
    torch.testing.assert_close(out, reference(spec, q, k, v, 1 / math.sqrt(D)), atol=1e-5, rtol=1e-5)


def check_against_reference(block_size, chunks, query_tile=torch_paged.QUERY_TILE, lengths=None):
    """Sequences of ``lengths`` (default: two, the second 3 tokens shorter) computed ``chunks`` tokens a step."""
    torch.manual_seed(0)
    specs = layer_specs()
    layout = plan_layout(specs, block_size)
    kv = KVCacheManager(layout, num_blocks=200, enable_prefix_caching=False)
    backend = TorchPagedAttention(layout, 200, "float32", query_tile=query_tile)
    lengths = lengths or [sum(chunks), sum(chunks) - 3]
    reqs = [CacheRequest(str(i), list(range(n))) for i, n in enumerate(lengths)]
    qkv = {
        (i, layer): [torch.randn(n, HQ, D), torch.randn(n, HKV, D), torch.randn(n, HKV, D)]
        for i, n in enumerate(lengths)
        for layer in range(len(specs))
    }
    outs = {key: torch.zeros(n, HQ, D) for key, n in ((k, lengths[k[0]]) for k in qkv)}
    scale = 1 / math.sqrt(D)
    for chunk in chunks:
        step = []
        for r, n in zip(reqs, lengths):
            q_len = min(chunk, n - r.num_computed_tokens)
            assert kv.allocate_slots(r, q_len)
            step.append((r, q_len))
        backend.begin_step(
            [StepSequence(r.num_computed_tokens, q, kv.block_tables(r.request_id)) for r, q in step if q]
        )
        for layer in range(len(specs)):
            parts = [(int(r.request_id), r.num_computed_tokens, q) for r, q in step if q]
            q_all = torch.cat([qkv[(i, layer)][0][c : c + n] for i, c, n in parts])
            k_all = torch.cat([qkv[(i, layer)][1][c : c + n] for i, c, n in parts])
            v_all = torch.cat([qkv[(i, layer)][2][c : c + n] for i, c, n in parts])
            out = backend.attend(layer, q_all, k_all, v_all, scale)
            start = 0
            for i, c, n in parts:
                outs[(i, layer)][c : c + n] = out[start : start + n]
                start += n
        for r, q_len in step:
            r.num_computed_tokens += q_len
            kv.on_tokens_computed(r)
    for (i, layer), (q, k, v) in qkv.items():
        expected = reference(specs[layer], q, k, v, scale)
        torch.testing.assert_close(outs[(i, layer)], expected, atol=1e-5, rtol=1e-5)
    # the local layers really dropped blocks: their tables start with the null block
    tables = kv.block_tables("0")
    sliding_group = layout.layer_slot(0)[0]
    assert tables[sliding_group][0] == 0


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_one_sequence_decoding_alone_matches_the_reference(block_size):
    """Batch 1, the CPU decode path: a 9-token prompt then 14 single-token steps of one sequence, each query over
    the blocks of its reach gathered whole (full, window 5, chunk 6), no mask."""
    check_against_reference(block_size, [9] + [1] * 14, lengths=[23])


def test_a_decode_step_reads_only_the_blocks_of_its_reach():
    """Window 5, chunk 6, block 4, after 40 tokens: the sliding layers read 2 blocks (positions 36..40 from slot 0
    of block 9), the chunked ones 2 (36..40: 36 starts a chunk), the full ones all 11; the same at any length."""
    specs = layer_specs()
    layout = plan_layout(specs, 4)
    kv = KVCacheManager(layout, num_blocks=40, enable_prefix_caching=False)
    backend = TorchPagedAttention(layout, 40, "float32")
    req = CacheRequest("0", list(range(41)))
    assert kv.allocate_slots(req, 41)
    backend.begin_step([StepSequence(40, 1, kv.block_tables("0"))])
    reads = {layout.layer_slot(i)[0]: backend._step[layout.layer_slot(i)[0]].reads[0] for i in range(len(specs))}
    by_kind = {type(specs[i]).__name__: reads[layout.layer_slot(i)[0]] for i in range(len(specs))}
    sliding, chunked, full = by_kind["SlidingWindowSpec"], by_kind["ChunkedLocalSpec"], by_kind["FullAttentionSpec"]
    assert (len(sliding.blocks), sliding.lo, sliding.count) == (2, 0, 5)
    assert (len(chunked.blocks), chunked.lo, chunked.count) == (2, 0, 5)
    assert (len(full.blocks), full.lo, full.count) == (11, 0, 41)
