"""Which data-parallel replica serves a request: ``round-robin``, ``least-loaded`` or ``cache-aware``.

Cache-aware routing keeps, per replica, the blocks its KV events say are cached (``ResidentBlocks``: each
``BlockStored`` adds ``(hash, group)`` on its medium, each ``BlockRemoved`` takes it away, ``AllBlocksCleared``
empties it) and asks the KV cache manager's own lookup how much of the prompt that replica would resume from
(``KVCacheManager.resumable_tokens``: every group, windows included). On Gemma-3 a prompt whose full-layer blocks
are all cached but whose sliding window before the end was evicted resumes only where the window is still there,
on the router's view as on the replica.

Prompts routed to a replica and not finished count as cached there too (their blocks are on their way: a second
question sent while the first is still prefilling the document goes where that prefill is).

The replica with the least work wins::

    cost = (prompt tokens - resumable tokens)                 # what this request prefills there
         + LOAD_WEIGHT * (pending prefill tokens               # sent there and not started yet (no first output)
                          + RUNNING_COST_TOKENS * running)     # each decoding request shares every step
         + prompt tokens, if the free KV cache cannot hold the new blocks (it waits, or evicts others' prefixes)

Block 4, replica 0 holds a 24-token document (6 blocks), replica 1 nothing, both idle: a 30-token question about
the document costs 30 - 24 = 6 tokens on replica 0 and 30 on replica 1, so it goes to replica 0; with 60 prompt
tokens pending there it costs 6 + 30 = 36 and goes to replica 1. Equal costs go to the replica with fewer requests in
flight, then to the one with fewer blocks cached (an unrelated prompt evicts least there), then in turn.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from itertools import count
from typing import Iterable, Sequence

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client import Counter as PromCounter

from hybridkv.kv.cache_manager import KVCacheManager
from hybridkv.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from hybridkv.kv.layout import KVLayout
from hybridkv.kv.request import CacheRequest
from hybridkv.kv.specs import cdiv

log = logging.getLogger("hybridkv.server")

POLICIES = ("round-robin", "least-loaded", "cache-aware")
# a decoding request adds a token to every step: about what a short prompt chunk costs the requests behind it
RUNNING_COST_TOKENS = 16
# load counts half as much as this prompt's own prefill: a prefix hit saves the whole cluster work, a queue only
# delays (a replica twice as loaded still wins when its cache saves more than half its queue)
LOAD_WEIGHT = 0.5
_HASH_BYTES = 8  # blocks are keyed by the hash as the events carry it (its last 8 bytes)


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"--routing-policy: unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    return policy


@dataclass(slots=True)
class ResidentBlocks:
    """One replica's prefix cache as its events describe it: ``(hash, group)`` keys per medium (``GPU``, ``CPU``).

    >>> r = ResidentBlocks()
    >>> r.apply([BlockStored(0, "GPU", [b"h0", b"h1"], None, [])])
    >>> r.lookup((b"h1", 0)), r.lookup((b"h1", 1))
    (True, None)
    """

    by_medium: dict[str, set[tuple[bytes, int]]] = field(default_factory=dict)
    # prompts routed here and not finished: their blocks will be cached in every group once computed (a question
    # sent while the document's first question is still being prefilled goes where that prefill is)
    in_flight: Counter[bytes] = field(default_factory=Counter)

    def apply(self, events: Iterable[KVEvent]) -> None:
        for e in events:
            if type(e) is BlockStored:
                self.by_medium.setdefault(e.medium, set()).update((h[-_HASH_BYTES:], e.group_id)
                                                                   for h in e.block_hashes)
            elif type(e) is BlockRemoved:
                self.by_medium.get(e.medium, set()).difference_update((h[-_HASH_BYTES:], e.group_id)
                                                                       for h in e.block_hashes)
            elif type(e) is AllBlocksCleared:
                self.by_medium.clear()

    def expect(self, block_hashes: Sequence[bytes], sign: int = 1) -> None:
        """Count (``sign`` 1) or stop counting (-1) a routed prompt's blocks as on their way."""
        for h in block_hashes:
            self.in_flight[h[-_HASH_BYTES:]] += sign
        if sign < 0:
            self.in_flight = +self.in_flight  # drop the zeros

    def lookup(self, key: tuple[bytes, int]) -> bool | None:
        """The KV cache's ``Lookup`` over these blocks: True where a medium holds ``(hash, group)`` (the host tier's
        blocks count: the replica's lookup loads them) or a prompt in flight will, else None."""
        h = key[0][-_HASH_BYTES:]
        k = (h, key[1])
        return True if h in self.in_flight or any(k in blocks for blocks in self.by_medium.values()) else None

    def __len__(self) -> int:
        return sum(len(b) for b in self.by_medium.values())


