"""Which key tiles a decode step's layer groups read (``KernelConfigs.decode_tiles``): 64-key tiles
(``DECODE_FEW``) for steps of 1-2 sequences whose reach, summed over sequences and KV heads, is at most
``FEW_KEYS``; 128-key tiles (``DECODE``) otherwise. The CUDA-graph path captures a second graph for the long
case of 1-2 rows, and every rank picks the same one from the step. Metadata only: no kernel runs, no GPU."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.kv import plan_layout
from hybridkv.kv.specs import ChunkedLocalSpec, FullAttentionSpec
from hybridkv.model.attention.base import StepSequence

pytest.importorskip("triton")
from hybridkv.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from hybridkv.model.attention import kernel_configs  # noqa: E402
from hybridkv.model.attention.kernel_configs import DECODE, DECODE_FEW, KernelOptions  # noqa: E402
from hybridkv.model.attention.triton_paged import TritonPagedAttention  # noqa: E402

BLOCK = 16
CHUNK = 16  # the chunked group reaches at most 16 + 64 keys


@pytest.fixture
def backend(monkeypatch):
    # a small FEW_KEYS so that short contexts cross it: 2 KV heads x 200 keys (the chunked group: at most
    # 2 sequences x 80 keys x 2 heads = 320)
    monkeypatch.setattr(kernel_configs, "FEW_KEYS", 400)
    specs = [FullAttentionSpec(2, 64, "float32"), ChunkedLocalSpec(2, 64, "float32", chunk=CHUNK)]
    tri = TritonPagedAttention(plan_layout(specs, BLOCK), 64, "float32", 10, device="cpu", num_sms=8)
    tri.enable_static_decode(4, 512)
    return tri


def decode_seqs(contexts: list[int]) -> list[StepSequence]:
    width = -(-(max(contexts) + 1) // BLOCK)
    tables = [np.arange(1, width + 1, dtype=np.int32)] * 2
    return [StepSequence(c, 1, tables) for c in contexts]


def group_configs(tri) -> list:
    """Each layer group's tiles: the full group first, then the chunked one."""
    full = next(i for i, g in enumerate(tri.layout.groups) if not g.spec.reach)
    configs = [meta.config for meta in tri.step_state.groups]
    return [configs[full], configs[1 - full]]


@pytest.mark.parametrize(("contexts", "full"), [
    ([199], DECODE_FEW),  # 200 keys (the context and the new token) x 2 heads = 400: not over
    ([200], DECODE),  # 201 x 2 = 402
    ([100, 98], DECODE_FEW),  # (101 + 99) x 2 = 400
    ([100, 99], DECODE),  # (101 + 100) x 2 = 402
    ([3, 3, 3], DECODE),  # three sequences: 128-key tiles whatever their reach
])
def test_eager_steps_pick_tiles_by_the_group_reach(backend, contexts, full):
    backend.begin_step(decode_seqs(contexts))
    few = len(contexts) <= 2
    # the chunked group's reach stays short: its tiles follow the batch size alone
    assert group_configs(backend) == [full, DECODE_FEW if few else DECODE]
    assert backend.many_keys(decode_seqs(contexts)) == (few and full is DECODE)


def test_a_long_graph_reads_128_key_tiles_in_its_long_groups_only(backend):
    assert backend.static_variants(1) == [False, True]
    assert backend.static_variants(2) == [False, True]
    assert backend.static_variants(4) == [False]  # 128-key tiles in every group already
    backend.begin_static_decode([], 1, many=False)
    assert group_configs(backend) == [DECODE_FEW, DECODE_FEW]
    short_splits = [meta.num_splits for meta in backend.step_state.groups]
    backend.begin_static_decode([], 1, many=True)
    assert group_configs(backend) == [DECODE, DECODE_FEW]
    # the split count follows the tiles: fewer, longer splits of 128 keys over the full group's 512 keys
    long_splits = [meta.num_splits for meta in backend.step_state.groups]
    assert long_splits != short_splits
    # each graph's state is built once and kept: a replay reads what its capture did
    state = backend.step_state
    backend.begin_static_decode([], 1, many=False)
    backend.begin_static_decode([], 1, many=True)
    assert backend.step_state is state
    backend.begin_static_decode([], 4)
    assert group_configs(backend) == [DECODE, DECODE]


def test_a_graph_is_picked_by_the_step_alone(backend):
    graphs = DecodeGraphs.__new__(DecodeGraphs)  # its choice alone: no GPU here
    graphs.backend, graphs.buckets, graphs.max_seqs = backend, [1, 2, 4], 4
    graphs.graphs = {(size, many): None for size in graphs.buckets for many in backend.static_variants(size)}

    def key(contexts):
        seqs = decode_seqs(contexts)
        return graphs.bucket(seqs, np.arange(len(seqs)))

    assert key([50]) == (1, False)
    assert key([250]) == (1, True)
    assert key([110, 110]) == (2, True)
    assert key([20, 20]) == (2, False)
    assert key([250, 250, 250]) == (4, False)  # one graph for 4 rows
    assert graphs.bucket(decode_seqs([5, 6]), np.arange(1)) is None  # not every row samples: eager


def test_one_decode_config_for_every_step_keeps_one_graph_a_size(monkeypatch):
    monkeypatch.setattr(kernel_configs, "FEW_KEYS", 400)
    specs = [FullAttentionSpec(2, 64, "float32")]
    tri = TritonPagedAttention(plan_layout(specs, BLOCK), 64, "float32", 10, device="cpu", num_sms=8,
                               options=KernelOptions(decode=DECODE_FEW))
    tri.enable_static_decode(4, 512)
    assert tri.static_variants(1) == [False]
    assert not tri.many_keys(decode_seqs([400]))
