"""Host time of one decode step through the whole engine, phase by phase, on the CPU (no GPU needed).

The model is Llama-4-Scout's layer pattern at toy width (4 layers: 3 chunked of 8,192 tokens and 1 full, so the
KV layout has Scout's 4 layer groups; hidden 64, vocabulary 512), so its forward is small and what is left is the
host's work around it: the part of a GPU decode step during which the GPU waits. ``--layout full`` makes every
layer full attention (one layer group, as SmolLM2 or a dense Llama). Each batch of ``--batches`` starts that many
greedy requests at ``--context`` tokens each (their KV "exists": slots are allocated, not computed, as
``benchmarks/gpu/decode.py`` does), then times ``--steps`` decode steps. ``--final-only`` asks for the final output
only, as ``LLM.generate`` does (the default: an output every step, as the server's requests);
``--no-prefix-caching`` turns the prefix cache off. Per step, in microseconds:

- schedule: ``Scheduler.schedule`` and ``on_step_done`` (block allocation, prefix-cache hashing of full blocks);
- prepare: ``ModelRunner.prepare`` (the step's token ids and per-sequence block tables);
- execute: ``ModelRunner.execute`` minus the model's forward and LM head and minus the CPU attention backend's
  metadata (``TorchPagedAttention.begin_step``, a CPU-only cost shown apart as ``cpu attn meta``);
- static decode meta: ``TritonPagedAttention.begin_static_decode`` of the same step on a CPU-built Triton backend:
  what a CUDA-graph replay (``DecodeGraphs.replay``) does on the host instead of ``begin_step``;
- sample: the ``Sampler`` call;
- output: everything else of ``LLMEngine.step`` (appending tokens, stop checks, detokenising, request outputs);
- deferred text: detokenising the tokens of requests whose text is read only at their end (``--final-only``), done
  between the step's launch and the sampler's wait for the logits: on a GPU, while the GPU computes.

``host`` is schedule + prepare + execute + static decode meta + sample + output: the GPU path's host time per step
that the GPU waits for (deferred text aside).
Each number is the mean over the timed steps, the least of ``--rounds`` rounds (a shared machine only adds time).

    python benchmarks/engine_host.py [--batches 1,8,32] [--context 16384] [--steps 64] [--rounds 5]
        [--layout scout|full] [--final-only] [--no-prefix-caching] [--vocab 202048] [--temperature 0.8]

``benchmarks/gpu/serve_smollm2.py``'s decode steps (256 requests of 512 prompt tokens, ``LLM.generate``, no prefix
cache) on the host::

    python benchmarks/engine_host.py --batches 1,32,256 --context 512 --layout full --final-only --no-prefix-caching
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from hybridkv.bench.tables import markdown_table
from hybridkv.engine.llm_engine import EngineConfig, LLMEngine
from hybridkv.engine.sampling_params import RequestOutputKind, SamplingParams
from hybridkv.engine.sequence import SequenceStatus
from hybridkv.model.architectures.llama import LlamaForCausalLM
from hybridkv.model.architectures.llama_config import ModelConfig
from hybridkv.model.loading.checkpoint import LoadedModel
from hybridkv.model.loading.tokenizer import word_tokenizer

CONFIG = Path(__file__).resolve().parent.parent / "tests" / "data" / "scout-text-config.json"
VOCAB = 512
BLOCK = 16
PHASES = ["schedule", "prepare", "execute", "static decode meta", "sample", "output"]


def tiny_scout(layout: str = "scout", vocab: int = VOCAB) -> dict:
    """Scout's layer pattern at toy width; ``layout="full"``: the same layers, every one full attention."""
    cfg = json.loads(CONFIG.read_text())
    cfg.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=16, intermediate_size=32,
               intermediate_size_mlp=64, num_hidden_layers=4, num_local_experts=2, moe_layers=[],
               no_rope_layers=[1, 1, 1, 0], vocab_size=vocab, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    if layout == "full":
        cfg.update(attention_chunk_size=None, no_rope_layers=[1, 1, 1, 1])
    return cfg


def build_engine(max_seqs: int, max_model_len: int, layout: str = "scout",
                 prefix_caching: bool = True, vocab: int = VOCAB) -> LLMEngine:
    cfg = tiny_scout(layout, vocab)
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.from_hf(cfg), dtype=torch.float32).eval()
    loaded = LoadedModel(f"tiny-{layout}", model, word_tokenizer(vocab), cfg)
    config = EngineConfig(device="cpu", block_size=BLOCK, max_num_seqs=max_seqs, max_model_len=max_model_len,
                          kv_cache_memory_bytes=max_seqs * (max_model_len + 64) * 4 * 2 * 16 * 4, cpu_threads=1,
                          enable_prefix_caching=prefix_caching)
    return LLMEngine(config, loaded)


def static_backend(engine: LLMEngine, max_seqs: int):
    """The Triton backend's decode buffers over the engine's layout, on the CPU (metadata only, nothing launched)."""
    from hybridkv.model.attention.triton_paged import TritonPagedAttention

    backend = TritonPagedAttention(engine.layout, 2, "float32", engine.model.cfg.num_heads, device="cpu")
    backend.enable_static_decode(max_seqs, engine.max_model_len)
    return backend


