"""``hybridkv generate``: one prompt through the offline engine, tokens streamed to the terminal as they come.

    hybridkv generate --prompt "What is the capital of France?" --max-tokens 32

The speed (tokens/s, time to the first token) follows on stderr; ``--json`` puts it in the object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from hybridkv.engine.args import add_engine_args, engine_config_from_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate a continuation of one prompt offline")
    add_engine_args(p)
    p.add_argument("--prompt", required=True, help="the prompt (a chat message unless --no-chat)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="apply the model's chat template when it has one")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: the smallest set of tokens with this much probability")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        return _generate(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"hybridkv generate: error: {e}", file=sys.stderr)
        return 2


def _generate(args: argparse.Namespace) -> int:
    from hybridkv.engine.llm_engine import LLMEngine
    from hybridkv.engine.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens
    )
    engine = LLMEngine(engine_config_from_args(args))
    tok = engine.tokenizer
    prompt: str | list[int] = args.prompt
    if args.chat and tok is not None and tok.chat_template:
        prompt = engine.chat_token_ids([{"role": "user", "content": args.prompt}])
    start = time.perf_counter()
    engine.add_request("cli", prompt, params)
    result, first_token_s = None, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            result = out
            if first_token_s is None and out.outputs[0].token_ids:
                first_token_s = time.perf_counter() - start
            if not args.json:
                print(out.outputs[0].delta_text, end="", flush=True)
    elapsed_s = time.perf_counter() - start
    completion = result.outputs[0]
    n = len(completion.token_ids)
    if args.json:
        print(json.dumps({
            "text": completion.text,
            "token_ids": completion.token_ids,
            "finish_reason": completion.finish_reason,
            "prompt_tokens": len(result.prompt_token_ids),
            "elapsed_s": round(elapsed_s, 4),
            "tokens_per_s": round(n / elapsed_s, 2),
        }))
    else:
        print()
        print(speed_line(n, len(result.prompt_token_ids), first_token_s or elapsed_s, elapsed_s), file=sys.stderr)
    return 0


def speed_line(tokens: int, prompt_tokens: int, first_token_s: float, elapsed_s: float) -> str:
    """The run's speed, on stderr after the text (the text alone goes to stdout)::

        >>> speed_line(33, 12, 0.5, 2.0)
        '33 tokens in 2.00 s: 16.5 tokens/s (first token after 0.50 s, with the 12-token prompt; then 21.3 tokens/s)'
    """
    line = f"{tokens} tokens in {elapsed_s:.2f} s: {tokens / elapsed_s:.1f} tokens/s (first token after " \
           f"{first_token_s:.2f} s, with the {prompt_tokens}-token prompt"
    if tokens > 1 and elapsed_s > first_token_s:
        line += f"; then {(tokens - 1) / (elapsed_s - first_token_s):.1f} tokens/s"
    return line + ")"
