"""The default CPU engine (SmolLM2's Q4_1 GGUF, its linears 4-bit) gives a request the same tokens and the same
logprobs whatever else is cached or batched with it: cold, with its prompt's prefix cached, and among other
requests, greedy and sampled with a seed.

What could break it: a prompt's rows running through another kernel than its cached tail's (``int4_cpu.RowPaths``),
a row's attention split at other keys (``torch_paged``'s segments), or the output head's rows summed otherwise
in a batch of another size (``parallel.vocab_parallel_logits``)."""

from __future__ import annotations

import pytest

from hybridkv import LLM, SamplingParams

# over 64 tokens, so that a cold prefill and a cached tail of a few tokens once took different kernels; not a
# multiple of the block size, so that the cached prefix ends inside the prompt
TARGET = ("Here is a note from my garden diary. This spring the tomatoes came up early, the beans were slow, and "
          "the roses by the fence had aphids until the ladybirds arrived in May. The pear tree flowered well but a "
          "late frost took most of the blossom. Summarise the note in one sentence, then suggest what to plant")
OTHERS = ["The capital of France is", "List three primary colours:", "Write a haiku about the sea.\n",
          "def fibonacci(n):\n    "]
PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=8),
    "greedy with logprobs": SamplingParams(temperature=0, max_tokens=8, logprobs=3),
    "seeded": SamplingParams(temperature=1.0, seed=1234, max_tokens=8, logprobs=3),
}


@pytest.fixture(scope="module")
def llm():
    llm = LLM()  # the CPU defaults: quantization auto packs the Q4_1 linears 4-bit
    assert llm.engine.int4_linears == 210
    return llm


def answer(out):
    """(token ids, logprobs): equal only if every logprob is equal to the bit."""
    first = out.outputs[0]
    return first.token_ids, first.logprobs


@pytest.mark.parametrize("kind", list(PARAMS))
def test_cold_cached_and_batched_requests_get_the_same_tokens_and_logprobs(llm, kind):
    params = PARAMS[kind]
    assert llm.engine.kv.reset_prefix_cache()
    cold = answer(llm.generate(TARGET, params, use_tqdm=False)[0])
    cached = answer(llm.generate(TARGET, params, use_tqdm=False)[0])  # all but the prompt's last block cached
    assert llm.engine.kv.reset_prefix_cache()
    # among others (greedy and sampled, short and long): prefilled in the same steps, then decoded side by side
    others = [SamplingParams(temperature=0.7, seed=i, max_tokens=4 + 3 * i) for i in range(len(OTHERS))]
    batched = llm.generate(OTHERS[:2] + [TARGET] + OTHERS[2:], others[:2] + [params] + others[2:], use_tqdm=False)
    # a batch of only the target's own prompt, twice: the two share its prefix as it is being cached
    twins = llm.generate([TARGET, TARGET], params, use_tqdm=False)
    assert cold[0] and (cold[1] is not None) == (params.logprobs is not None)
    assert cached == cold
    assert answer(batched[2]) == cold
    assert answer(twins[0]) == cold and answer(twins[1]) == cold


def test_a_request_decoding_beside_prompt_chunks_gets_the_same_tokens_and_logprobs(monkeypatch):
    """Small steps: a short request decodes while a long prompt is prefilled beside it, chunk by chunk. Such a step
    runs its decoding sequence in a forward of its own (``CausalLM.decodes_apart``: the C decode step computes a
    generated token's row, not the layers' forward), so the short request gets what it gets alone, to the bit."""
    from hybridkv.engine.model_runner import ModelRunner

    small = LLM(max_num_batched_tokens=32, enable_prefix_caching=False)
    assert small.engine.model.decodes_apart == (small.engine.model.native is not None)
    apart, forward_apart = [], ModelRunner._forward_apart
    monkeypatch.setattr(ModelRunner, "_forward_apart", lambda *a: apart.append(1) or forward_apart(*a))
    params = PARAMS["greedy with logprobs"]
    alone = answer(small.generate(OTHERS[0], params, use_tqdm=False)[0])
    both = small.generate([OTHERS[0], TARGET], [params, SamplingParams(temperature=0, max_tokens=1)], use_tqdm=False)
    assert answer(both[0]) == alone
    assert bool(apart) == small.engine.model.decodes_apart  # the target's chunks after its first: steps of both
