"""The engine: requests in, one scheduled forward pass per ``step()``, outputs out.

From ``LLM.generate`` to the kernel::

    LLM.generate(prompts, params)                      llm.py: one request per prompt, steps until all finish
      LLMEngine.add_request                            tokenize, check, one ``Sequence`` per sample (n)
      LLMEngine.step = execute(schedule())
        Scheduler.schedule                             this step's tokens, KV blocks allocated (``KVCacheManager``)
        ModelRunner.run = prepare + execute            model_runner.py: flat token ids, positions, block tables;
                                                       under TP the same input to every rank (tp_workers.py); a
                                                       decode step replays a CUDA graph (cuda_graphs.py)
          CausalLM forward                             model/architectures: layers, each attention through
            PagedAttentionBackend                      model/attention: torch (CPU) or Triton kernels (GPU)
          compute_logits                               the sampled rows only
        Sampler                                        sampler.py: penalties, masks, temperature, top-k/p, draw
        RequestOutputState.append_token                output_processing.py: text, stop checks, finish reason
      -> RequestOutput per request that advanced

The engine is built on its rank (``rank_builder.build_driver_rank``: device, dtype, weights, KV sizing,
tensor-parallel workers, CUDA graphs) and keeps only requests, the step and outputs. With async scheduling
(``EngineConfig.async_scheduling``, on with CUDA) a greedy decode step schedules and launches the next one before
its tokens reach the host: ``ahead.py``.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from hybridkv.engine.ahead import AheadSteps
from hybridkv.engine.config import EngineConfig
from hybridkv.engine.kv_events import KVEventPublisher, parse_kv_events_config
from hybridkv.engine.model_runner import StepOutput
from hybridkv.engine.output_processing import Logprobs, PromptLogprobs, PromptScores, RequestOutputState
from hybridkv.engine.rank_builder import build_driver_rank
from hybridkv.engine.sampler import Sampler, SamplerOutput, TokenScores, make_generator
from hybridkv.engine.sampling_params import RequestOutputKind, SamplingParams
from hybridkv.engine.scheduler import Scheduler, SchedulerOutput
from hybridkv.engine.sequence import Sequence
from hybridkv.engine.structured_output import StructuredOutputs
from hybridkv.kv.layer_specs import text_config
from hybridkv.kv.specs import AttentionSpec
from hybridkv.model.loading.checkpoint import LoadedModel
from hybridkv.model.loading.tokenizer import Tokenizer

log = logging.getLogger("hybridkv")

# what the engine itself hands a chat template; a request's template kwargs may not replace them
_TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "tools", "bos_token", "eos_token")


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[Logprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    # Text new since this sequence's previous output; the end is held back while it could start a stop string.
    delta_text: str = ""


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # with ``SamplingParams.prompt_logprobs``


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        for s in self.seqs:  # (a generator for all() cost more than the check, per request and step)
            if s.state.finish_reason is None:  # (``state.finished``, without the property call)
                return False
        return True


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        """``loaded``: a model already loaded (one rank); else ``config.model`` is loaded (``rank_builder.py``)."""
        if config.data_parallel_size != 1:
            raise ValueError(f"data_parallel_size {config.data_parallel_size}: one engine is one replica; replicas "
                             "are served by `hybridkv serve --data-parallel-size N` (server/data_parallel.py)")
        kv_events = parse_kv_events_config(config.kv_events_config)  # a bad config fails before the model loads
        rank = build_driver_rank(config, loaded)
        self.config, self.loaded, self.model = rank.config, rank.loaded, rank.model
        self.int4_linears = rank.int4_linears  # linear layers kept 4-bit on the CPU
        self.layout, self.kv, self.backend, self.runner = rank.layout, rank.kv, rank.backend, rank.runner
        self.max_model_len, self.max_model_len_bound = rank.max_model_len, rank.max_model_len_bound
        self.workers = rank.workers  # the other tensor-parallel ranks' processes (None: one rank)
        config = rank.config
        self.tokenizer = None if config.skip_tokenizer_init else rank.loaded.tokenizer
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.long_prefill_token_threshold)
        self.sampler = Sampler(config.seed)
        self.eos_token_ids = _eos_token_ids(self.tokenizer, rank.loaded.hf_config)
        self.structured_outputs = StructuredOutputs(self.tokenizer, self.model.cfg.vocab_size, self.eos_token_ids,
                                                    config.grammar_compile_timeout_s)
        self._requests: dict[str, _Request] = {}
        self._by_seq: dict[str, _Request] = {}  # by ``Sequence.request_id``
        self.ahead = AheadSteps(self)  # async scheduling: the step scheduled ahead
        self._arrivals = itertools.count()
        # no socket unless events are on
        self.kv_events = KVEventPublisher(kv_events, self.layout, config.data_parallel_rank)

    def collective_rpc(self, fn: Callable, *args) -> list:
        """``fn(runner, *args)`` on every tensor-parallel rank's ``ModelRunner`` (vLLM's name), e.g. to read each
        GPU's peak memory or fill each rank's KV cache in a benchmark; the results by rank. ``fn`` and its result
        must pickle under tensor parallelism (a module-level function)."""
        if self.workers is None:
            return [fn(self.runner, *args)]
        return self.runner.call_on_ranks(fn, *args)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (a no-op without them); the engine cannot step afterwards."""
        if self.workers is not None:
            self.workers.shutdown()
        self.kv_events.shutdown()

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def layer_specs(self) -> list[AttentionSpec]:
        """One spec per layer, sized for one tensor-parallel rank."""
        by_layer = {layer: group.spec for group in self.layout.groups for layer in group.layer_ids}
        return [by_layer[layer] for layer in sorted(by_layer)]

    @property
    def steps_launched_ahead(self) -> int:
        """Async scheduling: decode steps launched before the step before was sampled."""
        return self.ahead.steps_launched

    # ---- requests ----------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> None:
        """Validate and queue a request; raises ValueError naming the problem and the limit."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(map(int, prompt))
        _check_prompt(ids, self.max_model_len, self.model.cfg.vocab_size)
        _check_params(params, self.config.max_num_seqs, self.model.cfg.vocab_size)
        max_tokens = self.max_model_len - len(ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        if not self.kv.can_ever_fit(len(ids) + max_tokens):
            raise ValueError(
                f"request needs {len(ids) + max_tokens} tokens of KV cache ({self.kv.peak_blocks(len(ids) + max_tokens)}"
                f" blocks at its peak) but the whole cache holds {self.kv.pool.num_usable_blocks} blocks"
            )
        constraint = params.structured_outputs
        if constraint is not None:
            self.structured_outputs.compile(constraint)  # refuse a bad spec before anything is queued
        req = _Request(request_id, text, ids, params)
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            seq = Sequence(f"{request_id}:{i}", ids, max_tokens, next(self._arrivals), cache_salt=cache_salt)
            seq.state = RequestOutputState.create(params, ids, self.tokenizer, seq.all_token_ids)
            seq.generator = make_generator(seed)
            if constraint is not None:
                seq.grammar = self.structured_outputs.matcher(constraint)
            req.seqs.append(seq)
        if params.prompt_logprobs is not None:  # scored once per request, by its first sequence
            req.seqs[0].prompt_scores = PromptScores(ids, params.prompt_logprobs)
        for seq in req.seqs:  # queued only once every copy is built: a failure above leaves nothing behind
            self.scheduler.add(seq)
            self._by_seq[seq.request_id] = req
        self._requests[request_id] = req

    def chat_token_ids(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None, tokenizer: Tokenizer | None = None,
        add_special_tokens: bool = False, template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """``chat_token_ids`` below, with this engine's tokenizer (or ``tokenizer``: this one's with another chat
        template) and ``max_model_len``."""
        return chat_token_ids(tokenizer or self.tokenizer, self.max_model_len, messages, add_generation_prompt,
                              tools, add_special_tokens, template_kwargs)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``tokenize`` below, with this engine's tokenizer and ``max_model_len``."""
        return tokenize(self.tokenizer, self.max_model_len, text, add_special_tokens)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is; every block it held goes back. False if unknown or finished."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        self._forget(req)
        for seq in req.seqs:
            if not seq.state.finished:
                seq.state.finish_reason = "abort"
            self.scheduler.finish(seq)
        self.ahead.drop_if_finished()
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ---- one step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one forward pass; return the outputs of requests that advanced (finished ones for the last time)."""
        return self.execute(self.schedule())

    def schedule(self) -> SchedulerOutput:
        """The first half of ``step()``: pick this step's tokens and allocate their KV blocks (the server reads its
        gauges between the halves, so they show the step in flight). With ``async_scheduling`` it may be the step
        the previous ``execute`` scheduled (and launched) ahead."""
        if self.ahead.pending is not None:
            return self.ahead.pending.out
        return self.scheduler.schedule()

    def execute(self, out: SchedulerOutput) -> list[RequestOutput]:
        """The second half of ``step()``: the forward pass over ``out``, sampling, outputs; then the step's KV
        events (what the step, and any abort since the last one, made findable or not) go out as one batch."""
        try:
            launched = self.ahead.take(out)  # a step launched ahead ran already (``ahead.py``)
            if launched is not None:
                return self._sample_step(out, *launched)
            if not out.scheduled:
                if self.scheduler.has_unfinished:
                    raise RuntimeError("the scheduler could not schedule any request: KV cache accounting is broken")
                return []
            result = self.runner.run(out)
            if result.scores is not None:
                _add_prompt_scores(out, result.scores)
            # until the sampler reads the logits, a GPU is still computing them: the host's bookkeeping goes here
            self.scheduler.on_step_done(out)
            return self._sample_step(out, [s.seq for s in out.scheduled if s.samples], result)
        finally:
            self.kv_events.drain(self.kv.events)

    def _sample_step(self, out: SchedulerOutput, seqs: list[Sequence], result: StepOutput) -> list[RequestOutput]:
        """Sample a token for each of ``seqs`` from ``result`` (with async scheduling, launching the next step
        first where it may go ahead); the outputs of the requests that advanced."""
        _catch_up_text(seqs)
        if not seqs:
            return []
        if self.ahead.may_go_ahead(out, result, seqs):
            return self._outputs(self.ahead.sample_and_launch(seqs, result))
        return self._outputs(self.sample(seqs, result))

    def sample(self, seqs: list[Sequence], step: StepOutput, tokens: list[int] | None = None) -> list[_Request]:
        """Sample a token for each of ``seqs``, record it; the requests with news (an output to give this step).
        ``tokens``: the step's argmax, taken before the step after it was launched; each replaces its sequence's
        placeholder (``ahead.py``)."""
        if tokens is not None:
            result = SamplerOutput(tokens, None)
        elif step.argmax_only:  # no grammar either: ``SamplingParams.argmax_only`` excludes one
            result = self.sampler.argmax(step.logits)
        else:
            result = self.sampler(step.logits, *self._sampler_inputs(seqs))
        touched: dict[str, _Request] = {}
        eos, max_len, by_seq = self.eos_token_ids, self.max_model_len, self._by_seq
        logprobs = result.logprobs
        final_only = RequestOutputKind.FINAL_ONLY
        for i, (seq, token) in enumerate(zip(seqs, result.token_ids)):
            if tokens is not None:
                seq.all_token_ids.pop()  # its placeholder: the token takes its place
            state = seq.state
            lp = logprobs[i] if logprobs is not None else None
            # appended to ``seq.all_token_ids``, which the state reads its outputs from
            finish = state.append_token(token, lp, eos_token_ids=eos, max_model_len=max_len)
            if seq.grammar is not None and finish is None:
                finish = _advance_grammar(seq, token)
            if finish is not None:
                self.scheduler.finish(seq)
            elif state.params.output_kind is final_only:
                continue  # nothing to report before it finishes
            req = by_seq[seq.request_id]
            touched[req.request_id] = req
        return list(touched.values())

    def tokens_on_device(self, seqs: list[Sequence], step: StepOutput) -> torch.Tensor:
        """The step's tokens as ``sample`` would draw them, left on the device (async scheduling)."""
        if step.argmax_only:
            return step.logits.argmax(dim=-1)
        return self.sampler.tokens_on_device(step.logits, *self._sampler_inputs(seqs))

    def _sampler_inputs(self, seqs: list[Sequence]) -> tuple:
        """What the sampler takes besides the logits: params, prompts, outputs, generators, EOS ids, grammar mask."""
        grammars = [s.grammar for s in seqs]
        bitmask = self.structured_outputs.bitmask(grammars) if any(g is not None for g in grammars) else None
        return ([s.state.params for s in seqs], [s.prompt_token_ids for s in seqs],
                [s.state.token_ids for s in seqs],  # the outputs in place, without slicing a copy per step
                [s.generator for s in seqs], self.eos_token_ids, bitmask)

    def _forget(self, req: _Request) -> None:
        del self._requests[req.request_id]
        for seq in req.seqs:
            del self._by_seq[seq.request_id]

    def _outputs(self, touched: list[_Request]) -> list[RequestOutput]:
        """The outputs of the requests with news; finished ones are forgotten."""
        outputs = []
        for req in touched:
            finished = req.finished
            if finished or req.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(_request_output(req, finished))
            if finished:
                self._forget(req)
        return outputs


