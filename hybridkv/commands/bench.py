"""``hybridkv bench serve``: benchmark an OpenAI-compatible server (ours, vLLM, SGLang), like ``vllm bench serve``.

    hybridkv bench serve --base-url http://127.0.0.1:8000 --dataset random \\
        --input-len 1024 --output-len 128 --num-prompts 200 --max-concurrency 16 --json out.json --plot out.png

Prompts have exact token lengths by the bench tokenizer (special tokens not counted). With the chat
endpoint each prompt is one user message, and the server's chat template adds tokens to it.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

API_KEY_ENV = "OPENAI_API_KEY"  # what vLLM's bench reads, and the openai client


def add_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmark clients")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    p = bench_sub.add_parser("serve", help="benchmark an OpenAI-compatible server (like vllm bench serve)")
    _add_serve_args(p)
    p.set_defaults(run=_run)


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive (or inf), got {text}")
    return value


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"],
                   help="API the requests go to")
    p.add_argument("--model", help="model name sent in requests (default: the first id from GET /v1/models)")
    p.add_argument("--tokenizer", help="known model name, .gguf file or HF directory for prompt lengths "
                   "(default: --model if resolvable, else smollm2-135m-instruct)")
    p.add_argument("--dataset", choices=["random", "text"], default="random",
                   help="random: random token ids; text: prompts cut from --dataset-path")
    p.add_argument("--dataset-path", help="text file for --dataset text (required with it)")
    p.add_argument("--input-len", type=_positive_int, required=True, help="prompt tokens")
    p.add_argument("--output-len", type=_positive_int, required=True, help="max_tokens of every request")
    p.add_argument("--num-prompts", type=_positive_int, required=True, help="requests to send")
    p.add_argument("--max-concurrency", type=_positive_int, help="requests in flight at most (default: no limit)")
    p.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="Poisson arrivals per second (default: inf, all at once)")
    p.add_argument("--prefix-len", type=_non_negative_int, default=0,
                   help="tokens of a prefix shared by every prompt (counted in --input-len)")
    p.add_argument("--summarize-instruction", action="store_true",
                   help='start every prompt with "Please summarize the following text." (counted in --input-len)')
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the arrival times")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY if set, as vLLM's "
                                     "bench reads it; else no header)")
    p.add_argument("--request-timeout", type=float, default=6 * 3600.0, help="seconds per request")
    p.add_argument("--json", dest="json_path", metavar="OUT.json",
                   help="write metrics, config and per-request records (default: none written)")
    p.add_argument("--plot", metavar="OUT.png",
                   help="write latency histograms and throughput over time (default: none written)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _run(args: argparse.Namespace) -> int:
    import httpx

    try:
        return _bench_serve(args)
    except (ValueError, FileNotFoundError, httpx.HTTPError) as e:
        print(f"hybridkv bench serve: error: {e}", file=sys.stderr)
        return 2


def _load_tokenizer(name: str | None, model: str):
    """The bench tokenizer, without loading weights: --tokenizer, else the served model if we can resolve it."""
    from pathlib import Path

    from hybridkv.model.loading.known_models import DEFAULT_MODEL, resolve_model
    from hybridkv.model.loading.tokenizer import Tokenizer

    if name is not None and (Path(name) / "tokenizer.json").is_file():
        return Tokenizer.from_hf_dir(name), name
    try:
        resolved = resolve_model(name if name is not None else model)
    except (ValueError, FileNotFoundError):
        if name is not None:
            raise
        print(f"note: model {model!r} is not a known name or path; prompt lengths use the "
              f"{DEFAULT_MODEL} tokenizer (pass --tokenizer)", file=sys.stderr)
        resolved = resolve_model(DEFAULT_MODEL)
    if resolved.kind == "gguf":
        return Tokenizer.from_gguf(resolved.path), resolved.name
    return Tokenizer.from_hf_dir(resolved.path), resolved.name


def plot_title(config: dict[str, Any]) -> str:
    """What the run was, from its config::

        >>> plot_title({"model": "m", "endpoint": "/v1/completions", "input_len": 512, "output_len": 128,
        ...             "num_prompts": 64, "max_concurrency": 16, "request_rate": "inf"})
        'm /v1/completions in=512 out=128 prompts=64 concurrency=16 rate=inf'
    """
    concurrency = config["max_concurrency"] or "unlimited"
    return (f"{config['model']} {config['endpoint']} in={config['input_len']} out={config['output_len']} "
            f"prompts={config['num_prompts']} concurrency={concurrency} rate={config['request_rate']}")


def _config(args: argparse.Namespace, model: str, tokenizer_name: str) -> dict[str, Any]:
    rate = args.request_rate
    return {
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "model": model,
        "tokenizer": tokenizer_name,
        "dataset": args.dataset,
        "dataset_path": args.dataset_path,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_prompts": args.num_prompts,
        "max_concurrency": args.max_concurrency,
        "request_rate": "inf" if math.isinf(rate) else rate,
        "prefix_len": args.prefix_len,
        "summarize_instruction": args.summarize_instruction,
        "seed": args.seed,
    }


def _bench_serve(args: argparse.Namespace) -> int:
    import asyncio

    from tqdm import tqdm

    from hybridkv.bench.client import ClientConfig, first_model_id, run_requests
    from hybridkv.bench.datasets import DatasetConfig, dataset_summary, load_dataset
    from hybridkv.bench.metrics import compute_metrics, fill_output_tokens
    from hybridkv.bench.report import format_table, result_dict, write_json, write_plot

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    model = args.model or asyncio.run(first_model_id(args.base_url, api_key))
    tokenizer, tokenizer_name = _load_tokenizer(args.tokenizer, model)
    dataset_cfg = DatasetConfig(
        kind=args.dataset, input_len=args.input_len, output_len=args.output_len, num_prompts=args.num_prompts,
        prefix_len=args.prefix_len, summarize_instruction=args.summarize_instruction, seed=args.seed,
        path=args.dataset_path,
    )
    samples = load_dataset(tokenizer, dataset_cfg)
    summary = dataset_summary(samples)
    if summary["exact_prompts"] < len(samples):
        print(f"warning: {len(samples) - summary['exact_prompts']} prompts miss --input-len by up to "
              f"{summary['max_abs_deviation']} tokens", file=sys.stderr)
    client_cfg = ClientConfig(
        base_url=args.base_url, endpoint=args.endpoint, model=model, request_rate=args.request_rate,
        max_concurrency=args.max_concurrency, seed=args.seed, timeout_s=args.request_timeout, api_key=api_key,
    )
    with tqdm(total=len(samples), disable=args.no_progress, file=sys.stderr, desc="requests") as bar:
        results, duration = asyncio.run(run_requests(client_cfg, samples, on_done=lambda _: bar.update(1)))
    fill_output_tokens(results, lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
    metrics = compute_metrics(results, duration)
    config = _config(args, model, tokenizer_name)
    print(format_table(metrics, config))
    if args.json_path:
        write_json(args.json_path, result_dict(metrics, config, summary, results))
    if args.plot:
        write_plot(args.plot, results, metrics, title=plot_title(config))
    return 0 if metrics.completed else 1
