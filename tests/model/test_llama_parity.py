"""Token-exact parity of our Llama-2/3 and Llama-4 text models (through DenseAttention) with transformers.

Tiny random models are built with transformers, saved as safetensors, loaded through our loader and compared
in float32: logits of two sequences of different lengths batched into one flattened step, and greedy
generation recomputing the whole sequence each step.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")

from hybridkv.kv.layer_specs import layer_specs_from_hf_config  # noqa: E402
from hybridkv.kv.specs import ChunkedLocalSpec, FullAttentionSpec  # noqa: E402
from hybridkv.model.attention.dense import DenseAttention, allowed_mask  # noqa: E402
from hybridkv.model.architectures.llama_config import ModelConfig  # noqa: E402
from hybridkv.model.architectures.position_encoding import rope_inv_freq  # noqa: E402
from hybridkv.model.loading.weights import load_safetensors_model  # noqa: E402

VOCAB = 128
LOGIT_ATOL = 1e-4
# Large enough init that attention is far from uniform, so a wrong mask or position encoding shows in logits.
INIT_STD = 0.25
SMALL_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Tiny so that with head_dim 8 one frequency is kept, one blended and two scaled.
    "original_max_position_embeddings": 16,
}


def llama_config():
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rope_parameters=dict(SMALL_ROPE),
        initializer_range=INIT_STD, attn_implementation="eager",
    )


def llama4_config():
    # 6 layers: RoPE/chunked at 0, 1, 3, 4 and NoPE/full at 2, 5; MoE at 1, 3, 5 (both kinds), dense elsewhere.
    return transformers.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, intermediate_size_mlp=48, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        attention_chunk_size=8, no_rope_layer_interval=3, interleave_moe_layer_step=2, num_local_experts=4,
        num_experts_per_tok=2, use_qk_norm=True, attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5,
        rope_parameters=dict(SMALL_ROPE), initializer_range=INIT_STD, attn_implementation="eager",
    )


def qwen2_config():
    # q/k/v bias without a config key, tied embeddings.
    return transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        initializer_range=INIT_STD, attn_implementation="eager",
    )


def mistral_config():
    # Every layer slides with a window of 8: checks DenseAttention's sliding mask against transformers'.
    return transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=256, sliding_window=8,
        initializer_range=INIT_STD, attn_implementation="eager",
    )


MODELS = {
    "llama": (llama_config, "LlamaForCausalLM", 0),
    "llama4": (llama4_config, "Llama4ForCausalLM", 1),
    "qwen2": (qwen2_config, "Qwen2ForCausalLM", 2),
    "mistral": (mistral_config, "MistralForCausalLM", 3),
}


def build_hf(config, model_cls, seed: int):
    torch.manual_seed(seed)
    return model_cls(config).eval()


def save_and_load(name: str, tmp_path_factory):
    make_config, cls_name, seed = MODELS[name]
    hf = build_hf(make_config(), getattr(transformers, cls_name), seed)
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path, safe_serialization=True)
    ours, config = load_safetensors_model(path, progress=False)
    return hf, ours, config, path


@pytest.fixture(scope="module", params=list(MODELS))
def models(request, tmp_path_factory):
    return save_and_load(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama4_models(tmp_path_factory):
    return save_and_load("llama4", tmp_path_factory)


def prompts(lengths: list[int], seed: int = 7) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]


@torch.no_grad()
def our_logits(model, config: dict, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Logits per sequence, all sequences run as one flattened batch through DenseAttention."""
    lens = [len(s) for s in seqs]
    attn = DenseAttention(layer_specs_from_hf_config(config, kv_cache_dtype="float32"), lens)
    ids = torch.cat(seqs)
    positions = torch.cat([torch.arange(n) for n in lens])
    hidden = model(ids, positions, attn)
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    return list(logits.split(lens))


@torch.no_grad()
def hf_logits(hf, seq: torch.Tensor) -> torch.Tensor:
    return hf(input_ids=seq[None]).logits[0].float()


