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


def test_a_steps_decoding_sequences_and_its_others_are_two_steps_of_their_rows():
    """``ModelRunner._forward_apart``'s parts: a prompt chunk (3 rows, its last sampled and two scored), a decoding
    sequence (1 row) and a prompt's first token (1 row, sampled)."""
    from hybridkv.engine.model_runner import _decoding, _part

    seqs = [StepSequence(5, 3, []), StepSequence(40, 1, [], generated=True), StepSequence(0, 1, [])]
    step = StepInput(np.array([10, 11, 12, 13, 14]), seqs, np.array([2, 3, 4]), score_rows=np.array([0, 1]),
                     score_token_ids=np.array([11, 12]), prompt_rows=np.array([True, True, True, False, True]))
    decoding = _decoding(step)
    assert decoding.tolist() == [False, True, False]
    ours, others = _part(step, decoding), _part(step, ~decoding)
    assert ours.input_ids.tolist() == [13] and ours.seqs == [seqs[1]] and ours.sample_rows.tolist() == [0]
    assert ours.prompt_rows.tolist() == [False] and len(ours.score_rows) == 0 and ours.positions().tolist() == [40]
    assert others.input_ids.tolist() == [10, 11, 12, 14] and others.seqs == [seqs[0], seqs[2]]
    assert others.sample_rows.tolist() == [2, 3] and others.score_rows.tolist() == [0, 1]
    assert others.score_token_ids.tolist() == [11, 12] and others.prompt_rows.tolist() == [True] * 4
    assert others.positions().tolist() == [5, 6, 7, 0]
