"""The two kernels an attention launch goes to, with one call, ``launch(q, out, call, kv, keys)``: Triton's
``paged_attention_kernel`` (``TritonLaunch``, every device) and the Hopper CUDA kernel of ``hopper_attention.cu``
(``HopperLaunch``). Which one a layer group's launches go to is decided with the step's metadata
(``TritonMetadataBuilder``), not here.
"""

from __future__ import annotations

import torch

from hybridkv.kernels import cuda_build, hopper_attention  # torch only: their CUDA imports wait for a Hopper GPU
from hybridkv.kv.specs import AttentionSpec
from hybridkv.model.attention.kernel_configs import KernelConfig
from hybridkv.model.attention.triton_step import KeyRange, KVSource, LayerCall


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class TritonLaunch:
    """``paged_attention_kernel`` over the step's query tiles in the group's tiles (``GroupMeta.config``): K/V by
    TMA where the tiles ask for it and the pages allow it, else gathered; an FP8 cache widened in the kernel, or
    with FP8 compute V read from the segment's V^T copy."""

    def __init__(self, kernels, block_size: int, pdl: bool, device: torch.device) -> None:
        """``kernels``: ``hybridkv.kernels.paged_attention``. ``pdl``: decode launches programmatically dependent."""
        self.kernels = kernels
        self.block_size = block_size
        self.pdl = pdl
        self.v_columns = torch.arange(block_size, dtype=torch.int64, device=device)  # FP8 compute's V^T: in order

    def __call__(self, q: torch.Tensor, out: torch.Tensor, call: LayerCall, kv: KVSource, keys: KeyRange) -> None:
        spec, step, config, splits = call.spec, call.step, call.meta.config, call.meta.num_splits
        part, lse, cache, table, vt = call.part, call.lse, kv.cache, kv.table, kv.vt
        stride_tok = spec.num_kv_heads * spec.head_dim
        stride_block = kv.stride_block
        part_strides = (0,) * 5 if part is None else (*part.stride()[:3], *lse.stride()[:2])
        kv_desc = self.descriptor(config, cache, spec, stride_tok, stride_block)
        vt_desc = None
        if vt is not None and kv_desc is not None:
            vt_desc = self.vt_descriptor(config, vt, spec)
            kv_desc = kv_desc if vt_desc is not None else None  # both by TMA, or both gathered
        decode_pdl = self.pdl and config.decode  # prefill's launches are long: nothing to gain
        self.kernels.paged_attention_kernel[(step.num_tiles, spec.num_kv_heads, splits)](
            q, out, out if part is None else part, out if lse is None else lse, cache,
            cache if kv_desc is None else kv_desc, table,
            cache if vt is None else vt, cache if vt_desc is None else vt_desc,
            table if kv.vt_table is None else kv.vt_table,
            *step.seq,
            call.scale, call.k_scale, call.v_scale, keys.lo, keys.hi, stride_block // stride_tok,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), table.stride(0),
            stride_block, stride_tok, self.block_size * stride_tok,
            *part_strides, 0 if vt is None else vt.stride(0),
            KIND=spec.kernel_kind, REACH=max(spec.reach, 1), BLOCK_SIZE=self.block_size,
            GROUP=q.shape[1] // spec.num_kv_heads, ROWS=config.rows, TOKENS=step.tokens, D=spec.head_dim,
            D_PAD=max(16, next_pow2(spec.head_dim)), BLOCK_N=config.block_n, NUM_SPLITS=splits, QUANT=kv.quant,
            FP16_DOT=kv.quant and q.dtype == torch.bfloat16 and config.decode,
            SEGMENTED=keys.segmented, ACCUMULATE=keys.accumulate,
            TMA=kv_desc is not None, FP8_DOT=vt is not None,
            # float32 models stay exact (token parity with the CPU path); TF32 would round to 10 mantissa bits
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            PDL=decode_pdl, num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=decode_pdl,
        )

    def descriptor(self, cfg: KernelConfig, cache: torch.Tensor, spec: AttentionSpec, stride_tok: int,
                   stride_block: int):
        """The TMA descriptor of a layer's (or a segment scratch's) token rows, or None (pointer gathers): TMA where
        the config asks for it, a page holds whole key tiles, the head dim is one TMA box (64 or 128), pages are
        whole rows and every row index fits in int32."""
        rows = cache.numel() // stride_tok
        if not (cfg.tma and self.block_size % cfg.block_n == 0 and spec.head_dim in (64, 128) and rows < 2**31
                and stride_block % stride_tok == 0 and cache.data_ptr() % 16 == 0):
            return None
        from triton.tools.tensor_descriptor import TensorDescriptor

        return TensorDescriptor(cache, [rows, stride_tok], [stride_tok, 1], [cfg.block_n, spec.head_dim])

    @staticmethod
    def vt_descriptor(cfg: KernelConfig, vt: torch.Tensor, spec: AttentionSpec):
        """TMA descriptor of a segment's transposed V (``[heads * head_dim, columns]``, e4m3), boxes of head_dim x
        key tile; None where a row's bytes are not a multiple of 16 (TMA's stride unit)."""
        if vt.stride(0) % 16 or vt.data_ptr() % 16:
            return None
        from triton.tools.tensor_descriptor import TensorDescriptor

        return TensorDescriptor(vt, list(vt.shape), [vt.stride(0), 1], [spec.head_dim, cfg.block_n])


