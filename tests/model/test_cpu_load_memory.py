"""What bounds the default model's memory on a CPU, checked structurally (no RSS or timing): a GGUF load packs each
layer 4-bit before reading the next, so the float32 weights of at most one layer exist at once; a prompt row's bf16
weight is expanded from the packed bytes (the same values as a kept copy), and none is kept; building the model on
the meta device imports no torch._dynamo (with triton and sympy: ~110 MB)."""

from __future__ import annotations

import subprocess
import sys
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.model.int4_cpu import GROUP, Int4Linear, Int4Packing, _expand, int4_kernel_available, int4_linear_count
from hybridkv.model.loading import checkpoint

pytestmark = pytest.mark.skipif(not int4_kernel_available(), reason="torch has no CPU int4 kernel")


def test_a_gguf_load_holds_the_float32_linears_of_one_layer_at_a_time(monkeypatch):
    """Each time the reader hands over a tensor, the layers read from and not yet packed: at most one; and once the
    load is done no float linear of any layer is alive (nothing kept a reference to one)."""
    started: set[int] = set()
    linears: dict[int, list[weakref.ref]] = {}
    most = 0

    def watched(model, named):
        nonlocal most
        for index, layer in enumerate(model.layers):
            linears[index] = [weakref.ref(m) for m in layer.modules() if type(m) is not Int4Linear
                              and isinstance(m, nn.Linear)]
        for name, tensor in named:
            if name.startswith("model.layers."):
                started.add(int(name.split(".")[2]))
            float_layers = [i for i in started if any(ref() is not None for ref in linears[i])]
            most = max(most, len(float_layers))
            yield name, tensor

    real_load = checkpoint.load_weights
    monkeypatch.setattr(checkpoint, "load_weights",
                        lambda model, named, **kw: real_load(model, watched(model, named), **kw))
    loaded = checkpoint.load_checkpoint(None, progress=False, tokenizer=False, int4=Int4Packing(None))
    layers = len(loaded.model.layers)
    assert started == set(range(layers))
    assert most == 1
    assert int4_linear_count(loaded.model) == 7 * layers  # q, k, v, o, gate, up, down of every layer
    assert all(ref() is None for refs in linears.values() for ref in refs)


def test_without_pack_4bit_the_load_leaves_the_linears_float():
    """Any other caller (a model loaded once, then served by engines of either ``quantization``) gets the float
    model, which the engine packs after the load."""
    loaded = checkpoint.load_checkpoint(None, progress=False, tokenizer=False)
    assert int4_linear_count(loaded.model) == 0


@pytest.mark.parametrize("shape", [(128, 2 * GROUP), (960, 18 * GROUP), (576, 48 * GROUP)])
def test_a_prompt_rows_bf16_weight_is_expanded_from_the_packed_bytes_exactly(shape):
    """Whole 64-row blocks: no kept copy, and the expanded weight and a prompt's outputs are those of a kept bf16
    copy bit for bit (``_expand``), for any number of rows."""
    torch.manual_seed(0)
    n, k = shape
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    layer = Int4Linear(q, torch.rand(n, k // GROUP) * 0.01, torch.randn(n, k // GROUP) * 0.01, None)
    assert layer.dense is None
    kept = _expand(q, layer.scales_zeros)
    assert torch.equal(layer.bf16_weight(), kept)
    for rows in (1, 64, 300):
        x = torch.randn(rows, k)
        assert torch.equal(layer.dense_rows(x), F.linear(x.bfloat16(), kept).float())


def test_a_layer_of_a_partial_row_block_keeps_its_bf16_copy():
    """96 rows: the packing lays out a last block of 32 rows otherwise, so that layer keeps a copy (2 bytes a
    weight) rather than expanding bytes it cannot read."""
    q = torch.randint(0, 16, (96, 2 * GROUP), dtype=torch.int32)
    layer = Int4Linear(q, torch.rand(96, 2) * 0.01, torch.rand(96, 2) * 0.01, None)
    assert layer.dense is not None and torch.equal(layer.bf16_weight(), _expand(q, layer.scales_zeros))


def test_building_the_default_model_on_meta_imports_no_dynamo():
    """nn.Embedding's init on meta tensors goes through torch._refs, which imports torch._dynamo (and triton where
    installed): a fresh process builds the default model without it."""
    code = ("import sys; from hybridkv.model.factory import build_model; "
            "from hybridkv.model.loading.gguf_reader import read_gguf; "
            "from hybridkv.model.loading.known_models import resolve_model; "
            "build_model(read_gguf(resolve_model(None).path).hf_config); "
            "print(sorted(m for m in ('torch._dynamo', 'triton', 'sympy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
