"""The OpenAI-compatible HTTP API: ``build_app(engine_config or engine)`` returns a FastAPI app.

Routes: ``/health``, ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses`` (all three
streaming over SSE), ``/metrics``. Bad input is a 4xx with OpenAI's error body; a client that goes away aborts its
request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.llm_engine import CompletionOutput, LLMEngine, RequestOutput
from hybridkv.engine.output_processing import Logprobs, PromptLogprobs
from hybridkv.engine.sampling_params import SamplingParams
from hybridkv.model.loading.tokenizer import Tokenizer
from hybridkv.server.async_engine import AsyncEngine, EngineDeadError, RequestPrep, RequestStream
from hybridkv.server.auth import add_access_middleware
from hybridkv.server.data_parallel import DataParallelEngine
from hybridkv.server.errors import APIError, error_body, error_response, unserved_route
from hybridkv.server.json_body import decode_json
from hybridkv.server.limits import check_max_tokens, read_body, refuse_unsupported
from hybridkv.server.metrics import ServerMetrics
from hybridkv.server.options import ServerOptions
from hybridkv.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprob,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    PromptLogprob,
    PromptTokensDetails,
    ResponseMessage,
    TokenizeRequest,
    TokenizeResponse,
    TopLogprob,
    UsageInfo,
    random_id,
)
from hybridkv.server.responses import ResponseStore, ResponseTurn, renamed
from hybridkv.server.responses_protocol import ResponsesRequest
from hybridkv.server.tool_calls import (
    ToolCallStream,
    ToolConfig,
    ToolPlan,
    extract,
    finish_reason,
    plan_tools,
    template_renders_tools,
)

log = logging.getLogger("hybridkv.server")

DISCONNECT_POLL_S = 0.2
# pydantic names the member of a union it tried (``str``, ``list[int]``, ``TextPart``) inside error locations
_UNION_TAG = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|[A-Z]\w*|[\w-]+\[.*\])$")


@dataclass(slots=True)
class ServerState:
    engine: AsyncEngine | DataParallelEngine
    model_name: str
    tokenizer: Tokenizer | None = field(repr=False)  # None: skip_tokenizer_init
    options: ServerOptions = field(default_factory=ServerOptions)
    tools: ToolConfig = field(default_factory=ToolConfig)
    template_renders_tools: bool = False
    responses: ResponseStore = field(default_factory=ResponseStore)  # for previous_response_id
    _token_strings: dict[int, str] = field(default_factory=dict, repr=False)

    def token_str(self, token_id: int) -> str:
        text = self._token_strings.get(token_id)
        if self.tokenizer is None:
            return f"token_id:{token_id}"  # vLLM's spelling of a token it cannot decode
        if text is None:
            text = self._token_strings[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def build_app(engine: LLMEngine | EngineConfig, served_model_name: str | None = None,
              options: ServerOptions | None = None, tools: ToolConfig | None = None,
              chat_template: str | None = None, routing_policy: str | None = None,
              log_level: str = "info") -> FastAPI:
    """The app around an engine (built here from a config); the engine thread runs while the app is up.
    ``tools``: ``--enable-auto-tool-choice`` / ``--tool-call-parser``; ``chat_template``: replaces the model's.
    A config with ``data_parallel_size`` > 1 starts that many replica processes behind a router
    (``data_parallel.py``; ``routing_policy``, default cache-aware; ``log_level``: the replicas')."""
    options = options or ServerOptions()
    if isinstance(engine, EngineConfig) and engine.data_parallel_size > 1:
        async_engine = DataParallelEngine.launch(engine, routing_policy, served_model_name, log_level)
        name, tokenizer = async_engine.model_name, async_engine.prep.tokenizer
    else:
        if routing_policy is not None:
            raise ValueError("--routing-policy picks a replica per request: it needs --data-parallel-size > 1")
        if isinstance(engine, EngineConfig):
            engine = LLMEngine(engine)
        name = served_model_name or engine.loaded.name
        metrics = ServerMetrics(name)
        # every gauge, KV usage per attention type included, exists from the first scrape (before any request)
        metrics.update_engine_state(engine)
        async_engine = AsyncEngine(engine, metrics)
        tokenizer = engine.tokenizer

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(async_engine.shutdown)

    docs = {} if options.fastapi_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="hybridkv", lifespan=lifespan, **docs)
    if tokenizer is not None and chat_template is not None:
        tokenizer = replace(tokenizer, chat_template=chat_template)
    renders_tools = tokenizer is not None and template_renders_tools(tokenizer.chat_template)
    app.state.server = ServerState(async_engine, name, tokenizer, options, tools or ToolConfig(),
                                   renders_tools)
    _add_error_handlers(app)
    add_access_middleware(app, options)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/metrics", render_metrics, methods=["GET"])
    app.add_api_route("/v1/completions", create_completion, methods=["POST"])
    app.add_api_route("/v1/chat/completions", create_chat_completion, methods=["POST"])
    app.add_api_route("/v1/responses", create_response, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", retrieve_response, methods=["GET"])
    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
    app.add_api_route("/tokenizer_info", tokenizer_info, methods=["GET"])
    return app


def _state(request: Request) -> ServerState:
    return request.app.state.server


# ---- errors ------------------------------------------------------------------------------------------------
def _add_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: APIError) -> JSONResponse:
        response = error_response(exc.status, exc.message, exc.param)
        if exc.status == 408:  # the rest of the body may still come: this connection cannot carry another request
            response.headers["connection"] = "close"
        return response

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = unserved_route(request.url.path) if exc.status_code == 404 else None
        return error_response(exc.status_code, message or str(exc.detail))

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:  # uvicorn logs the traceback
        return error_response(500, f"internal server error ({type(exc).__name__})")

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One readable line from pydantic's errors, naming each bad field; and the first field's path."""
    parts: list[str] = []
    param = None
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p != "body" and not _UNION_TAG.match(str(p))]
        if not loc:
            parts.append(f"request body: {err.get('msg')}")
            continue
        path = ".".join(loc)
        param = param or path
        value = err.get("input")
        got = f" (got {value!r})" if isinstance(value, (str, int, float, bool)) and err["type"] != "missing" else ""
        line = f"{path}: {err.get('msg')}{got}"
        if line not in parts:
            parts.append(line)
    return "; ".join(parts[:4]) or "invalid request", param


async def _parse_body(request: Request, model: type[BaseModel]):
    """JSON whatever the content type says (``curl -d`` sends form-encoded), validated into ``model``."""
    limits = _state(request).options.limits
    raw = await read_body(request, limits)
    if not raw.strip():
        raise APIError(400, "the request body is empty: a JSON object is expected")
    data = decode_json(raw, limits.max_json_depth)
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    refuse_unsupported(data, {ChatCompletionRequest: "chat", ResponsesRequest: "responses"}.get(model, "completions"))
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise APIError(400, *validation_message(error.errors())) from None


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f"The model `{model}` does not exist. Served: `{state.model_name}`.", "model")


async def _prompt_ids(state: ServerState, prompt: str | list[int], max_tokens: int | None,
                      max_tokens_name: str) -> list[int]:
    """Tokenized off the event loop (other requests keep streaming), then ``max_tokens`` checked against it."""
    prep = state.engine.prep
    try:
        ids = prompt if isinstance(prompt, list) else await prep.tokenize(prompt)
    except ValueError as error:
        raise APIError.bad_request(error) from None
    check_max_tokens(max_tokens, len(ids), prep.max_model_len, max_tokens_name)
    return ids


async def _submit(state: ServerState, request_id: str, prompt, params, cache_salt) -> RequestStream:
    if params.structured_outputs is not None:  # compiled here, off the event loop; the engine finds it cached
        try:
            await state.engine.prep.compile_grammar(params.structured_outputs)
        except ValueError as error:
            raise APIError(400, str(error), "structured_outputs") from None
    try:
        return await state.engine.add_request(request_id, prompt, params, cache_salt)
    except ValueError as error:
        raise APIError.bad_request(error) from None
    except EngineDeadError as error:
        raise APIError(503, str(error)) from None


# ---- simple routes -----------------------------------------------------------------------------------------
async def health(request: Request) -> Response:
    if not _state(request).engine.is_alive:
        return error_response(503, "the engine is not running")
    return Response(status_code=200)


async def list_models(request: Request) -> ModelList:
    state = _state(request)
    prep = state.engine.prep
    return ModelList(data=[ModelCard(id=state.model_name, root=prep.checkpoint, max_model_len=prep.max_model_len)])


async def render_metrics(request: Request) -> Response:
    return Response(await _state(request).engine.metrics_text(), media_type=CONTENT_TYPE_LATEST)


# ---- completions -------------------------------------------------------------------------------------------
async def create_completion(request: Request) -> Response:
    """One prompt or a list of them (vLLM's batch): prompt i's ``n`` choices are indices ``i*n .. i*n+n-1``, and
    usage is their sum."""
    body = await _parse_body(request, CompletionRequest)
    state = _state(request)
    _check_model(state, body.model)
    try:
        prompts, params = body.prompts(), body.sampling_params()
    except ValueError as error:
        raise APIError.bad_request(error) from None
    if body.echo and state.tokenizer is None:
        raise APIError(400, "echo: needs a tokenizer to write the prompt's text, and this server runs without one "
                            "(--skip-tokenizer-init)", "echo")
    ids = [await _prompt_ids(state, p, params.max_tokens, "max_tokens") for p in prompts]  # all checked first
    request_id = random_id("cmpl")
    streams = await _submit_all(state, request_id, ids, params, body.cache_salt)
    response = CompletionResponse(id=request_id, model=state.model_name, choices=[])
    echoes = [_Echo(state, body, p if isinstance(p, str) else None) if body.echo else None for p in prompts]
    if body.stream:
        chunks = _completion_chunks(state, streams, response, body.include_usage, echoes, params.n)
        return _sse(chunks, *streams)
    finals = await _final_outputs(streams, request)
    for i, (final, echo) in enumerate(zip(finals, echoes)):
        prompt_logprobs = await _prompt_logprobs_off_loop(state, final)
        for o in final.outputs:
            choice = _completion_choice(state, o, o.text, o.logprobs, i * params.n)
            choice.prompt_logprobs = prompt_logprobs
            if echo is not None:
                echo.apply(choice, final, o.logprobs)
            response.choices.append(choice)
    response.usage = _summed_usage(state, finals, echoes)
    return JSONResponse(response.model_dump())


async def _submit_all(state: ServerState, request_id: str, prompts: list[list[int]], params,
                      cache_salt) -> list[RequestStream]:
    """One engine request per prompt (ids ``request_id``, then ``request_id-1`` ...); if one is refused, those
    already queued are aborted. The first goes alone (any grammar is compiled once, for it); the rest together,
    so that the engine takes them in one step rather than one step each."""
    first = await _submit(state, request_id, prompts[0], params, cache_salt)
    rest = await asyncio.gather(*(_submit(state, f"{request_id}-{i}", ids, params, cache_salt)
                                  for i, ids in enumerate(prompts[1:], 1)), return_exceptions=True)
    streams = [first, *(s for s in rest if isinstance(s, RequestStream))]
    error = next((e for e in rest if isinstance(e, BaseException)), None)
    if error is not None:
        for stream in streams:
            stream.abort()
        raise error
    return streams


def _summed_usage(state: ServerState, finals: list[RequestOutput], echoes: list[_Echo | None]) -> UsageInfo:
    total = _usage(state, None)
    for final, echo in zip(finals, echoes):
        usage = _usage(state, final) if echo is None else echo.usage(_usage(state, final))
        total.prompt_tokens += usage.prompt_tokens
        total.completion_tokens += usage.completion_tokens
        total.total_tokens += usage.total_tokens
        if total.prompt_tokens_details is not None:
            total.prompt_tokens_details.cached_tokens += usage.prompt_tokens_details.cached_tokens
    return total


@dataclass(slots=True)
class _Echo:
    """``echo``: a choice's text and logprobs (its first chunk's, when streaming) preceded by the prompt's; with
    ``max_tokens`` 0, the prompt's alone (the token the engine sampled is left out)."""

    state: ServerState
    body: CompletionRequest
    text: str | None  # the prompt as sent, or None for token ids (then decoded)

    def apply(self, choice: CompletionChoice, out: RequestOutput, rows: list[Logprobs] | None) -> None:
        if self.text is None:
            self.text = self.state.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
        only = self.body.echo_only
        choice.text = self.text + ("" if only else choice.text)
        if self.body.logprobs is not None:
            logprobs = _prompt_token_logprobs(self.state, out.prompt_token_ids, out.prompt_logprobs,
                                              self.body.logprobs)
            choice.logprobs = logprobs if only else _completion_logprobs(self.state, rows, logprobs)

    def usage(self, usage: UsageInfo) -> UsageInfo:
        if self.body.echo_only:
            usage.completion_tokens, usage.total_tokens = 0, usage.prompt_tokens
        return usage


