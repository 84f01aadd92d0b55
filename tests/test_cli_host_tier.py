"""The host tier's knobs and numbers outside the engine: ``--kv-offload-gib`` on plan/serve/generate, its metrics."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from hybridkv.cli import build_parser, main
from hybridkv.engine.args import add_engine_args, engine_config_from_args
from hybridkv.kv import CacheRequest, FullAttentionSpec, KVCacheManager, plan_layout
from hybridkv.server.metrics import ServerMetrics

SCOUT = Path(__file__).parent / "data" / "scout-text-config.json"
PLAN = ["plan", "--model", str(SCOUT), "--tensor-parallel-size", "8", "--kv-memory-gib", "89.71"]


def plan(capsys, *extra: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        sys.exit(main([*PLAN, *extra]))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_plan_prints_the_tokens_of_context_the_host_tier_holds(capsys):
    code, out, _ = plan(capsys, "--kv-offload-gib", "100")
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("host tier:"))
    # Scout TP 8, block 16: a 96 KiB page holds 16 tokens of the 12 full layers (512 B per token per layer)
    assert "1,092,266 pages" in line and f"{1_092_266 * 16:,} tokens of context" in line
    code, out, _ = plan(capsys, "--kv-offload-gib", "100", "--json")
    assert json.loads(out)["host_tier"] == {"bytes": 100 << 30, "pages": 1_092_266, "tokens": 1_092_266 * 16}
    code, out, _ = plan(capsys)
    assert "host tier" not in out
    code, _, err = plan(capsys, "--kv-offload-gib", "-1")
    assert code == 2 and "--kv-offload-gib must be >= 0" in err


@pytest.mark.parametrize("command", [["serve"], ["generate", "--prompt", "hi"]])
def test_serve_and_generate_take_the_flag(command):
    args = build_parser().parse_args([*command, "--kv-offload-gib", "1.5"])
    assert engine_config_from_args(args).kv_offload_bytes == 3 << 29
    assert engine_config_from_args(build_parser().parse_args(command)).kv_offload_bytes == 0


def test_a_negative_size_is_refused():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    with pytest.raises(ValueError, match="--kv-offload-gib must be >= 0"):
        engine_config_from_args(p.parse_args(["--kv-offload-gib", "-2"]))


def test_metrics_count_host_hits_bytes_and_usage():
    kv = KVCacheManager(plan_layout([FullAttentionSpec(1, 8)], 2), 6, host_blocks=8)
    engine = SimpleNamespace(kv=kv, scheduler=SimpleNamespace(running=[], waiting=[], num_preemptions=0))
    metrics = ServerMetrics("m")

    def run(rid, tokens):
        r = CacheRequest(rid, tokens)
        hit = kv.find_cache_hit(r)
        assert kv.allocate_slots(r, len(tokens) - hit.num_tokens, hit)
        kv.record_hit(r, hit)
        r.num_computed_tokens = len(tokens)
        kv.on_tokens_computed(r)
        kv.free(r)

    run("a", list(range(1, 10)))  # 4 full blocks cached
    run("b", list(range(20, 29)))  # evicts them: written back
    run("c", list(range(1, 10)) + [5])  # 8 tokens from the host
    metrics.update_engine_state(engine)
    text = metrics.render().decode()
    page = kv.layout.page_bytes

    def value(name):
        return float(next(x for x in text.splitlines() if x.startswith(name + "{")).rsplit(" ", 1)[1])

    assert value("hybridkv:host_cache_hit_tokens_total") == 8
    assert value("hybridkv:host_cache_bytes_read_total") == 4 * page
    assert value("hybridkv:host_cache_bytes_written_total") == kv.host.stats.bytes_written >= 4 * page
    assert value("hybridkv:host_cache_usage_perc") == kv.host.usage() > 0
    metrics.update_engine_state(engine)  # counters advance by what changed only
    assert value("hybridkv:host_cache_hit_tokens_total") == 8
