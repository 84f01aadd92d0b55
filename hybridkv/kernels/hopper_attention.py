"""The Hopper prefill kernel (``hopper_attention.cu``): compiled by NVRTC for sm_90a on first use and launched
through the CUDA driver API on torch's current stream.

Triton 3.6 cannot express its warp specialization (a producer warpgroup loading pages by TMA, two consumer
warpgroups overlapping their softmax with their dots, ``setmaxnreg``), so it is CUDA C++ with inline PTX.
It needs ``cuda-bindings`` (``pip install 'hybridkv[gpu]'``) and NVRTC (PyTorch's CUDA wheels bring
``nvidia-cuda-nvrtc``); where either is missing, the backend warns why and keeps the Triton kernel.

It covers what long prompts run: bf16 queries over a bf16 cache, or over the bf16 segments an FP8 cache's long
reach is widened into (partial outputs merged across segments); head dim 128, pages of a power of two from 4 tokens
(TMA from 16), full, sliding and chunked layers, KV splits (partial outputs and LSE for ``combine_splits_kernel``).
FP8 compute stays on the Triton kernel."""

from __future__ import annotations

import ctypes
import importlib.util
from collections import OrderedDict
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("hopper_attention.cu")
THREADS = 384  # a producer warpgroup and two consumers
ROWS = 128  # query rows per CTA: 64 per consumer
BLOCK_N = 128  # keys per tile
HEAD_DIM = 128
MAX_TENSOR_MAPS = 256  # a model's layers, a few times over
STAGES = 3  # key tiles in flight (K and V: 64 KB each; 3 fill the 227 KB a CTA may have)

_POINTERS = ("q", "out", "part", "lse", "cache", "table", "tile_seq", "tile_q0", "q_loc", "q_len", "ctx_len")
_STRIDES = ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_table", "stride_block", "stride_tok",
            "v_offset", "stride_ps", "stride_pt", "stride_ph", "stride_ls", "stride_lt")
_INTS = ("kind", "reach", "block_size", "group", "tokens", "num_splits", "seg_lo", "seg_hi", "segmented", "accumulate",
         "tma", "rows_per_block")


class _Params(ctypes.Structure):
    """Mirror of ``struct Params`` in the .cu file, field for field."""

    _fields_ = ([(n, ctypes.c_void_p) for n in _POINTERS] + [(n, ctypes.c_longlong) for n in _STRIDES]
                + [("qk_scale", ctypes.c_float), ("v_scale", ctypes.c_float)] + [(n, ctypes.c_int) for n in _INTS])


def shared_bytes(stages: int = STAGES) -> int:
    """Dynamic shared memory of one CTA: two 16 KB query tiles, ``stages`` x (K + V) of 32 KB each, barriers and
    1 KB to align the swizzled tiles."""
    return 2 * 16384 + stages * 65536 + 16 * stages + 1024


def unavailable(device: torch.device) -> str | None:
    """Why the kernel cannot run on ``device`` (None: it can)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "not a CUDA device"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return f"{torch.cuda.get_device_name(device)} is not Hopper (sm_90)"
    if importlib.util.find_spec("cuda.bindings") is None:
        return "cuda-bindings is not installed (pip install 'hybridkv[gpu]')"
    return None


def _check(result, what: str):
    """cuda-bindings calls return (error, values...): raise on an error, return the values."""
    err, *values = result
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err!r}")
    return values[0] if len(values) == 1 else values


def compile_cubin(stages: int = STAGES, source: str | None = None, defines: dict[str, int] | None = None) -> bytes:
    """NVRTC: the .cu source (or ``source``, a variant of it) to sm_90a machine code (wgmma and setmaxnreg need the
    'a' target). ``defines`` set the source's compile-time switches (OVERLAP, PINGPONG: benchmarks time them)."""
    from cuda.bindings import nvrtc

    text = SOURCE.read_bytes() if source is None else source.encode()
    prog = _check(nvrtc.nvrtcCreateProgram(text, b"hopper_attention.cu", 0, [], []),
                  "nvrtcCreateProgram")
    opts = [b"--gpu-architecture=sm_90a", b"-std=c++17", f"-DSTAGES={stages}".encode()]
    opts += [f"-D{k}={v}".encode() for k, v in (defines or {}).items()]
    err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if int(err) != 0:
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(f"NVRTC could not compile {SOURCE.name}:\n{log.decode(errors='replace')}")
    size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
    cubin = b" " * size
    _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    nvrtc.nvrtcDestroyProgram(prog)
    return cubin