def test_logits_match_transformers(models):
    hf, ours, config, _ = models
    seqs = prompts([37, 21])  # 37 tokens span five 8-token chunks
    for seq, got in zip(seqs, our_logits(ours, config, seqs)):
        want = hf_logits(hf, seq)
        assert got.shape == want.shape == (len(seq), VOCAB)
        assert want.abs().max() > 1.0  # logits are far from trivially small
        torch.testing.assert_close(got, want, atol=LOGIT_ATOL, rtol=0)


@torch.no_grad()
def our_greedy(model, config: dict, seqs: list[torch.Tensor], steps: int) -> list[list[int]]:
    seqs = [s.clone() for s in seqs]
    for _ in range(steps):
        logits = our_logits(model, config, seqs)
        seqs = [torch.cat([s, lg[-1].argmax()[None]]) for s, lg in zip(seqs, logits)]
    return [s.tolist() for s in seqs]


def test_greedy_generation_matches_transformers(models):
    hf, ours, config, _ = models
    seqs = prompts([37, 13], seed=11)
    steps = 10
    hf.generation_config.eos_token_id = None  # random weights may emit eos; generate a fixed number of tokens
    hf.generation_config.pad_token_id = 0
    got = our_greedy(ours, config, seqs, steps)
    for seq, our_tokens in zip(seqs, got):
        want = hf.generate(seq[None], do_sample=False, max_new_tokens=steps, min_new_tokens=0)[0].tolist()
        assert len(want) == len(seq) + steps
        assert our_tokens == want


def test_llama4_layer_kinds(llama4_models):
    _, ours, config, _ = llama4_models
    specs = layer_specs_from_hf_config(config, kv_cache_dtype="float32")
    assert [s.kind for s in specs] == ["chunked", "chunked", "full", "chunked", "chunked", "full"]
    assert [ours.cfg.uses_rope(i) for i in range(6)] == [True, True, False, True, True, False]
    assert [type(layer.mlp).__name__ for layer in ours.layers] == ["MLP", "MoE"] * 3


@pytest.mark.parametrize(
    "change",
    [
        {"attention_chunk_size": 1000},  # chunking
        {"attn_temperature_tuning": False},
        {"use_qk_norm": False},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},  # llama3 scaling
    ],
)
def test_llama4_features_change_transformers_output(llama4_models, change):
    """Each Llama-4 feature really acts in transformers (eager), so logits parity checks our version of it."""
    hf, _, config, _ = llama4_models
    raw = {k: v for k, v in config.items() if k not in ("layer_types", "transformers_version", "architectures")}
    ablated_config = transformers.Llama4TextConfig(**{**raw, **change}, attn_implementation="eager")
    ablated = transformers.Llama4ForCausalLM(ablated_config).eval()
    ablated.load_state_dict(hf.state_dict())
    seq = prompts([37])[0]
    assert (hf_logits(hf, seq) - hf_logits(ablated, seq)).abs().max() > 0.1


def test_llama4_chunking_in_our_model(llama4_models):
    _, ours, config, _ = llama4_models
    seq = prompts([37])[0]
    reference = our_logits(ours, config, [seq])[0]
    all_full = DenseAttention([FullAttentionSpec(2, 8, "float32")] * 6, [37])
    with torch.no_grad():
        unchunked = ours.compute_logits(ours(seq, torch.arange(37), all_full))
    assert torch.allclose(reference[:8], unchunked[:8], atol=LOGIT_ATOL)  # first chunk: identical masks
    assert (reference[8:] - unchunked[8:]).abs().max() > 0.1


def test_llama4_conditional_generation_checkpoint(llama4_models, tmp_path):
    """A Llama4ForConditionalGeneration-style checkpoint: language_model. prefix, vision tensors, sharded."""
    hf, _, config, _ = llama4_models
    renamed = {}
    for name, tensor in hf.state_dict().items():
        renamed["language_model." + name] = tensor.clone()
    renamed["vision_model.patch_embedding.linear.weight"] = torch.zeros(4, 4)
    renamed["multi_modal_projector.linear_1.weight"] = torch.zeros(32, 4)
    names = sorted(renamed)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: renamed[k] for k in keys}, str(tmp_path / file))
        weight_map.update({k: file for k in keys})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    outer = {"model_type": "llama4", "text_config": config, "vision_config": {"hidden_size": 4}}
    (tmp_path / "config.json").write_text(json.dumps(outer))

    loaded, loaded_config = load_safetensors_model(tmp_path, progress=False)
    assert loaded_config["model_type"] == "llama4"
    seq = prompts([19])[0]
    torch.testing.assert_close(our_logits(loaded, loaded_config, [seq])[0], hf_logits(hf, seq), atol=LOGIT_ATOL, rtol=0)


