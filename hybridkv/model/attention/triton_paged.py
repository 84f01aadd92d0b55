"""Paged hybrid attention on NVIDIA GPUs through the Triton kernels in ``hybridkv/kernels`` (on Hopper, with a bf16
cache and head dim 128, prefill steps run the CUDA kernel ``hopper_attention.cu`` over the same tiles instead).

Same contract as ``TorchPagedAttention`` (its oracle). ``begin_step`` builds the step's metadata once: sequence
offsets and lengths and the query tiles (shared by every layer), and per layer *group* the block table, the write
slots and the number of KV splits — so a hybrid model pays for metadata once per attention group, not per layer
(vLLM's hybrid manager rebuilt it per group and per layer type, costing ~2 ms of decode latency on Llama-4).

FP8 (``fp8_e4m3``): K and V are stored as e4m3 with one scale per layer for K and one for V (1.0 unless given,
as vLLM without calibration). The kernels widen e4m3 on load, which is exact; the scales multiply the scores and
the output, not every loaded value. Prefill dots stay in the model's dtype; decode dots run in fp16, whose
conversion from e4m3 is cheaper than bf16's.

FP8 compute (``fp8_compute=True``, e4m3 cache, compute capability 8.9+; measured on Hopper only): prefill runs
both dots in e4m3 on the tensor cores instead: queries quantized per row with their own scale, K read from the e4m3
pages, V from a transposed e4m3 copy of the step's reach (FP8 wgmma wants V K-major), P rounded to e4m3. On Hopper
with 64-token pages the CUDA kernel runs it (its V^T columns in the order ``hopper_attention.page_columns`` gives):
on an H200 909-916 TFLOP/s against its bf16 dots' 607-636 (docs/benchmarks.md#attention); elsewhere the Triton
kernel (3x slower than bf16 with 16-token pages). It costs e4m3's rounding of Q and P, ~5% relative error on random
inputs, and is off by default (docs/gpu.md#fp8-attention-compute).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from hybridkv.kernels import hopper_attention  # torch only: its CUDA imports wait for a Hopper GPU
from hybridkv.kv.layout import KVLayout
from hybridkv.kernels.kv_slots import KVSlots
from hybridkv.model.attention.base import BackendCapabilities, StepSequence, StoresKVFromKernels
from hybridkv.model.attention.kv_cache import PagedKVCache


@dataclass(frozen=True, slots=True)
class KernelConfig:
    rows: int  # query rows (tokens x heads of one KV head) per program
    block_n: int  # keys per inner iteration
    num_warps: int
    num_stages: int
    # Hopper: K/V tiles by TMA through a tensor descriptor, where a page holds whole key tiles (else gathered)
    tma: bool = False
    programs_per_sm: int = 1  # resident at once (registers and shared memory allow): a wave is this x SMs
    # the CUDA kernel of ``hybridkv/kernels/hopper_attention.cu`` instead of Triton's (its own tiles: rows x 128)
    cuda: bool = False


# Prefill tiles are compute-bound: wide tiles, deep pipelining. Decode is bandwidth-bound: 16 rows (the least a
# tensor-core dot takes), long key tiles, and the KV range split across programs to fill the GPU.
# Chosen by `benchmarks/gpu/attention.py --sweep` on an H200: prefill 32K full 372 TFLOP/s
# with 256x64 tiles (299 with 128x64); decode 1M 3.4 TB/s with 128-key tiles and 256 splits (1.8 TB/s with 64).
PREFILL = KernelConfig(rows=256, block_n=64, num_warps=8, num_stages=3)
DECODE = KernelConfig(rows=16, block_n=128, num_warps=4, num_stages=3)
# A layer group of a decode step of at most FEW_SEQS sequences whose reach, summed over its sequences and KV heads,
# is at most FEW_KEYS keys: 64-key tiles. Few keys leave a step bound by latency, where a shorter tile ends sooner;
# many keys stream faster in 128-key tiles. Graph replays of a Scout rank's step on an H200
# (`tools/kernel_dev/decode_stages.py --variants`, 64-key against 128-key tiles in every layer, ms):
#   one KV head (Scout over 8 GPUs): batch 1 at 16K 2.49 / 2.62, 1M 3.99 / 4.06, 5M 9.95 / 9.67;
#     batch 2 at 128K 3.25 / 3.38, at 1M 6.45 / 5.86; batch 32 at 128K 15.97 / 14.54;
#   two KV heads (`--shapes-of-tp 4`): batch 1 at 16K 3.46 / 3.65, 128K 3.89 / 4.02, 1M 7.08 / 6.47,
#     5M 21.56 / 17.79; batch 2 at 128K 5.00 / 4.97.
# The chunked layers' 8K reach stays under FEW_KEYS however long the context: their tiles stay short.
DECODE_FEW = KernelConfig(rows=16, block_n=64, num_warps=4, num_stages=3)
FEW_SEQS = 2
FEW_KEYS = 1 << 20
# Hopper (sm_90), pages of 64+ tokens: K/V tiles by TMA, one warpgroup of 128 rows per program and two programs
# per SM, which desynchronise so one's softmax overlaps the other's dots. `benchmarks/gpu/attention.py --sweep`
# on an H200: 32K one-shot 466 TFLOP/s, 16K step over 1M 498 (PREFILL: 382 / 450).
HOPPER_PREFILL = KernelConfig(rows=128, block_n=64, num_warps=4, num_stages=3, tma=True, programs_per_sm=2)
# Hopper, head dim 128, bf16 queries over a bf16 cache, an FP8 cache's widened segments, or FP8 compute (pages of
# 64+ tokens): the warp-specialized CUDA kernel (a TMA producer warpgroup, two wgmma consumers; one CTA per SM). Its
# tiles have HOPPER_PREFILL's 128 rows, packed across tokens (``hopper_attention.work_items``); what it does not
# cover (fp16/fp32 queries, FP8 read in the kernel, FP8 compute over small pages) runs the Triton kernel over the
# step's tiles of whole tokens.
# `tools/kernel_dev/hopper_kernel.py` on an H200, both kernels on the same inputs: 600 TFLOP/s one-shot and 620 on
# a 16K step over 1M (HOPPER_PREFILL: 481 / 499); current figures, FP8 compute's too: docs/benchmarks.md#attention.
HOPPER_CUDA_PREFILL = KernelConfig(rows=hopper_attention.ROWS, block_n=hopper_attention.BLOCK_N,
                                   num_warps=hopper_attention.THREADS // 32, num_stages=hopper_attention.STAGES,
                                   cuda=True)
# Head dims above 128 (Gemma-3: 256) need smaller tiles: a 256x64 tile of 256-wide rows overflows registers and
# three stages of 64x256 K and V tiles overflow shared memory. Correct first; not yet tuned on a device.
WIDE_HEAD_PREFILL = KernelConfig(rows=64, block_n=32, num_warps=4, num_stages=2)
WIDE_HEAD_DECODE = KernelConfig(rows=16, block_n=64, num_warps=4, num_stages=2)
# FP8 cache, long prefill: the reach is widened to bf16 in segments of at most this many bytes per step (Scout's
# rank, one sequence: 1M tokens), then attended by the bf16 kernel (16K queries over 1M keys on an H200: 99.5 ms
# vs 122 ms widening inside the kernel). The engine reserves 1.5x this (the gather's FP8 copy
# lives beside the scratch for a moment).
SEGMENT_BYTES = 512 << 20
# Splits of a decode step's KV range: a few programs per SM keep enough loads in flight. A Scout rank's full layer
# alone, one H200, attention and combine: 1M 131 us with 256 splits, 139 with 512; 128K 27.8 and 33.2; 16K 11.1
# and 15.3 (a graph's split count is fixed by max_model_len, and every program is launched however few have keys).
SPLITS_PER_SM = 4
MAX_SPLITS = 256


def _reach_cap(spec) -> int:
    """The most keys one sequence's step is counted as reading in a layer group of ``spec``, for its split count
    and tiles: a local type's reach with 64 keys of slack; unbounded for full attention."""
    return spec.reach + 64 if spec.reach else 2**31 - 1  # positions are int32


