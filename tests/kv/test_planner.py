"""Capacity planner: Scout numbers against vLLM's, agreement with the cache manager's admission, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridkv.kv.cache_manager import KVCacheManager
from hybridkv.kv.capacity import peak_blocks, step_reserve_bytes
from hybridkv.kv.layer_specs import layer_specs_from_hf_config
from hybridkv.kv.layout import plan_layout
from hybridkv.kv.planner import (
    GIB,
    RUNTIME_BYTES,
    estimate_weights,
    PlanInputs,
    plan_capacity,
    plan_to_dict,
)
from hybridkv.kv.specs import FullAttentionSpec, cdiv
from hybridkv.kv.weight_formats import INT4, UNQUANTIZED, weight_format

REPO = Path(__file__).parents[2]
DATA = REPO / "tests" / "data" / "scout-text-config.json"
SHARED = REPO / ".." / "shared" / "scout-text-config.json"  # CI clones shared/ beside the repo

SCOUT_KV = int(89.71 * GIB)
VLLM_NO_HYBRID_POOL = 3_919_664  # vLLM, hybrid manager off, 89.71 GiB/GPU (ANCHORS)
VLLM_FP8_POOL = 7_838_976  # vLLM, FP8 e4m3 KV (ANCHORS)
SCOUT_WEIGHTS_PER_RANK = 27.8 * GIB  # measured (ANCHORS)


@pytest.fixture(scope="module")
def scout() -> dict:
    return json.loads(DATA.read_text())


def gemma3_like(**overrides) -> dict:
    cfg = {
        "model_type": "gemma3_text",
        "num_hidden_layers": 18,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "hidden_size": 640,
        "intermediate_size": 2048,
        "vocab_size": 262_144,
        "max_position_embeddings": 32_768,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }
    return cfg | overrides


def make_plan(config: dict, hybrid: bool = True, **inputs):
    return plan_capacity(config, PlanInputs(**inputs), hybrid=hybrid)


def scout_plan(scout: dict, **kw):
    kw.setdefault("kv_memory_bytes", SCOUT_KV)
    return make_plan(scout, tensor_parallel_size=8, **kw)


def test_test_data_matches_shared_config():
    if not SHARED.is_file():
        pytest.skip("shared/ is not beside the repo")
    assert json.loads(DATA.read_text()) == json.loads(SHARED.read_text())


# ---- Scout ---------------------------------------------------------------------------------------------------
def test_scout_no_hybrid_pool_matches_vllm(scout):
    plan = scout_plan(scout, hybrid=False)
    assert plan.num_groups == 1 and plan.types[0].layers == 48
    assert plan.pool_tokens == pytest.approx(VLLM_NO_HYBRID_POOL, rel=1e-3)
    assert plan.max_model_len == plan.pool_tokens  # one group, every block usable by one request


def test_scout_fp8_no_hybrid_pool_matches_vllm(scout):
    plan = scout_plan(scout, hybrid=False, kv_cache_dtype="fp8_e4m3")
    assert plan.pool_tokens == pytest.approx(VLLM_FP8_POOL, rel=1e-3)


@pytest.mark.parametrize("dtype, per_layer", [("bfloat16", 512), ("auto", 512), ("fp8_e4m3", 256)])
def test_scout_hybrid_reaches_physical_limit(scout, dtype, per_layer):
    plan = scout_plan(scout, kv_cache_dtype=dtype)
    ideal = SCOUT_KV // (12 * per_layer)
    assert 0.995 * ideal <= plan.max_model_len <= ideal
    assert plan.physical_limit_tokens <= ideal
    assert plan.max_model_len <= plan.physical_limit_tokens
    full, chunked = plan.types
    assert (full.label, full.layers, full.groups, full.bytes_per_token_per_layer) == ("full", 12, 1, per_layer)
    assert (chunked.label, chunked.layers, chunked.groups) == ("chunked(8192)", 36, 3)
    assert full.bytes_per_token == 12 * per_layer and chunked.bytes_per_token == 36 * per_layer
    assert plan.padding_bytes == 0 and plan.fits


def test_scout_fp8_halves_bytes_and_keeps_fixed_scales(scout):
    bf16, fp8 = scout_plan(scout), scout_plan(scout, kv_cache_dtype="fp8_e4m3")
    assert fp8.page_bytes * 2 == bf16.page_bytes
    assert fp8.fixed_bytes == 48 * 8 and bf16.fixed_bytes == 0  # one float32 scale for K and V per layer
    assert abs(fp8.usable_blocks - 2 * bf16.usable_blocks) <= 2
    # The chunked groups keep the same block count, so only the full group's share doubles.
    assert fp8.max_model_len == (fp8.usable_blocks - 3 * 1024) * 16


def test_scout_chunked_groups_keep_one_chunk_plus_a_step(scout):
    plan = scout_plan(scout)
    chunked = plan.types[1]
    # chunk 8,192 is block-aligned: chunk - 1 + step tokens span cdiv(8191 + 8192, 16) blocks.
    assert chunked.blocks_per_group == cdiv(8191 + 8192, 16)
    assert plan.types[0].blocks_per_group == cdiv(plan.max_model_len, 16)


def test_requested_length_that_does_not_fit(scout):
    fitting = scout_plan(scout).max_model_len
    plan = scout_plan(scout, max_model_len=20_000_000)  # never raises for this
    assert not plan.fits
    assert plan.max_model_len == fitting
    assert "20,000,000" in plan.reason and f"{fitting:,}" in plan.reason and "\n" not in plan.reason
    assert plan.row_tokens == 20_000_000
    assert plan.concurrency[-1].num_tokens == 20_000_000 and plan.concurrency[-1].requests == 0


def test_requested_length_that_fits(scout):
    plan = scout_plan(scout, max_model_len=10_000_000)
    assert plan.fits and plan.reason == ""
    assert plan.max_model_len >= 10_000_000
    last = plan.concurrency[-1]
    assert last.num_tokens == 10_000_000 and last.requests == 1
    assert any("max_position_embeddings 10,485,760" in n for n in plan.notes)


def test_longest_fitting_is_tight(scout):
    plan = scout_plan(scout, kv_memory_bytes=4 * GIB)
    layout = plan_layout(layer_specs_from_hf_config(scout, 8), 16)
    assert peak_blocks(layout, plan.max_model_len, 8192) <= plan.usable_blocks
    assert peak_blocks(layout, plan.max_model_len + 1, 8192) > plan.usable_blocks


def test_concurrency(scout):
    hybrid, flat = scout_plan(scout), scout_plan(scout, hybrid=False)
    assert [c.num_tokens for c in hybrid.concurrency][:3] == [8192, 131072, 1048576]
    for c in hybrid.concurrency:
        assert c.requests == hybrid.usable_blocks // c.blocks_per_request
    # At 8K local layers keep everything anyway; beyond a chunk the hybrid cache fits ~3.9x as many at 1M.
    assert hybrid.concurrency[0].requests == flat.concurrency[0].requests
    assert hybrid.concurrency[2].requests > 3 * flat.concurrency[2].requests


def test_physical_limit_is_a_model_property(scout):
    assert scout_plan(scout).physical_limit_tokens == scout_plan(scout, hybrid=False).physical_limit_tokens
    assert scout_plan(scout).physical_limit_tokens == SCOUT_KV // 6144


# ---- agreement with the cache manager -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "config, tp, memory, block, step, hybrid",
    [
        ("scout", 8, SCOUT_KV, 16, 8192, True),
        ("scout", 8, 3 * GIB, 32, 2048, True),
        ("scout", 8, 3 * GIB, 16, 8192, False),
        ("gemma", 1, GIB // 4, 16, 8192, True),
        ("gemma", 1, GIB // 4, 64, 1000, True),
        ("gemma", 1, GIB // 4, 16, 8192, False),
    ],
)
def test_max_model_len_equals_cache_manager(scout, config, tp, memory, block, step, hybrid):
    cfg = scout if config == "scout" else gemma3_like()
    plan = make_plan(
        cfg, tensor_parallel_size=tp, kv_memory_bytes=memory, block_size=block,
        max_num_batched_tokens=step, hybrid=hybrid,
    )
    specs = layer_specs_from_hf_config(cfg, tp)
    if not hybrid:
        specs = [FullAttentionSpec(s.num_kv_heads, s.head_dim, s.dtype) for s in specs]
    layout = plan_layout(specs, block)
    manager = KVCacheManager(layout, layout.num_blocks(memory), enable_prefix_caching=False, max_step_tokens=step)
    assert manager.pool.num_usable_blocks == plan.usable_blocks
    assert manager.max_tokens_that_fit(plan.usable_blocks * block) == plan.max_model_len
    for n in (1, block, 8191, 8192, 100_000, plan.max_model_len):
        assert manager.peak_blocks(n) == peak_blocks(layout, n, step)
    assert manager.can_ever_fit(plan.max_model_len) and not manager.can_ever_fit(plan.max_model_len + 1)


# ---- sliding window (Gemma-3-like) ---------------------------------------------------------------------------
@pytest.mark.parametrize("block", [1, 16, 64, 256, 1024])
@pytest.mark.parametrize("step", [1, 512, 8192])
def test_gemma3_sliding_rows_keep_a_window_plus_a_step(block, step):
    plan = make_plan(
        gemma3_like(), kv_memory_bytes=GIB, block_size=block, max_num_batched_tokens=step, max_model_len=32_768
    )
    full, sliding = plan.types
    assert (full.label, full.layers, full.groups) == ("full", 3, 1)
    assert (sliding.label, sliding.layers, sliding.groups) == ("sliding(512)", 15, 5)
    assert sliding.bytes_per_token_per_layer == 2 * 256 * 2
    assert sliding.blocks_per_group <= cdiv(512 - 1 + step, block) + 1
    assert full.blocks_per_group == cdiv(32_768, block)


def test_all_sliding_model_is_not_bounded_by_kv():
    cfg = gemma3_like(sliding_window_pattern=None, model_type="mistral")
    plan = make_plan(cfg, kv_memory_bytes=GIB)
    assert plan.physical_limit_tokens is None
    assert plan.max_model_len == 32_768 and plan.fits
    assert any("every layer is local" in n for n in plan.notes)


# ---- GPU memory -> KV memory ---------------------------------------------------------------------------------
def test_scout_weights_estimate_within_15_percent(scout):
    weights = sum(estimate_weights(scout, 8).values())
    assert weights == pytest.approx(SCOUT_WEIGHTS_PER_RANK, rel=0.15)


def test_weights_count_lm_head_unless_tied(scout):
    untied = estimate_weights(scout, 8)
    tied = estimate_weights(scout | {"tie_word_embeddings": True}, 8)
    assert untied["lm_head"] == untied["embedding"] > 0 and tied["lm_head"] == 0
    # Llama-4: experts use intermediate_size, the dense MLP intermediate_size_mlp; every layer is MoE here.
    assert untied["mlp"] == 0
    half_moe = estimate_weights(scout | {"moe_layers": list(range(1, 48, 2))}, 8)
    assert half_moe["mlp"] == 24 * 3 * 5120 * 16384 // 8 * 2
    assert half_moe["moe"] == untied["moe"] // 2


def test_gpu_memory_mode_is_an_estimate(scout):
    plan = scout_plan(scout, kv_memory_bytes=None, gpu_memory_bytes=139 * GIB, gpu_memory_utilization=0.9)
    m = plan.memory
    assert plan.kv_memory_is_estimate and m is not None
    assert m.kv_memory_bytes == int(139 * GIB * 0.9) - m.weights_bytes - RUNTIME_BYTES - m.activation_reserve_bytes
    assert plan.kv_memory_bytes == m.kv_memory_bytes
    assert any("estimate" in n for n in plan.notes)
    # the engine's step reserve: 1 GiB slack + 8,192 tokens x 5,120 x 4 B x 16 + 256 seqs x 202,048 x 4 B x 3
    assert m.activation_reserve_bytes == GIB + 8192 * 5120 * 64 + 256 * 202_048 * 12
    fp8 = scout_plan(scout, kv_memory_bytes=None, gpu_memory_bytes=139 * GIB, kv_cache_dtype="fp8_e4m3",
                     max_num_seqs=8, segment_bytes=512 << 20).memory
    assert fp8.activation_reserve_bytes == step_reserve_bytes(8192, 8, 5120, 202_048, 512 << 20)
    assert fp8.activation_reserve_bytes - step_reserve_bytes(8192, 8, 5120, 202_048) == 768 << 20


def test_gpu_too_small_gives_zero_not_an_error(scout):
    plan = scout_plan(scout, kv_memory_bytes=None, gpu_memory_bytes=16 * GIB, max_model_len=8192)
    assert plan.kv_memory_bytes == 0 and plan.max_model_len == 0 and not plan.fits and plan.reason


# ---- bad input ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, match",
    [
        ({"kv_cache_dtype": "fp8_e5m2"}, "fp8_e5m2"),
        ({"block_size": 24}, "power of two"),
        ({"gpu_memory_bytes": 80 * GIB}, "exactly one"),
        ({"kv_memory_bytes": None}, "exactly one"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"gpu_memory_utilization": 1.5}, "utilization"),
    ],
)
def test_bad_input_raises_value_error(scout, kw, match):
    with pytest.raises(ValueError, match=match):
        scout_plan(scout, **kw)


def test_plan_is_json_ready(scout):
    out = json.loads(json.dumps(plan_to_dict(scout_plan(scout))))
    assert out["max_model_len"] > 0 and out["types"][0]["label"] == "full"


def test_capacity_docstring_example(scout):
    from hybridkv.kv.capacity import longest_fitting

    layout = plan_layout(layer_specs_from_hf_config(scout, 8), 16)
    assert peak_blocks(layout, 131_072, 8192) == 8192 + 3 * 1024 == 11_264
    assert longest_fitting(layout, 11_264, 8192, 10**7) == 131_072


def test_weights_beyond_the_gpu_name_the_smallest_tensor_parallel_size_that_fits(scout):
    """Scout's bf16 weights on one 139.8 GiB GPU leave no KV memory: the reason says the weights alone do not fit
    and names TP 2, the smallest size at which the same inputs plan a fitting pool (TP 1 is where they do not)."""
    inputs = dict(gpu_memory_bytes=int(139.8 * GIB))
    plan = make_plan(scout, **inputs)
    budget = int(139.8 * GIB * 0.9)
    assert plan.memory.weights_bytes > budget and plan.kv_memory_bytes == 0 and not plan.fits
    assert plan.reason.startswith(f"the weights alone ({plan.memory.weights_bytes / GIB:.2f} GiB per rank")
    assert "tensor-parallel size 1, bfloat16) exceed" in plan.reason
    # the asked format's smallest size, then the formats a bf16 checkpoint is quantized to at load that need fewer
    # (fp8, its routed experts included: 102.37 GiB; int4: 54.62 GiB)
    assert plan.reason.endswith(
        "; the smallest tensor-parallel size that fits is 2 (bfloat16)"
        "; with --quantization fp8 it fits at tensor-parallel size 1"
        "; with --quantization int4 it fits at tensor-parallel size 1")
    assert make_plan(scout, tensor_parallel_size=2, **inputs).fits
    fp8 = make_plan(scout, quantization="fp8", **inputs)
    assert fp8.fits and f"{fp8.memory.weights_bytes / GIB:.2f}" == "102.37"
    assert make_plan(scout, quantization="int4", **inputs).fits
    # a length no size up to 64 holds (Scout's 40 heads split over 2, 4, 8 only), in no format
    assert make_plan(scout, max_model_len=10**9, **inputs).reason.endswith(
        "no tensor-parallel size up to 64 fits (bfloat16)")
    # weights that fit, but with the runtime and the step reserve leave nothing: said so, and TP 2 again
    tight = make_plan(scout, gpu_memory_bytes=int(201 * GIB), gpu_memory_utilization=1.0)
    assert tight.memory.weights_bytes < 201 * GIB and tight.kv_memory_bytes == 0
    assert "+ step reserve" in tight.reason and "fits is 2 (bfloat16); with --quantization fp8" in tight.reason


def test_a_quantized_plan_that_does_not_fit_names_only_formats_that_need_fewer_ranks(scout):
    """int4 on one 39.8 GiB GPU: its 54.62 GiB of weights need TP 2; fp8 needs more ranks, so it is not named."""
    plan = make_plan(scout, gpu_memory_bytes=int(39.8 * GIB), quantization="int4")
    assert plan.reason.startswith("the weights alone (54.62 GiB per rank at tensor-parallel size 1, int4) exceed")
    assert plan.reason.endswith("; the smallest tensor-parallel size that fits is 2 (int4)")
    assert make_plan(scout, gpu_memory_bytes=int(39.8 * GIB), quantization="int4", tensor_parallel_size=2).fits


def test_the_smallest_tensor_parallel_size_is_planned_with_its_own_collectives_scratch(scout):
    """The search asks the collectives' scratch at each size it tries: one that takes the whole GPU at TP 2 (and
    none elsewhere) moves the answer from 2 to 4."""
    gpu = int(139.8 * GIB)
    budget = int(gpu * 0.9)
    plan = make_plan(scout, gpu_memory_bytes=gpu, collective_bytes=lambda tp: budget if tp == 2 else 0)
    plain = make_plan(scout, gpu_memory_bytes=gpu)
    assert plan.memory.activation_reserve_bytes == plain.memory.activation_reserve_bytes  # TP 1's: 0 scratch
    assert "the smallest tensor-parallel size that fits is 2 (bfloat16)" in plain.reason
    assert "the smallest tensor-parallel size that fits is 4 (bfloat16)" in plan.reason


def test_a_pool_too_small_for_one_token_says_so_without_a_length_asked(scout):
    plan = scout_plan(scout, kv_memory_bytes=4096)
    assert plan.usable_blocks == 0 and plan.max_model_len == 0 and not plan.fits
    assert plan.reason == "no request fits: 0.00 GiB holds 0 usable blocks of 98,304 B, and one token needs 4"


# ---- quantized weights ----------------------------------------------------------------------------------------
def small_llama(**overrides) -> dict:
    """Two layers, hidden 256, 4 heads of 64 (2 KV heads), MLP 512: shapes small enough to count by hand."""
    cfg = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 512,
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    return cfg | overrides


def compressed_tensors_w4a16(group_size: int, symmetric: bool, ignore: list[str]) -> dict:
    """A quantization_config as compressed-tensors 0.20 writes it (``QuantizationConfig.model_dump()``)."""
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "group_size": group_size, "strategy": "group",
               "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ignore,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None}}}


# Per layer and rank, [rows, cols] slices: TP 1: q, o [256, 256]; k, v [128, 256]; gate, up [512, 256]; down
# [256, 512]. TP 2: q [128, 256]; k, v [64, 256]; o [256, 128]; gate, up [256, 256]; down [256, 256].
# FP8: 1 B a weight + a float32 scale per output row. INT4 group 128: 1/2 B a weight + a bf16 scale per 128 inputs
# of a row. AWQ: INT4 + an int8 zero point per scale (unpacked in memory).
SMALL_LINEARS = {  # (format, tp): (attention, mlp) bytes of one layer, counted by hand
    ("fp8", 1): (2 * (65_536 + 1_024) + 2 * (32_768 + 512), 2 * (131_072 + 2_048) + (131_072 + 1_024)),
    ("fp8", 2): ((32_768 + 512) + 2 * (16_384 + 256) + (32_768 + 1_024), 3 * (65_536 + 1_024)),
    ("int4", 1): (2 * (32_768 + 1_024) + 2 * (16_384 + 512), 3 * (65_536 + 2_048)),
    ("int4", 2): ((16_384 + 512) + 2 * (8_192 + 256) + (16_384 + 512), 3 * (32_768 + 1_024)),
    ("awq", 1): (2 * (32_768 + 1_024 + 512) + 2 * (16_384 + 512 + 256), 3 * (65_536 + 2_048 + 1_024)),
    ("awq", 2): ((16_384 + 512 + 256) + 2 * (8_192 + 256 + 128) + (16_384 + 512 + 256), 3 * (32_768 + 1_024 + 512)),
}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


@pytest.mark.parametrize("name, tp", list(SMALL_LINEARS))
def test_quantized_weights_are_counted_exactly_per_rank(name, tp):
    cfg = small_llama(quantization_config=AWQ) if name == "awq" else small_llama()
    fmt = weight_format(cfg, name)
    weights = estimate_weights(cfg, tp, fmt)
    attention, mlp = SMALL_LINEARS[(name, tp)]
    assert weights["attention"] == 2 * attention and weights["mlp"] == 2 * mlp and weights["moe"] == 0
    # embeddings and LM head (vocab-parallel) and norms stay bf16 whatever the format
    assert weights["embedding"] == weights["lm_head"] == 1000 * 256 // tp * 2
    assert weights["norms"] == 5 * 256 * 2
    assert estimate_weights(cfg, tp, UNQUANTIZED)["attention"] == 2 * (2 * 256 * 256 + 2 * 128 * 256) * 2 // tp


def test_awq_group_minus_one_is_a_scale_per_output_row():
    """AWQ's q_group_size -1 is channel-wise: one bf16 scale and one int8 zero point per output row."""
    cfg = small_llama(quantization_config=AWQ | {"group_size": -1})
    mlp = estimate_weights(cfg, 1, weight_format(cfg, "auto"))["mlp"]
    assert mlp == 2 * (2 * (65_536 + 512 * 2 + 512) + (65_536 + 256 * 2 + 256))


