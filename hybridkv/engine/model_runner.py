"""Turns a scheduled step into one forward pass: flattened tokens, positions, attention metadata, logits.

``prepare`` (the driver, which owns the block tables) builds a ``StepInput``; ``execute`` runs it. Under tensor
parallelism the driver sends the same ``StepInput`` to every worker rank, which runs ``execute`` on its shard.

Prompt logprobs come from the same forward: the hidden states of the prompt positions a step computes go through
the LM head ``SCORE_ROWS`` rows at a time and only each row's scores are kept, so a long prompt costs no more
memory than a batch of sampled rows, and a step without such requests computes nothing extra. Without them, the
step's last layer runs past its K/V only for the sampled rows (``OutputRows``): a prompt's middle chunk skips that
layer's attention and MLP, and its last chunk computes them for one row.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from hybridkv.engine.block_copier import BlockCopier
from hybridkv.engine.device_transfer import host_to_device
from hybridkv.engine.sampler import TokenScores, score_tokens
from hybridkv.engine.scheduler import SchedulerOutput
from hybridkv.kv.cache_manager import KVCacheManager
from hybridkv.kv.host_tier import BlockCopy
from hybridkv.model.architectures.parallel import fuse_columns
from hybridkv.model.attention.base import (
    OutputRows, PagedAttentionBackend, StepHalf, StepSequence, output_sequences, split_step,
)
from hybridkv.model.causal_lm import CausalLM
from hybridkv.model.int4_cpu import row_paths_of

log = logging.getLogger("hybridkv")


@dataclass(slots=True)
class StepInput:
    """Everything a rank needs for one step; positions follow from each sequence's context and query lengths."""

    input_ids: np.ndarray  # [T] int64, every scheduled token of every sequence, flattened
    seqs: list[StepSequence]  # per sequence: cached tokens, new tokens, block table per layer group
    sample_rows: np.ndarray  # [N] int64, the token rows whose logits are wanted
    # Host tier: page copies between device and host memory to run, in order, before this step's forward.
    block_ops: list[BlockCopy] = field(default_factory=list)
    # Prompt logprobs: the token rows to score, the token each row scores (the next prompt token), the top k
    score_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    score_token_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    score_top_k: int = 0
    # every sampled row takes the plain argmax of its logits (``SamplingParams.argmax_only``)
    argmax_only: bool = False
    # async scheduling: the token ids, still on the device, that stand in for ``input_ids``' placeholders (a decode
    # step launched before the step before it was sampled: row i's token is that step's sampled row i)
    device_input_ids: torch.Tensor | None = None
    # under tensor parallelism: ``device_input_ids`` are on rank 0 only; every rank's ``execute`` takes them from
    # rank 0 first (a broadcast), since a worker's step reaches it pickled, without them
    ids_from_rank0: bool = False
    # [T] bool: row t is a prompt token's (a 4-bit CPU model runs those through its bf16 weights: ``RowPaths``);
    # built only for such a model
    prompt_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))

    def positions(self) -> np.ndarray:
        """Each token row's position: its sequence's context length plus its index among the sequence's rows (one
        numpy pass, not an arange per sequence: 256 decode rows cost 150 us that way)."""
        n = len(self.seqs)
        ctx = np.fromiter([s.context_len for s in self.seqs], np.int64, n)
        q = np.fromiter([s.query_len for s in self.seqs], np.int64, n)
        if (q == 1).all():  # a decode step
            return ctx
        starts = np.cumsum(q) - q  # each sequence's first row
        return np.arange(int(q.sum()), dtype=np.int64) + np.repeat(ctx - starts, q)


# Rows per LM-head call when scoring prompt positions: float32 logits and their log-softmax of this many rows stay
# within the step reserve's share for sampled rows (``kv/capacity.py``: max_num_seqs, 256 by default, x 3 copies).
SCORE_ROWS = 256