def _prompt_token_logprobs(state: ServerState, token_ids: list[int], entries: PromptLogprobs,
                           k: int) -> CompletionLogprobs:
    """OpenAI's legacy logprobs of the prompt's tokens (vLLM's echo): the first has none; each other one its own
    logprob, and its top logprobs the token's and its position's top ``k``."""
    out = CompletionLogprobs()
    for token_id, entry in zip(token_ids, entries):
        token = state.token_str(token_id)
        if entry is None:
            _append_logprob(out, token, None, None)
            continue
        top = {state.token_str(t): _finite(lp.logprob) for t, lp in itertools.islice(entry.items(), k + 1)}
        _append_logprob(out, token, _finite(entry[token_id].logprob), top)
    return out


async def _prompt_logprobs_off_loop(state: ServerState, final: RequestOutput) -> list | None:
    """A long prompt's entries take a while to write: off the event loop, so other requests keep streaming."""
    if final.prompt_logprobs is None:
        return None
    return await asyncio.to_thread(_prompt_logprobs, state, final.prompt_logprobs)


def _prompt_logprobs(state: ServerState, entries: PromptLogprobs) -> list:
    """vLLM's ``prompt_logprobs`` field: per prompt token None (the first) or {token id: logprob, rank, text}."""
    return [None if entry is None else {
        t: PromptLogprob(logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=state.token_str(t))
        for t, lp in entry.items()
    } for entry in entries]


