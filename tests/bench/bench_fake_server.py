"""A tiny fake OpenAI-compatible streaming server for the bench tests, run by uvicorn in a thread."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL_ID = "fake-model"
TOKEN_SLEEP_S = 0.002
FIRST_TOKEN_SLEEP_S = 0.005
# Deltas that SmolLM2's tokenizer reads back as exactly one token each.
WORDS = (" the", " cache", " is", " fast")


@dataclass(slots=True)
class FakeOptions:
    send_usage: bool = True
    fail_every: int = 0  # every n-th request answers HTTP 500 (0: never)
    seen: list[dict] = field(default_factory=list)
    authorizations: list[str | None] = field(default_factory=list)  # each request's Authorization header


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _chunk(chat: bool, text: str) -> dict:
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    return {"id": "x", "object": "chunk", "model": MODEL_ID, "choices": [choice]}


async def _stream(body: dict, chat: bool, options: FakeOptions):
    n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
    prompt = body["messages"][0]["content"] if chat else body["prompt"]
    if chat:
        yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'role': 'assistant'}}]})}\n\n"
    await asyncio.sleep(FIRST_TOKEN_SLEEP_S)
    for i in range(n):
        if i:
            await asyncio.sleep(TOKEN_SLEEP_S)
        yield f"data: {json.dumps(_chunk(chat, WORDS[i % len(WORDS)]))}\n\n"
    if options.send_usage and (body.get("stream_options") or {}).get("include_usage"):
        usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n, "total_tokens": n}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
    yield "data: [DONE]\n\n"


def make_app(options: FakeOptions) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]}

    async def handle(request: Request, chat: bool):
        body = await request.json()
        options.seen.append(body)
        options.authorizations.append(request.headers.get("authorization"))
        if options.fail_every and len(options.seen) % options.fail_every == 0:
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        return StreamingResponse(_stream(body, chat, options), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, chat=True)

    return app


@contextmanager
def running_server(options: FakeOptions):
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(make_app(options), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("fake server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
