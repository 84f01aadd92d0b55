"""Attention specs, per-layer specs from HF configs, and the layer-group layout."""

import json

import pytest
from kvutil import SCOUT

from hybridkv.kv import (
    ChunkedLocalSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
    layer_specs_from_hf_config,
    plan_layout,
)
from hybridkv.kv.layer_specs import checkpoint_dtype, layer_kinds
from hybridkv.model.loading.hf_config import load_hf_config


# ---- specs -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("dtype", "per_token", "fixed"), [("bfloat16", 512, 0), ("float16", 512, 0), ("float32", 1024, 0), ("fp8_e4m3", 256, 8)]
)
def test_bytes_per_token(dtype, per_token, fixed):
    spec = FullAttentionSpec(1, 128, dtype)
    assert spec.bytes_per_token == per_token
    assert spec.fixed_bytes_per_layer == fixed
    assert FullAttentionSpec(8, 64, dtype).bytes_per_token == 8 * 64 * 2 * (per_token // 256)


def test_spec_validation():
    with pytest.raises(ValueError, match="unknown KV cache dtype"):
        FullAttentionSpec(1, 128, "fp8_e5m2")
    with pytest.raises(ValueError):
        FullAttentionSpec(0, 128)
    with pytest.raises(ValueError):
        SlidingWindowSpec(1, 8, window=0)
    with pytest.raises(ValueError):
        ChunkedLocalSpec(1, 8, chunk=0)


def test_first_needed_token():
    full, sw, ch = FullAttentionSpec(1, 8), SlidingWindowSpec(1, 8, window=4), ChunkedLocalSpec(1, 8, chunk=4)
    assert [full.first_needed_token(n) for n in (0, 5, 10**7)] == [0, 0, 0]
    assert [sw.first_needed_token(n) for n in (0, 3, 4, 5, 7, 11)] == [0, 0, 1, 2, 4, 8]
    assert [ch.first_needed_token(n) for n in (0, 3, 4, 7, 8, 12)] == [0, 0, 4, 4, 8, 12]
    assert sw.tokens_kept(100) == 3 and ch.tokens_kept(7) == 3 and full.tokens_kept(9) == 9
    assert SlidingWindowSpec(1, 8, window=1).first_needed_token(6) == 6


def test_max_live_blocks():
    full = FullAttentionSpec(1, 8)
    assert full.max_live_blocks(0, 16, 8) == 0
    assert full.max_live_blocks(17, 16, 8) == 2
    sw = SlidingWindowSpec(1, 8, window=4)
    # decode: 3 earlier tokens + 1 new, unaligned -> at most 3 blocks of 2
    assert sw.max_live_blocks(1000, 2, 1) == 3
    assert sw.max_live_blocks(1000, 2, 0) == 3  # a step computes at least one token
    assert sw.max_live_blocks(1000, 2, 5) == 5  # 3 + 5 = 8 tokens unaligned -> 5 blocks
    assert sw.max_live_blocks(3, 2, 8) == 2  # never more than the request has
    ch = ChunkedLocalSpec(1, 8, chunk=4)
    assert ch.max_live_blocks(1000, 2, 1) == 2  # aligned chunk: 3 + 1 tokens from a chunk start
    assert ch.max_live_blocks(1000, 2, 4) == 4
    # chunk not a multiple of the block: treated as unaligned, an upper bound at most one block high
    assert ChunkedLocalSpec(1, 8, chunk=8).max_live_blocks(1000, 16, 1) in (1, 2)
    assert ChunkedLocalSpec(1, 8, chunk=24).max_live_blocks(1000, 16, 1) in (2, 3)
    assert ChunkedLocalSpec(1, 8, chunk=8192).max_live_blocks(10**7, 16, 8192) == 1024


# ---- HF configs ------------------------------------------------------------------------------------
def _kinds(cfg):
    return "".join(k[0] for k in layer_kinds(cfg))


def llama4(**kw):
    cfg = {"model_type": "llama4_text", "num_hidden_layers": 8, "num_attention_heads": 40, "num_key_value_heads": 8,
           "head_dim": 128, "hidden_size": 5120, "attention_chunk_size": 8192, "torch_dtype": "bfloat16"}
    return cfg | kw


def test_scout_config_file():
    cfg = load_hf_config(SCOUT)
    specs = layer_specs_from_hf_config(cfg, tensor_parallel_size=8)
    assert len(specs) == 48
    full = [i for i, s in enumerate(specs) if s.kind == "full"]
    assert full == list(range(3, 48, 4))
    assert all(s == ChunkedLocalSpec(1, 128, "bfloat16", chunk=8192) for s in specs if s.kind == "chunked")
    assert sum(s.bytes_per_token for s in specs) == 24576
    assert sum(s.bytes_per_token for s in specs if s.kind == "full") == 6144
    fp8 = layer_specs_from_hf_config(cfg, 8, "fp8")
    assert fp8[0].dtype == "fp8_e4m3" and sum(s.bytes_per_token for s in fp8) == 12288


def test_llama4_no_rope_layers_and_interval():
    assert _kinds(llama4(no_rope_layers=[1, 0, 1, 1, 0, 1, 1, 0])) == "cfccfccf"
    assert _kinds(llama4(no_rope_layer_interval=4)) == "cccfcccf"
    assert _kinds(llama4(no_rope_layer_interval=2)) == "cfcfcfcf"
    assert _kinds(llama4()) == "cccfcccf"  # llama4 default interval 4
    # without a chunk size nothing is chunked
    assert _kinds(llama4(attention_chunk_size=None, no_rope_layer_interval=4)) == "ffffffff"
    lt = ["chunked_attention"] * 3 + ["full_attention"]
    assert _kinds(llama4(num_hidden_layers=4, layer_types=lt)) == "cccf"


def test_gemma2_alternates():
    cfg = {"model_type": "gemma2", "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4,
           "head_dim": 256, "hidden_size": 2304, "sliding_window": 4096}
    specs = layer_specs_from_hf_config(cfg)
    assert "".join(s.kind[0] for s in specs) == "sfsfsf"
    assert specs[0] == SlidingWindowSpec(4, 256, "bfloat16", window=4096)


def gemma3_270m(**kw):
    cfg = {"model_type": "gemma3_text", "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
           "head_dim": 256, "hidden_size": 640, "sliding_window": 512, "torch_dtype": "bfloat16"}
    return cfg | kw


def test_gemma3_layer_types_and_pattern():
    by_pattern = layer_kinds(gemma3_270m(sliding_window_pattern=6))
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]
    assert layer_kinds(gemma3_270m(layer_types=types)) == by_pattern
    assert [i for i, k in enumerate(by_pattern) if k == "full"] == [5, 11, 17]
    assert _kinds(gemma3_270m(_sliding_window_pattern=2, num_hidden_layers=4)) == "sfsf"
    with pytest.raises(ValueError, match="18"):
        layer_kinds(gemma3_270m(layer_types=types[:17]))
    with pytest.raises(ValueError, match="unknown layer_types"):
        layer_kinds(gemma3_270m(layer_types=["linear_attention"] * 18))