def _request_output(req: _Request, finished: bool) -> RequestOutput:
    outputs = []
    for i, seq in enumerate(req.seqs):
        st = seq.state
        outputs.append(
            CompletionOutput(
                i,
                st.text,
                list(st.token_ids),  # a copy: a stream reads it after later steps appended to the sequence's
                None if st.logprobs is None else st.cumulative_logprob,
                st.logprobs,
                st.finish_reason,
                st.stop_reason,
                st.take_delta(),
            )
        )
    cached = min(s.num_cached_prompt_tokens for s in req.seqs)
    scores = req.seqs[0].prompt_scores
    prompt_logprobs = None if scores is None else scores.build()
    return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outputs, finished, cached,
                         prompt_logprobs)


def _check_params(params: SamplingParams, max_num_seqs: int, vocab: int) -> None:
    if params.n > max_num_seqs:
        raise ValueError(f"n must be <= max_num_seqs ({max_num_seqs}), got {params.n}")
    for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ())):
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab})")


def _check_prompt(ids: list[int], max_model_len: int, vocab: int) -> None:
    if not ids:
        raise ValueError("the prompt is empty: at least one token is needed")
    if len(ids) >= max_model_len:
        raise ValueError(
            f"the prompt is {len(ids)} tokens long but max_model_len is {max_model_len}: "
            "prompt plus at least one generated token must fit"
        )
    if min(ids) < 0 or max(ids) >= vocab:  # (two C loops: 256 prompts of 512 tokens in 2 ms, not 6)
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")


