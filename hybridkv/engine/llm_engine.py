"""The engine: requests in, one scheduled forward pass per ``step()``, outputs out.

``LLM.generate`` -> ``LLMEngine.add_request`` -> ``step()``: ``Scheduler.schedule`` -> ``ModelRunner.run``
(model forward, ``TorchPagedAttention`` over the hybrid cache) -> ``Sampler`` -> output processing.

With async scheduling (``EngineConfig.async_scheduling``, on with CUDA) a greedy decode step schedules and launches
the next one before its tokens reach the host: ``docs/design/decode.md#async-scheduling``.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from hybridkv.engine.config import EngineConfig, resolve_step_budget
from hybridkv.engine.model_runner import ModelRunner, StepOutput
from hybridkv.engine.output_processing import Logprobs, PromptLogprobs, PromptScores, RequestOutputState
from hybridkv.engine.runtime import build_runtime, rank_layout
from hybridkv.engine.sampler import Sampler, SamplerOutput, TokenScores, make_generator
from hybridkv.engine.sampling_params import RequestOutputKind, SamplingParams
from hybridkv.engine.scheduler import Scheduler, SchedulerOutput
from hybridkv.engine.sequence import Sequence, SequenceStatus
from hybridkv.engine.structured_output import StructuredOutputs
from hybridkv.kv.capacity import longest_fitting
from hybridkv.kv.capacity import copy_engine_sums_bytes
from hybridkv.kv.capacity import step_reserve_bytes as _step_reserve_formula
from hybridkv.kv.cache_manager import KVCacheManager
from hybridkv.kv.dtypes import MODEL_DTYPES
from hybridkv.kv.layer_specs import text_config
from hybridkv.kv.layout import KVLayout
from hybridkv.kv.specs import AttentionSpec
from hybridkv.model.architectures.parallel import TPGroup
from hybridkv.model.attention.factory import paged_attention_capabilities
from hybridkv.model.dtypes import dtype_name, torch_dtype
from hybridkv.model.int4_cpu import int4_kernel_available, pack_int4_linears
from hybridkv.model.int8_head_cpu import Int8ArgmaxHead, int8_kernel_available
from hybridkv.model.loading.checkpoint import LoadedModel, load_checkpoint
from hybridkv.model.loading.tokenizer import Tokenizer

log = logging.getLogger("hybridkv")

DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30
# stands for a sampled token still on the device (async scheduling): never a real id, never hashed or fed as one
PLACEHOLDER = -1


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
class _Ahead:
    """The next step, scheduled while this step's tokens were still on the device (``async_scheduling``), and its
    result when it was launched then too (``None``: it runs when ``execute`` gets it, as any step)."""

    out: SchedulerOutput
    result: StepOutput | None


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
            if s.state.finish_reason is None:
                return False
        return True


def step_reserve_bytes(config: EngineConfig, hidden_size: int, vocab_size: int) -> int:
    """GPU memory kept out of the KV cache for one step's working set: ``hybridkv.kv.capacity``'s formula (the
    planner's too), with an FP8 cache on the Triton kernels keeping room for a long prefill's bf16 segments."""
    # what the backend declares it widens beside the cache (an FP8 cache's prefill segments on the kernels)
    segments = paged_attention_capabilities(config.attention_backend, "cuda", config.kv_cache_dtype).segment_bytes
    step = resolve_step_budget(config, "cuda").max_num_batched_tokens  # a GPU reserve: the GPU's default step
    return _step_reserve_formula(step, config.max_num_seqs, hidden_size, vocab_size, segments,
                                 config.tensor_parallel_size)


def size_kv_cache(config: EngineConfig, hf_config: dict, layout: KVLayout,
                  kv_bytes: int) -> tuple[int, int, str]:
    """The engine's KV sizing of ``layout`` (one rank's, ``runtime.rank_layout``) for ``kv_bytes`` per rank: (number
    of blocks with the null block, max_model_len, what bound it). ``hybridkv plan`` (``plan_capacity``) reaches the
    same numbers from the same inputs."""
    num_blocks = layout.num_blocks(kv_bytes)
    if num_blocks < 2:
        raise ValueError(
            f"kv_cache_memory_bytes={kv_bytes} holds {num_blocks} blocks of {layout.page_bytes} bytes; "
            "at least 2 are needed"
        )
    return num_blocks, *resolve_max_model_len(config, hf_config, layout, num_blocks)


def resolve_max_model_len(config: EngineConfig, hf_config: dict, layout: KVLayout,
                          num_blocks: int) -> tuple[int, str]:
    """The model's context (``max_position_embeddings``) or the asked length, within what the KV cache holds; and
    which of these bound it, in words.

    Too long for the model or the cache: raise naming the limit, or clamp and log it (``clamp_max_model_len``).
    """
    cfg = text_config(hf_config)
    model_len = int(cfg.get("max_position_embeddings") or 2048)
    asked = config.max_model_len
    wanted = model_len if asked is None else asked
    limits = []
    if wanted > model_len:
        limits.append((model_len, f"the model's context (max_position_embeddings) is {model_len}"))
    usable = num_blocks - 1  # block 0 is the null block
    step = resolve_step_budget(config, config.device).max_num_batched_tokens  # unresolved "auto": the GPU's step
    cache_fits = longest_fitting(layout, usable, step, wanted)
    if cache_fits < wanted:
        limits.append((cache_fits, (
            f"the KV cache ({usable} blocks of {layout.block_size} tokens, "
            f"{layout.page_bytes} bytes each) holds at most {cache_fits} tokens for one request"
        )))
    if not limits:
        return wanted, ("asked for with max_model_len" if asked is not None
                        else f"the model's context (max_position_embeddings) is {model_len}")
    length, why = min(limits)
    if asked is not None and not config.clamp_max_model_len:
        raise ValueError(f"max_model_len {asked} is too long: {why}; lower it or raise kv_cache_memory_bytes")
    log.warning("max_model_len %d clamped to %d: %s", wanted, length, why)
    return length, why


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        device = resolve_device(config.device)
        config = resolve_step_budget(replace(config, device=device), device)
        if device == "cpu":
            torch.set_num_threads(cpu_threads(config.cpu_threads))
        self.config = config
        dtype = _resolve_dtype(config.dtype, config.device)
        tp = TPGroup(0, config.tensor_parallel_size)
        self.workers = None  # the other tensor-parallel ranks' processes, started last (nothing left to refuse)
        self.loaded = loaded or _load_rank0(config, dtype, tp)
        if tp.size > 1 and loaded is not None:
            raise ValueError("tensor_parallel_size > 1 loads each rank's shard itself: pass model, not loaded")
        self.model = self.loaded.model.to(device=config.device, dtype=dtype).eval()
        self.int4_linears = _keep_4bit_weights(self.model, config, tp)
        self.tokenizer = None if config.skip_tokenizer_init else self.loaded.tokenizer
        hf_config = self.loaded.hf_config
        kv_dtype = config.kv_cache_dtype
        if config.fp8_attention_compute and not kv_dtype.startswith("fp8"):
            raise ValueError(f"fp8_attention_compute needs kv_cache_dtype=fp8_e4m3, got {kv_dtype!r}")
        if kv_dtype == "auto":
            kv_dtype = dtype_name(dtype)
        self.layout = rank_layout(hf_config, tp.size, kv_dtype, config.block_size)
        kv_bytes = config.kv_cache_memory_bytes or self._default_kv_bytes()
        num_blocks, self.max_model_len, self.max_model_len_bound = size_kv_cache(config, hf_config, self.layout,
                                                                                 kv_bytes)
        host_blocks = self._host_blocks()
        self.kv = KVCacheManager(
            self.layout,
            num_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            hash_algorithm=config.prefix_caching_hash_algo,
            max_step_tokens=config.max_num_batched_tokens,
            host_blocks=host_blocks,
        )
        runtime = build_runtime(self.model, self.layout, num_blocks, kv_dtype, config.attention_backend,
                                config.device, self.kv, host_blocks, config.fp8_attention_compute,
                                config.prefill_overlap_tokens, dtype)
        self.backend, self.runner = runtime.backend, runtime.runner
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.long_prefill_token_threshold)
        if tp.size > 1:
            self.runner = self._start_workers(tp, dtype, kv_dtype, num_blocks, host_blocks)
        if not config.enforce_eager:
            self.runner.capture_decode_graphs(config.max_num_seqs, self.max_model_len)
        self.sampler = Sampler(config.seed)
        self.eos_token_ids = _eos_token_ids(self.tokenizer, hf_config)
        self.structured_outputs = StructuredOutputs(self.tokenizer, self.model.cfg.vocab_size, self.eos_token_ids)
        self._requests: dict[str, _Request] = {}
        self._by_seq: dict[str, _Request] = {}  # by ``Sequence.request_id``
        self._ahead: _Ahead | None = None
        self.steps_launched_ahead = 0  # async scheduling: decode steps launched before the step before was sampled
        self._arrivals = itertools.count()

    def _host_blocks(self) -> int:
        """Host tier pages (``kv_offload_bytes`` per rank, in pages of the device pool's size); 0: no tier."""
        want = self.config.kv_offload_bytes
        if want < 0:
            raise ValueError(f"kv_offload_bytes must be >= 0, got {want}")
        if want and not self.config.enable_prefix_caching:
            raise ValueError("kv_offload_bytes needs prefix caching: the host tier keeps evicted cached blocks")
        pages = want // self.layout.page_bytes
        if want and pages < 1:
            raise ValueError(
                f"kv_offload_bytes={want} holds no page of {self.layout.page_bytes} bytes; give at least one page"
            )
        return pages

    def _default_kv_bytes(self) -> int:
        if not self.config.device.startswith("cuda"):
            return DEFAULT_CPU_KV_CACHE_BYTES
        free, total = torch.cuda.mem_get_info(torch.device(self.config.device))
        reserve = step_reserve_bytes(self.config, self.model.cfg.hidden_size, self.model.cfg.vocab_size)
        budget = int(total * self.config.gpu_memory_utilization) - (total - free) - reserve
        if budget <= 0:
            raise ValueError(
                f"gpu_memory_utilization {self.config.gpu_memory_utilization} leaves no room for the KV cache: "
                f"{(total - free) / 2**30:.1f} GiB in use of {total / 2**30:.1f} GiB"
            )
        return budget

    def _start_workers(self, tp: TPGroup, dtype: torch.dtype, kv_dtype: str, num_blocks: int,
                       host_blocks: int) -> ModelRunner:
        from hybridkv.engine.tp_workers import TPDriverRunner, TPWorkers, WorkerSpec
        from hybridkv.model.architectures.collectives import OneShotAllReduce

        one_shot = not self.config.disable_custom_all_reduce and OneShotAllReduce.available_here()
        if not one_shot and not self.config.disable_custom_all_reduce:
            log.warning("all-reduces go through NCCL and decode runs eagerly: this process set up the one-shot "
                        "all-reduce for an earlier tensor-parallel engine (once per process)")
        sum_slots = (0, 0)
        c, hidden = self.config, self.model.cfg.hidden_size
        if one_shot and c.prefill_overlap_tokens and self.model.supports_step_halves and copy_engine_sums_bytes(
                c.tensor_parallel_size, c.max_num_batched_tokens, hidden):
            # half a step's rows (``ModelRunner._begin_step`` cuts at n // 2), kept out of the KV cache by
            # ``step_reserve_bytes``
            sum_slots = (-(-c.max_num_batched_tokens // 2), hidden)
        spec = WorkerSpec(self.config, dtype, kv_dtype, num_blocks, self.max_model_len, one_shot,
                          host_blocks=host_blocks, sum_slots=sum_slots)
        self.workers = TPWorkers(spec, tp)
        return TPDriverRunner(self.model, self.kv, self.backend, self.workers, self.runner.copier,
                              self.config.prefill_overlap_tokens)

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

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def layer_specs(self) -> list[AttentionSpec]:
        """One spec per layer, sized for one tensor-parallel rank."""
        by_layer = {layer: group.spec for group in self.layout.groups for layer in group.layer_ids}
        return [by_layer[layer] for layer in sorted(by_layer)]

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
        self._validate_prompt(ids)
        self._validate_params(params)
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
            seq.state = RequestOutputState.create(params, ids, self.tokenizer)
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
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Token ids of a conversation rendered by the chat template, tokenized like a text prompt (with its length
        check) but without special tokens (unless ``add_special_tokens``): the template writes any BOS itself.
        ``tools`` (OpenAI's tool definitions) go to the template. ``tokenizer``: this engine's with another chat
        template."""
        tok = tokenizer or self.tokenizer
        if tok is None:
            raise ValueError("chat needs a tokenizer, and this engine has none (skip_tokenizer_init)")
        extra = {"tools": tools} if tools else {}
        text = tok.apply_chat_template(messages, add_generation_prompt, **extra)
        return self.tokenize(text, add_special_tokens=add_special_tokens)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt. Text too long for ``max_model_len`` however it tokenizes is refused before
        tokenizing it (a 20 MB prompt would take seconds to find that out)."""
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer (skip_tokenizer_init): send the prompt as token ids")
        limit = self.max_model_len * self.tokenizer.max_token_chars
        if len(text) > limit:
            raise ValueError(
                f"the prompt is {len(text):,} characters long, more than max_model_len {self.max_model_len} tokens "
                f"can hold (at most {limit:,} characters with this tokenizer)"
            )
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _validate_params(self, params: SamplingParams) -> None:
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n must be <= max_num_seqs ({self.config.max_num_seqs}), got {params.n}")
        vocab = self.model.cfg.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ())):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab})")

    def _validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt is {len(ids)} tokens long but max_model_len is {self.max_model_len}: "
                "prompt plus at least one generated token must fit"
            )
        vocab = self.model.cfg.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:  # (two C loops: 256 prompts of 512 tokens in 2 ms, not 6)
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")

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
        self._drop_dead_ahead()
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
        if self._ahead is not None:
            return self._ahead.out
        return self.scheduler.schedule()

    def execute(self, out: SchedulerOutput) -> list[RequestOutput]:
        """The second half of ``step()``: the forward pass over ``out``, sampling, outputs."""
        ahead, live = self._ahead, None
        if ahead is not None:
            if ahead.out is not out:
                raise RuntimeError("execute() takes the step schedule() returned: one was scheduled ahead")
            self._ahead = None
            # requests that finished (or were aborted) after it was scheduled have no next token
            live = [s.seq.status is SequenceStatus.RUNNING for s in out.scheduled]
            if ahead.result is None:
                out.scheduled = [s for s, ok in zip(out.scheduled, live) if ok]
                live = None
        if not out.scheduled:
            if self.scheduler.has_unfinished:
                raise RuntimeError("the scheduler could not schedule any request: KV cache accounting is broken")
            return []
        if live is not None:
            result = ahead.result  # launched ahead; its tokens were counted computed when the step before sampled
        else:
            result = self.runner.run(out)
            if result.scores is not None:
                _add_prompt_scores(out, result.scores)
            # until the sampler reads the logits, a GPU is still computing them: the host's bookkeeping goes here
            self.scheduler.on_step_done(out)
        seqs = [s.seq for s, ok in zip(out.scheduled, live or itertools.repeat(True)) if s.samples and ok]
        if live is not None and not all(live):
            result.logits = result.logits[torch.tensor(live, device=result.logits.device)]
        self._catch_up_text(seqs)
        tokens = None
        if seqs and self._may_go_ahead(out, result, seqs):
            on_device = self._tokens_on_device(seqs, result)  # the next step's input, where it is
            tokens = _start_copy_to_host(on_device)  # queued before the next step, not behind it
            self._ahead = self._schedule_ahead(seqs, on_device)
        touched = self._sample(seqs, result, tokens() if tokens else None) if seqs else ()
        if self._ahead is not None:
            self._after_sampling_ahead()
        outputs = []
        for req in touched:
            finished = req.finished
            if finished or req.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(self._request_output(req, finished))
            if finished:
                self._forget(req)
        return outputs

    # ---- async scheduling ------------------------------------------------------------------------------
    def _may_go_ahead(self, out: SchedulerOutput, result: StepOutput, seqs: list[Sequence]) -> bool:
        """Whether the next step can be scheduled before this one's tokens are read: a step in which every running
        sequence samples and none asks for logprobs, each of them sure to take one more token (not at
        max_tokens), no request waiting, and the free pool holding a new block per sequence and group (so
        scheduling it preempts nobody: a preempted sequence's placeholder would be hashed into its blocks).

        Sampled rows go ahead too: this step's penalties, grammar masks and min_tokens read the tokens up to the
        step before, all in place by now, and the sampler leaves its tokens on the device."""
        if not (self.config.async_scheduling and result.scores is None and not self.scheduler.waiting):
            return False
        if any(s.state.params.logprobs is not None for s in seqs):
            return False  # their values would be read behind the next step
        if len(seqs) != len(out.scheduled) or len(seqs) != len(self.scheduler.running):
            return False
        if self.kv.pool.num_free_blocks < len(seqs) * self.kv.num_groups:
            return False
        return all(s.num_output_tokens + 1 < s.max_tokens for s in seqs)

    def _schedule_ahead(self, seqs: list[Sequence], tokens: torch.Tensor) -> _Ahead:
        """Schedule the next step with a placeholder for each sequence's token; launch it at once, its input ids
        taken from ``tokens`` on the device, when it is a decode step of the same sequences in the same order."""
        for seq in seqs:
            seq.append_token(PLACEHOLDER)
        out = self.scheduler.schedule()
        same = (not out.preempted and len(out.scheduled) == len(seqs)
                and all(s.seq is seq and s.num_new_tokens == 1 for s, seq in zip(out.scheduled, seqs)))
        if not same:
            return _Ahead(out, None)
        self.steps_launched_ahead += 1
        return _Ahead(out, self.runner.run(out, tokens))

    def _after_sampling_ahead(self) -> None:
        """This step's tokens replaced the placeholders: the step launched ahead counts its tokens computed (which
        hashes full blocks: the real ids are in place now)."""
        if self._drop_dead_ahead() and self._ahead.result is not None:
            self.scheduler.on_step_done(self._ahead.out)

    def _drop_dead_ahead(self) -> bool:
        """Forget the step scheduled ahead if every request in it has finished (launched or not, nothing of it is
        wanted); whether one is left."""
        if self._ahead is not None and not any(s.seq.status is SequenceStatus.RUNNING
                                               for s in self._ahead.out.scheduled):
            self._ahead = None
        return self._ahead is not None

    def _sample(self, seqs: list[Sequence], step: StepOutput, tokens: list[int] | None = None) -> list[_Request]:
        """Sample a token for each of ``seqs``, record it; the requests with news (an output to give this step).
        ``tokens``: the step's argmax, taken before the step after it was launched; each replaces its sequence's
        placeholder."""
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
                seq.all_token_ids[-1] = token
            else:
                seq.append_token(token)
            state = seq.state
            lp = logprobs[i] if logprobs is not None else None
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

    def _tokens_on_device(self, seqs: list[Sequence], step: StepOutput) -> torch.Tensor:
        """The step's tokens as ``_sample`` would draw them, left on the device (async scheduling)."""
        if step.argmax_only:
            return step.logits.argmax(dim=-1)
        return self.sampler.tokens_on_device(step.logits, *self._sampler_inputs(seqs))

    def _sampler_inputs(self, seqs: list[Sequence]) -> tuple:
        """What the sampler takes besides the logits: params, prompts, outputs, generators, EOS ids, grammar mask."""
        grammars = [s.grammar for s in seqs]
        bitmask = self.structured_outputs.bitmask(grammars) if any(g is not None for g in grammars) else None
        return ([s.state.params for s in seqs], [s.prompt_token_ids for s in seqs],
                [s.state.token_ids for s in seqs],  # = output_token_ids, without slicing a copy per step
                [s.generator for s in seqs], self.eos_token_ids, bitmask)

    @staticmethod
    def _catch_up_text(seqs: list[Sequence]) -> None:
        """Detokenize what the sequences' deferred text still lacks (``RequestOutputState.pending``)."""
        for seq in seqs:
            if seq.state.pending:
                seq.state.catch_up_text()

    def _forget(self, req: _Request) -> None:
        del self._requests[req.request_id]
        for seq in req.seqs:
            del self._by_seq[seq.request_id]

    def _request_output(self, req: _Request, finished: bool) -> RequestOutput:
        outputs = []
        for i, seq in enumerate(req.seqs):
            st = seq.state
            outputs.append(
                CompletionOutput(
                    i,
                    st.text,
                    list(st.token_ids),  # a copy: a stream reads it after later steps appended to the state's
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


def _start_copy_to_host(t: torch.Tensor) -> Callable[[], list[int]]:
    """Start copying ``t`` to the host now, so that it queues before later launches on the stream rather than
    behind them; the call returned waits for the copy and gives the values."""
    if not t.is_cuda:
        return t.tolist
    host = t.to("cpu", non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def values() -> list[int]:
        copied.synchronize()
        return host.tolist()

    return values


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


def _load_rank0(config: EngineConfig, dtype: torch.dtype, tp: TPGroup) -> LoadedModel:
    return load_checkpoint(config.model, dtype, tokenizer=not config.skip_tokenizer_init, tp=tp,
                           load_format=config.load_format, device=config.device, seed=config.seed)


def _keep_4bit_weights(model: torch.nn.Module, config: EngineConfig, tp: TPGroup) -> int:
    """``quantization`` auto on CPU: a GGUF's Q4_1 linear layers packed 4-bit (``model/int4_cpu.py``), and the
    output head given an int8 copy for greedy rows (``model/int8_head_cpu.py``); returns how many linears were
    packed (0: the model runs in its dtype, its head float32 for every row)."""
    if config.quantization not in ("auto", "none"):
        raise ValueError(f"unknown quantization {config.quantization!r}; choose auto or none")
    if config.quantization == "none" or config.device != "cpu" or tp.size > 1 or not int4_kernel_available():
        return 0
    packed = pack_int4_linears(model, model.residual_branch_ends)
    if packed:
        head = model.embed_tokens if model.lm_head is None else model.lm_head
        if int8_kernel_available():
            head.argmax_head = Int8ArgmaxHead.of(head.weight)
        screen = ("the float32 head for every row (no int8 GEMM of this torch sums exactly)" if head.argmax_head is None
                  else f"greedy tokens screened by an int8 head ({head.argmax_head.kind}'s GEMM)")
        log.info("%d linear layers kept 4-bit (Q4_1 weights, bf16 activations), %s; quantization=none: float32",
                 packed, screen)
    return packed


def cpu_threads(asked: int) -> int:
    """Intra-op threads on CPU: ``asked``, or (0) half the cores this process may use, at least 1."""
    if asked < 0:
        raise ValueError(f"cpu_threads must be >= 0 (0: half the cores), got {asked}")
    return asked or max(1, len(os.sched_getaffinity(0)) // 2)


def resolve_device(device: str) -> str:
    """``auto``: CUDA when torch sees a GPU, else the CPU (as vLLM picks); an unusable device names why."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but torch sees no CUDA GPU; use cpu or auto")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"unknown device {device!r}; choose auto, cpu or cuda")
    return device


def _eos_token_ids(tokenizer, hf_config: dict) -> list[int]:
    """The tokenizer's end ids; without a tokenizer, the checkpoint config's ``eos_token_id`` (one or a list)."""
    if tokenizer is not None:
        return list(tokenizer.eos_token_ids)
    eos = text_config(hf_config).get("eos_token_id", hf_config.get("eos_token_id"))
    return [int(t) for t in (eos if isinstance(eos, list) else [eos]) if t is not None]


def _resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        # CPUs compute float32 fastest and exactly; GPUs take the checkpoint's dtype (see the GPU path).
        return torch.float32 if device == "cpu" else torch.bfloat16
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(MODEL_DTYPES)}")
    return torch_dtype(dtype)