def _finite(logprob: float) -> float:
    """JSON has no -inf: vLLM's floor for a token ruled out (by the model, or by a grammar's mask, which comes
    before the logprobs)."""
    return max(logprob, -9999.0)


def _completion_choice(state: ServerState, o: CompletionOutput, text: str, rows: list[Logprobs] | None,
                       first_index: int = 0):
    """``first_index``: the index of the prompt's first choice (prompt i of a list: ``i * n``)."""
    logprobs = None if rows is None else _completion_logprobs(state, rows)
    return CompletionChoice(index=first_index + o.index, text=text, logprobs=logprobs, finish_reason=o.finish_reason,
                            stop_reason=o.stop_reason)


def _completion_logprobs(state: ServerState, rows: list[Logprobs],
                         out: CompletionLogprobs | None = None) -> CompletionLogprobs:
    """``out``: logprobs of the tokens before these (the echoed prompt's), which these continue."""
    out = CompletionLogprobs() if out is None else out
    for row in rows:
        sampled_id, sampled_lp = row[0]
        token = state.token_str(sampled_id)
        top = {state.token_str(t): _finite(lp) for t, lp in row[1:]}
        top.setdefault(token, _finite(sampled_lp))
        _append_logprob(out, token, _finite(sampled_lp), top)
    return out


