"""Load one tensor-parallel rank's shard of a checkpoint.

Safetensors tensors are opened as lazy slices and each parallel layer reads only its rows or columns
(``load_shard`` in ``parallel.py``), so a rank never holds a whole sharded weight. GGUF tensors are dequantised
whole by the reader, then sliced.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from hybridkv.kv.layer_specs import load_hf_config
from hybridkv.model.loading.checkpoint import LoadedModel
from hybridkv.model.architectures.llama_config import SUPPORTED_MODEL_TYPES, ModelConfig
from hybridkv.model.loading.gguf_reader import read_gguf
from hybridkv.model.architectures.llama import LlamaForCausalLM
from hybridkv.model.loading.weights import SUPPORTED_DTYPES, load_weights, safetensors_files
from hybridkv.model.architectures.parallel import TPGroup
from hybridkv.model.loading.known_models import resolve_model
from hybridkv.model.loading.tokenizer import Tokenizer


def iter_safetensors_slices(files: list[Path], progress: bool = True) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) per tensor; a slice reads from disk only the part it is indexed with."""
    # no tqdm at all without a bar: it would make a multiprocessing lock that a killed worker leaks
    bar = tqdm(desc="loading weights", unit="tensor") if progress else None
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            keys = list(f.keys())
            if bar is not None:
                bar.total = (bar.total or 0) + len(keys)
                bar.refresh()
            for key in keys:
                yield key, f.get_slice(key)
                if bar is not None:
                    bar.update()
    if bar is not None:
        bar.close()


def build_rank_model(config: dict[str, Any], dtype: torch.dtype, tp: TPGroup) -> LlamaForCausalLM:
    """This rank's uninitialised shard (Llama-family models only: the ones whose layers know how to split)."""
    if config.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"tensor parallelism supports model types {', '.join(SUPPORTED_MODEL_TYPES)}, "
            f"not {config.get('model_type')!r}"
        )
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype} is not supported; choose float32, bfloat16 or float16")
    with torch.device("meta"):
        model = LlamaForCausalLM(ModelConfig.from_hf(config), dtype=dtype, tp=tp)
    return model.to_empty(device="cpu").eval()


def load_rank_checkpoint(
    model: str | None, dtype: torch.dtype, tp: TPGroup, progress: bool = True, tokenizer: bool = True
) -> LoadedModel:
    """Like ``load_checkpoint`` for rank ``tp.rank``; ``tokenizer=False`` (worker ranks) leaves it None."""
    resolved = resolve_model(model)
    if resolved.kind == "gguf":
        ckpt = read_gguf(resolved.path, dtype)
        config, tensors = ckpt.hf_config, ckpt.named_tensors(progress)
        net = build_rank_model(config, dtype, tp)
        load_weights(net, tensors)
        return LoadedModel(resolved.name, net, Tokenizer.from_gguf(ckpt.reader) if tokenizer else None, config)
    config = load_hf_config(resolved.path)
    net = build_rank_model(config, dtype, tp)
    load_weights(net, iter_safetensors_slices(safetensors_files(resolved.path), progress))
    return LoadedModel(resolved.name, net, Tokenizer.from_hf_dir(resolved.path) if tokenizer else None, config)
