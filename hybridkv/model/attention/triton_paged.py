"""Paged hybrid attention on NVIDIA GPUs through the Triton kernels in ``hybridkv/kernels`` (on Hopper, with a bf16
cache and head dim 128, prefill steps run the CUDA kernel ``hopper_attention.cu`` over the same tiles instead).

Same contract as ``TorchPagedAttention`` (its oracle). The backend is four pieces, as vLLM's backends split the
metadata builder from the implementation:
- ``kernel_configs.choose_kernel_configs``: the tiles, chosen once from the layout and the device;
- ``triton_metadata.TritonMetadataBuilder``: each step's metadata, once for every layer (eager, or in the fixed
  buffers a CUDA graph replays), with the FP8 segments (``fp8_segments``) and the kernel each layer group's
  launches go to;
- ``triton_launch``: one launch call, into Triton's kernel or the Hopper CUDA kernel;
- this class: the KV writes, each layer's launches and the merge of split or segmented partial outputs.

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

from dataclasses import replace

import numpy as np
import torch

from hybridkv.kernels.kv_slots import KVSlots
from hybridkv.kv.layout import KVLayout
from hybridkv.model.attention.base import BackendCapabilities, StepSequence, StoresKVFromKernels
from hybridkv.model.attention.fp8_segments import SEGMENT_BYTES, SegmentPlanner
from hybridkv.model.attention.kernel_configs import KernelDevice, KernelOptions, Operands, choose_kernel_configs
from hybridkv.model.attention.kv_cache import LayerCache, PagedKVCache
from hybridkv.model.attention.triton_launch import HopperLaunch, TritonLaunch, load_hopper_kernel, next_pow2
from hybridkv.model.attention.triton_metadata import TritonMetadataBuilder
from hybridkv.model.attention.triton_step import ALL_KEYS, GroupMeta, KeyRange, KVSource, Launches, LayerCall


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
                 num_sms: int | None = None, dtype: torch.dtype | None = None,
                 options: KernelOptions = KernelOptions()) -> None:
        """``dtype``: the queries' (the model's; None: the cache's, bf16 over an FP8 cache), which decides what the
        CUDA kernel takes. ``num_sms``: how many programs fill the GPU (None: the device's SMs)."""
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
        self.pdl = pdl(self.cache.buffer)  # the decode path's kernels launch programmatically dependent
        kernel_device = KernelDevice.of(self.device, num_sms)
        operands = Operands.of(num_q_heads, kv_dtype, dtype)
        configs = choose_kernel_configs(layout, kernel_device, operands, options)
        self.hopper: HopperLaunch | None = None  # the CUDA kernel's launches (None: not built here)
        if configs.prefill.cuda:
            kernel = load_hopper_kernel(self.device)
            if kernel is None:
                configs = choose_kernel_configs(layout, replace(kernel_device, cuda_kernel=False), operands, options)
            else:
                self.hopper = HopperLaunch(kernel, self.block_size, configs.group, self.device)
        self.triton = TritonLaunch(kernels, self.block_size, self.pdl, self.device)
        self.fp8_compute = configs.fp8_compute
        # graphs need CUDA (a CPU device only happens under Triton's interpreter)
        self.capabilities = replace(self.declare(kv_dtype, options.segment_bytes),
                                    cuda_graphs=self.device.type == "cuda")
        segments = SegmentPlanner(self.block_size, options.segment_bytes, self.fp8_compute) if self.quantized else None
        self.builder = TritonMetadataBuilder(layout, configs, kernel_device, Launches(self.triton, self.hopper),
                                             segments, options.max_splits, self.device)
        self.step_state = None

    # ---- per step ----------------------------------------------------------------------------------
    def begin_step(self, seqs: list[StepSequence]) -> None:
        self.step_state = self.builder.build_step(seqs)

    # ---- decode steps replayed from CUDA graphs --------------------------------------------------------
    def enable_static_decode(self, max_seqs: int, max_model_len: int) -> None:
        """Fixed metadata buffers for decode steps, so a captured step reads each step's values in place."""
        self.builder.enable_static_decode(max_seqs, max_model_len)

    def static_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids, positions) [max_seqs] int32 of the static decode step, on the device: a captured forward
        reads them there, and ``begin_static_decode`` fills them in its one copy (a decode token's position is
        its sequence's context length)."""
        st = self.builder.static
        return st.token_ids, st.seq[4]

    def begin_static_decode(self, seqs: list[StepSequence], padded: int, token_ids: np.ndarray | None = None,
                            many: bool = False) -> None:
        """Decode metadata (one new token per sequence) written into the static buffers, padded to ``padded``
        rows, with the sequences' new ``token_ids`` (``static_inputs``); a padding row computes nothing and its
        token's K/V go to the null block, which is never read. ``many``: the step state of a step that
        ``many_keys`` (its long groups' tiles are 128 keys)."""
        self.step_state = self.builder.build_static_decode(seqs, padded, token_ids, many)

    def many_keys(self, seqs: list[StepSequence]) -> bool:
        """A decode step some layer group of which reads 128-key tiles only because its reach is long: its
        graph is the ``many`` one of its batch size (``begin_static_decode``)."""
        return self.builder.many_keys(seqs)

    def static_variants(self, padded: int) -> list[bool]:
        """The ``many`` values a decode graph of ``padded`` rows is captured for (``many_keys``)."""
        return self.builder.static_variants(padded)

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
        hd_pad = next_pow2(heads * dim)
        tokens = max(1, 4096 // hd_pad)
        self.kernels.kv_write_kernel[(-(-k.shape[0] // tokens),)](
            k, v, self._base(layer), meta.slot_block, meta.slot_offset, k_scale, v_scale, k.shape[0],
            self.cache.buffer.stride(0), self.block_size * heads * dim,
            HD=heads * dim, HD_PAD=hd_pad, TOKENS=tokens, QUANT=self.quantized, PDL=self.pdl, launch_pdl=self.pdl,
        )
        return layer, k_scale, v_scale

    def _base(self, layer) -> torch.Tensor:
        return self.cache.buffer.view(-1)[layer.elem_offset :]

    def _attention(self, q: torch.Tensor, layer: LayerCache, meta: GroupMeta, scale: float, k_scale: float,
                   v_scale: float) -> torch.Tensor:
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
        call = LayerCall(spec, scale, k_scale, v_scale, self.step_state, meta, part, lse)
        launch, stride_block = meta.launch, self.cache.buffer.stride(0)
        if self.fp8_compute and meta.segments:
            # FP8 dots: K straight from the pages, V from a transposed e4m3 copy of each segment (one pass over
            # the segment's V, as the widening below is one over K and V), its columns in the kernel's order
            fp8 = layer.view.view(torch.uint8)
            heads, dim = spec.num_kv_heads, spec.head_dim
            for i, seg in enumerate(meta.segments):
                vt = self._v_transposed(fp8, seg.blocks, launch.v_columns, heads * dim)
                kv = KVSource(self._base(layer), meta.table, stride_block, True, vt, meta.scratch_table)
                launch(q, out, call, kv, KeyRange(seg.lo, seg.hi, segmented, i > 0))
        elif not segmented:
            launch(q, out, call, KVSource(self._base(layer), meta.table, stride_block, self.quantized), ALL_KEYS)
        else:
            # FP8 cache, long prefill: widen each segment of the reach into a bf16 scratch (exact), then run the
            # unquantized kernel over it: the widening costs one pass over the keys instead of one per query tile
            fp8 = layer.view.view(torch.uint8)
            for i, seg in enumerate(meta.segments):
                scratch = fp8[seg.blocks].view(torch.float8_e4m3fn).to(q.dtype)  # [n, 2, block, heads, dim]
                kv = KVSource(scratch, meta.scratch_table, scratch.stride(0), False)
                launch(q, out, call, kv, KeyRange(seg.lo, seg.hi, True, i > 0))
        if part is not None:
            self._combine(part, lse, out, splits)
        return out

    def _combine(self, part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, splits: int) -> None:
        """Merge the split (or segmented) partial outputs into ``out``."""
        # few rows (decode): slice the head dim over more programs; many (prefill): one program per row
        head_dim = out.shape[2]
        d_pad = max(16, next_pow2(head_dim))
        d_slice = d_pad if out.shape[0] * out.shape[1] >= 64 * self.builder.device.num_sms else min(32, d_pad)
        grid = (out.shape[0], out.shape[1], -(-head_dim // d_slice))
        self.kernels.combine_splits_kernel[grid](
            part, lse, out, part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1), NUM_SPLITS=splits, CHUNK=min(splits, 128), D=head_dim,
            D_SLICE=d_slice, PDL=self.pdl, launch_pdl=self.pdl,
        )

    def _v_transposed(self, fp8: torch.Tensor, blocks: torch.Tensor, columns: torch.Tensor, hd: int) -> torch.Tensor:
        """V^T [heads * dim, pages * block] (e4m3) of the pages ``blocks`` of one layer's cache (``fp8``, bytes),
        each page's keys in ``columns`` order."""
        n_cols = blocks.shape[0] * self.block_size
        vt = torch.empty((hd, n_cols), dtype=torch.uint8, device=fp8.device)
        cols = 128
        self.kernels.v_transpose_kernel[(-(-n_cols // cols),)](
            fp8, blocks, columns, vt, n_cols, fp8.stride(0), fp8.stride(1),
            HD=hd, HD_PAD=next_pow2(hd), BLOCK_SIZE=self.block_size, COLS=cols,
        )
        return vt.view(torch.float8_e4m3fn)
