"""The Hopper prefill kernel (``hopper_attention.cu``): compiled by NVRTC for sm_90a on first use (the machine code
kept in ``CUBIN_CACHE`` for the next process) and launched through the CUDA driver API on torch's current stream.

Triton 3.6 cannot express its warp specialization (a producer warpgroup loading pages by TMA, two consumer
warpgroups overlapping their softmax with their dots, ``setmaxnreg``), so it is CUDA C++ with inline PTX.
It needs ``cuda-bindings`` (``pip install 'hybridkv[gpu]'``) and NVRTC (PyTorch's CUDA wheels bring
``nvidia-cuda-nvrtc``); where either is missing, the backend warns why and keeps the Triton kernel.

It covers what long prompts run, head dim 128, full, sliding and chunked layers, KV splits (partial outputs and LSE
for ``combine_splits_kernel``):
- bf16 queries over a bf16 cache, or over the bf16 segments an FP8 cache's long reach is widened into (partial
  outputs merged across segments); pages of a power of two from 4 tokens (TMA from 16).
- FP8 compute (``fp8=True``): bf16 queries quantized per row in the kernel, e4m3 K from the cache's pages, V from
  the backend's transposed e4m3 copy of each segment whose columns are permuted by ``page_columns``; pages of a
  power of two from 64 tokens (K and V^T tiles by TMA)."""

from __future__ import annotations

import ctypes
import re
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from hybridkv.kernels import cuda_build
from hybridkv.kernels.cuda_build import CUBIN_CACHE, check

SOURCE = Path(__file__).with_name("hopper_attention.cu")
THREADS = 384  # a producer warpgroup and two consumers
ROWS = 128  # query rows per CTA: 64 per consumer
BLOCK_N = 128  # keys per tile
FP8_BLOCK_N = 192  # FP8 compute: keys per tile (FP8_BN in the .cu file says why)
HEAD_DIM = 128
MAX_TENSOR_MAPS = 256  # a model's layers, a few times over
STAGES = 3  # key tiles in flight (K and V: 64 KB each; 3 fill the 227 KB a CTA may have)
FP8_STAGES = 4  # FP8 compute: K and V^T tiles of 24 KB each
# FP8 compute: V^T's column order within each 16 keys. The S accumulator gives a thread the keys 2t, 2t + 1, 8 + 2t,
# 9 + 2t of each 16 (t: its place in a quad); an 8-bit wgmma's A fragment reads a thread's 4 bytes as k-indices 4t..
# 4t + 3. So k-index a = 4t + 2b + e of V^T holds key 8b + 2t + e, and P goes from S to the next dot as it lies.
V_PERM16 = tuple(8 * ((a >> 1) & 1) + 2 * (a >> 2) + (a & 1) for a in range(16))

_POINTERS = ("q", "out", "part", "lse", "cache", "table", "tiles", "vt", "vt_table")
_STRIDES = ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_table", "stride_block", "stride_tok",
            "v_offset", "stride_ps", "stride_pt", "stride_ph", "stride_ls", "stride_lt", "stride_vt")
_INTS = ("kind", "reach", "block_size", "group", "num_splits", "seg_lo", "seg_hi", "segmented", "accumulate",
         "tma", "rows_per_block")


class _Params(ctypes.Structure):
    """Mirror of ``struct Params`` in the .cu file, field for field."""

    _fields_ = ([(n, ctypes.c_void_p) for n in _POINTERS] + [(n, ctypes.c_longlong) for n in _STRIDES]
                + [("qk_scale", ctypes.c_float), ("v_scale", ctypes.c_float)] + [(n, ctypes.c_int) for n in _INTS])


