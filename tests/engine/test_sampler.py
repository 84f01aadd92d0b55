import math

import pytest
import torch

from hybridkv.engine.sampler import Sampler, SamplerOutput, apply_penalties, make_generator
from hybridkv.engine.sampling_params import SamplingParams


def run(sampler, logits, params, prompt=None, out=None, gens=None, eos=()):
    b = logits.shape[0]
    return sampler(
        logits,
        params,
        prompt if prompt is not None else [[] for _ in range(b)],
        out if out is not None else [[] for _ in range(b)],
        gens if gens is not None else [None] * b,
        eos_token_ids=eos,
    )


# ---------------------------------------------------------------- SamplingParams


def test_defaults_and_normalisation():
    p = SamplingParams(stop="###", top_k=-1)
    assert p.stop == ["###"] and p.stop_token_ids == [] and p.top_k == 0
    assert p.n == 1 and p.temperature == 1.0 and p.max_tokens == 16 and not p.greedy
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(stop=None).stop == []


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.1}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"n": 0}, "n"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": ["a", ""]}, "stop"),
    ],
)
def test_validation_names_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**kwargs)


# ---------------------------------------------------------------- deterministic rules


def test_greedy_is_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    out = run(Sampler(seed=1), logits, [SamplingParams(temperature=0.0)] * 4)
    assert isinstance(out, SamplerOutput)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_inputs_not_modified():
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    run(Sampler(seed=0), logits, [SamplingParams(repetition_penalty=2.0, top_k=3)] * 2,
        prompt=[[1, 2], [3]])
    assert torch.equal(logits, before)


def test_top_k_1_is_argmax_at_high_temperature():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(2))
    sampler = Sampler(seed=3)
    for _ in range(5):
        out = run(sampler, logits, [SamplingParams(temperature=100.0, top_k=1)] * 8)
        assert out.token_ids == logits.argmax(-1).tolist()


def test_tiny_top_p_is_argmax():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(4))
    sampler = Sampler(seed=5)
    for _ in range(5):
        out = run(sampler, logits, [SamplingParams(temperature=5.0, top_p=1e-6)] * 8)
        assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_and_top_p_keep_expected_sets():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log().expand(2000, 4).contiguous()
    sampler = Sampler(seed=6)
    got_k = set(run(sampler, logits, [SamplingParams(top_k=2)] * 2000).token_ids)
    assert got_k == {0, 1}
    # 0.4 + 0.3 = 0.7 < 0.75, so the third token is needed to cover p.
    got_p = set(run(sampler, logits, [SamplingParams(top_p=0.75)] * 2000).token_ids)
    assert got_p == {0, 1, 2}
    got_p = set(run(sampler, logits, [SamplingParams(top_p=0.7)] * 2000).token_ids)
    assert got_p == {0, 1}


def test_min_p_filters():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20000
    logits = probs.log().expand(n, 4).contiguous()
    # threshold 0.35 * 0.5 = 0.175: only tokens 0 and 1 survive.
    out = run(Sampler(seed=7), logits, [SamplingParams(min_p=0.35)] * n)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4)
    assert counts[2] == 0 and counts[3] == 0
    assert abs(counts[0].item() / n - 0.5 / 0.8) < 0.02


def test_repetition_penalty_flips_choice():
    greedy = dict(temperature=0.0, repetition_penalty=2.0)
    # Positive logit divided: 2.0 -> 1.0 < 1.5 (token 0 is in the prompt).
    logits = torch.tensor([[2.0, 1.5, -1.0]])
    assert run(Sampler(), logits, [SamplingParams(temperature=0.0)]).token_ids == [0]
    assert run(Sampler(), logits, [SamplingParams(**greedy)], prompt=[[0]]).token_ids == [1]
    # Negative logit multiplied: -0.5 -> -1.0 < -0.8 (token 0 was generated).
    logits = torch.tensor([[-0.5, -0.8, -3.0]])
    assert run(Sampler(), logits, [SamplingParams(**greedy)], out=[[0]]).token_ids == [1]


