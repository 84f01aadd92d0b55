"""``hybridkv serve --data-parallel-size N``: N engine replicas, each its own process, behind one front end.

The front end is the usual app over ``DataParallelEngine``, which has ``AsyncEngine``'s interface (``prep``,
``add_request``, ``abort``, ``is_alive`` ...): each request goes to the replica the ``Router`` picks
(``router.py``), over that replica's pipe (``replica.py``), and its outputs come back the same way into the
request's queue, so streaming, aborts on disconnect and errors work as with one engine.

Cache-aware routing reads each replica's KV events, published over ZMQ in vLLM's wire format
(``engine/kv_events.py``): at ``--kv-events-config``'s endpoint offset by the replica's rank (vLLM's rule: a TCP
port plus the rank, an ipc path with ``_dp<rank>``), or, without that flag, on an ipc socket of the front end's
own (a TCP port under Ray: ``ray_replicas.py``). An external router subscribes to the same endpoints.

A replica that dies (its pipe closes, or its process is found gone within ``WATCH_S``) is taken out of rotation:
its requests in flight fail with ``EngineDeadError`` naming it (the server answers 503), the others keep serving.
When none is left the server stops, as with one dead engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import multiprocessing as mp
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.kv_events import decode_batch, parse_kv_events_config, replica_endpoint, subscriber_address
from hybridkv.engine.runtime import resolve_device
from hybridkv.engine.sampling_params import SamplingParams
from hybridkv.engine.structured_output import StructuredOutputs
from hybridkv.server.async_engine import _ACCEPTED, EngineDeadError, RequestPrep, RequestStream, accepted_stream
from hybridkv.server.replica import Placement, ReplicaInfo, ReplicaSpec, place_replicas, replica_config, run_replica
from hybridkv.server.router import Decision, Router, check_policy

log = logging.getLogger("hybridkv.server")

START_TIMEOUT_S = 1800.0  # a replica loading a large checkpoint
WATCH_S = 1.0  # how often the front end looks at the replica processes
METRICS_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 10.0


@dataclass(slots=True)
class _InFlight:
    replica: int
    decision: Decision
    queue: asyncio.Queue
    started: bool = False


@dataclass(slots=True)
class Replica:
    """The front end's handle on one replica process."""

    index: int
    placement: Placement
    process: mp.process.BaseProcess  # or, under Ray, a ``ray_replicas.RayProcess``
    conn: object  # a multiprocessing Connection: a pipe, or TCP under Ray
    info: ReplicaInfo | None = None
    failure: str | None = None  # why it is out of rotation; final
    requests: set[str] = field(default_factory=set)

    @property
    def alive(self) -> bool:
        return self.failure is None

    def send(self, msg: tuple) -> bool:
        try:
            self.conn.send(msg)
            return True
        except (OSError, ValueError):
            return False


@dataclass(slots=True)
class _Events:
    """Where the replicas' KV events are, and the front end's own directory for them (None: the user's)."""

    configs: list[str | None]  # each replica's --kv-events-config
    subscribe: list[str]  # where the router reads them (empty: it does not)
    own_dir: str | None = None


def plan_events(config: EngineConfig, n: int, policy: str) -> _Events:
    """Each replica's events config, and where the router subscribes: the user's endpoint offset by rank, or (routing
    cache-aware without one) a socket per replica of our own: ipc in a directory of ours, or, under Ray (replicas
    maybe on other hosts), TCP on ports free here. Subscriptions name 127.0.0.1; ``start`` puts each replica's host
    there."""
    user = parse_kv_events_config(config.kv_events_config)
    wants = policy == "cache-aware"
    if user.enabled:
        if wants and not user.publishes:
            raise ValueError('--routing-policy cache-aware reads the replicas\' KV events: --kv-events-config must '
                             'publish them (publisher "zmq")')
        configs = []
        for r in range(n):
            own = dataclasses.replace(user, endpoint=replica_endpoint(user.endpoint, r),
                                      replay_endpoint=None if user.replay_endpoint is None
                                      else replica_endpoint(user.replay_endpoint, r))
            configs.append(json.dumps(dataclasses.asdict(own)))
        subscribe = [subscriber_address(replica_endpoint(user.endpoint, r)) for r in range(n)] if wants else []
        return _Events(configs, subscribe)
    if not wants:
        return _Events([config.kv_events_config] * n, [])
    own_dir = None
    if config.data_parallel_backend == "ray":
        endpoints = [f"tcp://*:{port}" for port in _free_ports(n)]
    else:
        own_dir = tempfile.mkdtemp(prefix="hkv-", dir="/tmp")  # ipc paths must be short
        endpoints = [f"ipc://{own_dir}/kv_dp{r}" for r in range(n)]
    configs = [json.dumps({"enable_kv_cache_events": True, "endpoint": e}) for e in endpoints]
    return _Events(configs, [subscriber_address(e) for e in endpoints], own_dir)


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _placements(config: EngineConfig) -> list[Placement]:
    if config.data_parallel_backend == "ray":  # Ray places them (and sets each one's CUDA_VISIBLE_DEVICES)
        return [Placement(r, on_ray=True) for r in range(config.data_parallel_size)]
    device = resolve_device(config.device)
    gpus: list[str] = []
    if device.startswith("cuda"):
        import torch

        visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # the front end's own set, as the user restricted it
        gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    return place_replicas(config.data_parallel_size, config.tensor_parallel_size, device, gpus,
                          sorted(os.sched_getaffinity(0)))