def test_gpt_oss():
    cfg = {"model_type": "gpt_oss", "num_hidden_layers": 4, "num_attention_heads": 64, "num_key_value_heads": 8,
           "head_dim": 64, "hidden_size": 2880, "sliding_window": 128,
           "layer_types": ["sliding_attention", "full_attention"] * 2}
    specs = layer_specs_from_hf_config(cfg, tensor_parallel_size=4)
    assert specs[0] == SlidingWindowSpec(2, 64, "bfloat16", window=128)
    assert specs[1] == FullAttentionSpec(2, 64, "bfloat16")


def test_mistral():
    cfg = {"model_type": "mistral", "num_hidden_layers": 3, "num_attention_heads": 32, "num_key_value_heads": 8,
           "hidden_size": 4096, "sliding_window": 4096, "torch_dtype": "float16"}
    specs = layer_specs_from_hf_config(cfg)
    # head_dim from hidden / heads; the cache in bfloat16, what the engine computes a float16 checkpoint in on a GPU
    assert specs == [SlidingWindowSpec(8, 128, "bfloat16", window=4096)] * 3
    assert _kinds(cfg | {"sliding_window": None}) == "fff"


def test_qwen2_sliding_switch():
    cfg = {"model_type": "qwen2", "num_hidden_layers": 6, "num_attention_heads": 28, "num_key_value_heads": 4,
           "hidden_size": 3584, "sliding_window": 131072, "max_window_layers": 4, "use_sliding_window": False}
    assert _kinds(cfg) == "ffffff"
    assert _kinds(cfg | {"use_sliding_window": True}) == "ffffss"
    assert _kinds(cfg | {"use_sliding_window": True, "max_window_layers": 0}) == "ssssss"
    lt = ["full_attention"] * 4 + ["sliding_attention"] * 2
    assert _kinds(cfg | {"layer_types": lt}) == "ffffff"  # listed but switched off
    assert _kinds(cfg | {"layer_types": lt, "use_sliding_window": True}) == "ffffss"


def test_multimodal_nested_text_config():
    cfg = {"model_type": "llama4", "torch_dtype": "float32", "vision_config": {"num_hidden_layers": 34},
           "text_config": llama4(no_rope_layer_interval=4, torch_dtype=None)}
    specs = layer_specs_from_hf_config(cfg, tensor_parallel_size=8)
    assert "".join(s.kind[0] for s in specs) == "cccfcccf"
    assert specs[0].num_kv_heads == 1 and checkpoint_dtype(cfg) == "float32"  # dtype from the outer config


