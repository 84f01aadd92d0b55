"""A prompt's attention rows through our AVX-512 kernel (``hybridkv/model/prompt_attention_cpu.c``, which
``TorchPagedAttention`` takes on CPU): the exact softmax attention within float32 rounding, for full, sliding and
chunked layers over scattered pages, and each row's bits the same whatever its chunk, prefix cache hit or thread
count. Where the kernel does not run (no AVX-512 here, or a head size it does not take) the torch path answers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridkv.kv import FullAttentionSpec, plan_layout
from hybridkv.kv.specs import ChunkedLocalSpec, SlidingWindowSpec
from hybridkv.model.attention.base import StepSequence
from hybridkv.model.attention.prompt_attention_cpu import PromptAttentionKernel
from hybridkv.model.attention.torch_paged import TorchPagedAttention

KERNEL = PromptAttentionKernel.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no AVX-512 on this CPU (or the extension was not built)")
BLOCK = 16
HQ, HKV = 6, 2
SPECS = {
    "full": FullAttentionSpec(HKV, 64, "float32"),
    "sliding": SlidingWindowSpec(HKV, 64, "float32", window=100),
    "chunked": ChunkedLocalSpec(HKV, 64, "float32", chunk=96),
}
PROMPT = 300  # positions 0..299: past several key blocks of 64, windows and chunks


def backend(spec, prompt_kernel: bool = True) -> TorchPagedAttention:
    return TorchPagedAttention(plan_layout([spec], BLOCK), 64, "float32", prompt_kernel=prompt_kernel)


def inputs(head_dim: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(PROMPT, h, head_dim, generator=g) for h in (HQ, HKV, HKV))
    q[:, 0] *= 4.0  # one head with sharp softmaxes
    return q, k, v


# the sequence's pages out of order, so that a block of 64 keys spans pages that are not neighbours
TABLE = np.random.default_rng(1).permutation(64)[: -(-PROMPT // BLOCK)]


def run_chunks(attn: TorchPagedAttention, q, k, v, cuts: list[int]) -> torch.Tensor:
    """The prompt's rows computed in steps cut at ``cuts`` (each step writes its K/V, then attends)."""
    outs = []
    for start, stop in zip([0, *cuts], [*cuts, PROMPT]):
        attn.begin_step([StepSequence(start, stop - start, [TABLE])])
        outs.append(attn.attend(0, q[start:stop], k[start:stop], v[start:stop], 0.125))
    return torch.cat(outs)


def reference(spec, q, k, v) -> torch.Tensor:
    """float64 softmax attention, causal within the type's reach."""
    r = lambda x: x.double()  # noqa: E731
    pos = torch.arange(PROMPT)
    mask = spec.visible(pos, pos)
    per = HQ // HKV
    s = torch.einsum("qhd,khd->hqk", r(q), r(k).repeat_interleave(per, 1)) * 0.125
    w = s.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", w, r(v).repeat_interleave(per, 1)).float()


@needs_kernel
@pytest.mark.parametrize("kind", SPECS)
def test_rows_match_the_exact_softmax(kind):
    spec = SPECS[kind]
    q, k, v = inputs()
    out = run_chunks(backend(spec), q, k, v, [])
    want = reference(spec, q, k, v)
    assert (out - want).abs().max() < 2e-5  # float32 rounding of scores up to ~40 (the sharp head)
    torch_path = run_chunks(backend(spec, prompt_kernel=False), q, k, v, [])
    assert (torch_path - want).abs().max() < 2e-5
    assert not torch.equal(out, torch_path)  # the kernel did run (another order of the same sums)


@needs_kernel
@pytest.mark.parametrize("kind", SPECS)
def test_a_rows_bits_do_not_depend_on_its_chunk_or_the_threads(kind):
    spec = SPECS[kind]
    q, k, v = inputs()
    cold = run_chunks(backend(spec), q, k, v, [])
    assert torch.equal(run_chunks(backend(spec), q, k, v, [1, 37, 64, 65, 200, 299]), cold)
    # a prefix cache hit: the first 150 tokens' K/V already in the pages, the rest computed in one step
    attn = backend(spec)
    run_chunks(attn, q, k, v, [150])
    attn.begin_step([StepSequence(150, PROMPT - 150, [TABLE])])
    assert torch.equal(attn.attend_stored(0, q[150:], 0.125), cold[150:])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(run_chunks(backend(spec), q, k, v, [100]), cold)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_the_kernel_reads_only_the_sequences_pages():
    """Another sequence's K/V in the other pages (NaN here) change nothing."""
    spec = SPECS["full"]
    q, k, v = inputs()
    attn = backend(spec)
    attn.cache.buffer.fill_(float("nan"))
    attn.cache.buffer.view(64, -1)[TABLE] = 0.0
    out = run_chunks(attn, q, k, v, [130])
    assert torch.equal(out, run_chunks(backend(spec), q, k, v, [130]))


def test_elsewhere_the_torch_path_answers():
    """A head size the kernel does not take (32), and a backend without the kernel: torch's flash kernel by
    segments, bit for bit."""
    spec = FullAttentionSpec(HKV, 32, "float32")
    q, k, v = inputs(head_dim=32)
    if KERNEL is not None:
        assert not KERNEL.takes(backend(spec).cache.layers[0])
    assert torch.equal(run_chunks(backend(spec), q, k, v, [100]),
                       run_chunks(backend(spec, prompt_kernel=False), q, k, v, [100]))
    assert backend(SPECS["full"], prompt_kernel=False)._prompt_kernel is None
    assert (backend(SPECS["full"])._prompt_kernel is None) == (KERNEL is None)