class PhaseClock:
    """Wraps the engine's methods on its instances with timers; ``totals`` holds seconds per phase."""

    def __init__(self, engine: LLMEngine, triton) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.triton = triton
        sched, runner = engine.scheduler, engine.runner
        self._wrap(sched, "schedule", "schedule")
        self._wrap(sched, "on_step_done", "schedule")
        self._wrap(runner, "prepare", "prepare", after=self._static_meta)
        self._wrap(runner, "execute", "execute")
        self._wrap(engine.model, "forward", "forward")
        self._wrap(engine.model, "compute_logits", "forward")
        self._wrap(engine.backend, "begin_step", "cpu attn meta")
        from hybridkv.engine import llm_engine  # deferred text is a module function there: timed for this process

        self._wrap(llm_engine, "_catch_up_text", "text")
        sampler = engine.sampler
        engine.sampler = self._timed(sampler, "sample")
        engine.sampler.argmax = self._timed(sampler.argmax, "sample")  # the all-greedy step's

    def _timed(self, fn, phase: str, after=None):
        def run(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.totals[phase] += time.perf_counter() - start
            if after is not None:
                after(out)
            return out

        return run

    def _wrap(self, obj, name: str, phase: str, after=None) -> None:
        setattr(obj, name, self._timed(getattr(obj, name), phase, after))

    def _static_meta(self, step) -> None:
        seqs = step.seqs
        if seqs and all(s.query_len == 1 for s in seqs):
            padded = 1 << (len(seqs) - 1).bit_length()
            start = time.perf_counter()
            self.triton.begin_static_decode(seqs, padded, step.input_ids)
            self.totals["static decode meta"] += time.perf_counter() - start


def start_decoding(engine: LLMEngine, batch: int, context: int, steps: int, final_only: bool = False,
                   temperature: float = 0.0) -> None:
    """``batch`` requests (greedy, or sampled at ``temperature``) with ``context`` tokens of KV allocated (not
    computed), then their first steps."""
    g = torch.Generator().manual_seed(batch)
    kind = RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.CUMULATIVE
    params = SamplingParams(temperature=temperature, max_tokens=steps, ignore_eos=True, output_kind=kind)
    for b in range(batch):
        ids = torch.randint(3, engine.model.cfg.vocab_size, (context,), generator=g).tolist()
        engine.add_request(f"r{batch}-{b}", ids, params)
    seqs = [engine.scheduler.waiting.popleft() for _ in range(batch)]
    for seq in seqs:
        assert engine.kv.allocate_slots(seq, context - 1), "KV cache too small"
        seq.num_computed_tokens = context - 1
        engine.kv.on_tokens_computed(seq)
        seq.status = SequenceStatus.RUNNING
        engine.scheduler.running.append(seq)
    engine.step()  # the last prompt token of each
    engine.step()


def measure(engine: LLMEngine, clock: PhaseClock, batch: int, context: int, steps: int, rounds: int,
            final_only: bool = False, temperature: float = 0.0) -> dict:
    """Per phase, its least mean over ``rounds`` rounds (``host``: the sum of those)."""
    best: dict[str, float] = {}
    for _ in range(rounds):
        start_decoding(engine, batch, context, steps + 4, final_only, temperature)
        clock.totals.clear()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - t0
        per = {k: v / steps * 1e6 for k, v in clock.totals.items()}
        while engine.has_unfinished_requests():
            engine.step()
        per["step"] = wall / steps * 1e6
        inner = sum(per.get(k, 0.0) for k in ("schedule", "prepare", "execute", "sample", "static decode meta", "text"))
        per["output"] = per["step"] - inner
        per["execute"] = per.get("execute", 0.0) - per.get("forward", 0.0) - per.get("cpu attn meta", 0.0)
        for k, v in per.items():
            best[k] = min(best.get(k, v), v)
    best["host"] = sum(best.get(k, 0.0) for k in PHASES)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layout", choices=("scout", "full"), default="scout",
                    help="scout: 3 chunked + 1 full layer group; full: one full-attention group (SmolLM2)")
    ap.add_argument("--final-only", action="store_true", help="final outputs only, as LLM.generate asks")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary size (Llama-4: 202048)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (0: greedy)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b]
    max_model_len = args.context + args.steps + 16
    engine = build_engine(max(batches), max_model_len, args.layout, not args.no_prefix_caching, args.vocab)
    clock = PhaseClock(engine, static_backend(engine, max(batches)))
    rows = []
    for batch in batches:
        per = measure(engine, clock, batch, args.context, args.steps, args.rounds, args.final_only,
                      args.temperature)
        rows.append([f"{batch}", *(f"{per.get(k, 0.0):,.0f}" for k in PHASES), f"{per['host']:,.0f}",
                     f"{per.get('text', 0.0):,.0f}", f"{per.get('forward', 0.0):,.0f}",
                     f"{per.get('cpu attn meta', 0.0):,.0f}"])
    groups = len(engine.layout.groups)
    print(f"Decode step host time, µs per step, context {args.context:,} tokens, block {BLOCK}, "
          f"{args.steps} steps (least of {args.rounds} rounds); tiny Llama-4 width, {groups} layer group(s), "
          f"{'final outputs only' if args.final_only else 'an output every step'}, prefix cache "
          f"{'off' if args.no_prefix_caching else 'on'}, vocabulary {args.vocab:,}, "
          f"{f'sampled at temperature {args.temperature}' if args.temperature else 'greedy'}, CPU")
    print(markdown_table(["batch", *PHASES, "host", "deferred text", "forward", "cpu attn meta"], rows))


if __name__ == "__main__":
    main()
