"""The CPU's default KV budget: room for ``CPU_DEFAULT_REQUESTS`` requests of max_model_len, within a floor and a cap
(``capacity.cpu_default_kv_bytes``); and the engine sizing its cache by it when no budget is given."""

from hybridkv.kv import FullAttentionSpec, plan_layout
from hybridkv.kv.capacity import CPU_KV_CAP_BYTES, CPU_KV_FLOOR_BYTES, cpu_default_kv_bytes

# SmolLM2-135M's float32 cache: 30 layers of 3 KV heads x 64, block 16 -> 737,280 B a page
SMOLLM2 = plan_layout([FullAttentionSpec(3, 64, "float32")] * 30, 16)


def test_smollm2_context_sizes_two_requests():
    assert SMOLLM2.page_bytes == 737_280
    # 8,192 tokens: 512 blocks a request, 2 requests and the null block
    assert cpu_default_kv_bytes(SMOLLM2, 8192, 512) == (2 * 512 + 1) * 737_280 == 755_712_000


def test_shorter_max_model_len_gives_a_smaller_budget():
    assert cpu_default_kv_bytes(SMOLLM2, 2048, 512) == (2 * 128 + 1) * 737_280


def test_floor_and_cap():
    assert cpu_default_kv_bytes(SMOLLM2, 16, 512) == CPU_KV_FLOOR_BYTES == 64 << 20
    assert cpu_default_kv_bytes(SMOLLM2, 131_072, 512) == CPU_KV_CAP_BYTES == 2 << 30
