"""The position-encoding kernel (``kernels/rope.py``) on prefill steps, one token a program against the tiles, against
the bytes it must move over the device's copy bandwidth measured in the same run.

A step's q, k and v come as views of one fused QKV output (as the model hands them over); the kernel rotates q and
k, normalises them (Llama-4's QK-norm) and stores k and v into a paged bf16 cache, its pages shuffled. Bytes: q, k
and v read once, q written, k and v written into the cache, cos/sin read. Both variants are checked against each
other before they are timed (bitwise for v; QK-norm's row sum may move q and k by a bf16 step).

    python benchmarks/gpu/rope.py [--tokens 4096,16384] [--heads 5:1,10:2] [--sweep]

``--heads q:kv`` per row: 5:1 is one Scout TP-8 rank, 10:2 a GPU of Scout at TP 4.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.gpu.attention import copy_bandwidth  # noqa: E402
from hybridkv.bench.tables import markdown_table  # noqa: E402
from hybridkv.kernels.kv_slots import KVSlots  # noqa: E402
from hybridkv.kernels.rope import PREFILL_TILE, rope_qk  # noqa: E402
from hybridkv.model.architectures.llama_config import RopeConfig  # noqa: E402
from hybridkv.model.architectures.position_encoding import rope_cos_sin, rope_inv_freq  # noqa: E402

D, PAGE = 128, 64


def step(tokens: int, q_heads: int, kv_heads: int):
    """(q, k, v views of one QKV output, cos, sin, the cache, its slots) of one prefill step on the GPU."""
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * D, device="cuda").to(torch.bfloat16)
    q, k, v = (t.unflatten(-1, (-1, D)) for t in qkv.split([q_heads * D, kv_heads * D, kv_heads * D], dim=-1))
    positions = torch.arange(1 << 20, (1 << 20) + tokens, device="cuda")
    cos, sin = rope_cos_sin(rope_inv_freq(RopeConfig(theta=500000.0), D).cuda(), positions)
    pages = -(-tokens // PAGE)
    cache = torch.zeros(pages, 2, PAGE, kv_heads, D, device="cuda", dtype=torch.bfloat16)
    order = torch.randperm(pages * PAGE, device="cuda")[:tokens]
    slots = KVSlots(cache.view(-1), (order // PAGE).int(), (order % PAGE).int(), cache.stride(0),
                    PAGE * kv_heads * D, 1.0, 1.0, False)
    return q, k, v, cos, sin, cache, slots


MODES = {  # name: (rotate, qk_norm, store); unrotated rows are a NoPE layer's: q times its temperature
    "RoPE + QK-norm, k/v stored": (True, True, True),
    "RoPE + QK-norm, k out": (True, True, False),
    "RoPE, k out": (True, False, False),
    "temperature, k/v stored": (False, False, True),
}


def timed_us(tokens: int, q_heads: int, kv_heads: int, tiles: list[tuple[int, int]],
             mode=(True, True, True)) -> list[float]:
    """The kernel's us at each (tokens, warps) tile, after checking every tile's output against one token a
    program's."""
    q, k, v, cos, sin, cache, slots = step(tokens, q_heads, kv_heads)
    rotate, qk_norm, store = mode
    temperature = None if rotate else torch.rand(tokens, 1, 1, device="cuda") + 1

    def run(tile):
        return rope_qk(q, k, cos, sin, rotate=rotate, interleaved=True, qk_norm=qk_norm, eps=1e-5,
                       temperature=temperature, v=v if store else None, slots=slots if store else None, tile=tile)

    q_one, k_one = run((1, 1))
    cache_one = cache.clone()
    for tile in tiles:
        q_t, k_t = run(tile)
        torch.testing.assert_close(q_t, q_one, rtol=1e-2, atol=0)
        if store:
            torch.testing.assert_close(cache, cache_one, rtol=1e-2, atol=0)
            assert torch.equal(cache[:, 1], cache_one[:, 1]) and cache_one[:, 1].abs().sum() > 0  # v as given
        elif rotate:
            torch.testing.assert_close(k_t, k_one, rtol=1e-2, atol=0)
    # replayed from a CUDA graph: launched one by one, a call's host time (~25-60 us) would hide the kernel's
    return [1000 * triton.testing.do_bench_cudagraph(lambda t=t: run(t), rep=100) for t in tiles]


def row(tokens: int, q_heads: int, kv_heads: int, copy_gbs: float) -> list[str]:
    item = 2  # bf16
    moved = tokens * D * item * (2 * q_heads + 4 * kv_heads) + 2 * tokens * D // 2 * 4  # + cos and sin, float32
    floor_us = moved / copy_gbs / 1e3
    one, tiled = timed_us(tokens, q_heads, kv_heads, [(1, 1), PREFILL_TILE])
    return [f"{tokens:,}", f"{q_heads}:{kv_heads}", f"{moved / 1e6:.1f}", f"{floor_us:.1f}", f"{one:.1f}",
            f"{tiled:.1f}", f"{floor_us / tiled:.0%}", f"{one / tiled:.1f}x"]


def sweep(tokens: int, q_heads: int, kv_heads: int) -> None:
    tiles = [(t, w) for t in (1, 4, 16, 64) for w in (1, 2, 4, 8) if t * 32 >= w * 8]
    by_mode = {name: timed_us(tokens, q_heads, kv_heads, tiles, mode) for name, mode in MODES.items()}
    print(f"\n{tokens:,} tokens, heads {q_heads}:{kv_heads}, us by (tokens, warps) a program")
    print(markdown_table(["tile", *MODES], [[f"{t} x {w}", *(f"{by_mode[m][i]:.1f}" for m in MODES)]
                                            for i, (t, w) in enumerate(tiles)]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--heads", default="5:1,10:2")
    ap.add_argument("--sweep", action="store_true", help="also time tiles x warps on the first tokens and heads")
    args = ap.parse_args()
    copy_gbs = copy_bandwidth()
    rows = [row(int(n), *map(int, h.split(":")), copy_gbs)
            for h in args.heads.split(",") for n in args.tokens.split(",")]
    print(f"\n{torch.cuda.get_device_name()}, copy bandwidth {copy_gbs:.0f} GB/s (read + write), bf16, D {D}, "
          f"RoPE + QK-norm + k/v into a paged cache, one layer")
    print(markdown_table(["tokens", "heads q:kv", "MB moved", "floor us", "a token a program, us",
                          f"{PREFILL_TILE[0]} tokens x {PREFILL_TILE[1]} warps a program, us", "tiles: of floor",
                          "speed-up"], rows))
    if args.sweep:
        sweep(int(args.tokens.split(",")[-1]), *map(int, args.heads.split(",")[0].split(":")))


if __name__ == "__main__":
    main()
