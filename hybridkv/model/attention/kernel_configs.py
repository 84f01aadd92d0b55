"""The tiles the paged attention kernels run, chosen once per backend (``choose_kernel_configs``) from the KV layout,
the device and what the kernels are given; and which launches of a prefill step the Hopper CUDA kernel takes.

E.g. a Scout rank on an H200 (one KV head of 128 values, 5 query heads, bf16, 64-token pages): prefill steps in
the CUDA kernel's tiles (``HOPPER_CUDA_PREFILL``), decode steps in 16-row tiles of 64 keys (``DECODE_FEW``) or 128
(``DECODE``); on an A100, prefill in Triton's 256-row tiles (``PREFILL``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from hybridkv.kernels import hopper_attention  # torch only: its CUDA imports wait for a Hopper GPU
from hybridkv.kv.layout import KVLayout
from hybridkv.kv.specs import AttentionSpec
from hybridkv.model.attention.fp8_segments import SEGMENT_BYTES
from hybridkv.model.dtypes import torch_dtype


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
    # decode tiles (one query a sequence): launched programmatically dependent, an FP8 cache's dots in fp16
    decode: bool = False


# Prefill tiles are compute-bound: wide tiles, deep pipelining. Decode is bandwidth-bound: 16 rows (the least a
# tensor-core dot takes), long key tiles, and the KV range split across programs to fill the GPU.
# Chosen by `benchmarks/gpu/attention.py --sweep` on an H200: prefill 32K full 372 TFLOP/s
# with 256x64 tiles (299 with 128x64); decode 1M 3.4 TB/s with 128-key tiles and 256 splits (1.8 TB/s with 64).
PREFILL = KernelConfig(rows=256, block_n=64, num_warps=8, num_stages=3)
DECODE = KernelConfig(rows=16, block_n=128, num_warps=4, num_stages=3, decode=True)
# A layer group of a decode step of at most FEW_SEQS sequences whose reach, summed over its sequences and KV heads,
# is at most FEW_KEYS keys: 64-key tiles. Few keys leave a step bound by latency, where a shorter tile ends sooner;
# many keys stream faster in 128-key tiles. Graph replays of a Scout rank's step on an H200
# (`tools/kernel_dev/decode_stages.py --variants`, 64-key against 128-key tiles in every layer, ms):
#   one KV head (Scout over 8 GPUs): batch 1 at 16K 2.49 / 2.62, 1M 3.99 / 4.06, 5M 9.95 / 9.67;
#     batch 2 at 128K 3.25 / 3.38, at 1M 6.45 / 5.86; batch 32 at 128K 15.97 / 14.54;
#   two KV heads (`--shapes-of-tp 4`): batch 1 at 16K 3.46 / 3.65, 128K 3.89 / 4.02, 1M 7.08 / 6.47,
#     5M 21.56 / 17.79; batch 2 at 128K 5.00 / 4.97.
# The chunked layers' 8K reach stays under FEW_KEYS however long the context: their tiles stay short.
DECODE_FEW = KernelConfig(rows=16, block_n=64, num_warps=4, num_stages=3, decode=True)
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
# step's tiles of whole tokens (``KernelConfigs.triton_prefill``).
# `tools/kernel_dev/hopper_kernel.py` on an H200, both kernels on the same inputs: 600 TFLOP/s one-shot and 620 on
# a 16K step over 1M (HOPPER_PREFILL: 481 / 499); current figures, FP8 compute's too: docs/benchmarks.md#attention.
HOPPER_CUDA_PREFILL = KernelConfig(rows=hopper_attention.ROWS, block_n=hopper_attention.BLOCK_N,
                                   num_warps=hopper_attention.THREADS // 32, num_stages=hopper_attention.STAGES,
                                   cuda=True)
# Head dims above 128 (Gemma-3: 256) need smaller tiles: a 256x64 tile of 256-wide rows overflows registers and
# three stages of 64x256 K and V tiles overflow shared memory. Correct first; not yet tuned on a device.
WIDE_HEAD_PREFILL = KernelConfig(rows=64, block_n=32, num_warps=4, num_stages=2)
WIDE_HEAD_DECODE = KernelConfig(rows=16, block_n=64, num_warps=4, num_stages=2, decode=True)
# Splits of a decode step's KV range: a few programs per SM keep enough loads in flight. A Scout rank's full layer
# alone, one H200, attention and combine: 1M 131 us with 256 splits, 139 with 512; 128K 27.8 and 33.2; 16K 11.1
# and 15.3 (a graph's split count is fixed by max_model_len, and every program is launched however few have keys).
SPLITS_PER_SM = 4
MAX_SPLITS = 256


def reach_cap(spec: AttentionSpec) -> int:
    """The most keys one sequence's step is counted as reading in a layer group of ``spec``, for its split count
    and tiles: a local type's reach with 64 keys of slack; unbounded for full attention."""
    return spec.reach + 64 if spec.reach else 2**31 - 1  # positions are int32


