"""The engine on one background thread, fed from asyncio.

Event loop -> engine: ``add_request`` / ``abort`` append to lists guarded by a ``threading.Condition`` and
notify it. Engine thread: takes everything queued, adds and aborts, runs one ``step()`` and hands each
``RequestOutput`` to its request's ``asyncio.Queue`` with ``loop.call_soon_threadsafe``; with nothing to do it
sleeps on the condition (waking only to write the periodic log line). All requests in flight share the
engine's continuous batch, however many clients send them.

A step that raises (a tensor-parallel rank died, a bug), or a tensor-parallel worker found dead while idle, kills
the engine for good: ``is_alive`` is False from the moment a worker process has ended (``/health`` answers 503),
every request in flight fails with ``EngineDeadError`` (the server answers 503), the workers are stopped, and only
then is ``on_dead`` called, so the server stops listening (and exits) last. ``begin_shutdown`` (SIGTERM) fails the
requests in flight at once, from the event loop, without waiting for the step in flight; ``shutdown`` gives that
step a moment, then abandons it.

Routes reach the engine only through ``AsyncEngine``: requests go in through ``add_request`` / ``abort``; what a
route reads or prepares before submitting (``max_model_len``, tokenizing, rendering a chat, compiling a grammar)
is ``AsyncEngine.prep`` (``RequestPrep``), which touches only what no step changes, from a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hybridkv.engine.llm_engine import LLMEngine, RequestOutput, chat_token_ids, tokenize
from hybridkv.engine.sampling_params import SamplingParams, StructuredOutputsParams
from hybridkv.engine.structured_output import StructuredOutputs
from hybridkv.model.loading.tokenizer import Tokenizer
from hybridkv.server.metrics import ServerMetrics
from hybridkv.server.summary import engine_lines

log = logging.getLogger("hybridkv.server")

_ACCEPTED = object()  # first item on a request's queue when the engine took it
SHUTDOWN_GRACE_S = 1.0  # how long shutdown waits for the step in flight (a long CPU prefill is abandoned)
WORKER_WATCH_S = 1.0  # how often an idle engine thread looks at its tensor-parallel workers


class EngineDeadError(RuntimeError):
    """The engine failed a step or shut down while the request was in flight."""


@dataclass(slots=True)
class _Channel:
    """The engine thread's handle on one request: where its outputs go, and its timing."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.monotonic)
    last_token_at: float | None = None
    tokens_seen: int = 0

    def put(self, item: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


@dataclass(slots=True)
class _Submission:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    cache_salt: str | None
    channel: _Channel


async def accepted_stream(owner: AsyncEngine, request_id: str, queue: asyncio.Queue) -> RequestStream:
    """A submitted request's stream once the engine (or a replica) has taken it: ``queue``'s first item says so, or is
    the error that refused it (raised here). Cancelled while waiting: the request is aborted. ``owner``: an engine
    with ``live`` (request id -> queue) and ``abort``."""
    try:
        first = await queue.get()
    except asyncio.CancelledError:
        owner.live.pop(request_id, None)
        owner.abort(request_id)
        raise
    if isinstance(first, BaseException):
        owner.live.pop(request_id, None)
        raise first
    return RequestStream(request_id, queue, owner)


class RequestStream:
    """Outputs of one accepted request, as an async iterator; ``abort()`` stops it (idempotent)."""

    def __init__(self, request_id: str, queue: asyncio.Queue, owner: AsyncEngine) -> None:
        self.request_id = request_id
        self._queue = queue
        self._owner = owner
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._finish()
            raise item
        if item.finished:
            self._finish()
        return item

    def abort(self) -> None:
        if not self.finished:
            self._finish()
            self._owner.abort(self.request_id)

    def _finish(self) -> None:
        self.finished = True
        self._owner.live.pop(self.request_id, None)


class RequestPrep:
    """What routes may call of the engine from the event loop: the limits fixed when it was built, and the work on
    a request before it is submitted, run in a worker thread (other requests keep streaming). Each reads only the
    tokenizer, ``max_model_len`` and xgrammar's compiler (which locks itself), none of which a step changes.

    Built from an engine (``of``), or from what a data-parallel replica reported (the front end holds no model)."""

    def __init__(self, tokenizer: Tokenizer | None, max_model_len: int, checkpoint: str,
                 structured_outputs: StructuredOutputs) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.checkpoint = checkpoint  # what was loaded (``/v1/models``' ``root``)
        self._structured_outputs = structured_outputs

    @classmethod
    def of(cls, engine: LLMEngine) -> RequestPrep:
        return cls(engine.tokenizer, engine.max_model_len, engine.loaded.name, engine.structured_outputs)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``llm_engine.tokenize``: refused (ValueError) when too long for ``max_model_len``."""
        return await asyncio.to_thread(tokenize, self.tokenizer, self.max_model_len, text, add_special_tokens)

    async def chat_token_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                             tools: list[dict] | None = None, tokenizer: Tokenizer | None = None,
                             add_special_tokens: bool = False, template_kwargs: dict | None = None) -> list[int]:
        """``llm_engine.chat_token_ids``: the conversation rendered by the chat template and tokenized."""
        return await asyncio.to_thread(chat_token_ids, tokenizer or self.tokenizer, self.max_model_len, messages,
                                       add_generation_prompt, tools, add_special_tokens, template_kwargs)

    async def compile_grammar(self, constraint: StructuredOutputsParams) -> None:
        """Compile a request's grammar, so that the engine thread finds it cached; ValueError if it is invalid."""
        await asyncio.to_thread(self._structured_outputs.compile, constraint)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics,
                 on_dead: Callable[[], None] | None = None) -> None:
        self.engine = engine  # the engine thread's: routes use ``prep``, ``add_request`` and ``abort``
        self.prep = RequestPrep.of(engine)
        self.metrics = metrics
        self.on_dead = on_dead  # called on the engine thread once a step has failed
        self.failure: str | None = None  # why the engine died; final
        self.live: dict[str, asyncio.Queue] = {}  # event loop only: the queue of every request not yet finished
        self._cond = threading.Condition()
        self._new: list[_Submission] = []
        self._aborts: list[str] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._channels: dict[str, _Channel] = {}  # engine thread only

    # ---- lifecycle (event loop) ---------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="hybridkv-engine", daemon=True)
        self._thread.start()

    def begin_shutdown(self) -> None:
        """Stop taking requests and fail those in flight now (503); safe to call from a signal handler."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_fail_queues, self.live, EngineDeadError("the server is shutting down"))

    def shutdown(self, timeout: float = SHUTDOWN_GRACE_S) -> None:
        """Stop the engine thread; a step still running after ``timeout`` is abandoned (the thread is a daemon)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("shutting down in the middle of an engine step: the step is abandoned")
                return
        self.engine.shutdown()  # tensor-parallel workers, if any

    def summary_lines(self, model_name: str) -> list[str]:
        """The startup summary's lines about the engine (``summary.py``)."""
        return engine_lines(self.engine, model_name)

    async def metrics_text(self) -> bytes:
        """``/metrics``: Prometheus' text format."""
        return self.metrics.render()

    @property
    def is_alive(self) -> bool:
        workers = self.engine.workers
        return (self._thread is not None and self._thread.is_alive() and self.failure is None
                and not self._stopping and (workers is None or workers.alive))

    # ---- requests (event loop) ----------------------------------------------------------------------------
    async def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> RequestStream:
        """Queue a request and wait until the engine took it; raises the engine's ValueError if it refused."""
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running: {self.failure or 'it has stopped'}")
        channel = _Channel(asyncio.get_running_loop(), asyncio.Queue())
        self.live[request_id] = channel.queue
        self._submit(_Submission(request_id, prompt, params, cache_salt, channel))
        return await accepted_stream(self, request_id, channel.queue)

    def abort(self, request_id: str) -> None:
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def _submit(self, submission: _Submission) -> None:
        with self._cond:
            self._new.append(submission)
            self._cond.notify()

    # ---- the engine thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._run_once():
                pass
        except Exception:  # noqa: BLE001 - the thread must report, not vanish
            log.exception("engine thread failed")
        finally:
            self._fail_all(EngineDeadError("the engine stopped"))

    def _run_once(self) -> bool:
        work = self._take_work()
        if work is None:
            return False
        workers = self.engine.workers
        if workers is not None and not workers.alive and workers.failure is None:  # died while idle
            failure = str(workers.fail(""))
            self._die(failure, EngineDeadError(f"the engine stopped: {failure}"))
            return False
        new, aborts = work
        for submission in new:  # adds first: an abort may name a request submitted in the same batch
            self._add(submission)
        for request_id in aborts:
            self._abort(request_id)
        if self.engine.has_unfinished_requests():
            if not self._step():
                return False
        else:
            self.metrics.update_engine_state(self.engine)
        self.metrics.maybe_log()
        return True

    def _take_work(self) -> tuple[list[_Submission], list[str]] | None:
        """Block until there is something to do (or a log line is due); None when shutting down."""
        with self._cond:
            while not (self._new or self._aborts or self._stopping or self.engine.has_unfinished_requests()):
                if not self._cond.wait(self._idle_wait()):
                    break  # time for the log line, or to look at the workers
            if self._stopping:
                return None
            new, self._new = self._new, []
            aborts, self._aborts = self._aborts, []
        return new, aborts

    def _idle_wait(self) -> float | None:
        wait = self.metrics.seconds_to_next_log()
        if self.engine.workers is None:
            return wait
        return WORKER_WATCH_S if wait is None else min(wait, WORKER_WATCH_S)

    def _add(self, sub: _Submission) -> None:
        try:
            self.engine.add_request(sub.request_id, sub.prompt, sub.params, sub.cache_salt)
        except ValueError as error:
            sub.channel.put(error)
            return
        except Exception as error:  # noqa: BLE001 - a bug in validation: this request fails, the engine goes on
            log.exception("adding request %s failed", sub.request_id)  # add_request queued nothing
            sub.channel.put(RuntimeError(f"the engine could not add this request: {error!r}"))
            return
        self._channels[sub.request_id] = sub.channel
        sub.channel.put(_ACCEPTED)

    def _abort(self, request_id: str) -> None:
        if self._channels.pop(request_id, None) is not None:
            self.engine.abort_request(request_id)

    def _step(self) -> bool:
        """One engine step; False when it failed (the engine is dead)."""
        try:
            scheduled = self.engine.schedule()
            self.metrics.update_engine_state(self.engine)  # the gauges show the step in flight, not the last one
            outputs = self.engine.execute(scheduled)
        except Exception as error:  # noqa: BLE001 - the engine's state is unknown now: it is dead, say so
            log.exception("engine step failed; the engine is dead, failing %d requests", len(self._channels))
            self._die(f"an engine step failed: {error}",
                      EngineDeadError(f"the engine failed while running this request ({error})"))
            return False
        self.metrics.update_engine_state(self.engine)  # before the outputs: a client that sees one sees this too
        now = time.monotonic()
        for out in outputs:
            channel = self._channels.get(out.request_id)
            if channel is None:
                continue
            self._record(channel, out, now)
            channel.put(out)
            if out.finished:
                del self._channels[out.request_id]
        return True

    def _die(self, failure: str, error: EngineDeadError) -> None:
        """The engine is dead for good: fail every request, stop the workers, then tell the server (which stops
        listening, so everything slow happens while ``/health`` still answers 503)."""
        log.error("the engine is dead: %s", failure)
        self.failure = failure
        self._fail_all(error)
        self.engine.shutdown()
        if self.on_dead is not None:
            self.on_dead()

    def _record(self, channel: _Channel, out: RequestOutput, now: float) -> None:
        total = sum(len(o.token_ids) for o in out.outputs)
        new = total - channel.tokens_seen
        if new > 0:
            if channel.last_token_at is None:
                self.metrics.on_first_token(now - channel.arrival, len(out.prompt_token_ids))
                self.metrics.on_tokens(new, None)
            else:
                self.metrics.on_tokens(new, now - channel.last_token_at)
            channel.last_token_at = now
            channel.tokens_seen = total
        if out.finished:
            self.metrics.on_finished(now - channel.arrival)

    def _fail_all(self, error: Exception) -> None:
        for request_id, channel in list(self._channels.items()):
            self.engine.abort_request(request_id)
            channel.put(error)
        self._channels.clear()
        with self._cond:
            pending, self._new = self._new, []
        for sub in pending:
            sub.channel.put(error)


def _fail_queues(live: dict[str, asyncio.Queue], error: Exception) -> None:
    """Every request in flight gets ``error`` (on the event loop: the queues are its)."""
    for queue in live.values():
        queue.put_nowait(error)
    live.clear()
