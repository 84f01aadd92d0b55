"""Everything type-specific lives on the spec: which keys a query sees (on numpy and torch alike), the first token
still needed, the kernel's kind and reach, construction from a HF config, and which manager keeps its blocks.

A type defined in this file alone (``NeighbourChunkSpec``) runs through the layout, the cache manager, capacity
math and retention with no other change: adding a type is a spec class (and, where needed, a manager)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest

from hybridkv.kv import CacheRequest, KVCacheManager, plan_layout
from hybridkv.kv.capacity import longest_fitting, peak_blocks
from hybridkv.kv.managers import (
    ChunkedLocalManager,
    FullAttentionManager,
    SingleTypeManager,
    SlidingWindowManager,
    default_retention_interval,
    manager_class,
)
from hybridkv.kv.specs import (
    KERNEL_CHUNKED,
    KERNEL_FULL,
    KERNEL_SLIDING,
    SPEC_TYPES,
    AttentionSpec,
    ChunkedLocalSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
    cdiv,
    max_blocks_spanned,
)

torch = pytest.importorskip("torch")


@dataclass(frozen=True, slots=True)
class NeighbourChunkSpec(AttentionSpec):
    """A made-up type: a token sees its own chunk and the one before it."""

    chunk: int = 4
    kind: ClassVar[str] = "neighbour"
    kernel_kind: ClassVar[int] = -1  # no kernel mask: the torch backend only

    @classmethod
    def from_hf_config(cls, num_kv_heads, head_dim, dtype, text_config):
        return cls(num_kv_heads, head_dim, dtype, chunk=int(text_config["neighbour_chunk"]))

    @property
    def reach(self) -> int:
        return 2 * self.chunk

    def first_needed_token(self, pos):
        return pos // self.chunk * self.chunk - self.chunk * (pos >= self.chunk)  # the previous chunk's start

    def max_live_blocks(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        span = 2 * self.chunk - 1 + max(1, max_step_tokens)
        return min(cdiv(num_tokens, block_size), max_blocks_spanned(span, block_size, aligned=False))


def literal_rule(spec: AttentionSpec, q: int, k: int) -> bool:
    """Whether query position q sees key position k, written out per type (independent of the specs' code)."""
    if k > q:
        return False
    if isinstance(spec, SlidingWindowSpec):
        return q - k < spec.window
    if isinstance(spec, ChunkedLocalSpec):
        return k // spec.chunk == q // spec.chunk
    if isinstance(spec, NeighbourChunkSpec):
        return q // spec.chunk - k // spec.chunk <= 1
    return True


SPECS = [
    FullAttentionSpec(1, 8),
    SlidingWindowSpec(1, 8, window=1),
    SlidingWindowSpec(1, 8, window=3),
    ChunkedLocalSpec(1, 8, chunk=1),
    ChunkedLocalSpec(1, 8, chunk=4),
    NeighbourChunkSpec(1, 8, chunk=3),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label)
@pytest.mark.parametrize("q_range, k_range", [((0, 20), (0, 20)), ((10, 14), (3, 14))])
def test_visible_is_the_types_rule_on_numpy_and_torch(spec, q_range, k_range):
    expected = np.array([[literal_rule(spec, q, k) for k in range(*k_range)] for q in range(*q_range)])
    on_numpy = spec.visible(np.arange(*q_range), np.arange(*k_range))
    on_torch = spec.visible(torch.arange(*q_range), torch.arange(*k_range))
    assert isinstance(on_torch, torch.Tensor) and on_torch.dtype == torch.bool
    np.testing.assert_array_equal(on_numpy, expected)
    np.testing.assert_array_equal(on_torch.numpy(), expected)


def test_the_docstring_example():
    mask = SlidingWindowSpec(1, 8, window=3).visible(np.arange(5), np.arange(5))
    assert ["".join("1" if x else "." for x in row) for row in mask] == ["1....", "11...", "111..", ".111.", "..111"]
    assert SlidingWindowSpec(1, 8, window=3).first_needed_token(np.arange(5)).tolist() == [0, 0, 0, 1, 2]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label)
def test_first_needed_token_is_the_first_key_seen_on_ints_and_arrays(spec):
    firsts = [min(k for k in range(n + 1) if literal_rule(spec, n, k)) for n in range(30)]
    assert [spec.first_needed_token(n) for n in range(30)] == firsts
    assert spec.first_needed_token(np.arange(30)).tolist() == firsts
    assert spec.first_needed_token(torch.arange(30)).tolist() == firsts
    for n in range(30):
        # no later token sees further back (what lets managers free blocks below it)
        assert all(spec.first_needed_token(m) >= spec.first_needed_token(n) for m in range(n, 40))


def test_reach_bounds_the_keys_one_query_sees():
    for spec in SPECS:
        most = max(sum(literal_rule(spec, q, k) for k in range(60)) for q in range(60))
        assert most == (spec.reach or 60)
        assert spec.keeps_every_token == (spec.reach == 0)


