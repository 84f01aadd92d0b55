"""The output head's greedy token on CPU from an int8 copy of its weight, exact against the float32 head.

A CPU decode step of a small model reads its output head once a token: SmolLM2-135M's tied embedding is 49,152 x
576, 113 MB in float32, 11.5 ms of a 32 ms 4-bit decode step on one core. Greedy decoding needs only each row's
argmax, so the head is screened with an int8 copy (one scale per vocabulary row, through torch's CPU int8 kernel
with bf16 activations: 4x fewer bytes, 4.2 ms), and every token that could still be the argmax is re-scored with
the float32 weight.

The bound: for a hidden row h and vocabulary row w, with ``e`` the int8 row the kernel uses (``q * bf16(scale)``),
the kernel's score differs from ``h . w`` by at most

    |h|_1 * (max|w - e| + (2^-8 + K 2^-23) max|e|)  +  2^-7 |score|

(the weight's rounding to int8; h rounded to bf16, relative 2^-8, and a float32 sum of K terms; the score rounded
to bf16, where 2^-7 leaves room for the float32 rounding of the comparison; the first term is taken 1% larger).
A token whose score plus its bound is below the largest score minus its bound cannot be the argmax; every other
token (on SmolLM2's chat replies, ``benchmarks/cpu.py --error``: 34 of 49,152 a step on average, at most 476) is
re-scored with the float32 weight. The returned logits are exact (float32) for every re-scored token and within the bound elsewhere,
so their argmax, lowest index first among equals, is the float32 head's. Only rows whose token is the plain
argmax use it (``SamplingParams.argmax_only``): sampling, logprobs and anything that edits logits read every
logit, and get the float32 head.

Example: scores [5.0, 4.9, 1.0] with bounds [0.2, 0.2, 0.1]: the best lower end is 4.8; tokens 0 (5.2) and 1
(5.1) reach it and are re-scored, token 2 (1.1) cannot be the argmax and keeps its screened score.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

_BF16_UNIT = 2.0**-8  # bf16's relative rounding error (8 significant bits)


def int8_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


@dataclass(slots=True)
class Int8ArgmaxHead:
    """float32 logits of hidden rows whose argmax equals that of ``F.linear(hidden, weight)``."""

    q: torch.Tensor  # int8 [vocab, hidden]
    scales: torch.Tensor  # bf16 [vocab], one per vocabulary row
    row_error: torch.Tensor  # float32 [vocab]: the bound of a row's score over |h|_1

    @classmethod
    def of(cls, weight: torch.Tensor) -> Int8ArgmaxHead:
        w = weight.detach().float()
        amax = w.abs().amax(1)
        scales = torch.where(amax > 0, amax / 127, torch.ones_like(amax)).bfloat16()
        q = (w / scales.float()[:, None]).round().clamp(-127, 127)
        e = q * scales.float()[:, None]  # exact in float32: an int8 times a bf16
        k = w.shape[1]
        # 1% over: the bound's own float32 arithmetic rounds too
        row_error = 1.01 * ((w - e).abs().amax(1) + (_BF16_UNIT + k * 2.0**-23) * e.abs().amax(1))
        return cls(q.to(torch.int8).contiguous(), scales, row_error)

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
        """(the int8 kernel's scores, float32 [R, vocab]; the bound of their distance from the float32 head's)."""
        h = hidden.float()
        scores = torch.ops.aten._weight_int8pack_mm(h.bfloat16(), self.q, self.scales).float()
        return scores, h.abs().sum(1, keepdim=True) * self.row_error + 2 * _BF16_UNIT * scores.abs()


def _reach(scores: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """[R, vocab] bool: the tokens whose score plus bound reaches the row's best score minus its bound."""
    return scores + bound >= (scores - bound).amax(1, keepdim=True)
