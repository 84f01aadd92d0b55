"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step launches every kernel of every layer from Python; on a Llama-4 Scout rank at 1M context that was
68 ms of CPU for 10 ms of GPU work (torch profiler, eager). A captured graph launches them all at once. Batches are
padded up to the next bucket (1, 2, 4, 8, ...); padding rows attend to nothing and write into the null block.

Prefill and mixed steps stay eager. ``EngineConfig(enforce_eager=True)`` turns graphs off.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from hybridkv.model.attention.triton_paged import TritonPagedAttention
from hybridkv.model.causal_lm import CausalLM

log = logging.getLogger("hybridkv")
TABLE_BUDGET_BYTES = 512 << 20  # static block tables grow with batch x max_model_len: cap the batch they allow


class DecodeGraphs:
    def __init__(self, model: CausalLM, backend: TritonPagedAttention, max_num_seqs: int,
                 max_model_len: int) -> None:
        self.model = model
        self.backend = backend
        width = -(-max_model_len // backend.block_size)
        by_tables = TABLE_BUDGET_BYTES // (width * 4 * len(backend.layout.groups))
        most = max(1, min(max_num_seqs, by_tables, model.max_graph_tokens))
        self.buckets = sorted({min(1 << i, most) for i in range(most.bit_length() + 1)})
        self.max_seqs = self.buckets[-1]
        device = backend.device
        backend.enable_static_decode(self.max_seqs, max_model_len)
        self.input_ids = torch.zeros(self.max_seqs, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_seqs, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.replays = 0
        self._capture()
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for size in reversed(self.buckets):  # largest first: the smaller ones reuse its memory pool
            self.backend.begin_static_decode([], size)
            self._forward(size)  # warm-up: compiles kernels, caches per-device constants
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph

    def _forward(self, size: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.backend)
        return self.model.compute_logits(hidden)

    def run(self, input_ids: np.ndarray, seqs: list, sample_rows: np.ndarray) -> torch.Tensor | None:
        """Logits of a decode step from its graph, or None if this step is not a decode step that fits."""
        n = len(seqs)
        if not 0 < n <= self.max_seqs or len(sample_rows) != n or any(s.query_len != 1 for s in seqs):
            return None
        size = next(b for b in self.buckets if b >= n)
        self.input_ids[:n].copy_(torch.from_numpy(input_ids))
        self.positions[:n].copy_(torch.from_numpy(np.array([s.context_len for s in seqs], dtype=np.int64)))
        self.backend.begin_static_decode(seqs, size)
        self.graphs[size].replay()
        self.replays += 1
        return self.logits[size][:n]
