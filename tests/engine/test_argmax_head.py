"""Which rows the CPU int8 output head serves: steps whose every sampled row takes the plain argmax; a row that
reads logits otherwise (logprobs, penalties, bias, sampling) gets the float32 head's."""

from __future__ import annotations

import pytest
from tiny_models import random_prompts

from hybridkv import LLM, SamplingParams
from hybridkv.model.int8_head_cpu import Int8ArgmaxHead, int8_kernel_available


@pytest.mark.parametrize("extra, plain", [
    ({}, True), ({"logprobs": 0}, False), ({"temperature": 0.7}, False), ({"repetition_penalty": 1.1}, False),
    ({"presence_penalty": 0.5}, False), ({"logit_bias": {5: 1.0}}, False), ({"min_tokens": 2}, False),
])
def test_argmax_only_is_greedy_with_nothing_else_reading_the_logits(extra, plain):
    assert SamplingParams(**{"temperature": 0, **extra}).argmax_only(0) is plain


def test_min_tokens_stops_editing_the_logits_once_reached():
    params = SamplingParams(temperature=0, min_tokens=2)
    assert [params.argmax_only(n) for n in range(4)] == [False, False, True, True]


@pytest.mark.skipif(not int8_kernel_available(), reason="torch has no CPU int8 kernel")
def test_greedy_steps_use_the_int8_head_and_steps_with_logprobs_the_float_head(tiny_model):
    path = str(tiny_model("llama3").path)
    plain, screened = LLM(model=path, device="cpu"), LLM(model=path, device="cpu")
    model = screened.engine.model
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    assert head.argmax_head is None  # a float checkpoint: only a 4-bit GGUF gets one by itself
    int8, rows = Int8ArgmaxHead.of(head.weight), []

    def spy(hidden, weight):
        rows.append(len(hidden))
        return int8(hidden, weight)

    head.argmax_head = spy
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 9, 17], seed=4)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in screened.generate(prompts, greedy, use_tqdm=False)]
    assert got == want
    assert sum(rows) == 3 * 12  # every sampled row went through the int8 head
    rows.clear()
    scored = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    want = plain.generate(prompts, scored, use_tqdm=False)
    got = screened.generate(prompts, scored, use_tqdm=False)
    assert not rows
    assert [o.outputs[0].logprobs for o in got] == [o.outputs[0].logprobs for o in want]
