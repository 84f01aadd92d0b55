"""Tensor-parallel worker processes and the driver's handle on them.

Process layout: rank 0 is the driver, the process that built the engine. It owns the scheduler, the block tables
(one ``KVCacheManager``, sized for one rank's KV heads: every rank's cache has the same blocks) and the sampler,
and runs rank 0's shard of the forward. Ranks 1..N-1 are spawned worker processes: each loads only its shard,
allocates its own KV heads' cache, then loops: receive a ``StepInput`` on its pipe, run it. The collectives inside
the forward (all-reduces, the logits gather to rank 0) go through torch.distributed: gloo on CPU, NCCL on CUDA.

Per step the driver sends each worker one pickled ``StepInput``: token ids, per sequence the cached and new
token counts and block tables, and which rows to compute logits for. A pipe rather than a collective, because a
worker idles there for as long as the engine has no work, where a collective would time out.

Failure: a worker that raises sends its traceback up its pipe and exits. The driver sees a dead worker before a
step (liveness check), inside a step (gloo raises at once when a peer's sockets close; a hung peer raises after
``distributed_timeout_s``), or while starting (pipe waits that also watch the process sentinel, with a timeout).
It then kills every worker and raises ``TensorParallelError`` naming the rank and what happened to it. A worker
whose driver dies reads EOF on its pipe, or fails its next collective, and exits.
"""

from __future__ import annotations

import contextlib
import signal
import time
import traceback
import weakref
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridkv.engine.block_copier import BlockCopier
from hybridkv.engine.config import EngineConfig
from hybridkv.engine.model_runner import ModelRunner, StepInput, StepOutput
from hybridkv.engine.runtime import build_runtime, rank_layout
from hybridkv.model.architectures.parallel import TPGroup
from hybridkv.model.attention.base import PagedAttentionBackend
from hybridkv.model.attention.factory import AttentionChoice
from hybridkv.model.loading.checkpoint import load_checkpoint

_HOST = "127.0.0.1"
_SPIN_S = 0.05  # a GPU worker polls its pipe this long after a step: decode steps come every few milliseconds
_GRACE_S = 2.0  # how long a failing step waits for a dying worker to be reaped, so the error can name it
# Start-up (importing torch, loading a shard) takes as long as it takes; a worker that dies meanwhile is seen at
# once through its process sentinel, so this bound only catches one that hangs.
_START_TIMEOUT_S = 1800.0


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died, raised or hung; the engine's workers are shut down and it cannot step again."""


@dataclass(slots=True)
class WorkerSpec:
    """What a worker rank is started with: the engine's whole config (so a new knob reaches the workers by itself)
    and what rank 0 resolved from it, which every rank must share."""

    config: EngineConfig  # its device resolved (cpu or cuda)
    dtype: torch.dtype
    kv_dtype: str
    num_blocks: int
    max_model_len: int  # the driver's, which sizes the decode graphs' block tables
    one_shot: bool  # small all-reduces one-shot over peer memory (decided by the driver: see collectives.py)
    rank: int = 0
    port: int = 0  # of the driver's TCPStore, where ranks meet
    host_blocks: int = 0  # host tier pages per rank (each rank keeps its own heads' pages)
    # (rows, hidden) of a prefill half's message when its all-reduces run on the copy engines; (0, 0): they do not
    sum_slots: tuple[int, int] = (0, 0)

    @property
    def size(self) -> int:
        return self.config.tensor_parallel_size

    @property
    def copy_sums(self) -> tuple[int, int, torch.dtype] | None:
        """``TPGroup.connect``'s ``sum_slots``."""
        return (*self.sum_slots, self.dtype) if self.sum_slots[0] else None

    @property
    def timeout_s(self) -> float:
        return self.config.distributed_timeout_s

    @property
    def device(self) -> str:
        return self.config.device


