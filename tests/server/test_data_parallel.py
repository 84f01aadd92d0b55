"""``--data-parallel-size``: the router's decisions on crafted KV events, and two replica processes behind the HTTP
front end (completions, streaming, per-replica metrics, a replica killed mid-request)."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from test_lifecycle import ServerProcess, long_context_copy, wait_for

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.kv_events import KVEventEncoder, decode_batch
from hybridkv.engine.llm_engine import LLMEngine
from hybridkv.kv.block_hash import BlockHasher
from hybridkv.kv.cache_manager import KVCacheManager
from hybridkv.kv.events import BlockRemoved, BlockStored
from hybridkv.kv.layout import plan_layout
from hybridkv.kv.request import CacheRequest
from hybridkv.kv.specs import FullAttentionSpec, SlidingWindowSpec
from hybridkv.server.app import build_app
from hybridkv.server.data_parallel import DataParallelEngine, plan_events
from hybridkv.server.replica import place_replicas
from hybridkv.server.router import Router

BS = 4
FULL = plan_layout([FullAttentionSpec(1, 8, "float32")] * 2, BS)
# one full group and one sliding group (window 8 tokens = 2 blocks), as Gemma-3 at toy size
HYBRID = plan_layout([FullAttentionSpec(1, 8, "float32"), SlidingWindowSpec(1, 8, "float32", window=8)], BS)


def router(policy: str, layout=FULL, n: int = 2, usable: int = 64) -> Router:
    return Router(policy, n, layout, "xxh3_128", usable, CollectorRegistry())


def hashes(prompt: list[int]) -> list[bytes]:
    out: list[bytes] = []
    BlockHasher(BS).extend(out, prompt)
    return out


def stored(group: int, hs: list[bytes]) -> BlockStored:
    return BlockStored(group, "GPU", hs, None, [])


def group_ids(layout) -> tuple[int, int]:
    """(full group id, sliding group id)."""
    full = next(g.group_id for g in layout.groups if g.spec.kind == "full")
    return full, next(g.group_id for g in layout.groups if g.spec.kind == "sliding")


PROMPT = list(range(10, 35))  # 25 tokens: 6 full blocks, at most 24 tokens resumable


def test_cache_aware_goes_where_the_prefix_is_and_load_sends_it_elsewhere():
    r = router("cache-aware")
    h = hashes(PROMPT)
    r.events(1, [stored(g.group_id, h[:5]) for g in FULL.groups])
    assert r.resumable_tokens(PROMPT) == [0, 20]
    d = r.choose(PROMPT)
    assert (d.replica, d.resumable_tokens, d.new_tokens) == (1, 20, 5)
    # 60 prompt tokens sent to replica 1 and not started: 5 + 60 / 2 there against 25 on replica 0
    r.loads[1].pending_prefill = 60
    assert r.choose(PROMPT).replica == 0
    r.loads[1].pending_prefill = 30  # 5 + 15 against 25
    assert r.choose(PROMPT).replica == 1
    # a removal is seen: the hit falls back to the blocks before it
    r.loads[1].pending_prefill = 0
    r.events(1, [BlockRemoved(g.group_id, "GPU", [h[2]]) for g in FULL.groups])
    assert r.resumable_tokens(PROMPT) == [0, 8]


def test_a_full_layer_hit_whose_window_was_dropped_does_not_count():
    full, sliding = group_ids(HYBRID)
    r = router("cache-aware", HYBRID)
    h = hashes(PROMPT)
    # replica 0: all 6 full blocks, but only the sliding blocks 0-1 (the windows before tokens 16 and 24 evicted)
    r.events(0, [stored(full, h[:6]), stored(sliding, h[:2])])
    # replica 1: 4 full blocks and the sliding window before token 16 (blocks 2-3)
    r.events(1, [stored(full, h[:4]), stored(sliding, h[2:4])])
    assert r.resumable_tokens(PROMPT) == [8, 16]  # a full-prefix count would say [24, 16]
    assert r.choose(PROMPT).replica == 1


def test_the_view_built_from_the_wire_finds_what_the_engine_finds():
    """A hybrid cache with events on, under eviction: the router's view, decoded from vLLM's wire format, resumes
    exactly the prefix the engine's own lookup finds, for every prompt tried."""
    kv = KVCacheManager(HYBRID, 19, max_step_tokens=64, kv_events=True)
    encoder = KVEventEncoder(HYBRID, data_parallel_rank=1)
    r = router("cache-aware", HYBRID)
    prompts = [list(range(1, 30)), list(range(1, 22)) + [90, 91, 92, 93], list(range(40, 66)), list(range(1, 30))]
    for i, prompt in enumerate(prompts):
        req = CacheRequest(f"r{i}", prompt)
        hit = kv.find_cache_hit(req)
        assert kv.allocate_slots(req, len(prompt) - hit.num_tokens, hit)
        req.num_computed_tokens = len(prompt)
        kv.on_tokens_computed(req)
        kv.free(req)
        rank, events = decode_batch(encoder.encode(kv.events.take(), 0.0))
        assert rank == 1
        r.events(0, events)
        for probe in prompts + [list(range(1, 14)) + [7] * 9]:
            expected = kv.find_cache_hit(CacheRequest("probe", probe)).num_tokens
            assert r.resumable_tokens(probe)[0] == expected
    assert kv.pool.num_cached_blocks < 2 * 4 * len(prompts)  # the small pool did evict


