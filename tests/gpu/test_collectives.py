"""The one-shot all-reduce over peer GPU memory sums what NCCL sums, eagerly and replayed from a CUDA graph, on
two GPUs (two processes, joined as the engine joins its ranks). Skips without two GPUs that reach each other."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if torch.cuda.device_count() < 2 or not torch.cuda.can_device_access_peer(0, 1):
    pytest.skip("needs 2 GPUs with peer access", allow_module_level=True)

from hybridkv.model.architectures.parallel import TPGroup  # noqa: E402

SHAPES = [(1, 5120), (3, 5120), (7, 96), (64, 4096)]  # 64 x 4096 x 4 B: the largest message the path takes


def rank_main(rank: int, port: int, failures) -> None:
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    tp = TPGroup(rank, 2)
    tp.connect(store, "nccl", 60.0)
    try:
        assert tp.one_shot is not None
        for dtype in (torch.float32, torch.bfloat16):
            for shape in SHAPES:
                g = torch.Generator(device="cuda").manual_seed(rank * 100 + shape[0])
                x = torch.randn(shape, device="cuda", dtype=dtype, generator=g) * (rank + 1)
                want = x.clone()
                dist.all_reduce(want)
                assert tp.one_shot.fits(x)
                assert torch.equal(tp.all_reduce(x.clone()), want)  # two terms: one rounding, either way
                static = x.clone()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = tp.all_reduce(static)
                for scale in (2.0, -1.0):  # replays read the static input as it is now
                    static.copy_(x * scale)
                    graph.replay()
                    expect = (x * scale).clone()
                    dist.all_reduce(expect)
                    assert torch.equal(out, expect), (dtype, shape, scale)
        big = torch.ones(1 << 20, device="cuda")  # 4 MiB: past the one-shot limit, NCCL's in place
        assert not tp.one_shot.fits(big) and tp.all_reduce(big) is big and bool((big == 2).all())
    except BaseException as e:
        failures.put(f"rank {rank}: {e!r}")
        raise
    finally:
        dist.barrier()
        tp.leave()


def test_one_shot_sums_what_nccl_sums_eager_and_in_a_graph():
    ctx = mp.get_context("spawn")
    failures = ctx.Queue()
    port = 20000 + torch.randint(0, 20000, ()).item()
    mp.start_processes(rank_main, args=(port, failures), nprocs=2, start_method="spawn")
    assert failures.empty()