@dataclass(slots=True)
class RankCall:
    """Sent to every worker in place of a step: run ``fn(its runner, *args)``, as rank 0 does at the same time,
    and send the result back (vLLM's ``collective_rpc``). Capturing the decode CUDA graphs is one: it runs
    forwards, and so the collectives inside them, on every rank together. ``fn`` must pickle (a module-level
    function or a class's method)."""

    fn: Callable
    args: tuple = ()


def device_for_rank(device: str, rank: int) -> str:
    return f"cuda:{rank}" if device.startswith("cuda") else device


def _worker_main(spec: WorkerSpec, conn: Connection) -> None:
    torch.set_num_threads(1)  # ranks share the machine's cores: one thread each keeps them from oversubscribing
    try:
        tp = TPGroup(spec.rank, spec.size)
        conn.send(("hello", None))
        store = dist.TCPStore(_HOST, spec.port, spec.size, False, timeout=timedelta(seconds=spec.timeout_s))
        backend = "gloo"
        if spec.device.startswith("cuda"):
            backend = "nccl"
            torch.cuda.set_device(device_for_rank(spec.device, spec.rank))
        tp.connect(store, backend, spec.timeout_s, spec.one_shot, spec.copy_sums)
        runner = _build_runner(spec, tp)
        conn.send(("ready", None))
        spin_s = _SPIN_S if spec.device.startswith("cuda") else 0.0
        while (step := _receive(conn, spin_s)) is not None:
            if isinstance(step, RankCall):
                conn.send(("result", step.fn(runner, *step.args)))
            else:
                runner.execute(step)
        tp.leave()
    except EOFError:
        return  # the driver is gone: nothing left to serve
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
        raise SystemExit(1)


def _receive(conn: Connection, spin_s: float):
    """The next message, polled for up to ``spin_s`` before sleeping on the pipe: rank 0's decode graph waits at
    its first all-reduce for this rank to launch its own, and a process woken from sleep starts tens of
    microseconds later (vLLM's workers poll their message queue too). A GPU rank burns a core while steps come;
    idle, it sleeps."""
    deadline = time.perf_counter() + spin_s
    while spin_s and not conn.poll() and time.perf_counter() < deadline:
        pass
    return conn.recv()


def _build_runner(spec: WorkerSpec, tp: TPGroup) -> ModelRunner:
    c, device = spec.config, device_for_rank(spec.device, spec.rank)
    loaded = load_checkpoint(c.model, spec.dtype, progress=False, tokenizer=False, tp=tp, load_format=c.load_format,
                             device=device, seed=c.seed, quantization=c.quantization)
    model = loaded.model.place(device, spec.dtype)
    # the same layout and block count as the driver's, so its block tables address this rank's cache
    layout = rank_layout(loaded.hf_config, tp.size, spec.kv_dtype, c.block_size)
    attention = AttentionChoice(c.attention_backend, device, spec.kv_dtype, spec.dtype, c.fp8_attention_compute)
    return build_runtime(model, layout, spec.num_blocks, attention, host_blocks=spec.host_blocks,
                         halves_from_tokens=c.prefill_overlap_tokens).runner


