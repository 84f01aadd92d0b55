"""``--data-parallel-backend ray``: the replicas as Ray actors, one placement-group bundle each, on any host of the
Ray cluster ``ray.init()`` finds (``RAY_ADDRESS``, a running ``ray start``) or a local one it starts.

A replica runs exactly what a local one runs (``replica.run_replica``); only its pipe differs: the front end listens
on a TCP socket (``multiprocessing.connection``, with a random key), and each actor connects back to it, so a
replica on another host talks to the front end as a local one does, and its death closes the connection the same
way. This package is shipped to the actors with the job (Ray's ``py_modules``).

Bundles: ``{"GPU": tp, "CPU": 1}`` per replica on GPUs (Ray sets each actor's ``CUDA_VISIBLE_DEVICES``), else
``{"CPU": c}`` with c the cluster's CPUs over N (at least 1; torch then runs c // 2 threads, at least 1).
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
from dataclasses import dataclass, replace
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

from hybridkv.server.replica import Placement, ReplicaSpec, run_replica

log = logging.getLogger("hybridkv.server")

CONNECT_TIMEOUT_S = 300.0  # an actor waiting for its bundle (a busy cluster) connects back late


class RayReplica:
    """The actor: connect back to the front end, say who it is, then run the replica on that connection."""

    def run(self, spec: ReplicaSpec, address: tuple[str, int], authkey: bytes) -> None:
        import ray

        conn = Client(address, authkey=authkey)
        conn.send(("hello", spec.placement.index, os.getpid()))
        run_replica(spec, conn, ray.util.get_node_ip_address())


@dataclass(slots=True)
class RayProcess:
    """A replica actor seen as a process (what the front end asks of one)."""

    actor: object
    ref: object  # the actor's ``run``: done when the replica has stopped or died
    pid: int | None = None
    exitcode: int | None = None  # never known: a dead actor says only that it is gone

    def is_alive(self) -> bool:
        import ray

        done, _ = ray.wait([self.ref], timeout=0)
        return not done

    def join(self, timeout: float | None = None) -> None:
        import ray

        ray.wait([self.ref], timeout=timeout)

    def kill(self) -> None:
        import ray

        ray.kill(self.actor)


def start_ray_replicas(specs: list[ReplicaSpec], tp: int, device: str) -> list[tuple[RayProcess, Connection]]:
    """One actor per spec, each in its own bundle of one placement group; their connections, in spec order.
    ``device`` auto: GPUs when the cluster has any (this host may have none)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    package = str(Path(__file__).resolve().parents[1])
    ray.init(ignore_reinit_error=True, runtime_env={"py_modules": [package]}, include_dashboard=False)
    n = len(specs)
    resources = ray.cluster_resources()
    on_gpu = device.startswith("cuda") or (device == "auto" and resources.get("GPU", 0) > 0)
    cpus = max(1, int(resources.get("CPU", n)) // n)
    bundle = {"GPU": tp, "CPU": 1} if on_gpu else {"CPU": cpus}
    group = placement_group([dict(bundle) for _ in range(n)], strategy="PACK")
    ray.get(group.ready(), timeout=CONNECT_TIMEOUT_S)
    authkey = secrets.token_bytes(32)
    listener = Listener((ray.util.get_node_ip_address(), 0), authkey=authkey)
    actor_class = ray.remote(RayReplica)
    processes = []
    for r, spec in enumerate(specs):
        if not on_gpu:  # Ray's CPUs are logical: the threads follow the bundle, not the host's cores
            spec = replace(spec, placement=Placement(r), config=replace(spec.config, cpu_threads=max(1, cpus // 2)))
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=r)
        actor = actor_class.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                                    scheduling_strategy=strategy, name=None).remote()
        processes.append(RayProcess(actor, actor.run.remote(spec, listener.address, authkey)))
    conns = _accept(listener, processes)
    listener.close()
    return [(processes[r], conns[r]) for r in range(n)]


def _accept(listener: Listener, processes: list[RayProcess]) -> dict[int, Connection]:
    """Each actor's connection by its index (they connect in any order); ValueError if one dies or is late."""
    arrived: queue.Queue = queue.Queue()

    def accept() -> None:
        for _ in processes:
            try:
                arrived.put(listener.accept())
            except OSError:  # closed: given up
                return

    threading.Thread(target=accept, name="ray-replicas-accept", daemon=True).start()
    conns: dict[int, Connection] = {}
    while len(conns) < len(processes):
        try:
            conn = arrived.get(timeout=CONNECT_TIMEOUT_S)
        except queue.Empty:
            raise ValueError(f"a Ray replica did not connect within {CONNECT_TIMEOUT_S:.0f} s") from None
        _, index, pid = conn.recv()
        processes[index].pid = pid
        conns[index] = conn
    return conns


def stop_ray() -> None:
    """Disconnect from the cluster (a local one ``ray.init`` started stops with it)."""
    import ray

    ray.shutdown()
