"""All-reduce latency by message size over N GPUs: NCCL vs the one-shot path (``collectives.OneShotAllReduce``).

One process per GPU, joined as the engine joins its ranks (``TPGroup.connect``). Each row: a bf16 message of the
size given, every rank's values random and different; the sum is checked against a float64 reference first. Then
a CUDA graph of 64 all-reduces back to back (as a decode step's graph holds them) is replayed 20 times on every
rank in lockstep (a fixed count, so no rank waits in a collective alone), and the median replay / 64 is the time
of one all-reduce. NCCL is timed the same way, graphed and eager (each call launched from Python, as prefill
runs them). Bus bandwidth as nccl-tests counts it: size x 2 (N - 1) / N / time.

A Scout decode step sums 97 messages of tokens x 5,120 bf16 values (10 KB a token): 2 per layer and the embedding.

    python benchmarks/gpu/all_reduce.py [--gpus 2] [--sizes 2048,10240,...]
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hybridkv.bench.tables import markdown_table  # noqa: E402
from hybridkv.model.architectures.collectives import ONE_SHOT_MAX_BYTES, OneShotAllReduce  # noqa: E402
from hybridkv.model.architectures.parallel import TPGroup  # noqa: E402

CALLS = 64  # all-reduces per graph
PROBE_MAX_BYTES = 8 << 20
REPLAYS = 20
DEFAULT_SIZES = [2 << 10, 10 << 10, 40 << 10, 64 << 10, 160 << 10, 320 << 10, 1 << 20, 8 << 20, 64 << 20, 168 << 20]


def graph_of(fn, x: torch.Tensor) -> torch.cuda.CUDAGraph:
    fn(x)  # warm-up outside the graph (NCCL sets up its channels on first use)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn(x)
    return graph


def median_us(run) -> float:
    times = []
    for _ in range(REPLAYS):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS)
    return sorted(times)[len(times) // 2]


def eager_calls(fn, x: torch.Tensor):
    def run():
        for _ in range(CALLS):
            fn(x)
    return run


def nccl(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def check(fn, numel: int, rank: int, size: int) -> None:
    """Every rank's random values summed by ``fn`` equal the float64 sum (bf16 inputs: exact to bf16 rounding)."""
    parts = [torch.randn(numel, generator=torch.Generator().manual_seed(r)).bfloat16() for r in range(size)]
    want = torch.stack([p.double() for p in parts]).sum(0)
    got = fn(parts[rank].cuda()).double().cpu()
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)


def worker(rank: int, size: int, port: int, sizes: list[int], results) -> None:
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=timedelta(seconds=120))
    tp = TPGroup(rank, size)
    tp.connect(store, "nccl", 120.0)
    # the engine's path takes messages up to ONE_SHOT_MAX_BYTES; a larger buffer here shows where the cut belongs
    probe = None
    if tp.one_shot is not None:
        probe = OneShotAllReduce(torch.device("cuda", rank), store, "all-reduce-probe", PROBE_MAX_BYTES)
    rows = []
    for nbytes in sizes:
        numel = nbytes // 2
        x = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
        check(nccl, numel, rank, size)
        row = {"bytes": nbytes,
               "nccl_graph": median_us(graph_of(nccl, x).replay),
               "nccl_eager": median_us(eager_calls(nccl, x))}
        if probe is not None and probe.fits(x):
            check(probe, numel, rank, size)
            row["one_shot_graph"] = median_us(graph_of(probe, x).replay)
        rows.append(row)
        del x
        torch.cuda.empty_cache()
    if rank == 0:
        results.put((tp.one_shot is not None, rows))
    dist.barrier()
    tp.leave()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                    help=f"message sizes in bytes (one-shot timed up to {PROBE_MAX_BYTES:,})")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = 29500 + torch.randint(0, 1000, ()).item()
    mp.start_processes(worker, args=(args.gpus, port, sizes, results), nprocs=args.gpus, start_method="spawn")
    one_shot, rows = results.get()
    table = []
    for r in rows:
        n, best = r["bytes"], min(v for k, v in r.items() if k.endswith("graph"))
        busbw = n * 2 * (args.gpus - 1) / args.gpus / (r["nccl_graph"] * 1e-6) / 1e9
        one = f"{r['one_shot_graph']:.1f}" if "one_shot_graph" in r else "-"
        table.append([f"{n:,}", f"{r['nccl_eager']:.1f}", f"{r['nccl_graph']:.1f}", one,
                      "one-shot" if r.get("one_shot_graph") == best else "NCCL", f"{busbw:.0f}"])
    print(f"\n{torch.cuda.get_device_name()} x {args.gpus}: all-reduce of bf16, microseconds per call "
          f"(one-shot path {'set up' if one_shot else 'NOT available: no peer access'}; "
          f"the engine sends it messages up to {ONE_SHOT_MAX_BYTES:,} bytes)")
    print(markdown_table(["bytes", "NCCL eager (us)", "NCCL in a graph (us)", "one-shot in a graph (us)", "faster",
                          "NCCL bus GB/s"], table))


if __name__ == "__main__":
    main()
