"""Paged attention backends declare what they can do; the engine reads the declaration, not the backend's type."""

from __future__ import annotations

import pytest

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.kv_sizing import step_reserve_bytes
from hybridkv.kv import FullAttentionSpec, plan_layout
from hybridkv.model.attention.base import BackendCapabilities
from hybridkv.model.attention.factory import AttentionChoice, make_paged_attention, paged_attention_capabilities
from hybridkv.model.attention.fp8_segments import SEGMENT_BYTES
from hybridkv.model.attention.triton_paged import TritonPagedAttention


def test_the_torch_backend_declares_no_graphs_and_no_segments():
    layout = plan_layout([FullAttentionSpec(1, 8, "fp8_e4m3")] * 2, 4)
    backend = make_paged_attention(AttentionChoice("auto", "cpu", "fp8_e4m3"), layout, 8, 2)
    assert backend.capabilities == BackendCapabilities() == paged_attention_capabilities("torch", "cuda", "fp8_e4m3")


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
def test_the_triton_backend_declares_graphs_and_an_fp8_caches_segments(kv_dtype):
    caps = paged_attention_capabilities("auto", "cuda", kv_dtype)
    fp8 = kv_dtype == "fp8_e4m3"
    assert caps.cuda_graphs and caps.fp8_segments == fp8
    assert caps.segment_bytes == (SEGMENT_BYTES if fp8 else 0)
    assert TritonPagedAttention.declare(kv_dtype, segment_bytes=1 << 20).segment_bytes == ((1 << 20) if fp8 else 0)
    # the engine keeps the declared segment, 1.5x (its FP8 gather beside it for a moment), out of the KV cache
    config = EngineConfig(kv_cache_dtype=kv_dtype)
    plain = step_reserve_bytes(EngineConfig(kv_cache_dtype="bfloat16"), 2048, 49152)
    assert step_reserve_bytes(config, 2048, 49152) - plain == caps.segment_bytes * 3 // 2


def test_an_unknown_backend_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown attention_backend 'flash'; choose auto, torch or triton"):
        paged_attention_capabilities("flash", "cpu", "bfloat16")
