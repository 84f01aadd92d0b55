"""KV cache events on the wire as vLLM sends them, so routers that read vLLM's events (llm-d, NVIDIA Dynamo, vLLM's
production-stack) read hybridkv's unchanged.

The wire, as vLLM v0.26 sends it (``vllm/distributed/kv_events.py``, ``vllm/config/kv_events.py``):

- ZMQ PUB, one multipart message per engine step that changed the cache: ``(topic, seq, payload)``; ``seq`` is an
  8-byte big-endian counter from 0, ``payload`` msgpack.
- payload: ``KVEventBatch``, a positional array ``[ts, events, data_parallel_rank]``; each event a map tagged by its
  class name under ``"type"`` (vLLM PR #42892 dropped the positional events): ``BlockStored`` {block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys?, group_idx?,
  kv_cache_spec_kind?, kv_cache_spec_sliding_window?}, ``BlockRemoved`` {block_hashes, medium, group_idx?},
  ``AllBlocksCleared`` {}. Fields marked ? are left out when None (msgspec's ``omit_defaults``).
- block hashes as unsigned 64-bit ints: the last 8 bytes of the engine's hash, big-endian (vLLM's
  ``maybe_convert_block_hash``). Ours is xxh3_128 over the parent hash, the block's token ids and extra keys
  (``kv/block_hash.py``), vLLM's sha256 or xxhash over CBOR: equal within one engine, never across engines. Routers
  that key blocks by tokens (llm-d, Dynamo) use ``token_ids`` and the parent links, not the hash values.
- replay: with ``replay_endpoint``, a ROUTER socket; a request is one frame, the 8-byte big-endian first sequence
  wanted; the reply, per buffered batch from there, ``(topic, seq, payload)``, then ``(b"", -1 as 8 signed bytes,
  b"")`` (vLLM PR #45177 added the topic frame). ``buffer_steps`` batches are kept.

What hybridkv adds, as map keys vLLM's decoders ignore: ``kv_cache_spec_attention_chunk_size`` on a chunked group's
``BlockStored`` (vLLM's events give a chunked group's kind but not its chunk).

``--kv-events-config`` takes vLLM's JSON: ``'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557",
"replay_endpoint": "tcp://*:5558", "topic": "kv"}'``.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from itertools import count
from typing import Any

import msgspec
import zmq

from hybridkv.kv import events as kv
from hybridkv.kv.layout import KVLayout

# our spec kinds as vLLM's ``KVCacheSpecKind`` values
SPEC_KINDS = {"full": "full_attention", "sliding": "sliding_window", "chunked": "chunked_local_attention"}
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(slots=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig``: its keys, defaults and meaning (``publisher`` None: "zmq" when enabled)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(text: str | None) -> KVEventsConfig:
    """``--kv-events-config``'s JSON, checked key by key.

    >>> parse_kv_events_config('{"enable_kv_cache_events": true, "topic": "kv"}').publisher
    'zmq'
    """
    if not text:
        return KVEventsConfig()
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--kv-events-config is not valid JSON ({error.msg} at character {error.pos})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--kv-events-config must be a JSON object, got {type(raw).__name__}")
    known = {f.name: f for f in fields(KVEventsConfig)}
    for key, value in raw.items():
        if key not in known:
            raise ValueError(f"--kv-events-config: unknown key {key!r}; known keys: {', '.join(known)}")
        _check_value(key, value)
    config = KVEventsConfig(**raw)
    if config.publisher is None:
        config.publisher = "zmq" if config.enable_kv_cache_events else "null"
    return config


def _check_value(key: str, value: Any) -> None:
    if key == "enable_kv_cache_events":
        ok, want = isinstance(value, bool), "true or false"
    elif key == "publisher":
        ok, want = value in ("zmq", "null"), '"zmq" or "null"'
    elif key in ("buffer_steps", "hwm", "max_queue_size"):
        ok, want = isinstance(value, int) and not isinstance(value, bool) and value >= 1, "an integer >= 1"
    elif key == "replay_endpoint":
        ok, want = value is None or isinstance(value, str), "a ZMQ endpoint string or null"
    else:  # endpoint, topic
        ok, want = isinstance(value, str), "a string"
    if not ok:
        raise ValueError(f"--kv-events-config: {key} must be {want}, got {value!r}")


# ---- vLLM's structs, declared again (msgspec: the library vLLM encodes them with) ----------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Tagged by class name under "type"."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    kv_cache_spec_attention_chunk_size: int | None = None  # hybridkv's, ignored by vLLM's decoder


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


def wire_hash(block_hash: bytes) -> int:
    """vLLM's external block hash: the low 64 bits of the hash read big-endian.

    >>> wire_hash(bytes(8) + (5).to_bytes(8, "big"))
    5
    """
    return int.from_bytes(block_hash[-8:], "big")


class KVEventEncoder:
    """Our events -> one msgpack ``KVEventBatch``, each group described by its spec."""

    def __init__(self, layout: KVLayout, data_parallel_rank: int = 0) -> None:
        self.block_size = layout.block_size
        self.data_parallel_rank = data_parallel_rank
        self._groups = {g.group_id: _group_fields(g.spec) for g in layout.groups}
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, events: list[kv.KVEvent], ts: float) -> bytes:
        batch = EventBatch(ts, [self._wire(e) for e in events], self.data_parallel_rank)
        return self._encoder.encode(batch)

    def _wire(self, event: kv.KVEvent) -> KVCacheEvent:
        if type(event) is kv.BlockRemoved:
            return BlockRemoved([wire_hash(h) for h in event.block_hashes], event.medium, event.group_id)
        if type(event) is kv.AllBlocksCleared:
            return AllBlocksCleared()
        parent = event.parent_block_hash
        extra = None
        if event.cache_salt is not None:  # vLLM's extra keys: the salt on the sequence's first block only
            extra = [(event.cache_salt,)] + [None] * (len(event.block_hashes) - 1)
        kind, window, chunk = self._groups[event.group_id]
        return BlockStored(
            [wire_hash(h) for h in event.block_hashes], None if parent is None else wire_hash(parent),
            event.token_ids, self.block_size, None, event.medium, None, extra, event.group_id, kind, window, chunk)


def _group_fields(spec) -> tuple[str, int | None, int | None]:
    """(kind, sliding window, chunk) as the events carry them."""
    return (SPEC_KINDS.get(spec.kind, spec.kind), getattr(spec, "window", None), getattr(spec, "chunk", None))


class ZmqEventPublisher:
    """vLLM's PUB + ROUTER publisher: a thread owns both sockets, encodes and sends each batch, keeps the last
    ``buffer_steps`` for replay and answers replay requests between batches."""

    def __init__(self, config: KVEventsConfig, encoder: KVEventEncoder) -> None:
        self.config = config
        self._encoder = encoder
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        if _binds(config.endpoint):  # vLLM's rule: bind a wildcard or local endpoint, connect to a remote one
            self._pub.bind(config.endpoint)
        else:
            self._pub.connect(config.endpoint)
        self._replay = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self._topic = config.topic.encode()
        self._queue: queue.Queue[tuple[float, list] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = count()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[kv.KVEvent]) -> None:
        self._queue.put((time.time(), events))

    def flush(self) -> None:
        """Wait until every batch published so far is sent (and in the replay buffer)."""
        self._queue.join()

    def shutdown(self) -> None:
        """Send what is queued, then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout=5.0)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                self._queue.task_done()
                return
            seq, payload = next(self._seq), self._encoder.encode(item[1], item[0])
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self._queue.task_done()

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:  # identity, empty delimiter (REQ/DEALER), first sequence
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def replica_endpoint(endpoint: str, data_parallel_rank: int) -> str:
    """Replica ``data_parallel_rank``'s endpoint for a configured one, as vLLM offsets it: a TCP port plus the
    rank, an ipc/inproc path with ``_dp<rank>`` appended.

    >>> replica_endpoint("tcp://*:5557", 1), replica_endpoint("ipc:///tmp/kv", 1)
    ('tcp://*:5558', 'ipc:///tmp/kv_dp1')
    """
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"--kv-events-config: endpoint {endpoint!r} has no port to offset per replica")
        return f"{host}:{int(port) + data_parallel_rank}"
    return f"{endpoint}_dp{data_parallel_rank}"


