"""``StepInput``: what the runner hands each rank for one step."""

import numpy as np

from hybridkv.engine.model_runner import StepInput
from hybridkv.model.attention.base import StepSequence


def test_positions_run_from_each_sequences_context():
    # a prefill chunk, a first token, a sequence with nothing this step, two decode-like tokens
    seqs = [StepSequence(5, 3, []), StepSequence(0, 1, []), StepSequence(100, 0, []), StepSequence(7, 2, [])]
    step = StepInput(np.zeros(6, dtype=np.int64), seqs, np.zeros(0, dtype=np.int64))
    positions = step.positions()
    assert positions.tolist() == [5, 6, 7, 0, 7, 8] and positions.dtype == np.int64


def test_split_step_continues_a_sequence_the_cut_crosses():
    from hybridkv.model.attention.base import split_step

    tables = [np.array([3, 4, 5])]
    seqs = [StepSequence(0, 10, tables, 7), StepSequence(5, 6, [], 9)]
    first, second = split_step(seqs, 8)
    assert [(s.context_len, s.query_len) for s in first] == [(0, 8)]
    assert [(s.context_len, s.query_len) for s in second] == [(8, 2), (5, 6)]
    assert second[0].block_tables is tables and second[0].tables_version == 7  # the same sequence's tables
    # a cut between sequences leaves each whole; every token row is in exactly one half, in order
    first, second = split_step(seqs, 10)
    assert [(s.context_len, s.query_len) for s in first] == [(0, 10)]
    assert [(s.context_len, s.query_len) for s in second] == [(5, 6)]
    halves = StepInput(np.zeros(8), first, np.zeros(0)).positions().tolist() + \
        StepInput(np.zeros(8), second, np.zeros(0)).positions().tolist()
    assert halves == StepInput(np.zeros(16), seqs, np.zeros(0)).positions().tolist()