def test_presence_frequency_penalties_exact():
    logits = torch.tensor([[1.0, -2.0, 3.0, 0.5, 4.0]])
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25,
                             repetition_penalty=2.0)]
    prompt, output = [[3, 4]], [[0, 0, 0, 1, 4]]
    got = logits.clone()
    apply_penalties(got, params, prompt, output)
    # repetition on prompt+output {0,1,3,4}; freq/presence on output only.
    expected = [
        1.0 / 2 - 0.25 * 3 - 0.5,   # seen 3 times in output
        -2.0 * 2 - 0.25 * 1 - 0.5,  # negative: multiplied
        3.0,                        # never seen
        0.5 / 2,                    # prompt only: no freq/presence
        4.0 / 2 - 0.25 - 0.5,
    ]
    assert got[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_prompt_token_sets_are_built_once_per_prompt_and_forgotten_with_it():
    sampler = Sampler()
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0)] * 2
    long_prompt, other = list(range(1000)) * 3, [4]
    logits = torch.zeros(2, 1001)
    logits[:, 5] = 2.0
    logits[:, 1000] = 1.5
    # token 5 is only in the long prompt: halved there (1.0 < 1.5), kept for the other row
    assert run(sampler, logits, params, prompt=[long_prompt, other]).token_ids == [1000, 5]
    cached = sampler._prompt_tokens._by_id[id(long_prompt)][1]
    assert sorted(cached.tolist()) == list(range(1000))
    run(sampler, logits, params, prompt=[long_prompt, other])
    assert sampler._prompt_tokens._by_id[id(long_prompt)][1] is cached  # not rebuilt the next step
    run(sampler, logits[:1], params[:1], prompt=[other])
    assert id(long_prompt) not in sampler._prompt_tokens._by_id  # its request is gone: so is its set


def test_presence_penalty_flips_choice():
    logits = torch.tensor([[1.0, 0.9]])
    p = SamplingParams(temperature=0.0, presence_penalty=0.5)
    assert run(Sampler(), logits, [p], prompt=[[0]]).token_ids == [0]  # prompt ignored
    assert run(Sampler(), logits, [p], out=[[0]]).token_ids == [1]


def test_min_tokens_blocks_eos_and_stop_ids():
    eos, stop_id = 7, 3
    logits = torch.zeros(1, 10)
    logits[0, eos] = 50.0
    logits[0, stop_id] = 40.0
    logits[0, 5] = 30.0
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop_id])
    s = Sampler()
    assert run(s, logits, [p], out=[[1, 2]], eos=[eos]).token_ids == [5]
    assert run(s, logits, [p], out=[[1, 2, 3]], eos=[eos]).token_ids == [eos]
    # ignore_eos: EOS cannot stop the request, so it is not masked.
    p = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    assert run(s, logits, [p], out=[[1]], eos=[eos]).token_ids == [eos]


# ---------------------------------------------------------------- seeds and randomness


def _seeded_run(steps, batch_builder):
    """Sample `steps` tokens for the seeded request (row returned by builder)."""
    torch_gen = torch.Generator().manual_seed(99)
    target = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)
    gens = {"target": make_generator(target.seed)}
    sampler = Sampler()
    tokens = []
    for _ in range(steps):
        row = torch.randn(1, 200, generator=torch_gen)
        logits, params, g, idx = batch_builder(row, target, gens)
        b = logits.shape[0]
        out = sampler(logits, params, [[]] * b, [[]] * b, g)
        tokens.append(out.token_ids[idx])
    return tokens


def test_same_seed_same_samples_alone_or_batched():
    def alone(row, target, gens):
        return row, [target], [gens["target"]], 0

    def batched(row, target, gens):
        gens.setdefault("other", make_generator(7))
        others = torch.randn(3, 200)
        logits = torch.cat([others[:2], row, others[2:]])
        params = [SamplingParams(), SamplingParams(temperature=0.0), target,
                  SamplingParams(seed=7, top_k=5)]
        return logits, params, [None, None, gens["target"], gens["other"]], 2

    a, b = _seeded_run(30, alone), _seeded_run(30, batched)
    assert a == b
    assert len(set(a)) > 5  # actually random, not argmax every time


def test_different_seeds_differ():
    logits = torch.zeros(1, 1000)
    def draw(seed):
        g = make_generator(seed)
        s = Sampler()
        return [s(logits, [SamplingParams(seed=seed)], [[]], [[]], [g]).token_ids[0]
                for _ in range(20)]
    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def _chi_square(tokens, probs):
    n = len(tokens)
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).double()
    expected = probs.double() * n
    return ((counts - expected) ** 2 / expected).sum().item()


@pytest.mark.parametrize("seeded_rows", [False, True])
def test_empirical_distribution_matches_softmax(seeded_rows):
    logits_row = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3, -1.0])
    probs = torch.softmax(logits_row, -1)
    n = 20000
    logits = logits_row.expand(n, 6).contiguous()
    gens = [make_generator(i) for i in range(n)] if seeded_rows else [None] * n
    out = run(Sampler(seed=11), logits, [SamplingParams()] * n, gens=gens)
    # 5 degrees of freedom: P(chi2 > 25) ~ 1.4e-4; the draw is seeded anyway.
    assert _chi_square(out.token_ids, probs) < 25.0