def test_a_prompt_in_flight_counts_where_it_was_sent():
    r = router("cache-aware")
    doc = PROMPT[:20]
    first = r.choose(doc + [1, 2, 3])
    r.sent(first)
    assert r.resumable_tokens(doc + [7, 8, 9, 10, 11])[first.replica] == 20  # on its way there
    r.finished(first, started=True)
    assert r.resumable_tokens(doc + [7, 8, 9, 10, 11]) == [0, 0]  # no event said it stayed


def test_round_robin_and_least_loaded():
    rr = router("round-robin", n=3)
    assert [rr.choose(PROMPT).replica for _ in range(4)] == [0, 1, 2, 0]
    rr.down(1)
    assert [rr.choose(PROMPT).replica for _ in range(2)] == [0, 2]
    ll = router("least-loaded")
    first = ll.choose(PROMPT)
    ll.sent(first)
    second = ll.choose(PROMPT)
    assert second.replica != first.replica
    ll.sent(second)
    ll.finished(first, started=False)
    assert ll.choose(PROMPT).replica == first.replica
    with pytest.raises(ValueError, match="unknown policy 'random'"):
        router("random")


def test_replica_placement():
    assert [p.cuda_devices for p in place_replicas(2, 4, "cuda", [str(i) for i in range(8)], [])] == [
        "0,1,2,3", "4,5,6,7"]
    with pytest.raises(ValueError, match="needs 4 GPUs, and 2 are visible"):
        place_replicas(2, 2, "cuda", ["0", "1"], [])
    assert [p.cpu_cores for p in place_replicas(2, 1, "cpu", [], [0, 1])] == [(0,), (1,)]
    assert [p.cpu_cores for p in place_replicas(3, 1, "cpu", [], [0, 1])] == [None, None, None]


def test_bad_setups_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match="one engine is one replica"):
        LLMEngine(EngineConfig(data_parallel_size=2))
    with pytest.raises(ValueError, match="--routing-policy .* needs --data-parallel-size > 1"):
        build_app(EngineConfig(), routing_policy="round-robin")
    with pytest.raises(ValueError, match="no port to offset"):
        plan_events(EngineConfig(kv_events_config='{"enable_kv_cache_events": true, "endpoint": "tcp://*"}'), 2,
                    "cache-aware")


