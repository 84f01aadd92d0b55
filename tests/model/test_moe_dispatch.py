"""The CPU MoE dispatches (per-expert loop, grouped GEMM over expert-sorted rows) give the same output: top-2
routing, an expert nobody picks, and a token count that is not a multiple of anything. The fused CUDA decode
kernels are checked against the same arithmetic in tests/gpu/test_fused_moe.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridkv.model.architectures.llama_config import ModelConfig
from hybridkv.model.architectures.llama import MoE
from hybridkv.model.architectures.parallel import TPGroup


def tiny_moe(num_experts: int = 4, top_k: int = 2) -> MoE:
    cfg = ModelConfig.from_hf({
        "model_type": "llama4_text", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 16,
        "intermediate_size_mlp": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "num_local_experts": num_experts, "num_experts_per_tok": top_k, "interleave_moe_layer_step": 1,
    })
    torch.manual_seed(0)
    moe = MoE(cfg, torch.float32, TPGroup())
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


def routing(moe: MoE, x: torch.Tensor, unused_expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = moe.router(x)
    logits[:, unused_expert] = -1e9
    top_logits, top_ids = torch.topk(logits, moe.top_k, dim=-1)
    return top_ids, torch.sigmoid(top_logits)


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch without grouped_mm")
def test_grouped_mm_dispatch_matches_per_expert_loop():
    moe = tiny_moe()
    x = torch.randn(37, 32)
    top_ids, gates = routing(moe, x, unused_expert=1)
    assert 1 not in top_ids.tolist() and len(top_ids.unique()) == 3
    reference = moe._routed_by_expert(x, top_ids, gates)
    grouped = moe._routed_by_grouped_mm(x, top_ids, gates)
    assert reference.abs().max() > 0.1
    torch.testing.assert_close(grouped, reference, rtol=1e-5, atol=1e-5)


def test_moe_forward_picks_a_dispatch_that_matches_the_loop():
    moe = tiny_moe(top_k=1)
    x = torch.randn(9, 32)
    top_logits, top_ids = torch.topk(moe.router(x), 1, dim=-1)
    expected = moe.shared_expert(x) + moe._routed_by_expert(x, top_ids, torch.sigmoid(top_logits))
    torch.testing.assert_close(moe(x), expected, rtol=1e-5, atol=1e-5)


def test_dims_grouped_mm_cannot_take_fall_back_to_the_loop():
    # hidden 12 in bf16 = 24-byte rows: grouped_mm wants multiples of 16 bytes
    cfg = ModelConfig.from_hf({
        "model_type": "llama4_text", "vocab_size": 64, "hidden_size": 12, "intermediate_size": 6,
        "intermediate_size_mlp": 48, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 6, "num_local_experts": 2, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
    })
    moe = MoE(cfg, torch.bfloat16, TPGroup())
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    assert not moe._grouped_mm_ok and tiny_moe()._grouped_mm_ok == hasattr(F, "grouped_mm")
    x = torch.randn(9, 12, dtype=torch.bfloat16)
    top_logits, top_ids = torch.topk(moe.router(x), 1, dim=-1)
    gates = torch.sigmoid(top_logits.float()).to(x.dtype)
    torch.testing.assert_close(moe(x), moe.shared_expert(x) + moe._routed_by_expert(x, top_ids, gates))
