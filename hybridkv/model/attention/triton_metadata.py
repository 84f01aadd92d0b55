"""The Triton backend's step metadata (``TritonMetadataBuilder``), built once a step on the host and shared by every
layer: sequence offsets and lengths and the query tiles, and per layer *group* the block table, the write slots,
the number of KV splits, the FP8 segments and the kernel its launches go to. A hybrid model pays for metadata once
per attention group, not per layer (vLLM's hybrid manager rebuilt it per group and per layer type, costing ~2 ms
of decode latency on Llama-4). Decode steps replayed from CUDA graphs read the same metadata from fixed buffers
(``StaticDecode``), written in place each step.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridkv.kernels import hopper_attention  # torch only: its CUDA imports wait for a Hopper GPU
from hybridkv.kv.layout import KVLayout, LayerGroup
from hybridkv.model.attention.base import StepSequence
from hybridkv.model.attention.fp8_segments import SegmentPlanner
from hybridkv.model.attention.kernel_configs import (
    SPLITS_PER_SM, KernelConfig, KernelConfigs, KernelDevice, reach_cap,
)
from hybridkv.model.attention.static_decode import StaticDecode
from hybridkv.model.attention.triton_step import GroupMeta, Launches, TritonStepState


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


def query_tiles(q_lens: np.ndarray, ctx: np.ndarray, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """A step's query tiles of ``tokens`` tokens, as (sequence, first query's offset in it), longest first: the GPU
    starts programs in grid order, so the short causal tiles fill the last wave. E.g. 30 and 10 new tokens over 100
    and 0 cached, 25 tokens a tile: sequences [0, 0, 1], offsets [25, 0, 0]."""
    tiles_per_seq = -(-q_lens // tokens)
    tile_seq = np.repeat(np.arange(len(q_lens), dtype=np.int32), tiles_per_seq)
    tile_q0 = np.concatenate([np.arange(n, dtype=np.int32) * tokens for n in tiles_per_seq])
    order = np.argsort(-(ctx[tile_seq] + tile_q0), kind="stable")
    return tile_seq[order], tile_q0[order]


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


class TritonMetadataBuilder:
    """Builds each step's ``TritonStepState``: eagerly (``build_step``) or into the static decode buffers of a CUDA
    graph (``build_static_decode``). Where a prefill step runs the CUDA kernel's tiles, each layer group's launches
    are sent to it or to Triton here (``KernelConfigs.cuda_takes``), not at launch."""

    def __init__(self, layout: KVLayout, configs: KernelConfigs, device: KernelDevice, launches: Launches,
                 segments: SegmentPlanner | None, max_splits: int, torch_device: torch.device) -> None:
        """``segments``: the FP8 segments' planner (None: not an FP8 cache)."""
        self.layout = layout
        self.block_size = layout.block_size
        self.configs = configs
        self.device = device
        self.launches = launches
        self.segments = segments
        self.max_splits = max_splits
        self.torch_device = torch_device
        self.static: StaticDecode | None = None

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.torch_device, non_blocking=True)

    # ---- per step ----------------------------------------------------------------------------------
    def build_step(self, seqs: list[StepSequence]) -> TritonStepState:
        configs, as_dev = self.configs, self._to_device
        q_lens = np.array([s.query_len for s in seqs], dtype=np.int32)
        ctx = np.array([s.context_len for s in seqs], dtype=np.int32)
        q_loc = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int32)
        config = configs.decode_tiles(len(seqs), 0) if int(q_lens.max()) == 1 else configs.prefill
        tokens = config.rows // configs.group
        tile_seq, tile_q0 = query_tiles(q_lens, ctx, tokens)
        seq = [as_dev(tile_seq), as_dev(tile_q0), as_dev(q_loc), as_dev(q_lens), as_dev(ctx)]
        tiles = None
        if config.cuda:
            tiles = as_dev(hopper_attention.work_items(q_loc, q_lens, ctx, configs.group))
        step = TritonStepState(config, tokens, len(tile_seq), seq, tiles)
        step.groups = [self._group_meta(step, g, seqs, ctx + q_lens) for g in self.layout.groups]
        return step

    def _group_meta(self, step: TritonStepState, group: LayerGroup, seqs: list[StepSequence],
                    seq_lens: np.ndarray) -> GroupMeta:
        bs, configs, as_dev = self.block_size, self.configs, self._to_device
        tables = [s.block_tables[group.group_id] for s in seqs]
        width = max(len(t) for t in tables)
        table = np.zeros((len(seqs), width), dtype=np.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = t
        new = np.concatenate([np.arange(s.context_len, s.context_len + s.query_len) for s in seqs])
        owner = np.repeat(np.arange(len(seqs)), [s.query_len for s in seqs])
        blocks = table[owner, new // bs]
        spec = group.spec
        reaches = np.minimum(seq_lens, reach_cap(spec))
        reach = int(reaches.max())
        config = step.config
        if config.decode:
            config = configs.decode_tiles(len(seqs), int(reaches.sum()) * spec.num_kv_heads)
        meta = GroupMeta(as_dev(table), as_dev(blocks), as_dev((new % bs).astype(np.int32)),
                         self.num_splits(step, reach, spec.num_kv_heads, config), config, self.launches.triton)
        long_reach = reach >= 256 * configs.prefill.block_n
        if self.segments is not None and not step.config.decode and (configs.fp8_compute or long_reach):
            meta.segments, meta.scratch_table = self.segments.plan(spec, seqs, table, configs.prefill.block_n,
                                                                   as_dev)
        if step.config.cuda and not configs.cuda_takes(bool(meta.segments)):
            # what the CUDA kernel does not take: Triton over the step's tiles of whole tokens
            meta.config = configs.triton_prefill
        elif step.config.cuda:
            meta.launch = self.launches.cuda
        return meta

    def num_splits(self, step: TritonStepState, longest_reach: int, kv_heads: int, config: KernelConfig) -> int:
        """Split the KV range only when too few programs would run otherwise (decode of few long sequences)."""
        num_sms = self.device.num_sms
        programs = (step.num_tiles if step.tiles is None else len(step.tiles)) * kv_heads
        block_n = config.block_n
        if programs >= num_sms:
            # prefill over a long context (Scout's full layers at 16K+, not its 8K chunks): over short ones the
            # combine pass costs more than the idle SMs
            long_prefill = not config.decode and longest_reach >= 256 * block_n
            return wave_splits(programs, num_sms * config.programs_per_sm) if long_prefill else 1
        if longest_reach <= 4 * block_n:
            return 1
        want = _pow2_floor(max(1, SPLITS_PER_SM * num_sms // programs))
        # Long splits stream best (32+ key tiles each: 1M keys -> 256 splits); short contexts still get up to
        # 128 splits of 4+ tiles, or too few SMs would work.
        long_splits = _pow2_floor(max(1, longest_reach // (32 * block_n)))
        short_splits = min(128, _pow2_floor(max(1, longest_reach // (4 * block_n))))
        return min(want, max(long_splits, short_splits), self.max_splits)

    # ---- decode steps replayed from CUDA graphs --------------------------------------------------------
    def enable_static_decode(self, max_seqs: int, max_model_len: int) -> None:
        self.static = StaticDecode.allocate(self.layout, max_seqs, max_model_len, self.torch_device)

    def build_static_decode(self, seqs: list[StepSequence], padded: int, token_ids: np.ndarray | None,
                            many: bool) -> TritonStepState:
        """The step state of a decode graph of ``padded`` rows, its buffers holding this step's ``seqs``."""
        st = self.static
        st.write_step(seqs, padded, token_ids)
        return st.steps.get((padded, many)) or self._static_step(padded, many)

    def _static_step(self, padded: int, many: bool) -> TritonStepState:
        """The step state of a decode graph of ``padded`` rows (``many``: see ``static_variants``): views of the
        static buffers, built once."""
        st, configs = self.static, self.configs
        config = configs.decode_tiles(padded, 0)
        step = TritonStepState(config, config.rows // configs.group, padded, [buf[:padded] for buf in st.seq])
        for g, group in enumerate(self.layout.groups):
            spec = group.spec
            reach = min(st.max_model_len, reach_cap(spec))
            # a function of the graph alone: the tiles and split count it was captured with are those it replays
            # with (a split that sees no key stores nothing, so any count is right for any context)
            keys = padded * reach * spec.num_kv_heads if many else 0
            group_config = configs.decode_tiles(padded, keys)
            splits = self.num_splits(step, reach, spec.num_kv_heads, group_config)
            step.groups.append(GroupMeta(st.tables[g][:padded], st.slot_block(g)[:padded],
                                         st.slot_offset(g)[:padded], splits, group_config, self.launches.triton))
        st.steps[(padded, many)] = step
        return step

    def many_keys(self, seqs: list[StepSequence]) -> bool:
        """A decode step some layer group of which reads 128-key tiles only because its reach is long: its
        graph is the ``many`` one of its batch size."""
        configs = self.configs
        return configs.may_read_few(len(seqs)) and configs.reads_many_keys(
            self.layout, [s.context_len + 1 for s in seqs])

    def static_variants(self, padded: int) -> list[bool]:
        """The ``many`` values a decode graph of ``padded`` rows is captured for: [False], or [False, True] where
        a step of that size can read 128-key tiles in some group because of its reach (``many_keys``)."""
        configs = self.configs
        many = configs.may_read_few(padded) and configs.reads_many_keys(
            self.layout, [self.static.max_model_len] * padded)
        return [False, True] if many else [False]