def test_kernel_kind_and_reach_come_from_the_spec():
    assert (KERNEL_FULL, KERNEL_SLIDING, KERNEL_CHUNKED) == (0, 1, 2)  # the numbers the kernel's masks test
    assert [(s.kernel_kind, s.reach) for s in SPECS[:5]] == [(0, 0), (1, 1), (1, 3), (2, 1), (2, 4)]


def test_registries():
    assert dict(SPEC_TYPES) == {"full": FullAttentionSpec, "sliding": SlidingWindowSpec, "chunked": ChunkedLocalSpec}
    assert manager_class(FullAttentionSpec(1, 8)) is FullAttentionManager
    assert manager_class(SlidingWindowSpec(1, 8)) is SlidingWindowManager
    assert manager_class(ChunkedLocalSpec(1, 8)) is ChunkedLocalManager
    assert manager_class(NeighbourChunkSpec(1, 8)) is SingleTypeManager  # the generic one serves any new type


def test_specs_from_a_hf_config():
    cfg = {"sliding_window": 512, "attention_chunk_size": 8192, "neighbour_chunk": 7}
    assert FullAttentionSpec.from_hf_config(2, 64, "float16", cfg) == FullAttentionSpec(2, 64, "float16")
    assert SlidingWindowSpec.from_hf_config(2, 64, "bfloat16", cfg).window == 512
    assert ChunkedLocalSpec.from_hf_config(2, 64, "fp8_e4m3", cfg) == ChunkedLocalSpec(2, 64, "fp8_e4m3", 8192)
    assert NeighbourChunkSpec.from_hf_config(1, 8, "float32", cfg).chunk == 7


def test_a_new_type_runs_through_layout_manager_and_capacity():
    full, neighbour = FullAttentionSpec(1, 8), NeighbourChunkSpec(1, 8, chunk=4)
    layout = plan_layout([full, neighbour, neighbour, full], block_size=2)
    assert [g.spec.kind for g in layout.groups] == ["full", "neighbour"]
    assert default_retention_interval(layout) == 4 * 8  # periodic retention: 4 reaches of the new type
    kv = KVCacheManager(layout, num_blocks=64, enable_prefix_caching=False, max_step_tokens=4)
    req = CacheRequest("a", list(range(40)))
    group = layout.groups[1].group_id
    for _ in range(10):
        assert kv.allocate_slots(req, 4)
        req.num_computed_tokens += 4
        kv.on_tokens_computed(req)
        n = req.num_computed_tokens
        table = kv.block_tables("a")[group]
        first = neighbour.first_needed_token(n) // 2  # the generic manager nulled every block below this
        assert (table[:first] == 0).all() and (table[first:] != 0).all()
        assert kv.managers[1].num_live_blocks("a") <= neighbour.max_live_blocks(n, 2, 4)
    # 40 tokens: the full group holds 20 blocks; the new type what token 40 sees, 36..39 (blocks 18 and 19)
    assert kv.pool.num_usable_blocks - kv.pool.num_free_blocks == 20 + 2
    assert kv.peak_blocks(40) == peak_blocks(layout, 40, 4) == 20 + neighbour.max_live_blocks(40, 2, 4)
    assert kv.max_tokens_that_fit(10_000) == longest_fitting(layout, 63, 4, 10_000)


@pytest.mark.parametrize("block_size", [1, 4])
def test_a_new_type_on_the_paged_torch_backend_matches_the_dense_oracle(block_size):
    """Chunked prefill then decode over the paged cache, the new type's blocks dropped by the generic manager."""
    from hybridkv.model.attention.dense import DenseAttention
    from hybridkv.model.attention.base import StepSequence
    from hybridkv.model.attention.torch_paged import TorchPagedAttention

    torch.manual_seed(0)
    specs = [NeighbourChunkSpec(2, 8, "float32", chunk=3), FullAttentionSpec(2, 8, "float32")]
    layout = plan_layout(specs, block_size)
    kv = KVCacheManager(layout, num_blocks=100, enable_prefix_caching=False)
    backend = TorchPagedAttention(layout, 100, "float32")
    n = 17
    q, k, v = torch.randn(n, 4, 8), torch.randn(n, 2, 8), torch.randn(n, 2, 8)
    req = CacheRequest("a", list(range(n)))
    out = torch.zeros(len(specs), n, 4, 8)
    for step in [7, 5, 1, 1, 1, 1, 1]:
        start = req.num_computed_tokens
        assert kv.allocate_slots(req, step)
        backend.begin_step([StepSequence(start, step, kv.block_tables("a"))])
        for layer in range(len(specs)):
            part = slice(start, start + step)
            out[layer, part] = backend.attend(layer, q[part], k[part], v[part], 0.5)
        req.num_computed_tokens += step
        kv.on_tokens_computed(req)
    assert kv.block_tables("a")[0][0] == 0  # the new type's early blocks really went back to the pool
    dense = DenseAttention(specs, [n])
    for layer in range(len(specs)):
        torch.testing.assert_close(out[layer], dense.attend(layer, q, k, v, 0.5), atol=1e-5, rtol=1e-5)