def test_temperature_sharpens_distribution():
    logits_row = torch.tensor([1.0, 0.0, -0.5, 2.0])
    n = 20000
    logits = logits_row.expand(n, 4).contiguous()
    out = run(Sampler(seed=12), logits, [SamplingParams(temperature=0.5)] * n)
    assert _chi_square(out.token_ids, torch.softmax(logits_row / 0.5, -1)) < 25.0


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(13))
    params = [
        SamplingParams(logprobs=3, temperature=0.7, repetition_penalty=1.5),
        SamplingParams(),  # not requested
        SamplingParams(logprobs=0, temperature=0.0),
    ]
    out = run(Sampler(seed=14), logits, params, prompt=[[1, 2], [], [4]])
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs[1] == []
    row0 = out.logprobs[0]
    assert len(row0) == 4
    assert row0[0][0] == out.token_ids[0]
    assert row0[0][1] == pytest.approx(ref[0, out.token_ids[0]].item(), abs=1e-6)
    top_vals, top_ids = ref[0].topk(3)
    assert [t for t, _ in row0[1:]] == top_ids.tolist()
    assert [v for _, v in row0[1:]] == pytest.approx(top_vals.tolist(), abs=1e-6)
    assert out.logprobs[2] == [(out.token_ids[2], pytest.approx(ref[2].max().item(), abs=1e-6))]
    assert all(math.isfinite(v) for _, v in row0)


def test_greedy_rows_take_the_argmax_only_when_nothing_moves_it():
    # every row's argmax is token 0; each greedy row but the first has something that moves it to token 1
    logits = torch.tensor([[2.0, 1.9, -1.0]]).repeat(5, 1)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logit_bias={1: 1.0}),
              SamplingParams(temperature=0.0, presence_penalty=1.0), SamplingParams(temperature=0.0, min_tokens=1),
              SamplingParams(temperature=0.0, logprobs=1)]
    out = run(Sampler(), logits, params, out=[[], [], [0], [], []], eos=[0])
    assert out.token_ids == [0, 1, 1, 1, 0]
    assert out.logprobs[0] == [] and out.logprobs[4][0][0] == 0  # the logprobs row still gets its logprobs
    alone = run(Sampler(), logits[:1], params[:1])  # the argmax alone: same token, no logprobs
    assert alone.token_ids == [0] and alone.logprobs is None


def test_tokens_on_device_are_the_tokens_call_samples():
    """Async scheduling samples through ``tokens_on_device``: the same tokens as ``__call__`` (the same generator
    states, penalties, min_tokens), left as a tensor; rows asking for logprobs are refused."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.3, top_k=7, top_p=0.8, seed=2),
              SamplingParams(temperature=0.6, min_p=0.05, repetition_penalty=1.4, min_tokens=3, seed=3),
              SamplingParams(temperature=0)]
    prompts, outputs = [[1, 2, 3]] * 4, [[4, 5], [], [6], [7]]
    calls = []
    for _ in range(2):
        gens = [make_generator(p.seed) for p in params]
        calls.append((Sampler(seed=5), gens))
    want = run(calls[0][0], logits, params, prompts, outputs, calls[0][1], eos=(0,)).token_ids
    got = calls[1][0].tokens_on_device(logits, params, prompts, outputs, calls[1][1], (0,))
    assert isinstance(got, torch.Tensor) and got.tolist() == want
    assert got[3] == logits[3].argmax()
    with pytest.raises(ValueError, match="no logprobs"):
        Sampler().tokens_on_device(logits[:1], [SamplingParams(logprobs=2)], [[]], [[]], [None])


def test_inverse_cdf_picks_by_cumulative_probability_and_never_a_zero():
    from hybridkv.engine.sampler import inverse_cdf

    probs = torch.tensor([[0.5, 0.0, 0.5]] * 4 + [[0.3, 0.7, 0.0, 0.0][:3]])
    u = torch.tensor([0.0, 0.4999, 0.5, 0.6, 1 - 2.0**-53], dtype=torch.float64)
    # u 0.5 lands on the cumulative 0.5 that tokens 0 and 1 share: the next token with any probability is taken
    assert inverse_cdf(probs, u).tolist() == [0, 0, 2, 2, 1]
    # rows need not sum to 1; masked (zero) tokens are never picked whatever u
    masked = torch.tensor([[0.0, 2.0, 0.0, 6.0, 0.0]]).expand(1000, 5)
    picks = inverse_cdf(masked, torch.rand(1000, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    assert set(picks.tolist()) == {1, 3} and 650 < (picks == 3).sum() < 850  # 3/4 of the draws
    # a row with no probability anywhere (every logit -inf, softmax NaN) still gives a valid id
    nowhere = torch.full((2, 4), float("nan"))
    assert inverse_cdf(nowhere, torch.tensor([0.3, 0.9], dtype=torch.float64)).tolist() == [0, 0]
