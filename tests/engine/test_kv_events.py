"""KV cache events through the whole engine, read the way a router reads vLLM's: a ZMQ SUB socket, vLLM's structs
(declared again here exactly as vLLM v0.26 declares them, no hybridkv field) and its replay socket."""

from __future__ import annotations

import shutil
import tempfile
import time
from typing import Any

import msgspec
import pytest
import zmq
from tiny_models import random_prompts

from hybridkv import LLM, SamplingParams
from hybridkv.engine.kv_events import parse_kv_events_config, wire_hash
from hybridkv.kv.block_hash import BlockHasher


# ---- vLLM's definitions (vllm/distributed/kv_events.py, v0.26) ------------------------------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
BS = 4


@pytest.fixture
def endpoints():
    d = tempfile.mkdtemp(dir="/tmp")  # ipc paths must be short
    yield f"ipc://{d}/pub", f"ipc://{d}/replay"
    shutil.rmtree(d, ignore_errors=True)


def events_llm(path: str, endpoints, **kw) -> LLM:
    config = (f'{{"enable_kv_cache_events": true, "endpoint": "{endpoints[0]}", '
              f'"replay_endpoint": "{endpoints[1]}", "topic": "kv"}}')
    return LLM(model=path, block_size=BS, kv_events_config=config, **kw)


def subscribe(endpoint: str) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    time.sleep(0.5)  # a PUB drops what it sends before the subscription reached it
    return sub


def receive_all(sub: zmq.Socket) -> list[tuple[int, KVEventBatch]]:
    out = []
    while sub.poll(500):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv" and len(seq) == 8
        out.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
    return out


def replay(endpoint: str, first: int) -> list[tuple[int, bytes]]:
    req = zmq.Context.instance().socket(zmq.DEALER)
    req.connect(endpoint)
    req.send_multipart((b"", first.to_bytes(8, "big")))
    out = []
    while req.poll(5000):
        _, topic, seq, payload = req.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == -1:
            assert topic == b"" and payload == b""
            break
        assert topic == b"kv"
        out.append((int.from_bytes(seq, "big"), payload))
    req.close(linger=0)
    return out


def resident(batches) -> set[tuple[int, int, str]]:
    """(hash, group, medium) of every block the events say a lookup finds now."""
    held: set[tuple[int, int, str]] = set()
    for _, batch in batches:
        for e in batch.events:
            if isinstance(e, AllBlocksCleared):
                held.clear()
            elif isinstance(e, BlockStored):
                held |= {(h, e.group_idx, e.medium) for h in e.block_hashes}
            else:
                assert all((h, e.group_idx, e.medium) in held for h in e.block_hashes), "removed a block never stored"
                held -= {(h, e.group_idx, e.medium) for h in e.block_hashes}
    return held


def engine_index(llm: LLM) -> set[tuple[int, int, str]]:
    kv = llm.engine.kv
    out = {(wire_hash(h), g, "GPU") for h, g in kv.pool._cached}
    if kv.host is not None:
        out |= {(wire_hash(h), g, "CPU") for h, g in kv.host._slots}
    return out


def test_two_requests_with_a_shared_prefix_publish_their_chains_once(tiny_model, endpoints):
    llm = events_llm(str(tiny_model("llama3").path), endpoints)
    sub = subscribe(endpoints[0])
    shared, a_tail, b_tail = random_prompts([12, 5, 6], seed=3)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    sequences = []
    for prompt in (shared + a_tail, shared + b_tail):
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        sequences.append(prompt + out.outputs[0].token_ids)
    llm.engine.kv_events.flush()
    live = receive_all(sub)

    seqs = [s for s, _ in live]
    assert seqs == list(range(len(seqs))) and len(seqs) >= 2
    assert all(b.data_parallel_rank == 0 for _, b in live)
    stored = [e for _, b in live for e in b.events if isinstance(e, BlockStored)]
    assert {e.medium for e in stored} == {"GPU"} and {e.group_idx for e in stored} == {0}
    assert {e.kv_cache_spec_kind for e in stored} == {"full_attention"} and {e.block_size for e in stored} == {BS}

    # every stored block, chained: its parent is the block before it, its tokens the request's
    by_hash: dict[int, tuple[int | None, list[int]]] = {}
    for e in stored:
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            assert h not in by_hash, "a block published twice"
            by_hash[h] = (parent, e.token_ids[i * BS:(i + 1) * BS])
            parent = h
    for seq in sequences:
        hashes: list[bytes] = []
        BlockHasher(BS).extend(hashes, seq[:-1])  # the last sampled token is never computed
        for i, h in enumerate(hashes):
            parent = None if i == 0 else wire_hash(hashes[i - 1])
            assert by_hash[wire_hash(h)] == (parent, seq[i * BS:(i + 1) * BS])
    # the shared prefix (3 blocks) was published by the first request only; the events equal the engine's index
    assert len(by_hash) == (len(sequences[0]) - 1) // BS + (len(sequences[1]) - 1) // BS - 3
    assert resident(live) == engine_index(llm)

    # replay from sequence 1: the same batches, byte for byte decodable
    replayed = replay(endpoints[1], 1)
    assert [s for s, _ in replayed] == seqs[1:]
    assert [DECODER.decode(p) for _, p in replayed] == [b for _, b in live[1:]]
    sub.close(linger=0)
    llm.shutdown()