def test_a_replica_that_cannot_start_stops_the_others(tmp_path):
    config = EngineConfig(model=str(tmp_path / "missing"), data_parallel_size=2, device="cpu")
    with pytest.raises(ValueError, match="replica [01] could not start: .*missing"):
        DataParallelEngine.launch(config, "round-robin")


# ---- two replica processes behind the HTTP front end ----------------------------------------------------------
DP_ARGS = ("--data-parallel-size", "2", "--block-size", "4", "--kv-cache-memory-bytes", str(8 << 20))


def samples(srv: ServerProcess) -> list:
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def by_engine(srv: ServerProcess, name: str) -> dict[str, float]:
    return {s.labels["engine"]: s.value for s in samples(srv) if s.name == name}


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_two_replicas_serve_stream_and_route_by_prefix(tiny_model, backend):
    # ray: a local Ray cluster, events over TCP (ray is in the test extra: imported by the server, never skipped)
    with ServerProcess(str(tiny_model("gemma3").path), *DP_ARGS, "--data-parallel-backend", backend) as srv:
        doc = [5 + i % 80 for i in range(40)]
        body = {"prompt": doc + [3], "max_tokens": 4, "ignore_eos": True}
        first = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert first.status_code == 200, first.text
        assert first.json()["usage"]["completion_tokens"] == 4
        # the same document, another question, streamed: it goes where the document is cached
        wait_for(lambda: sum(by_engine(srv, "hybridkv:router_resident_blocks").values()) > 0, "events")
        chunks = []
        with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=60,
                          json={**body, "prompt": doc + [4, 9], "stream": True}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        assert len(chunks) == 4 and all(c["choices"][0]["text"] for c in chunks)
        routed = by_engine(srv, "hybridkv:router_requests_total")
        assert sorted(routed.values()) == [2.0]  # both on one replica
        home = next(iter(routed))
        assert by_engine(srv, "hybridkv:router_resumable_tokens_total")[home] == 40
        hits = by_engine(srv, "hybridkv:prefix_cache_hits_total")  # the replicas' own counters, per engine
        assert hits == {home: 40.0, str(1 - int(home)): 0.0}
        # a third, unrelated prompt goes to the replica with nothing cached
        other = httpx.post(f"{srv.url}/v1/completions", json={**body, "prompt": [7] * 30}, timeout=60)
        assert other.status_code == 200
        assert by_engine(srv, "hybridkv:router_requests_total") == {home: 2.0, str(1 - int(home)): 1.0}
        srv.proc.terminate()
        assert srv.proc.wait(60) == 0


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_a_killed_replica_fails_its_requests_within_10s_and_the_other_serves(tiny_model, tmp_path, backend):
    # ray: a local Ray cluster on this host
    model = long_context_copy(tiny_model("llama3").path, tmp_path / "llama3")
    args = (*DP_ARGS, "--routing-policy", "round-robin", "--data-parallel-backend", backend)
    with ServerProcess(str(model), *args) as srv:
        pids = {e: int(v) for e, v in by_engine(srv, "hybridkv:replica_pid").items()}
        long = {"prompt": [5, 6, 7, 8], "max_tokens": 16000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=long, timeout=10) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # replica 0 (round-robin's first)
            os.kill(pids["0"], signal.SIGKILL)
            start = time.monotonic()
            last = next(line for line in lines if "error" in line)  # the read timeout (10 s) bounds the wait
        error = json.loads(last[6:])["error"]
        print(f"error after {time.monotonic() - start:.2f}s: {error['message']}")
        assert error["code"] == 503 and "replica 0" in error["message"]
        assert by_engine(srv, "hybridkv:replica_alive") == {"0": 0.0, "1": 1.0}
        for _ in range(2):  # both go to the live replica
            ok = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=30)
            assert ok.status_code == 200, ok.text
        assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200
        srv.proc.terminate()  # a clean stop: the replicas (and a local Ray cluster) stop with the front end
        assert srv.proc.wait(60) == 0
