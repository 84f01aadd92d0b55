"""The fused decode MoE kernels against the per-expert eager reference (``MoE._routed_by_expert``'s arithmetic).

Float32 weights run IEEE dots: equal to rounding. bf16: the kernels sum K in another order and round the gated
input, the projections and ``silu(gate) * up`` where eager torch does, so they agree to bf16 rounding
(relative error ~1e-2 of the output's norm at most)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not (torch.cuda.is_available() or INTERPRET):
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")

from hybridkv.kernels.fused_moe import MAX_PAIRS, fused_moe, fused_moe_counters, route  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"


def reference(x, gates, ids, gate_up, down, shared=None):
    """float64 per (token, choice): the expert's MLP on the gated input, summed over choices; plus the shared
    expert's MLP (nn.Linear weights: gate/up [2I, H], down [H, I]) on the ungated input."""
    x, gates, gate_up, down = (t.double() for t in (x, gates, gate_up, down))
    out = torch.zeros_like(x)
    if shared is not None:
        g, u = (x @ shared[0].double().T).chunk(2, dim=-1)
        out += (F.silu(g) * u) @ shared[1].double().T
    for t in range(x.shape[0]):
        for c in range(ids.shape[1]):
            e = int(ids[t, c])
            g, u = ((x[t] * gates[t, c]) @ gate_up[e]).chunk(2, dim=-1)
            out[t] += (F.silu(g) * u) @ down[e]
    return out


def relative_error(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts,top_k,tokens,hidden,inter,with_shared", [
    (16, 1, 1, 320, 96, False),    # batch 1: one expert busy, K split over several programs
    (16, 1, 1, 320, 96, True),     # ... and the shared expert as one more
    (16, 1, 7, 200, 64, True),     # K and I not multiples of the tiles
    (4, 2, 5, 256, 160, False),    # top-2: two rows per token, summed
    (4, 2, 5, 256, 160, True),
    (16, 1, 32, 256, 128, True),   # every expert likely busy, one split; MAX_PAIRS rows with the shared ones
    (8, 2, 32, 128, 64, False),    # MAX_PAIRS (token, choice) rows
])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_matches_reference(dtype, experts, top_k, tokens, hidden, inter, with_shared, splits):
    """``splits``: the gate/up kernel's K-splits (None: its own choice); with several, the last split of a tile
    sums them and applies SiLU. The down kernel's last program of a column tile adds each token's rows."""
    if INTERPRET and dtype == torch.bfloat16:
        pytest.skip("Triton 3.6's interpreter gets bf16 dots wrong (any tl.dot of two bf16 tiles)")
    torch.manual_seed(experts * 100 + tokens)
    x = torch.randn(tokens, hidden).to(dtype)
    logits = torch.randn(tokens, experts)
    top, ids = torch.topk(logits, top_k, dim=-1)
    gates = torch.sigmoid(top).to(dtype)
    gate_up = (torch.randn(experts, hidden, 2 * inter) / hidden**0.5).to(dtype)
    down = (torch.randn(experts, inter, hidden) / inter**0.5).to(dtype)
    shared = None
    if with_shared:
        shared = ((torch.randn(2 * inter, hidden) / hidden**0.5).to(dtype),
                  (torch.randn(hidden, inter) / inter**0.5).to(dtype))
    on_device = [t.to(DEVICE) for t in (x, gates, ids, gate_up, down)]
    arrived = fused_moe_counters(experts, inter, hidden, DEVICE)
    shared_on = tuple(w.to(DEVICE) for w in shared) if shared else None
    got = fused_moe(*on_device, arrived, shared=shared_on, splits=splits)
    assert not arrived.any()  # left as found: the next launch's counters start at zero
    assert got.shape == x.shape and got.dtype == dtype and torch.isfinite(got).all()
    err = relative_error(got.cpu(), reference(x, gates, ids, gate_up, down, shared))
    assert err < (1e-5 if dtype == torch.float32 else 1.5e-2), err
    # the splits are summed in split order whichever program finishes last: the same bits every time
    assert torch.equal(fused_moe(*on_device, arrived, shared=shared_on, splits=splits), got)


def test_unrouted_expert_weights_are_not_read():
    """A NaN-poisoned expert nobody picked leaves the output finite: its programs return before any load."""
    torch.manual_seed(1)
    experts, hidden, inter = 4, 128, 64
    x = torch.randn(3, hidden)
    ids = torch.tensor([[0], [2], [0]])
    gates = torch.full((3, 1), 0.5)
    gate_up = torch.randn(experts, hidden, 2 * inter) / hidden**0.5
    down = torch.randn(experts, inter, hidden) / inter**0.5
    gate_up[1], down[1], gate_up[3], down[3] = float("nan"), float("nan"), float("nan"), float("nan")
    arrived = fused_moe_counters(experts, inter, hidden, DEVICE)
    got = fused_moe(*(t.to(DEVICE) for t in (x, gates, ids, gate_up, down)), arrived).cpu()
    assert relative_error(got, reference(x, gates, ids, gate_up, down)) < 1e-5