def test_loader_rejects_missing_and_unexpected_weights(models, tmp_path):
    hf, _, config, _ = models
    state = {k: v.clone() for k, v in hf.state_dict().items()}  # clone: tied weights share memory
    (tmp_path / "config.json").write_text(json.dumps(config))
    dropped = dict(state)
    del dropped["model.norm.weight"]
    save_file(dropped, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing weights \['norm.weight'\]"):
        load_safetensors_model(tmp_path, progress=False)
    save_file({**state, "model.layers.0.self_attn.extra": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected weights.*self_attn.extra"):
        load_safetensors_model(tmp_path, progress=False)


def test_bfloat16_load_close_to_float32(models):
    hf, ours, config, path = models
    low, _ = load_safetensors_model(path, dtype=torch.bfloat16, progress=False)
    assert low.embed_tokens.weight.dtype == torch.bfloat16
    seq = prompts([20])[0]
    got = our_logits(low, config, [seq])[0]
    want = our_logits(ours, config, [seq])[0]
    assert got.dtype == torch.float32
    # bf16 keeps ~3 significant digits; a layout or RoPE bug would be off by whole units.
    assert (got - want).abs().max() < 0.15 * want.abs().max()


def test_dense_attention_masks():
    full = allowed_mask(FullAttentionSpec(1, 4), 5)
    assert full.tolist() == torch.ones(5, 5).tril().bool().tolist()
    chunked = allowed_mask(ChunkedLocalSpec(1, 4, chunk=2), 5)
    assert chunked.nonzero().tolist() == [[0, 0], [1, 0], [1, 1], [2, 2], [3, 2], [3, 3], [4, 4]]
    from hybridkv.kv.specs import SlidingWindowSpec

    sliding = allowed_mask(SlidingWindowSpec(1, 4, window=2), 4)
    assert sliding.nonzero().tolist() == [[0, 0], [1, 0], [1, 1], [2, 1], [2, 2], [3, 2], [3, 3]]


def test_dense_attention_separates_sequences_and_groups_heads():
    torch.manual_seed(0)
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    out = DenseAttention([FullAttentionSpec(2, 8, "float32")], [2, 3]).attend(0, q, k, v, 0.5)
    # Second sequence's first token sees only itself: output is its own value of the right KV head.
    torch.testing.assert_close(out[2, 0], v[2, 0])
    torch.testing.assert_close(out[2, 3], v[2, 1])
    # First token of the second sequence is unaffected by the first sequence.
    alone = DenseAttention([FullAttentionSpec(2, 8, "float32")], [3]).attend(0, q[2:], k[2:], v[2:], 0.5)
    torch.testing.assert_close(out[2:], alone)


def test_config_reads_old_and_new_rope_keys():
    base = llama_config().to_dict()
    new = ModelConfig.from_hf(base)
    old = dict(base)
    params = old.pop("rope_parameters")
    old["rope_theta"] = params.pop("rope_theta")
    old["rope_scaling"] = {**params, "type": params.pop("rope_type")}
    assert ModelConfig.from_hf(old).rope == new.rope
    assert new.rope.rope_type == "llama3" and new.rope.factor == 8.0 and new.rope.theta == 10000.0
    assert new.rope.original_max_position_embeddings == 16


def test_config_llama4_fields_and_errors():
    raw = llama4_config().to_dict()
    raw["eos_token_id"] = [2, 3]
    cfg = ModelConfig.from_hf({"model_type": "llama4", "text_config": raw})
    assert cfg.is_llama4 and cfg.attention_chunk_size == 8 and cfg.eos_token_ids == (2, 3)
    assert cfg.rope_layers == (True, True, False, True, True, False)
    assert cfg.moe_layers == (1, 3, 5) and cfg.intermediate_size_mlp == 48
    assert cfg.floor_scale == 4 and cfg.attn_scale == 0.5 and cfg.use_qk_norm
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        ModelConfig.from_hf({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        ModelConfig.from_hf({**raw, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0, "factor": 2.0}})


@pytest.mark.parametrize("low,high", [(1.0, 4.0), (1.0, 1.0)])
def test_llama3_rope_frequencies_match_transformers(low, high):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": 8192}
    hf_config = transformers.LlamaConfig(hidden_size=1024, num_attention_heads=8, rope_parameters=rope)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config)
    got = rope_inv_freq(ModelConfig.from_hf(hf_config.to_dict()).rope, 128)
    torch.testing.assert_close(got, want, atol=0, rtol=1e-6)


def test_config_scout_style_dict():
    """Llama-4 Scout config.json style: integer temperature flag, empty no_rope_layers, old rope keys."""
    text = {
        "model_type": "llama4_text", "vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192,
        "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40,
        "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5, "attention_chunk_size": 8192,
        "attn_temperature_tuning": 4, "floor_scale": 8192, "attn_scale": 0.1, "no_rope_layers": [],
        "moe_layers": None, "interleave_moe_layer_step": 1, "num_local_experts": 16, "num_experts_per_tok": 1,
        "rope_theta": 500000.0, "eos_token_id": [200001, 200007, 200008], "bos_token_id": 200000,
        "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192},
    }
    cfg = ModelConfig.from_hf({"model_type": "llama4", "text_config": text, "tie_word_embeddings": False})
    assert cfg.attn_temperature_tuning and cfg.num_layers == 48 and cfg.moe_layers == tuple(range(48))
    assert cfg.rope_layers[:4] == (True, True, True, False) and sum(cfg.rope_layers) == 36
    assert cfg.rope.theta == 500000.0 and cfg.rope.high_freq_factor == 1.0 and cfg.eos_token_ids[-1] == 200008
    assert torch.isfinite(rope_inv_freq(cfg.rope, cfg.head_dim)).all()


def test_rope_rolled_is_rope_halves_bit_for_bit():
    """The CPU path's one rotation over q and k: x * cos + roll(x) * signed sin, the chunk-and-cat formula's values
    exactly (``a + b * -s`` is ``a - b * s``), in float32 and bf16."""
    from hybridkv.model.architectures.position_encoding import rope_cos_sin, rope_halves_tables, rope_rolled

    def chunk_and_cat(x, cos, sin):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    cos, sin = rope_cos_sin(rope_inv_freq(ModelConfig.from_hf(llama_config().to_dict()).rope, 8), torch.arange(300))
    x = torch.randn(300, 6, 8) * 5
    for dtype in (torch.float32, torch.bfloat16):
        y = x.to(dtype)
        assert torch.equal(rope_rolled(y, *rope_halves_tables(cos, sin)), chunk_and_cat(y, cos, sin))


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_fused_qkv_on_cpu_rotates_q_and_k_together_with_the_same_attention_output(name, tmp_path_factory):
    """Once q/k/v are one GEMM (``fuse_columns``, as the engine runs), a CPU forward rotates q and k in one pass
    over the fused output (``PositionTables.rolled``): bit for bit each layer's output when they are rotated apart."""
    from hybridkv.model.architectures.position_encoding import PositionTables, rope_cos_sin, rope_halves_tables
    from hybridkv.model.architectures.parallel import fuse_columns

    _, model, config, _ = save_and_load(name, tmp_path_factory)
    fuse_columns(model)
    lens = [9, 4]
    attn = DenseAttention(layer_specs_from_hf_config(config, kv_cache_dtype="float32"), lens)
    positions = torch.cat([torch.arange(n) for n in lens])
    cos, sin = rope_cos_sin(rope_inv_freq(model.cfg.rope, model.cfg.head_dim), positions)
    apart, together = PositionTables(cos, sin, None), PositionTables(cos, sin, None, rope_halves_tables(cos, sin))
    x = torch.randn(sum(lens), model.cfg.hidden_size)
    with torch.no_grad():
        for layer in model.layers:
            assert layer.self_attn.qkv.joint(x) is not None
            assert torch.equal(layer.self_attn(x, together, attn), layer.self_attn(x, apart, attn))