class TPWorkers:
    """The driver's side: spawn ranks 1..N-1, join them, send each step, detect failure, shut down."""

    def __init__(self, spec: WorkerSpec, tp: TPGroup) -> None:
        """``spec`` as for rank 0 (its rank and port are replaced per worker); returns once every rank is ready."""
        if dist.is_initialized():
            raise ValueError("torch.distributed is already initialised in this process: one tensor-parallel engine "
                             "per process (shut the other one down first)")
        self.timeout_s = spec.timeout_s
        self.failure: str | None = None
        self.worker_errors: dict[int, str] = {}  # rank -> the traceback it sent before exiting
        ctx = mp.get_context("spawn")
        # port 0: the OS picks a free port for the store, so no port is guessed and none can be taken meanwhile
        timeout = timedelta(seconds=spec.timeout_s)
        store = dist.TCPStore(_HOST, 0, tp.size, True, timeout=timeout, wait_for_workers=False)
        self.procs, self.conns = [], []
        for rank in range(1, tp.size):
            parent, child = ctx.Pipe()
            worker = replace(spec, rank=rank, port=store.port)
            proc = ctx.Process(target=_worker_main, args=(worker, child), name=f"hybridkv-tp{rank}", daemon=True)
            proc.start()
            child.close()  # only the worker holds its end: its exit shows up here as EOF
            self.procs.append(proc)
            self.conns.append(parent)
        self._stop = weakref.finalize(self, _stop_workers, self.procs, self.conns, tp)
        try:
            self._expect("hello")  # every worker is up before rank 0 blocks in the group's rendezvous
            tp.connect(store, "nccl" if spec.device.startswith("cuda") else "gloo", spec.timeout_s, spec.one_shot,
                       spec.copy_sums)
            self._expect("ready")
        except TensorParallelError:
            raise
        except BaseException as e:
            raise self.fail(f"starting the workers failed on rank 0: {e!r}") from e

    # ---- steps ------------------------------------------------------------------------------------
    def run(self, step: StepInput | RankCall, execute: Callable[[StepInput], torch.Tensor],
            sent: StepInput | None = None) -> torch.Tensor:
        """Send ``step`` (or its lighter twin ``sent``) to every worker and run rank 0's part with ``execute``;
        what it returns comes back."""
        if self.failure is not None:
            raise TensorParallelError(f"this engine cannot step: its tensor-parallel workers are gone ({self.failure})")
        if not all(p.is_alive() for p in self.procs):
            raise self.fail("")
        try:
            message = ForkingPickler.dumps(step if sent is None else sent)  # pickled once for every worker
            for conn in self.conns:
                conn.send_bytes(message)
            return execute(step)
        except BaseException as e:  # the workers may be waiting in a collective rank 0 will never join
            error = self.fail(f"rank 0 failed: {e!r}")
            if not isinstance(e, Exception):
                raise  # KeyboardInterrupt and the like stay what they are
            raise error from e

    def call(self, call: RankCall, runner: ModelRunner) -> list:
        """``call`` on every rank (rank 0 with ``runner``); every rank's result, by rank."""
        first = self.run(call, lambda c: c.fn(runner, *c.args))
        try:
            return [first, *self._expect("result")]
        except TensorParallelError:
            raise
        except BaseException as e:
            raise self.fail(f"collecting the ranks' results failed: {e!r}") from e

    def _expect(self, what: str) -> list:
        """Each worker's next message, which must be ``what``; their payloads by rank."""
        payloads = []
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), 1):
            timeout = max(self.timeout_s, _START_TIMEOUT_S)
            if conn not in wait([conn, proc.sentinel], timeout):
                raise self.fail(f"rank {rank} sent no {what!r} within {timeout:g} s" if proc.is_alive() else "")
            try:
                kind, payload = conn.recv()
            except EOFError:
                raise self.fail("") from None
            if kind == "error":
                self.worker_errors[rank] = payload
            if kind != what:
                raise self.fail(f"rank {rank} sent {kind!r}, not {what!r}")
            payloads.append(payload)
        return payloads

    # ---- failure and shutdown ---------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """No worker has ended and none has failed. Read from the processes' sentinels, so any thread may ask
        (``/health`` does, while the engine thread steps): nothing is reaped."""
        return self.failure is None and not wait([p.sentinel for p in self.procs], 0)

    def fail(self, reason: str) -> TensorParallelError:
        """Kill every worker and return the error to raise, naming each rank that died or raised first."""
        sentinels = [p.sentinel for p in self.procs]
        for ended in wait(sentinels, _GRACE_S):  # a worker dying right now closes its files a moment before
            self.procs[sentinels.index(ended)].join(_GRACE_S)  # its exit status exists: wait for that too
        causes = [c for c in (self._worker_cause(r) for r in range(1, len(self.procs) + 1)) if c]
        if causes:  # a worker's death explains rank 0's failed collective better than gloo's message does
            reason = "; ".join(causes)
        self.failure = reason or "a worker stopped"
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        self._stop()
        return TensorParallelError(f"tensor parallelism failed: {self.failure}; every worker was shut down")

    def _worker_cause(self, rank: int) -> str:
        proc, conn = self.procs[rank - 1], self.conns[rank - 1]
        with contextlib.suppress(EOFError, OSError):
            while rank not in self.worker_errors and conn.poll():
                kind, payload = conn.recv()
                if kind == "error":
                    self.worker_errors[rank] = payload
        if rank in self.worker_errors:
            return f"rank {rank} raised:\n{self.worker_errors[rank]}"
        if proc.is_alive():
            return ""
        code = proc.exitcode
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        return f"rank {rank} (pid {proc.pid}) {how}"

    def shutdown(self) -> None:
        """Stop every worker (asked first, killed if it does not go) and leave the process group. Idempotent."""
        self.failure = self.failure or "the engine was shut down"
        self._stop()


def _stop_workers(procs: list, conns: list[Connection], tp: TPGroup) -> None:
    # a finalizer: holds no reference to the TPWorkers, so it also runs when an engine is dropped unclosed
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.send(None)
    for proc in procs:
        proc.join(5.0)
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)
    for conn in conns:
        conn.close()
    tp.leave()


class TPDriverRunner(ModelRunner):
    """Rank 0's runner: each step it prepares goes to every worker, then runs here."""

    def __init__(self, model: torch.nn.Module, kv, backend: PagedAttentionBackend, workers: TPWorkers,
                 copier: BlockCopier | None = None, halves_from_tokens: int = 0) -> None:
        super().__init__(model, kv, backend, copier, halves_from_tokens)
        self.workers = workers
        self.sent_versions: list[int] = []  # per decode-graph row, the ``tables_version`` the workers hold

    def run(self, out, device_input_ids: torch.Tensor | None = None) -> StepOutput:
        """As ``ModelRunner.run``; with ``device_input_ids`` (async scheduling) every rank takes them from this one
        at the step's start (``StepInput.ids_from_rank0``)."""
        step = self.prepare(out)
        step.device_input_ids, step.ids_from_rank0 = device_input_ids, device_input_ids is not None
        return self.workers.run(step, self.execute, self._for_workers(step))

    def _for_workers(self, step: StepInput) -> StepInput:
        """``step`` as the workers get it: without rank 0's device tensors, and a graph step carries a row's block
        tables only when their version is new to the workers, whose decode buffers keep the rest
        (``begin_static_decode`` writes a row's tables only when its version changed, on every rank alike). At 5M of
        context one sequence's tables are ~1 MB of pickle a step; through a pipe that was a 3 ms round trip on a
        loaded 2-core machine, 0.5 ms at 1M."""
        if step.device_input_ids is not None:
            step = replace(step, device_input_ids=None)
        if self.graph_bucket(step) is None:
            return step
        seqs = []
        for row, s in enumerate(step.seqs):
            known = s.tables_version != 0 and s.tables_version == self.sent_versions[row]
            self.sent_versions[row] = s.tables_version
            seqs.append(replace(s, block_tables=[]) if known else s)
        return replace(step, seqs=seqs)

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> bool:
        """Every rank captures the same batch buckets in the same order (their collectives pair up), then replays
        the same bucket each step: each rank picks it from the same ``StepInput``."""
        if not self.can_capture:
            return False
        captured = all(self.call_on_ranks(ModelRunner.capture_decode_graphs, max_num_seqs, max_model_len))
        if captured:
            self.sent_versions = [0] * self.graphs.max_seqs
        return captured

    def call_on_ranks(self, fn: Callable, *args) -> list:
        """``fn(runner, *args)`` on every rank; their results by rank."""
        return self.workers.call(RankCall(fn, args), self)
