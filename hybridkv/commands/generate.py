"""``hybridkv generate``: one prompt through the offline engine, tokens streamed to the terminal as they come.

    hybridkv generate --prompt "What is the capital of France?" --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import sys

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
    engine.add_request("cli", prompt, params)
    result = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            result = out
            if not args.json:
                print(out.outputs[0].delta_text, end="", flush=True)
    completion = result.outputs[0]
    if args.json:
        print(json.dumps({
            "text": completion.text,
            "token_ids": completion.token_ids,
            "finish_reason": completion.finish_reason,
            "prompt_tokens": len(result.prompt_token_ids),
        }))
    else:
        print()
    return 0
