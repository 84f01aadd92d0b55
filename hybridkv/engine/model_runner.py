"""Turns a scheduled step into one forward pass: flattened tokens, positions, attention metadata, logits."""

from __future__ import annotations

import torch

from hybridkv.engine.scheduler import SchedulerOutput
from hybridkv.kv.cache_manager import KVCacheManager
from hybridkv.model.attention.torch_paged import StepSequence, TorchPagedAttention


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVCacheManager, backend: TorchPagedAttention) -> None:
        self.model = model
        self.kv = kv
        self.backend = backend
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> torch.Tensor:
        """Compute every scheduled token; return float32 logits ``[num sampling sequences, vocab]``.

        Rows follow ``out.scheduled`` order, skipping sequences in the middle of a chunked prefill.
        """
        input_ids, positions, step, last = [], [], [], []
        offset = 0
        for s in out.scheduled:
            start, end = s.context_len, s.context_len + s.num_new_tokens
            input_ids.extend(s.seq.all_token_ids[start:end])
            positions.extend(range(start, end))
            step.append(StepSequence(start, s.num_new_tokens, self.kv.block_tables(s.seq.request_id)))
            offset += s.num_new_tokens
            if s.samples:
                last.append(offset - 1)
        self.backend.begin_step(step)
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            self.backend,
        )
        if not last:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        return self.model.compute_logits(hidden[torch.tensor(last, device=self.device)])