def _append_logprob(out: CompletionLogprobs, token: str, logprob: float | None, top: dict | None) -> None:
    out.text_offset.append(out.text_offset[-1] + len(out.tokens[-1]) if out.tokens else 0)
    out.tokens.append(token)
    out.token_logprobs.append(logprob)
    out.top_logprobs.append(top)


async def _completion_chunks(
    state: ServerState, streams: list[RequestStream], template: CompletionResponse, include_usage: bool,
    echoes: list[_Echo | None], n: int,
) -> AsyncIterator[str]:
    """The prompts' chunks as each comes (prompt i's choices at ``i*n ..``); usage, summed, after the last."""
    deltas = [ChoiceDeltas() for _ in streams]
    echoed: set[tuple[int, int]] = set()
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in _merged(streams):
        finals[i] = out
        for o, rows in deltas[i].new(out):
            choice = _completion_choice(state, o, o.delta_text, rows, i * n)
            echo = echoes[i]
            if echo is not None and (i, o.index) not in echoed:  # max_tokens 0: this first chunk is also the last
                echo.apply(choice, out, rows)
                echoed.add((i, o.index))
            yield _event(template.model_copy(update={"choices": [choice]}))
    if include_usage:
        yield _event(template.model_copy(update={"choices": [], "usage": _summed_usage(state, finals, echoes)}))


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from several streams as each output arrives; a stream's error is raised here."""
    if len(streams) == 1:  # the common case needs no tasks
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except Exception as error:  # noqa: BLE001 - raised by the consumer
            await queue.put((i, error))
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


