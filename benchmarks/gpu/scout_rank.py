"""One tensor-parallel rank of Llama-4-Scout at TP 8, on one GPU, through the whole engine.

The text config (`tests/data/scout-text-config.json`, = `../shared/scout-text-config.json`) with attention heads,
MLP/expert widths and the vocabulary divided by the TP size (KV heads: one per rank), all 48 layers and 16 experts,
seeded random bf16 weights built on the GPU (~25 GiB: no checkpoint travels). The all-reduces of real TP are absent;
per-GPU compute and memory are those of one rank. Reports:

- `hybridkv plan`'s max_model_len for the KV memory this GPU actually gives, vs the engine's;
- prefill wall time of one cold prompt (prefix caching off) of each length, time to first token;
- decode step latency at long contexts: the KV cache is FILLED WITH RANDOM VALUES (written, not computed by a
  prefill) up to the context, then the engine decodes; bf16 and fp8 KV;
- a step-cost model (--step-contexts): one 16,384-token prefill step timed at each context over the same random
  cache, cost(context) fitted as a line and summed over a prompt's steps to predict its prefill time, beside a
  user's vLLM numbers (and checked against a measured prefill of the same length when one ran);
- peak GPU memory.

    python benchmarks/gpu/scout_rank.py [--prefill-lengths 1048576,2845646] [--decode-contexts 1048576,5242880,10000000]
        [--kv-dtypes bfloat16,fp8_e4m3] [--block-size 64] [--step-contexts 0,1048576,...] [--plot PATH]

Tensor parallelism (dummy weights, every rank's KV filled with random values through ``collective_rpc``):

    python benchmarks/gpu/scout_rank.py --tensor-parallel-size 2 [--tp-prefill-length 1048576]
        [--decode-contexts 1048576,5242880]
    python benchmarks/gpu/scout_rank.py --tensor-parallel-size 4 --full-model [--tp-prefill-length 2845646]
        [--decode-contexts 1048576,5242880] [--kv-dtypes bfloat16,fp8_compute]

The first runs Scout/4 over 2 GPUs beside Scout/8 on one (the same shapes per GPU): prefill, decode with CUDA
graphs, time in collectives, and a model of the TP 8 step from them. The second runs full-size Scout over 4 GPUs
beside one TP-8 rank on one GPU (``--tp-prefill-length 0`` skips its prefill, ``--decode-contexts ''`` its decode
steps and the TP-8 rank; with a prefill the 16K step over 512K is left out, so that a prefill of millions of tokens
fits one run's time, and its progress goes to stderr each minute).

``--plot PATH`` (with ``--step-contexts``): a PNG of this run's step times with their fitted line, and the prefill
time the step model predicts by prompt length beside the measured prefills and the user's vLLM runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from hybridkv.bench.tables import markdown_table
from hybridkv.engine.llm_engine import EngineConfig, LLMEngine
from hybridkv.engine.sampling_params import SamplingParams
from hybridkv.engine.sequence import SequenceStatus
from hybridkv.kv.planner import PlanInputs, plan_capacity
from hybridkv.model.loading.checkpoint import LoadedModel
from hybridkv.model.architectures.llama_config import ModelConfig
from hybridkv.model.architectures.llama import LlamaForCausalLM
from hybridkv.model.loading.tokenizer import word_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's root, for benchmarks.plots
from benchmarks.plots import Panel, Series, save_plot  # noqa: E402

CONFIG = Path(__file__).resolve().parents[2] / "tests" / "data" / "scout-text-config.json"
STEP_TOKENS = 16384  # the engines' max_num_batched_tokens unless --step-tokens says otherwise (TP and full-model)


def rank_config(tp: int) -> dict:
    cfg = json.loads(CONFIG.read_text())
    cfg["num_attention_heads"] //= tp
    cfg["num_key_value_heads"] = max(1, cfg["num_key_value_heads"] // tp)
    cfg["intermediate_size"] //= tp
    cfg["intermediate_size_mlp"] //= tp
    cfg["vocab_size"] //= tp  # vocab-parallel embedding and LM head
    return cfg


def random_model(cfg: dict, device: str = "cuda") -> LlamaForCausalLM:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(ModelConfig.from_hf(cfg), dtype=torch.bfloat16)
    model = model.to_empty(device=device).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model.place(device)


# 64-token pages: a prefill key tile (64 keys) then lies in one page, one table entry per tile instead of one per
# key (16K-token step at 1M context on an H200: 441 TFLOP/s vs 400 with 16-token pages). --block-size changes it.
BLOCK_SIZE = 64


def engine_for(loaded: LoadedModel | None, kv_dtype: str, block_size: int = BLOCK_SIZE, **overrides) -> LLMEngine:
    """An engine with a ``kv_dtype`` cache as ``--kv-dtypes`` names it (``fp8_compute``: an fp8_e4m3 cache with FP8
    attention dots in prefill, ``EngineConfig.fp8_attention_compute``; ``kv_label`` names it back)."""
    fp8_compute = kv_dtype == "fp8_compute"
    config = EngineConfig(device="cuda", dtype="bfloat16", kv_cache_dtype="fp8_e4m3" if fp8_compute else kv_dtype,
                          block_size=block_size, max_num_batched_tokens=STEP_TOKENS, max_num_seqs=8,
                          enable_prefix_caching=False, gpu_memory_utilization=0.92, fp8_attention_compute=fp8_compute,
                          async_scheduling=False)  # steps timed one by one
    for key, value in overrides.items():
        setattr(config, key, value)
    return LLMEngine(config, loaded)


T = TypeVar("T")


def kv_label(engine: LLMEngine) -> str:
    """The KV dtype as ``--kv-dtypes`` names it: ``fp8_compute`` for an fp8_e4m3 cache with FP8 attention dots."""
    return "fp8_compute" if engine.config.fp8_attention_compute else engine.config.kv_cache_dtype


def on_dummy_engine(cfg: dict, tensor_parallel_size: int, run: Callable[[LLMEngine], T],
                    kv_dtype: str = "bfloat16", **overrides) -> T:
    """``run(engine)`` on ``engine_for`` a ``kv_dtype`` cache over the model of ``cfg`` (a config.json's contents),
    its random weights built on each rank's GPU (``load_format="dummy"``); then the engine shut down and its GPU
    memory given back (``run`` keeps no reference to it), so the next engine of the process finds it free.
    ``overrides``: other ``EngineConfig`` fields."""
    with tempfile.TemporaryDirectory() as path:
        Path(path, "config.json").write_text(json.dumps(cfg))
        engine = engine_for(None, kv_dtype, model=path, load_format="dummy",
                            tensor_parallel_size=tensor_parallel_size, **overrides)
        try:
            return run(engine)
        finally:
            engine.shutdown()
            del engine
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


def warm_up(engine: LLMEngine, vocab: int) -> None:
    """A prompt of a whole step and a part, then 2 decode steps, not reported: the kernels compiled and every
    allocation of a timed step's shapes made before it (the first 32K-token step at TP 2 took 1.8 s after a
    20,000-token warm-up, 0.33 s after this one)."""
    decode_after_prefill_ms(engine, engine.config.max_num_batched_tokens + 4096, vocab, steps=2)


def decode_after_prefill_ms(engine: LLMEngine, n: int, vocab: int, steps: int = 8) -> tuple[float, float]:
    """(prefill seconds, median decode step ms) of one request of ``n`` prompt tokens, its KV computed for real."""
    engine.add_request(f"real-{n}", prompt(n, vocab, n + 1), SamplingParams(
        temperature=0, max_tokens=steps + 3, ignore_eos=True))
    seq = engine._requests[f"real-{n}"].seqs[0]
    torch.cuda.synchronize()
    start = report = time.perf_counter()
    while seq.num_output_tokens == 0:
        engine.step()
        if time.perf_counter() - report > PROGRESS_S:  # a run cut short by a time limit still shows its rate
            report = time.perf_counter()
            print(f"  prefill: {seq.num_computed_tokens:,} of {n:,} tokens after {report - start:.0f} s",
                  file=sys.stderr, flush=True)
    torch.cuda.synchronize()
    prefill = time.perf_counter() - start
    engine.step()
    return prefill, median_step_ms(engine, steps)


PROGRESS_S = 60.0  # a long prefill reports how far it got this often (stderr)


def fill_random_cache(runner) -> None:
    """Every rank's KV cache filled with random values (``LLMEngine.collective_rpc`` runs it on each rank)."""
    fill_buffer(runner.backend.cache.buffer)