def _catch_up_text(seqs: list[Sequence]) -> None:
    """Detokenize what the sequences' deferred text still lacks (``RequestOutputState.pending``)."""
    for seq in seqs:
        if seq.state.pending:
            seq.state.catch_up_text()


def _add_prompt_scores(out: SchedulerOutput, scores: TokenScores) -> None:
    """Hand each sequence its rows of the step's prompt scores (in ``ModelRunner.prepare``'s order)."""
    start = 0
    for s in out.scheduled:
        n = len(s.prompt_score_positions)
        if n:
            s.seq.prompt_scores.add(scores.rows(start, start + n))
            start += n


def _advance_grammar(seq: Sequence, token: int) -> str | None:
    """Feed the sampled token to the sequence's grammar; finish the sequence once the grammar is done."""
    if not seq.grammar.accept_token(token):
        # only an all-masked row gets here (min_tokens forbidding the one stop token the grammar allows)
        log.warning("%s: token %d breaks its grammar; finishing the sequence", seq.request_id, token)
        seq.state.finish_reason = "abort"
    elif seq.grammar.is_terminated():  # the grammar took its stop token but the row ignores EOS
        seq.state.finish_reason = "stop"
    return seq.state.finish_reason


def _eos_token_ids(tokenizer, hf_config: dict) -> list[int]:
    """The tokenizer's end ids; without a tokenizer, the checkpoint config's ``eos_token_id`` (one or a list)."""
    if tokenizer is not None:
        return list(tokenizer.eos_token_ids)
    eos = text_config(hf_config).get("eos_token_id", hf_config.get("eos_token_id"))
    return [int(t) for t in (eos if isinstance(eos, list) else [eos]) if t is not None]