class DataParallelEngine:
    """``AsyncEngine``'s interface over replica processes (see the module docstring)."""

    def __init__(self, replicas: list[Replica], router: Router, registry: CollectorRegistry,
                 events: _Events) -> None:
        info = replicas[0].info
        self.replicas = replicas
        self.router = router
        self.registry = registry
        self.events = events
        self.model_name = info.model_name
        structured = StructuredOutputs(info.tokenizer, info.vocab_size, info.eos_token_ids)
        self.prep = RequestPrep(info.tokenizer, info.max_model_len, info.checkpoint, structured)
        self.on_dead: Callable[[], None] | None = None
        self.failure: str | None = None
        self.live: dict[str, asyncio.Queue] = {}
        self._requests: dict[str, _InFlight] = {}
        self._stopping = False
        self._tasks: list[asyncio.Task] = []
        self._tokens = count()
        self._metrics_wait: dict[int, asyncio.Future] = {}
        self._zmq: zmq.asyncio.Context | None = None
        self._alive_gauge = Gauge("hybridkv:replica_alive", "1 while the replica is in rotation", ["engine"],
                                  registry=registry)
        self._pid_gauge = Gauge("hybridkv:replica_pid", "The replica's process id", ["engine"], registry=registry)
        for rep in replicas:
            self._alive_gauge.labels(str(rep.index)).set(1)
            self._pid_gauge.labels(str(rep.index)).set(rep.info.pid)

    # ---- start and stop ------------------------------------------------------------------------------
    @classmethod
    def launch(cls, config: EngineConfig, policy: str | None = None, served_model_name: str | None = None,
               log_level: str = "info") -> DataParallelEngine:
        """Start ``config.data_parallel_size`` replicas and wait until each has built its engine; ValueError (the
        others stopped) if one cannot."""
        n = config.data_parallel_size
        policy = check_policy(policy or "cache-aware")
        events = plan_events(config, n, policy)
        specs = [ReplicaSpec(p, replica_config(config, p.index, events.configs[p.index]), served_model_name, log_level)
                 for p in _placements(config)]
        replicas: list[Replica] = []
        try:
            if config.data_parallel_backend == "ray":
                from hybridkv.server.ray_replicas import start_ray_replicas

                started = start_ray_replicas(specs, config.tensor_parallel_size, config.device)
                replicas = [Replica(spec.placement.index, spec.placement, process, conn)
                            for spec, (process, conn) in zip(specs, started)]
            else:
                replicas = _start_processes(specs, replicas)
            for rep in replicas:
                rep.info = _wait_ready(rep)
        except BaseException:
            for rep in replicas:
                _stop_process(rep, 0.0)
            if config.data_parallel_backend == "ray":
                from hybridkv.server.ray_replicas import stop_ray

                stop_ray()
            if events.own_dir is not None:
                shutil.rmtree(events.own_dir, ignore_errors=True)
            raise
        info = replicas[0].info
        registry = CollectorRegistry(auto_describe=True)
        router = Router(policy, n, info.layout, info.hash_algorithm, info.num_usable_blocks, registry)
        return cls(replicas, router, registry, events)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        for rep in self.replicas:
            loop.add_reader(rep.conn.fileno(), self._read, rep)
        self._tasks.append(asyncio.ensure_future(self._watch()))
        if self.events.subscribe:
            self._zmq = zmq.asyncio.Context()
            for rep, address in zip(self.replicas, self.events.subscribe):
                address = address.replace("//127.0.0.1:", f"//{rep.info.host}:")  # a Ray replica's host
                self._tasks.append(asyncio.ensure_future(self._subscribe(rep.index, address)))

    def begin_shutdown(self) -> None:
        """Stop taking requests and fail those in flight (503); safe to call from a signal handler."""
        self._stopping = True
        self._fail(list(self._requests), "the server is shutting down")

    def shutdown(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop every replica (a stop message, then a kill after ``timeout``) and the subscriptions."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        for rep in self.replicas:
            rep.send(("stop",))
        for rep in self.replicas:
            _stop_process(rep, timeout)
        if self._zmq is not None:
            self._zmq.destroy(linger=0)
            self._zmq = None
        if self.events.own_dir is not None:
            shutil.rmtree(self.events.own_dir, ignore_errors=True)
        if any(rep.placement.on_ray for rep in self.replicas):
            from hybridkv.server.ray_replicas import stop_ray

            stop_ray()

    @property
    def is_alive(self) -> bool:
        """While any replica serves."""
        return not self._stopping and self.failure is None and any(rep.alive for rep in self.replicas)

    def summary_lines(self, model_name: str) -> list[str]:
        lines = [f"  data parallel: {len(self.replicas)} replicas, routing {self.router.policy}; replica 0:"]
        lines += self.replicas[0].info.summary
        lines += [f"  replica {rep.index}: pid {rep.info.pid}, " + _where(rep.placement) for rep in self.replicas]
        return lines

    # ---- requests (event loop) ------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          cache_salt: str | None = None) -> RequestStream:
        """Route a request and wait until its replica took it; raises the replica's ValueError if it refused."""
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running: {self.failure or 'it has stopped'}")
        ids = prompt if isinstance(prompt, list) else await self.prep.tokenize(prompt)
        try:
            decision = self.router.choose(ids, cache_salt)
        except ValueError as error:
            raise EngineDeadError(str(error)) from None
        rep = self.replicas[decision.replica]
        flight = _InFlight(rep.index, decision, asyncio.Queue())
        self._requests[request_id] = flight
        self.live[request_id] = flight.queue
        rep.requests.add(request_id)
        self.router.sent(decision)
        if not rep.send(("add", request_id, ids, params, cache_salt)):
            self._replica_down(rep, "its pipe is closed")
        return await accepted_stream(self, request_id, flight.queue)

    def abort(self, request_id: str) -> None:
        flight = self._forget(request_id)
        if flight is not None:
            self.replicas[flight.replica].send(("abort", request_id))

    def _forget(self, request_id: str) -> _InFlight | None:
        flight = self._requests.pop(request_id, None)
        self.live.pop(request_id, None)
        if flight is not None:
            self.replicas[flight.replica].requests.discard(request_id)
            self.router.finished(flight.decision, flight.started)
        return flight

    def _fail(self, request_ids: list[str], why: str) -> None:
        for rid in request_ids:
            flight = self._forget(rid)
            if flight is not None:
                flight.queue.put_nowait(EngineDeadError(why))

    # ---- from the replicas (event loop) -----------------------------------------------------------------
    def _read(self, rep: Replica) -> None:
        try:
            while rep.conn.poll():
                self._handle(rep, rep.conn.recv())
        except (EOFError, OSError):
            self._replica_down(rep, _exit_reason(rep.process))

    def _handle(self, rep: Replica, msg: tuple) -> None:
        kind = msg[0]
        if kind == "metrics":
            waiter = self._metrics_wait.pop(msg[1], None)
            if waiter is not None and not waiter.done():
                waiter.set_result(msg[2])
            return
        flight = self._requests.get(msg[1])
        if flight is None:  # aborted or failed meanwhile
            return
        if kind == "accepted":
            flight.queue.put_nowait(_ACCEPTED)
        elif kind == "out":
            out = msg[2]
            self.router.reported(rep.index, msg[3])
            if not flight.started:
                flight.started = True
                self.router.started(flight.decision)
            flight.queue.put_nowait(out)
            if out.finished:
                self._forget(msg[1])
        elif kind == "refused":
            self._forget(msg[1])
            flight.queue.put_nowait(ValueError(msg[2]))
        elif kind == "error":
            self._forget(msg[1])
            flight.queue.put_nowait(EngineDeadError(f"replica {rep.index}: {msg[2]}"))

    def _replica_down(self, rep: Replica, why: str) -> None:
        """Out of rotation for good: its requests fail naming it; with none left, the server stops."""
        if not rep.alive:
            return
        rep.failure = why
        if self._stopping:  # told to stop: not a failure
            return
        log.error("replica %d (pid %s) is dead: %s; %d requests in flight fail", rep.index, rep.process.pid, why,
                  len(rep.requests))
        with contextlib.suppress(ValueError, OSError, RuntimeError):  # a closed pipe, or no loop (shutting down)
            asyncio.get_running_loop().remove_reader(rep.conn.fileno())
        self.router.down(rep.index)
        self._alive_gauge.labels(str(rep.index)).set(0)
        self._fail(list(rep.requests), f"replica {rep.index} (pid {rep.process.pid}) died while running this "
                                       f"request ({why}); the other replicas keep serving")
        if not any(r.alive for r in self.replicas) and not self._stopping:
            self.failure = "every replica has died"
            if self.on_dead is not None:
                self.on_dead()

    async def _watch(self) -> None:
        """A replica whose process ended without its pipe closing (its children hold it) is found here."""
        while True:
            await asyncio.sleep(WATCH_S)
            for rep in self.replicas:
                if rep.alive and not rep.process.is_alive():
                    self._replica_down(rep, _exit_reason(rep.process))

    async def _subscribe(self, r: int, address: str) -> None:
        """Replica ``r``'s KV events into the router's view of its cache."""
        sock = self._zmq.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(address)
        expected = 0
        try:
            while self.replicas[r].alive:
                _, seq_bytes, payload = await sock.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                if seq > expected:
                    self.router.gap(r, seq - expected)
                expected = seq + 1
                _, events = decode_batch(payload)
                self.router.events(r, events)
        finally:
            sock.close(linger=0)

    # ---- metrics ----------------------------------------------------------------------------------------
    async def metrics_text(self) -> bytes:
        """Every live replica's metrics, labelled ``engine`` (as vLLM's data-parallel engines are), and the
        router's."""
        loop = asyncio.get_running_loop()
        asked: list[tuple[int, asyncio.Future]] = []
        for rep in self.replicas:
            if rep.alive:
                token = next(self._tokens)
                self._metrics_wait[token] = loop.create_future()
                if rep.send(("metrics", token)):
                    asked.append((rep.index, self._metrics_wait[token]))
        texts = []
        for index, waiter in asked:
            try:
                texts.append((index, await asyncio.wait_for(waiter, METRICS_TIMEOUT_S)))
            except asyncio.TimeoutError:
                log.warning("replica %d did not answer for /metrics within %.0f s", index, METRICS_TIMEOUT_S)
        return merged_metrics(texts, self.registry)


def merged_metrics(texts: list[tuple[int, bytes]], own: CollectorRegistry) -> bytes:
    """Replicas' exposition texts with an ``engine`` label each, one family per name, then ``own``'s metrics."""
    families: dict[str, Metric] = {}
    for index, text in texts:
        for family in text_string_to_metric_families(text.decode()):
            samples = [s._replace(labels={**s.labels, "engine": str(index)}) for s in family.samples]
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            merged.samples += samples

    class _Collected:
        def collect(self) -> list[Metric]:
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collected())
    return generate_latest(registry) + generate_latest(own)


