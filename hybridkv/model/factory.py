"""One model factory: ``model_type`` -> (config class, model class), and ``build_model`` for every way a model is
made: one rank or one tensor-parallel shard, weights to be loaded or dummy (seeded random) weights.

Adding an architecture: its config class (``from_hf(hf_config)``) and model class (``(cfg, dtype=, tp=)``,
implementing ``CausalLM``) in ``architectures/``, and its model types here.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from hybridkv.kv.dtypes import MODEL_DTYPES
from hybridkv.kv.weight_formats import UNQUANTIZED, WeightFormat
from hybridkv.model.architectures.gemma3 import GEMMA3_MODEL_TYPES, Gemma3Config, Gemma3ForCausalLM
from hybridkv.model.architectures.llama import Experts, LlamaForCausalLM
from hybridkv.model.architectures.llama_config import LLAMA_MODEL_TYPES, ModelConfig
from hybridkv.model.architectures.parallel import ColumnParallelLinear, RowParallelLinear, TPGroup
from hybridkv.model.causal_lm import CausalLM
from hybridkv.model.dtypes import MODEL_TORCH_DTYPES
from hybridkv.model.quantization.quantized_layers import is_quantized, quantize_layout, random_quantized

# the linears a quantized format stores quantized: those of attention and the MLPs, and a MoE's routed experts where
# the format quantizes them (INT4); not routers, embeddings, heads
QUANTIZABLE = (ColumnParallelLinear, RowParallelLinear, Experts)
LOAD_FORMATS = ("auto", "dummy")  # vLLM's names: the checkpoint's weights | random weights from config.json alone


@dataclass(frozen=True, slots=True)
class Architecture:
    config_class: type  # from_hf(hf_config) -> its config
    model_class: type  # (config, dtype=, tp=) -> CausalLM


_LLAMA = Architecture(ModelConfig, LlamaForCausalLM)
_GEMMA3 = Architecture(Gemma3Config, Gemma3ForCausalLM)
ARCHITECTURES = MappingProxyType(
    {**{t: _LLAMA for t in LLAMA_MODEL_TYPES}, **{t: _GEMMA3 for t in GEMMA3_MODEL_TYPES}}
)


def architecture(hf_config: dict[str, Any]) -> Architecture:
    model_type = hf_config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[model_type]


def build_model(
    hf_config: dict[str, Any], dtype: torch.dtype = torch.float32, tp: TPGroup | None = None,
    load_format: str = "auto", device: str = "cpu", seed: int = 0, weights: WeightFormat = UNQUANTIZED,
) -> CausalLM:
    """This rank's model, placed on ``device`` (``CausalLM.place``). ``auto``: uninitialised (no random init:
    every parameter must be loaded before use); ``dummy``: norms neutral, every other weight N(0, 0.02) drawn on
    ``device`` from ``seed + rank``. ``weights``: a quantized format keeps the linears of attention and the MLPs (and
    a MoE's routed experts) in it (``quantization/quantized_layers.py``)."""
    if dtype not in MODEL_TORCH_DTYPES:
        raise ValueError(f"dtype {dtype} is not supported; choose {', '.join(MODEL_DTYPES)}")
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; choose {' or '.join(LOAD_FORMATS)}")
    arch = architecture(hf_config)
    tp = tp or TPGroup()
    with torch.device("meta"):
        model = arch.model_class(arch.config_class.from_hf(hf_config), dtype=dtype, tp=tp)
        if weights.quantized:
            quantize_layout(model, weights, QUANTIZABLE)
    # Module.to_empty's empty_like of a meta tensor runs torch._refs, which imports sympy (~35 MB RSS on a CPU)
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device)).eval()
    if load_format == "dummy":
        _random_weights(model, torch.Generator(device=device).manual_seed(seed + tp.rank))
    return model.place(device)


@torch.no_grad()
def _random_weights(model: torch.nn.Module, gen: torch.Generator) -> None:
    drawn: set[int] = set()  # a quantized linear's weight and scales, drawn as one (``random_quantized``)
    for name, module in model.named_modules():
        if "norm" in name.rpartition(".")[2]:
            module.reset_parameters()  # neutral: Llama's 1, Gemma's zero-centred 0
        if is_quantized(module):
            random_quantized(module, gen)
            drawn.update(id(p) for n, p in module.named_parameters(recurse=False) if n != "bias")
    for name, param in model.named_parameters():
        if "norm" not in name and id(param) not in drawn:
            param.normal_(0.0, 0.02, generator=gen)