def test_expert_weights_are_counted_per_expert_on_the_rank_slice(scout):
    """Scout at TP 2, int4 group 128: per layer 17 experts (16 routed, 1 shared) of two [4096, 5120] weights and
    one [5120, 4096], each 1/2 B a weight + a bf16 scale per 128 inputs; the routers [16, 5120] stay bf16."""
    per_weight = 4096 * 5120 // 2 + 4096 * 40 * 2  # == 5120 * 4096 // 2 + 5120 * 32 * 2
    weights = estimate_weights(scout, 2, INT4)
    assert weights["moe"] == 48 * (17 * 3 * per_weight + 16 * 5120 * 2)
    assert sum(weights.values()) / GIB == pytest.approx(27.31, abs=0.01)


def test_a_group_that_does_not_divide_a_rank_slice_names_layer_columns_group_and_tp():
    # TP 4: o_proj keeps 1 of 4 heads, 64 input columns, and a 128-column group does not divide them
    with pytest.raises(ValueError) as error:
        estimate_weights(small_llama(), 4, INT4)
    message = str(error.value)
    assert message.startswith("model.layers.0.self_attn.o_proj:")
    assert "tensor-parallel size 4" in message and "64 input columns" in message and "group 128" in message
    # a checkpoint's own group cannot change (quantized at load, INT4 takes a group that fits: 64)
    with pytest.raises(ValueError, match="o_proj: its slice at tensor-parallel size 4"):
        make_plan(small_llama(quantization_config=compressed_tensors_w4a16(128, True, ["lm_head"])),
                  tensor_parallel_size=4,
                  gpu_memory_bytes=GIB)