def wave_splits(programs: int, num_sms: int) -> int:
    """KV splits (1, 2 or 4) that make ``programs`` tiles fill whole waves of one program per SM.

    E.g. a 16,384-token prefill step of Scout's rank is 322 tiles; on an H200's 132 SMs that is 3 waves, the last
    44% full (341 TFLOP/s at 1M context). 2 splits make 644 programs in 5 waves, 98% full (393 TFLOP/s). 643 tiles
    (a 32,768-token step) already fill 97%: no split. More than 4 would multiply the float32 partial outputs for
    little gain."""

    def fill(splits: int) -> float:
        p = programs * splits
        return p / (-(-p // num_sms) * num_sms)

    best = max(fill(s) for s in (1, 2, 4))
    return next(s for s in (1, 2, 4) if fill(s) >= best - 0.02)


def segment_tokens(reaches: list[int], budget: int, unit: int) -> int:
    """The longest segment (a multiple of ``unit``, at least one) whose scratch holds at most ``budget`` tokens:
    a segment of S keys holds ``sum(min(S, reach))`` of them over the step's sequences.

    E.g. reaches [1M, 4K, 4K] and a budget of 1M: S = 1M - 8K (the two short sequences take 8K of any segment)."""
    reaches = sorted(reaches)
    for i, r in enumerate(reaches):
        # S >= r for the i shortest: they take sum(reaches[:i]) + r; the rest take S each
        longest = (budget - sum(reaches[:i])) // (len(reaches) - i)
        if longest < r:
            return max(unit, longest // unit * unit)
    return max(unit, -(-reaches[-1] // unit) * unit)


def plan_segments(first: list[int], ends: list[int], table: np.ndarray, block_size: int, seg_tokens: int):
    """Cut a step's key range into segments of ``seg_tokens`` keys (a multiple of ``block_size``).

    Sequence i's queries see keys ``[first[i], ends[i])``; ``table[i]`` holds its blocks. Returns the segments as
    ``(lo, hi, cache blocks in scratch order)`` and a table of each block's row in its segment's scratch. E.g.
    4-token blocks, 8-token segments, one sequence seeing keys 2..13 with table [7, 3, 9, 4]: segment [0, 8)
    widens blocks [7, 3] into scratch rows 0 and 1, segment [8, 16) widens [9, 4] into rows 0 and 1, and the
    scratch table is [0, 1, 0, 1]. Blocks wholly below ``first`` (dropped by a chunk or window) are never read."""
    seg_blocks = seg_tokens // block_size
    first_b = [f // block_size for f in first]
    end_b = [-(-e // block_size) for e in ends]
    scratch_table = np.zeros_like(table)
    segments = []
    for lo_b in range(0, max(end_b), seg_blocks):
        gather, rows = [], 0
        for i in range(len(ends)):
            a, b = max(first_b[i], lo_b), min(end_b[i], lo_b + seg_blocks)
            if a < b:
                scratch_table[i, a:b] = np.arange(rows, rows + b - a)
                gather.append(table[i, a:b])
                rows += b - a
        if rows:
            segments.append((lo_b * block_size, (lo_b + seg_blocks) * block_size, np.concatenate(gather)))
    return segments, scratch_table


def query_tiles(q_lens: np.ndarray, ctx: np.ndarray, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """A step's query tiles of ``tokens`` tokens, as (sequence, first query's offset in it), longest first: the GPU
    starts programs in grid order, so the short causal tiles fill the last wave. E.g. 30 and 10 new tokens over 100
    and 0 cached, 25 tokens a tile: sequences [0, 0, 1], offsets [25, 0, 0]."""
    tiles_per_seq = -(-q_lens // tokens)
    tile_seq = np.repeat(np.arange(len(q_lens), dtype=np.int32), tiles_per_seq)
    tile_q0 = np.concatenate([np.arange(n, dtype=np.int32) * tokens for n in tiles_per_seq])
    order = np.argsort(-(ctx[tile_seq] + tile_q0), kind="stable")
    return tile_seq[order], tile_q0[order]


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


@dataclass(slots=True)
class _Segment:
    lo: int  # key positions [lo, hi)
    hi: int
    blocks: torch.Tensor  # [n] int64: the cache blocks of this segment, in scratch order


@dataclass(slots=True)
class _GroupMeta:
    table: torch.Tensor  # [S, max_blocks] int32
    slot_block: torch.Tensor  # [T] int32
    slot_offset: torch.Tensor  # [T] int32
    num_splits: int
    config: KernelConfig  # the step's tiles; a decode step's may differ by group (``_decode_config``)
    # FP8 long prefill: segments widened to bf16 one at a time, and each block's row in its segment's scratch
    segments: list[_Segment] = field(default_factory=list)
    scratch_table: torch.Tensor | None = None


@dataclass(slots=True)
class TritonStepState:
    """What ``begin_step`` (or ``begin_static_decode``) works out once for every layer of the step."""

    config: KernelConfig  # the prefill or the decode tiles
    tokens: int  # query tokens per tile
    num_tiles: int
    seq: list[torch.Tensor]  # tile_seq, tile_q0, q_loc, q_len, ctx_len
    # the CUDA kernel's own tiles (``hopper_attention.work_items``: 128 rows each, a tile may end inside a token's
    # heads), [CTAs, 4] int32, one load a CTA
    tiles: torch.Tensor | None = None
    groups: list[_GroupMeta] = field(default_factory=list)  # per layer group


@dataclass(slots=True)
class _StaticDecode:
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
    # per graph, (padded batch size, many): the step state its every replay reads (views of the buffers above)
    steps: dict[tuple[int, bool], TritonStepState] = field(default_factory=dict)

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


class TritonPagedAttention(StoresKVFromKernels):
    @staticmethod
    def declare(kv_dtype: str, segment_bytes: int = SEGMENT_BYTES) -> BackendCapabilities:
        """An FP8 cache's long prefills widen segments of ``segment_bytes``; the engine reserves 1.5x that (the
        gather's FP8 copy lives beside the scratch for a moment)."""
        fp8 = kv_dtype.startswith("fp8")
        segment = segment_bytes if fp8 else 0
        return BackendCapabilities(cuda_graphs=True, fp8_segments=fp8, segment_bytes=segment)

    def __init__(self, layout: KVLayout, num_blocks: int, kv_dtype: str, num_q_heads: int,
                 device: torch.device | str = "cuda", kv_scales: dict[int, tuple[float, float]] | None = None,
                 num_sms: int | None = None, prefill: KernelConfig = PREFILL, decode: KernelConfig = DECODE,
                 decode_few: KernelConfig | None = None,
                 max_splits: int = MAX_SPLITS, segment_bytes: int = SEGMENT_BYTES, fp8_compute: bool = False,
                 hopper_kernel: bool = True) -> None:
        from hybridkv.kernels import paged_attention as kernels  # triton is only needed on GPU
        from hybridkv.kernels.launch import pdl

        self.kernels = kernels
        self.layout = layout
        self.block_size = layout.block_size
        self.cache = PagedKVCache(layout, num_blocks, kv_dtype, device)
        self.device = torch.device(device)
        self.quantized = kv_dtype.startswith("fp8")
        self.kv_scales = kv_scales or {}
        self.num_q_heads = num_q_heads
        # query heads per KV head: they share the rows of one attention tile
        self.group = max(num_q_heads // g.spec.num_kv_heads for g in layout.groups)
        if num_sms is None:  # (a CPU device only happens under Triton's interpreter, in development)
            cuda = self.device.type == "cuda"
            num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count if cuda else 8
        self.num_sms = num_sms  # how many programs fill the GPU; decides KV splits
        self.pdl = pdl(self.cache.buffer)  # the decode path's kernels launch programmatically dependent
        hopper = self.device.type == "cuda" and torch.cuda.get_device_capability(self.device)[0] == 9
        default_prefill = prefill is PREFILL
        if decode_few is None:  # a decode config given alone serves every decode step
            decode_few = DECODE_FEW if decode is DECODE else decode
        if max(g.spec.head_dim for g in layout.groups) > 128:
            prefill = WIDE_HEAD_PREFILL if prefill is PREFILL else prefill
            decode = WIDE_HEAD_DECODE if decode is DECODE else decode
            decode_few = WIDE_HEAD_DECODE if decode_few is DECODE_FEW else decode_few
        elif hopper and prefill is PREFILL and layout.block_size % HOPPER_PREFILL.block_n == 0 and all(
                g.spec.head_dim in (64, 128) for g in layout.groups):
            prefill = HOPPER_PREFILL
        # the Triton tiles of prefill steps the CUDA kernel does not cover: 128 rows like it, gathered if not TMA
        self.triton_prefill = prefill if prefill.rows == HOPPER_PREFILL.rows else replace(HOPPER_PREFILL, tma=False)
        self.hopper = None
        # the CUDA kernel's tiles cut a step's rows by one G (self.group): every layer group must have that G
        if hopper_kernel and hopper and default_prefill and all(
                g.spec.head_dim == hopper_attention.HEAD_DIM and g.spec.num_kv_heads * self.group == num_q_heads
                for g in layout.groups):
            self.hopper = self._load_hopper_kernel()
            prefill = HOPPER_CUDA_PREFILL if self.hopper is not None else prefill
        # FP8 compute in the CUDA kernel: the V^T copy gathers each page's columns in the kernel's order
        bs = self.block_size
        self._v_columns = None  # None: FP8 compute stays on Triton (no CUDA kernel, or pages under 64 tokens)
        if self.hopper is not None and bs >= 64 and bs & (bs - 1) == 0:
            self._v_columns = torch.tensor(hopper_attention.page_columns(bs), dtype=torch.int64, device=self.device)
        self._v_in_order = torch.arange(bs, dtype=torch.int64, device=self.device)  # Triton's FP8 V^T columns
        self.prefill, self.decode, self.decode_few, self.max_splits = prefill, decode, decode_few, max_splits
        self.segment_bytes = segment_bytes
        # graphs need CUDA (a CPU device only happens under Triton's interpreter)
        self.capabilities = replace(self.declare(kv_dtype, segment_bytes), cuda_graphs=self.device.type == "cuda")
        self.fp8_compute = fp8_compute and self.quantized
        if self.fp8_compute and self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9):
            name = torch.cuda.get_device_name(self.device)
            raise ValueError(f"FP8 attention compute needs FP8 tensor cores (compute capability 8.9+); {name} has none")
        rows = min(decode.rows, decode_few.rows)
        if self.group > rows:
            raise ValueError(f"{self.group} query heads per KV head: more than one tile's {rows} rows")
        self.step_state: TritonStepState | None = None

    def _load_hopper_kernel(self):
        """The CUDA prefill kernel, or None (with a warning naming why) where it cannot be built here."""
        import warnings

        reason = hopper_attention.unavailable(self.device)
        if reason is None:
            try:
                return hopper_attention.HopperPrefill(self.device)
            except (RuntimeError, OSError) as e:
                reason = str(e)
        warnings.warn(f"Hopper prefill kernel unavailable, using the Triton kernel: {reason}", stacklevel=3)
        return None

    # ---- per step ----------------------------------------------------------------------------------
    def begin_step(self, seqs: list[StepSequence]) -> None:
        dev = self.device
        q_lens = np.array([s.query_len for s in seqs], dtype=np.int32)
        ctx = np.array([s.context_len for s in seqs], dtype=np.int32)
        q_loc = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int32)
        config = self._decode_config(len(seqs), 0) if int(q_lens.max()) == 1 else self.prefill
        tokens = config.rows // self.group
        tile_seq, tile_q0 = query_tiles(q_lens, ctx, tokens)
        as_dev = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev, non_blocking=True)  # noqa: E731
        seq = [as_dev(tile_seq), as_dev(tile_q0), as_dev(q_loc), as_dev(q_lens), as_dev(ctx)]
        tiles = None
        if config.cuda:
            tiles = as_dev(hopper_attention.work_items(q_loc, q_lens, ctx, self.group))
        self.step_state = TritonStepState(config, tokens, len(tile_seq), seq, tiles)
        self.step_state.groups = [self._group_meta(g, seqs, ctx + q_lens, as_dev) for g in self.layout.groups]

    def _group_meta(self, group, seqs, seq_lens, as_dev) -> _GroupMeta:
        bs = self.block_size
        tables = [s.block_tables[group.group_id] for s in seqs]
        width = max(len(t) for t in tables)
        table = np.zeros((len(seqs), width), dtype=np.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = t
        new = np.concatenate([np.arange(s.context_len, s.context_len + s.query_len) for s in seqs])
        owner = np.repeat(np.arange(len(seqs)), [s.query_len for s in seqs])
        blocks = table[owner, new // bs]
        spec = group.spec
        reaches = np.minimum(seq_lens, _reach_cap(spec))
        reach = int(reaches.max())
        config = self.step_state.config
        if self._is_decode(config):
            config = self._decode_config(len(seqs), int(reaches.sum()) * spec.num_kv_heads)
        meta = _GroupMeta(as_dev(table), as_dev(blocks), as_dev((new % bs).astype(np.int32)),
                          self._num_splits(reach, spec.num_kv_heads, config), config)
        long_reach = reach >= 256 * self.prefill.block_n
        if self.quantized and self.step_state.config is self.prefill and (self.fp8_compute or long_reach):
            self._plan_segments(meta, spec, seqs, table, as_dev)
        return meta

    def _plan_segments(self, meta: _GroupMeta, spec, seqs, table: np.ndarray, as_dev) -> None:
        unit = max(self.block_size, self.prefill.block_n)  # segments start on key-tile boundaries
        # bf16 K and V; FP8 compute: V's transposed e4m3 copy (gathered from the pages by the same pass)
        per_token = spec.num_kv_heads * spec.head_dim * (1 if self.fp8_compute else 4)
        first = [spec.first_needed_token(s.context_len) for s in seqs]
        ends = [s.context_len + s.query_len for s in seqs]
        # whole blocks round each reach out: its last block, and its first where a window starts inside one
        budget = self.segment_bytes // per_token - 2 * len(seqs) * self.block_size
        reaches = [e - f for f, e in zip(first, ends)]
        if self.fp8_compute and sum(reaches) <= budget:
            # the whole step in one segment: no merging pass, and the windows of local layers are not cut in two
            seg_tokens = -(-max(ends) // unit) * unit
        else:
            seg_tokens = segment_tokens(reaches, budget, unit)
        segments, scratch_table = plan_segments(first, ends, table, self.block_size, seg_tokens)
        meta.segments = [_Segment(lo, hi, as_dev(blocks.astype(np.int64))) for lo, hi, blocks in segments]
        meta.scratch_table = as_dev(scratch_table)

    # ---- decode steps replayed from CUDA graphs --------------------------------------------------------
    def enable_static_decode(self, max_seqs: int, max_model_len: int) -> None:
        """Fixed metadata buffers for decode steps, so a captured step reads each step's values in place."""
        width = -(-max_model_len // self.block_size)
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.int32, device=self.device)  # noqa: E731
        groups = len(self.layout.groups)
        rows = zeros(6 + 2 * groups, max_seqs)
        host = torch.zeros(rows.shape, dtype=torch.int32, pin_memory=rows.is_cuda)
        self._static = _StaticDecode(
            rows=rows, host=host, copied=None, tables=[zeros(max_seqs, width) for _ in range(groups)],
            mirror=np.zeros((groups, max_seqs, width), dtype=np.int32), host_np=host.numpy(),
            order=np.arange(max_seqs, dtype=np.int32),
            ends=[np.zeros(max_seqs, dtype=np.int64) for _ in range(groups)], versions=[0] * max_seqs,
            max_model_len=max_model_len,
        )

    def static_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids, positions) [max_seqs] int32 of the static decode step, on the device: a captured forward
        reads them there, and ``begin_static_decode`` fills them in its one copy (a decode token's position is
        its sequence's context length)."""
        st = self._static
        return st.token_ids, st.seq[4]

    def begin_static_decode(self, seqs: list[StepSequence], padded: int, token_ids: np.ndarray | None = None,
                            many: bool = False) -> None:
        """Decode metadata (one new token per sequence) written into the static buffers, padded to ``padded``
        rows, with the sequences' new ``token_ids`` (``static_inputs``); a padding row computes nothing and its
        token's K/V go to the null block, which is never read. ``many``: the step state of a step that
        ``many_keys`` (its long groups' tiles are 128 keys)."""
        st, n, bs = self._static, len(seqs), self.block_size
        if st.copied is not None:
            st.copied.synchronize()  # the previous step's copy has read ``host``
        host, groups = st.host_np, len(self.layout.groups)
        host[:, :padded] = 0
        ctx = host[4, :n]
        ctx[:] = [s.context_len for s in seqs]
        host[0, :padded] = host[2, :padded] = st.order[:padded]  # tile_seq, q_loc
        host[3, :n] = 1  # q_len
        if token_ids is not None:
            host[-1, :n] = token_ids
        known = st.versions
        rows = [i for i, s in enumerate(seqs) if s.tables_version == 0 or s.tables_version != known[i]]
        if rows:  # the rows whose tables changed
            for g, group in enumerate(self.layout.groups):
                st.write_tables(g, rows, [seqs[i].block_tables[group.group_id] for i in rows])
            for i in rows:
                known[i] = seqs[i].tables_version
        # every group's slot block (the tables' entries, just written) and slot offset: rows 5, 7, ... and 6, 8, ...
        host[5 : 5 + 2 * groups : 2, :n] = st.mirror[:, st.order[:n], ctx // bs]
        host[6 : 6 + 2 * groups : 2, :n] = ctx % bs
        st.rows.copy_(st.host, non_blocking=True)
        if st.rows.is_cuda:
            st.copied = torch.cuda.Event()
            st.copied.record()
        self.step_state = st.steps.get((padded, many)) or self._static_step(padded, many)

    def _static_step(self, padded: int, many: bool) -> TritonStepState:
        """The step state of a decode graph of ``padded`` rows (``many``: see ``begin_static_decode``): views of
        the static buffers, built once."""
        st = self._static
        config = self._decode_config(padded, 0)
        self.step_state = TritonStepState(config, config.rows // self.group, padded, [buf[:padded] for buf in st.seq])
        for g, group in enumerate(self.layout.groups):
            spec = group.spec
            reach = min(st.max_model_len, _reach_cap(spec))
            # a function of the graph alone: the tiles and split count it was captured with are those it replays
            # with (a split that sees no key stores nothing, so any count is right for any context)
            keys = padded * reach * spec.num_kv_heads if many else 0
            group_config = self._decode_config(padded, keys)
            splits = self._num_splits(reach, spec.num_kv_heads, group_config)
            self.step_state.groups.append(_GroupMeta(st.tables[g][:padded], st.slot_block(g)[:padded],
                                                     st.slot_offset(g)[:padded], splits, group_config))
        st.steps[(padded, many)] = self.step_state
        return self.step_state

    def _decode_config(self, num_seqs: int, keys: int) -> KernelConfig:
        """The tiles of a decode step's layer group whose reach over all its sequences and KV heads is ``keys``.

        E.g. one sequence at 16K context, 2 KV heads: 32K keys -> 64-key tiles (``DECODE_FEW``); at 1M: 2M keys
        -> 128-key tiles (``DECODE``) for the full layers, while the chunked layers (8K reach) keep 64-key ones."""
        return self.decode_few if num_seqs <= FEW_SEQS and keys <= FEW_KEYS else self.decode

    def many_keys(self, seqs: list[StepSequence]) -> bool:
        """A decode step some layer group of which reads 128-key tiles only because its reach is long: its
        graph is the ``many`` one of its batch size (``begin_static_decode``)."""
        if len(seqs) > FEW_SEQS or self.decode is self.decode_few:
            return False
        return self._reads_many_keys([s.context_len + 1 for s in seqs])

    def static_variants(self, padded: int) -> list[bool]:
        """The ``many`` values a decode graph of ``padded`` rows is captured for: [False], or [False, True] where
        a step of that size can read 128-key tiles in some group because of its reach (``many_keys``)."""
        if padded > FEW_SEQS or self.decode is self.decode_few:
            return [False]
        return [False, True] if self._reads_many_keys([self._static.max_model_len] * padded) else [False]

    def _reads_many_keys(self, lens: list[int]) -> bool:
        """Whether some layer group reads more than FEW_KEYS keys, over its KV heads, for sequences of ``lens``
        tokens (a few ints: plain Python is quicker than numpy here)."""
        return any(sum(min(n, _reach_cap(g.spec)) for n in lens) * g.spec.num_kv_heads > FEW_KEYS
                   for g in self.layout.groups)

    def _is_decode(self, config: KernelConfig) -> bool:
        return config is self.decode or config is self.decode_few

    def _num_splits(self, longest_reach: int, kv_heads: int, config: KernelConfig) -> int:
        """Split the KV range only when too few programs would run otherwise (decode of few long sequences)."""
        step = self.step_state
        programs = (step.num_tiles if step.tiles is None else len(step.tiles)) * kv_heads
        block_n = config.block_n
        if programs >= self.num_sms:
            # prefill over a long context (Scout's full layers at 16K+, not its 8K chunks): over short ones the
            # combine pass costs more than the idle SMs
            long_prefill = config is self.prefill and longest_reach >= 256 * block_n
            return wave_splits(programs, self.num_sms * config.programs_per_sm) if long_prefill else 1
        if longest_reach <= 4 * block_n:
            return 1
        want = _pow2_floor(max(1, SPLITS_PER_SM * self.num_sms // programs))
        # Long splits stream best (32+ key tiles each: 1M keys -> 256 splits); short contexts still get up to
        # 128 splits of 4+ tiles, or too few SMs would work.
        long_splits = _pow2_floor(max(1, longest_reach // (32 * block_n)))
        short_splits = min(128, _pow2_floor(max(1, longest_reach // (4 * block_n))))
        return min(want, max(long_splits, short_splits), self.max_splits)

    # ---- per layer ---------------------------------------------------------------------------------
    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        layer, k_scale, v_scale = self.write(layer_id, k, v)
        return self._attention(q, layer, self.step_state.groups[layer.group_id], scale, k_scale, v_scale)

    def kv_slots(self, layer_id: int) -> KVSlots:
        """Where this step's K/V of ``layer_id`` go (``kernels.rope.rope_qk`` stores them with q's encoding)."""
        layer = self.cache.layers[layer_id]
        meta = self.step_state.groups[layer.group_id]
        k_scale, v_scale = self.kv_scales.get(layer_id, (1.0, 1.0))
        row = layer.spec.num_kv_heads * layer.spec.head_dim
        return KVSlots(self._base(layer), meta.slot_block, meta.slot_offset, self.cache.buffer.stride(0),
                       self.block_size * row, k_scale, v_scale, self.quantized)

    def attend_stored(self, layer_id: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """``attend`` once the step's K/V of ``layer_id`` are in their ``kv_slots``."""
        layer = self.cache.layers[layer_id]
        k_scale, v_scale = self.kv_scales.get(layer_id, (1.0, 1.0))
        return self._attention(q, layer, self.step_state.groups[layer.group_id], scale, k_scale, v_scale)

    def write(self, layer_id: int, k: torch.Tensor, v: torch.Tensor):
        """Store the step's K/V of one layer into its slots (benchmarks also use it alone, to fill a cache)."""
        layer = self.cache.layers[layer_id]
        meta = self.step_state.groups[layer.group_id]
        heads, dim = layer.spec.num_kv_heads, layer.spec.head_dim
        k_scale, v_scale = self.kv_scales.get(layer_id, (1.0, 1.0))
        # one token's K (or V) rows: heads * dim contiguous values, in the inputs as in a slot
        k, v = k.reshape(k.shape[0], -1).contiguous(), v.reshape(v.shape[0], -1).contiguous()
        hd_pad = _next_pow2(heads * dim)
        tokens = max(1, 4096 // hd_pad)
        self.kernels.kv_write_kernel[(-(-k.shape[0] // tokens),)](
            k, v, self._base(layer), meta.slot_block, meta.slot_offset, k_scale, v_scale, k.shape[0],
            self.cache.buffer.stride(0), self.block_size * heads * dim,
            HD=heads * dim, HD_PAD=hd_pad, TOKENS=tokens, QUANT=self.quantized, PDL=self.pdl, launch_pdl=self.pdl,
        )
        return layer, k_scale, v_scale

    def _base(self, layer) -> torch.Tensor:
        return self.cache.buffer.view(-1)[layer.elem_offset :]

    def _attention(self, q, layer, meta, scale, k_scale, v_scale) -> torch.Tensor:
        spec = layer.spec
        out = torch.empty_like(q)
        splits = meta.num_splits
        # FP8 compute always has segments (V's transposed copy), but one segment needs no merging
        segmented = len(meta.segments) > (1 if self.fp8_compute else 0)
        if splits > 1 or segmented:
            part = torch.empty((splits, q.shape[0], q.shape[1], q.shape[2]), dtype=torch.float32, device=q.device)
            lse = torch.empty((splits, q.shape[0], q.shape[1]), dtype=torch.float32, device=q.device)
        else:
            part = lse = None
        args = (q, out, part, lse, spec, scale, k_scale, v_scale, splits, meta.config)
        if self.fp8_compute and meta.segments:
            # FP8 dots: K straight from the pages, V from a transposed e4m3 copy of each segment (one pass over
            # the segment's V, as the widening below is one over K and V)
            fp8 = layer.view.view(torch.uint8)
            heads, dim = spec.num_kv_heads, spec.head_dim
            cuda = self._hopper_fp8_covers(q, out)  # the CUDA kernel, its own V^T column order; else Triton's
            columns = self._v_columns if cuda else self._v_in_order
            for i, seg in enumerate(meta.segments):
                vt = self._v_transposed(fp8, seg.blocks, columns, heads * dim)
                self._launch(*args, self._base(layer), meta.table, self.cache.buffer.stride(0), True,
                             seg_lo=seg.lo, seg_hi=seg.hi, segmented=segmented, accumulate=i > 0,
                             vt=vt, vt_table=meta.scratch_table, cuda_vt=cuda)
        elif not segmented:
            self._launch(*args, self._base(layer), meta.table, self.cache.buffer.stride(0), self.quantized)
        else:
            # FP8 cache, long prefill: widen each segment of the reach into a bf16 scratch (exact), then run the
            # unquantized kernel over it: the widening costs one pass over the keys instead of one per query tile
            fp8 = layer.view.view(torch.uint8)
            for i, seg in enumerate(meta.segments):
                scratch = fp8[seg.blocks].view(torch.float8_e4m3fn).to(q.dtype)  # [n, 2, block, heads, dim]
                self._launch(*args, scratch, meta.scratch_table, scratch.stride(0), False,
                             seg_lo=seg.lo, seg_hi=seg.hi, segmented=True, accumulate=i > 0)
        if part is not None:
            # few rows (decode): slice the head dim over more programs; many (prefill): one program per row
            d_pad = max(16, _next_pow2(spec.head_dim))
            d_slice = d_pad if q.shape[0] * q.shape[1] >= 64 * self.num_sms else min(32, d_pad)
            grid = (q.shape[0], q.shape[1], -(-spec.head_dim // d_slice))
            self.kernels.combine_splits_kernel[grid](
                part, lse, out, part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
                out.stride(0), out.stride(1), NUM_SPLITS=splits, CHUNK=min(splits, 128), D=spec.head_dim,
                D_SLICE=d_slice, PDL=self.pdl, launch_pdl=self.pdl,
            )
        return out

    def _v_transposed(self, fp8: torch.Tensor, blocks: torch.Tensor, columns: torch.Tensor, hd: int) -> torch.Tensor:
        """V^T [heads * dim, pages * block] (e4m3) of the pages ``blocks`` of one layer's cache (``fp8``, bytes),
        each page's keys in ``columns`` order."""
        n_cols = blocks.shape[0] * self.block_size
        vt = torch.empty((hd, n_cols), dtype=torch.uint8, device=fp8.device)
        cols = 128
        self.kernels.v_transpose_kernel[(-(-n_cols // cols),)](
            fp8, blocks, columns, vt, n_cols, fp8.stride(0), fp8.stride(1),
            HD=hd, HD_PAD=_next_pow2(hd), BLOCK_SIZE=self.block_size, COLS=cols,
        )
        return vt.view(torch.float8_e4m3fn)

    def _launch(self, q, out, part, lse, spec, scale, k_scale, v_scale, splits, group_config, cache, table,
                stride_block, quant, seg_lo=0, seg_hi=2**31 - 1, segmented=False, accumulate=False, vt=None,
                vt_table=None, cuda_vt=False) -> None:
        """One attention launch over ``cache`` with the layer group's tiles; with ``vt`` FP8 compute, its V^T in
        the CUDA kernel's column order where ``cuda_vt``."""
        stride_tok = spec.num_kv_heads * spec.head_dim
        kind, reach = spec.kernel_kind, spec.reach
        step = self.step_state
        config = group_config
        if config.cuda:
            segment = (seg_lo, seg_hi, segmented, accumulate)
            if cuda_vt or (vt is None and self._hopper_covers(q, out, cache, quant)):
                self._launch_hopper(q, out, part, lse, spec, scale * k_scale, v_scale, splits, cache, table,
                                    stride_block, stride_tok, segment, vt, vt_table)
                return
            config = self.triton_prefill
        part_strides = (0,) * 5 if part is None else (*part.stride()[:3], *lse.stride()[:2])
        kv_desc = self._descriptor(config, cache, spec, stride_tok, stride_block)
        vt_desc = None
        if vt is not None and kv_desc is not None:
            vt_desc = self._vt_descriptor(config, vt, spec)
            kv_desc = kv_desc if vt_desc is not None else None  # both by TMA, or both gathered
        decode_pdl = self.pdl and self._is_decode(config)  # prefill's launches are long: nothing to gain
        self.kernels.paged_attention_kernel[(step.num_tiles, spec.num_kv_heads, splits)](
            q, out, out if part is None else part, out if lse is None else lse, cache,
            cache if kv_desc is None else kv_desc, table,
            cache if vt is None else vt, cache if vt_desc is None else vt_desc, table if vt_table is None else vt_table,
            *step.seq,
            scale, k_scale, v_scale, seg_lo, seg_hi, stride_block // stride_tok,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), table.stride(0),
            stride_block, stride_tok, self.block_size * stride_tok,
            *part_strides, 0 if vt is None else vt.stride(0),
            KIND=kind, REACH=max(reach, 1), BLOCK_SIZE=self.block_size, GROUP=q.shape[1] // spec.num_kv_heads,
            ROWS=config.rows, TOKENS=step.tokens, D=spec.head_dim, D_PAD=max(16, _next_pow2(spec.head_dim)),
            BLOCK_N=config.block_n, NUM_SPLITS=splits, QUANT=quant,
            FP16_DOT=quant and q.dtype == torch.bfloat16 and self._is_decode(group_config),
            SEGMENTED=segmented, ACCUMULATE=accumulate,
            TMA=kv_desc is not None, FP8_DOT=vt is not None,
            # float32 models stay exact (token parity with the CPU path); TF32 would round to 10 mantissa bits
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            PDL=decode_pdl, num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=decode_pdl,
        )

    @staticmethod
    def _rows_aligned(q, out, cache) -> bool:
        """bf16 query and output head rows, and the cache, on 16-byte boundaries (the CUDA kernel's loads and
        stores)."""
        return (q.dtype == torch.bfloat16 and all(t.data_ptr() % 16 == 0 for t in (q, out, cache))
                and q.stride(2) == 1 and out.stride(2) == 1
                and all(s % 8 == 0 for s in (q.stride(0), q.stride(1), out.stride(0), out.stride(1))))

    def _hopper_covers(self, q, out, cache, quant) -> bool:
        """What the CUDA kernel's bf16 dots take: bf16 queries and cache (an FP8 cache's widened segments too),
        aligned rows, pages of a power of two from 4 tokens (a 128-key tile spans at most 32 of them: one table
        entry per lane)."""
        bs = self.block_size
        return (cache.dtype == torch.bfloat16 and not quant and self._rows_aligned(q, out, cache)
                and bs >= 4 and bs & (bs - 1) == 0)

    def _hopper_fp8_covers(self, q, out) -> bool:
        """What the CUDA kernel's FP8 compute takes: a step of its tiles, bf16 queries, aligned rows, pages of a
        power of two from 64 tokens (K and V^T tiles by TMA, 64 key columns a box)."""
        return (self.step_state.config.cuda and self._v_columns is not None
                and self._rows_aligned(q, out, self.cache.buffer))

    def _launch_hopper(self, q, out, part, lse, spec, scale, v_scale, splits, cache, table, stride_block,
                       stride_tok, segment, vt=None, vt_table=None) -> None:
        step = self.step_state
        if vt_table is not None:
            assert vt_table.stride(0) == table.stride(0), "the kernel reads both tables with one stride"
        tensors = dict(q=q, out=out, part=part, lse=lse, cache=cache, table=table, vt=vt, vt_table=vt_table,
                       tiles=step.tiles)
        ps = (0,) * 3 if part is None else part.stride()[:3]
        ls = (0,) * 2 if lse is None else lse.stride()[:2]
        strides = dict(stride_qt=q.stride(0), stride_qh=q.stride(1), stride_ot=out.stride(0), stride_oh=out.stride(1),
                       stride_table=table.stride(0), stride_block=stride_block, stride_tok=stride_tok,
                       v_offset=self.block_size * stride_tok, stride_ps=ps[0], stride_pt=ps[1], stride_ph=ps[2],
                       stride_ls=ls[0], stride_lt=ls[1], stride_vt=0 if vt is None else vt.stride(0))
        seg_lo, seg_hi, segmented, accumulate = segment
        ints = dict(kind=spec.kernel_kind, reach=max(spec.reach, 1), block_size=self.block_size,
                    group=self.group, num_splits=splits, seg_lo=seg_lo,  # the G the step's tiles were cut by
                    seg_hi=seg_hi, segmented=int(segmented), accumulate=int(accumulate))
        self.hopper.launch((len(step.tiles), spec.num_kv_heads, splits), tensors, strides,
                           scale * 1.4426950408889634, v_scale, ints)

    def _descriptor(self, cfg: KernelConfig, cache: torch.Tensor, spec, stride_tok: int, stride_block: int):
        """The TMA descriptor of a layer's (or a segment scratch's) token rows, or None (pointer gathers): TMA where
        the config asks for it, a page holds whole key tiles, the head dim is one TMA box (64 or 128), pages are
        whole rows and every row index fits in int32."""
        rows = cache.numel() // stride_tok
        if not (cfg.tma and self.block_size % cfg.block_n == 0 and spec.head_dim in (64, 128) and rows < 2**31
                and stride_block % stride_tok == 0 and cache.data_ptr() % 16 == 0):
            return None
        from triton.tools.tensor_descriptor import TensorDescriptor

        return TensorDescriptor(cache, [rows, stride_tok], [stride_tok, 1], [cfg.block_n, spec.head_dim])

    def _vt_descriptor(self, cfg: KernelConfig, vt: torch.Tensor, spec):
        """TMA descriptor of a segment's transposed V (``[heads * head_dim, columns]``, e4m3), boxes of head_dim x
        key tile; None where a row's bytes are not a multiple of 16 (TMA's stride unit)."""
        if vt.stride(0) % 16 or vt.data_ptr() % 16:
            return None
        from triton.tools.tensor_descriptor import TensorDescriptor

        return TensorDescriptor(vt, list(vt.shape), [vt.stride(0), 1], [spec.head_dim, cfg.block_n])
