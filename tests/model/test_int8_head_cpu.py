"""The int8 output head of CPU greedy decoding: its bound holds, every token that could be the argmax is re-scored
in float32, so the argmax is the float32 head's, near-ties included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridkv.model.int8_head_cpu import Int8ArgmaxHead, _prepack, _sums, int8_gemm, int8_kernel_available

pytestmark = pytest.mark.skipif(not int8_kernel_available(), reason="torch has no CPU int8 kernel")


def head_and_rows(vocab: int, hidden: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, hidden, generator=g) * 0.05, torch.randn(rows, hidden, generator=g) * 4


@pytest.mark.parametrize("rows", [1, 4])
def test_the_bound_holds_and_the_logits_are_exact_where_they_could_be_the_largest(rows):
    w, h = head_and_rows(3000, 128, rows, seed=0)
    head = Int8ArgmaxHead.of(w)
    exact = F.linear(h, w)
    scores, bound = head.screen(h)
    assert (scores - exact).abs().le(bound).all()
    assert (scores - exact).abs().max() > 0  # really the int8 kernel
    got = head(h, w)
    assert torch.equal(got.argmax(1), exact.argmax(1))
    rescored = head.rescored(h)
    assert (rescored >= 1).all() and rescored.max() < 3000 // 10  # the screen leaves few tokens to float32
    assert ((got != scores).sum(1) <= rescored.sum()).all()  # only those (of any row) changed
    top = exact.argmax(1)
    torch.testing.assert_close(got.gather(1, top[:, None]), exact.gather(1, top[:, None]), rtol=1e-6, atol=1e-6)
    assert (got - exact).abs().le(bound).all()  # elsewhere: within the bound


def test_a_near_tie_that_int8_cannot_see_is_decided_by_the_float_weight():
    """Rows 0 and 1 differ by 1e-5 in one weight (not their largest, which sets the scale): the same int8 row and
    the same score, but row 1 is larger."""
    w, h = head_and_rows(500, 64, 1, seed=1)
    h = h.abs()
    w[0] = 0.3
    w[0, 0] = 0.5
    w[1] = w[0]
    w[1, 5] += 1e-5
    head = Int8ArgmaxHead.of(w)
    scores, _ = head.screen(h)
    assert scores[0, 0] == scores[0, 1] and scores.argmax() == 0  # int8 alone picks row 0
    assert F.linear(h, w).argmax() == 1
    assert head(h, w).argmax() == 1


def test_hidden_rows_with_outlier_channels_go_in_as_two_digits_and_stay_exact():
    """A few channels 40x the others (as a final hidden state's are): one int8 digit would round every other
    channel to a few levels and leave over a hundred of these tokens in reach (the weight is on an int8 grid here,
    so only the hidden row's rounding counts); with the second digit the argmax alone is."""
    g = torch.Generator().manual_seed(2)
    w = torch.randint(-127, 128, (3000, 128), generator=g) / 2048
    w[:, 0] = 127 / 2048
    h = torch.randn(3, 128, generator=g) * 4
    h[:, [3, 50, 97]] *= 40
    head = Int8ArgmaxHead.of(w)
    scores, bound = head.screen(h)
    assert (scores.double() - F.linear(h.double(), w.double())).abs().le(bound.double()).all()
    assert head.rescored(h).tolist() == [1, 1, 1]
    assert torch.equal(head(h, w).argmax(1), F.linear(h, w).argmax(1))


def test_the_gemm_sums_exactly_at_the_extremes():
    """What ``int8_kernel_available`` checks, here for the head's own shapes: digits and weights of +-127 whose
    products all add up (the largest sum there is) come out exact."""
    w = torch.full((300, 128), 0.5)
    w[1] = -0.5
    head = Int8ArgmaxHead.of(w)
    h = torch.full((1, 128), 3.0)  # one digit of 127 everywhere, a second of 0
    scores, _ = head.screen(h)
    assert scores[0, 0] == 3.0 * 0.5 * 128 and scores[0, 1] == -3.0 * 0.5 * 128


@pytest.mark.parametrize("kind", ["fbgemm", "onednn"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_each_gemm_gives_each_rows_exact_sums_times_its_scale(kind, rows):
    """fbgemm's GEMM (its input quantisation fixed by extremes in extra zero-weight columns) and oneDNN's (fewer
    than four rows padded with zero digits): every row's sums exact, times the vocabulary row's scale, and only the
    rows asked for come back."""
    g = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (300, 128), generator=g, dtype=torch.int8)
    digits = torch.randint(-127, 128, (rows, 128), generator=g).float()
    scales = torch.rand(300, generator=g) + 0.5
    try:
        packed = _prepack(kind, q, scales)
    except (AttributeError, RuntimeError):
        pytest.skip(f"no {kind} int8 GEMM in this torch")
    got = _sums(kind, digits, packed, scales, torch.zeros(300, dtype=torch.int64))
    assert got.shape == (rows, 300)
    assert torch.equal(got, (digits.long() @ q.long().t()).float() * scales)


def test_both_gemms_screen_alike():
    """The head picks fbgemm's GEMM where it sums exactly (on this x86 torch it does); either gives the same
    scores."""
    if int8_gemm() != "fbgemm":
        pytest.skip("fbgemm's int8 GEMM is not exact here")
    w, h = head_and_rows(3000, 128, 3, seed=4)
    assert Int8ArgmaxHead.of(w).kind == "fbgemm"
    assert torch.equal(Int8ArgmaxHead.of(w, "fbgemm").screen(h)[0], Int8ArgmaxHead.of(w, "onednn").screen(h)[0])
