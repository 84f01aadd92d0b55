"""``hybridkv serve``: the OpenAI-compatible HTTP server (vLLM's ``vllm serve``).

    hybridkv serve                       # SmolLM2-135M-Instruct on 0.0.0.0:8000
    hybridkv serve MODEL --port 8001 --served-model-name my-model --max-model-len 4096
    hybridkv serve --api-key SECRET      # /v1 routes need "Authorization: Bearer SECRET" (or HYBRIDKV_API_KEY)
    hybridkv serve gemma-3-270m --data-parallel-size 2   # 2 replicas behind a cache-aware router
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import TYPE_CHECKING

from hybridkv.commands import plain_text
from hybridkv.engine.args import add_engine_args, engine_config_from_args
from hybridkv.server.tool_calls import TOOL_CALL_PARSERS, ToolConfig, load_chat_template

if TYPE_CHECKING:
    from hybridkv.server.options import ServerOptions

API_KEY_ENV = "HYBRIDKV_API_KEY"  # vLLM's VLLM_API_KEY


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server", description=plain_text(__doc__))
    add_engine_args(p, model_positional=True)
    p.add_argument("--host", default="0.0.0.0", help="address to bind (default: all interfaces, like vLLM)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: the model's name)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser')
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_CALL_PARSERS),
                   help="how tool calls are read from the output: llama3_json / llama4_json (JSON calls), "
                        "hermes (<tool_call> blocks, also SmolLM2's list form); by default none, and tool_choice "
                        '"auto" is refused')
    p.add_argument("--chat-template", default=None,
                   help="chat template replacing the model's: a file, the name of one in hybridkv/server/templates "
                        "(e.g. tool_chat_template_smollm2.jinja), or the template itself (default: the model's own)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="lowest level of log lines written to stderr")
    p.add_argument("--api-key", action="append", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1 routes; repeat for several keys "
                        f"(default: ${API_KEY_ENV} if set, else no authentication)")
    p.add_argument("--disable-fastapi-docs", action="store_true",
                   help="no /docs, /redoc or /openapi.json (they need the API key when one is set)")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage.prompt_tokens_details.cached_tokens in every response: the prompt tokens the prefix "
                        "cache served")
    p.add_argument("--allowed-origins", type=_json_list, default=["*"], help='CORS origins, a JSON list')
    p.add_argument("--allowed-methods", type=_json_list, default=["*"], help='CORS methods, a JSON list')
    p.add_argument("--allowed-headers", type=_json_list, default=["*"], help='CORS headers, a JSON list')
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    p.add_argument("--max-request-body-bytes", type=int, default=None,
                   help="larger request bodies get 413 (default: 100 MiB)")
    p.add_argument("--request-body-timeout-s", type=float, default=None,
                   help="a request body not all received within this many seconds gets 408 and its connection is "
                        "closed (default: 30)")
    p.add_argument("--routing-policy", default=None, choices=["round-robin", "least-loaded", "cache-aware"],
                   help="with --data-parallel-size > 1: which replica serves each request; cache-aware: the one "
                        "whose KV cache (read from its KV events) resumes the longest prefix, weighed against its "
                        "load (default: cache-aware)")
    p.set_defaults(run=_run)


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, like '[\"*\"]', got {text!r}")
    return value


def server_options_from_args(args: argparse.Namespace) -> ServerOptions:
    from hybridkv.server.limits import RequestLimits
    from hybridkv.server.options import ServerOptions

    keys = args.api_key or ([os.environ[API_KEY_ENV]] if os.environ.get(API_KEY_ENV) else [])
    limits = RequestLimits()
    if args.max_request_body_bytes is not None:
        if args.max_request_body_bytes < 1:
            raise ValueError(f"--max-request-body-bytes must be at least 1, got {args.max_request_body_bytes}")
        limits.max_body_bytes = args.max_request_body_bytes
    if args.request_body_timeout_s is not None:
        if not args.request_body_timeout_s > 0:
            raise ValueError(f"--request-body-timeout-s must be > 0, got {args.request_body_timeout_s}")
        limits.body_read_timeout_s = args.request_body_timeout_s
    return ServerOptions(api_keys=keys, allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
                         allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
                         limits=limits, fastapi_docs=not args.disable_fastapi_docs,
                         prompt_tokens_details=args.enable_prompt_tokens_details)


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        config = engine_config_from_args(args)
        config.clamp_max_model_len = True  # a server starts with what fits, and says why
        options = server_options_from_args(args)
        tools = ToolConfig(args.enable_auto_tool_choice, args.tool_call_parser)
        from hybridkv.server.app import build_app  # torch and the model load only here

        template = None if args.chat_template is None else load_chat_template(args.chat_template)
        app = build_app(config, served_model_name=args.served_model_name, options=options, tools=tools,
                        chat_template=template, routing_policy=args.routing_policy, log_level=args.log_level)
    except (ValueError, FileNotFoundError) as e:
        print(f"hybridkv serve: error: {e}", file=sys.stderr)
        return 2
    from hybridkv.server.runner import run_server

    code = run_server(app, args.host, args.port, args.log_level)
    # Every request is answered and the engine and its workers are stopped; the interpreter's own teardown (torch's
    # process group, gloo) can take seconds more, in which nothing listens any more: leave now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
