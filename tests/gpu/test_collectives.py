"""The one-shot all-reduce over peer GPU memory sums what NCCL sums, its sum fused with the residual add and RMSNorm
computes what NCCL's sum then the norm kernel do, and the logits gather built on it gathers what NCCL's all-gather
does, eagerly and replayed from a CUDA graph, on two GPUs and, where there are four, on four (a process a GPU,
joined as the engine joins its ranks). The prefill halves' sums on the copy engines match the rank-order sum then
the norm. Skips without two GPUs that reach each other."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if torch.cuda.device_count() < 2 or not torch.cuda.can_device_access_peer(0, 1):
    pytest.skip("needs 2 GPUs with peer access", allow_module_level=True)

from hybridkv.kernels.rms_norm import rms_norm  # noqa: E402
from hybridkv.model.architectures.parallel import TPGroup  # noqa: E402

SHAPES = [(1, 5120), (3, 5120), (7, 96), (64, 4096)]  # 64 x 4096 x 4 B: the largest message the path takes


@contextmanager
def rank_reports(rank: int, tp: TPGroup, failures) -> Iterator[None]:
    """A rank's failure goes to the parent's queue; at the end every rank meets the others and leaves the group."""
    try:
        yield
    except BaseException as e:
        failures.put(f"rank {rank}: {e!r}")
        raise
    finally:
        dist.barrier()
        tp.leave()


def rank_main(rank: int, world: int, port: int, failures) -> None:
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    tp = TPGroup(rank, world)
    tp.connect(store, "nccl", 60.0)
    with rank_reports(rank, tp, failures):
        assert tp.one_shot is not None
        for dtype in (torch.float32, torch.bfloat16):
            for shape in SHAPES:
                g = torch.Generator(device="cuda").manual_seed(rank * 100 + shape[0])
                x = torch.randn(shape, device="cuda", dtype=dtype, generator=g) * (rank + 1)
                want = x.clone()
                dist.all_reduce(want)
                assert tp.one_shot.fits(x)
                assert sums_match(tp.all_reduce(x.clone()), want, x), (dtype, shape)
                static = x.clone()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = tp.all_reduce(static)
                for scale in (2.0, -1.0):  # replays read the static input as it is now
                    static.copy_(x * scale)
                    graph.replay()
                    expect = (x * scale).clone()
                    dist.all_reduce(expect)
                    assert sums_match(out, expect, x * scale), (dtype, shape, scale)
        check_add_norm(tp, rank, world)
        big = torch.ones(1 << 20, device="cuda")  # 4 MiB: past the one-shot limit, NCCL's in place
        assert not tp.one_shot.fits(big) and tp.all_reduce(big) is big and bool((big == world).all())
        # the logits gather: rank 0 gets every rank's columns, side by side, exactly; one-shot (in a graph) up to
        # the buffer, NCCL's all-gather beyond
        for rows, cols in ((1, 1000), (2, 300), (3, 50000)):
            x = torch.randn(rows, cols, device="cuda", generator=torch.Generator(device="cuda").manual_seed(rank))
            parts = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(parts, x)
            want = torch.cat(parts, dim=-1)
            assert tp.gathers_one_shot(rows, cols, x.dtype) == (rows * cols * world * 4 <= tp.one_shot.max_bytes)
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


def sums_match(got: torch.Tensor, want: torch.Tensor, part: torch.Tensor) -> bool:
    """Two terms round once whichever adds them: bit for bit. More may be added in another order than NCCL's: each
    order is within (world - 1) roundings of sum |part| of the exact sum, and a last rounding of its own."""
    world = dist.get_world_size()
    if world == 2:
        return torch.equal(got, want)
    bound = part.abs().float()
    dist.all_reduce(bound)
    ulp = torch.finfo(got.dtype).eps
    return bool(((got.float() - want.float()).abs() <= 2 * world * ulp * bound).all())


def same_on_every_rank(t: torch.Tensor) -> bool:
    every = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(every, t)
    return all(torch.equal(every[0], other) for other in every[1:])


def rank_order_sum(part: torch.Tensor) -> torch.Tensor:
    """Every rank's ``part`` added in rank order in float32, rounded once: the fused kernel's sum."""
    parts = [torch.empty_like(part) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, part)
    total = parts[0].float()
    for other in parts[1:]:
        total = total + other.float()
    return total.to(part.dtype)


def check_add_norm(tp: TPGroup, rank: int, world: int) -> None:
    """Sum + residual + RMSNorm in one kernel against NCCL's sum then the norm kernel, for many calls in a row (the
    slots' generations rotate), eagerly and from a graph replayed between eager calls, and with parts whose bits
    are the empty pattern or -0.0. The sum plus residual is bit for bit the parts added in rank order (on two ranks:
    NCCL's); the normalised row within float32 rounding of the norm kernel's (the two reduce a row's squares in
    different orders: 1e-6, bf16's one rounding after it), and bit for bit the same on every rank, which is what
    keeps the ranks' hidden states identical."""
    eps = 1e-5

    def agrees(got, want, res, want_res) -> bool:
        tol = 1e-6 if got.dtype == torch.float32 else 2 ** -7
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        return torch.equal(res, want_res) and same_on_every_rank(got) and same_on_every_rank(res)

    for dtype in (torch.float32, torch.bfloat16):
        for shape in SHAPES:
            same = torch.Generator(device="cuda").manual_seed(shape[0])  # weight and residual: alike on every rank
            w = torch.randn(shape[1], device="cuda", dtype=dtype, generator=same)
            own = torch.Generator(device="cuda").manual_seed(rank * 100 + shape[0])

            def sample():
                part = torch.randn(shape, device="cuda", dtype=dtype, generator=own) * (rank + 1)
                return part, torch.randn(shape, device="cuda", dtype=dtype, generator=same)

            def expect(part, residual):
                res = residual.clone()
                return rms_norm(rank_order_sum(part), eps, w, residual=res), res

            for _ in range(4):  # compiles the kernel too, before a graph captures it
                part, residual = sample()
                want, want_res = expect(part, residual)
                got = tp.add_norm(part, residual, w, eps)
                assert agrees(got, want, residual, want_res), (dtype, shape)
            static_part, static_res = sample()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = tp.add_norm(static_part, static_res, w, eps)
            for _ in range(4):
                part, residual = sample()
                want, want_res = expect(part, residual)
                static_part.copy_(part)
                static_res.copy_(residual)
                graph.replay()
                assert agrees(out, want, static_res, want_res), (dtype, shape, "graph")
                part, residual = sample()
                want, want_res = expect(part, residual)
                assert agrees(tp.add_norm(part, residual, w, eps), want, residual, want_res), (dtype, shape, "eager")
    # a part that is all ones in its bits (NaN) still arrives, as a NaN; -0.0 arrives as a zero
    part = torch.full((2, 96), -1, dtype=torch.int16, device="cuda").view(torch.bfloat16)
    part[1] = -0.0 if rank == 0 else float(rank == 1)
    residual = torch.zeros(2, 96, dtype=torch.bfloat16, device="cuda")
    w = torch.ones(96, dtype=torch.bfloat16, device="cuda")
    out = tp.add_norm(part, residual, w, eps)
    assert bool(out[0].isnan().all()) and bool((residual[1] == 1.0).all()) and bool((out[1] == 1.0).all())


def run_on_ranks(main, world: int) -> None:
    """``main(rank, world, port, failures)`` in a process per GPU, joined as the engine joins its ranks."""
    if torch.cuda.device_count() < world or not all(torch.cuda.can_device_access_peer(0, r) for r in range(1, world)):
        pytest.skip(f"needs {world} GPUs with peer access")
    failures = mp.get_context("spawn").Queue()
    port = 20000 + torch.randint(0, 20000, ()).item()
    mp.start_processes(main, args=(world, port, failures), nprocs=world, start_method="spawn")
    assert failures.empty()


@pytest.mark.parametrize("world", [2, 4])
def test_one_shot_sums_what_nccl_sums_eager_and_in_a_graph(world):
    run_on_ranks(rank_main, world)


SUM_ROWS, SUM_HIDDEN = 96, 5120  # slots of half a step: 96 rows of Scout's width


def copy_sums_main(rank: int, world: int, port: int, failures) -> None:
    """Prefill halves' sums on the copy engines (``CopyEngineSums``): each half's messages are pushed, then summed
    in the next norm, for several steps in a row (both generations of every slot reused), with fewer rows than the
    slots hold, and with one rank's GPU held back before it sends, so the others wait in the norm for its parts."""
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    tp = TPGroup(rank, world)
    tp.connect(store, "nccl", 60.0, sum_slots=(SUM_ROWS, SUM_HIDDEN, torch.bfloat16))
    eps = 1e-5
    with rank_reports(rank, tp, failures):
        assert tp.copy_sums is not None
        same = torch.Generator(device="cuda").manual_seed(7)
        own = torch.Generator(device="cuda").manual_seed(rank + 1)
        w = torch.randn(SUM_HIDDEN, device="cuda", dtype=torch.bfloat16, generator=same)
        for step, rows in enumerate((96, 96, 40, 96, 1, 96, 96)):
            parts = [torch.randn(rows, SUM_HIDDEN, device="cuda", dtype=torch.bfloat16, generator=own) * (rank + 1)
                     for _ in range(2)]
            residuals = [torch.randn(rows, SUM_HIDDEN, device="cuda", dtype=torch.bfloat16, generator=same)
                         for _ in range(2)]
            wants = []
            for part, residual in zip(parts, residuals):
                res = residual.clone()
                wants.append((rms_norm(rank_order_sum(part), eps, w, residual=res), res))
            torch.cuda.synchronize()
            dist.barrier()
            if rank == world - 1 and step % 2:
                torch.cuda._sleep(20_000_000)  # this GPU sends late: the others' norms wait for its parts
            for half, part in enumerate(parts):
                with tp.pushing_half(half):
                    assert tp.all_reduce(part) is part  # sent; summed by the norm
            got = []
            for half, (part, residual) in enumerate(zip(parts, residuals)):
                with tp.pushing_half(half):
                    got.append(tp.add_norm(part, residual, w, eps))
            for half, (out, (want, want_res)) in enumerate(zip(got, wants)):
                torch.testing.assert_close(out, want, rtol=2 ** -7, atol=2 ** -7)
                assert torch.equal(residuals[half], want_res), (step, half)
                assert same_on_every_rank(out) and same_on_every_rank(residuals[half]), (step, half)
        with tp.pushing_half(0), pytest.raises(ValueError, match="does not fit"):
            tp.all_reduce(torch.ones(SUM_ROWS + 1, SUM_HIDDEN, device="cuda", dtype=torch.bfloat16))
        with tp.pushing_half(1), pytest.raises(RuntimeError, match="before it was sent"):
            tp.add_norm(parts[1], residuals[1], w, eps)


@pytest.mark.parametrize("world", [2, 4])
def test_copy_engine_sums_match_rank_order_sums_then_the_norm(world):
    run_on_ranks(copy_sums_main, world)
