"""Load Llama / Llama-4 text weights from a Hugging Face directory (config.json + safetensors).

``load_weights`` takes tensors under their transformers names from any source (safetensors here, GGUF
elsewhere), so every reader shares one name mapping and one completeness check.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from hybridkv.kv.layer_specs import load_hf_config
from hybridkv.model.architectures.llama_config import ModelConfig
from hybridkv.model.architectures.gemma3 import GEMMA3_MODEL_TYPES, Gemma3Config, Gemma3ForCausalLM
from hybridkv.model.architectures.llama import LlamaForCausalLM
from hybridkv.model.architectures.parallel import shard_for_rank

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Parts of multimodal checkpoints (Llama4ForConditionalGeneration, llava-style) that are not the text model.
_SKIPPED_PREFIXES = ("vision_model.", "vision_tower.", "multi_modal_projector.")
# Wrappers around the text model's names, outermost first: (prefix, replacement).
_PREFIX_RENAMES = (
    ("language_model.model.", ""),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", ""),
    ("language_model.", ""),
    ("model.", ""),
)


def hf_to_local_name(name: str) -> str | None:
    """Our parameter name for a transformers tensor name, or None for tensors the text model does not use."""
    bare = name.removeprefix("model.")
    if bare.startswith(_SKIPPED_PREFIXES) or name.endswith("rotary_emb.inv_freq"):
        return None
    for prefix, replacement in _PREFIX_RENAMES:
        if name.startswith(prefix):
            name = replacement + name[len(prefix) :]
            break
    return name.replace(".feed_forward.", ".mlp.")


def load_weights(model: LlamaForCausalLM, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors into ``model`` (casting dtype); raise if any is unknown, misshapen or missing."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    for hf_name, tensor in named_tensors:
        name = hf_to_local_name(hf_name)
        if name is None or (name == "lm_head.weight" and model.lm_head is None):
            continue  # tied checkpoints may still carry a copy of the embedding as lm_head
        if name not in params:
            unexpected.append(hf_name)
            continue
        param = params[name]
        tensor = shard_for_rank(model, name, tensor)  # all of it unless the model is one TP rank's shard
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"weight {hf_name}: checkpoint shape {tuple(tensor.shape)}, model expects {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if unexpected or missing:
        raise ValueError(
            f"checkpoint does not match the model: {len(unexpected)} unexpected weights {unexpected[:8]}, "
            f"{len(missing)} missing weights {missing[:8]}"
        )


def build_model(config: dict[str, Any], dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """An uninitialised model (no random init: every parameter must be loaded before use).

    Dispatches on ``model_type``: Gemma-3 (``gemma3_text``, or ``gemma3`` with a nested ``text_config``) gets
    ``Gemma3ForCausalLM``, everything else ``LlamaForCausalLM`` (which names what it supports)."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype} is not supported; choose float32, bfloat16 or float16")
    with torch.device("meta"):
        if config.get("model_type") in GEMMA3_MODEL_TYPES:
            model = Gemma3ForCausalLM(Gemma3Config.from_hf(config), dtype=dtype)
        else:
            model = LlamaForCausalLM(ModelConfig.from_hf(config), dtype=dtype)
    return model.to_empty(device="cpu").eval()


def safetensors_files(path: str | Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def iter_safetensors(files: list[Path], progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    with tqdm(desc="loading weights", unit="tensor", disable=not progress) as bar:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                keys = list(f.keys())
                bar.total = (bar.total or 0) + len(keys)
                bar.refresh()
                for key in keys:
                    yield key, f.get_tensor(key)
                    bar.update()


def load_safetensors_model(
    path: str | Path, dtype: torch.dtype = torch.float32, progress: bool = True
) -> tuple[LlamaForCausalLM, dict[str, Any]]:
    """Model and its raw config dict from a transformers checkpoint directory."""
    config = load_hf_config(path)
    model = build_model(config, dtype)
    load_weights(model, iter_safetensors(safetensors_files(path), progress))
    return model, config