def test_eviction_and_the_host_tier_on_a_hybrid_model_match_the_engine_index(tiny_model, endpoints):
    path = str(tiny_model("gemma3").path)  # 5 sliding layers (window 8) and 1 full: two groups
    probe = LLM(model=path, block_size=BS, max_num_batched_tokens=16, kv_cache_memory_bytes=1 << 20).engine
    page, pages = probe.layout.page_bytes, probe.kv.peak_blocks(40) + 1
    llm = events_llm(path, endpoints, max_num_batched_tokens=16, kv_cache_memory_bytes=pages * page,
                     kv_offload_bytes=6 * page)
    sub = subscribe(endpoints[0])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for prompt in random_prompts([30, 33, 28, 31], seed=5):
        llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    llm.engine.kv_events.flush()
    live = receive_all(sub)

    events = [e for _, b in live for e in b.events]
    removed = {(e.medium, e.group_idx) for e in events if isinstance(e, BlockRemoved)}
    assert llm.engine.kv.pool.num_evictions > 0 and llm.engine.kv.host.stats.evictions > 0
    assert {"GPU", "CPU"} <= {m for m, _ in removed}
    kinds = {(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
             for e in events if isinstance(e, BlockStored)}
    groups = {g.group_id: g.spec.kind for g in llm.engine.layout.groups}
    assert kinds == {(g, "full_attention", None) if k == "full" else (g, "sliding_window", 8)
                     for g, k in groups.items()}
    assert resident(live) == engine_index(llm)

    assert llm.engine.kv.reset_prefix_cache()
    llm.generate({"prompt_token_ids": random_prompts([9], seed=8)[0]}, params, use_tqdm=False)
    llm.engine.kv_events.flush()
    after = receive_all(sub)
    assert isinstance(after[0][1].events[0], AllBlocksCleared)
    assert resident(live + after) == engine_index(llm)
    sub.close(linger=0)
    llm.shutdown()


def test_disabled_events_open_no_socket_and_record_nothing(tiny_model, endpoints):
    off = '{"enable_kv_cache_events": false, "endpoint": "%s"}' % endpoints[0]
    for config in (None, off):
        llm = LLM(model=str(tiny_model("llama3").path), block_size=BS, kv_events_config=config)
        llm.generate({"prompt_token_ids": list(range(3, 20))}, SamplingParams(max_tokens=2), use_tqdm=False)
        assert llm.engine.kv.events is None and llm.engine.kv.pool.events is None
        assert llm.engine.kv_events._zmq is None
        llm.shutdown()


@pytest.mark.parametrize(("text", "message"), [
    ("{not json", "not valid JSON"),
    ("[1]", "must be a JSON object"),
    ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "unknown key 'endpont'"),
    ('{"publisher": "kafka"}', "publisher must be"),
    ('{"buffer_steps": 0}', "buffer_steps must be an integer >= 1"),
])
def test_a_bad_config_is_refused_naming_the_problem(text, message):
    with pytest.raises(ValueError, match=message):
        parse_kv_events_config(text)


def test_config_takes_vllm_defaults():
    c = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert (c.publisher, c.endpoint, c.replay_endpoint, c.buffer_steps, c.hwm, c.topic) == (
        "zmq", "tcp://*:5557", None, 10_000, 100_000, "")
    assert parse_kv_events_config('{"enable_kv_cache_events": false}').publisher == "null"