# ---- chat completions --------------------------------------------------------------------------------------
async def create_chat_completion(request: Request) -> Response:
    body = await _parse_body(request, ChatCompletionRequest)
    state = _state(request)
    _check_model(state, body.model)
    plan, params, prompt = await _chat_prompt(state, body)
    request_id = random_id("chatcmpl")
    stream = await _submit(state, request_id, prompt, params, body.cache_salt)
    if body.stream:
        template = ChatCompletionChunk(id=request_id, model=state.model_name, choices=[])
        return _sse(_chat_chunks(state, stream, template, params.n, body.include_usage, plan), stream)
    final = await _final_output(stream, request)
    choices = [_chat_choice(state, o, plan) for o in final.outputs]
    response = ChatCompletionResponse(id=request_id, model=state.model_name, choices=choices, usage=_usage(state, final),
                                      prompt_logprobs=await _prompt_logprobs_off_loop(state, final))
    return JSONResponse(response.model_dump())


async def _chat_prompt(state: ServerState, body: ChatCompletionRequest) -> tuple[ToolPlan, SamplingParams, list[int]]:
    """The request's tool plan, sampling parameters and rendered prompt; APIError 400 naming a bad field."""
    tokenizer = state.tokenizer
    if tokenizer is None:
        raise APIError(400, "chat needs a tokenizer, and this server runs without one (--skip-tokenizer-init): "
                            "use /v1/completions with token ids")
    try:
        plan = plan_tools(body, state.tools, state.template_renders_tools)
        params = body.sampling_params(plan.constraint)
        # rendered and tokenized off the event loop (other requests keep streaming)
        prompt = await state.engine.prep.chat_token_ids(body.template_messages(), body.add_generation_prompt,
                                                        plan.template_tools, tokenizer,
                                                        template_kwargs=body.chat_template_kwargs)
    except ValueError as error:
        raise APIError.bad_request(error) from None
    name = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
    check_max_tokens(params.max_tokens, len(prompt), state.engine.prep.max_model_len, name)
    return plan, params, prompt


def _chat_choice(state: ServerState, o: CompletionOutput, plan: ToolPlan) -> ChatChoice:
    content, calls = extract(plan, o.text, o.finish_reason == "length") if plan.parses else (o.text, [])
    return ChatChoice(index=o.index, message=ResponseMessage(content=content, tool_calls=calls),
                      logprobs=_chat_logprobs(state, o.logprobs), stop_reason=o.stop_reason,
                      finish_reason=finish_reason(plan, o.finish_reason, bool(calls)))


def _chat_logprobs(state: ServerState, rows: list[Logprobs] | None) -> ChatLogprobs | None:
    if rows is None:
        return None
    return ChatLogprobs(content=[
        ChatLogprob(**_top(state, *row[0]).model_dump(), top_logprobs=[_top(state, t, lp) for t, lp in row[1:]])
        for row in rows
    ])


