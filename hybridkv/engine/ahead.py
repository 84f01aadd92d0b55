"""Async scheduling (``EngineConfig.async_scheduling``, on with CUDA): a greedy decode step schedules and launches
the next one before its own tokens reach the host, so the host's work of a step overlaps the GPU's
(``docs/design/decode.md#async-scheduling``). It sits beside the plain step as vLLM's ``AsyncScheduler`` sits
beside its scheduler: ``LLMEngine.execute`` hands it only a step it scheduled.

One step, n sequences, every one sampling:

1. the step's tokens are drawn on the device (``_tokens_on_device``), and their copy to the host is queued;
2. each sequence takes a placeholder token (``PLACEHOLDER``) and the next step is scheduled: when it is a decode
   step of the same sequences in the same order, it is launched at once, its input ids the tokens on the device;
3. this step's tokens reach the host and replace the placeholders; the next step's tokens count as computed
   (which hashes its full blocks: the real ids are in place now);
4. ``execute`` of the next step takes its result; rows of requests that finished meanwhile are dropped.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.device_transfer import start_copy_to_host
from hybridkv.engine.model_runner import ModelRunner, StepOutput
from hybridkv.engine.scheduler import Scheduler, SchedulerOutput
from hybridkv.engine.sequence import Sequence, SequenceStatus
from hybridkv.kv.cache_manager import KVCacheManager

# stands for a sampled token still on the device: never a real id, never hashed or fed as one
PLACEHOLDER = -1


@dataclass(slots=True)
class AheadStep:
    """The next step, scheduled while this step's tokens were still on the device, and its result when it was
    launched then too (``None``: it runs when ``execute`` gets it, as any step)."""

    out: SchedulerOutput
    result: StepOutput | None


class Engine(Protocol):
    """What the steps ahead use of ``LLMEngine``."""

    config: EngineConfig
    scheduler: Scheduler
    kv: KVCacheManager
    runner: ModelRunner

    def tokens_on_device(self, seqs: list[Sequence], step: StepOutput) -> torch.Tensor: ...

    def sample(self, seqs: list[Sequence], step: StepOutput, tokens: list[int] | None = None) -> list[Any]: ...


class AheadSteps:
    """The engine's step scheduled ahead (``pending``), and how many were launched ahead."""

    def __init__(self, engine: Engine) -> None:
        # a proxy: the engine owns this object, and a strong reference back would make a cycle that keeps the
        # engine (its KV cache, the GPU's memory) alive after the user drops it, until the cycle collector runs
        self.engine = weakref.proxy(engine)
        self.pending: AheadStep | None = None
        self.steps_launched = 0  # decode steps launched before the step before was sampled

    def take(self, out: SchedulerOutput) -> tuple[list[Sequence], StepOutput] | None:
        """``out`` was scheduled ahead and launched: its sampling sequences still running, and its result (its
        logits without the rows of those that finished since). Scheduled but not launched: its finished rows are
        dropped, and it runs as a plain step (None). Not scheduled ahead: None."""
        pending = self.pending
        if pending is None:
            return None
        if pending.out is not out:
            raise RuntimeError("execute() takes the step schedule() returned: one was scheduled ahead")
        self.pending = None
        # requests that finished (or were aborted) after it was scheduled have no next token
        live = [s.seq.status is SequenceStatus.RUNNING for s in out.scheduled]
        if pending.result is None:
            out.scheduled = [s for s, ok in zip(out.scheduled, live) if ok]
            return None
        result = pending.result  # its tokens were counted computed when the step before sampled
        seqs = [s.seq for s, ok in zip(out.scheduled, live) if s.samples and ok]
        if not all(live):
            result.logits = result.logits[torch.tensor(live, device=result.logits.device)]
        return seqs, result

    def may_go_ahead(self, out: SchedulerOutput, result: StepOutput, seqs: list[Sequence]) -> bool:
        """Whether the next step can be scheduled before this one's tokens are read: a step in which every running
        sequence samples and none asks for logprobs, each of them sure to take one more token (not at
        max_tokens), no request waiting, and the free pool holding a new block per sequence and group (so
        scheduling it preempts nobody: a preempted sequence's placeholder would be hashed into its blocks).

        Sampled rows go ahead too: this step's penalties, grammar masks and min_tokens read the tokens up to the
        step before, all in place by now, and the sampler leaves its tokens on the device."""
        engine = self.engine
        if not (engine.config.async_scheduling and result.scores is None and not engine.scheduler.waiting):
            return False
        if any(s.state.params.logprobs is not None for s in seqs):
            return False  # their values would be read behind the next step
        if len(seqs) != len(out.scheduled) or len(seqs) != len(engine.scheduler.running):
            return False
        if engine.kv.pool.num_free_blocks < len(seqs) * engine.kv.num_groups:
            return False
        return all(s.num_output_tokens + 1 < s.max_tokens for s in seqs)

    def sample_and_launch(self, seqs: list[Sequence], result: StepOutput) -> list[Any]:
        """Steps 1 to 3 above: ``engine._sample``'s requests with news."""
        on_device = self.engine.tokens_on_device(seqs, result)  # the next step's input, where it is
        tokens = start_copy_to_host(on_device)  # queued before the next step, not behind it
        self.pending = self._schedule(seqs, on_device)
        touched = self.engine.sample(seqs, result, tokens())
        if self.drop_if_finished() and self.pending.result is not None:
            self.engine.scheduler.on_step_done(self.pending.out)
        return touched

    def _schedule(self, seqs: list[Sequence], tokens: torch.Tensor) -> AheadStep:
        """Schedule the next step with a placeholder for each sequence's token; launch it at once, its input ids
        taken from ``tokens`` on the device, when it is a decode step of the same sequences in the same order."""
        for seq in seqs:
            seq.append_token(PLACEHOLDER)
        out = self.engine.scheduler.schedule()
        same = (not out.preempted and len(out.scheduled) == len(seqs)
                and all(s.seq is seq and s.num_new_tokens == 1 for s, seq in zip(out.scheduled, seqs)))
        if not same:
            return AheadStep(out, None)
        self.steps_launched += 1
        return AheadStep(out, self.engine.runner.run(out, tokens))

    def drop_if_finished(self) -> bool:
        """Forget the step scheduled ahead if every request in it has finished (launched or not, nothing of it is
        wanted); whether one is left."""
        if self.pending is not None and not any(s.seq.status is SequenceStatus.RUNNING
                                                for s in self.pending.out.scheduled):
            self.pending = None
        return self.pending is not None
