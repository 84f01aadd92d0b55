"""``hybridkv serve``: the OpenAI-compatible HTTP server (vLLM's ``vllm serve``).

    hybridkv serve                       # SmolLM2-135M-Instruct on 0.0.0.0:8000
    hybridkv serve MODEL --port 8001 --served-model-name my-model --max-model-len 4096
"""

from __future__ import annotations

import argparse
import logging
import sys

from hybridkv.engine.args import add_engine_args, engine_config_from_args
from hybridkv.server.tool_calls import TOOL_CALL_PARSERS, ToolConfig, load_chat_template


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(p, model_positional=True)
    p.add_argument("--host", default="0.0.0.0", help="address to bind (default: all interfaces, like vLLM)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: the model's name)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser')
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_CALL_PARSERS),
                   help="how tool calls are read from the output: llama3_json / llama4_json (JSON calls), "
                        "hermes (<tool_call> blocks, also SmolLM2's list form)")
    p.add_argument("--chat-template", default=None,
                   help="chat template replacing the model's: a file, the name of one in hybridkv/server/templates "
                        "(e.g. tool_chat_template_smollm2.jinja), or the template itself")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        config = engine_config_from_args(args)
        config.clamp_max_model_len = True  # a server starts with what fits, and says why
        tools = ToolConfig(args.enable_auto_tool_choice, args.tool_call_parser)
        from hybridkv.server.app import build_app  # torch and the model load only here

        template = None if args.chat_template is None else load_chat_template(args.chat_template)
        app = build_app(config, served_model_name=args.served_model_name, tools=tools, chat_template=template)
    except (ValueError, FileNotFoundError) as e:
        print(f"hybridkv serve: error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
