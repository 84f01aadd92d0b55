"""Prefix-cache hit rate with and without the host-memory tier, on the multi-turn trace of ``prefix_trace.py``.

The same seeded trace (conversations sharing system prompts, long documents asked several questions, interleaved)
replayed by the same small scheduler through our ``KVCacheManager``, the device pool too small for the trace, with
no host tier and with host tiers of two sizes. Sizes are shares of the trace's unique tokens stored in every layer
group (as ``prefix_trace.py`` sizes the device pool). The replay records the page copies the engine would run
(bytes are one rank's: one tensor-parallel rank of each layout; "kept" is the share of the pages the device pool evicted
that the tier holds afterwards: every full-attention page, only the retained windows of sliding/chunked groups)
but moves no data: hit rates and recomputed tokens
are those of the bookkeeping the engine runs, whose loads the engine tests check token for token.

    python benchmarks/prefix_tiers.py            # ~6 minutes on 2 cores
    python benchmarks/prefix_tiers.py --quick    # a small trace
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prefix_trace import BLOCK, HybridKV, layouts, pool_blocks, replay, trace_from_args  # noqa: E402

from hybridkv.bench.tables import markdown_table  # noqa: E402

DEVICE = {"30%": 0.3, "10%": 0.1}
HOST = {"off": 0.0, "30%": 0.3, "roomy": 1.1}


def host_blocks(layout, unique: int, share: float) -> int:
    return int(share * unique / BLOCK * len(layout.groups))


def main() -> None:
    args, trace, unique = trace_from_args(__doc__.splitlines()[0])
    head = ("layout", "device pool", "host tier", "hit rate", "prompt tokens recomputed", "from host",
            "evicted pages kept", "GiB written / read", "preemptions")
    rows = []
    for lname, layout in layouts().items():
        for dname, dshare in DEVICE.items():
            n = pool_blocks(layout, trace, unique, dshare, args.chunk)
            for hname, hshare in HOST.items():
                h = host_blocks(layout, unique, hshare)
                cache = HybridKV(layout, n, args.chunk, host_blocks=h)
                res = replay(cache, trace, args.max_running, args.chunk)
                host = cache.kv.host.stats if cache.kv.host is not None else None
                moved = f"{host.bytes_written / 2**30:.2f} / {host.bytes_read / 2**30:.2f}" if host else "-"
                kept = f"{host.kept / host.device_evictions:.0%} of {host.device_evictions:,}" if host else "-"
                rows.append((lname, f"{dname} ({n:,})", f"{hname} ({h:,})" if h else "off",
                             f"{res.hit_rate:.1%}", f"{res.prompt_tokens - res.hit_tokens:,}",
                             f"{host.hit_tokens:,}" if host else "-", kept, moved, str(res.preemptions)))
                print(rows[-1], flush=True)
    print(markdown_table(head, rows))


if __name__ == "__main__":
    main()