def peak_gib(runner) -> float:
    return torch.cuda.max_memory_allocated() / 2**30


def gpu_timeline(run) -> tuple[float, float, float, float]:
    """(ms in collective kernels, ms the GPU was busy, ms it waited, ms of kernels that ran beside another) on rank
    0's GPU while ``run()`` executes, from the first kernel to the last: waiting is the host's share of a step
    (scheduling, metadata, sending the step to the workers, sampling); a collective's time includes its wait for
    the slower rank. Collectives are NCCL's kernels, the one-shot all-reduce, the sums fused with the residual add
    and RMSNorm after them (``kernels/one_shot_norm.py``, their norms counted in) and the prefill halves' copies
    to the peers (copy engines, beside the kernels)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end, e.name.lower()) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    comm = sum(end - start for start, end, name in spans
               if any(k in name for k in ("nccl", "all_reduce", "one_shot", "pushed_add_norm", "ptop")))
    busy, reach = 0.0, spans[0][0]
    for start, end, _ in spans:  # the union of the kernels' intervals (overlapping across streams)
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    beside = sum(end - start for start, end, _ in spans) - busy
    return comm / 1000, busy / 1000, (reach - spans[0][0] - busy) / 1000, beside / 1000


def host_phases(engine: LLMEngine, steps: int) -> str:
    """Rank 0's host time a step by phase over ``steps`` decode steps, ms (no sync inside a step: "sample" holds
    the wait for the GPU). Each phase's method is wrapped on its instance for the measurement, then unwrapped."""
    from collections import defaultdict

    spent: dict[str, float] = defaultdict(float)
    wrapped = []

    def timed(obj, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - start

        setattr(obj, name, wrapper)
        wrapped.append((obj, name))

    runner = engine.runner
    timed(engine, "schedule", "schedule")
    timed(runner, "prepare", "prepare")
    timed(runner.graphs, "replay", "replay")
    timed(runner.backend, "begin_static_decode", "of which metadata")
    for graph in runner.graphs.graphs.values():
        timed(graph, "replay", "of which graph launch")
    timed(engine, "_sample", "sample")
    for conn in getattr(engine.workers, "conns", []):
        timed(conn, "send", "send")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    for obj, name in wrapped:
        delattr(obj, name)
    parts = ", ".join(f"{label} {1000 * t / steps:.3f}" for label, t in spent.items())
    return f"step {1000 * total / steps:.3f}: {parts}"


def set_prefill_halves(runner, tokens: int) -> None:
    """Steps of ``tokens`` or more run in two overlapped halves on this rank (0: none); ``collective_rpc`` sets
    every rank alike."""
    runner.halves_from_tokens = tokens


TP_DECODE_MESSAGES = 97  # a Scout decode step's all-reduces: 2 per layer and the embedding's


def tensor_parallel_rows(size: int, n: int, contexts: list[int], step_tokens: int = STEP_TOKENS) -> list[list[str]]:
    """Scout with the shapes of one TP-(8/size) rank, split over ``size`` GPUs by real tensor parallelism: each GPU
    holds what one GPU holds in the single-GPU run, plus the all-reduces. Weights: load_format=dummy. Then a model
    of the TP 8 step from the measured communication. Both engines take steps of ``step_tokens``."""
    rows, measured = [], {}
    for tp in (1, size):
        cfg = rank_config(8 // tp)
        label = f"TP {tp} (Scout/{8 // tp} over {tp} GPU{'s' if tp > 1 else ''})"
        rows += on_dummy_engine(cfg, tp, lambda engine: engine_rows(engine, label, cfg["vocab_size"], n, contexts,
                                                                    measured.setdefault(tp, {})),
                                max_num_batched_tokens=step_tokens)
    return rows + tp8_model_rows(size, measured)


def engine_rows(engine: LLMEngine, label: str, vocab: int, n: int, contexts: list[int], out: dict,
                prefill_step: bool = True) -> list[list[str]]:
    """Prefill of ``n`` tokens and the decode step after it; one whole prefill step over 524,288 cached
    tokens (tensor parallelism: its layers whole and in two halves; not with ``prefill_step`` off); decode steps at
    ``contexts`` over random KV (CUDA graphs) with rank 0's host time by phase, then with async scheduling; peak
    memory per GPU. Times go into ``out`` too.

    Then, tensor-parallel engines only, profiles: the time in collectives of the prefill step and of decode steps.
    Profiles come last: once torch's profiler has run in a process, every later CUDA launch there costs more host
    time (a decode graph's launch went from 0.04 to 0.6 ms), so a number timed after one would read high."""
    rows, kv = [], kv_label(engine)
    warm_up(engine, vocab)
    if n:
        seconds, ms = decode_after_prefill_ms(engine, n, vocab)
        out["prefill"] = seconds
        rows.append([kv, f"{label}: prefill {n:,} (cold)", f"{seconds:.1f} s", f"{n / seconds:,.0f} tok/s"])
        rows.append([kv, f"{label}: decode step after it (graphs)", f"{ms:.2f} ms", ""])
        print(rows[-2], rows[-1], flush=True)
    if prefill_step or contexts:
        engine.collective_rpc(fill_random_cache)
    step_fits = prefill_step and engine.config.max_num_batched_tokens + (1 << 19) <= engine.max_model_len
    if step_fits:
        rows += prefill_step_rows(engine, label, vocab)
    fitting = [ctx for ctx in contexts if ctx <= engine.max_model_len]
    rows += [[kv, f"{label}: decode step @ {ctx:,}", "does not fit", ""] for ctx in contexts
             if ctx not in fitting]
    for ctx in fitting:
        ms = out[ctx] = decode_ms(engine, ctx, vocab, drain=False)
        rows.append([kv, f"{label}: decode step @ {ctx:,} (random KV, graphs)", f"{ms:.2f} ms", ""])
        rows.append([kv, f"{label}: decode step @ {ctx:,}, rank 0's host by phase, ms", "",
                     host_phases(engine, 5)])
        print(rows[-2], rows[-1], flush=True)
        while engine.has_unfinished_requests():
            engine.step()
        ms = out[("async", ctx)] = async_steps_ms(engine, lambda: start_decode(engine, ctx, vocab, 20), 8)
        rows.append([kv, f"{label}: decode step @ {ctx:,}, async scheduling (graphs)", f"{ms:.2f} ms", ""])
        print(rows[-1], flush=True)
    peaks = engine.collective_rpc(peak_gib)
    rows.append([kv, f"{label}: peak GPU memory per rank", " / ".join(f"{p:.1f}" for p in peaks) + " GiB", ""])
    if engine.workers is None:
        return rows
    if step_fits:
        for tokens, how in ((0, "layers whole"), (engine.config.prefill_overlap_tokens, "two halves")):
            engine.collective_rpc(set_prefill_halves, tokens)
            comm, busy, _, beside = gpu_timeline(lambda: step_seconds(engine, 1 << 19, vocab))
            out.setdefault("prefill_comm_share", comm / busy)
            rows.append([kv, f"{label}: prefill step over 524,288, {how}: collectives (profiled)",
                         f"{comm:.1f} of {busy:.1f} ms busy", f"{100 * comm / busy:.1f}%; kernels beside another "
                         f"{beside:.1f} ms"])
    for ctx in fitting:
        decode_ms(engine, ctx, vocab, steps=1, drain=False)
        comm, busy, idle, _ = gpu_timeline(lambda: median_step_ms(engine, 5, drain=False))
        while engine.has_unfinished_requests():
            engine.step()
        out.setdefault("decode_comm", {})[ctx] = comm / 5
        rows.append([kv, f"{label}: decode step @ {ctx:,}: GPU a step (profiled)",
                     f"busy {busy / 5:.2f} ms", f"collectives {comm / 5:.2f} ms; waiting {idle / 5:.2f} ms"])
    return rows


def prefill_step_rows(engine: LLMEngine, label: str, vocab: int) -> list[list[str]]:
    """A whole prefill step over 524,288 cached tokens, best wall time of 2; under tensor parallelism
    with its layers whole (all-reduces waited for) and in two overlapped halves (``prefill_overlap_tokens``)."""
    rows, halves, kv = [], engine.config.prefill_overlap_tokens, kv_label(engine)
    ways = [(halves, "")] if engine.workers is None else [(0, ", layers whole"), (halves, ", two halves")]
    for tokens, how in ways:
        engine.collective_rpc(set_prefill_halves, tokens)
        best = min(step_seconds(engine, 1 << 19, vocab) for _ in range(2))
        rows.append([kv, f"{label}: {engine.config.max_num_batched_tokens:,}-token prefill step over 524,288{how}",
                     f"{1000 * best:.1f} ms", ""])
        print(rows[-1], flush=True)
    return rows


def tp8_model_rows(size: int, measured: dict) -> list[list[str]]:
    """The TP 8 step, modelled: one rank's work (the TP 1 run: Scout/8 on one GPU) plus TP ``size``'s measured
    collectives, decode's per message and prefill's share scaled by a ring's traffic per GPU, 2 (N - 1) / N."""
    one, many = measured[1], measured[size]
    rows = []
    for ctx, comm in many.get("decode_comm", {}).items():
        if ctx in one:
            per = comm / TP_DECODE_MESSAGES
            rows.append(["bfloat16", f"TP 8 model: decode step @ {ctx:,}", f"{one[ctx] + comm:.2f} ms",
                         f"rank step {one[ctx]:.2f} + {TP_DECODE_MESSAGES} x {1000 * per:.1f} us (TP {size}'s "
                         "latency; 8 GPUs not measured)"])
    if "prefill" in one and "prefill_comm_share" in many:
        ring = (2 * 7 / 8) / (2 * (size - 1) / size)
        share = many["prefill_comm_share"] * ring
        rows.append(["bfloat16", "TP 8 model: prefill (collectives not overlapped)",
                     f"{one['prefill'] / (1 - share):.1f} s",
                     f"rank prefill {one['prefill']:.1f} s / (1 - {100 * share:.1f}% collectives: TP {size}'s share "
                     f"x {ring:.2f} ring traffic)"])
    return rows


def full_model_rows(size: int, n: int, contexts: list[int], kv_dtype: str = "bfloat16",
                    step_tokens: int = STEP_TOKENS, quantization: str = "none") -> list[list[str]]:
    """Full-size Scout (dummy weights, in ``quantization``'s format) over ``size`` GPUs with a ``kv_dtype`` cache:
    plan vs engine max_model_len, the prefill of ``n`` tokens in steps of ``step_tokens``, decode steps at
    ``contexts`` with graphs, peak memory per GPU; under tensor parallelism beside one TP-8 rank's decode steps on
    one GPU (the same build and cache), which each GPU does twice over at TP 4."""
    rows, rank = [], {}
    cfg = rank_config(8)
    if contexts and size > 1:  # without decode contexts (``--decode-contexts ''``) only the full model runs
        rows += on_dummy_engine(cfg, 1, lambda engine: engine_rows(engine, "one TP-8 rank (Scout/8, 1 GPU)",
                                                                   cfg["vocab_size"], 0, contexts, rank), kv_dtype,
                                max_num_batched_tokens=step_tokens)
    full = json.loads(CONFIG.read_text())

    def full_rows(engine: LLMEngine) -> list[list[str]]:
        kv_bytes = engine.kv.pool.num_blocks * engine.layout.page_bytes
        plan = plan_capacity(full, PlanInputs(tensor_parallel_size=size, kv_cache_dtype=engine.config.kv_cache_dtype,
                                              block_size=BLOCK_SIZE, kv_memory_bytes=kv_bytes,
                                              max_num_batched_tokens=engine.config.max_num_batched_tokens,
                                              quantization=quantization))
        label = f"Scout, TP {size}" + (f", {quantization} weights" if quantization != "none" else "")
        out = [[kv_dtype, f"{label}: max_model_len plan / engine", f"{plan.max_model_len:,} / "
                f"{engine.max_model_len:,}", f"KV {kv_bytes / 2**30:.2f} GiB per GPU"]]
        measured = {}
        # a measured prefill of millions of tokens runs alone, to fit one command's time
        out += engine_rows(engine, label, full["vocab_size"], n, contexts, measured, prefill_step=not n)
        for ctx in contexts:
            if ctx in measured and ctx in rank:
                out.append([kv_dtype, f"{label}: decode @ {ctx:,} vs 2 x rank step + 1 ms",
                            f"{measured[ctx]:.2f} vs {2 * rank[ctx] + 1:.2f} ms", ""])
        if n == VLLM_FULL_PREFILL[0] and "prefill" in measured:
            vllm_s, vllm_gpus = VLLM_FULL_PREFILL[1:]
            out.append([kv_dtype, f"{label}: GPU-seconds for {n:,} tokens vs the user's vLLM (bf16 KV)",
                        f"{size * measured['prefill']:,.0f} vs {vllm_gpus * vllm_s:,.0f}",
                        f"vLLM {vllm_s} s on {vllm_gpus} GPUs"])
        return out

    return rows + on_dummy_engine(full, size, full_rows, kv_dtype, max_num_batched_tokens=step_tokens,
                                  quantization=quantization)


# the user's vLLM run on 8xH200 the full-size rows compare with: prompt tokens, wall s, GPUs
VLLM_FULL_PREFILL = (2845646, 334.9, 8)


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=g).tolist()


def prefill_seconds(engine: LLMEngine, n: int, vocab: int) -> float:
    engine.add_request(f"prefill-{n}", prompt(n, vocab, n), SamplingParams(temperature=0, max_tokens=1))
    torch.cuda.synchronize()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    torch.cuda.synchronize()
    return time.perf_counter() - start


# Slots are allocated this many tokens at a time when a context is faked: a chunked layer's blocks are only freed
# once the tokens are marked computed, so a piece holds a piece's worth of blocks in every chunked group (at 1M
# pieces, full-size Scout at TP 4 ran out of blocks at 5M of its 6.17M).
SLOT_PIECE = 1 << 17


def fill_random(engine: LLMEngine) -> None:
    """Random K/V everywhere (not zeros: timing on zeros can flatter)."""
    fill_buffer(engine.backend.cache.buffer)


def fill_buffer(buf: torch.Tensor) -> None:
    # a bounded draw at a time: full-size Scout on one GPU leaves well under a GiB free beside its cache
    rows_per_draw = max(1, (256 << 20) // (buf.shape[1] * 2))
    for rows in torch.split(torch.arange(buf.shape[0], device=buf.device), rows_per_draw):
        chunk = torch.randn(len(rows), buf.shape[1], device=buf.device, dtype=torch.bfloat16)
        buf[rows] = chunk.to(buf.dtype)


def decode_ms(engine: LLMEngine, context: int, vocab: int, steps: int = 8, drain: bool = True) -> float:
    """Decode latency with ``context`` tokens already in a cache filled with random values."""
    start_decode(engine, context, vocab, steps + 2 + (0 if drain else 10))
    return median_step_ms(engine, steps, drain)


def start_decode(engine: LLMEngine, context: int, vocab: int, max_tokens: int) -> None:
    """One request decoding after ``context`` tokens whose KV is the cache's random values: two steps taken."""
    engine.add_request(f"decode-{context}", prompt(context, vocab, 7), SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True))
    seq = engine.scheduler.waiting.popleft()
    # slots for all but the last prompt token, a piece at a time so chunked layers drop what left their chunk; the
    # KV of these tokens "exists" as the random values filled in before, it is not computed
    piece = SLOT_PIECE
    while seq.num_computed_tokens < context - 1:
        n = min(piece, context - 1 - seq.num_computed_tokens)
        assert engine.kv.allocate_slots(seq, n)
        seq.num_computed_tokens += n
        engine.kv.on_tokens_computed(seq)
    seq.status = SequenceStatus.RUNNING
    engine.scheduler.running.append(seq)
    engine.step()  # the last prompt token, then decodes
    engine.step()


def async_steps_ms(engine: LLMEngine, start: Callable[[], object], steps: int) -> float:
    """Mean ms of ``steps`` engine steps back to back with async scheduling on (under tensor parallelism too),
    after ``start()`` set decoding going with tokens to spare; checked to have launched every one ahead."""
    engine.config.async_scheduling = True
    try:
        start()
        ahead = engine.steps_launched_ahead
        ms = median_step_ms(engine, steps, back_to_back=True)
    finally:
        engine.config.async_scheduling = False
    if engine.steps_launched_ahead - ahead < steps:
        raise RuntimeError(f"async scheduling launched {engine.steps_launched_ahead - ahead} steps ahead of {steps}")
    return ms


# A user's vLLM on 8xH200 (docs/benchmarks.md#scout-rank): prompt tokens, wall s, KV dtype, prefix-cache hit
VLLM_PREFILLS = [(2065427, 69.35, "bfloat16", 0.3), (2845646, 334.9, "bfloat16", 0.0), (4908091, 957.1, "bfloat16", 0.0),
                 (9811859, 2964.4, "fp8_e4m3", 0.0)]


def step_seconds(engine: LLMEngine, context: int, vocab: int) -> float:
    """Wall time of one engine step prefilling a whole step's new tokens (``max_num_batched_tokens``) over
    ``context`` cached ones (the cache FILLED WITH RANDOM VALUES up to the context, as for decode), the first token
    sampled included."""
    tokens = engine.config.max_num_batched_tokens
    engine.add_request(f"step-{context}", prompt(context + tokens, vocab, 11), SamplingParams(
        temperature=0, max_tokens=1))
    if context:
        seq = engine.scheduler.waiting.popleft()
        piece = SLOT_PIECE
        while seq.num_computed_tokens < context:
            n = min(piece, context - seq.num_computed_tokens)
            assert engine.kv.allocate_slots(seq, n)
            seq.num_computed_tokens += n
            engine.kv.on_tokens_computed(seq)
        seq.status = SequenceStatus.RUNNING
        engine.scheduler.running.append(seq)
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return seconds


def fit_step_cost(contexts: list[int], seconds: list[float]) -> tuple[float, float]:
    """Least-squares ``cost(c) = a + b * c``: the full layers' attention grows linearly with the context a step
    reads, everything else (chunked layers, MoE, norms, sampling) is the same at every step."""
    import numpy as np

    b, a = np.polyfit(np.array(contexts, dtype=float), np.array(seconds), 1)
    return float(a), float(b)


def predicted_prefill(a: float, b: float, n: int, hit: float = 0.0) -> float:
    """Sum of the fitted step costs over a prompt of ``n`` tokens prefilled in STEP_TOKENS steps, the first
    ``hit`` fraction already cached; a short last step costs its share of a full one."""
    total, c = 0.0, int(n * hit)
    while c < n:
        tokens = min(STEP_TOKENS, n - c)
        total += (a + b * c) * tokens / STEP_TOKENS
        c += tokens
    return total


def step_model_rows(kv_dtype: str, contexts: list[int], seconds: list[float],
                    measured: dict[int, float]) -> list[list[str]]:
    a, b = fit_step_cost(contexts, seconds)
    rows = [[kv_dtype, f"step model: {STEP_TOKENS:,}-token step = {a * 1000:.0f} ms + {b * 1e9:.2f} ms per 1M "
             "context tokens", "", "fit residuals " + ", ".join(
                 f"{100 * ((a + b * c) / t - 1):+.1f}%" for c, t in zip(contexts, seconds))]]
    for n, vllm_s, vllm_dtype, hit in VLLM_PREFILLS:
        for h in sorted({0.0, hit}):
            pred = predicted_prefill(a, b, n, h)
            note = f"vLLM 8xH200 ({vllm_dtype}{f', {hit:.0%} prefix hit' if hit else ''}): {vllm_s:,} s"
            if h == hit:
                note += f", ours / vLLM {pred / vllm_s:.2f}"
            if n in measured and h == 0.0:
                note += f"; measured {measured[n]:.1f} s, model / measured {pred / measured[n]:.3f}"
            label = f"predicted prefill {n:,} tokens" + (f" ({h:.0%} prefix hit)" if h else " (cold)")
            rows.append([kv_dtype, label, f"{pred:.1f} s", note])
    return rows


def plot_panels(steps: dict[str, tuple[list[int], list[float]]], measured: dict[str, dict[int, float]]) -> list[Panel]:
    """``steps[kv_dtype]``: the contexts and seconds of the timed steps; ``measured[kv_dtype]``: prompt tokens ->
    seconds of the cold prefills that ran. Left: the step times and their fitted line; right: the prefill time the
    model predicts for a cold prompt of each length, the measured prefills, and vLLM's cold runs."""
    step_series, prefill_series = [], []
    longest = max([n for n, *_ in VLLM_PREFILLS] + [n for m in measured.values() for n in m])
    lengths = [longest * i // 40 for i in range(1, 41)]
    for kv_dtype, (contexts, seconds) in steps.items():
        a, b = fit_step_cost(contexts, seconds)
        step_series += [Series(f"{kv_dtype}, timed", list(zip(contexts, seconds)), "o"),
                        Series(f"{kv_dtype}, fit {a * 1000:.0f} ms + {b * 1e9:.0f} ms per 1M",
                               [(c, a + b * c) for c in (0, max(contexts))], "-")]
        model = [(n, predicted_prefill(a, b, n)) for n in lengths]
        prefill_series.append(Series(f"{kv_dtype}, step model", model, "-"))
    for kv_dtype, runs in measured.items():
        prefill_series.append(Series(f"{kv_dtype}, measured", sorted(runs.items()), "o"))
    for vllm_dtype in dict.fromkeys(d for *_, d, _ in VLLM_PREFILLS):
        prefill_series.append(Series(f"vLLM 8xH200 ({vllm_dtype} KV)", [
            (n, s) for n, s, d, hit in VLLM_PREFILLS if d == vllm_dtype and hit == 0.0], "*"))
    return [Panel(f"one {STEP_TOKENS:,}-token prefill step", "context tokens cached before the step", "seconds",
                  step_series),
            Panel("prefill of one cold prompt (one rank, no all-reduces)", "prompt tokens", "seconds",
                  prefill_series)]


def median_step_ms(engine: LLMEngine, steps: int, drain: bool = True, back_to_back: bool = False) -> float:
    """Median wall time of the next ``steps`` engine steps; then runs the engine dry (``drain``).
    ``back_to_back`` (async scheduling, whose step returns with the next one running): their mean, the GPU
    waited for only at the ends."""
    if back_to_back:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        ms = 1000 * (time.perf_counter() - start) / steps
        while drain and engine.has_unfinished_requests():
            engine.step()
        return ms
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    while drain and engine.has_unfinished_requests():
        engine.step()
    return 1000 * sorted(times)[len(times) // 2]


class ModelEngines:
    """Engines over the model of ``cfg`` (a config.json's contents): its seeded bf16 weights built once and shared
    (``quantization`` "none" and ``shared``), or random weights in ``quantization``'s format that each engine builds
    itself (``load_format="dummy"``)."""

    def __init__(self, cfg: dict, quantization: str, block_size: int = BLOCK_SIZE, shared: bool = True) -> None:
        self.cfg, self.quantization, self.block_size = cfg, quantization, block_size
        self.loaded = None
        if quantization == "none" and shared:
            self.loaded = LoadedModel("scout-rank (random weights)", random_model(cfg), word_tokenizer(cfg["vocab_size"]),
                                      cfg)
        self.dir = tempfile.mkdtemp()
        Path(self.dir, "config.json").write_text(json.dumps(cfg))

    def build(self, kv_dtype: str, **overrides) -> LLMEngine:
        if self.loaded is not None:
            return engine_for(self.loaded, kv_dtype, self.block_size, **overrides)
        return engine_for(None, kv_dtype, self.block_size, model=self.dir, load_format="dummy",
                          quantization=self.quantization, **overrides)


RANK_COLUMNS = ["weights", "KV dtype", "measure", "value", "note"]


def rank_rows(args: argparse.Namespace, quantization: str, steps: dict, measured_by_dtype: dict) -> list[list[str]]:
    """One TP-8 rank with weights in ``quantization``'s format: its rows for each of ``--kv-dtypes`` (capacity,
    prefill, step model, decode, peak memory); the step model's points go into ``steps`` and the measured prefills
    into ``measured_by_dtype``, by the label the plot draws."""
    cfg = rank_config(8)
    rank = ModelEngines(cfg, quantization, args.block_size)
    rows = []
    for kv_dtype in (args.kv_dtypes or "bfloat16,fp8_e4m3").split(","):
        engine = rank.build(kv_dtype)
        kv_bytes = engine.kv.pool.num_blocks * engine.layout.page_bytes
        full = json.loads(CONFIG.read_text())
        plan = plan_capacity(full, PlanInputs(tensor_parallel_size=8, kv_cache_dtype=engine.config.kv_cache_dtype,
                                              block_size=args.block_size, kv_memory_bytes=kv_bytes,
                                              max_num_batched_tokens=engine.config.max_num_batched_tokens,
                                              quantization=quantization))
        weights_gib = sum(p.numel() * p.element_size() for p in engine.model.parameters()) / 2**30
        capped = "engine capped by max_position_embeddings" if engine.max_model_len < plan.max_model_len else ""
        rows += [[quantization, kv_dtype, "KV memory allocated", f"{kv_bytes / 2**30:.2f} GiB",
                  f"weights {weights_gib:.2f} GiB"],
                 [quantization, kv_dtype, "max_model_len plan / engine",
                  f"{plan.max_model_len:,} / {engine.max_model_len:,}", capped]]
        label = kv_dtype if quantization == "none" else f"{kv_dtype}, {quantization} weights"
        measured = measured_by_dtype[label] = {}
        if args.prefill_lengths:
            prefill_seconds(engine, 20000, cfg["vocab_size"])  # compiles the kernels; not reported
            for n in (int(x) for x in args.prefill_lengths.split(",") if x):
                s = measured[n] = prefill_seconds(engine, n, cfg["vocab_size"])
                rows.append([quantization, kv_dtype, f"prefill {n:,} tokens (cold)", f"{s:.1f} s",
                             f"{n / s:,.0f} tok/s"])
                print(rows[-1], flush=True)
        fill_random(engine)
        if args.step_contexts:
            contexts = [int(x) for x in args.step_contexts.split(",") if x]
            step_seconds(engine, 0, cfg["vocab_size"])  # compiles the kernels; not reported
            seconds = []
            for ctx in contexts:
                times = [step_seconds(engine, ctx, cfg["vocab_size"]) for _ in range(2)]
                seconds.append(min(times))
                runs = ", ".join(f"{1000 * t:.0f}" for t in times)
                rows.append([quantization, kv_dtype, f"{STEP_TOKENS:,}-token prefill step over {ctx:,} (random KV)",
                             f"{1000 * min(times):.0f} ms", f"2 runs: {runs} ms"])
                print(rows[-1], flush=True)
            rows += [[quantization, *row] for row in step_model_rows(kv_dtype, contexts, seconds, measured)]
            steps[label] = (contexts, seconds)
        for ctx in (int(x) for x in args.decode_contexts.split(",") if x):
            if ctx > engine.max_model_len:
                rows.append([quantization, kv_dtype, f"decode step @ {ctx:,}", "does not fit", ""])
                continue
            ms = decode_ms(engine, ctx, cfg["vocab_size"])
            rows.append([quantization, kv_dtype, f"decode step @ {ctx:,} (random KV)", f"{ms:.1f} ms", ""])
            print(rows[-1], flush=True)
        peak_gib = torch.cuda.max_memory_allocated() / 2**30
        rows.append([quantization, kv_dtype, "peak GPU memory", f"{peak_gib:.1f} GiB", ""])
        del engine
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    del rank
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="1: one TP-8 rank on one GPU; 2, 4, 8: real TP over that many GPUs, each holding a "
                         "TP-(8/N) rank, beside TP 1 holding the same per GPU")
    ap.add_argument("--full-model", action="store_true",
                    help="with --tensor-parallel-size N: full-size Scout over N GPUs (--tp-prefill-length tokens, "
                         "decode at --decode-contexts), beside one TP-8 rank's decode on one GPU")
    ap.add_argument("--prefill-lengths", default="1048576")
    ap.add_argument("--decode-contexts", default="1048576,5242880,10000000")
    ap.add_argument("--kv-dtypes", default=None,
                    help="bfloat16, fp8_e4m3 and/or fp8_compute (an fp8_e4m3 cache with FP8 attention dots); "
                         "default bfloat16,fp8_e4m3 (one rank) or bfloat16 (--full-model)")
    ap.add_argument("--tp-prefill-length", type=int, default=1048576)
    ap.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    ap.add_argument("--step-tokens", type=int, default=STEP_TOKENS,
                    help="max_num_batched_tokens of the engines --tensor-parallel-size 2+ and --full-model compare")
    ap.add_argument("--step-contexts", default="",
                    help="time one 16,384-token prefill step at each context (random KV), fit cost(context) and "
                         "predict vLLM's prompt lengths, e.g. 0,1048576,2097152,4194304,8388608,9800000")
    ap.add_argument("--plot", metavar="PATH", help="with --step-contexts: draw the step model of this run into a PNG")
    ap.add_argument("--quantization", default="none",
                    help="weights in this format (none, fp8, int4): random ones the engine builds "
                         "(load_format=dummy); one rank takes a list, e.g. fp8,none, and runs each in turn")
    args = ap.parse_args()
    quantizations = args.quantization.split(",")
    if unknown := set(quantizations) - {"none", "fp8", "int4"}:
        ap.error(f"--quantization: {', '.join(sorted(unknown))} is not one of none, fp8, int4")
    if len(quantizations) > 1 and (args.full_model or args.tensor_parallel_size > 1):
        ap.error("--quantization takes a list for one rank only (not with --full-model or --tensor-parallel-size)")
    contexts = [int(x) for x in args.decode_contexts.split(",") if x]
    if args.full_model:
        rows = [row for kv_dtype in (args.kv_dtypes or "bfloat16").split(",")
                for row in full_model_rows(args.tensor_parallel_size, args.tp_prefill_length, contexts, kv_dtype,
                                           args.step_tokens, args.quantization)]
        print_table(rows, f"full-size Llama-4-Scout over {args.tensor_parallel_size} GPUs, block {BLOCK_SIZE}",
                    args.step_tokens)
        return
    if args.tensor_parallel_size in (2, 4, 8):
        rows = tensor_parallel_rows(args.tensor_parallel_size, args.tp_prefill_length, contexts, args.step_tokens)
        print_table(rows, f"Llama-4-Scout, tensor parallelism {args.tensor_parallel_size} vs 1, block {BLOCK_SIZE}",
                    args.step_tokens)
        return
    rows = []
    steps: dict[str, tuple[list[int], list[float]]] = {}
    measured_by_dtype: dict[str, dict[int, float]] = {}
    for quantization in quantizations:
        rows += rank_rows(args, quantization, steps, measured_by_dtype)
    print_table(rows, f"Llama-4-Scout rank shapes at TP 8, block {args.block_size}", columns=RANK_COLUMNS)
    if args.plot and not steps:
        print("--plot: nothing drawn, the step model needs --step-contexts")
    elif args.plot:
        save_plot(args.plot, plot_panels(steps, measured_by_dtype),
                  f"{torch.cuda.get_device_name()}: one Llama-4-Scout rank (TP 8 shapes), "
                  f"{args.block_size}-token pages")
        print(f"plot: {args.plot}")


def print_table(rows: list[list[str]], title: str, step_tokens: int = STEP_TOKENS,
                columns: list[str] | None = None) -> None:
    print(f"\n{torch.cuda.get_device_name()} x {torch.cuda.device_count()}: {title} "
          f"(48 layers, 12 full + 36 chunked(8192), 16 experts), batch 1, steps of {step_tokens:,} tokens")
    print(markdown_table(columns or ["KV dtype", "measure", "value", "note"], rows))


if __name__ == "__main__":
    main()
