"""Where the Hopper prefill kernel's time goes: the kernel against copies of itself with one stage removed.

Each variant is the kernel's source with a text edit (no K/V loads, K/V loaded once, every tile from the first
tile's pages, every tile gathered, no softmax, no query load, no output stores) or fewer stages, compiled by NVRTC
and timed on the same inputs as the kernel and the Triton kernel: a one-shot causal prefill of ``--length`` tokens
and a 16,384-token step over ``--step-context`` cached keys (Scout rank shape: 5 query heads, 1 KV head, d 128),
64-token pages. Its compile-time switches (OVERLAP, PINGPONG, TREE, FP8_PROMOTE) are timed the same way. Variants
that change the result print their error but are not held to it; the others are checked against SDPA (relative error
<= 1e-2) first. Every row has the SM clock and power while it was timed: stale data in a dot draws less power, and a
higher clock would flatter the variant. ``--fp8``: the FP8-compute kernel over an e4m3 cache instead, against
Triton's FP8 compute, by stage count (checked against SDPA over the same e4m3 K/V, relative error <= 6e-2).
``--chunked``: the one-shot prefill on a chunked(8192) layer, whose work items (a query tile's keys) are 16x shorter
than a 128K full layer's, so their fixed costs show.

    python tools/kernel_dev/hopper_kernel.py [--length 65536] [--step-context 1048576] [--fp8] [--chunked]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.gpu.attention import (
    CHUNK, D, HKV, HQ, SmClock, bench, e4m3, filled_backend, first_query, make_backend, rel_err, sdpa, useful_pairs,
)
from hybridkv.bench.tables import markdown_table
from hybridkv.kernels import hopper_attention
from hybridkv.kv.specs import ChunkedLocalSpec, FullAttentionSpec
from hybridkv.model.attention.base import StepSequence

TMA_TILE = "} else if (p.tma && inside) {"
SOFTMAX = "  const float NEG_INF = __int_as_float(0xff800000);\n  constexpr int CHAINS"
STAGED_STORE = "      if (tok < n_tok)\n        st_global16("  # O staged in shared memory (bf16 and FP8)
NO_SOFTMAX = "  if (n >= 0) return;  // the raw scores go to P V\n"
EDITS = {
    # bf16: every tile takes the TMA branch, which then copies nothing: the barriers still turn over
    "no loads": [(TMA_TILE, "} else if (true) {"), ("if (lane == 0) mbar_expect_tx(full, L::stage_bytes);", ""),
                 ("if (lane < 4 * boxes)\n            tma_load(", "if (false)\n            tma_load(")],
    "gathers only": [(TMA_TILE, "} else if (false) {")],
    # the first NS tiles of each CTA by TMA, then none (result wrong): the dots multiply real K/V, as built, with no
    # L2 or HBM traffic after the first NS tiles: what the loads cost in cycles and in clock (the power they draw)
    "loads once": [(TMA_TILE, "} else if (true) {"),
                   ("if (lane == 0) mbar_expect_tx(full, L::stage_bytes);",
                    "if (lane == 0 && t < NS) mbar_expect_tx(full, L::stage_bytes);"),
                   ("if (lane < 4 * boxes)\n            tma_load(",
                    "if (lane < 4 * boxes && t < NS)\n            tma_load(")],
    "no softmax": [(SOFTMAX, NO_SOFTMAX + SOFTMAX)],
    # every tile's K/V from the pages of the CTA's first tile (result wrong): the same bytes through L2 and shared
    # memory, but L2 hits with no HBM behind them: a bound on what the loads' latency costs at this many stages
    "first tile's pages": [("      pages = next_pages;\n", "")],
    # a work item's fixed costs (--chunked: 32 key tiles an item on average, against 512 at a 128K full layer); like
    # "no loads", "no Q load" leaves stale shared memory to the dots, which draw less power and run at a higher
    # clock: an upper bound (hopper_timeline.py counts its cycles)
    "no Q load": [("  if (wg > 0) fetch_q(p, rows, q_regs, wg - 1, tid - 128 * wg, q_row0, n_tok, kv_head);\n", ""),
                  ("  store_q<FP8>(q_regs, q_smem, q_scales, cw, ct);\n", "")],
    # (a condition false at run time: the compiler keeps the work whose result is no longer written)
    "no output stores": [(STAGED_STORE, STAGED_STORE.replace("tok < n_tok", "n_tok < 0"))],
    # FP8 compute: the producer copies nothing (K, V^T by TMA, or the edge tiles' V^T), the barriers still turn over
    "fp8 no loads": [("if (lane == 0) mbar_expect_tx(full, inside ? 2 * L::k_bytes : L::k_bytes);", ""),
                     ("          if (lane < boxes)\n            tma_load(",
                      "          if (false)\n            tma_load("),
                     ("if (inside && lane >= boxes && lane < boxes + bn / 64)", "if (false)"),
                     ("        if (!inside) {\n          const int r = tid;",
                      "        if (false) {\n          const int r = tid;")],
    # FP8 compute without one of its dots (the softmax then runs on stale registers): what each dot costs
    "no QK dots": [("      wgmma_ss_e4m3<BN<FP8>>(s, desc_at(q, kk * 32), desc_at(k, kk * 32), kk > 0);\n",
                    "      ;\n")],
    # the exponentials of an unmasked tile against the running max instead of the new one (wrong wherever a row's
    # max rises; the first tile overflows): the tile's max is still reduced, but off the exponentials' path. A bound
    # on what starting the exponentials before the max is known could buy
    "stale max": [("    m_new[h] = fmaxf(m[h], MASKED ? mx : mx * scale[h]);\n",
                   "    m_new[h] = MASKED ? fmaxf(m[h], mx) : fmaxf(m[h], -64.f);\n"
                   "    if (!MASKED) l[h] += 0.f * mx;\n")],
    # bounds on fewer instructions per score: no row sums (the sum stays 0; what taking them from the tensor core
    # could save), no O update after each P V (O never sees P V)
    "no row sums": [("        sum[(2 * j + e) % CHAINS] += x;\n", "")],
    "no O update": [("  for (int i = 0; i < 64; ++i) o[i] = PROMOTE ? fmaf(o[i], alpha[(i >> 1) & 1], pv[i]) : "
                     "o[i] * alpha[(i >> 1) & 1];\n", "")],
    # without FP8_PROMOTE: O is rescaled only where a warp's rows' max moved (FlashAttention-4's skip, exact here)
    "rescale when the max moves": [("        update_o<false>(o, o, alpha);\n",
                                    "        if (__any_sync(FULL, alpha[0] != 1.f || alpha[1] != 1.f)) "
                                    "update_o<false>(o, o, alpha);\n")],
    # 2^x on the FMA pipe for some of an unmasked tile's exponentials (FlashAttention-4's offload of MUFU): x rounded
    # by the 1.5 x 2^23 trick, 2^f of the rest by a quadratic (relative error 1.8e-3, under P's e4m3 rounding), the
    # integer part added to the exponent; 8 instructions where MUFU takes one, but MUFU's pipe does an exponential
    # a warp per 8 cycles. ``ex2 poly k/8``: k of every 8 scores of a row
    **{f"ex2 poly {k}/8": [
        ("template <bool MASKED, bool FP8>\n__device__ __forceinline__ void softmax_scores(",
         "__device__ __forceinline__ float ex2_poly(float x) {\n"
         "  x = fmaxf(x, -126.f);\n  const float t = x + 12582912.f;\n  const float f = x - (t - 12582912.f);\n"
         "  const float q = fmaf(fmaf(0.23783041f, f, 0.70339650f), f, 1.00051367f);\n"
         "  return __int_as_float(__float_as_int(q) + (__float_as_int(t) << 23));\n}\n"
         "template <bool MASKED, bool FP8>\n__device__ __forceinline__ void softmax_scores("),
        ("        const float x = MASKED ? ex2(s[i] + shift) : ex2(fmaf(s[i], scale[h], shift));\n",
         f"        const float x = MASKED ? ex2(s[i] + shift) : (2 * j + e) % 8 < {k} ? "
         "ex2_poly(fmaf(s[i], scale[h], shift)) : ex2(fmaf(s[i], scale[h], shift));\n")] for k in (1, 2, 3)},
    # the FP8 softmax's row max and sum as c independent chains (TREE's 4), and the consumers at 240 registers
    # (the producer at 24) where FP8_BN 192 leaves them 232: more room for ptxas's schedule
    **{f"{c} chains": [("constexpr int CHAINS = FP8 && TREE ? 4 : 1;",
                        f"constexpr int CHAINS = FP8 && TREE ? {c} : 1;")] for c in (2, 6, 8)},
    "240 registers": [("producer_regs = FP8 && FP8_PROMOTE ? 24 : 40;", "producer_regs = FP8 ? 24 : 40;"),
                      ("consumer_regs = FP8 && FP8_PROMOTE ? 240 : 232;", "consumer_regs = FP8 ? 240 : 232;")],
    "no PV dots": [("      wgmma_rs_e4m3(o, p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3], b, "
                    "FP8_PROMOTE ? kk > 0 : 1);\n", "")],
}


def variant(names: list[str], text: str | None = None) -> str:
    """The kernel's source (or ``text``, another version of it) with the named edits."""
    text = hopper_attention.SOURCE.read_text() if text is None else text
    for name in names:
        for old, new in EDITS[name]:
            assert old in text, f"{name}: the kernel's source changed ({old[:40]!r} not found)"
            text = text.replace(old, new)
    return text


