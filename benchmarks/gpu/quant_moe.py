"""A Llama-4-Scout rank's routed experts (``kernels/quant_moe.py``) in FP8 and INT4 against the bf16 kernels.

One MoE layer's 16 experts at a rank's slice (``--tensor-parallel-size``, default 8: [5120 -> 2 x 1024 -> 5120]),
N(0, 0.02) weights in bf16, quantized once (FP8: e4m3 with a float32 scale per output channel; INT4: group 128):

- decode, (tokens, top-k) pairs up to ``fused_moe.MAX_PAIRS``: the bf16 ``fused_moe`` against ``quant_moe_decode``
  over each format, each the median of CUDA-graph replays (``do_bench_cudagraph``), and the GB/s of the picked
  experts' weight bytes over that time;
- prefill, rows spread evenly over the experts: the gate/up grouped GEMM, bf16 ``F.grouped_mm`` against
  ``quant_grouped_gemm`` over each format, in TFLOP/s.

Every output is first checked against the float MoE over the dequantized experts (1.5e-2 of its norm). Routing
and inputs random, never zeros.

    python benchmarks/gpu/quant_moe.py [--tensor-parallel-size 8] [--tokens 1,8,16,32] [--rows 4096,16384]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from hybridkv.kernels.fused_moe import fused_moe, fused_moe_counters  # noqa: E402
from hybridkv.kernels.quant_moe import quant_grouped_gemm, quant_moe_decode  # noqa: E402
from hybridkv.kv.weight_formats import FP8, INT4  # noqa: E402
from hybridkv.model.quantization.quantize import quantize_weight  # noqa: E402
from hybridkv.model.quantization.quantized_experts import StackedFp8, StackedInt4  # noqa: E402

EXPERTS, HIDDEN, INTER = 16, 5120, 8192


def quantized(w: torch.Tensor, fmt) -> StackedFp8 | StackedInt4:
    """transformers' [E, K, N] stack -> the kernels' output-major stack in ``fmt``."""
    e, k, n = w.shape
    q, s = quantize_weight(w.transpose(1, 2).reshape(e * n, k).contiguous(), fmt)
    if fmt is FP8:
        return StackedFp8(q.view(e, n, k), s.view(e, n))
    return StackedInt4(q.view(e, n, k // 8), s.view(e, n, -1))


def reference(x, gates, ids, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """float32: each pair's expert MLP on its gated input ([E, N, K] weights), summed over the token's choices."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for c in range(ids.shape[1]):
            g, u = (gate_up[ids[t, c]] @ (x[t].float() * gates[t, c].float())).chunk(2)
            out[t] += down[ids[t, c]] @ (F.silu(g) * u)
    return out


def check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = ((got.float() - want).norm() / want.norm()).item()
    if err > 1.5e-2:
        raise SystemExit(f"{what}: relative error {err:.2e} against the dequantized float MoE")


def decode(stacks: dict, gate_up: torch.Tensor, down: torch.Tensor, tokens: int, top_k: int) -> str:
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, EXPERTS, (tokens, top_k), device="cuda")
    gates = torch.rand(tokens, top_k, device="cuda", dtype=torch.bfloat16)
    arrived = fused_moe_counters(EXPERTS, gate_up.shape[2] // 2, HIDDEN, x.device)
    picked = len(ids.unique())
    weights = picked * 3 * HIDDEN * (gate_up.shape[2] // 2)
    row = [f"{tokens} x top-{top_k} ({picked} experts)"]
    with torch.cuda.stream(torch.cuda.Stream()):
        t = do_bench_cudagraph(lambda: fused_moe(x, gates, ids, gate_up, down, arrived))
        row.append(f"{t * 1e3:.1f} us, {weights * 2 / t / 1e6:.0f} GB/s")
        for fmt, (a, b) in stacks.items():
            want = reference(x, gates, ids, a.dequantized(torch.float32), b.dequantized(torch.float32))
            check(quant_moe_decode(x, gates, ids, a.parts(), b.parts()), want, f"{fmt.name} decode")
            t = do_bench_cudagraph(lambda: quant_moe_decode(x, gates, ids, a.parts(), b.parts()))
            row.append(f"{t * 1e3:.1f} us, {weights * fmt.bits / 8 / t / 1e6:.0f} GB/s")
    return "| " + " | ".join(row) + " |"


def prefill(stacks: dict, gate_up: torch.Tensor, rows: int) -> str:
    a = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    ends = (torch.arange(1, EXPERTS + 1, device="cuda") * rows // EXPERTS).to(torch.int32)
    flops = 2 * rows * HIDDEN * gate_up.shape[2]
    row = [f"{rows:,}", f"{flops / do_bench(lambda: F.grouped_mm(a, gate_up, offs=ends)) / 1e9:.0f}"]
    for fmt, (s, _) in stacks.items():
        w = s.dequantized(torch.float32)
        starts = [0, *ends[:-1].tolist()]
        want = torch.cat([a[lo:hi].float() @ w[e].T for e, (lo, hi) in enumerate(zip(starts, ends.tolist()))])
        check(quant_grouped_gemm(a, ends, *s.parts()), want, f"{fmt.name} prefill")
        row.append(f"{flops / do_bench(lambda: quant_grouped_gemm(a, ends, *s.parts())) / 1e9:.0f}")
    return "| " + " | ".join(row) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensor-parallel-size", type=int, default=8)
    ap.add_argument("--tokens", default="1,8,16,32")
    ap.add_argument("--top-k", type=int, default=1)
    ap.add_argument("--rows", default="4096,16384")
    args = ap.parse_args()
    inter = INTER // args.tensor_parallel_size
    torch.manual_seed(0)
    gate_up = torch.randn(EXPERTS, HIDDEN, 2 * inter, device="cuda", dtype=torch.bfloat16) * 0.02
    down = torch.randn(EXPERTS, inter, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    stacks = {fmt: (quantized(gate_up, fmt), quantized(down, fmt)) for fmt in (FP8, INT4)}
    print(f"{torch.cuda.get_device_name()}, {EXPERTS} experts of [{HIDDEN} -> 2 x {inter} -> {HIDDEN}]\n")
    print("| pairs | bf16 fused_moe | fp8 | int4 |\n|---|---|---|---|")
    for tokens in map(int, args.tokens.split(",")):
        print(decode(stacks, gate_up, down, tokens, args.top_k), flush=True)
    print("\n| rows | bf16 grouped_mm TFLOP/s | fp8 | int4 |\n|---|---|---|---|")
    for rows in map(int, args.rows.split(",")):
        print(prefill(stacks, gate_up, rows), flush=True)


if __name__ == "__main__":
    main()
