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