@dataclass(slots=True)
class ReplicaLoad:
    """What the front end knows of a replica's load: its requests in flight, the prompt tokens sent and not yet
    started, and the last free-block count it reported."""

    in_flight: int = 0
    started: int = 0  # of ``in_flight``, those with a first output
    pending_prefill: int = 0
    free_blocks: int | None = None  # None: not reported yet (taken as enough)


@dataclass(slots=True)
class Decision:
    replica: int
    resumable_tokens: int  # of the prompt, on the chosen replica (cache-aware only; else 0)
    new_tokens: int  # the prompt tokens it prefills there
    block_hashes: list[bytes] = field(default_factory=list)  # the prompt's full blocks (cache-aware only)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry, policy: str) -> None:
        self.routed = PromCounter("hybridkv:router_requests", "Requests routed, by replica", ["engine", "policy"],
                              registry=registry)
        self.prompt_tokens = PromCounter("hybridkv:router_prompt_tokens", "Prompt tokens routed, by replica",
                                     ["engine"], registry=registry)
        self.resumable = PromCounter("hybridkv:router_resumable_tokens",
                                 "Prompt tokens the chosen replica's cache held as the router saw it", ["engine"],
                                 registry=registry)
        self.event_batches = PromCounter("hybridkv:router_kv_event_batches", "KV event batches read, by replica",
                                     ["engine"], registry=registry)
        self.event_gaps = PromCounter("hybridkv:router_kv_event_gaps",
                                  "Sequence gaps in a replica's KV events (batches lost)", ["engine"],
                                  registry=registry)
        self.resident = Gauge("hybridkv:router_resident_blocks", "Blocks the router sees cached, by replica",
                              ["engine"], registry=registry)
        self.policy = policy


