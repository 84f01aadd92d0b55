"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (two for the smallest buckets).

A decode step launches every kernel of every layer from Python; on a Llama-4 Scout rank at 1M context that was
68 ms of CPU for 10 ms of GPU work (torch profiler, eager). A captured graph launches them all at once. Batches are
padded up to the next bucket (1, 2, 4, 8, ...); padding rows attend to nothing and write into the null block.
Buckets of 1-2 rows get a second graph for steps whose reach is long (``TritonPagedAttention.many_keys``): its
full layers read 128-key tiles where the first graph's read 64-key ones. Graphs are keyed ``(bucket, many)``.

Prefill and mixed steps stay eager. ``EngineConfig(enforce_eager=True)`` turns graphs off.

Under tensor parallelism every rank captures the same buckets in the same order and replays the same bucket each
step. The graphs hold the all-reduces only through the one-shot path (``collectives.py``), never NCCL: torch's
``destroy_process_group`` hangs once NCCL work was captured in a graph (pytorch#115388), and NCCL documents
deadlocks between graphs of several communicators. So the buckets stop where a step's messages outgrow the
one-shot buffer, and a graph ends at the logits only where the vocabulary slices' logits fit it too (Scout/4 over
2 GPUs: up to 4 rows); larger graphs end at the final hidden states, the logits computed and gathered after the
replay, eagerly. Without the one-shot path (``disable_custom_all_reduce``, or GPUs that cannot
reach each other's memory) decode stays eager.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from hybridkv.model.architectures.parallel import vocab_rows_per_rank
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
        most = max(1, min(max_num_seqs, by_tables, model.max_graph_tokens, self.one_shot_tokens(model)))
        self.buckets = sorted({min(1 << i, most) for i in range(most.bit_length() + 1)})
        self.max_seqs = self.buckets[-1]
        backend.enable_static_decode(self.max_seqs, max_model_len)
        # int32, in the backend's metadata rows: one pinned copy a step carries them with the metadata
        self.input_ids, self.positions = backend.static_inputs()
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], torch.Tensor | None] = {}  # logits or final hidden states
        self.ends_at_logits = {size: self._logits_fit(size) for size in self.buckets}
        self.replays = 0
        self.last: tuple[int, bool] | None = None  # the graph replayed last (tools time it alone)
        self._capture()
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    @staticmethod
    def possible(model: CausalLM) -> bool:
        """One rank, or tensor-parallel ranks whose all-reduces can stay out of NCCL (see the module docstring)."""
        return model.tp.size == 1 or model.tp.one_shot is not None

    @staticmethod
    def one_shot_tokens(model: CausalLM) -> int:
        """Most tokens a step's all-reduces ([tokens, hidden]) carry through the one-shot buffer; no bound at TP 1."""
        if model.tp.size == 1:
            return 1 << 30
        item = next(model.parameters()).element_size()
        return model.tp.one_shot.max_bytes // (model.cfg.hidden_size * item)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for size in reversed(self.buckets):  # largest first: the smaller ones reuse its memory pool
            for many in self.backend.static_variants(size):
                self.backend.begin_static_decode([], size, many=many)
                self._forward(size)  # warm-up: compiles kernels, caches per-device constants
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size, many] = self._forward(size)
                pool = graph.pool()
                self.graphs[size, many] = graph

    def _logits_fit(self, size: int) -> bool:
        """The graph of ``size`` rows ends at the logits (one rank; or its vocabulary slices gathered one-shot),
        else at the final hidden states, the logits computed and gathered after the replay."""
        tp = self.model.tp
        return tp.size == 1 or tp.gathers_one_shot(size, vocab_rows_per_rank(self.model.cfg.vocab_size, tp.size),
                                                   torch.float32)

    def _forward(self, size: int) -> torch.Tensor | None:
        """Logits (None on tensor-parallel ranks other than 0), or the final hidden states (``ends_at_logits``)."""
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.backend)
        return self.model.compute_logits(hidden) if self.ends_at_logits[size] else hidden

    def bucket(self, seqs: list, sample_rows: np.ndarray) -> tuple[int, bool] | None:
        """The graph that runs this step, ``(bucket, many)``: the smallest bucket holding its batch, and whether
        the step's reach is long (``many_keys``); or None if it is not a decode step that fits. A function of the
        step alone: under tensor parallelism every rank picks the same graph."""
        n = len(seqs)
        if not 0 < n <= self.max_seqs or len(sample_rows) != n or any(s.query_len != 1 for s in seqs):
            return None
        size = next(b for b in self.buckets if b >= n)
        return size, (size, True) in self.graphs and self.backend.many_keys(seqs)

    def replay(self, key: tuple[int, bool], input_ids: np.ndarray, seqs: list,
               device_input_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits of a decode step from graph ``key`` (``bucket``; None on tensor-parallel ranks other than 0).
        ``device_input_ids`` (async scheduling): the token ids, on the device, copied over ``input_ids`` after the
        step's metadata copy."""
        n, (size, many) = len(seqs), key
        self.backend.begin_static_decode(seqs, size, input_ids, many)
        if device_input_ids is not None:
            self.input_ids[:n].copy_(device_input_ids)
        self.graphs[key].replay()
        self.replays += 1
        self.last = key
        out = self.outputs[key]
        if not self.ends_at_logits[size]:
            return self.model.compute_logits(out[:n])  # the hidden states (see _forward)
        return None if out is None else out[:n]
