"""Routing policies over data-parallel replicas: prefix-cache hit rate, prefill tokens saved and TTFT on a multi-turn
trace served over HTTP.

The trace is ``prefix_trace.py``'s (conversations sharing system prompts, each turn repeating the history before it;
documents asked several questions, one after another; all interleaved), small enough for a CPU. It is sent as token
ids to ``hybridkv serve --data-parallel-size N`` under each ``--routing-policy``, and to one replica with N times the
KV cache (the bound: nothing is split, so every prefix is where the next request looks), by ``--concurrency``
clients; a turn waits for the turn before it. Hit rate and tokens saved are the replicas' own prefix-cache counters
(``/metrics``, summed over replicas); TTFT is the client's, to the first streamed token.

The last column projects each policy onto Llama-4-Scout: every request's prompt scaled by ``--scout-scale`` (4,096:
a 250-token document becomes a 1M-token one) and prefilled from the cached share this run gave it (the server's
``usage.prompt_tokens_details.cached_tokens``), summed through one Scout TP-8 rank's step model (``scout_rank.py``'s
``predicted_prefill`` over the bf16-KV fit measured on an H200, docs/benchmarks.md#the-step-model).

    python benchmarks/routing.py                       # Gemma-3-270M, 2 replicas on the CPU: a few minutes on 2 cores
    python benchmarks/routing.py --quick               # a smaller trace
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prefix_trace import TraceRequest, TraceShape, make_trace  # noqa: E402
from gpu.scout_rank import predicted_prefill  # noqa: E402

from hybridkv.bench.tables import markdown_table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHAPE = TraceShape(system_prompts=2, system_len=(96, 160), conversations=6, turns=(2, 4), user_len=(8, 32),
                   reply_len=(8, 32), documents=3, document_len=(200, 320), questions=(3, 4))
QUICK = TraceShape(system_prompts=1, system_len=(64, 96), conversations=3, turns=(2, 3), user_len=(8, 16),
                   reply_len=(8, 16), documents=2, document_len=(120, 160), questions=(2, 3))
POLICIES = ("round-robin", "least-loaded", "cache-aware")
# one Scout TP-8 rank's 16K-token prefill step over c cached tokens: A + B c seconds (bf16 KV, one H200)
SCOUT_STEP_A, SCOUT_STEP_B = 0.220, 0.8523e-6


@dataclass(slots=True)
class Run:
    label: str
    hit_tokens: float
    query_tokens: float
    ttft_s: list[float]
    prompts: list[tuple[int, int]]  # (prompt tokens, cached tokens) a request

    def scout_prefill_s(self, scale: int) -> float:
        """The projected prefill seconds of every prompt, ``scale`` times longer, on a Scout rank."""
        return sum(predicted_prefill(SCOUT_STEP_A, SCOUT_STEP_B, n * scale, cached / n) for n, cached in self.prompts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--kv-mib", type=int, default=64, help="KV cache per replica, MiB (the bound gets N times it)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--scout-scale", type=int, default=4096, help="prompt length factor of the Scout projection")
    args = p.parse_args()
    trace = one_question_at_a_time(make_trace(QUICK if args.quick else SHAPE))
    print(f"{len(trace)} requests, {sum(len(r.prompt) for r in trace):,} prompt tokens", file=sys.stderr)
    runs = []
    for policy in POLICIES:
        flags = ["--data-parallel-size", str(args.replicas), "--routing-policy", policy,
                 "--kv-cache-memory-bytes", str(args.kv_mib << 20)]
        runs.append(serve_and_replay(policy, args, flags, trace))
    bound = ["--kv-cache-memory-bytes", str(args.replicas * args.kv_mib << 20)]
    runs.append(serve_and_replay(f"one replica, {args.replicas}x KV (bound)", args, bound, trace))
    head = ("policy", "hit rate", "prefill tokens saved", "TTFT p50 (s)", "TTFT p90 (s)",
            f"Scout rank prefill, prompts x {args.scout_scale:,} (projected)")
    rows = [(r.label, f"{100 * r.hit_tokens / r.query_tokens:.1f}%", f"{r.hit_tokens:,.0f} of {r.query_tokens:,.0f}",
             f"{np.percentile(r.ttft_s, 50):.2f}", f"{np.percentile(r.ttft_s, 90):.2f}",
             f"{r.scout_prefill_s(args.scout_scale):,.0f} s") for r in runs]
    print(markdown_table(head, rows))


def one_question_at_a_time(trace: list[TraceRequest]) -> list[TraceRequest]:
    """A document's reader asks the next question once the last is answered, as a conversation's next turn waits
    (``make_trace`` sends a document's questions independently)."""
    last: dict[str, str] = {}
    for r in trace:
        if r.rid.startswith("d"):
            doc = r.rid.split("q")[0]
            r.after = last.get(doc)
            last[doc] = r.rid
    return trace


def serve_and_replay(label: str, args: argparse.Namespace, flags: list[str], trace: list[TraceRequest]) -> Run:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "hybridkv.cli", "serve", args.model, "--device", "cpu", "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", "1024", "--log-level", "warning", "--enable-prompt-tokens-details",
           *flags]
    log = tempfile.TemporaryFile()  # the server's output: shown only if it fails
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log)
        before = counters(url)
        ttft, prompts = asyncio.run(replay(url, trace, args.concurrency, args.max_tokens))
        after = counters(url)
    finally:
        proc.terminate()
        proc.wait(60)
    run = Run(label, after[0] - before[0], after[1] - before[1], ttft, prompts)
    print(f"{label}: hit {run.hit_tokens:.0f} of {run.query_tokens:.0f}", file=sys.stderr)
    return run


def wait_healthy(proc: subprocess.Popen, url: str, log) -> None:
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            log.seek(0)
            raise SystemExit(f"the server exited with status {proc.returncode}:\n{log.read().decode()[-3000:]}")
        if time.monotonic() > deadline:
            raise SystemExit("the server did not start within 600 s")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)


def counters(url: str) -> tuple[float, float]:
    """(prefix-cache hit tokens, query tokens), summed over replicas."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    total = {"hybridkv:prefix_cache_hits_total": 0.0, "hybridkv:prefix_cache_queries_total": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in total:
                total[s.name] += s.value
    return total["hybridkv:prefix_cache_hits_total"], total["hybridkv:prefix_cache_queries_total"]


async def replay(url: str, trace: list[TraceRequest], concurrency: int, max_tokens: int
                 ) -> tuple[list[float], list[tuple[int, int]]]:
    """Each request in trace order, at most ``concurrency`` at once, a turn after the turn it continues; TTFTs, and
    each prompt's (tokens, cached tokens) from its usage."""
    done = {r.rid: asyncio.Event() for r in trace}
    slots = asyncio.Semaphore(concurrency)
    ttft: list[float] = []
    prompts: list[tuple[int, int]] = []

    async def one(client: httpx.AsyncClient, r: TraceRequest) -> None:
        if r.after is not None:
            await done[r.after].wait()
        async with slots:
            body = {"prompt": r.prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            start = time.perf_counter()
            first = None
            async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if first is None and line.startswith("data: {"):
                        first = time.perf_counter() - start
                    if line.startswith("data: {") and '"usage":{' in line.replace(" ", ""):
                        usage = json.loads(line[6:])["usage"]
                        prompts.append((usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
            ttft.append(first)
        done[r.rid].set()

    async with httpx.AsyncClient(timeout=600) as client:
        tasks = []
        for r in trace:  # started in arrival order: the semaphore admits them in that order
            tasks.append(asyncio.ensure_future(one(client, r)))
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
    return ttft, prompts


if __name__ == "__main__":
    main()
