"""Decode steps of one Llama-4-Scout TP-8 rank against the memory-bound limit, through the whole engine.

A decode step must read the weights it uses (attention, router, shared expert, the routed experts its tokens
picked, the LM-head slice) and the KV its sequences can reach (full layers: the whole context; chunked layers:
the current chunk), once. Those bytes over the device's copy bandwidth, measured in the same run, are the
step's floor. Per (KV dtype, batch, context): the step's median wall time with CUDA graphs (scheduler and
sampling included), the bytes, the floor and the fraction of it reached, and the GPU kernels one step launches.

The model is `scout_rank.py`'s: seeded random bf16 weights, the KV cache filled with random values up to the
context (decode timing on zeros flatters). Random weights route tokens to experts almost uniformly, so a batch of
B tokens is counted as touching E * (1 - (1 - 1/E)^B) experts per MoE layer.

    python benchmarks/gpu/decode.py [--contexts 16384,1048576,10000000] [--batches 1,8,32]
        [--batch-context 131072] [--kv-dtypes bfloat16,fp8_e4m3] [--profile] [--async-scheduling]
        [--temperature 0.8] [--quantization int4|fp8] [--full-model]

``--quantization`` builds the weights in that format (``load_format="dummy"``: random quantized weights made on the
GPU), so the bytes a step must read are the quantized ones (values, scales, zero points: the model's own tensors).
``--full-model`` times full-size Scout on one GPU instead of a TP-8 rank, and prints the plan's ``max_model_len``
beside the engine's.

``--async-scheduling`` times every row a second time with ``EngineConfig.async_scheduling`` on, in the same engine:
each step returns with the next one already running, so those steps are timed back to back (their mean).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scout_rank import (  # noqa: E402
    BLOCK_SIZE, CONFIG, SLOT_PIECE, ModelEngines, async_steps_ms, fill_random, median_step_ms, prompt, rank_config,
)

from hybridkv.bench.tables import markdown_table  # noqa: E402
from hybridkv.engine.sampling_params import SamplingParams  # noqa: E402
from hybridkv.engine.sequence import SequenceStatus  # noqa: E402
from hybridkv.kv.planner import PlanInputs, plan_capacity  # noqa: E402


def copy_bandwidth() -> float:
    """Device-to-device copy of 4 GiB, bytes read plus written per second (median of 20)."""
    import triton.testing

    src = torch.randn(1 << 30, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=400, return_mode="median")
    del src, dst
    return 2 * (1 << 32) / (ms / 1000)


def step_bytes(model, cfg: dict, batch: int, context: int, kv_bytes_per_value: int) -> float:
    """Bytes one decode step of ``batch`` sequences at ``context`` must read (see the module docstring)."""
    experts_total = cfg["num_local_experts"]
    touched = experts_total * (1 - (1 - 1 / experts_total) ** (batch * cfg["num_experts_per_tok"]))
    weights = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            continue  # B rows of it
        size = p.numel() * p.element_size()
        weights += size * touched / experts_total if ".experts." in name else size
    if model.lm_head is None:
        weights += model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    per_token_layer = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * kv_bytes_per_value
    chunk = cfg["attention_chunk_size"]
    # Llama-4: RoPE layers are the chunked ones, NoPE layers the full ones
    chunked_layers = sum(1 for i in range(cfg["num_hidden_layers"]) if model.cfg.uses_rope(i))
    full_layers = cfg["num_hidden_layers"] - chunked_layers
    reach_chunked = context % chunk + 1
    kv = batch * per_token_layer * (full_layers * (context + 1) + chunked_layers * reach_chunked)
    return weights + kv


def start_decoding(engine, batch: int, context: int, vocab: int, steps: int, temperature: float = 0.0) -> bool:
    """``batch`` sequences with ``context`` tokens of random KV each, then their first decode steps; False (and
    nothing left running) when their KV does not fit the pool. ``temperature`` > 0: sampled (seeded) requests."""
    for b in range(batch):
        engine.add_request(f"decode-{context}-{b}", prompt(context, vocab, 7 + b), SamplingParams(
            temperature=temperature, seed=b if temperature else None, max_tokens=steps + 2, ignore_eos=True))
    seqs = [engine.scheduler.waiting.popleft() for _ in range(batch)]
    piece = SLOT_PIECE
    for seq in seqs:
        # slots for all but the last prompt token; their KV "exists" as the random values filled in before
        while seq.num_computed_tokens < context - 1:
            n = min(piece, context - 1 - seq.num_computed_tokens)
            if not engine.kv.allocate_slots(seq, n):
                for b in range(batch):
                    engine.abort_request(f"decode-{context}-{b}")
                return False
            seq.num_computed_tokens += n
            engine.kv.on_tokens_computed(seq)
    for seq in seqs:
        seq.status = SequenceStatus.RUNNING
        engine.scheduler.running.append(seq)
    engine.step()  # the last prompt tokens
    engine.step()
    engine.step()
    return True


def kernels_per_step(engine, top: int = 0) -> tuple[int, list[list[str]]]:
    """GPU kernels launched by one decode step (graph replays traced kernel by kernel), and the ``top`` kernels
    by time over 5 steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [e for e in events if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    rows = []
    if top:
        by_name: dict[str, list[float]] = {}
        for e in kernels:
            by_name.setdefault(e.name, []).append(e.device_time)
        total = sum(sum(v) for v in by_name.values())
        for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
            rows.append([name[:90], f"{len(times) / 5:.0f}", f"{sum(times) / 5 / 1000:.3f}",
                         f"{100 * sum(times) / total:.1f}%"])
    return round(len(kernels) / 5), rows


def graph_us(fn, calls: int = 20) -> float:
    """Microseconds per call of ``fn`` replayed from a CUDA graph of ``calls`` back-to-back calls: at decode sizes
    a Python launch outlasts the kernel, and in the engine's graphs kernels follow each other like this."""
    import triton.testing

    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median")
    return 1000 * ms / calls


# (columns, K, programs per SM, warps, stages) of kernels/skinny_gemm.py
SKINNY_TILES = [(16, 256, 4, 4, 3), (16, 256, 8, 4, 3), (16, 512, 4, 4, 3), (32, 256, 4, 4, 3), (16, 128, 8, 4, 4),
                (32, 128, 4, 4, 4), (16, 256, 2, 4, 3), (64, 128, 4, 4, 3), (16, 256, 4, 2, 4)]


def projection_rows(model, rows_list=(1, 8, 16)) -> list[list[str]]:
    """Each distinct projection weight of a layer at decode batch sizes, through cuBLAS (``F.linear``) and
    through ``kernels/skinny_gemm.py`` per tile (its result checked against cuBLAS's first): microseconds per call
    replayed from a graph, and the weight's bytes over that time."""
    from hybridkv.kernels.skinny_gemm import skinny_gemm, skinny_gemm_counters

    layer = model.layers[0]
    shapes = {"q/k/v": layer.self_attn.qkv.weight, "o": layer.self_attn.o_proj.weight,
              "shared gate/up": layer.mlp.shared_expert.gate_up.weight,
              "shared down": layer.mlp.shared_expert.down_proj.weight,
              "LM head": (model.lm_head or model.embed_tokens).weight}
    rows = []
    for name, w in shapes.items():
        arrived = skinny_gemm_counters(w.shape[0], w.device)
        for m in rows_list:
            x = torch.randn(m, w.shape[1], device="cuda", dtype=w.dtype)
            ref = torch.nn.functional.linear(x, w)
            runs = [("cuBLAS", lambda: torch.nn.functional.linear(x, w))]
            for tile in SKINNY_TILES:
                got = skinny_gemm(x, w, None, arrived, tile)
                assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2, (name, tile)
                runs.append((f"{tile}", lambda tile=tile: skinny_gemm(x, w, None, arrived, tile)))
            for kernel, fn in runs:
                us = graph_us(fn)
                rows.append([name, f"{tuple(w.shape)}", f"{m}", kernel, f"{us:.1f}",
                             f"{w.numel() * w.element_size() / (us / 1e6) / 1e9:,.0f}"])
    return rows


# (columns, K, warps, stages): each kernel's choices, timed with the other kernel at the default
GATE_UP_TILES = [(64, 128, 4, 3), (64, 256, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 128, 4, 5), (32, 256, 4, 4)]
DOWN_TILES = [(64, 128, 4, 3), (64, 256, 4, 3), (64, 256, 8, 2), (128, 128, 8, 3), (64, 64, 4, 5), (32, 256, 4, 4),
              (64, 512, 8, 2), (32, 128, 4, 3)]
SPLITS = [None, 2, 4, 8, 16]


def moe_tile_rows(model, batches=(1, 8, 32)) -> list[list[str]]:
    """The fused MoE kernels of one layer (routed and shared experts) alone at each batch size, tile choice and
    gate/up K-split count: microseconds per call replayed from a graph, and the touched experts' bytes over that
    time (each result checked against the default choices' first)."""
    import triton

    from hybridkv.kernels.fused_moe import fused_moe, fused_moe_counters, route

    moe = model.layers[0].mlp
    gate_up, down = moe.experts.gate_up_proj, moe.experts.down_proj
    per_expert = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()  # the shared expert's size too
    arrived = fused_moe_counters(down.shape[0], down.shape[1], down.shape[2], down.device)
    rows = []
    for batch in batches:
        x = torch.randn(batch, gate_up.shape[1], device="cuda", dtype=gate_up.dtype)
        ids, gates = route(x, moe.router.weight, moe.top_k, arrived)
        touched = len(ids.unique())
        shared = (moe.shared_expert.gate_up.weight, moe.shared_expert.down_proj.weight)
        ref = fused_moe(x, gates, ids, gate_up, down, arrived, shared)
        default = (64, 128, 4, 3)
        choices = ([(gu, default, None) for gu in GATE_UP_TILES] + [(default, dn, None) for dn in DOWN_TILES]
                   + [(None, None, s) for s in SPLITS[1:]])
        for gu, dn, splits in choices:
            try:
                got = fused_moe(x, gates, ids, gate_up, down, arrived, shared, gu, dn, splits)
            except triton.runtime.errors.OutOfResources:
                rows.append([f"{batch}", f"{touched}", f"{gu}", f"{dn}", f"{splits}", "too much shared memory", ""])
                continue
            assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
            us = graph_us(lambda: fused_moe(x, gates, ids, gate_up, down, arrived, shared, gu, dn, splits), 10)
            rows.append([f"{batch}", f"{touched}", f"{gu or 'default'}", f"{dn or 'default'}", f"{splits or 'auto'}",
                         f"{us:.1f}", f"{(touched + 1) * per_expert / (us / 1e6) / 1e9:,.0f}"])
    return rows


def plan_row(engines: ModelEngines, engine) -> list[str]:
    """The plan's max_model_len for this engine's KV memory beside the engine's own, and the weights' bytes."""
    kv_bytes = engine.kv.pool.num_blocks * engine.layout.page_bytes
    plan = plan_capacity(engines.cfg, PlanInputs(kv_cache_dtype=engine.config.kv_cache_dtype, block_size=BLOCK_SIZE,
                                                 kv_memory_bytes=kv_bytes, quantization=engines.quantization,
                                                 max_num_batched_tokens=engine.config.max_num_batched_tokens))
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    return [engine.config.kv_cache_dtype, f"{plan.max_model_len:,} / {engine.max_model_len:,}",
            f"weights {weights / 2**30:.2f} GiB, KV {kv_bytes / 2**30:.2f} GiB"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="16384,1048576,10000000", help="batch-1 contexts")
    ap.add_argument("--batches", default="1,8,32", help="batch sizes timed at --batch-context")
    ap.add_argument("--batch-context", type=int, default=131072)
    ap.add_argument("--kv-dtypes", default="bfloat16,fp8_e4m3")
    ap.add_argument("--profile", action="store_true", help="also print the top kernels of a batch-1 step")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per row (median)")
    ap.add_argument("--projections", action="store_true",
                    help="also time each projection shape alone (cuBLAS, skinny_gemm's tiles) against its bytes")
    ap.add_argument("--moe-tiles", action="store_true",
                    help="also time the fused MoE kernels' tile and K-split choices")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="also time each row with EngineConfig.async_scheduling (steps back to back, their mean)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample the tokens at this temperature (seeded) instead of taking the argmax")
    ap.add_argument("--quantization", default="none", choices=("none", "fp8", "int4"),
                    help="weights in this format (random, built by the engine: load_format=dummy)")
    ap.add_argument("--full-model", action="store_true", help="full-size Scout on one GPU instead of a TP-8 rank")
    args = ap.parse_args()

    bandwidth = copy_bandwidth()
    cfg = json.loads(CONFIG.read_text()) if args.full_model else rank_config(8)
    engines = ModelEngines(cfg, args.quantization, shared=not args.full_model)
    projections, tiles, plans = [], [], []
    batches = [int(b) for b in args.batches.split(",") if b]
    cases = list(dict.fromkeys([(1, int(c)) for c in args.contexts.split(",") if c] +
                               [(b, args.batch_context) for b in batches]))
    dtypes = args.kv_dtypes.split(",")
    # Every step is timed before any profile: once torch's profiler has run in a process, each later CUDA launch
    # there costs more host time (a decode graph's launch: 0.6 ms instead of 0.01), so the kernels are counted in a
    # second pass over fresh engines.
    timed: dict[tuple[str, int, int], float] = {}
    timed_async: dict[tuple[str, int, int], float] = {}
    for kv_dtype in dtypes:
        engine = engines.build(kv_dtype, max_num_seqs=max(b for b, _ in cases))
        plans.append(plan_row(engines, engine))
        print(*plans[-1], flush=True)
        if args.projections and not projections:
            projections = projection_rows(engine.model)  # fused weights exist once the engine has been built
        if args.moe_tiles and not tiles:
            tiles = moe_tile_rows(engine.model)
        fill_random(engine)
        for batch, context in cases:
            if context + args.steps + 8 <= engine.max_model_len and start_decoding(
                    engine, batch, context, cfg["vocab_size"], args.steps + 8, args.temperature):
                timed[kv_dtype, batch, context] = median_step_ms(engine, args.steps, drain=True)
                print(kv_dtype, batch, context, f"{timed[kv_dtype, batch, context]:.2f} ms", flush=True)
                if args.async_scheduling:
                    timed_async[kv_dtype, batch, context] = async_steps_ms(engine, lambda: start_decoding(
                        engine, batch, context, cfg["vocab_size"], args.steps + 8, args.temperature), args.steps)
                    print(kv_dtype, batch, context, f"async {timed_async[kv_dtype, batch, context]:.2f} ms",
                          flush=True)
        del engine
        torch.cuda.empty_cache()
    rows, top_rows = [], []
    for kv_dtype in dtypes:
        engine = engines.build(kv_dtype, max_num_seqs=max(b for b, _ in cases))
        kv_value_bytes = 1 if kv_dtype.startswith("fp8") else 2
        for batch, context in cases:
            ms = timed.get((kv_dtype, batch, context))
            if ms is None:
                rows.append([kv_dtype, f"{batch}", f"{context:,}", "does not fit", "", "", "", ""]
                            + ["", ""] * args.async_scheduling)
                continue
            start_decoding(engine, batch, context, cfg["vocab_size"], 5 + 8, args.temperature)
            count, top = kernels_per_step(engine, 25 if args.profile and batch == 1 and not top_rows else 0)
            top_rows = top_rows or top
            while engine.has_unfinished_requests():
                engine.step()
            need = step_bytes(engine.model, cfg, batch, context, kv_value_bytes)
            floor_ms = 1000 * need / bandwidth
            row = [kv_dtype, f"{batch}", f"{context:,}", f"{ms:.2f}", f"{need / 1e9:.2f}", f"{floor_ms:.2f}",
                   f"{100 * floor_ms / ms:.0f}%", f"{count}"]
            if args.async_scheduling:
                fast = timed_async[kv_dtype, batch, context]
                row += [f"{fast:.2f}", f"{100 * floor_ms / fast:.0f}%"]
            rows.append(row)
        del engine
        torch.cuda.empty_cache()
    sampled = f", tokens sampled at temperature {args.temperature}" if args.temperature else ""
    shape = "full-size Llama-4-Scout on one GPU" if args.full_model else "Llama-4-Scout TP-8 rank"
    weights = f", {args.quantization} weights" if args.quantization != "none" else ""
    print(f"\n{torch.cuda.get_device_name()}: {shape} decode{weights}, CUDA graphs{sampled}, "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (measured in this run)")
    if engines.loaded is None:
        print(markdown_table(["KV", "max_model_len plan / engine", "memory"], plans))
    extra = ["async scheduling: step ms", "of floor"] if args.async_scheduling else []
    print(markdown_table(["KV", "batch", "context", "step ms", "GB to read", "floor ms", "of floor",
                          "kernels/step", *extra], rows))
    if projections:
        print("\nProjections alone, cuBLAS against kernels/skinny_gemm.py by tile (columns, K, programs per SM, "
              "warps, stages):")
        print(markdown_table(["projection", "weight", "rows", "kernel", "us", "weight GB/s"], projections))
    if tiles:
        print("\nFused MoE alone, by tiles (columns, K, warps, stages) of the gate/up and down kernels and K-splits:")
        print(markdown_table(["batch", "experts", "gate/up tile", "down tile", "splits", "us", "GB/s"], tiles))
    if top_rows:
        print("\nTop kernels of a batch-1 step (5 steps profiled):")
        print(markdown_table(["kernel", "per step", "ms per step", "share"], top_rows))


if __name__ == "__main__":
    main()
