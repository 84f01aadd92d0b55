"""Batched token sampler with vLLM's processing order and semantics.

Order per step: the structured-output token bitmask (before the logprobs, as
in vLLM) -> logit_bias -> penalties (repetition, frequency, presence) -> min_tokens
masking -> temperature -> top-k -> top-p -> min-p -> sample.  Greedy rows take
the argmax right after min_tokens masking (later steps cannot change it).

Sampling is by inverse transform: one uniform ``u`` in [0, 1) per row, and the
first token whose cumulative probability (summed in float64) exceeds ``u``,
which picks token ``i`` with probability ``probs[i]``.  One number per row, not
one per vocabulary entry: the exponential race (``argmax(probs / q)``, ``q`` drawn
per entry on the CPU) took 3.8 ms of CPU per row and step for Llama-4's 202,048
tokens (``benchmarks/engine_host.py``).  Each seeded row draws its ``u`` from its
own generator, on the CPU, so its samples depend only on its seed and its own
history, never on what else is in the batch; its draws are the same on every
device.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hybridkv.engine.device_transfer import host_to_device, to_device
from hybridkv.engine.sampling_params import SamplingParams

Logprobs = list[tuple[int, float]]


@dataclass(slots=True)
class SamplerOutput:
    """One sampled token per row.

    ``logprobs`` is None when no row asked for them.  Otherwise row ``i`` is
    ``[]`` if ``params[i].logprobs is None``, else
    ``[(sampled_id, lp), (top1_id, lp), ..., (topk_id, lp)]`` with
    ``k = params[i].logprobs``: the sampled token first (it may repeat inside
    the top-k), then the top-k in descending order.  All values come from
    ``log_softmax`` of the raw logits, before penalties, temperature or
    truncation, like vLLM's default ``raw_logprobs`` mode.
    """

    token_ids: list[int]
    logprobs: list[Logprobs] | None


def make_generator(seed: int | None) -> torch.Generator | None:
    """A request's private generator; create once per sequence and keep it."""
    if seed is None:
        return None
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


