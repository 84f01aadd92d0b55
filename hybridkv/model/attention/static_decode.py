"""The buffers a decode step replayed from a CUDA graph reads (``StaticDecode``), and how each step's values are
written into them in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from hybridkv.kv.layout import KVLayout
from hybridkv.model.attention.base import StepSequence
from hybridkv.model.attention.triton_step import TritonStepState


@dataclass(slots=True)
class StaticDecode:
    """The buffers a captured decode step reads. The per-sequence vectors are rows of one device tensor
    (``rows``), written each step by one copy from a pinned mirror (``host``): 5 + 2 x groups small copies cost
    more host time than the whole decode step's GPU work at batch 1. Block tables change only when a sequence
    gets a new block (or drops one out of its window), so a row is looked at only when its sequence's
    ``tables_version`` differs from the one written there, and only the entries that differ are copied, from a
    host mirror of the device tables (``mirror``; plain memory: it is as large as the tables, and a few entries
    a step copy as fast from it)."""

    rows: torch.Tensor  # [6 + 2 * groups, max_seqs] int32 on the device (the last row: the step's token ids)
    host: torch.Tensor  # its pinned mirror (plain memory without CUDA)
    copied: torch.cuda.Event | None  # the last copy from ``host``: done before ``host`` is written again
    tables: list[torch.Tensor]  # per group [max_seqs, max blocks] int32
    mirror: np.ndarray  # [groups, max_seqs, max blocks]: what ``tables`` hold; a row is its table, then zeros
    host_np: np.ndarray  # ``host``'s memory, for numpy
    order: np.ndarray  # [max_seqs] int32: 0, 1, 2, ...
    ends: list[np.ndarray]  # per group [max_seqs]: past this entry a row of ``mirror`` is all zeros
    versions: list[int]  # per row: the ``tables_version`` written there (0: none known)
    max_model_len: int
    block_size: int
    group_ids: list[int]  # the layout's layer groups, in order
    # per graph, (padded batch size, many): the step state its every replay reads (views of the buffers above)
    steps: dict[tuple[int, bool], TritonStepState] = field(default_factory=dict)

    @classmethod
    def allocate(cls, layout: KVLayout, max_seqs: int, max_model_len: int, device: torch.device) -> StaticDecode:
        width = -(-max_model_len // layout.block_size)
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.int32, device=device)  # noqa: E731
        groups = len(layout.groups)
        rows = zeros(6 + 2 * groups, max_seqs)
        host = torch.zeros(rows.shape, dtype=torch.int32, pin_memory=rows.is_cuda)
        return cls(
            rows=rows, host=host, copied=None, tables=[zeros(max_seqs, width) for _ in range(groups)],
            mirror=np.zeros((groups, max_seqs, width), dtype=np.int32), host_np=host.numpy(),
            order=np.arange(max_seqs, dtype=np.int32),
            ends=[np.zeros(max_seqs, dtype=np.int64) for _ in range(groups)], versions=[0] * max_seqs,
            max_model_len=max_model_len, block_size=layout.block_size, group_ids=[g.group_id for g in layout.groups],
        )

    @property
    def seq(self) -> list[torch.Tensor]:  # tile_seq, tile_q0, q_loc, q_len, ctx_len: [max_seqs]
        return list(self.rows[:5])

    @property
    def token_ids(self) -> torch.Tensor:
        return self.rows[-1]

    def slot_block(self, g: int) -> torch.Tensor:
        return self.rows[5 + 2 * g]

    def slot_offset(self, g: int) -> torch.Tensor:
        return self.rows[6 + 2 * g]

    def write_step(self, seqs: list[StepSequence], padded: int, token_ids: np.ndarray | None) -> None:
        """A decode step's metadata (one new token per sequence) and its sequences' new ``token_ids``, padded to
        ``padded`` rows, in one copy to the device."""
        n, bs = len(seqs), self.block_size
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has read ``host``
        host, groups = self.host_np, len(self.group_ids)
        host[:, :padded] = 0
        ctx = host[4, :n]
        ctx[:] = [s.context_len for s in seqs]
        host[0, :padded] = host[2, :padded] = self.order[:padded]  # tile_seq, q_loc
        host[3, :n] = 1  # q_len
        if token_ids is not None:
            host[-1, :n] = token_ids
        known = self.versions
        rows = [i for i, s in enumerate(seqs) if s.tables_version == 0 or s.tables_version != known[i]]
        if rows:  # the rows whose tables changed
            for g, group_id in enumerate(self.group_ids):
                self.write_tables(g, rows, [seqs[i].block_tables[group_id] for i in rows])
            for i in rows:
                known[i] = seqs[i].tables_version
        # every group's slot block (the tables' entries, just written) and slot offset: rows 5, 7, ... and 6, 8, ...
        host[5 : 5 + 2 * groups : 2, :n] = self.mirror[:, self.order[:n], ctx // bs]
        host[6 : 6 + 2 * groups : 2, :n] = ctx % bs
        self.rows.copy_(self.host, non_blocking=True)
        if self.rows.is_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()

    def write_tables(self, g: int, rows: list[int], tables: list[np.ndarray]) -> None:
        """Rows ``rows`` of group ``g``'s device table become ``tables``, each followed by zeros. Only the entries
        that differ from the host mirror travel (a decode step that crossed into a new block: its last entry), every
        row's together: one copy of their span, or where they lie apart one copy and one scatter, however many rows
        changed (sequences decoding in lockstep cross into new blocks at the same step: 256 rows at once)."""
        mirror, ends, width = self.mirror[g], self.ends[g], self.mirror.shape[2]
        changed = []
        for row, table in zip(rows, tables):
            have, n, end = mirror[row], len(table), int(ends[row])
            cols = np.flatnonzero(have[:n] != table)
            if len(cols):
                have[cols] = table[cols]
                changed.append(cols + row * width)
            if end > n:  # the row held a longer table
                have[n:end] = 0
                changed.append(np.arange(row * width + n, row * width + end))
            ends[row] = n
        if not changed:
            return
        at = np.concatenate(changed) if len(changed) > 1 else changed[0]
        lo, hi = int(at[0]), int(at[-1]) + 1
        # from plain memory a copy is staged before it returns: the mirror may change right after
        if hi - lo <= 2 * len(at):  # one span (a single row's new entries): a plain copy, no scatter
            self.tables[g].view(-1)[lo:hi].copy_(torch.from_numpy(mirror.reshape(-1)[lo:hi]), non_blocking=True)
            return
        packed = torch.from_numpy(np.stack([at, mirror.reshape(-1)[at]])).to(self.tables[g].device, non_blocking=True)
        self.tables[g].view(-1).index_copy_(0, packed[0], packed[1].to(torch.int32))