@dataclass(slots=True)
class StepOutput:
    logits: torch.Tensor | None  # float32 [sampled rows, vocab]; None on tensor-parallel ranks other than 0
    scores: TokenScores | None = None  # of ``StepInput.score_rows`` (rank 0), None when the step scored none
    argmax_only: bool = False  # ``StepInput.argmax_only``: the sampler takes each row's argmax


class ModelRunner:
    def __init__(
        self, model: CausalLM, kv: KVCacheManager | None, backend: PagedAttentionBackend,
        copier: BlockCopier | None = None, halves_from_tokens: int = 0,
    ) -> None:
        """``halves_from_tokens``: tensor-parallel steps of at least this many tokens run in two halves (0: none;
        ``EngineConfig.prefill_overlap_tokens``)."""
        fuse_columns(model)  # q/k/v and gate/up as one GEMM each: fewer launches, wider GEMMs
        self.model = model
        self.kv = kv  # None on worker ranks: they only execute
        self.backend = backend
        self.copier = copier  # this rank's host pages (None without a host tier)
        self.halves_from_tokens = halves_from_tokens if model.tp.size > 1 and model.supports_step_halves else 0
        self.device = next(model.parameters()).device
        self.graphs = None  # DecodeGraphs when decode steps replay from CUDA graphs
        # a step's last layer computes only its sampled rows (``OutputRows``); off only to measure what it saves
        self.output_rows_only = True
        # a 4-bit CPU model's choice of kernel by row (``int4_cpu.RowPaths``), set each step; None: no such model
        self.row_paths = row_paths_of(model)

    @property
    def can_capture(self) -> bool:
        return self.backend.capabilities.cuda_graphs and self.model.supports_cuda_graphs

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> bool:
        """Replay decode steps from CUDA graphs from now on, where the backend and the model both can."""
        if not self.can_capture:
            return False
        from hybridkv.engine.cuda_graphs import DecodeGraphs  # CUDA only

        if not DecodeGraphs.possible(self.model):
            log.info("decode steps run eagerly: tensor-parallel CUDA graphs need the one-shot all-reduce")
            return False
        self.graphs = DecodeGraphs(self.model, self.backend, max_num_seqs, max_model_len)
        return True

    def run(self, out: SchedulerOutput, device_input_ids: torch.Tensor | None = None) -> StepOutput:
        """Compute every scheduled token; return float32 logits ``[num sampling sequences, vocab]`` and the
        scores of the prompt positions asked for (``ScheduledSequence.prompt_score_positions``, in order).

        Logits rows follow ``out.scheduled`` order, skipping sequences in the middle of a chunked prefill.
        ``device_input_ids``: see ``StepInput`` (one rank only).
        """
        step = self.prepare(out)
        step.device_input_ids = device_input_ids
        return self.execute(step)

    def prepare(self, out: SchedulerOutput) -> StepInput:
        input_ids, seqs, last, score_rows, score_ids, prompt_counts = [], [], [], [], [], []
        offset, top_k, argmax_only = 0, 0, True
        step_tables = self.kv.step_tables
        for s in out.scheduled:  # (every sequence, every step: kept lean)
            seq, start, n = s.seq, s.context_len, s.num_new_tokens
            if n == 1:
                input_ids.append(seq.all_token_ids[start])
            else:
                input_ids.extend(seq.all_token_ids[start : start + n])
            prompt = min(max(seq.num_prompt_tokens - start, 0), n)  # its first rows are a prompt's
            seqs.append(StepSequence(start, n, *step_tables(seq.request_id), generated=not prompt))
            prompt_counts.append(prompt)
            scored = s.prompt_score_positions if seq.prompt_scores is not None else None
            if scored:
                score_rows.extend(range(offset + scored.start - start, offset + scored.stop - start))
                score_ids.extend(seq.prompt_token_ids[scored.start + 1 : scored.stop + 1])
                top_k = max(top_k, seq.prompt_scores.top_k)
            offset += n
            if s.samples:
                last.append(offset - 1)
                argmax_only = argmax_only and seq.state.argmax_only
        step = StepInput(
            np.array(input_ids, dtype=np.int64), seqs, np.array(last, dtype=np.int64), self.kv.take_block_ops(),
            np.array(score_rows, dtype=np.int64), np.array(score_ids, dtype=np.int64), top_k, argmax_only,
        )
        if self.row_paths is not None:
            step.prompt_rows = _prompt_rows(prompt_counts, [s.query_len for s in seqs])
        return step

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        """Logits of ``step.sample_rows`` and scores of ``step.score_rows`` (None on tensor-parallel ranks other
        than 0)."""
        if step.block_ops:  # host tier: before anything reads a loaded page or overwrites a written-back one
            self.copier.run(step.block_ops)
        if step.ids_from_rank0:
            step.device_input_ids = self.model.tp.from_rank0(step.device_input_ids, len(step.seqs), self.device)
        bucket = self.graph_bucket(step)
        if bucket is not None:  # logits None on tensor-parallel ranks other than 0, as eager
            return StepOutput(self.graphs.replay(bucket, step.input_ids, step.seqs, step.device_input_ids),
                              argmax_only=step.argmax_only)
        decoding = _decoding(step) if self.model.decodes_apart and step.device_input_ids is None else None
        if decoding is not None and 0 < decoding.sum() < len(step.seqs):
            rows, scores = self._forward_apart(step, decoding)
        else:
            rows, scores = self._forward(step)
        if not len(step.sample_rows):
            return StepOutput(rows.new_empty((0, 0), dtype=torch.float32), scores)
        return StepOutput(self.model.compute_logits(rows, step.argmax_only), scores, step.argmax_only)

    def _forward(self, step: StepInput) -> tuple[torch.Tensor, TokenScores | None]:
        """The final hidden states of ``step.sample_rows`` [N, hidden], and the scores of ``step.score_rows``."""
        if self.row_paths is not None:
            self.row_paths.set(step.prompt_rows, step.sample_rows)
        input_ids = step.device_input_ids
        if input_ids is None:
            input_ids = self._on_device(step.input_ids)
        positions = self._on_device(step.positions())
        outputs = self._output_rows(step)  # before ``_begin_step``: the step's own state is the current one
        halves = self._begin_step(step)
        extra = {"halves": halves} if halves else {}
        if outputs is not None:
            extra["outputs"] = outputs
        hidden = self.model(input_ids, positions, self.backend, **extra)
        scores = self._score(hidden, step) if len(step.score_rows) else None
        return (hidden if outputs is not None else hidden[self._on_device(step.sample_rows)]), scores

    def _forward_apart(self, step: StepInput, decoding: np.ndarray) -> tuple[torch.Tensor, TokenScores | None]:
        """``_forward`` of a step of decoding and other sequences (``decoding`` [sequences] bool) on a model that
        computes a generated token's row its own way (``CausalLM.decodes_apart``): the decoding sequences in one
        forward, the others in another, so each row is computed as in a step of its kind alone (sequences attend
        only to their own blocks: the two forwards are the step's). Their sampled rows come back in the step's
        order; the scores are the others' (a decoding row scores no prompt position)."""
        parts = [_part(step, decoding == kind) for kind in (True, False)]
        (decoded, _), (others, scores) = (self._forward(part) for part in parts)
        in_decoding = np.repeat(decoding, [s.query_len for s in step.seqs])[step.sample_rows]
        order = np.empty(len(step.sample_rows), dtype=np.int64)
        order[in_decoding] = np.arange(int(in_decoding.sum()))
        order[~in_decoding] = np.arange(int(in_decoding.sum()), len(step.sample_rows))
        return torch.cat((decoded, others))[self._on_device(order)], scores

    def _output_rows(self, step: StepInput) -> OutputRows | None:
        """The sampled rows, for a forward whose last layer computes only them (``OutputRows``), when the step has
        other rows and scores none of its prompt positions (their scores need every row's hidden state)."""
        if not self.output_rows_only or len(step.score_rows) or len(step.sample_rows) == len(step.input_ids):
            return None
        seqs = output_sequences(step.seqs, step.sample_rows)
        if seqs is None:
            return None
        state = None
        if seqs:
            self.backend.begin_step(seqs)
            state = self.backend.step_state
        return OutputRows(self._on_device(step.sample_rows), state)

    def _on_device(self, values: np.ndarray) -> torch.Tensor:
        """A step's host array on this rank's device (``host_to_device``)."""
        return host_to_device(torch.from_numpy(values), self.device)

    def graph_bucket(self, step: StepInput) -> tuple[int, bool] | None:
        """The decode graph that replays ``step``, or None: it runs eagerly."""
        if self.graphs is None or len(step.score_rows):
            return None
        return self.graphs.bucket(step.seqs, step.sample_rows)

    def _begin_step(self, step: StepInput) -> list[StepHalf] | None:
        """The step's attention metadata; a tensor-parallel step of ``halves_from_tokens`` or more gets it for each
        half of its token rows, and is run in those halves (see ``StepHalf``)."""
        n = len(step.input_ids)
        if not self.halves_from_tokens or n < max(2, self.halves_from_tokens):  # each half needs a token
            self.backend.begin_step(step.seqs)
            return None
        halves = []
        for rows, seqs in zip((slice(0, n // 2), slice(n // 2, n)), split_step(step.seqs, n // 2)):
            self.backend.begin_step(seqs)
            halves.append(StepHalf(rows, self.backend.step_state))
        return halves

    def _score(self, hidden: torch.Tensor, step: StepInput) -> TokenScores | None:
        """Every rank takes part in each LM-head call (under TP it gathers the vocabulary slices to rank 0)."""
        rows = self._on_device(step.score_rows)
        token_ids = self._on_device(step.score_token_ids)
        parts = []
        for i in range(0, len(rows), SCORE_ROWS):
            logits = self.model.compute_logits(hidden[rows[i : i + SCORE_ROWS]])
            if logits is not None:
                parts.append(score_tokens(logits, token_ids[i : i + SCORE_ROWS], step.score_top_k))
        return TokenScores.concat(parts) if parts else None


def _decoding(step: StepInput) -> np.ndarray:
    """[sequences] bool: the sequence computes one generated token this step (it is decoding)."""
    return np.fromiter((s.generated and s.query_len == 1 for s in step.seqs), bool, len(step.seqs))


def _part(step: StepInput, keep: np.ndarray) -> StepInput:
    """The step of the sequences ``keep`` [sequences] says: their rows, sampled and scored rows renumbered, in order
    (the step's block copies are run before its forwards).

    E.g. sequences of 3 and 1 rows, sampled rows [2, 3], keep [False, True]: input row 3 alone, sampled row [0]."""
    rows = np.repeat(keep, [s.query_len for s in step.seqs])
    new = np.cumsum(rows) - 1  # a kept row's index among the kept ones
    sampled, scored = step.sample_rows[rows[step.sample_rows]], rows[step.score_rows]
    return StepInput(step.input_ids[rows], [s for s, k in zip(step.seqs, keep) if k], new[sampled],
                     score_rows=new[step.score_rows[scored]], score_token_ids=step.score_token_ids[scored],
                     score_top_k=step.score_top_k, argmax_only=step.argmax_only,
                     prompt_rows=step.prompt_rows[rows] if len(step.prompt_rows) else step.prompt_rows)


def _prompt_rows(prompt_counts: list[int], query_lens: list[int]) -> np.ndarray:
    """[T] bool of a step's rows: True for a prompt token's. Each sequence's first ``prompt_counts[i]`` of its
    ``query_lens[i]`` rows are. E.g. counts [3, 0], lens [3, 1]: [True, True, True, False]."""
    lens = np.asarray(query_lens, dtype=np.int64)
    starts = np.cumsum(lens) - lens
    return np.arange(int(lens.sum())) < np.repeat(starts + np.asarray(prompt_counts, dtype=np.int64), lens)