def test_a_compressed_tensors_checkpoint_is_counted_in_its_own_format_with_auto():
    """quantization_config read with --quantization auto: INT4 group 64 with zero points, self_attn left bf16 by
    its ignore list; the plan says which format it counted."""
    qc = compressed_tensors_w4a16(64, symmetric=False, ignore=["lm_head", "re:.*self_attn.*"])
    cfg = small_llama(quantization_config=qc)
    plan = make_plan(cfg, gpu_memory_bytes=4 * GIB)
    m = plan.memory
    assert (m.weights_format, m.weights_format_detail) == (
        "int4", "int4 (group 64, zero points, W4A16, compressed-tensors checkpoint)")
    weights = m.weights_breakdown
    assert weights["attention"] == estimate_weights(small_llama(), 1)["attention"]  # ignored: bf16
    # gate, up [512, 256] and down [256, 512]: 1/2 B a weight, a bf16 scale and an int8 zero point per 64 inputs
    assert weights["mlp"] == 2 * 3 * (65_536 + 2_048 * 2 + 2_048)
    assert m.weights_bytes == sum(weights.values())
    assert any("int4 (group 64, zero points, W4A16, compressed-tensors checkpoint)" in n for n in plan.notes)
    assert not any("assumes unquantized" in n for n in plan.notes)
    assert make_plan(cfg, gpu_memory_bytes=4 * GIB, quantization="compressed-tensors").memory == m
    assert make_plan(cfg, gpu_memory_bytes=4 * GIB, quantization="none").memory.weights_format == "bfloat16"


