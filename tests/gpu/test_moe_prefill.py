"""The prefill MoE's Triton kernels (``kernels/moe_prefill.py``) against eager torch: the counting sort against a
stable argsort, the gathers, ``silu * up`` and the routed rows' sum with eager torch's rounding, and the whole
routed-expert dispatch against the per-expert loop, with no host sync. Runs on a GPU, or on the CPU under
TRITON_INTERPRET=1."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not (torch.cuda.is_available() or INTERPRET):
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")

from hybridkv.kernels.moe_prefill import (  # noqa: E402
    MAX_COUNTS, add_routed, gather_gated, silu_mul, sort_by_expert, sorts,
)
from hybridkv.model.architectures.device_ops import bind_ops  # noqa: E402
from hybridkv.model.architectures.llama import MoE  # noqa: E402
from hybridkv.model.architectures.llama_config import ModelConfig  # noqa: E402
from hybridkv.model.architectures.parallel import TPGroup  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
# the interpreter rounds float32 to bf16 its own way (an ulp apart at times); compiled kernels round as torch
EXACT_BF16 = dict(rtol=2 ** -6, atol=2 ** -4) if INTERPRET else dict(rtol=0, atol=0)


@pytest.mark.parametrize("n,experts,unused", [(2500, 16, (0, 7, 15)), (300, 128, (1, 2, 127)), (5, 6, (0, 1, 2, 3)),
                                              (1, 16, ())])
def test_the_counting_sort_is_a_stable_sort_by_expert(n, experts, unused):
    g = torch.Generator().manual_seed(n)
    allowed = torch.tensor([e for e in range(experts) if e not in unused])
    ids = allowed[torch.randint(len(allowed), (n,), generator=g)].to(DEVICE)
    ends, order, place = sort_by_expert(ids, experts)
    want = torch.argsort(ids.cpu(), stable=True)
    assert torch.equal(order.cpu(), want)
    assert torch.equal(place.cpu()[want], torch.arange(n))
    assert torch.equal(ends.cpu(), torch.searchsorted(ids.cpu()[want], torch.arange(experts), right=True).int())
    assert all(ends[e] == ends[e - 1] for e in unused if e > 0)


def test_a_sort_past_its_counts_is_refused():
    assert sorts(4 << 20, 16) and not sorts(8 << 20, 16) and not sorts(1 << 20, 128)
    with pytest.raises(ValueError, match=f"{MAX_COUNTS}"):
        sort_by_expert(torch.zeros(1 << 20, dtype=torch.int64, device=DEVICE), 128)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_gathered_gated_activated_and_added_back_round_as_eager_torch(dtype):
    g = torch.Generator().manual_seed(1)
    tokens, top_k, hidden, inter = 37, 2, 1100, 1030  # past one program's 1,024 columns
    x = torch.randn(tokens, hidden, generator=g).to(dtype).to(DEVICE)
    gates = torch.rand(tokens, top_k, generator=g).to(dtype).to(DEVICE)
    order = torch.randperm(tokens * top_k, generator=g).to(DEVICE)
    exact = dict(rtol=0, atol=0) if dtype == torch.float32 else EXACT_BF16
    torch.testing.assert_close(gather_gated(x, gates, order, top_k), x[order // top_k] * gates.reshape(-1)[order, None],
                               **exact)

    gate_up = (torch.randn(tokens, 2 * inter, generator=g) * 4).to(dtype).to(DEVICE)
    gate, up = gate_up.chunk(2, dim=-1)
    # the kernel's exponential is not libm's: an ulp of float32 apart, which can move silu's bf16 rounding and the
    # product's after it
    close = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=2 ** -6)
    torch.testing.assert_close(silu_mul(gate_up), F.silu(gate) * up, **close)

    routed = torch.randn(tokens * top_k, hidden, generator=g).to(dtype).to(DEVICE)
    place = torch.argsort(order)
    shared = torch.randn(tokens, hidden, generator=g).to(dtype).to(DEVICE)
    want = shared + routed[place].view(tokens, top_k, hidden).sum(dim=1)
    got = add_routed(shared.clone(), routed, place, top_k)
    torch.testing.assert_close(got, want, **exact)
    assert not torch.equal(got, shared)


# CUDA's grouped_mm takes bf16; the interpreter's bf16 rounding would drift through the GEMMs, so it runs float32
DTYPE = torch.float32 if INTERPRET else torch.bfloat16


def tiny_moe(top_k: int, experts: int = 6) -> MoE:
    cfg = ModelConfig.from_hf({
        "model_type": "llama4_text", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 32,
        "intermediate_size_mlp": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_local_experts": experts, "num_experts_per_tok": top_k, "interleave_moe_layer_step": 1,
    })
    torch.manual_seed(0)
    moe = MoE(cfg, DTYPE, TPGroup()).to(DEVICE)
    bind_ops(moe, DEVICE)  # the forward's dispatch for the device, as ``CausalLM.place`` binds it
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch without grouped_mm")
@pytest.mark.parametrize("top_k", [1, 2])
def test_the_routed_dispatch_matches_the_per_expert_loop_without_a_host_sync(top_k):
    """Experts nobody picks, first and last, leave empty groups. A sync would leave the GPU idle at every layer
    while the host launched the rest (``bincount``'s was one); the torch dispatch, CUDA's past the counting sort's
    size, takes none either."""
    moe = tiny_moe(top_k)
    x = torch.randn(1000, 64, device=DEVICE, dtype=DTYPE)
    logits = moe.router(x)
    logits[:, [0, 5]] = -1e9
    top_logits, top_ids = torch.topk(logits, top_k, dim=-1)
    gates = torch.sigmoid(top_logits.float()).to(x.dtype)
    shared = moe.shared_expert(x)
    want = shared + moe._routed_by_expert(x, top_ids, gates)
    # the first calls compile and may load libraries
    moe._routed_by_kernels(x, top_ids, gates).added_to(shared.clone()), moe._routed_by_grouped_mm(x, top_ids, gates)
    if not INTERPRET:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        got = moe._routed_by_kernels(x, top_ids, gates).added_to(shared.clone())
        by_torch = shared + moe._routed_by_grouped_mm(x, top_ids, gates)
    finally:
        if not INTERPRET:
            torch.cuda.set_sync_debug_mode("default")
    assert set(top_ids.unique().tolist()) == {1, 2, 3, 4}
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    # the same GEMMs as the torch dispatch, so the same bits but where silu rounds apart
    torch.testing.assert_close(got, by_torch, rtol=2 ** -7, atol=2 ** -5)
    if not INTERPRET:  # the forward takes this dispatch for more than decode's 64 pairs
        top_logits, top_ids = torch.topk(moe.router(x), top_k, dim=-1)
        gates = torch.sigmoid(top_logits.float()).to(x.dtype)
        assert torch.equal(moe(x), moe._routed_by_kernels(x, top_ids, gates).added_to(moe.shared_expert(x)))


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch without grouped_mm")
@pytest.mark.parametrize("top_k", [1, 2])
def test_routed_rows_added_in_ranges_are_the_whole_steps_bits(top_k):
    """The prefill halves dispatch the routed experts once over the whole step, then add each half's rows to its
    shared-expert output (``LlamaForCausalLM._moe_in_halves``): row for row the bits of adding them all at once."""
    moe = tiny_moe(top_k)
    x = torch.randn(1000, 64, device=DEVICE, dtype=DTYPE)
    top_logits, top_ids = torch.topk(moe.router(x), top_k, dim=-1)
    routed = moe._routed_by_kernels(x, top_ids, torch.sigmoid(top_logits.float()).to(x.dtype))
    shared = moe.shared_expert(x)
    whole = routed.added_to(shared.clone())
    ranges = [routed.added_to(shared[rows].clone(), rows) for rows in (slice(0, 377), slice(377, None))]
    assert torch.equal(torch.cat(ranges), whole)
    if top_k == 1:  # expert order is not token order here: rows taken by position would differ
        assert not torch.equal(whole[377:], shared[377:] + routed.out[377:])
    if not INTERPRET:  # the forward's own dispatch at this size
        assert moe.routed(x).place is not None