def _top(state: ServerState, token_id: int, logprob: float) -> TopLogprob:
    token = state.token_str(token_id)
    return TopLogprob(token=token, logprob=_finite(logprob), bytes=list(token.encode("utf-8")))


async def _chat_chunks(
    state: ServerState, stream: RequestStream, template: ChatCompletionChunk, n: int, include_usage: bool,
    plan: ToolPlan,
) -> AsyncIterator[str]:
    for i in range(n):
        choice = ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
        yield _event(template.model_copy(update={"choices": [choice]}))
    deltas = ChoiceDeltas()
    tool_streams = [ToolCallStream(plan) for _ in range(n)] if plan.parses else None
    async for out in stream:
        for o, rows in deltas.new(out):
            delta, reason = DeltaMessage(content=o.delta_text), o.finish_reason
            if tool_streams is not None:
                tool_stream = tool_streams[o.index]
                content, calls = tool_stream.feed(o.delta_text, bool(reason), reason == "length")
                if content is None and not calls and not reason and rows is None:
                    continue
                delta = DeltaMessage(content=content, tool_calls=calls or None)
                reason = finish_reason(plan, reason, tool_stream.called)
            choice = ChatChunkChoice(index=o.index, delta=delta, logprobs=_chat_logprobs(state, rows),
                                     finish_reason=reason, stop_reason=o.stop_reason)
            yield _event(template.model_copy(update={"choices": [choice]}))
    if include_usage:
        yield _event(template.model_copy(update={"choices": [], "usage": _usage(state, out)}))


# ---- OpenAI's Responses API: a chat request underneath (responses.py translates) ----------------------------
async def create_response(request: Request) -> Response:
    body = await _parse_body(request, ResponsesRequest)
    state = _state(request)
    _check_model(state, body.model)
    turn = ResponseTurn(body, state.model_name, state.responses)
    try:
        chat = turn.chat_request()
    except ValueError as error:
        raise renamed(APIError.bad_request(error)) from None
    try:
        plan, params, prompt = await _chat_prompt(state, chat)
        stream = await _submit(state, turn.id, prompt, params, None)
    except APIError as error:
        raise renamed(error) from None
    if body.stream:
        return _sse(turn.events(stream, plan), stream, done=False)
    return JSONResponse(turn.finish(await _final_output(stream, request), plan))


async def retrieve_response(request: Request, response_id: str) -> Response:
    """A stored response, as it was returned."""
    return JSONResponse(_state(request).responses.response(response_id))


# ---- vLLM's tokenizer endpoints ----------------------------------------------------------------------------
def _tokenizer(state: ServerState, endpoint: str) -> Tokenizer:
    if state.tokenizer is None:
        raise APIError(400, f"{endpoint} needs a tokenizer, and this server runs without one (--skip-tokenizer-init)")
    return state.tokenizer


async def tokenize(request: Request) -> Response:
    """vLLM's ``/tokenize``: a prompt's (or a rendered chat's) token ids, with ``max_model_len`` to compare."""
    body = await _parse_body(request, TokenizeRequest)
    state = _state(request)
    _check_model(state, body.model)
    tokenizer, prep = _tokenizer(state, "/tokenize"), state.engine.prep
    try:
        if body.messages is None:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await prep.tokenize(body.prompt, special)
        else:
            ids = await _chat_ids(prep, tokenizer, body)
    except ValueError as error:
        raise APIError.bad_request(error) from None
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    response = TokenizeResponse(count=len(ids), max_model_len=prep.max_model_len, tokens=ids, token_strs=strs)
    return JSONResponse(response.model_dump())


async def _chat_ids(prep: RequestPrep, tokenizer: Tokenizer, body: TokenizeRequest) -> list[int]:
    tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
    return await prep.chat_token_ids([m.template_dict() for m in body.messages], body.add_generation_prompt, tools,
                                     tokenizer, add_special_tokens=bool(body.add_special_tokens),
                                     template_kwargs=body.chat_template_kwargs)


