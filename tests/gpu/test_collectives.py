"""The one-shot all-reduce over peer GPU memory sums what NCCL sums, and the logits gather built on it gathers
what NCCL's all-gather does, eagerly and replayed from a CUDA graph, on two GPUs (two processes, joined as the engine joins its ranks). Skips without two GPUs that reach each other."""

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
        # the logits gather: rank 0 gets every rank's columns, side by side, exactly; one-shot (in a graph) up to
        # the buffer, NCCL's all-gather beyond
        for rows, cols in ((1, 1000), (2, 300), (3, 50000)):
            x = torch.randn(rows, cols, device="cuda", generator=torch.Generator(device="cuda").manual_seed(rank))
            parts = [torch.empty_like(x) for _ in range(2)]
            dist.all_gather(parts, x)
            want = torch.cat(parts, dim=-1)
            assert tp.gathers_one_shot(rows, cols, x.dtype) == (rows * cols * 2 * 4 <= tp.one_shot.max_bytes)
            got = tp.gather_last_dim(x)
            static = x.clone()
            graph = torch.cuda.CUDAGraph()
            if tp.gathers_one_shot(rows, cols, x.dtype):
                with torch.cuda.graph(graph):
                    replayed = tp.gather_last_dim(static)
                graph.replay()
            else:
                replayed = tp.gather_last_dim(static)
            if rank == 0:
                assert torch.equal(got, want) and torch.equal(replayed, want), (rows, cols)
            else:
                assert got is None and replayed is None
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