def subscriber_address(endpoint: str) -> str:
    """Where a subscriber on this host connects to a publisher bound at ``endpoint`` (a wildcard host becomes the
    loopback); ValueError for an endpoint the publisher connects to rather than binds (no one here can subscribe).

    >>> subscriber_address("tcp://*:5557")
    'tcp://127.0.0.1:5557'
    """
    if not _binds(endpoint):
        raise ValueError(f"--kv-events-config: endpoint {endpoint!r} is one the engine connects to, so the "
                         "data-parallel router cannot subscribe to it; bind one (tcp://*:PORT or ipc://PATH)")
    return endpoint.replace("://*:", "://127.0.0.1:").replace("://[::]:", "://127.0.0.1:")


class WireBatch(msgspec.Struct, array_like=True, gc=False):
    """A ``KVEventBatch`` as a subscriber reads it, its events typed."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_BATCH_DECODER = msgspec.msgpack.Decoder(WireBatch)


def decode_batch(payload: bytes) -> tuple[int | None, list[kv.KVEvent]]:
    """A published payload back into our events (hashes as the wire's 8 bytes, big-endian), with the batch's
    data-parallel rank: what a router in this package reads.

    >>> enc = msgspec.msgpack.Encoder()
    >>> decode_batch(enc.encode(EventBatch(0.0, [BlockRemoved([7], "GPU", 1)], 2)))
    (2, [BlockRemoved(group_id=1, medium='GPU', block_hashes=[b'\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x07'])])
    """
    batch = _BATCH_DECODER.decode(payload)
    out: list[kv.KVEvent] = []
    for e in batch.events:
        if type(e) is AllBlocksCleared:
            out.append(kv.AllBlocksCleared())
            continue
        hashes = [h.to_bytes(8, "big") for h in e.block_hashes]
        group, medium = e.group_idx or 0, e.medium or kv.DEVICE_MEDIUM
        if type(e) is BlockRemoved:
            out.append(kv.BlockRemoved(group, medium, hashes))
        else:
            parent = None if e.parent_block_hash is None else e.parent_block_hash.to_bytes(8, "big")
            out.append(kv.BlockStored(group, medium, hashes, parent, e.token_ids))
    return batch.data_parallel_rank, out


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """The engine's side: drains the cache manager's events once per step and hands non-empty batches to the ZMQ
    publisher (the "null" publisher drops them, as vLLM's)."""

    def __init__(self, config: KVEventsConfig, layout: KVLayout, data_parallel_rank: int = 0) -> None:
        self.config = config
        encoder = KVEventEncoder(layout, data_parallel_rank)
        self._zmq = ZmqEventPublisher(config, encoder) if config.publishes else None

    def drain(self, log: kv.KVEventLog | None) -> None:
        """Take the step's events from ``log`` (None: events off) and send them, if any, as one batch."""
        if log is None:
            return
        events = log.take()
        if events and self._zmq is not None:
            self._zmq.publish(events)

    def flush(self) -> None:
        """Wait until every batch published so far is on the wire."""
        if self._zmq is not None:
            self._zmq.flush()

    def shutdown(self) -> None:
        if self._zmq is not None:
            self._zmq.shutdown()
            self._zmq = None
