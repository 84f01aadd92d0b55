"""The CUDA-graph decode path's metadata (``TritonPagedAttention.begin_static_decode``), built on the CPU beside a
running engine: after every decode step (new blocks, chunks dropped, prefix hits, preemption, finished sequences
leaving their rows to others) the static buffers hold exactly what a rebuild from scratch gives, though only the
tables whose version changed were written."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import random_prompts

from hybridkv.engine.llm_engine import EngineConfig, LLMEngine
from hybridkv.engine.model_runner import StepInput
from hybridkv.engine.sampling_params import SamplingParams

pytest.importorskip("triton")
from hybridkv.model.attention.static_decode import StaticDecode  # noqa: E402
from hybridkv.model.attention.triton_paged import TritonPagedAttention  # noqa: E402

MAX_SEQS = 4


def expected_rows(backend, seqs, padded, token_ids):
    """The metadata rows of a decode step, built from scratch (the last one: the step's token ids)."""
    bs, groups = backend.block_size, backend.layout.groups
    rows = np.zeros((6 + 2 * len(groups), MAX_SEQS), dtype=np.int32)
    rows[-1, : len(seqs)] = token_ids
    rows[0, :padded] = rows[2, :padded] = np.arange(padded)
    rows[3, : len(seqs)] = 1
    for i, s in enumerate(seqs):
        rows[4, i] = s.context_len
        for g, group in enumerate(groups):
            rows[5 + 2 * g, i] = s.block_tables[group.group_id][s.context_len // bs]
            rows[6 + 2 * g, i] = s.context_len % bs
    return rows


def step_positions(seqs) -> list[int]:
    return StepInput(np.zeros(len(seqs), dtype=np.int64), seqs, np.zeros(0, dtype=np.int64)).positions().tolist()


def check_static(backend, seqs, padded, token_ids):
    st = backend.builder.static
    assert np.array_equal(st.rows.numpy()[:, :padded], expected_rows(backend, seqs, padded, token_ids)[:, :padded])
    ids, positions = backend.static_inputs()  # what a captured forward reads
    assert ids[: len(seqs)].tolist() == list(token_ids)
    assert positions[: len(seqs)].tolist() == step_positions(seqs)
    for g, group in enumerate(backend.layout.groups):
        for i, s in enumerate(seqs):
            table = s.block_tables[group.group_id]
            row = st.tables[g][i].numpy()
            assert np.array_equal(row[: len(table)], table) and not row[len(table):].any()
        meta = backend.step_state.groups[g]
        assert meta.table.data_ptr() == st.tables[g].data_ptr() and meta.table.shape[0] == padded
    assert backend.step_state.num_tiles == padded


def test_static_decode_buffers_match_a_rebuild_through_preemption_hits_and_finishes(tiny_model, monkeypatch):
    model = tiny_model("llama4")  # full and chunked (8-token chunks) layer groups
    probe = LLMEngine(EngineConfig(model=str(model.path), block_size=4, kv_cache_memory_bytes=1 << 20))
    page = probe.layout.page_bytes
    engine = LLMEngine(EngineConfig(model=str(model.path), block_size=4, max_num_seqs=MAX_SEQS,
                                    max_num_batched_tokens=16, kv_cache_memory_bytes=40 * page))
    backend = TritonPagedAttention(engine.layout, 2, "float32", engine.model.cfg.num_heads, device="cpu")
    backend.enable_static_decode(MAX_SEQS, engine.max_model_len)
    prepare, checked, writes = engine.runner.prepare, [], []
    write_tables = StaticDecode.write_tables

    def counting_write(st, g, rows, tables):
        writes.extend((g, row) for row in rows)
        write_tables(st, g, rows, tables)

    monkeypatch.setattr(StaticDecode, "write_tables", counting_write)

    def prepare_and_check(out):
        step = prepare(out)
        if step.seqs and all(s.query_len == 1 for s in step.seqs):
            padded = 1 << (len(step.seqs) - 1).bit_length()
            backend.begin_static_decode(step.seqs, padded, step.input_ids)
            check_static(backend, step.seqs, padded, step.input_ids)
            checked.append(len(step.seqs))
        return step

    engine.runner.prepare = prepare_and_check
    shared = random_prompts([12], seed=5)[0]
    prompts = [shared + p for p in random_prompts([3, 9, 14, 6, 11, 2], seed=6)]
    for wave in range(2):  # the second wave's prompts hit the first's cached prefix
        for i, p in enumerate(prompts):
            engine.add_request(f"{wave}-{i}", p, SamplingParams(temperature=0, max_tokens=8 + 5 * i,
                                                                ignore_eos=True, n=1 + i % 2))
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.scheduler.num_preemptions > 0 and engine.kv.stats.hit_tokens > 0
    assert len(checked) > 50 and len(set(checked)) >= 3
    # only changed tables were written: far fewer rows than a rebuild of every row at every step
    assert 0 < len(writes) < sum(checked) * len(engine.layout.groups) / 2
