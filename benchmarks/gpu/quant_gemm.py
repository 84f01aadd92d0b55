"""The quantized linears (``kernels/quant_gemm.py``) against their peers on Llama-4-Scout's TP-1 shapes.

Per (weight N x K, rows M), one weight quantized once (INT4, group 128, symmetric) and the same values handed to:

- ``int4``: ours (``int4_gemm``), its GB/s (packed weight, scales, x and y once) and that over the copy bandwidth
  measured in the same run (1 GiB device-to-device, bytes read plus written);
- ``tinygemm``: torch's ``_weight_int4pack_mm`` on ``_convert_weight_to_int4pack``'s layout of the same values;
- ``bf16``: cuBLAS ``F.linear`` on the dequantized bf16 weight;
- ``fp8``: ours (``fp8_linear``: the Triton per-token quantization + ``torch._scaled_mm``), the same product with
  the quantization in torch ops (``torch q + mm``), and ``_scaled_mm`` alone on pre-quantized activations.

Every result is checked against a float32 reference before anything is timed. Each time is the median of CUDA-graph
replays (``do_bench_cudagraph``: a decode-sized call's host time would hide the kernel), over enough copies of the
weight, called in turn, that they do not fit in L2 together (one weight replayed from L2 would flatter). Random
inputs, never zeros.

    python benchmarks/gpu/quant_gemm.py [--rows 1,8,16,64,256,2048] [--shapes qkv,o,8192] [--sweep]

``--sweep``: for the decode rows (<= 64) also times the INT4 tiles of ``sweep_tiles`` (the GEMV up to 8 rows, a
dot per nibble up to 16, the reshaped tile) and prints the best per row (for tuning ``quant_triton.int4_tile``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from hybridkv.bench.tables import markdown_table  # noqa: E402
from hybridkv.kernels.quant_gemm import (  # noqa: E402
    FP8_MAX, dequantize_int4, fp8_linear, int4_gemm, pack_int4, quantize_fp8_per_token_reference,
)
from hybridkv.kernels.quant_triton import DECODE_ROWS, Int4Tile, launch_int4_gemm  # noqa: E402

GROUP = 128
TOL = 1e-2  # relative error of the output's norm against the float32 reference (bf16 outputs land near 2e-3)
# --sweep's candidates: the GEMV (no dots) up to 8 rows, a dot per nibble up to 16, the reshaped tile to 64
GEMV_SWEEP = [Int4Tile(1, 64, 128, 8, 4, 1, False, gemv=True), Int4Tile(1, 64, 128, 4, 4, 1, False, gemv=True),
              Int4Tile(1, 128, 128, 4, 8, 1, False, gemv=True), Int4Tile(1, 32, 128, 8, 2, 1, False, gemv=True),
              Int4Tile(1, 64, 128, 4, 4, 3, False, gemv=True), Int4Tile(1, 64, 128, 8, 4, 1, True, gemv=True),
              Int4Tile(1, 128, 128, 4, 4, 1, False, gemv=True), Int4Tile(1, 128, 128, 8, 4, 1, False, gemv=True),
              Int4Tile(1, 256, 128, 4, 8, 1, False, gemv=True)]
NIBBLE_SWEEP = [Int4Tile(16, 128, 128, 2, 8, 3, False, True), Int4Tile(16, 64, 128, 4, 4, 4, False, True)]
RESHAPE_SWEEP = [Int4Tile(16, 64, 128, 4, 4, 4, False), Int4Tile(16, 128, 128, 2, 8, 3, False),
                 Int4Tile(16, 64, 64, 4, 4, 4, False), Int4Tile(16, 64, 128, 4, 4, 4, True),
                 Int4Tile(16, 128, 64, 2, 4, 4, False)]


def sweep_tiles(m: int) -> list[Int4Tile]:
    """The tiles --sweep times at ``m`` rows (the dot tiles' rows padded to a power of two, at least 16)."""
    tiles = [t for t in GEMV_SWEEP if m <= 8] + [t for t in NIBBLE_SWEEP if m <= 16] + RESHAPE_SWEEP
    return [t if t.gemv else replace(t, block_m=max(16, triton.next_power_of_2(m))) for t in tiles]


def tile_name(t: Int4Tile) -> str:
    """E.g. "N64 K128 x8/SM w4 s1 gemv"; "scaled w": the group scale multiplies the weights."""
    kind = "gemv" if t.gemv else "nibble dots" if t.nibble_dots else "reshape"
    return f"N{t.block_n} K{t.block_k} x{t.per_sm}/SM w{t.warps} s{t.stages} {kind}" + \
        (" scaled w" if t.scale_weights else "")


def scout_shapes() -> dict[str, tuple[int, int]]:
    """(N, K) of a Scout layer's linears at TP 1, from its config; and 8192 x 8192."""
    cfg = json.loads((ROOT / "tests/data/scout-text-config.json").read_text())
    hidden, d = cfg["hidden_size"], cfg["head_dim"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    return {"qkv": ((heads + 2 * kv) * d, hidden), "o": (hidden, heads * d),
            "mlp_gate_up": (2 * cfg["intermediate_size_mlp"], hidden),
            "mlp_down": (hidden, cfg["intermediate_size_mlp"]),
            "expert_gate_up": (2 * cfg["intermediate_size"], hidden), "expert_down": (hidden, cfg["intermediate_size"]),
            "8192": (8192, 8192)}


def copy_bandwidth() -> float:
    """Bytes read plus written per second by a 1 GiB device-to-device copy."""
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() * 4 / (ms / 1e3)


def graph_us(fn, copies: int) -> float:
    """Median microseconds of one ``fn(i)``, replaying a graph that calls it on copies 0..copies-1 in turn."""
    ms = triton.testing.do_bench_cudagraph(lambda: [fn(i) for i in range(copies)], rep=15, return_mode="median")
    return 1e3 * ms / copies


def copies_for(nbytes: int) -> int:
    """Enough copies of ``nbytes`` that together they are three times the L2."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(1, min(16, math.ceil(3 * l2 / nbytes)))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


class Weights:
    """One quantized weight in every peer's layout, ``copies`` of each (the int4 ones: several, to leave L2)."""

    def __init__(self, n: int, k: int):
        gen = torch.Generator(device="cuda").manual_seed(n + k)
        q = torch.randint(-8, 8, (n, k), dtype=torch.int8, device="cuda", generator=gen)
        scale = ((torch.rand(n, k // GROUP, device="cuda", generator=gen) + 0.5) / (4 * k**0.5)).to(torch.bfloat16)
        packed = pack_int4(q)
        self.int4_bytes = packed.numel() * 4 + scale.numel() * 2
        self.n4 = copies_for(self.int4_bytes)
        self.int4 = [(packed.clone(), scale.clone()) for _ in range(self.n4)]
        self.w = dequantize_int4(packed, scale, None, GROUP)  # bf16 [N, K]
        self.nbf = copies_for(self.w.numel() * 2)
        self.bf16 = [self.w] + [self.w.clone() for _ in range(self.nbf - 1)]
        self.tiny = self._tinygemm(q, scale)
        w8_scale = (self.w.float().abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
        w8 = (self.w.float() / w8_scale[:, None]).to(torch.float8_e4m3fn)
        self.n8 = copies_for(w8.numel())
        self.fp8 = [(w8.clone(), w8_scale) for _ in range(self.n8)]

    def _tinygemm(self, q: torch.Tensor, scale: torch.Tensor):
        """torch's int4 layout: unsigned nibbles two a byte (the even column high), scales and zeros [K/G, N, 2]
        with w = (nibble - 8) * scale + zero. None (and a line said) where this torch lacks it."""
        try:
            u = q.to(torch.int32) + 8
            u8 = (u[:, ::2] << 4 | u[:, 1::2]).to(torch.uint8)
            packed = torch._convert_weight_to_int4pack(u8, 8)
            sz = torch.stack((scale.t(), torch.zeros_like(scale.t())), dim=-1).contiguous()
            torch._weight_int4pack_mm(torch.zeros(1, q.shape[1], device="cuda", dtype=torch.bfloat16), packed,
                                      GROUP, sz)
            return [(packed.clone(), sz) for _ in range(self.n4)]
        except (RuntimeError, AttributeError) as e:
            print(f"tinygemm unavailable: {e}")
            return None


def fp8_torch_quant(x: torch.Tensor):
    """The per-token quantization in torch ops (the peer of our one-launch kernel): several launches."""
    return quantize_fp8_per_token_reference(x)


def row(name: str, wt: Weights, n: int, k: int, m: int, copy_gbs: float) -> list[object]:
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    want = x.float() @ wt.w.float().T
    checks = {"int4": int4_gemm(x, *wt.int4[0], None, GROUP), "bf16": F.linear(x, wt.w)}
    if wt.tiny:
        checks["tinygemm"] = torch._weight_int4pack_mm(x, wt.tiny[0][0], GROUP, wt.tiny[0][1])
    w8, s8 = wt.fp8[0]
    xq, xs = quantize_fp8_per_token_reference(x)
    want8 = (xq.float() * xs) @ (w8.float() * s8[:, None]).T
    for label, got in checks.items():
        if rel_err(got, want) > TOL:
            raise SystemExit(f"{name} M={m}: {label} is off by {rel_err(got, want):.2e} (limit {TOL})")
    err8 = rel_err(fp8_linear(x, w8, s8), want8)
    if err8 > TOL:
        raise SystemExit(f"{name} M={m}: fp8_linear is off by {err8:.2e} (limit {TOL})")

    t4 = graph_us(lambda i: int4_gemm(x, *wt.int4[i], None, GROUP), wt.n4)
    tt = graph_us(lambda i: torch._weight_int4pack_mm(x, wt.tiny[i][0], GROUP, wt.tiny[i][1]), wt.n4) if wt.tiny \
        else float("nan")
    tb = graph_us(lambda i: F.linear(x, wt.bf16[i]), wt.nbf)
    t8 = graph_us(lambda i: fp8_linear(x, *wt.fp8[i]), wt.n8)

    def torch_fp8(i):
        q, s = fp8_torch_quant(x)
        return torch._scaled_mm(q, wt.fp8[i][0].t(), scale_a=s, scale_b=wt.fp8[i][1].view(1, n), out_dtype=x.dtype)

    tq = graph_us(torch_fp8, wt.n8)
    tm = graph_us(lambda i: torch._scaled_mm(xq, wt.fp8[i][0].t(), scale_a=xs, scale_b=wt.fp8[i][1].view(1, n),
                                             out_dtype=x.dtype), wt.n8)
    gbs = (wt.int4_bytes + 2 * m * (k + n)) / (t4 / 1e6) / 1e9
    return [name, f"{n}x{k}", m, f"{t4:.1f}", f"{tt:.1f}", f"{tb:.1f}", f"{gbs:,.0f}", f"{gbs / copy_gbs:.0%}",
            f"{tt / t4:.2f}x", f"{tb / t4:.2f}x", f"{t8:.1f}", f"{tq:.1f}", f"{tm:.1f}"]


def sweep_rows(name: str, wt: Weights, n: int, k: int, rows: list[int]) -> list[list[object]]:
    out = []
    for m in (m for m in rows if m <= DECODE_ROWS):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        want = F.linear(x, wt.w)
        times = []
        for t in sweep_tiles(m):
            if rel_err(launch_int4_gemm(x, *wt.int4[0], None, GROUP, None, tile=t), want) > TOL:
                raise SystemExit(f"{name} M={m}: tile {t} is wrong")
            times.append((graph_us(lambda i: launch_int4_gemm(x, *wt.int4[i], None, GROUP, None, tile=t), wt.n4), t))
        best_t, best = min(times, key=lambda p: p[0])
        out.append([name, m, " / ".join(f"{tile_name(t)}: {us:.1f}" for us, t in times), f"{best_t:.1f}",
                    tile_name(best)])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,16,64,256,2048")
    ap.add_argument("--shapes", default="qkv,o,expert_gate_up,expert_down,mlp_down,8192",
                    help=f"of {','.join(scout_shapes())}")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    shapes = scout_shapes()
    copy_gbs = copy_bandwidth() / 1e9
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"copy bandwidth {copy_gbs:,.0f} GB/s; INT4 group {GROUP}, symmetric; bf16 activations", flush=True)
    table, sweep = [], []
    for name in args.shapes.split(","):
        n, k = shapes[name]
        wt = Weights(n, k)
        for m in rows:
            table.append(row(name, wt, n, k, m, copy_gbs))
            print(" ".join(str(c) for c in table[-1]), flush=True)
        if args.sweep:
            sweep += sweep_rows(name, wt, n, k, rows)
        del wt
        torch.cuda.empty_cache()
    if sweep:
        print("\nINT4 tiles at decode rows, us\n")
        print(markdown_table(["linear", "M", "us", "best us", "best tile"], sweep))
    print()
    print(markdown_table(["linear", "N x K", "M", "int4 us", "tinygemm us", "bf16 us", "int4 GB/s", "of copy",
                          "int4 vs tinygemm", "int4 vs bf16", "fp8 us", "torch q + mm us", "_scaled_mm us"],
                         table))


if __name__ == "__main__":
    main()
