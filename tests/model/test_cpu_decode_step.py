"""The C decode step of a 4-bit Llama (``hybridkv/model/cpu_decode.c`` through ``llama_cpu_decode.NativeDecode``):
the torch loop's hidden states and stored K/V within float32 rounding, and a row's bits the same at every
instruction set, thread count and batch; and the backend's tables it reads (``TorchPagedAttention.decode_rows``)."""

from __future__ import annotations

from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from hybridkv.kv.layer_specs import layer_specs_from_hf_config
from hybridkv.kv.layout import plan_layout
from hybridkv.model.architectures.llama_cpu_decode import CpuDecodeLlama
from hybridkv.model.architectures.parallel import fuse_columns
from hybridkv.model.attention.base import StepSequence
from hybridkv.model.attention.torch_paged import TorchPagedAttention
from hybridkv.model.int4_cpu import GROUP, int4_kernel_available, pack_int4_linears
from hybridkv.model.q4_1_cpu import Q41Kernel

KERNEL = Q41Kernel.load(threads=2) if int4_kernel_available() else None
pytestmark = pytest.mark.skipif(KERNEL is None, reason="our Q4_1 kernel was not built")
BLOCK = 4  # tokens a page: a row's keys span many blocks and several of the step's chunks of 32 keys
CONTEXTS = [3, 37, 70]  # cached tokens of each sequence before its decode step


def q4_1(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """A weight as a Q4_1 GGUF holds it: quantised by gguf (llama.cpp's reference code) and dequantised."""
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.05
    quant = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    return torch.from_numpy(gguf.quants.dequantize(quant, gguf.GGMLQuantizationType.Q4_1).copy()).float()


def placed_llama(bias: bool = False, kernel: Q41Kernel | None = KERNEL, **extra) -> tuple[CpuDecodeLlama, dict]:
    """A 2-layer Llama of Q4_1 weights, 4 query heads over 2 KV heads, packed 4-bit and placed on the CPU (``extra``:
    more of its config)."""
    from hybridkv.model.architectures.llama import LlamaForCausalLM
    from hybridkv.model.architectures.llama_config import ModelConfig

    hf = {"model_type": "llama", "vocab_size": 64, "hidden_size": 2 * GROUP, "intermediate_size": 3 * GROUP,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": GROUP,
          "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
          "attention_bias": bias, **extra}
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.from_hf(hf))
    with torch.no_grad():
        for i, linear in enumerate(m for m in model.modules() if isinstance(m, nn.Linear)):
            linear.weight.copy_(q4_1(tuple(linear.weight.shape), seed=40 + i))
            if linear.bias is not None:
                linear.bias.normal_(0, 0.1)
        for norm in (m for name, m in model.named_modules() if name.endswith("norm")):
            norm.weight.uniform_(0.5, 1.5)
    pack_int4_linears(model, model.residual_branch_ends, kernel=kernel)
    fuse_columns(model)
    placed = model.place("cpu")
    assert isinstance(placed, CpuDecodeLlama)
    return placed, hf