async def detokenize(request: Request) -> Response:
    """vLLM's ``/detokenize``: the text of token ids (special tokens included)."""
    body = await _parse_body(request, DetokenizeRequest)
    state = _state(request)
    _check_model(state, body.model)
    tokenizer = _tokenizer(state, "/detokenize")
    vocab = tokenizer.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"tokens: token id {bad} is outside the tokenizer's vocabulary [0, {vocab})", "tokens")
    text = await asyncio.to_thread(tokenizer.decode, body.tokens, False)
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump())


async def tokenizer_info(request: Request) -> Response:
    """vLLM's ``/tokenizer_info``: the fields of the tokenizer's config clients read (lm-eval's remote tokenizer
    reads ``eos_token``, ``bos_token`` and ``chat_template``)."""
    state = _state(request)
    tokenizer = _tokenizer(state, "/tokenizer_info")
    return JSONResponse({
        "tokenizer_class": "PreTrainedTokenizerFast",  # built from the same files, with the same ids
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": None,
        "chat_template": tokenizer.chat_template,
        "model_max_length": state.engine.prep.max_model_len,
        "vocab_size": tokenizer.vocab_size,
    })


# ---- shared plumbing ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class ChoiceDeltas:
    """Which part of each choice a stream has sent: token counts, and the choices already finished."""

    sent_tokens: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)

    def new(self, out: RequestOutput) -> Iterator[tuple[CompletionOutput, list[Logprobs] | None]]:
        """Each choice with something new (text, its finish, or tokens when logprobs are on), with its new rows."""
        for o in out.outputs:
            if o.index in self.finished:
                continue
            start, end = self.sent_tokens.get(o.index, 0), len(o.token_ids)
            if not (o.delta_text or o.finish_reason or (o.logprobs is not None and end > start)):
                continue
            self.sent_tokens[o.index] = end
            if o.finish_reason:
                self.finished.add(o.index)
            yield o, None if o.logprobs is None else o.logprobs[start:end]


def _sse(events: AsyncIterator[str], *streams: RequestStream, done: bool = True) -> StreamingResponse:
    """``done``: end with ``data: [DONE]`` (the completion endpoints; the Responses API has no such event)."""
    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
            if done:
                yield "data: [DONE]\n\n"
        except EngineDeadError as error:
            yield _event(error_body(503, str(error)))
        finally:  # the client went away (cancellation) or we are done: either way free the requests
            for stream in streams:
                stream.abort()

    return StreamingResponse(body(), media_type="text/event-stream")


def _event(model) -> str:
    return f"data: {model.model_dump_json()}\n\n"


async def _final_output(stream: RequestStream, request: Request) -> RequestOutput:
    """The request's last output; aborts it if the client disconnects first."""
    return (await _final_outputs([stream], request))[0]


async def _final_outputs(streams: list[RequestStream], request: Request) -> list[RequestOutput]:
    """Each request's last output; aborts them all if the client disconnects first (or one fails)."""
    task = asyncio.ensure_future(asyncio.gather(*(_last(s) for s in streams)))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return _result(task)
            if await request.is_disconnected():
                raise APIError(499, "client disconnected")
    finally:
        task.cancel()
        for stream in streams:
            stream.abort()


def _result(task: asyncio.Future):
    try:
        return task.result()
    except EngineDeadError as error:
        raise APIError(503, str(error)) from None


async def _last(stream: RequestStream) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    return last


def _usage(state: ServerState, out: RequestOutput | None) -> UsageInfo:
    """A request's token counts (None: zeros, to sum several into); the cached prompt tokens too where the server
    reports them (``--enable-prompt-tokens-details``)."""
    prompt = 0 if out is None else len(out.prompt_token_ids)
    completion = 0 if out is None else sum(len(o.token_ids) for o in out.outputs)
    details = None
    if state.options.prompt_tokens_details:
        details = PromptTokensDetails(cached_tokens=0 if out is None else out.num_cached_tokens)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=details)