# ---- prompts: what the engine and a data-parallel front end (which holds no model) both do ---------------------
def chat_token_ids(
    tokenizer: Tokenizer | None, max_model_len: int, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None, add_special_tokens: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of a conversation rendered by the chat template, tokenized like a text prompt (with its length
    check) but without special tokens (unless ``add_special_tokens``): the template writes any BOS itself.
    ``tools`` (OpenAI's tool definitions) go to the template. ``template_kwargs``: more variables for the template
    (vLLM's ``chat_template_kwargs``, e.g. ``{"enable_thinking": False}``); the ones set here (``messages``,
    ``tools`` ...) are refused."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer, and this engine has none (skip_tokenizer_init)")
    extra = {"tools": tools} if tools else {}
    for name, value in (template_kwargs or {}).items():
        if name in _TEMPLATE_VARIABLES:
            raise ValueError(f"chat_template_kwargs: {name!r} is set from the request itself, so it cannot be "
                             f"passed here (reserved: {', '.join(_TEMPLATE_VARIABLES)})")
        extra[name] = value
    text = tokenizer.apply_chat_template(messages, add_generation_prompt, **extra)
    return tokenize(tokenizer, max_model_len, text, add_special_tokens=add_special_tokens)


def tokenize(tokenizer: Tokenizer | None, max_model_len: int, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a text prompt. Text too long for ``max_model_len`` however it tokenizes is refused before
    tokenizing it (a 20 MB prompt would take seconds to find that out)."""
    if tokenizer is None:
        raise ValueError("this engine has no tokenizer (skip_tokenizer_init): send the prompt as token ids")
    limit = max_model_len * tokenizer.max_token_chars
    if len(text) > limit:
        raise ValueError(
            f"the prompt is {len(text):,} characters long, more than max_model_len {max_model_len} tokens "
            f"can hold (at most {limit:,} characters with this tokenizer)"
        )
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
