"""A real prefill of Scout with a TP-8 rank's shapes per GPU, at TP 1 or split over TP 2 GPUs: the wall time of
every step (synchronised after each), printed by the context it started at, and the GPUs' SM clock, power and
temperature while it ran (``nvidia-smi``, once a second). Where ``benchmarks/gpu/scout_rank.py`` gives the prefill's
total, this shows which steps the difference between TP 1 and TP 2 comes from.

    PYTHONPATH=. python tools/kernel_dev/tp_prefill_steps.py --tensor-parallel-size 1 --length 1048576
    PYTHONPATH=. python tools/kernel_dev/tp_prefill_steps.py --tensor-parallel-size 2 --length 1048576

Run one size per process (an engine's GPU memory is only all given back when its process ends).

``--traffic`` separates what the halves' sums move from the rest (both are ablations):

- ``none`` (TP 2): each push writes its flags but copies nothing, so the norms sum stale zeros (wrong results) and
  the step runs without the copies' traffic;
- ``local`` (TP 1): each all-reduce message over 1 MiB is also copied within the GPU on a side stream, as TP 2 sends
  it to the peer: the copies' memory traffic without NVLink.

E.g. what the copies cost TP 2, and its SM clock (against TP 2 and TP 1 in halves as built; the figures are in
``docs/design/decode.md#tp-prefill-traffic``):

    PYTHONPATH=. python tools/kernel_dev/tp_prefill_steps.py --tensor-parallel-size 2 --traffic none
    PYTHONPATH=. python tools/kernel_dev/tp_prefill_steps.py --tensor-parallel-size 1 --halves-from-tokens 4096 \
        --traffic local
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.gpu import scout_rank  # noqa: E402
from hybridkv.engine.sampling_params import SamplingParams  # noqa: E402

LOADED_W = 500.0  # clock samples below this power are the GPU idling between steps, left out


def step_times(engine, n: int, vocab: int) -> list[tuple[int, float]]:
    """(cached tokens before the step, its seconds) of each step of one request's prefill of ``n`` tokens."""
    engine.add_request("prefill", scout_rank.prompt(n, vocab, n + 1),
                       SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    seq = engine._requests["prefill"].seqs[0]
    torch.cuda.synchronize()
    times = []
    while seq.num_output_tokens == 0:
        start, context = time.perf_counter(), seq.num_computed_tokens
        engine.step()
        torch.cuda.synchronize()
        times.append((context, time.perf_counter() - start))
    while engine.has_unfinished_requests():
        engine.step()
    return times


def clocks(samples: str) -> dict[str, tuple[float, float, float]]:
    """{GPU index: (median SM MHz, mean W, median degrees C)} over the samples taken under load."""
    by_gpu: dict[str, list[tuple[int, float, int]]] = {}
    for line in samples.splitlines():
        m = re.match(r"\s*(\d+), (\d+) MHz, ([\d.]+) W, (\d+)", line)
        if m and float(m.group(3)) >= LOADED_W:
            by_gpu.setdefault(m.group(1), []).append((int(m.group(2)), float(m.group(3)), int(m.group(4))))
    return {g: (statistics.median(c for c, _, _ in v), statistics.mean(w for _, w, _ in v),
                statistics.median(t for _, _, t in v)) for g, v in by_gpu.items()}


def flags_only(runner) -> None:
    """``--traffic none`` on this rank: a prefill half's push writes the peers' flags and copies nothing."""
    sums = runner.model.tp.copy_sums
    if sums is None:
        raise RuntimeError("--traffic none needs the copy-engine sums (TP 2 on GPUs that reach each other's memory)")
    sums.slots.zero_()  # what the norms then add: zeros, not stale bits that could be NaN
    push = sums.push
    sums.push = lambda part, half: push(part[:0], half)  # no rows copied; the flags are written as ever


def local_copies(runner) -> None:
    """``--traffic local`` (TP 1, one process): every message TP 2 would all-reduce, if over 1 MiB, is copied within
    the GPU on a side stream; its sum is still the message itself. At TP 1 the MoE still calls ``all_reduce`` and
    the attention's row-parallel output projection does not, so both are wrapped."""
    from hybridkv.model.architectures.parallel import RowParallelLinear, TPGroup

    stream, buffers = torch.cuda.Stream(), {}

    def copy_out(x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.is_contiguous() and x.numel() * x.element_size() > 1 << 20:
            flat = x.view(-1)
            if flat.numel() not in buffers:
                buffers[flat.numel()] = torch.empty_like(flat)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                buffers[flat.numel()].copy_(flat)
            flat.record_stream(stream)
        return x

    row_parallel = RowParallelLinear.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = row_parallel(self, x)
        return copy_out(y) if self.reduce else y

    TPGroup.all_reduce = lambda self, x: copy_out(x)
    RowParallelLinear.forward = forward


def report(engine, tp: int, n: int, every: int, halves: int | None) -> None:
    """Prefill ``n`` tokens after a warm-up, sampling the clocks meanwhile; print every ``every``-th step. ``halves``:
    steps of that many tokens or more run in two halves (at TP 1 too, where they show the split's own cost)."""
    vocab = engine.model.cfg.vocab_size
    if halves is not None:
        engine.collective_rpc(scout_rank.set_prefill_halves, halves)
    scout_rank.warm_up(engine, vocab)
    with tempfile.TemporaryFile("w+") as log:
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=index,clocks.sm,power.draw,temperature.gpu",
                                "--format=csv,noheader", "-lms", "1000"], stdout=log)
        try:
            times = step_times(engine, n, vocab)
        finally:
            smi.terminate()
            smi.wait()
        log.seek(0)
        samples = log.read()
    print(f"TP {tp}: prefill of {n:,} tokens in {sum(t for _, t in times):.2f} s, {len(times)} steps")
    for context, seconds in times[::every] + times[-1:]:
        print(f"  step after {context:>9,} cached: {1000 * seconds:8.1f} ms")
    for gpu, (mhz, watts, celsius) in sorted(clocks(samples).items()):
        print(f"  GPU {gpu} under load: SM clock median {mhz:.0f} MHz, {watts:.0f} W, {celsius:.0f} C")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensor-parallel-size", type=int, default=2, choices=(1, 2))
    ap.add_argument("--length", type=int, default=1 << 20, help="prompt tokens")
    ap.add_argument("--every", type=int, default=4, help="print every this many steps (and the last)")
    ap.add_argument("--halves-from-tokens", type=int, help="steps of this many tokens or more in two halves "
                    "(default: the engine's, prefill_overlap_tokens at TP 2 and none at TP 1; 0: none)")
    ap.add_argument("--step-tokens", type=int, default=scout_rank.STEP_TOKENS, help="max_num_batched_tokens")
    ap.add_argument("--traffic", choices=("as-built", "none", "local"), default="as-built",
                    help="none (TP 2): the halves' pushes copy nothing; local (TP 1): each large message also "
                         "copied within the GPU (ablations, see the module's docstring)")
    args = ap.parse_args()
    tp = args.tensor_parallel_size
    if (args.traffic, tp) in (("none", 1), ("local", 2)):
        ap.error(f"--traffic {args.traffic} is for TP {3 - tp}")

    def run(engine) -> None:
        if args.traffic != "as-built":
            engine.collective_rpc(flags_only if args.traffic == "none" else local_copies)
        report(engine, tp, args.length, args.every, args.halves_from_tokens)

    scout_rank.on_dummy_engine(scout_rank.rank_config(8 // tp), tp, run, max_num_batched_tokens=args.step_tokens)


if __name__ == "__main__":
    main()