def test_tensor_parallel_split_replicate_and_errors():
    cfg = llama4(no_rope_layer_interval=4)
    assert {s.num_kv_heads for s in layer_specs_from_hf_config(cfg, 1)} == {8}
    assert {s.num_kv_heads for s in layer_specs_from_hf_config(cfg, 2)} == {4}
    assert {s.num_kv_heads for s in layer_specs_from_hf_config(cfg, 16)} == {1}  # replicated
    with pytest.raises(ValueError, match="split evenly"):
        layer_specs_from_hf_config(cfg, 3)
    with pytest.raises(ValueError, match="replicated evenly"):
        layer_specs_from_hf_config(cfg, 12)
    with pytest.raises(ValueError):
        layer_specs_from_hf_config(cfg, 0)
    with pytest.raises(ValueError, match="fp8_e5m2"):
        layer_specs_from_hf_config(cfg, 8, "fp8_e5m2")


def test_load_hf_config_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 1}))
    assert load_hf_config(tmp_path) == {"num_hidden_layers": 1}
    with pytest.raises(FileNotFoundError):
        load_hf_config(tmp_path / "missing")


# ---- layout ----------------------------------------------------------------------------------------
def test_layout_scout():
    layout = plan_layout(layer_specs_from_hf_config(load_hf_config(SCOUT), 8), block_size=16)
    assert [(g.spec.kind, len(g.layer_ids)) for g in layout.groups] == [("chunked", 12)] * 3 + [("full", 12)]
    assert [g.group_id for g in layout.groups] == [0, 1, 2, 3]
    full = next(g for g in layout.groups if g.spec.kind == "full")
    assert full.layer_ids == tuple(range(3, 48, 4))
    chunked = [g.layer_ids for g in layout.groups if g.spec.kind == "chunked"]
    assert chunked[0][:4] == (0, 1, 2, 4) and chunked[2][-1] == 46
    assert layout.page_bytes == 16 * 12 * 512 == 96 * 1024
    assert not any(layout.padding_bytes.values()) and layout.fixed_bytes == 0
    assert layout.num_layers == 48
    assert layout.layer_slot(7) == (full.group_id, 1)
    assert layout.num_blocks(96 * 1024 * 10 + 5) == 10
    with pytest.raises(KeyError):
        layout.layer_slot(48)


def test_layout_gemma3_270m():
    specs = layer_specs_from_hf_config(gemma3_270m(sliding_window_pattern=6))
    layout = plan_layout(specs, 16)
    kinds = [g.spec.kind for g in layout.groups]
    assert kinds.count("full") == 1 and kinds.count("sliding") == 5
    assert all(len(g.layer_ids) == 3 for g in layout.groups)
    assert next(g for g in layout.groups if g.spec.kind == "full").layer_ids == (5, 11, 17)
    assert layout.page_bytes == 16 * 3 * 1024 and not any(layout.padding_bytes.values())


def test_layout_seven_sliding_three_full():
    specs = [SlidingWindowSpec(2, 64, window=128)] * 7 + [FullAttentionSpec(2, 64)] * 3
    layout = plan_layout(specs, 8)
    assert len(layout.groups) == 10 and all(len(g.layer_ids) == 1 for g in layout.groups)
    assert layout.page_bytes == 8 * 512 and not any(layout.padding_bytes.values())
    assert sorted(i for g in layout.groups for i in g.layer_ids) == list(range(10))


def test_layout_mixed_bytes():
    # 4 layers at 512 B/token and 2 at 1024 B/token: one page of 2048 B/token holds 4 or 2 layers.
    specs = [FullAttentionSpec(1, 128)] * 4 + [SlidingWindowSpec(2, 128, window=64)] * 2
    layout = plan_layout(specs, 4)
    assert [(g.spec.kind, len(g.layer_ids)) for g in layout.groups] == [("full", 4), ("sliding", 2)]
    assert layout.page_bytes == 4 * 2048 and not any(layout.padding_bytes.values())
    # 3 layers at 512 and 1 at 1024: 3 x 512 is not a multiple of 1024 -> one layer per group, padded.
    padded = plan_layout([FullAttentionSpec(1, 128)] * 3 + [SlidingWindowSpec(2, 128, window=64)], 4)
    assert len(padded.groups) == 4 and padded.page_bytes == 4 * 1024
    assert padded.padding_bytes["full"] == 4 * 512 and not padded.padding_bytes.get("sliding(64)")


def test_layout_fp8_fixed_bytes_and_block_size_checks():
    layout = plan_layout([FullAttentionSpec(1, 128, "fp8_e4m3")] * 4, 16)
    assert layout.fixed_bytes == 4 * 8 and layout.page_bytes == 16 * 4 * 256
    assert layout.num_blocks(layout.page_bytes * 3 + 31) == 2
    with pytest.raises(ValueError, match="power of two"):
        plan_layout([FullAttentionSpec(1, 128)], 12)
    with pytest.raises(ValueError):
        plan_layout([], 16)