def prefilled(model: CpuDecodeLlama, hf: dict) -> tuple[TorchPagedAttention, list[list[np.ndarray]], torch.Tensor]:
    """A float32 paged cache holding ``CONTEXTS`` prompts' K/V (each sequence and layer group its own blocks), the
    block tables (per sequence, per group), and the next token of each sequence."""
    layout = plan_layout(layer_specs_from_hf_config(hf, kv_cache_dtype="float32"), BLOCK)
    backend = TorchPagedAttention(layout, 128, "float32")
    tables, first = [], 1
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n in CONTEXTS:
            tables.append([])
            for _ in layout.groups:
                tables[-1].append(np.arange(first, first + n // BLOCK + 1))
                first += n // BLOCK + 1
            backend.begin_step([StepSequence(0, n, tables[-1])])
            model(torch.randint(0, 64, (n,), generator=g), torch.arange(n), backend)
    return backend, tables, torch.randint(0, 64, (len(CONTEXTS),), generator=g)


def decode(model, backend, tables, ids, rows=None, native=True):
    """A decode step of the sequences ``rows`` (all: None): the C step's hidden states, or the torch loop's."""
    rows = range(len(CONTEXTS)) if rows is None else rows
    backend.begin_step([StepSequence(CONTEXTS[i], 1, tables[i], generated=True) for i in rows])
    positions = torch.tensor([CONTEXTS[i] for i in rows])
    inner = model.model
    x, tables_ = inner.embed_tokens(ids[list(rows)]), inner.position_tables(positions)
    with torch.no_grad():
        if native:
            return model.native(x, tables_, backend)
        out, residual = model.loop(x, tables_, backend)
        return inner.norm.add_forward(out, residual)[0]


def stored(backend: TorchPagedAttention, tables: list[list[np.ndarray]]) -> torch.Tensor:
    """Every layer's K and V in each sequence's slot of the decode step."""
    return torch.stack([layer.view[int(t[layer.group_id][n // BLOCK]), :, n % BLOCK]
                        for layer in backend.cache.layers.values() for t, n in zip(tables, CONTEXTS)])


# Qwen2's sliding window on layer 1 only: two layer groups, layer 1's keys a window starting inside a block
WINDOW = {"use_sliding_window": True, "max_window_layers": 1, "sliding_window": 10}


@pytest.mark.parametrize("bias, extra", [(False, {}), (True, {}), (False, WINDOW)])
def test_the_c_step_gives_the_torch_loops_hidden_states_and_kv_within_float32_rounding(bias, extra):
    model, hf = placed_llama(bias, **extra)
    assert model.native is not None and model.decodes_apart
    backend, tables, ids = prefilled(model, hf)
    want = decode(model, backend, tables, ids, native=False)
    if extra:  # the last row (70 cached tokens) reads all 71 keys in layer 0, a window of 10 in layer 1
        assert sorted(backend.decode_rows()[0][:, 2, 4].tolist()) == [10, 71]
    want_kv = stored(backend, tables)
    got = decode(model, backend, tables, ids)
    got_kv = stored(backend, tables)
    assert got.shape == want.shape == (len(CONTEXTS), hf["hidden_size"])
    # norms, SiLU and attention are the C step's own float32 arithmetic, a few ulps from torch's; an ulp can move
    # an activation's second int8 digit by one (a block's max|x| / 32512) in the next 4-bit linear
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())
    torch.testing.assert_close(got_kv, want_kv, rtol=0, atol=1e-4 * want_kv.abs().max().item())
    assert not torch.equal(got, want)  # really the C step


def test_a_rows_bits_do_not_depend_on_the_instruction_set_the_threads_or_the_other_rows():
    model, hf = placed_llama()
    backend, tables, ids = prefilled(model, hf)
    native = model.native
    want = decode(model, backend, tables, ids)
    for isa in range(KERNEL.isa + 1):  # scalar C, AVX2, AVX-512 VNNI: those this CPU runs
        for threads in (1, 2, 3):
            model.native = replace(native, kernel=Q41Kernel(KERNEL.ext, isa, threads))
            assert torch.equal(decode(model, backend, tables, ids), want), (isa, threads)
    model.native = native
    for i in range(len(CONTEXTS)):  # each sequence alone: its row of the step of all three, bit for bit
        assert torch.equal(decode(model, backend, tables, ids, rows=[i])[0], want[i])


def test_the_c_step_runs_only_decode_steps_and_only_over_our_kernel():
    model, hf = placed_llama()
    backend, tables, ids = prefilled(model, hf)
    backend.begin_step([StepSequence(CONTEXTS[1], 2, tables[1], generated=True)])  # two rows of one sequence
    assert backend.decode_rows() is None
    backend.begin_step([StepSequence(CONTEXTS[0], 1, tables[0])])  # a prompt's last token
    assert backend.decode_rows() is None
    torch_kernel, _ = placed_llama(kernel=None)
    assert torch_kernel.native is None and not torch_kernel.decodes_apart


def test_decode_rows_are_each_rows_slot_and_the_keys_it_reads():
    """``TorchPagedAttention.decode_rows``' docstring example: one group, rows at context 17 and 3, block 16."""
    layout = plan_layout(layer_specs_from_hf_config(placed_llama()[1], kv_cache_dtype="float32"), 16)
    backend = TorchPagedAttention(layout, 16, "float32")
    backend.begin_step([StepSequence(17, 1, [np.array([5, 9])], generated=True),
                        StepSequence(3, 1, [np.array([2])], generated=True)])
    rows, blocks = backend.decode_rows()
    assert rows.tolist() == [[[9, 1, 0, 0, 18], [2, 3, 2, 0, 4]]] and blocks.tolist() == [5, 9, 2]
    caches = backend.decode_caches()
    layer = backend.cache.layers[1]
    assert caches.shape == (2, 6) and caches[1].tolist() == [
        layer.keys.data_ptr(), layer.values.data_ptr(), *layer.keys.stride()[:3], layer.group_id]
