"""What copy traffic costs the GEMMs beside it on two GPUs at their power cap: the prefill halves' sums, without
the engine.

Each GPU runs bf16 GEMMs (4096 x 8192 x 8192) on a stream of its own, in periods of ``--gemms`` of them. Each period,
each GPU also copies ``--message-mb`` to the other on a side stream, as ``CopyEngineSums`` pushes a half's part
(``cudaMemcpyAsync`` on a copy engine, no SM). The modes move those bytes differently:

- ``none``: no copies;
- ``burst``: one copy at the period's start (what the engine does);
- ``paced``: the message in ``--pieces`` copies, one after each of the period's first GEMMs;
- ``half``: one copy of half the message;
- ``within``: the whole message copied within the GPU instead (HBM, no NVLink).

The defaults send about what TP 2 sends in the 1M-token prefill's 32K-token steps (168 MB each way every ~7 ms
here, every ~5.6 ms there).
Modes take turns over ``--rounds``; the table gives each mode's mean time per period against ``none`` in the same
run, with the median SM clock and power of each GPU.

    PYTHONPATH=. python tools/kernel_dev/copy_traffic.py [--periods 1500] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.gpu.attention import SmClock
from hybridkv.bench.tables import markdown_table

MODES = ("none", "burst", "paced", "half", "within")
M, K, N = 4096, 8192, 8192


class Traffic:
    """The GEMMs and the copies of both GPUs."""

    def __init__(self, message_bytes: int, gemms: int, pieces: int) -> None:
        if pieces > gemms:
            raise ValueError(f"--pieces {pieces} needs as many GEMMs a period, got --gemms {gemms}")
        devs = [torch.device("cuda", i) for i in range(2)]
        self.devs, self.gemms, self.pieces = devs, gemms, pieces
        self.elems = message_bytes // 2 // pieces * pieces
        gen = torch.Generator(device="cpu").manual_seed(0)
        rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.bfloat16)  # noqa: E731
        self.a = [rand(M, K).to(d) for d in devs]
        self.b = [rand(K, N).to(d) for d in devs]
        self.c = [torch.empty(M, N, device=d, dtype=torch.bfloat16) for d in devs]
        self.src = [rand(self.elems).to(d) for d in devs]
        # to_peer[i]: GPU i's message as it lands on the other GPU; local[i]: its copy within GPU i
        self.to_peer = [torch.empty(self.elems, device=devs[1 - i], dtype=torch.bfloat16) for i in range(2)]
        self.local = [torch.empty(self.elems, device=d, dtype=torch.bfloat16) for d in devs]
        self.compute = [torch.cuda.Stream(d) for d in devs]
        self.side = [torch.cuda.Stream(d) for d in devs]
        # a peer copy also orders itself after the destination GPU's current stream: keep that one idle
        self.idle = [torch.cuda.Stream(d) for d in devs]

    def copy(self, i: int, mode: str, piece: int) -> None:
        """Piece ``piece`` of GPU i's copies of ``mode``, on its side stream after its GEMMs so far."""
        whole = mode in ("burst", "within")
        size = self.elems // 2 if mode == "half" else self.elems if whole else self.elems // self.pieces
        lo = 0 if mode != "paced" else piece * size
        dst = self.local[i] if mode == "within" else self.to_peer[i]
        self.side[i].wait_stream(self.compute[i])
        with torch.cuda.stream(self.idle[1 - i]), torch.cuda.stream(self.side[i]):
            dst[lo : lo + size].copy_(self.src[i][lo : lo + size], non_blocking=True)

    def run(self, mode: str, periods: int) -> None:
        copies = 0 if mode == "none" else self.pieces if mode == "paced" else 1
        for _ in range(periods):
            for g in range(self.gemms):
                for i in range(2):
                    with torch.cuda.stream(self.compute[i]):
                        torch.mm(self.a[i], self.b[i], out=self.c[i])
                    if g < copies:
                        self.copy(i, mode, g)
        for d in self.devs:
            torch.cuda.synchronize(d)

    def check(self) -> None:
        """Every mode's copies land the message's bytes where they should (a half copy: its first half)."""
        for mode in MODES[1:]:
            for t in self.to_peer + self.local:
                t.zero_()
            self.run(mode, 1)
            for i in range(2):
                got = (self.local if mode == "within" else self.to_peer)[i].cpu()
                n = self.elems // 2 if mode == "half" else self.elems
                if not torch.equal(got[:n], self.src[i][:n].cpu()):
                    raise AssertionError(f"{mode}: GPU {i}'s copy differs from its message")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--periods", type=int, default=1500, help="periods a mode runs each round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gemms", type=int, default=9, help="GEMMs a period")
    ap.add_argument("--pieces", type=int, default=8, help="copies a paced message is cut into")
    ap.add_argument("--message-mb", type=float, default=168.0, help="bytes each GPU sends a period, in MB (1e6)")
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs two GPUs")
    traffic = Traffic(int(args.message_mb * 1e6), args.gemms, args.pieces)
    traffic.check()
    traffic.run("none", 300)  # to the power cap
    clocks = [SmClock(i) for i in range(2)]
    seconds: dict[str, list[float]] = {m: [] for m in MODES}
    spans: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    try:
        for _ in range(args.rounds):
            for mode in MODES:
                _, span = clocks[0].window(lambda: traffic.run(mode, args.periods))
                seconds[mode].append(span[1] - span[0])
                spans[mode].append(span)
    finally:
        for c in clocks:
            c.close()
    base = statistics.mean(seconds["none"])
    rows = []
    for mode in MODES:
        mean = statistics.mean(seconds[mode])
        seen = [[c.median(s) for s in spans[mode]] for c in clocks]
        clock = " / ".join("n/a" if None in s else f"{statistics.median(m for m, _ in s):.0f}" for s in seen)
        power = " / ".join("n/a" if None in s else f"{statistics.median(w for _, w in s):.0f}" for s in seen)
        rows.append([mode, f"{mean / args.periods * 1e3:.3f}", f"{100 * (mean / base - 1):+.2f}%", clock, power])
    print(f"{args.gemms} GEMMs of {M} x {K} x {N} a period; {traffic.elems * 2 / 1e6:.0f} MB sent by each GPU "
          f"a period ({args.pieces} pieces when paced); {args.rounds} rounds of {args.periods} periods")
    print(markdown_table(["mode", "ms a period", "against none", "SM clock, GPU 0 / 1 (MHz)", "power (W)"], rows))


if __name__ == "__main__":
    main()