def _start_processes(specs: list[ReplicaSpec], started: list[Replica]) -> list[Replica]:
    """One spawned process per spec, each with a pipe to the front end (appended to ``started`` as they start)."""
    ctx = mp.get_context("spawn")
    for spec in specs:
        parent, child = ctx.Pipe()
        index = spec.placement.index
        process = ctx.Process(target=run_replica, args=(spec, child), name=f"hybridkv-replica-{index}")
        process.start()
        child.close()  # the replica holds the only other end: its death closes the pipe
        started.append(Replica(index, spec.placement, process, parent))
    return started


def _wait_ready(rep: Replica) -> ReplicaInfo:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not rep.conn.poll(0.5):
        if not rep.process.is_alive():
            raise ValueError(f"replica {rep.index} exited while starting ({_exit_reason(rep.process)})")
        if time.monotonic() > deadline:
            raise ValueError(f"replica {rep.index} did not start within {START_TIMEOUT_S:.0f} s")
    try:
        msg = rep.conn.recv()
    except EOFError:
        raise ValueError(f"replica {rep.index} exited while starting ({_exit_reason(rep.process)})") from None
    if msg[0] == "failed":
        raise ValueError(f"replica {rep.index} could not start: {msg[1]}")
    return msg[1]


def _stop_process(rep: Replica, timeout: float) -> None:
    rep.process.join(timeout)
    if rep.process.is_alive():
        rep.process.kill()
        rep.process.join(5.0)
    rep.conn.close()


def _exit_reason(process: mp.process.BaseProcess) -> str:
    process.join(0.5)  # its exit code, once the pipe says it is gone
    code = process.exitcode
    if code is None:
        return "its connection to the front end closed"
    return f"killed by signal {-code}" if code < 0 else f"exited with status {code}"


def _where(p: Placement) -> str:
    if p.on_ray:
        return f"Ray actor in placement group bundle {p.index}"
    if p.cuda_devices is not None:
        return f"GPUs {p.cuda_devices}"
    return "every core" if p.cpu_cores is None else f"cores {','.join(map(str, p.cpu_cores))}"
