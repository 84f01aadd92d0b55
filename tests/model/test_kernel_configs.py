"""Which tiles the Triton backend runs on which device (``choose_kernel_configs``), and which launches of a prefill
step the Hopper CUDA kernel takes: pure, so checked here for devices this machine does not have."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hybridkv.kv import plan_layout
from hybridkv.kv.specs import ChunkedLocalSpec, FullAttentionSpec, SlidingWindowSpec
from hybridkv.model.attention.kernel_configs import (
    DECODE, DECODE_FEW, HOPPER_CUDA_PREFILL, HOPPER_PREFILL, PREFILL, WIDE_HEAD_DECODE, WIDE_HEAD_PREFILL,
    KernelConfig, KernelDevice, KernelOptions, Operands, choose_kernel_configs,
)

H200 = KernelDevice((9, 0), 132, "NVIDIA H200")
A100 = KernelDevice((8, 0), 108, "NVIDIA A100-SXM4-80GB")
L40S = KernelDevice((8, 9), 142, "NVIDIA L40S")
GATHERED_128 = replace(HOPPER_PREFILL, tma=False)  # Triton's 128-row tiles without TMA


def scout_rank(kv_dtype: str, block_size: int = 64):
    """A Scout rank's layout over 8 GPUs: full and chunked layers of one KV head of 128 values."""
    return plan_layout([FullAttentionSpec(1, 128, kv_dtype), ChunkedLocalSpec(1, 128, kv_dtype, chunk=8192)],
                       block_size)


def choose(layout, device, kv_dtype: str, dtype=None, num_q_heads: int = 5, **options):
    return choose_kernel_configs(layout, device, Operands.of(num_q_heads, kv_dtype, dtype), KernelOptions(**options))


def test_hopper_with_a_bf16_cache_runs_the_cuda_kernel_over_pages():
    c = choose(scout_rank("bfloat16"), H200, "bfloat16")
    assert c.group == 5
    assert c.prefill == HOPPER_CUDA_PREFILL and c.prefill.cuda and not c.prefill.decode
    assert c.triton_prefill == HOPPER_PREFILL  # 64-token pages: Triton's tiles by TMA where the CUDA kernel is not
    assert (c.decode, c.decode_few) == (DECODE, DECODE_FEW) and c.decode.decode and c.decode_few.decode
    assert (c.cuda_pages, c.cuda_segments, c.cuda_fp8, c.fp8_compute) == (True, False, False, False)
    assert c.cuda_takes(segments=False)
    # fp32 queries (a float32 model over a bf16 cache): the CUDA kernel's tiles, every launch Triton's
    f32 = choose(scout_rank("bfloat16"), H200, "bfloat16", torch.float32)
    assert f32.prefill == HOPPER_CUDA_PREFILL and not f32.cuda_takes(segments=False)


def test_hopper_with_an_fp8_cache_takes_widened_segments_and_fp8_compute_on_big_pages():
    c = choose(scout_rank("fp8_e4m3"), H200, "fp8_e4m3")
    assert c.prefill == HOPPER_CUDA_PREFILL and (c.cuda_pages, c.cuda_segments, c.cuda_fp8) == (False, True, False)
    assert c.cuda_takes(segments=True) and not c.cuda_takes(segments=False)  # e4m3 read in the kernel: Triton
    fp8 = choose(scout_rank("fp8_e4m3"), H200, "fp8_e4m3", fp8_compute=True)
    assert fp8.fp8_compute and fp8.cuda_fp8 and fp8.cuda_takes(segments=True)
    # 16-token pages: the CUDA kernel's tiles (it gathers bf16), FP8 compute in Triton's gathered 128-row tiles
    small = choose(scout_rank("fp8_e4m3", 16), H200, "fp8_e4m3", fp8_compute=True)
    assert small.prefill == HOPPER_CUDA_PREFILL and small.triton_prefill == GATHERED_128
    assert small.fp8_compute and not small.cuda_fp8 and not small.cuda_takes(segments=True)
    # a bf16 cache ignores fp8_compute
    assert not choose(scout_rank("bfloat16"), H200, "bfloat16", fp8_compute=True).fp8_compute


