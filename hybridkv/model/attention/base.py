"""The interface between model code, the runner and attention backends.

A model's attention layer computes q, k, v for the tokens of this step (every sequence of the batch flattened
into one dimension of T tokens), applies its position encoding, then calls::

    out = backend.attend(layer_id, q, k, v, scale)     # q [T, Hq, D], k/v [T, Hkv, D] -> out [T, Hq, D]

The backend knows each layer's attention type (full, sliding, chunked) from the KV layout and which tokens of
the batch belong to which sequence from the step's metadata, so model code never sees masks, caches or block
tables. Backends: ``DenseAttention`` (no cache, whole sequences; the test oracle), ``TorchPagedAttention``
(the paged hybrid cache in plain torch; CPU and reference for GPU kernels), ``TritonPagedAttention`` (GPU).

A paged backend (``PagedAttentionBackend``) is told each step's sequences first (``begin_step``), and declares
what it can do (``BackendCapabilities``) instead of the engine finding out by its type.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import torch

from hybridkv.kernels.kv_slots import KVSlots


@dataclass(slots=True)
class StepSequence:
    """One scheduled sequence of a step, as the runner describes it to the backend (and sends to TP workers)."""

    context_len: int  # tokens already in the cache
    query_len: int  # tokens computed this step (their K/V are written now)
    block_tables: list[np.ndarray]  # per layer group
    # ``KVCacheManager.tables_version``: equal versions, equal tables (a decode step re-sends only changed ones);
    # 0: unknown, the tables are sent whole
    tables_version: int = 0
    # every query row is a generated token's (a decode step's), none a prompt's: a backend may then compute them
    # another way than a prompt's rows, always the same way (``TorchPagedAttention``'s full layers on CPU)
    generated: bool = False


@dataclass(slots=True)
class StepHalf:
    """One of the two halves a tensor-parallel prefill step runs in, so that one half's all-reduces travel while
    the other half computes (``LlamaForCausalLM.forward``): its rows of the step's tokens and the backend's step
    state for its sequences."""

    rows: slice
    state: Any


@dataclass(slots=True)
class OutputRows:
    """The token rows of a step whose final hidden states are read (its sampled rows), for a forward that runs
    its last layer's attention and MLP on those rows alone: no other row's output of that layer reaches anything
    the engine keeps. Every row still has its K/V stored in the cache, which is what later steps read.

    Each such row is the last of its sequence in the step, so it attends as a decode query at its position over
    keys the step has stored: ``state`` is the backend's ``begin_step`` state of those one-token sequences
    (``output_sequences``), None when no row is read (a chunk in the middle of a prompt).

    E.g. a step of (context 0, 8 new: a prompt's middle chunk) and (context 100, 1 new: decoding): rows [8],
    state from [(context 100, 1 new)]. For Llama-4 Scout, whose last layer is a full one, a 32K-token chunk over
    1M cached tokens skips that layer's attention over 1M keys for 32,767 of its 32,768 queries."""

    rows: torch.Tensor  # [N] int64 on the model's device, ascending
    state: Any

    def attend(self, attn: PagedAttentionBackend, layer_id: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of the output rows' queries ``q`` [N, Hq, D], once every row's K/V of ``layer_id`` is stored;
        the backend's step state is left as it was."""
        step = attn.step_state
        attn.step_state = self.state
        try:
            return attn.attend_stored(layer_id, q, scale)
        finally:
            attn.step_state = step


def output_sequences(seqs: list[StepSequence], sample_rows: np.ndarray) -> list[StepSequence] | None:
    """The one-token sequences whose attention ``OutputRows`` runs: each sequence whose last row of the step is
    sampled, as a query at that row's position over the context the step leaves. None if some sampled row is not
    the last of its sequence (then the step needs every row's output).

    E.g. (context 0, 8 new) and (context 100, 1 new), sampled rows [8]: [(context 100, 1 new)]; sampled rows
    [7, 8]: [(context 7, 1 new), (context 100, 1 new)]."""
    q = np.fromiter([s.query_len for s in seqs], np.int64, len(seqs))
    last = np.cumsum(q) - 1
    sampled = np.isin(last, sample_rows)
    if int(sampled.sum()) != len(sample_rows):
        return None
    return [replace(s, context_len=s.context_len + s.query_len - 1, query_len=1)
            for s, keep in zip(seqs, sampled) if keep]


def split_step(seqs: list[StepSequence], cut: int) -> tuple[list[StepSequence], list[StepSequence]]:
    """The step's sequences as two steps: its first ``cut`` token rows, and the rest. A sequence the cut crosses
    is in both, its second piece continuing where its first ends: layer by layer the first half writes its K/V
    before the second half's attention reads them.

    E.g. (context 0, 10 new) and (context 5, 6 new), cut 8: [(0, 8)] and [(8, 2), (5, 6)]."""
    first, second, row = [], [], 0
    for s in seqs:
        take = min(max(cut - row, 0), s.query_len)
        if take:
            first.append(replace(s, query_len=take))
        if take < s.query_len:
            second.append(replace(s, context_len=s.context_len + take, query_len=s.query_len - take))
        row += s.query_len
    return first, second


@dataclass(frozen=True, slots=True)
class BackendCapabilities:
    """What a paged backend declares about itself for one KV cache dtype."""

    cuda_graphs: bool = False  # decode steps can be captured and replayed (``enable_static_decode``)
    fp8_segments: bool = False  # an FP8 cache's long prefills are widened to bf16 segment by segment
    # the most bytes one such segment's scratch holds (0: no segments); the engine and the planner keep room
    # for it out of the KV cache (``kv.capacity.step_reserve_bytes``)
    segment_bytes: int = 0


class AttentionBackend(Protocol):
    """What model code calls."""

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        ...


class StoresKVFromKernels:
    """A backend whose step K/V another kernel may store (the position encoding's, as it writes q): the model
    asks for ``kv_slots``, has them filled, then calls ``attend_stored`` instead of ``attend``. A base class, not
    a Protocol: the model asks ``isinstance`` once per layer, and a runtime Protocol check costs 6-12 us."""

    def kv_slots(self, layer_id: int) -> KVSlots:
        raise NotImplementedError

    def attend_stored(self, layer_id: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        raise NotImplementedError


class PagedAttentionBackend(AttentionBackend, Protocol):
    """What the runner calls: a backend over the paged hybrid KV cache."""

    block_size: int
    capabilities: BackendCapabilities

    # what ``begin_step`` built, which every layer of the step reads. A step run in two halves (``StepHalf``) builds
    # both halves' states and sets the one each layer call is for.
    step_state: Any

    def begin_step(self, seqs: list[StepSequence]) -> None:
        """Build the step's metadata (write slots, what each sequence reads) once, before the forward."""
        ...

    def write(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> Any:
        """Store the step's K/V of one layer into their slots, without attending (``attend`` does both)."""
        ...

    def attend_stored(self, layer_id: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """``attend`` once the step's K/V of ``layer_id`` are stored."""
        ...