def shared_bytes(stages: int = STAGES, fp8: bool = False, fp8_block_n: int = FP8_BLOCK_N) -> int:
    """Dynamic shared memory of one CTA (``struct Smem`` in the .cu file): two query tiles of 64 rows, ``stages`` x
    (K + V) key tiles (128 keys; FP8: ``fp8_block_n``), barriers, FP8's 128 query-row factors, and 1 KB to align
    the swizzled tiles."""
    elem, block_n = (1, fp8_block_n) if fp8 else (2, BLOCK_N)
    return 2 * 64 * HEAD_DIM * elem + stages * 2 * block_n * HEAD_DIM * elem + 16 * stages + 512 * fp8 + 1024


def work_items(q_loc: np.ndarray, q_len: np.ndarray, ctx: np.ndarray, group: int, rows: int = ROWS) -> np.ndarray:
    """The kernel's ``tiles``: each sequence's query rows (its tokens x the ``group`` query heads of one KV head,
    token by token) cut into tiles of ``rows``, longest first (the GPU starts CTAs in grid order, so the short
    causal tiles fill the last wave). Per tile: its sequence, its first token's row in q and out, that token's
    position, and the tokens its rows touch | (the head its row 0 holds) << 16; ``[tiles, 4]`` int32, one 16-byte
    load a CTA. A tile may end inside a token's heads and the next go on from there: a G of 5 fills 128 rows where
    whole tokens would fill 125.

    E.g. G 5: 30 new tokens over 100 cached are 150 rows, tile 0 rows 0-127 (tokens 0-24 and heads 0-2 of token
    25) and tile 1 rows 128-149 (token 25 from head 3, tokens 26-29); 10 new tokens over none, one tile:
    ``[[0, 25, 125, 5 | 3 << 16], [0, 0, 100, 26], [1, 30, 0, 10]]``."""
    q_len = np.asarray(q_len, dtype=np.int64)
    per_seq = -(-q_len * group // rows)
    seq = np.repeat(np.arange(len(q_len)), per_seq)
    row0 = (np.arange(int(per_seq.sum())) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)) * rows
    t0, h0 = row0 // group, row0 % group
    n_tok = np.minimum((h0 + rows - 1) // group + 1, q_len[seq] - t0)
    pos = np.asarray(ctx)[seq] + t0
    items = np.stack([seq, np.asarray(q_loc)[seq] + t0, pos, n_tok | (h0 << 16)], axis=1)
    return items[np.argsort(-pos, kind="stable")].astype(np.int32)


def page_columns(block_size: int) -> list[int]:
    """FP8 compute: which key offset of a page each of its V^T columns holds (``V_PERM16`` within every 16 keys; a
    16-key group never straddles two pages). E.g. columns 0..15 hold offsets 0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12,
    13, 6, 7, 14, 15: V^T is gathered as ``v[:, page_columns(block_size)]``."""
    return [16 * (c // 16) + V_PERM16[c % 16] for c in range(block_size)]


# an RS wgmma in SASS (HGMMA bf16, QGMMA FP8): accumulators, then register A (4 registers from the one named)
_RS_DOT = re.compile(r"[HQ]GMMA\.\S+ R\d+, R(\d+), gdesc")
_WRITES = re.compile(r"^(?:@!?U?P[T\d]\s+)?([A-Z][\w.]*)\s+R(\d+)\b")
_NOT_WRITES = ("ST", "BAR", "SYNCS", "BRA", "WARPGROUP", "HGMMA", "QGMMA", "RED", "ATOM", "FENCE", "MEMBAR")


def inflight_register_writes(sass: str) -> list[str]:
    """The instructions of a disassembled kernel (``cuobjdump -sass``) that write a register a P V dot reads as its A
    while the dot may still run: between an RS wgmma and the next ``WARPGROUP.DEPBAR.LE gsb0, 0x0``, in address
    order. ptxas counts register A as read when the dot is issued and may give those registers to other values,
    but the dot reads them until its wait (a P packed early gave NaN). E.g. ``QGMMA.64x128x32...
    R120, R184, gdesc[UR8], R120`` then ``FFMA R186, R2, R3, R4`` before the wait: that FFMA. Empty for a sound
    build; the GPU tests check each."""
    a_regs: set[int] = set()  # of the dots issued since the last full wait (and within one function)
    found = []
    for line in sass.splitlines():
        body = line.split("*/", 1)[-1].split(";", 1)[0].strip()
        if dot := _RS_DOT.search(body):
            a_regs.update(range(int(dot.group(1)), int(dot.group(1)) + 4))
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in body or "Function :" in line:
            a_regs.clear()
        elif a_regs and (w := _WRITES.match(body)) and not w.group(1).startswith(_NOT_WRITES):
            width = 4 if ".128" in w.group(1) else 2 if (".64" in w.group(1) or ".WIDE" in w.group(1)) else 1
            if a_regs & set(range(int(w.group(2)), int(w.group(2)) + width)):
                found.append(body)
    return found


def compile_options(stages: int = STAGES, defines: dict[str, int] | None = None, fp8_stages: int = FP8_STAGES,
                    fp8_block_n: int = FP8_BLOCK_N) -> list[str]:
    """The compiler's options for the .cu file, NVRTC's and nvcc's alike: sm_90a (wgmma and setmaxnreg need the
    'a' target) and the source's compile-time switches."""
    opts = ["--gpu-architecture=sm_90a", "-std=c++17", f"-DSTAGES={stages}", f"-DFP8_STAGES={fp8_stages}",
            f"-DFP8_BN={fp8_block_n}"]
    return opts + [f"-D{k}={v}" for k, v in (defines or {}).items()]


def compile_cubin(stages: int = STAGES, source: str | None = None, defines: dict[str, int] | None = None,
                  fp8_stages: int = FP8_STAGES, cache_dir: Path | None = CUBIN_CACHE,
                  fp8_block_n: int = FP8_BLOCK_N) -> bytes:
    """NVRTC: the .cu source (or ``source``, a variant of it) to sm_90a machine code, or the same build from
    ``cache_dir``. ``defines`` set the source's compile-time switches (OVERLAP, PINGPONG: benchmarks time them)."""
    return cuda_build.compile_cubin(SOURCE, compile_options(stages, defines, fp8_stages, fp8_block_n), source,
                                    cache_dir)


class HopperPrefill:
    """The compiled kernels (bf16 and FP8 compute), loaded into ``device``'s primary context."""

    def __init__(self, device: torch.device, stages: int = STAGES, source: str | None = None,
                 defines: dict[str, int] | None = None, fp8_stages: int = FP8_STAGES,
                 cache_dir: Path | None = CUBIN_CACHE, fp8_block_n: int = FP8_BLOCK_N) -> None:
        from cuda.bindings import driver

        self.driver = driver
        self.device = device
        self.stages = stages
        self._image = ctypes.create_string_buffer(
            compile_cubin(stages, source, defines, fp8_stages, cache_dir, fp8_block_n))
        with torch.cuda.device(device):  # the module belongs to the device's primary context: make it current
            torch.empty(1, device=device)
            self._ensure_context()
            self.module = check(driver.cuModuleLoadData(ctypes.addressof(self._image)), "cuModuleLoadData")
            # per kernel: its function and dynamic shared memory
            self.kernels = {}
            for fp8, name, n in ((False, b"paged_prefill_hopper", stages), (True, b"paged_prefill_hopper_fp8",
                                                                               fp8_stages)):
                function = check(driver.cuModuleGetFunction(self.module, name), "cuModuleGetFunction")
                smem = shared_bytes(n, fp8, fp8_block_n)
                attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                check(driver.cuFuncSetAttribute(function, attr, smem), "cuFuncSetAttribute")
                self.kernels[fp8] = (function, smem)
        self._maps: OrderedDict[tuple, object] = OrderedDict()  # per tensor base and box: TMA map
        self._no_map = driver.CUtensorMap()
        self.launches = 0  # so far: how tests and benchmarks tell this kernel's work from the Triton fallback's

    def _ensure_context(self) -> None:
        cuda_build.ensure_context(self.driver, self.device)

    def tensor_map(self, tensor: torch.Tensor, row_elems: int, box: tuple[int, int], swizzle_bytes: int = 128):
        """The TMA tensor map of ``tensor`` seen as ``[rows, row_elems]`` from its first element (a layer's token
        rows, or a segment's V^T), bf16 or bytes; boxes of ``box`` (columns, rows) in the kernel's swizzled shared
        memory layout (128- or 64-byte swizzle); cached by base address."""
        key = (tensor.data_ptr(), tensor.numel(), tensor.element_size(), row_elems, box, swizzle_bytes)
        if key in self._maps:
            self._maps.move_to_end(key)
        else:
            if len(self._maps) >= MAX_TENSOR_MAPS:
                self._maps.popitem(last=False)
            d = self.driver
            dtype = (d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8 if tensor.element_size() == 1
                     else d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16)
            swizzle = {128: d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
                       64: d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B}[swizzle_bytes]
            self._maps[key] = check(d.cuTensorMapEncodeTiled(
                dtype, 2, tensor.data_ptr(),
                [d.cuuint64_t(row_elems), d.cuuint64_t(tensor.numel() // row_elems)],
                [d.cuuint64_t(row_elems * tensor.element_size())],
                [d.cuuint32_t(box[0]), d.cuuint32_t(box[1])], [d.cuuint32_t(1), d.cuuint32_t(1)],
                d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")
        return self._maps[key]

    def launch(self, grid: tuple[int, int, int], tensors: dict[str, torch.Tensor | None], strides: dict[str, int],
               qk_scale: float, v_scale: float, ints: dict[str, int]) -> None:
        """One launch on torch's current stream. ``tensors`` holds every pointer of ``Params`` (None: unused),
        ``strides`` its strides in elements, ``ints`` its integer fields but ``tma`` and ``rows_per_block``.
        With ``tensors["vt"]`` (FP8 compute, an e4m3 cache) the FP8 kernel runs.

        Tiles inside the reach arrive by TMA where the cache allows it: pages of 16+ tokens (a tile's boxes, 4 per
        page up to 128 rows, one per lane of a warp) and whole token rows per page; else every tile is gathered.
        FP8 compute needs TMA (the backend only sends it pages of 64+ tokens)."""
        cache, bs, row_elems = tensors["cache"], ints["block_size"], strides["stride_tok"]
        fp8 = tensors.get("vt") is not None
        tma = (bs >= 16 and strides["stride_block"] % row_elems == 0 and (row_elems * cache.element_size()) % 16 == 0
               and cache.numel() // row_elems < 2**31)
        if fp8 and not (tma and bs >= 64):
            raise ValueError(f"FP8 compute in the CUDA kernel needs TMA pages of 64+ tokens (got {bs})")
        ints = dict(ints, tma=int(tma), rows_per_block=strides["stride_block"] // row_elems)
        maps = [self._no_map]
        if tma:  # bf16: 64-column panels of min(page, 128) rows; FP8: one 128-byte row of a head, 64 rows a box
            maps[0] = self.tensor_map(cache, row_elems, (HEAD_DIM, 64) if fp8 else (64, min(bs, BLOCK_N)))
        if fp8:  # V^T: boxes of 64 key columns x the head's 128 rows
            vt = tensors["vt"]
            maps.append(self.tensor_map(vt, vt.shape[1], (64, HEAD_DIM), swizzle_bytes=64))
        params = _Params(
            *[0 if tensors.get(n) is None else tensors[n].data_ptr() for n in _POINTERS],
            *[strides.get(n, 0) for n in _STRIDES], qk_scale, v_scale, *[ints[n] for n in _INTS],
        )
        argv = (ctypes.c_void_p * (1 + len(maps)))(ctypes.addressof(params), *[m.getPtr() for m in maps])
        stream = self.driver.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        function, smem = self.kernels[fp8]
        self.launches += 1
        self._ensure_context()
        check(self.driver.cuLaunchKernel(function, *grid, THREADS, 1, 1, smem, stream, ctypes.addressof(argv), 0),
               "cuLaunchKernel")