def shapes(fp8: bool, n: int, context: int, tokens: int, chunked: bool = False) -> list[tuple]:
    """The one-shot prefill (full, or chunked(8192)) and the step, each as (CUDA backend, Triton backend, step, q, k,
    v, reference, FLOP); FP8 compute: an e4m3 cache, its reference SDPA over the same e4m3 K/V."""
    kv_dtype, options = ("fp8_e4m3", {"fp8_compute": True}) if fp8 else ("bfloat16", {})
    round_kv = e4m3 if fp8 else (lambda x: x)
    spec = ChunkedLocalSpec(HKV, D, kv_dtype, chunk=CHUNK) if chunked else FullAttentionSpec(HKV, D, kv_dtype)
    q = torch.randn(n, HQ, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(n, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    one_shot, table = make_backend(spec, n, n, **options)
    one_shot_triton, _ = make_backend(spec, n, n, hopper_kernel=False, **options)
    out = [(one_shot, one_shot_triton, [StepSequence(0, n, [table])], q, k, v,
            sdpa(q, round_kv(k), round_kv(v), chunked=chunked), 4 * HQ * D * useful_pairs(n, chunked))]
    spec = FullAttentionSpec(HKV, D, kv_dtype)
    if context:
        keys = torch.randn(context + tokens, HKV, D, device="cuda", dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        step, step_table = filled_backend(spec, context, tokens, 64, keys, values, **options)
        step_triton, _ = filled_backend(spec, context, tokens, 64, keys, values, hopper_kernel=False, **options)
        qs = torch.randn(tokens, HQ, D, device="cuda", dtype=torch.bfloat16)
        step_ref = first_query(qs, round_kv(keys[: context + 1]), round_kv(values[: context + 1]))
        out.append((step, step_triton, [StepSequence(context, tokens, [step_table])], qs, keys[context:],
                    values[context:], step_ref, 4 * HQ * D * (tokens * context + tokens * (tokens + 1) // 2)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=65536, help="one-shot causal prefill")
    ap.add_argument("--step-context", type=int, default=1 << 20, help="and 16,384 new tokens over this many (0: no)")
    ap.add_argument("--fp8", action="store_true", help="FP8 compute instead: Triton, then the CUDA kernel's stages")
    ap.add_argument("--chunked", action="store_true", help="the one-shot prefill on a chunked(8192) layer")
    ap.add_argument("--cases", default="", help="only the variants whose names contain one of these (comma-separated)")
    args = ap.parse_args()
    torch.manual_seed(0)
    n, context, tokens = args.length, args.step_context, 16384
    # (name, source edits (None: the Triton kernel), compile-time defines, HopperPrefill's FP8 tile and stages)
    if args.fp8:
        old = {"fp8_block_n": 128, "fp8_stages": 5}  # the tile before FP8_BN (with FP8_PROMOTE)
        cases = [("Triton kernel, FP8 compute", None, {}, {})]
        cases += [(f"CUDA kernel, FP8 compute, {st} stages", [], {}, {"fp8_stages": st}) for st in (3, 4)]
        cases += [("CUDA kernel, FP8 compute, 128-key tiles, 5 stages", [], {}, old),
                  ("CUDA kernel, FP8 compute, 128-key tiles, 5 stages, FP8_PROMOTE=0", [], {"FP8_PROMOTE": 0}, old)]
        cases += [(f"CUDA kernel, FP8 compute, {k}=0", [], {k: 0}, {}) for k in ("OVERLAP", "TREE", "PINGPONG")]
        cases += [("CUDA kernel, FP8 compute, rescale when the max moves", ["rescale when the max moves"], {}, {})]
        cases += [(f"CUDA kernel, FP8 compute, ex2 poly {k}/8", [f"ex2 poly {k}/8"], {}, {}) for k in (1, 2, 3)]
        cases += [(f"CUDA kernel, FP8 compute, {e}", [e], {}, {}) for e in ("2 chains", "6 chains", "8 chains",
                                                                          "240 registers")]
        cases += [(f"CUDA kernel, FP8 compute, {' + '.join(c)}", c, {}, {})
                  for c in (["no softmax"], ["fp8 no loads"], ["no softmax", "fp8 no loads"], ["no QK dots"],
                            ["no PV dots"], ["no QK dots", "no PV dots"], ["stale max"], ["no row sums"],
                            ["no O update"], ["no row sums", "no O update"])]
    else:
        cases = [("Triton kernel", None, {}, {}), ("CUDA kernel (as built)", [], {}, {}),
                 ("CUDA kernel, 2 stages", [], {}, {"stages": 2})]  # what the third stage buys
        cases += [(f"OVERLAP={o}, PINGPONG={p}", [], {"OVERLAP": o, "PINGPONG": p}, {}) for o in (0, 1)
                  for p in (0, 1)]
        cases += [(" + ".join(c), c, {}, {})
                  for c in (["first tile's pages"], ["loads once"], ["gathers only"], ["no loads"], ["no softmax"],
                            ["no loads", "no softmax"], ["no Q load"], ["no output stores"],
                            ["no Q load", "no output stores"], ["stale max"])]
    if args.cases:
        cases = [c for c in cases if any(w in c[0] for w in args.cases.split(","))]
    bound = 6e-2 if args.fp8 else 1e-2  # the GPU tests' bounds
    rows = []
    clock = SmClock()
    cases_shapes = shapes(args.fp8, n, context, tokens, args.chunked)
    for name, edits, defines, tile in cases:
        row = [name]
        kernel = None
        if edits is not None:
            kernel = hopper_attention.HopperPrefill(torch.device("cuda"), source=variant(edits), defines=defines,
                                                    **tile)
        for cuda_backend, triton_backend, seqs, qq, kk, vv, want, fl in cases_shapes:
            backend = triton_backend if kernel is None else cuda_backend
            if kernel is not None:
                backend.hopper.kernel = kernel
            backend.begin_step(seqs)
            out = backend.attend(0, qq, kk, vv, D ** -0.5)
            err = rel_err(out[: want.shape[0]], want)
            if not edits:
                assert err <= bound, f"{name}: relative error {err:.2e}"
            ms, span = clock.window(lambda: bench(lambda: backend.attend(0, qq, kk, vv, D ** -0.5)))
            sm = clock.median(span)
            row += [f"{ms:.2f}", f"{fl / ms / 1e9:.0f}", f"{err:.1e}",
                    "n/a" if sm is None else f"{sm[0]:.0f} / {sm[1]:.0f}"]
        rows.append(row)
        print(" | ".join(row), flush=True)
    print(f"\n{torch.cuda.get_device_name()}, 64-token pages: one-shot causal prefill of {n:,} tokens"
          + (f" (chunked({CHUNK}))" if args.chunked else "")
          + (f"; {tokens:,} new tokens over {context:,} cached (error of the first query)" if context else "")
          + ("; FP8 compute, errors against SDPA over the same e4m3 K/V" if args.fp8 else ""))
    head = ["variant"] + [c for s in (["one-shot"] + (["step"] if context else [])) for c in
                          (f"{s} ms", f"{s} TFLOP/s", f"{s} rel err", f"{s} SM MHz / W")]
    print(markdown_table(head, rows))
    clock.close()


if __name__ == "__main__":
    main()
