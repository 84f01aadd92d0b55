"""The paged torch backend against attention computed the slow, obvious way over whole sequences."""

import math

import pytest
import torch

from hybridkv.kv import CacheRequest, KVCacheManager, plan_layout
from hybridkv.kv.specs import ChunkedLocalSpec, FullAttentionSpec, SlidingWindowSpec
from hybridkv.model.attention.base import StepSequence
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
    torch.manual_seed(0)
    specs = layer_specs()
    layout = plan_layout(specs, block_size)
    kv = KVCacheManager(layout, num_blocks=200, enable_prefix_caching=False)
    backend = TorchPagedAttention(layout, 200, "float32")
    lengths = [sum(chunks), sum(chunks) - 3]
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
