"""Turns a scheduled step into one forward pass: flattened tokens, positions, attention metadata, logits.

``prepare`` (the driver, which owns the block tables) builds a ``StepInput``; ``execute`` runs it. Under tensor
parallelism the driver sends the same ``StepInput`` to every worker rank, which runs ``execute`` on its shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from hybridkv.engine.block_copier import BlockCopier
from hybridkv.engine.scheduler import SchedulerOutput
from hybridkv.kv.cache_manager import KVCacheManager
from hybridkv.kv.host_tier import BlockCopy
from hybridkv.model.architectures.parallel import fuse_columns
from hybridkv.model.attention.base import PagedAttentionBackend, StepSequence
from hybridkv.model.causal_lm import CausalLM


@dataclass(slots=True)
class StepInput:
    """Everything a rank needs for one step; positions follow from each sequence's context and query lengths."""

    input_ids: np.ndarray  # [T] int64, every scheduled token of every sequence, flattened
    seqs: list[StepSequence]  # per sequence: cached tokens, new tokens, block table per layer group
    sample_rows: np.ndarray  # [N] int64, the token rows whose logits are wanted
    # Host tier: page copies between device and host memory to run, in order, before this step's forward.
    block_ops: list[BlockCopy] = field(default_factory=list)

    def positions(self) -> np.ndarray:
        return np.concatenate([np.arange(s.context_len, s.context_len + s.query_len) for s in self.seqs])


class ModelRunner:
    def __init__(
        self, model: CausalLM, kv: KVCacheManager | None, backend: PagedAttentionBackend,
        copier: BlockCopier | None = None,
    ) -> None:
        fuse_columns(model)  # q/k/v and gate/up as one GEMM each: fewer launches, wider GEMMs
        self.model = model
        self.kv = kv  # None on worker ranks: they only execute
        self.backend = backend
        self.copier = copier  # this rank's host pages (None without a host tier)
        self.device = next(model.parameters()).device
        self.graphs = None  # DecodeGraphs when decode steps replay from CUDA graphs

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> bool:
        """Replay decode steps from CUDA graphs from now on, where the backend and the model both can."""
        if not (self.backend.capabilities.cuda_graphs and self.model.supports_cuda_graphs):
            return False
        from hybridkv.engine.cuda_graphs import DecodeGraphs  # CUDA only

        self.graphs = DecodeGraphs(self.model, self.backend, max_num_seqs, max_model_len)
        return True

    def run(self, out: SchedulerOutput) -> torch.Tensor:
        """Compute every scheduled token; return float32 logits ``[num sampling sequences, vocab]``.

        Rows follow ``out.scheduled`` order, skipping sequences in the middle of a chunked prefill.
        """
        return self.execute(self.prepare(out))

    def prepare(self, out: SchedulerOutput) -> StepInput:
        input_ids, seqs, last = [], [], []
        offset = 0
        for s in out.scheduled:
            start, end = s.context_len, s.context_len + s.num_new_tokens
            input_ids.extend(s.seq.all_token_ids[start:end])
            seqs.append(StepSequence(start, s.num_new_tokens, self.kv.block_tables(s.seq.request_id)))
            offset += s.num_new_tokens
            if s.samples:
                last.append(offset - 1)
        return StepInput(
            np.array(input_ids, dtype=np.int64), seqs, np.array(last, dtype=np.int64), self.kv.take_block_ops()
        )

    @torch.inference_mode()
    def execute(self, step: StepInput) -> torch.Tensor | None:
        """Logits of ``step.sample_rows``; None on tensor-parallel ranks other than 0."""
        if step.block_ops:  # host tier: before anything reads a loaded page or overwrites a written-back one
            self.copier.run(step.block_ops)
        if self.graphs is not None:
            logits = self.graphs.run(step.input_ids, step.seqs, step.sample_rows)
            if logits is not None:
                return logits
        self.backend.begin_step(step.seqs)
        hidden = self.model(
            torch.from_numpy(step.input_ids).to(self.device),
            torch.from_numpy(step.positions()).to(self.device),
            self.backend,
        )
        if not len(step.sample_rows):
            return hidden.new_empty((0, 0), dtype=torch.float32)
        return self.model.compute_logits(hidden[torch.from_numpy(step.sample_rows).to(self.device)])