def rows_aligned(q: torch.Tensor, out: torch.Tensor, cache: torch.Tensor) -> bool:
    """bf16 query and output head rows, and the cache, on 16-byte boundaries (the CUDA kernel's loads and
    stores)."""
    return (q.dtype == torch.bfloat16 and all(t.data_ptr() % 16 == 0 for t in (q, out, cache))
            and q.stride(2) == 1 and out.stride(2) == 1
            and all(s % 8 == 0 for s in (q.stride(0), q.stride(1), out.stride(0), out.stride(1))))


class HopperLaunch:
    """The CUDA kernel over the step's own tiles (``TritonStepState.tiles``): bf16 dots over a bf16 cache or a
    widened segment, or FP8 dots (``kv.vt``) over an FP8 cache's pages and the segment's V^T in ``v_columns``
    order. ``kernel``: ``hopper_attention.HopperPrefill``, which counts its launches."""

    def __init__(self, kernel, block_size: int, group: int, device: torch.device) -> None:
        """``group``: the G the step's tiles were cut by."""
        self.kernel = kernel
        self.block_size = block_size
        self.group = group
        bs = block_size
        # FP8 compute: the V^T copy gathers each page's columns in the kernel's order (pages of 64+ tokens)
        self.v_columns = None
        if bs >= 64 and bs & (bs - 1) == 0:
            self.v_columns = torch.tensor(hopper_attention.page_columns(bs), dtype=torch.int64, device=device)

    def __call__(self, q: torch.Tensor, out: torch.Tensor, call: LayerCall, kv: KVSource, keys: KeyRange) -> None:
        spec, step, splits, part, lse = call.spec, call.step, call.meta.num_splits, call.part, call.lse
        table, vt, vt_table = kv.table, kv.vt, kv.vt_table
        if not rows_aligned(q, out, kv.cache):
            raise ValueError(f"the CUDA prefill kernel takes bf16 query and output rows on 16-byte boundaries, got "
                             f"{q.dtype} queries of strides {q.stride()}: the backend's dtype must be the queries'")
        if vt_table is not None:
            assert vt_table.stride(0) == table.stride(0), "the kernel reads both tables with one stride"
        stride_tok = spec.num_kv_heads * spec.head_dim
        tensors = dict(q=q, out=out, part=part, lse=lse, cache=kv.cache, table=table, vt=vt, vt_table=vt_table,
                       tiles=step.tiles)
        ps = (0,) * 3 if part is None else part.stride()[:3]
        ls = (0,) * 2 if lse is None else lse.stride()[:2]
        strides = dict(stride_qt=q.stride(0), stride_qh=q.stride(1), stride_ot=out.stride(0), stride_oh=out.stride(1),
                       stride_table=table.stride(0), stride_block=kv.stride_block, stride_tok=stride_tok,
                       v_offset=self.block_size * stride_tok, stride_ps=ps[0], stride_pt=ps[1], stride_ph=ps[2],
                       stride_ls=ls[0], stride_lt=ls[1], stride_vt=0 if vt is None else vt.stride(0))
        ints = dict(kind=spec.kernel_kind, reach=max(spec.reach, 1), block_size=self.block_size,
                    group=self.group, num_splits=splits, seg_lo=keys.lo, seg_hi=keys.hi,
                    segmented=int(keys.segmented), accumulate=int(keys.accumulate))
        self.kernel.launch((len(step.tiles), spec.num_kv_heads, splits), tensors, strides,
                           call.scale * call.k_scale * 1.4426950408889634, call.v_scale, ints)


def load_hopper_kernel(device: torch.device):
    """The CUDA prefill kernel (``hopper_attention.HopperPrefill``), or None (with a warning naming why) where it
    cannot be built here. Called from the backend's constructor: the warning points at its caller."""
    import warnings

    reason = cuda_build.hopper_unavailable(device)
    if reason is None:
        try:
            return hopper_attention.HopperPrefill(device)
        except (RuntimeError, OSError) as e:
            reason = str(e)
    warnings.warn(f"Hopper prefill kernel unavailable, using the Triton kernel: {reason}", stacklevel=3)
    return None