def test_other_devices_and_the_kernel_turned_off_run_triton_alone():
    for device, options in ((A100, {}), (L40S, {}), (H200, {"hopper_kernel": False}),
                            (replace(H200, cuda_kernel=False), {})):
        c = choose(scout_rank("bfloat16"), device, "bfloat16", **options)
        tma = device.hopper  # Hopper keeps its TMA tiles without the CUDA kernel
        assert c.prefill == (HOPPER_PREFILL if tma else PREFILL), device
        assert c.triton_prefill == (HOPPER_PREFILL if tma else GATHERED_128)
        assert not (c.prefill.cuda or c.cuda_pages or c.cuda_segments or c.cuda_fp8)
        assert (c.decode, c.decode_few) == (DECODE, DECODE_FEW)
    assert choose(scout_rank("fp8_e4m3"), L40S, "fp8_e4m3", fp8_compute=True).fp8_compute  # 8.9: FP8 tensor cores
    with pytest.raises(ValueError, match=r"compute capability 8.9\+\); NVIDIA A100-SXM4-80GB has none"):
        choose(scout_rank("fp8_e4m3"), A100, "fp8_e4m3", fp8_compute=True)


def test_layouts_the_cuda_kernel_does_not_cover():
    # head dim 64 (TMA tiles, no CUDA kernel: it is built for 128)
    narrow = plan_layout([FullAttentionSpec(2, 64, "bfloat16")], 64)
    c = choose(narrow, H200, "bfloat16", num_q_heads=8)
    assert c.prefill == HOPPER_PREFILL and c.group == 4
    # groups of different G (query heads per KV head): the CUDA kernel cuts a step's rows by one G
    mixed = plan_layout([FullAttentionSpec(1, 128, "bfloat16"), SlidingWindowSpec(2, 128, "bfloat16", window=64)], 64)
    assert choose(mixed, H200, "bfloat16", num_q_heads=4).prefill == HOPPER_PREFILL
    # head dim 256 (Gemma-3): small tiles everywhere, one decode config for every step
    wide = plan_layout([FullAttentionSpec(1, 256, "bfloat16"), SlidingWindowSpec(1, 256, "bfloat16", window=512)], 16)
    for device in (H200, A100):
        c = choose(wide, device, "bfloat16", num_q_heads=8)
        assert (c.prefill, c.decode, c.decode_few) == (WIDE_HEAD_PREFILL, WIDE_HEAD_DECODE, None)
        assert not c.may_read_few(1) and c.decode_tiles(1, 0) == WIDE_HEAD_DECODE
    with pytest.raises(ValueError, match="32 query heads per KV head: more than one tile's 16 rows"):
        choose(scout_rank("bfloat16"), H200, "bfloat16", num_q_heads=32)


def test_given_tiles_are_kept_and_marked_for_what_they_serve():
    tiles = KernelConfig(rows=64, block_n=16, num_warps=4, num_stages=2)
    c = choose(scout_rank("bfloat16"), H200, "bfloat16", prefill=PREFILL, decode=tiles)
    # given prefill tiles are kept (even the default's): no CUDA kernel, no TMA upgrade
    assert c.prefill == PREFILL and not c.cuda_pages and c.triton_prefill == GATHERED_128
    # decode tiles given alone serve every decode step, marked as decode tiles
    assert c.decode == replace(tiles, decode=True) and c.decode_few is None
    assert c.decode_tiles(1, 0) == c.decode and not c.may_read_few(1)


def test_decode_tiles_follow_the_batch_and_its_keys():
    c = choose(scout_rank("bfloat16"), H200, "bfloat16")
    assert c.decode_tiles(1, 1 << 20) == DECODE_FEW and c.decode_tiles(2, 0) == DECODE_FEW
    assert c.decode_tiles(1, (1 << 20) + 1) == DECODE and c.decode_tiles(3, 0) == DECODE
    layout = scout_rank("bfloat16")
    # the full layer reaches past 2^20 keys at 1M context; the chunked one never does
    assert not c.reads_many_keys(layout, [1 << 19]) and c.reads_many_keys(layout, [(1 << 20) + 1])


def test_a_device_is_read_once():
    cpu = KernelDevice.of(torch.device("cpu"))
    assert (cpu.capability, cpu.num_sms, cpu.hopper) == (None, 8, False)
    assert KernelDevice.of(torch.device("cpu"), num_sms=4).num_sms == 4
    assert Operands.of(5, "fp8_e4m3").dtype == torch.bfloat16 and Operands.of(5, "float16").dtype == torch.float16
