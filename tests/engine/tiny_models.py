"""Tiny random checkpoints saved to disk the way real ones are (config.json, safetensors, tokenizer.json), so the
engine is tested through its real loading path against transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 96
ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def llama4_config(**overrides):
    # chunk 8; layers 2 and 5 NoPE/full, the rest chunked; MoE on odd layers; floor_scale 4 so temperature tuning acts
    return transformers.Llama4TextConfig(**{**dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, intermediate_size_mlp=48, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
        attention_chunk_size=8, no_rope_layer_interval=3, interleave_moe_layer_step=2, num_local_experts=4,
        num_experts_per_tok=1, use_qk_norm=True, attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5,
        rope_parameters=dict(ROPE), initializer_range=0.25, attn_implementation="eager",
        bos_token_id=0, eos_token_id=1, pad_token_id=2,
    ), **overrides})


def llama4_d128_config():
    # Scout's per-rank attention shape at toy width: 5 query heads on 1 KV head of 128 (on Hopper with a bf16 cache,
    # the CUDA prefill kernel's shape), chunks of 192 spanning its 128-key tiles; layers 1 and 3 NoPE/full
    return llama4_config(hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
                         num_attention_heads=5, num_key_value_heads=1, head_dim=128, max_position_embeddings=1024,
                         attention_chunk_size=192, no_rope_layer_interval=2)


def llama4_q_config():
    # every linear's inputs a multiple of 128 (INT4's group) and its sizes of 16 (FP8's GEMM): quantizable
    return llama4_config(hidden_size=128, intermediate_size=128, intermediate_size_mlp=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, no_rope_layer_interval=2,
                         initializer_range=0.3)


def llama3_config():
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, rope_parameters=dict(ROPE),
        initializer_range=0.25, attn_implementation="eager", bos_token_id=0, eos_token_id=1,
    )


def mistral_config():
    # every layer slides over 8 tokens
    return transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=512, sliding_window=8,
        initializer_range=0.25, attn_implementation="eager", bos_token_id=0, eos_token_id=1,
    )


def gemma3_config():
    # Gemma-3's layout at toy size: 5 sliding (window 8) then 1 full, head_dim 256 like the real 270M model
    return transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=2,
        num_key_value_heads=1, head_dim=256, max_position_embeddings=512, sliding_window=8,
        initializer_range=0.25, attn_implementation="eager", bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )


CONFIGS = {"llama4": llama4_config, "llama4_d128": llama4_d128_config, "llama4_q": llama4_q_config, "llama3": llama3_config, "mistral": mistral_config, "gemma3": gemma3_config}


def save_word_tokenizer(path: Path) -> None:
    """A word-level tokenizer over the tiny vocabulary: token i is the word 'w<i>'."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "w0", "eos_token": "w1"}))


class TinyModel:
    def __init__(self, name: str, path: Path) -> None:
        self.name = name
        self.path = path
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """transformers' own greedy continuation of exactly n tokens."""
        with torch.no_grad():
            out = self.hf.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                pad_token_id=2, eos_token_id=None,
            )
        return out[0, len(prompt):].tolist()

    def logprobs(self, prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(self.hf(torch.tensor([prompt])).logits[0, -1].float(), -1)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    made: dict[str, TinyModel] = {}

    def get(name: str) -> TinyModel:
        if name not in made:
            torch.manual_seed(0)
            path = tmp_path_factory.mktemp(name)
            hf = transformers.AutoModelForCausalLM.from_config(CONFIGS[name]())
            hf.save_pretrained(path)
            save_word_tokenizer(path)
            made[name] = TinyModel(name, path)
        return made[name]

    return get


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]
