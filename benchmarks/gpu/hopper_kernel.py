"""Where the Hopper prefill kernel's time goes: the kernel against copies of itself with one stage removed.

Each variant is the kernel's source with a text edit (no K/V loads, every tile gathered, no softmax),
compiled by NVRTC and timed on the same inputs as the kernel and the Triton
kernel: a one-shot causal prefill of ``--length`` tokens and a 16,384-token step over ``--step-context`` cached
keys (Scout rank shape: 5 query heads, 1 KV head, d 128), 64-token pages. Its compile-time switches (OVERLAP,
PINGPONG) are timed the same way. Variants that change the result print their error but are not held to
it; the others are checked against SDPA (relative error <= 1e-2) first.

    python benchmarks/gpu/hopper_kernel.py [--length 65536] [--step-context 1048576]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.gpu.attention import (
    D, HKV, HQ, bench, filled_backend, first_query, make_backend, rel_err, sdpa, useful_pairs,
)
from hybridkv.kernels import hopper_attention
from hybridkv.kv.specs import FullAttentionSpec
from hybridkv.model.attention.base import StepSequence

TMA_TILE = "if (p.tma && n >= lo && n + BN <= end) {"
SOFTMAX = "  const float NEG_INF = __int_as_float(0xff800000);\n  float m_new[2];\n"
NO_SOFTMAX = "  if (n >= 0) return;  // the raw scores go to P V\n"
EDITS = {
    # every tile takes the TMA branch, which then copies nothing: the barriers still turn over
    "no loads": [(TMA_TILE, "if (true) {"), ("mbar_arrive_expect_tx(full_bar + 8 * s, STAGE_BYTES);",
                                             "mbar_arrive(full_bar + 8 * s);"),
                 ("if (lane < 4 * boxes)\n            tma_load(", "if (false)\n            tma_load(")],
    "gathers only": [(TMA_TILE, "if (false) {")],
    "no softmax": [(SOFTMAX, NO_SOFTMAX + SOFTMAX)],
}


def variant(names: list[str]) -> str:
    text = hopper_attention.SOURCE.read_text()
    for name in names:
        for old, new in EDITS[name]:
            assert old in text, f"{name}: the kernel's source changed ({old[:40]!r} not found)"
            text = text.replace(old, new)
    return text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=65536, help="one-shot causal prefill")
    ap.add_argument("--step-context", type=int, default=1 << 20, help="and 16,384 new tokens over this many (0: no)")
    args = ap.parse_args()
    torch.manual_seed(0)
    n, context, tokens = args.length, args.step_context, 16384
    spec = FullAttentionSpec(HKV, D, "bfloat16")
    q = torch.randn(n, HQ, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(n, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ref = sdpa(q, k, v, chunked=False)
    flops = 4 * HQ * D * useful_pairs(n, False)
    one_shot, table = make_backend(spec, n, n)
    one_shot_triton, _ = make_backend(spec, n, n, hopper_kernel=False)
    shapes = [(one_shot, one_shot_triton, [StepSequence(0, n, [table])], q, k, v, ref, flops)]
    if context:
        keys = torch.randn(context + tokens, HKV, D, device="cuda", dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        step, step_table = filled_backend(spec, context, tokens, 64, keys, values)
        step_triton, _ = filled_backend(spec, context, tokens, 64, keys, values, hopper_kernel=False)
        qs = torch.randn(tokens, HQ, D, device="cuda", dtype=torch.bfloat16)
        step_ref = first_query(qs, keys[: context + 1], values[: context + 1])
        step_flops = 4 * HQ * D * (tokens * context + tokens * (tokens + 1) // 2)
        shapes.append((step, step_triton, [StepSequence(context, tokens, [step_table])], qs, keys[context:],
                       values[context:], step_ref, step_flops))
    cases = [("Triton kernel", None, {}), ("CUDA kernel (as built)", [], {})]
    cases += [(f"OVERLAP={o}, PINGPONG={p}", [], {"OVERLAP": o, "PINGPONG": p}) for o in (0, 1) for p in (0, 1)]
    cases += [(" + ".join(c), c, {}) for c in (["gathers only"], ["no loads"], ["no softmax"], ["no loads", "no softmax"])]
    rows = []
    for name, edits, defines in cases:
        row = [name]
        kernel = None if edits is None else hopper_attention.HopperPrefill(torch.device("cuda"), source=variant(edits),
                                                                           defines=defines)
        for cuda_backend, triton_backend, seqs, qq, kk, vv, want, fl in shapes:
            backend = triton_backend if kernel is None else cuda_backend
            if kernel is not None:
                backend.hopper = kernel
            backend.begin_step(seqs)
            out = backend.attend(0, qq, kk, vv, D ** -0.5)
            err = rel_err(out[: want.shape[0]], want)
            if not edits:
                assert err <= 1e-2, f"{name}: relative error {err:.2e}"
            ms = bench(lambda: backend.attend(0, qq, kk, vv, D ** -0.5))
            row += [f"{ms:.2f}", f"{fl / ms / 1e9:.0f}", f"{err:.1e}"]
        rows.append(row)
        print(" | ".join(row), flush=True)
    print(f"\n{torch.cuda.get_device_name()}, 64-token pages: one-shot causal prefill of {n:,} tokens"
          + (f"; {tokens:,} new tokens over {context:,} cached (error of the first query)" if context else ""))
    head = ["variant"] + [c for s in (["one-shot"] + (["step"] if context else [])) for c in
                          (f"{s} ms", f"{s} TFLOP/s", f"{s} rel err")]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