@pytest.mark.parametrize("quantization, match", [
    ("awq", "quantization awq needs a checkpoint in that format"),
    ("compressed-tensors", "quantization compressed-tensors needs a checkpoint in that format"),
    ("gptq", "unknown quantization 'gptq'"),
])
def test_a_quantization_the_checkpoint_cannot_take_is_bad_input(quantization, match):
    for memory in ({"kv_memory_bytes": GIB}, {"gpu_memory_bytes": 4 * GIB}):
        with pytest.raises(ValueError, match=match):
            make_plan(small_llama(), quantization=quantization, **memory)


def test_int4_at_load_takes_the_widest_group_that_divides_every_rank_slice():
    from hybridkv.kv.planner import fitted_format

    assert fitted_format(small_llama(), "int4").group_size == 128
    # TP 4: o_proj keeps 64 input columns; SmolLM2-135M's hidden size 576 = 9 x 64
    assert fitted_format(small_llama(), "int4", 4).group_size == 64
    assert fitted_format(small_llama(hidden_size=576, head_dim=144, intermediate_size=1536), "int4").group_size == 64
    assert fitted_format(small_llama(), "fp8", 4) == weight_format(small_llama(), "fp8")  # only INT4 at load
    with pytest.raises(ValueError, match=r"no group of 128, 64, 32 inputs divides .* size 1 \(48, "):
        fitted_format(small_llama(hidden_size=48, head_dim=12), "int4")
