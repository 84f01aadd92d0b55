"""A step's last layer computes only the rows whose hidden states are read (``OutputRows``): every row's K/V of that
layer is stored, but only the sampled rows attend and go through its MLP. The engine's output must not change."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import random_prompts

from hybridkv import LLM, SamplingParams
from hybridkv.engine.model_runner import ModelRunner
from hybridkv.model.attention.base import StepSequence, output_sequences
from hybridkv.model.attention.torch_paged import TorchPagedAttention


def test_output_sequences_are_the_sampled_rows_as_decode_queries():
    seqs = [StepSequence(0, 8, []), StepSequence(100, 1, []), StepSequence(40, 5, [])]
    as_pairs = lambda out: [(s.context_len, s.query_len) for s in out]  # noqa: E731
    assert as_pairs(output_sequences(seqs, np.array([8]))) == [(100, 1)]
    assert as_pairs(output_sequences(seqs, np.array([7, 8, 13]))) == [(7, 1), (100, 1), (44, 1)]
    assert output_sequences(seqs, np.array([], dtype=np.int64)) == []  # a mid-prompt chunk alone
    assert output_sequences(seqs, np.array([3])) is None  # not the last row of its sequence: every row is needed


@pytest.mark.parametrize("name", ["llama4", "gemma3", "llama3"])
def test_the_last_layer_attends_from_the_sampled_rows_alone(tiny_model, monkeypatch, name):
    model = tiny_model(name)
    # 8-token chunks: the long prompts' middle chunks sample nothing, their last ones one row, beside decode rows
    prompts = random_prompts([37, 21, 9], seed=7)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    steps, calls = [], []
    execute, attend_stored = ModelRunner.execute, TorchPagedAttention.attend_stored

    def step_spy(runner, step):
        steps.append((len(step.input_ids), len(step.sample_rows), len(calls)))
        return execute(runner, step)

    def attend_spy(backend, layer_id, q, scale):
        calls.append((layer_id, q.shape[0]))
        return attend_stored(backend, layer_id, q, scale)

    monkeypatch.setattr(ModelRunner, "execute", step_spy)
    monkeypatch.setattr(TorchPagedAttention, "attend_stored", attend_spy)

    def run(rows_only: bool):
        llm = LLM(model=str(model.path), block_size=4, max_num_batched_tokens=8, max_num_seqs=3)
        llm.engine.runner.output_rows_only = rows_only
        steps.clear()
        calls.clear()
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    whole = run(False)
    outs = run(True)
    assert [o.outputs[0].token_ids for o in outs] == [model.greedy(p, 6) for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in whole]
    for got, ref in zip(outs, whole):  # the sampled rows' logits, to float32 rounding
        got_lp = torch.tensor([[lp for _, lp in row] for row in got.outputs[0].logprobs])
        ref_lp = torch.tensor([[lp for _, lp in row] for row in ref.outputs[0].logprobs])
        torch.testing.assert_close(got_lp, ref_lp, atol=1e-5, rtol=0)

    last = model.hf.config.num_hidden_layers - 1
    ends = [first for _, _, first in steps[1:]] + [len(calls)]
    mid_prompt = 0
    for (tokens, sampled, first), end in zip(steps, ends):
        rows = {}
        for layer_id, n in calls[first:end]:
            rows[layer_id] = rows.get(layer_id, 0) + n
        assert all(rows[i] == tokens for i in range(last)), (tokens, rows)
        if sampled == 0:
            assert last not in rows  # a chunk in the middle of a prompt: that layer only stored its K/V
            mid_prompt += 1
        else:
            assert rows[last] == sampled, (tokens, sampled, rows)
    assert mid_prompt >= 3
