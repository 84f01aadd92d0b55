"""The output head's greedy token on CPU from an int8 copy of its weight, exact against the float32 head.

A CPU decode step of a small model reads its output head once a token: SmolLM2-135M's tied embedding is 49,152 x
576, 113 MB in float32, 11.5 ms of a 32 ms 4-bit decode step on one core. Greedy decoding needs only each row's
argmax, so the head is screened with an int8 copy (one scale per vocabulary row: 4x fewer bytes) through an int8
GEMM on a prepacked weight, and every token that could still be the argmax is re-scored with the float32 weight.
The GEMM (``int8_gemm``) is fbgemm's (``torch.ops.quantized.linear_dynamic``: 1.4 ms on one core, the weight read
from memory as in a decode step), or oneDNN's (``torch.ops.onednn.qlinear_pointwise``: 2.1 ms) where fbgemm's is
missing or does not sum exactly; torch's bf16-activation int8 kernel took 3.8 ms.

The hidden row x goes in as two int8 digits, two rows of the GEMM at the price of one: ``x = s1 a + s2 b + r``
with ``s1 = max|x| / 127``, ``a = round(x / s1)``, ``s2 = max|x - s1 a| / 127``, ``b = round((x - s1 a) / s2)``.
The int32 sums are exact, so with ``e = s_w q`` the int8 row (``w - e`` its rounding) the screened score
``s_w (s1 a.q + s2 b.q)`` differs from ``x . w`` by ``r . e + x . (w - e)``, at most

    |r|_2 |e|_2  +  |x|_1 max|w - e|  (+ (K 2^-23 + 2^-19) |x|_1 max|w| for the float32 head's own rounding, and ours)

the first two taken 1% larger (the bound's own float32 arithmetic rounds too). A token whose score plus its bound
is below the largest score minus its bound cannot be the argmax; every other token is re-scored with the float32
weight. Hidden states have outlier channels (a row's largest value is 7-20x its RMS on SmolLM2): one digit would
leave r coarse (a median of 57 tokens a row to re-score on chat replies, some rows thousands); with two, 4 a row on
average (at most 56; ``benchmarks/cpu.py --error``). The returned logits are exact (float32) for every re-scored
token and within the bound elsewhere, so their argmax, lowest index first among equals, is the float32 head's.
Only rows whose token is the plain argmax use it (``SamplingParams.argmax_only``): sampling, logprobs and anything
that edits logits read every logit, and get the float32 head.

Example: scores [5.0, 4.9, 1.0] with bounds [0.2, 0.2, 0.1]: the best lower end is 4.8; tokens 0 (5.2) and 1
(5.1) reach it and are re-scored, token 2 (1.1) cannot be the argmax and keeps its screened score.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

_ZERO_POINT = 128  # oneDNN's GEMM takes unsigned activations: a digit d in -127..127 goes in as d + 128
_FEWEST_ROWS = 4  # rows of oneDNN's GEMM: fewer are padded (``_sums``)
_SPREAD_COLUMNS = 4  # zero columns fbgemm's copy of the weight has beyond the hidden size (``_sums``)
_BUILD_ROWS = 1024  # vocabulary rows quantised at a time (``_int8_rows``; 4,096 left ~140 MB of freed heap resident)


def int8_kernel_available() -> bool:
    """An int8 GEMM of this torch sums exactly in int32 (``int8_gemm``)."""
    return int8_gemm() is not None


def int8_gemm() -> str | None:
    """The int8 GEMM the head runs: "fbgemm" (torch's dynamically quantised linear: 1.4 ms for SmolLM2's head on
    one core, its weight read from memory) where it sums exactly, else "onednn" (2.1 ms) where it does, else None.
    Exactly: a kernel that saturates 16-bit pair sums, as int8 kernels without VNNI may, would break the bound;
    checked on products of +-127."""
    g = torch.Generator().manual_seed(0)
    a = (torch.randint(0, 2, (2, 64), generator=g) * 254 - 127).float()
    w = (torch.randint(0, 2, (24, 64), generator=g) * 254 - 127).to(torch.int8)
    w[0] = a[0]  # the largest sum there is: 64 x 127^2
    want = (a.double() @ w.t().double())
    for kind in ("fbgemm", "onednn"):
        try:
            got = _sums(kind, a, _prepack(kind, w, torch.ones(24)), torch.ones(24), torch.zeros(24, dtype=torch.int64))
        except (AttributeError, RuntimeError):  # not in this torch, or not on this CPU
            continue
        if torch.equal(got.double(), want):
            return kind
    return None


@dataclass(slots=True)
class Int8ArgmaxHead:
    """float32 logits of hidden rows whose argmax equals that of ``F.linear(hidden, weight)``."""

    kind: str  # which int8 GEMM (``int8_gemm``)
    packed: Any  # the int8 [vocab, hidden] copy, prepacked for that GEMM
    scales: torch.Tensor  # float32 [vocab], one per vocabulary row
    zero_points: torch.Tensor  # int64 [vocab] zeros: the weight is symmetric (oneDNN's GEMM takes one per row)
    # float32 [2, vocab]: what |x|_1 and |r|_2 multiply in a row's bound (``_bound``)
    row_error: torch.Tensor

    @classmethod
    def of(cls, weight: torch.Tensor, kind: str | None = None) -> Int8ArgmaxHead:
        """``kind``: the GEMM (default: ``int8_gemm()``'s pick)."""
        kind = kind or int8_gemm()
        if kind is None:
            raise RuntimeError("no int8 GEMM of this torch sums exactly in int32 (int8_kernel_available)")
        vocab, hidden = weight.shape
        # one int8 copy, written in place (fbgemm's with its zero columns already): no second one to join or pad
        q = torch.zeros(vocab, hidden + (_SPREAD_COLUMNS if kind == "fbgemm" else 0), dtype=torch.int8)
        scales, row_error = torch.empty(vocab), torch.empty(vocab, 2)
        for lo in range(0, vocab, _BUILD_ROWS):
            hi = min(lo + _BUILD_ROWS, vocab)
            q[lo:hi, :hidden], scales[lo:hi], row_error[lo:hi] = _int8_rows(weight.detach()[lo:hi])
        zeros = torch.zeros(scales.shape, dtype=torch.int64)
        return cls(kind, _prepack(kind, q, scales, spread=kind == "fbgemm"), scales, zeros, row_error.t().contiguous())

    @property
    def vocab_size(self) -> int:
        return self.scales.shape[0]

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``hidden`` [R, K]; ``weight`` the float head [vocab, K] the int8 copy was made of."""
        h = hidden.float()
        scores, bound = self.screen(h)
        rows = _reach(scores, bound).any(0).nonzero()[:, 0]  # the union over rows: extra exact scores do no harm
        scores[:, rows] = F.linear(h, weight[rows].float())
        return scores

    def rescored(self, hidden: torch.Tensor) -> torch.Tensor:
        """How many tokens of each row [R] could be its argmax (and are re-scored in float32)."""
        return _reach(*self.screen(hidden)).sum(1)

    def screen(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the screened scores, float32 [R, vocab]; the bound of their distance from the float32 head's)."""
        h = hidden.float()
        s1, a, r = _digit(h)
        s2, b, r = _digit(r)
        both = _sums(self.kind, torch.cat((a, b)), self.packed, self.scales, self.zero_points)  # [2R, vocab]: a.e, b.e
        rows = h.shape[0]
        scores = both[:rows] * s1 + both[rows:] * s2
        return scores, torch.cat((h.abs().sum(1, keepdim=True), r.norm(dim=1, keepdim=True)), 1) @ self.row_error


def _int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 q [n, K], scales [n], row_error [n, 2]) of ``n`` rows of the float head: ``Int8ArgmaxHead``'s copy, a
    slice of rows at a time (the float32 temporaries of a whole 49,152 x 576 head add ~120 MB to start-up's peak)."""
    w = weight.float()
    amax = w.abs().amax(1)
    scales = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = (w / scales[:, None]).round().clamp(-127, 127)
    e = q * scales[:, None]
    per_l1 = 1.01 * (w - e).abs().amax(1) + (w.shape[1] * 2.0**-23 + 2.0**-19) * amax
    return q.to(torch.int8), scales, torch.stack((per_l1, 1.01 * e.norm(dim=1)), 1)


def _digit(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(s [R, 1], a [R, K] whole numbers in -127..127, x - s a): each row of x to the nearest multiple of
    s = max|row| / 127."""
    s = x.abs().amax(1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127
    a = (x / s).round()
    return s, a, x - a * s


def _prepack(kind: str, q: torch.Tensor, scales: torch.Tensor, spread: bool = False) -> Any:
    """int8 ``q`` [vocab, K] with its row ``scales``, prepacked for GEMM ``kind``; ``spread``: fbgemm's ``q`` has its
    ``_SPREAD_COLUMNS`` zero columns already."""
    if kind == "onednn":
        return torch.ops.onednn.qlinear_prepack(q, [1, q.shape[1]])
    if torch.backends.quantized.engine not in ("x86", "fbgemm"):  # another engine packs for its own kernels
        raise RuntimeError(f"quantized engine {torch.backends.quantized.engine} does not run fbgemm")
    with warnings.catch_warnings():  # torch deprecates its quantised tensors for torchao's; torch 2.13 has them
        warnings.simplefilter("ignore", UserWarning)
        zeros = torch.zeros_like(scales, dtype=torch.int64)
        q = q if spread else F.pad(q, (0, _SPREAD_COLUMNS))
        weight = torch._make_per_channel_quantized_tensor(q, scales.double(), zeros, 0)
    return torch.ops.quantized.linear_prepack(weight, None)


def _sums(kind: str, digits: torch.Tensor, packed: Any, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """float32 [R, vocab]: each row's exact int32 sum of ``digits . q`` (whole numbers in -127..127), times the
    vocabulary row's scale, through GEMM ``kind``.

    fbgemm's linear quantises its float input itself, one scale and zero point for the whole tensor from its least
    and largest value: -128 and 127 in columns whose weights are zero (``_SPREAD_COLUMNS``) make that range 255
    wide, so the scale is 1 and the zero point 128, and every digit goes in as itself. (In an extra row instead
    they cost more: 9 rows of SmolLM2's head took 2.9 ms against 2.3 for 8, four streams' digits.)

    oneDNN's takes unsigned activations with one zero point: a digit d goes in as d + 128. It runs the SmolLM2
    head in 2.1 ms for 3 to 6 rows on one core and 2.5-3.1 ms for 1 or 2 (its weight read from memory: a decode
    step's), so fewer than ``_FEWEST_ROWS`` rows go in padded with zero digits."""
    rows = digits.shape[0]
    if kind == "fbgemm":
        k = digits.shape[1]
        spread = F.pad(digits, (0, _SPREAD_COLUMNS))
        spread[0, k], spread[0, k + 1] = -128.0, 127.0
        return torch.ops.quantized.linear_dynamic(spread, packed, False)
    u8 = (digits + _ZERO_POINT).to(torch.uint8)
    if rows < _FEWEST_ROWS:
        u8 = torch.cat((u8, u8.new_full((_FEWEST_ROWS - rows, u8.shape[1]), _ZERO_POINT)))
    got = torch.ops.onednn.qlinear_pointwise(u8, 1.0, _ZERO_POINT, packed, scales, zeros, None, 1.0, 0,
                                             torch.float32, "none", [], "")
    return got[:rows]


def _reach(scores: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """[R, vocab] bool: the tokens whose score plus bound reaches the row's best score minus its bound."""
    return scores + bound >= (scores - bound).amax(1, keepdim=True)