class HopperPrefill:
    """The compiled kernel, loaded into ``device``'s primary context."""

    def __init__(self, device: torch.device, stages: int = STAGES, source: str | None = None,
                 defines: dict[str, int] | None = None) -> None:
        from cuda.bindings import driver

        self.driver = driver
        self.device = device
        self.stages = stages
        self.smem = shared_bytes(stages)
        self._image = ctypes.create_string_buffer(compile_cubin(stages, source, defines))
        with torch.cuda.device(device):  # the module belongs to the device's primary context: make it current
            torch.empty(1, device=device)
            self._ensure_context()
            self.module = _check(driver.cuModuleLoadData(ctypes.addressof(self._image)), "cuModuleLoadData")
            self.function = _check(driver.cuModuleGetFunction(self.module, b"paged_prefill_hopper"),
                                   "cuModuleGetFunction")
        self._maps: OrderedDict[tuple[int, int, int, int], object] = OrderedDict()  # per cache base: TMA map
        self._no_map = driver.CUtensorMap()
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check(driver.cuFuncSetAttribute(self.function, attr, self.smem), "cuFuncSetAttribute")

    def _ensure_context(self) -> None:
        """A thread that has not touched CUDA through torch has no current context: give it the primary one."""
        ctx = _check(self.driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if int(ctx) == 0:
            dev = _check(self.driver.cuDeviceGet(self.device.index or 0), "cuDeviceGet")
            ctx = _check(self.driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            _check(self.driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def tensor_map(self, cache: torch.Tensor, row_elems: int, box_rows: int):
        """The TMA tensor map of a layer's token rows (``[rows, row_elems]`` bf16 from ``cache``'s first element;
        boxes of 64 columns x ``box_rows`` rows, 128-byte swizzle: the kernel's shared-memory layout), cached by
        base address."""
        key = (cache.data_ptr(), cache.numel(), row_elems, box_rows)
        if key in self._maps:
            self._maps.move_to_end(key)
        else:
            if len(self._maps) >= MAX_TENSOR_MAPS:
                self._maps.popitem(last=False)
            d = self.driver
            self._maps[key] = _check(d.cuTensorMapEncodeTiled(
                d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, cache.data_ptr(),
                [d.cuuint64_t(row_elems), d.cuuint64_t(cache.numel() // row_elems)],
                [d.cuuint64_t(row_elems * cache.element_size())],
                [d.cuuint32_t(64), d.cuuint32_t(box_rows)], [d.cuuint32_t(1), d.cuuint32_t(1)],
                d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
                d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")
        return self._maps[key]

    def launch(self, grid: tuple[int, int, int], tensors: dict[str, torch.Tensor | None], strides: dict[str, int],
               qk_scale: float, v_scale: float, ints: dict[str, int]) -> None:
        """One launch on torch's current stream. ``tensors`` holds every pointer of ``Params`` (None: unused),
        ``strides`` its strides in elements, ``ints`` its integer fields but ``tma`` and ``rows_per_block``.

        Tiles inside the reach arrive by TMA where the cache allows it: pages of 16+ tokens (a tile's boxes, 4 per
        page up to 128 rows, one per lane of a warp) and whole token rows per page; else every tile is gathered."""
        cache, bs, row_elems = tensors["cache"], ints["block_size"], strides["stride_tok"]
        tma = (bs >= 16 and strides["stride_block"] % row_elems == 0 and (row_elems * 2) % 16 == 0
               and cache.numel() // row_elems < 2**31)
        ints = dict(ints, tma=int(tma), rows_per_block=strides["stride_block"] // row_elems)
        tmap = self.tensor_map(cache, row_elems, min(bs, BLOCK_N)) if tma else self._no_map
        params = _Params(
            *[0 if tensors[n] is None else tensors[n].data_ptr() for n in _POINTERS],
            *[strides[n] for n in _STRIDES], qk_scale, v_scale, *[ints[n] for n in _INTS],
        )
        argv = (ctypes.c_void_p * 2)(ctypes.addressof(params), tmap.getPtr())
        stream = self.driver.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        self._ensure_context()
        _check(self.driver.cuLaunchKernel(self.function, *grid, THREADS, 1, 1, self.smem, stream,
                                          ctypes.addressof(argv), 0), "cuLaunchKernel")