class Router:
    """Picks a replica per request and keeps what it needs to: each replica's load and, cache-aware, its blocks.

    ``layout`` and ``hash_algorithm``: the replicas' (all alike), for the cache manager whose lookup scores them;
    ``num_usable_blocks``: each replica's pool."""

    def __init__(self, policy: str, num_replicas: int, layout: KVLayout, hash_algorithm: str,
                 num_usable_blocks: int, registry: CollectorRegistry) -> None:
        self.policy = check_policy(policy)
        self.block_size = layout.block_size
        self.num_usable_blocks = num_usable_blocks
        self.loads = [ReplicaLoad() for _ in range(num_replicas)]
        self.resident = [ResidentBlocks() for _ in range(num_replicas)]
        self.alive = [True] * num_replicas
        # a cache manager over 2 blocks: only its lookup logic is used, over each replica's ``ResidentBlocks``
        self._kv = KVCacheManager(layout, 2, hash_algorithm=hash_algorithm)
        self._turn = count()
        self._ids = count()
        self.metrics = RouterMetrics(registry, policy)

    # ---- decisions ----------------------------------------------------------------------------------
    def choose(self, prompt: list[int], cache_salt: str | None = None) -> Decision:
        """The replica for a prompt; ValueError when no replica is alive."""
        alive = [r for r, ok in enumerate(self.alive) if ok]
        if not alive:
            raise ValueError("no replica is alive")
        turn = next(self._turn)
        if self.policy == "round-robin":
            r = alive[turn % len(alive)]
            decision = Decision(r, 0, len(prompt))
        elif self.policy == "least-loaded":
            r = min(alive, key=lambda i: (self.loads[i].in_flight, self.loads[i].pending_prefill,
                                          (i - turn) % len(self.loads)))
            decision = Decision(r, 0, len(prompt))
        else:
            decision = self._cache_aware(prompt, cache_salt, alive, turn)
        self._record(decision, len(prompt))
        return decision

    def resumable_tokens(self, prompt: list[int], cache_salt: str | None = None) -> list[int]:
        """Per replica, the prompt tokens its cache would resume from, as its own lookup would find them."""
        return self._lookup(prompt, cache_salt)[0]

    def _lookup(self, prompt: list[int], cache_salt: str | None) -> tuple[list[int], list[bytes]]:
        req = CacheRequest(f"route-{next(self._ids)}", prompt, cache_salt=cache_salt)
        return [self._kv.resumable_tokens(req, blocks.lookup) for blocks in self.resident], req.block_hashes

    def _cache_aware(self, prompt: list[int], cache_salt: str | None, alive: list[int], turn: int) -> Decision:
        hits, block_hashes = self._lookup(prompt, cache_salt)
        n = len(self.loads)

        def key(r: int) -> tuple[int, int, int, int]:
            # ties: fewer requests in flight, then fewer blocks cached (a new prefix evicts least there)
            return self.cost(r, len(prompt), hits[r]), self.loads[r].in_flight, len(self.resident[r]), (r - turn) % n

        r = min(alive, key=key)
        return Decision(r, hits[r], len(prompt) - hits[r], block_hashes)

    def cost(self, replica: int, prompt_tokens: int, resumable: int) -> float:
        """Work on ``replica``, in prompt tokens, if it serves this prompt (see the module docstring)."""
        load = self.loads[replica]
        new = prompt_tokens - resumable
        cost = new + LOAD_WEIGHT * (load.pending_prefill + RUNNING_COST_TOKENS * load.started)
        if load.free_blocks is not None and cdiv(new, self.block_size) > load.free_blocks:
            cost += prompt_tokens
        return cost

    def _record(self, d: Decision, prompt_tokens: int) -> None:
        engine = str(d.replica)
        self.metrics.routed.labels(engine, self.policy).inc()
        self.metrics.prompt_tokens.labels(engine).inc(prompt_tokens)
        self.metrics.resumable.labels(engine).inc(d.resumable_tokens)

    # ---- what the front end tells it ----------------------------------------------------------------
    def sent(self, d: Decision) -> None:
        load = self.loads[d.replica]
        load.in_flight += 1
        load.pending_prefill += d.new_tokens
        self.resident[d.replica].expect(d.block_hashes)

    def started(self, d: Decision) -> None:
        """The request's first output came back: its prefill is done."""
        load = self.loads[d.replica]
        load.started += 1
        load.pending_prefill -= d.new_tokens

    def finished(self, d: Decision, started: bool) -> None:
        """The request finished, failed or was aborted: its blocks are in the replica's events from now on."""
        load = self.loads[d.replica]
        load.in_flight -= 1
        self.resident[d.replica].expect(d.block_hashes, -1)
        if started:
            load.started -= 1
        else:
            load.pending_prefill -= d.new_tokens

    def reported(self, replica: int, free_blocks: int) -> None:
        self.loads[replica].free_blocks = free_blocks

    def events(self, replica: int, events: list[KVEvent]) -> None:
        self.resident[replica].apply(events)
        self.metrics.event_batches.labels(str(replica)).inc()
        self.metrics.resident.labels(str(replica)).set(len(self.resident[replica]))

    def gap(self, replica: int, missing: int) -> None:
        """``missing`` batches of the replica's events were lost (ZMQ dropped them): its view may be stale until
        the blocks are stored or removed again."""
        log.warning("replica %d: %d KV event batches lost; its cache view may be stale", replica, missing)
        self.metrics.event_gaps.labels(str(replica)).inc(missing)

    def down(self, replica: int) -> None:
        """Out of rotation for good; its view is dropped."""
        self.alive[replica] = False
        self.resident[replica] = ResidentBlocks()