@dataclass(frozen=True, slots=True)
class KernelDevice:
    """What the choice of tiles reads of the device."""

    capability: tuple[int, int] | None  # CUDA compute capability; None: not a CUDA device (Triton's interpreter)
    num_sms: int  # how many programs fill the GPU; decides KV splits
    name: str = ""
    cuda_kernel: bool = True  # the Hopper CUDA kernel can be built here (False: it failed to, see the warning)

    @classmethod
    def of(cls, device: torch.device, num_sms: int | None = None) -> KernelDevice:
        if device.type != "cuda":  # a CPU device only happens under Triton's interpreter, in development
            return cls(None, 8 if num_sms is None else num_sms, str(device))
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        return cls(torch.cuda.get_device_capability(device), num_sms, torch.cuda.get_device_name(device))

    @property
    def hopper(self) -> bool:
        return self.capability is not None and self.capability[0] == 9


@dataclass(frozen=True, slots=True)
class Operands:
    """What the kernels are given: the rank's query heads, the queries' dtype and the cache's."""

    num_q_heads: int
    kv_dtype: str
    dtype: torch.dtype  # the queries' (the model's)

    @classmethod
    def of(cls, num_q_heads: int, kv_dtype: str, dtype: torch.dtype | None = None) -> Operands:
        """``dtype`` None: the cache's, bf16 over an FP8 cache."""
        if dtype is None:
            dtype = torch.bfloat16 if kv_dtype.startswith("fp8") else torch_dtype(kv_dtype)
        return cls(num_q_heads, kv_dtype, dtype)


@dataclass(frozen=True, slots=True)
class KernelOptions:
    """What a caller may choose: tiles (None: chosen for the layout and device), the CUDA kernel off, FP8 prefill
    dots over an FP8 cache, the bytes of one FP8 segment's scratch and the most KV splits of a launch."""

    prefill: KernelConfig | None = None
    decode: KernelConfig | None = None
    decode_few: KernelConfig | None = None  # None: DECODE_FEW with the default decode tiles, else ``decode``
    hopper_kernel: bool = True
    fp8_compute: bool = False
    segment_bytes: int = SEGMENT_BYTES
    max_splits: int = MAX_SPLITS


@dataclass(frozen=True, slots=True)
class KernelConfigs:
    """The tiles a backend runs, and which launches of a prefill step the CUDA kernel takes (all False unless
    ``prefill.cuda``; the others run Triton over ``triton_prefill``)."""

    group: int  # query heads per KV head: they share the rows of one tile, and a step's tiles are cut by it
    prefill: KernelConfig  # a prefill step's tiles: the CUDA kernel's (``cuda``) or Triton's
    decode: KernelConfig
    decode_few: KernelConfig | None  # a decode step's over few keys (``decode_tiles``); None: ``decode`` always
    triton_prefill: KernelConfig  # Triton's tiles for what the CUDA kernel does not take: 128 rows like its own
    fp8_compute: bool  # prefill dots in e4m3 over an FP8 cache
    cuda_pages: bool  # bf16 queries over a bf16 cache's pages
    cuda_segments: bool  # bf16 queries over an FP8 cache's segments widened to bf16
    cuda_fp8: bool  # FP8 compute: bf16 queries, pages of a power of two from 64 tokens

    def decode_tiles(self, num_seqs: int, keys: int) -> KernelConfig:
        """The tiles of a decode step's layer group whose reach over all its sequences and KV heads is ``keys``.

        E.g. one sequence at 16K context, 2 KV heads: 32K keys -> 64-key tiles (``DECODE_FEW``); at 1M: 2M keys
        -> 128-key tiles (``DECODE``) for the full layers, while the chunked layers (8K reach) keep 64-key ones."""
        return self.decode_few if self.may_read_few(num_seqs) and keys <= FEW_KEYS else self.decode

    def may_read_few(self, num_seqs: int) -> bool:
        """Whether a decode step of ``num_seqs`` sequences reads ``decode_few`` tiles where its reach is short."""
        return self.decode_few is not None and num_seqs <= FEW_SEQS

    def reads_many_keys(self, layout: KVLayout, lens: list[int]) -> bool:
        """Whether some layer group reads more than FEW_KEYS keys, over its KV heads, for sequences of ``lens``
        tokens (a few ints: plain Python is quicker than numpy here)."""
        return any(sum(min(n, reach_cap(g.spec)) for n in lens) * g.spec.num_kv_heads > FEW_KEYS
                   for g in layout.groups)

    def cuda_takes(self, segments: bool) -> bool:
        """Whether the CUDA kernel takes a prefill step's launches over a layer group (``segments``: the group's
        reach is cut into FP8 segments this step)."""
        if self.fp8_compute:
            return self.cuda_fp8
        return self.cuda_segments if segments else self.cuda_pages