@pytest.mark.parametrize("with_shared", [False, True])
def test_slots_take_the_picked_experts_in_order(with_shared):
    """Top-2 of 3 tokens picking experts 2, 5 and 9 (repeats included): 6 grid slots, the first three take experts
    2, 5, 9 and the rest return; every other expert is NaN-poisoned, so a slot that read one would show."""
    torch.manual_seed(2)
    experts, hidden, inter = 16, 128, 64
    x = torch.randn(3, hidden)
    ids = torch.tensor([[5, 2], [5, 9], [2, 5]])
    gates = torch.rand(3, 2)
    gate_up = torch.randn(experts, hidden, 2 * inter) / hidden**0.5
    down = torch.randn(experts, inter, hidden) / inter**0.5
    for e in set(range(experts)) - {2, 5, 9}:
        gate_up[e], down[e] = float("nan"), float("nan")
    shared = (torch.randn(2 * inter, hidden) / hidden**0.5, torch.randn(hidden, inter) / inter**0.5)
    shared = shared if with_shared else None
    arrived = fused_moe_counters(experts, inter, hidden, DEVICE)
    got = fused_moe(*(t.to(DEVICE) for t in (x, gates, ids, gate_up, down)), arrived,
                    shared=tuple(w.to(DEVICE) for w in shared) if shared else None).cpu()
    assert not arrived.any()
    assert relative_error(got, reference(x, gates, ids, gate_up, down, shared)) < 1e-5


def test_too_many_pairs_is_refused():
    x = torch.zeros(MAX_PAIRS + 1, 16, device=DEVICE)
    ids = torch.zeros(MAX_PAIRS + 1, 1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match=f"at most {MAX_PAIRS}"):
        fused_moe(x, x[:, :1], ids, torch.zeros(1, 16, 32, device=DEVICE), torch.zeros(1, 16, 16, device=DEVICE),
                  fused_moe_counters(1, 16, 16, DEVICE))


def test_too_few_counters_is_refused():
    x = torch.zeros(1, 16, device=DEVICE)
    ids = torch.zeros(1, 1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="arrival counters"):
        fused_moe(x, x[:, :1], ids, torch.zeros(1, 16, 32, device=DEVICE), torch.zeros(1, 16, 16, device=DEVICE),
                  torch.zeros(MAX_PAIRS, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts,top_k,tokens,hidden", [
    (16, 1, 1, 300), (16, 1, 33, 300), (5, 2, 7, 300), (128, 4, 3, 300), (40, 2, 2, 300),
    (16, 1, 2, 9000),  # rows longer than one tile: the K loop after the wait
])
def test_route_matches_topk_of_the_router(dtype, experts, top_k, tokens, hidden):
    """Ids as torch.topk of the router's (rounded) logits, gates as sigmoid of them."""
    torch.manual_seed(experts + tokens)
    x = torch.randn(tokens, hidden).to(dtype)
    w = (torch.randn(experts, hidden) / hidden**0.5).to(dtype)
    logits = (x.double() @ w.double().T).to(dtype)
    top, want_ids = torch.topk(logits.float(), top_k, dim=-1)
    arrived = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    ids, gates = route(x.to(DEVICE), w.to(DEVICE), top_k, arrived)
    assert not arrived.any()  # left as found: the next launch's counters start at zero
    assert ids.dtype == torch.int64 and gates.dtype == dtype and ids.shape == (tokens, top_k)
    # logits one bf16 step apart may swap under another summation order: compare the picked logits, not ids
    picked = logits.float().gather(1, ids.cpu())
    torch.testing.assert_close(picked, top, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)
    if dtype == torch.float32:
        assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(gates.cpu().float(), torch.sigmoid(picked), rtol=1e-2, atol=1e-3)


@pytest.mark.skipif(INTERPRET, reason="programmatic dependent launch needs a GPU")
@pytest.mark.parametrize("tokens", [1, 3])
def test_layers_chained_in_a_graph_match_launches_one_at_a_time(tokens):
    """A Scout-like MoE block repeated in a CUDA graph, launched programmatically dependent: norm, router, gate/up
    (its shared-expert programs read x before waiting for the router), down (the last program of a column tile
    adds the rows), the next norm adding the output to the residual. Bit for bit what the same launches give one
    at a time, with the arrival counters back at zero."""
    from hybridkv.kernels.launch import pdl
    from hybridkv.kernels.rms_norm import rms_norm

    torch.manual_seed(5)
    experts, hidden, inter, layers = 16, 1024, 256, 12
    dt = torch.bfloat16
    router = (torch.randn(experts, hidden, device="cuda") / hidden**0.5).to(dt)
    gate_up = (torch.randn(experts, hidden, 2 * inter, device="cuda") / hidden**0.5).to(dt)
    down = (torch.randn(experts, inter, hidden, device="cuda") / inter**0.5).to(dt)
    shared = ((torch.randn(2 * inter, hidden, device="cuda") / hidden**0.5).to(dt),
              (torch.randn(hidden, inter, device="cuda") / inter**0.5).to(dt))
    arrived = fused_moe_counters(experts, inter, hidden, "cuda")
    x0, r0 = (torch.randn(tokens, hidden, device="cuda", dtype=dt) for _ in range(2))
    assert pdl(x0)

    def block(x, residual):
        h = rms_norm(x, 1e-5, residual=residual)
        ids, gates = route(h, router, 1, arrived)
        return fused_moe(h, gates, ids, gate_up, down, arrived, shared=shared, splits=4)

    want, want_r = x0.clone(), r0.clone()
    for _ in range(layers):  # compiles the kernels too, before the graph captures them
        want = block(want, want_r)
        torch.cuda.synchronize()
    static_x, static_r = x0.clone(), r0.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = static_x
        for _ in range(layers):
            out = block(out, static_r)
    for _ in range(3):
        static_x.copy_(x0)
        static_r.copy_(r0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want) and torch.equal(static_r, want_r)
    assert not arrived.any()
    assert torch.isfinite(want).all() and not torch.equal(want_r, r0)