class Sampler:
    """Stateless apart from the generator used for unseeded rows and the prompts' token sets (a cache)."""

    def __init__(self, seed: int | None = None) -> None:
        # A private generator keeps unseeded sampling off torch's global RNG,
        # so unrelated torch code cannot perturb (or be perturbed by) us.
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self._prompt_tokens = PromptTokens()

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        eos_token_ids: Collection[int] = (),
        token_bitmask: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """Sample one token per row of ``logits`` ([B, V]); inputs are not modified.

        ``eos_token_ids`` are the model's EOS ids; they (unless the row sets
        ``ignore_eos``) and the row's ``stop_token_ids`` are masked while the
        row has fewer than ``min_tokens`` output tokens. ``token_bitmask`` ([B, ceil(V / 32)] int32, from
        ``StructuredOutputs.bitmask``) allows only the tokens whose bit is set.
        """
        batch = logits.shape[0]
        assert len(params) == len(prompt_ids) == len(output_ids) == len(generators) == batch
        if _argmax_only(params, output_ids, token_bitmask):
            return self.argmax(logits)
        tokens, raw_logprobs = self._tokens(logits, params, prompt_ids, output_ids, generators, eos_token_ids,
                                            token_bitmask)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, _gather_logprobs(raw_logprobs, params, token_list))

    def tokens_on_device(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        eos_token_ids: Collection[int] = (),
        token_bitmask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The tokens ``__call__`` would sample, int64 [B] left on the logits' device (async scheduling: the next
        step's input ids), for rows that ask no logprobs."""
        if any(p.logprobs is not None for p in params):
            raise ValueError("tokens_on_device gives no logprobs: sample rows that ask for them with __call__")
        if _argmax_only(params, output_ids, token_bitmask):
            return logits.argmax(dim=-1)
        return self._tokens(logits, params, prompt_ids, output_ids, generators, eos_token_ids, token_bitmask)[0]

    def _tokens(self, logits, params, prompt_ids, output_ids, generators, eos_token_ids,
                token_bitmask) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the sampled tokens on the logits' device, the raw logprobs where a row asks for them)."""
        logits = logits.to(torch.float32, copy=True)
        if token_bitmask is not None:
            from hybridkv.engine.structured_output import apply_token_bitmask

            apply_token_bitmask(logits, token_bitmask)
        raw_logprobs = _raw_logprobs(logits, params)

        apply_logit_bias(logits, params)
        apply_penalties(logits, params, prompt_ids, output_ids, self._prompt_tokens)
        apply_min_tokens(logits, params, output_ids, eos_token_ids)

        greedy = [p.greedy for p in params]
        tokens = logits.argmax(dim=-1)
        if not all(greedy):
            random_tokens = self._sample_random(logits, params, generators, greedy)
            greedy_mask = to_device(greedy, torch.bool, logits.device)
            tokens = torch.where(greedy_mask, tokens, random_tokens)
        return tokens, raw_logprobs

    @staticmethod
    def argmax(logits: torch.Tensor) -> SamplerOutput:
        """The common greedy step (every row ``SamplingParams.argmax_only``): nothing the sampler does would move a
        row's maximum, so one argmax and one copy to the host, and no float32 copy of the logits."""
        return SamplerOutput(logits.argmax(dim=-1).tolist(), None)

    def _sample_random(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        greedy: list[bool],
    ) -> torch.Tensor:
        # Greedy rows go through with temperature 1 (their result is discarded)
        # so the division never sees ~0.
        temps = to_device([1.0 if p.greedy else p.temperature for p in params], torch.float32, logits.device)
        logits.div_(temps.unsqueeze(1))
        apply_top_k_top_p(logits, params)
        apply_min_p(logits, params)
        probs = torch.softmax(logits, dim=-1)
        return inverse_cdf(probs, host_to_device(self._uniforms(generators, greedy), probs.device))

    def _uniforms(self, generators: Sequence[torch.Generator | None], greedy: list[bool]) -> torch.Tensor:
        """float64 [B] in [0, 1), drawn on the CPU with CPU generators whatever the logits' device, so a seed
        gives the same draws on every device: a seeded row takes one from its own generator per step, unseeded
        rows share ours; greedy rows take none (0)."""
        u = torch.zeros(len(generators), dtype=torch.float64)
        shared_rows = [i for i, g in enumerate(generators) if g is None and not greedy[i]]
        if shared_rows:
            u[shared_rows] = torch.rand(len(shared_rows), dtype=torch.float64, generator=self._generator)
        for i, gen in enumerate(generators):
            if gen is not None and not greedy[i]:
                u[i] = torch.rand(1, dtype=torch.float64, generator=gen)
        return u


def _argmax_only(params: Sequence[SamplingParams], output_ids: Sequence[Sequence[int]],
                 token_bitmask: torch.Tensor | None) -> bool:
    """Every row's token is its logits' argmax: nothing the sampler does would move it."""
    return token_bitmask is None and all(p.argmax_only(len(ids)) for p, ids in zip(params, output_ids))


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of ``probs`` [B, V] (each row's sum need not be 1), the first token whose cumulative probability
    exceeds ``u`` [B] (in [0, 1)) times the row's sum: token i with probability ``probs[i] / sum``. A token of
    probability 0 is never picked. E.g. probs [0.5, 0, 0.5], u 0.6 -> cdf [0.5, 0.5, 1.0] -> token 2."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    target = (u.to(torch.float64) * cdf[:, -1]).unsqueeze(1)
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # u * sum may round up to the sum itself: stay on the last token that has any probability (token 0 where
    # none has, e.g. every logit -inf: as the argmax of NaNs would give, a valid id)
    positions = torch.arange(probs.shape[1], device=probs.device)
    last = torch.where(probs > 0, positions, -1).amax(dim=-1).clamp_min(0)
    return torch.minimum(picked, last)


def _raw_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor | None:
    if all(p.logprobs is None for p in params):
        return None
    return torch.log_softmax(logits, dim=-1)


def _gather_logprobs(
    raw: torch.Tensor | None, params: Sequence[SamplingParams], tokens: list[int]
) -> list[Logprobs] | None:
    if raw is None:
        return None
    max_k = min(max(p.logprobs or 0 for p in params), raw.shape[1])
    top_vals, top_ids = raw.topk(max_k, dim=-1)
    sampled = raw.gather(1, torch.tensor(tokens, device=raw.device).unsqueeze(1)).squeeze(1)
    top_vals, top_ids, sampled = top_vals.tolist(), top_ids.tolist(), sampled.tolist()
    rows: list[Logprobs] = []
    for i, p in enumerate(params):
        if p.logprobs is None:
            rows.append([])
            continue
        k = p.logprobs
        rows.append([(tokens[i], sampled[i]), *zip(top_ids[i][:k], top_vals[i][:k])])
    return rows


@dataclass(slots=True)
class TokenScores:
    """Per logits row: the log-probability and rank of a given token (a prompt's next one), and the row's top k."""

    logprobs: np.ndarray  # [R] float32
    ranks: np.ndarray  # [R] int64: 1 + how many tokens are more likely
    top_ids: np.ndarray  # [R, k] int64, most likely first
    top_logprobs: np.ndarray  # [R, k] float32

    def __len__(self) -> int:
        return len(self.logprobs)

    def rows(self, start: int, stop: int) -> TokenScores:
        return TokenScores(self.logprobs[start:stop], self.ranks[start:stop], self.top_ids[start:stop],
                           self.top_logprobs[start:stop])

    @staticmethod
    def concat(parts: Sequence[TokenScores]) -> TokenScores:
        return TokenScores(*(np.concatenate([getattr(p, f) for p in parts]) for f in TokenScores.__slots__))


def score_tokens(logits: torch.Tensor, token_ids: torch.Tensor, top_k: int) -> TokenScores:
    """``token_ids[i]``'s log-probability under ``logits[i]`` ([R, V] float32), as ``Sampler`` reports a sampled
    token's: ``log_softmax`` of the raw logits."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=1) + 1
    top = logprobs.topk(min(top_k, logprobs.shape[1]), dim=-1)
    return TokenScores(chosen.squeeze(1).cpu().numpy(), ranks.cpu().numpy(), top.indices.cpu().numpy(),
                       top.values.cpu().numpy())


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """In place: add each row's ``logit_bias`` to its tokens' logits (before penalties, as vLLM)."""
    for i, p in enumerate(params):
        if p.logit_bias:
            ids = to_device(list(p.logit_bias), torch.long, logits.device)
            logits[i, ids] += to_device(list(p.logit_bias.values()), torch.float32, logits.device)


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    prompt_tokens: PromptTokens | None = None,
) -> None:
    """In place: repetition penalty, then ``- freq * count - presence * seen``.

    ``prompt_tokens`` keeps each prompt's token set across steps (the sampler passes its own)."""
    # decided on the host: the common no-penalty step costs no device round trip
    if all(p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0 for p in params):
        return
    dev = logits.device
    rep = to_device([p.repetition_penalty for p in params], torch.float32, dev)
    freq = to_device([p.frequency_penalty for p in params], torch.float32, dev)
    pres = to_device([p.presence_penalty for p in params], torch.float32, dev)
    out_counts = _token_counts(output_ids, logits.shape[1], dev)
    out_mask = out_counts > 0
    # Repetition penalty (CTRL-style) covers prompt and output; the OpenAI
    # penalties look at generated tokens only, as in vLLM.
    seen = out_mask.clone()
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rows:
        token_sets = (prompt_tokens or PromptTokens()).token_sets([prompt_ids[i] for i in rows], dev)
        row_of = torch.cat([torch.full((len(t),), i, device=dev) for i, t in zip(rows, token_sets)])
        seen[row_of, torch.cat(token_sets)] = True
    rep = rep.unsqueeze(1).expand_as(logits)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    torch.where(seen, penalised, logits, out=logits)
    logits -= freq.unsqueeze(1) * out_counts
    logits -= pres.unsqueeze(1) * out_mask


class PromptTokens:
    """Each prompt's distinct token ids, on the logits' device, kept while the same prompt list comes back step
    after step: a 1M-token prompt with a repetition penalty is converted once, not at every decode step.

    Holds only the prompts of the latest call, so finished requests are forgotten a step later."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[Sequence[int], torch.Tensor]] = {}

    def token_sets(self, prompts: Sequence[Sequence[int]], device: torch.device) -> list[torch.Tensor]:
        kept: dict[int, tuple[Sequence[int], torch.Tensor]] = {}
        for prompt in prompts:
            hit = self._by_id.get(id(prompt))
            if hit is None or hit[0] is not prompt or hit[1].device != device:
                hit = (prompt, host_to_device(torch.unique(torch.as_tensor(prompt, dtype=torch.long)), device))
            kept[id(prompt)] = hit
        self._by_id = kept
        return [kept[id(p)][1] for p in prompts]


def _token_counts(ids: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[B, V] float counts of each token id per row, built on ``device`` (only the ids travel)."""
    width = max((len(r) for r in ids), default=0)
    # Padding points at an extra column that is dropped afterwards.
    padded = torch.full((len(ids), width), vocab, dtype=torch.long)
    for i, row in enumerate(ids):
        if row:
            padded[i, : len(row)] = torch.as_tensor(list(row), dtype=torch.long)  # (a row may be a view)
    counts = torch.zeros(len(ids), vocab + 1, device=device)
    counts.scatter_add_(1, host_to_device(padded, device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def apply_min_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_ids: Sequence[Sequence[int]],
    eos_token_ids: Collection[int],
) -> None:
    """In place: forbid the tokens that would stop a row still under min_tokens."""
    vocab = logits.shape[1]
    for i, p in enumerate(params):
        if len(output_ids[i]) >= p.min_tokens:
            continue
        blocked = set(p.stop_token_ids)
        if not p.ignore_eos:
            blocked.update(eos_token_ids)
        blocked = [t for t in blocked if 0 <= t < vocab]
        if blocked:
            logits[i, to_device(blocked, torch.long, logits.device)] = float("-inf")


def apply_top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """In place: set logits outside each row's top-k / top-p set to -inf."""
    vocab = logits.shape[1]
    dev = logits.device
    # decided on the host: no device round trip (with async scheduling the GPU may be a step ahead)
    if all(not 0 < p.top_k < vocab and p.top_p >= 1.0 for p in params):
        return
    top_k = to_device([p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.long, dev)
    top_p = to_device([p.top_p for p in params], torch.float32, dev)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    positions = torch.arange(vocab, device=dev).unsqueeze(0)
    sorted_logits.masked_fill_(positions >= top_k.unsqueeze(1), float("-inf"))
    # Top-p runs on the top-k-renormalised distribution; keep a token while the
    # mass strictly before it is < p, so the smallest covering set survives and
    # the top token always does.
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_logits.masked_fill_(mass_before >= top_p.unsqueeze(1), float("-inf"))
    logits.scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """In place: drop tokens with prob < min_p * (the row's max prob)."""
    if all(p.min_p == 0.0 for p in params):
        return
    min_p = to_device([p.min_p for p in params], torch.float32, logits.device)
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    logits.masked_fill_(probs < threshold, float("-inf"))
