"""One model factory: every model type maps to a config class and a model class implementing ``CausalLM``;
``build_model`` makes whole models, tensor-parallel shards and dummy-weight models alike."""

from __future__ import annotations

import pytest
import torch

from hybridkv.kv.layer_specs import layer_kinds, llama4_rope_layers
from hybridkv.model.architectures.llama_config import ModelConfig
from hybridkv.model.architectures.parallel import TPGroup
from hybridkv.model.causal_lm import CausalLM
from hybridkv.model.factory import ARCHITECTURES, build_model

LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
GEMMA3 = {"model_type": "gemma3_text", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
          "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
LLAMA4 = {"model_type": "llama4_text", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 16,
          "intermediate_size_mlp": 48, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 8, "attention_chunk_size": 8, "no_rope_layer_interval": 3, "num_local_experts": 4}


def test_every_model_type_builds_a_causal_lm_that_splits_over_ranks():
    for model_type, arch in ARCHITECTURES.items():
        base = LLAMA4 if model_type.startswith("llama4") else GEMMA3 if model_type.startswith("gemma3") else LLAMA
        hf = {**base, "model_type": model_type}
        if model_type in ("llama4", "gemma3"):  # the multimodal wrappers nest the text model
            hf = {"model_type": model_type, "text_config": {**base}}
        whole, shard = build_model(hf), build_model(hf, tp=TPGroup(1, 2))
        assert isinstance(whole, arch.model_class) and isinstance(whole, CausalLM), model_type
        assert isinstance(whole.cfg, arch.config_class)
        assert whole.tp.size == 1 and shard.tp.rank == 1
        # rank 1 of 2 holds half the query heads and half the vocabulary
        assert shard.layers[0].self_attn.q_proj.weight.shape[0] * 2 == whole.layers[0].self_attn.q_proj.weight.shape[0]
        assert shard.embed_tokens.weight.shape[0] * 2 == whole.embed_tokens.weight.shape[0]


def test_an_unknown_model_type_or_dtype_or_load_format_is_refused_by_name():
    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not supported; supported: llama, .*gemma3_text"):
        build_model({**LLAMA, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="dtype torch.int8 is not supported"):
        build_model(LLAMA, torch.int8)
    with pytest.raises(ValueError, match="unknown load_format 'pt'; choose auto or dummy"):
        build_model(LLAMA, load_format="pt")
    with pytest.raises(ValueError, match="attention heads \\(2\\) cannot be split evenly over tensor_parallel_size 4"):
        build_model(GEMMA3, tp=TPGroup(0, 4))


def test_dummy_weights_are_seeded_per_rank_with_neutral_norms():
    a, b = build_model(LLAMA, load_format="dummy", seed=1), build_model(LLAMA, load_format="dummy", seed=1)
    torch.testing.assert_close(a.layers[1].mlp.up_proj.weight, b.layers[1].mlp.up_proj.weight, rtol=0, atol=0)
    other = build_model(LLAMA, load_format="dummy", seed=2)
    assert not torch.equal(a.layers[1].mlp.up_proj.weight, other.layers[1].mlp.up_proj.weight)
    rank1 = build_model(LLAMA, tp=TPGroup(1, 2), load_format="dummy", seed=0)
    rank0_of_seed1 = build_model(LLAMA, tp=TPGroup(0, 2), load_format="dummy", seed=1)
    torch.testing.assert_close(rank1.norm.weight, torch.ones(32))  # Llama's norm multiplies by w
    torch.testing.assert_close(rank1.embed_tokens.weight, rank0_of_seed1.embed_tokens.weight, rtol=0, atol=0)
    gemma = build_model(GEMMA3, load_format="dummy")
    assert all(bool((p == 0).all()) for n, p in gemma.named_parameters() if "norm" in n)  # Gemma's by 1 + w


def test_llama4_layer_pattern_has_one_home():
    """The model's RoPE layers are the KV cache's chunked layers, read by the same function."""
    cfg = ModelConfig.from_hf(LLAMA4)
    assert list(cfg.rope_layers) == llama4_rope_layers(LLAMA4) == [k == "chunked" for k in layer_kinds(LLAMA4)]
    assert "".join("c" if r else "f" for r in cfg.rope_layers) == "ccfccf"
    short = {**LLAMA4, "no_rope_layers": [1, 1, 0]}
    for read in (ModelConfig.from_hf, layer_kinds):
        with pytest.raises(ValueError, match="no_rope_layers has 3 entries but num_hidden_layers is 6"):
            read(short)