def choose_kernel_configs(layout: KVLayout, device: KernelDevice, operands: Operands,
                          options: KernelOptions = KernelOptions()) -> KernelConfigs:
    """The tiles for ``layout`` on ``device``, and which prefill launches the CUDA kernel takes. Tiles given in
    ``options`` are kept as given (the CUDA kernel runs only with the default prefill tiles).

    E.g. on an H200 (capability 9.0), head dim 128, 5 query heads a KV head, 64-token pages, a bf16 cache and
    queries: ``HOPPER_CUDA_PREFILL``, ``triton_prefill`` ``HOPPER_PREFILL``, ``cuda_pages``; an FP8 cache instead:
    ``cuda_segments``; 16-token pages: ``triton_prefill`` gathers (no TMA); an A100 (8.0): ``PREFILL``, no CUDA."""
    specs = [g.spec for g in layout.groups]
    bs = layout.block_size
    group = max(operands.num_q_heads // s.num_kv_heads for s in specs)
    fp8_compute = options.fp8_compute and operands.kv_dtype.startswith("fp8")
    if fp8_compute and device.capability is not None and device.capability < (8, 9):
        raise ValueError(f"FP8 attention compute needs FP8 tensor cores (compute capability 8.9+); {device.name} "
                         "has none")
    wide = max(s.head_dim for s in specs) > 128
    if options.prefill is not None:
        prefill = _tiles(options.prefill, decode=False)
    elif wide:
        prefill = WIDE_HEAD_PREFILL
    elif device.hopper and bs % HOPPER_PREFILL.block_n == 0 and all(s.head_dim in (64, 128) for s in specs):
        prefill = HOPPER_PREFILL
    else:
        prefill = PREFILL
    decode = _tiles(options.decode, decode=True) if options.decode is not None else (
        WIDE_HEAD_DECODE if wide else DECODE)
    if options.decode_few is not None:
        decode_few = _tiles(options.decode_few, decode=True)
    else:  # decode tiles given alone serve every decode step
        decode_few = DECODE_FEW if options.decode is None and not wide else None
    decode_few = None if decode_few == decode else decode_few
    rows = decode.rows if decode_few is None else min(decode.rows, decode_few.rows)
    if group > rows:
        raise ValueError(f"{group} query heads per KV head: more than one tile's {rows} rows")
    # the Triton tiles of prefill steps the CUDA kernel does not cover: 128 rows like it, gathered if not TMA
    triton_prefill = prefill if prefill.rows == HOPPER_PREFILL.rows else replace(HOPPER_PREFILL, tma=False)
    # the CUDA kernel's tiles cut a step's rows by one G: every layer group must have that G
    cuda = (options.hopper_kernel and device.hopper and device.cuda_kernel and options.prefill is None and all(
        s.head_dim == hopper_attention.HEAD_DIM and s.num_kv_heads * group == operands.num_q_heads for s in specs))
    # its bf16 dots read pages of a power of two from 4 tokens (a 128-key tile spans at most 32: one table entry a
    # lane); its FP8 dots pages of a power of two from 64 (K and V^T tiles by TMA, 64 key columns a box)
    bf16 = cuda and operands.dtype == torch.bfloat16 and bs >= 4 and bs & (bs - 1) == 0
    return KernelConfigs(
        group=group, prefill=HOPPER_CUDA_PREFILL if cuda else prefill, decode=decode, decode_few=decode_few,
        triton_prefill=triton_prefill, fp8_compute=fp8_compute,
        cuda_pages=bf16 and torch_dtype(operands.kv_dtype) == torch.bfloat16,
        cuda_segments=bf16 and operands.kv_dtype.startswith("fp8"),
        cuda_fp8=bf16 and fp8_compute and bs >= 64,
    )


def _tiles(config: KernelConfig, decode: bool) -> KernelConfig:
    """``config`` marked as decode tiles or not (a caller's own tiles need not say)."""
    return config if config.decode == decode else replace(config, decode=decode)
