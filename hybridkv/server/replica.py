"""One data-parallel replica: its own process running the server's engine loop (``AsyncEngine``), fed over a pipe.

The front end (``data_parallel.py``) starts N of these with multiprocessing's spawn and talks to each over one
``multiprocessing.Pipe``. Messages are tuples, pickled:

    front end -> replica   ("add", request_id, prompt_ids, params, cache_salt)  ("abort", request_id)
                           ("metrics", token)  ("stop",)
    replica -> front end   ("ready", ReplicaInfo) or ("failed", why), once, when the engine is built
                           ("accepted", request_id)  ("refused", request_id, why)   (refused: the engine's ValueError)
                           ("out", request_id, RequestOutput, free_blocks)  ("error", request_id, why)
                           ("metrics", token, text)

Devices: replica r of ``tensor_parallel_size`` tp sees GPUs ``[r*tp, (r+1)*tp)`` of those the front end sees
(``CUDA_VISIBLE_DEVICES``, set in the replica before CUDA starts, so its tensor-parallel ranks use ``cuda:0 ..
cuda:tp-1`` of its own set); on the CPU it is pinned to its share of the cores, and torch's threads follow from
them (``cpu_threads``: half the cores it may use). A replica whose front end goes away stops.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection

from hybridkv.engine.config import EngineConfig
from hybridkv.kv.layout import KVLayout
from hybridkv.model.loading.tokenizer import Tokenizer

log = logging.getLogger("hybridkv.server")


@dataclass(slots=True)
class Placement:
    """Where replica ``index`` runs: its GPUs (a ``CUDA_VISIBLE_DEVICES`` value; None on the CPU) or its cores."""

    index: int
    cuda_devices: str | None = None
    cpu_cores: tuple[int, ...] | None = None  # None: every core the front end may use
    on_ray: bool = False  # a Ray actor: Ray chose its host and devices (``ray_replicas.py``)


@dataclass(slots=True)
class ReplicaSpec:
    placement: Placement
    config: EngineConfig  # the replica's own: data_parallel_size 1, its rank, its KV events endpoint
    served_model_name: str | None
    log_level: str = "info"


@dataclass(slots=True)
class ReplicaInfo:
    """What a built replica tells the front end, which holds no model: enough to tokenize, check and route."""

    pid: int
    model_name: str  # served as
    checkpoint: str
    tokenizer: Tokenizer | None
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    layout: KVLayout
    hash_algorithm: str
    num_usable_blocks: int
    summary: list[str]  # its lines of the startup summary
    host: str = "127.0.0.1"  # where its KV events are (a Ray replica's node)


def place_replicas(n: int, tp: int, device: str, visible_gpus: list[str], cores: list[int]) -> list[Placement]:
    """Each replica's devices. GPUs: ``tp`` consecutive ones each, of those visible; the CPU: an equal share of
    ``cores`` each when there are enough, else every replica on all of them.

    >>> [p.cuda_devices for p in place_replicas(2, 2, "cuda", ["0", "1", "2", "3"], [])]
    ['0,1', '2,3']
    >>> [p.cpu_cores for p in place_replicas(2, 1, "cpu", [], [0, 1, 2, 3])]
    [(0, 1), (2, 3)]
    """
    if device.startswith("cuda"):
        if n * tp > len(visible_gpus):
            raise ValueError(f"--data-parallel-size {n} x --tensor-parallel-size {tp} needs {n * tp} GPUs, and "
                             f"{len(visible_gpus)} are visible")
        return [Placement(r, cuda_devices=",".join(visible_gpus[r * tp:(r + 1) * tp])) for r in range(n)]
    share = len(cores) // n
    if share == 0:
        return [Placement(r) for r in range(n)]
    return [Placement(r, cpu_cores=tuple(cores[r * share:(r + 1) * share])) for r in range(n)]


def run_replica(spec: ReplicaSpec, conn: Connection, host: str = "127.0.0.1") -> None:
    """The replica process: build the engine, report, then serve the pipe until told to stop or the front end
    goes."""
    index = spec.placement.index
    logging.basicConfig(level=spec.log_level.upper(),
                        format=f"%(levelname)s %(asctime)s replica {index} %(name)s: %(message)s")
    if threading.current_thread() is threading.main_thread():  # (a Ray actor may run us on another thread)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the front end stops us
    _place(spec.placement)
    from hybridkv.engine.llm_engine import LLMEngine  # torch: after the devices are chosen

    try:
        engine = LLMEngine(spec.config)
    except Exception as error:  # noqa: BLE001 - the front end says why and stops
        conn.send(("failed", f"{type(error).__name__}: {error}"))
        return
    name = spec.served_model_name or engine.loaded.name
    conn.send(("ready", replace(_info(engine, name), host=host)))
    asyncio.run(_serve(engine, conn, name))


def _place(p: Placement) -> None:
    if p.cuda_devices is not None:
        # the replica's GPUs, before anything starts CUDA: its ranks count from cuda:0 within them
        os.environ["CUDA_VISIBLE_DEVICES"] = p.cuda_devices
    if p.cpu_cores is not None:
        os.sched_setaffinity(0, p.cpu_cores)


def _info(engine, name: str) -> ReplicaInfo:
    from hybridkv.server.summary import engine_lines

    return ReplicaInfo(os.getpid(), name, engine.loaded.name, engine.tokenizer, engine.max_model_len,
                       engine.model.cfg.vocab_size, engine.eos_token_ids, engine.layout,
                       engine.config.prefix_caching_hash_algo, engine.kv.pool.num_usable_blocks,
                       engine_lines(engine, name))


async def _serve(engine, conn: Connection, name: str) -> None:
    from hybridkv.server.async_engine import AsyncEngine
    from hybridkv.server.metrics import ServerMetrics

    metrics = ServerMetrics(name)
    metrics.update_engine_state(engine)
    async_engine = AsyncEngine(engine, metrics)
    loop = asyncio.get_running_loop()
    stop = loop.create_future()
    async_engine.on_dead = lambda: loop.call_soon_threadsafe(_set, stop)  # its requests got their errors
    async_engine.start()
    server = _ReplicaServer(async_engine, conn, engine.kv.pool.num_usable_blocks, stop)
    loop.add_reader(conn.fileno(), server.read)
    await stop
    loop.remove_reader(conn.fileno())
    async_engine.begin_shutdown()
    await asyncio.to_thread(async_engine.shutdown)


def _set(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class _ReplicaServer:
    """The pipe's end in the replica: one task per request, forwarding its outputs."""

    def __init__(self, engine, conn: Connection, usable_blocks: int, stop: asyncio.Future) -> None:
        self.engine = engine
        self.conn = conn
        self.usable_blocks = usable_blocks
        self.stop = stop
        self.tasks: dict[str, asyncio.Task] = {}

    def read(self) -> None:
        try:
            while self.conn.poll():
                self.handle(self.conn.recv())
        except (EOFError, OSError):  # the front end is gone
            _set(self.stop)

    def handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":
            rid = msg[1]
            self.tasks[rid] = asyncio.ensure_future(self.run(*msg[1:]))
        elif kind == "abort":
            task = self.tasks.pop(msg[1], None)
            if task is not None:
                task.cancel()
        elif kind == "metrics":
            self.send(("metrics", msg[1], self.engine.metrics.render()))
        elif kind == "stop":
            _set(self.stop)

    async def run(self, rid: str, prompt: list[int], params, cache_salt: str | None) -> None:
        from hybridkv.server.async_engine import EngineDeadError

        stream = None
        try:
            stream = await self.engine.add_request(rid, prompt, params, cache_salt)
            self.send(("accepted", rid))
            async for out in stream:
                free = round(self.engine.metrics.kv_free_share() * self.usable_blocks)
                self.send(("out", rid, out, free))
        except ValueError as error:
            self.send(("refused", rid, str(error)))
        except EngineDeadError as error:
            self.send(("error", rid, str(error)))
        except asyncio.CancelledError:
            pass  # aborted by the front end
        except Exception as error:  # noqa: BLE001 - this request fails, the replica goes on
            log.exception("request %s failed", rid)
            self.send(("error", rid, f"the replica could not run this request: {error!r}"))
        finally:
            if stream is not None:
                stream.abort()
            self.tasks.pop(rid, None)

    def send(self, msg: tuple) -> None:
        try:
            self.conn.send(msg)
        except (BrokenPipeError, OSError):  # the front end is gone
            _set(self.stop)


def replica_config(config: EngineConfig, index: int, kv_events_config: str | None) -> EngineConfig:
    """Replica ``index``'s engine config: one replica, its rank, its events endpoint."""
    return replace(config, data_parallel_size=1, data_parallel_rank=index, kv_events_config=kv_events_config)
