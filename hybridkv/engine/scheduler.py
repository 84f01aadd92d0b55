"""Continuous batching over the hybrid KV cache: a token budget per step, chunked prefill, preemption.

Every sequence has ``num_computed_tokens`` and ``num_tokens``; a step gives each scheduled sequence some of the
difference. Decodes and prefill chunks share one budget (``max_num_batched_tokens``), so the memory a step needs
is bounded by the budget, not by the longest prompt::

    budget 8: running A (decode, 1 token), B (decode, 1), waiting C (prompt 20)
    step 1: A 1, B 1, C 6     step 2: A 1, B 1, C 6     step 3: A 1, B 1, C 6     step 4: A 1, B 1, C 2 -> C samples

With ``long_prefill_token_threshold`` (CPU default: half the budget) one prompt's chunk is capped below the
budget, so a short request that arrives during a long prefill starts at the next step and its decodes go on
between the long prompt's chunks (with budget 8 and cap 4, C above would take 4 a step and leave room).

Running sequences go first, oldest first. When the pool cannot hold a running sequence's next tokens, the newest
running sequence is preempted (its blocks go back; it waits and later recomputes, helped by the prefix cache).
A waiting sequence is admitted only when its first chunk fits; otherwise it waits (first come, first served).
A sequence whose peak need exceeds the whole pool is refused when it is added (``can_ever_fit``), so the
oldest sequence alone always fits and the loop always makes progress.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hybridkv.engine.sequence import Sequence, SequenceStatus
from hybridkv.kv.cache_manager import CacheHit, KVCacheManager


@dataclass(slots=True)
class ScheduledSequence:
    seq: Sequence
    context_len: int  # computed before this step
    num_new_tokens: int
    # whether this step reaches the end of the known tokens, so the model's output is sampled
    samples: bool

    @property
    def prompt_score_positions(self) -> range:
        """Positions of this step whose logits score the next prompt token (prompt logprobs), skipping those a
        sequence recomputed after preemption scored already. The last prompt position is the sampled row."""
        if not self.seq.needs_prompt_scores:
            return range(0)
        start = max(self.context_len, self.seq.prompt_scores.num_scored)
        return range(start, min(self.context_len + self.num_new_tokens, self.seq.num_prompt_tokens - 1))


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, long_prefill_token_threshold: int = 0
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # most tokens one sequence gets in a step (0: the whole budget)
        self.max_chunk = long_prefill_token_threshold or max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        running, scheduled, max_chunk = self.running, out.scheduled, self.max_chunk
        i = 0
        while i < len(running) and budget > 0:  # (every running sequence, every step: kept lean)
            seq = running[i]
            computed = seq.num_computed_tokens
            left = len(seq.all_token_ids) - computed
            n = min(left, budget, max_chunk)
            if self._allocate_or_preempt(seq, n, out):
                scheduled.append(ScheduledSequence(seq, computed, n, n == left))
                budget -= n
                i += 1
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _allocate_or_preempt(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Allocate, preempting the newest running sequences until it fits; False if ``seq`` itself went."""
        while not self.kv.allocate_slots(seq, n):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hit = CacheHit.none(self.kv.num_groups) if seq.needs_prompt_scores else self.kv.find_cache_hit(seq)
            n = min(seq.num_uncomputed_tokens - hit.num_tokens, budget, self.max_chunk)
            if not self.kv.allocate_slots(seq, n, hit, full_sequence_must_fit=True):
                return  # first come, first served: later arrivals do not overtake it
            self.kv.record_hit(seq, hit)
            if seq.num_computed_tokens == 0 and seq.num_preemptions == 0:
                seq.num_cached_prompt_tokens = hit.num_tokens
            seq.num_computed_tokens += hit.num_tokens
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, n,
                                                   seq.num_computed_tokens + n == seq.num_tokens))
            budget -= n

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def on_step_done(self, out: SchedulerOutput) -> None:
        """Record the computed tokens (before sampled tokens are appended). A sequence that finished since the
        step was scheduled (async scheduling: the step was launched ahead) has given its blocks back: skipped."""
        computed, running = self.kv.on_tokens_computed, SequenceStatus.RUNNING
        for s in out.scheduled:
            if s.seq.status is running:
                s.seq.num_computed_tokens = s.context_len + s.num_new_tokens
                computed(s.seq)

    def finish(self, seq: Sequence) -> None:
        """A finished or aborted sequence leaves the scheduler and gives back every block it held."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        if self.kv.has_blocks(seq.request_id):
            self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
