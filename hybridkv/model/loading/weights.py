"""Load weights, under their transformers names, into a model built by ``model/factory.py``.

``load_weights`` takes tensors under their transformers names from any source (safetensors here, GGUF
elsewhere), so every reader shares one name mapping and one completeness check.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from hybridkv.model.architectures.parallel import TPGroup, shard_for_rank
from hybridkv.model.causal_lm import CausalLM
from hybridkv.model.factory import build_model
from hybridkv.model.quantization.weight_plan import WeightPlan
from hybridkv.model.loading.hf_config import load_hf_config
from hybridkv.model.quantization.quantized_layers import load_quantizing

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


def load_weights(model: CausalLM, named_tensors: Iterable[tuple[str, torch.Tensor]], adopt: bool = False,
                 on_layer: Callable[[nn.Module], None] | None = None) -> None:
    """Copy HF-named tensors into ``model`` (casting dtype); raise if any is unknown, misshapen or missing. A float
    weight of a quantized linear is quantized as it loads (``--quantization fp8 | int4`` on a bf16 checkpoint).
    ``adopt``: a tensor of the parameter's dtype and shape becomes the parameter itself, not copied (the source
    makes each tensor afresh: a GGUF's dequantized ones), so a weight is never held twice. ``on_layer``: called with
    each of ``model.layers`` once every parameter of it is loaded, and the load's references to them dropped (it
    may replace them: ``int4_cpu.pack_int4_linears``, so only one layer is held in float at a time)."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    waiting = _layer_params(model, params) if on_layer is not None else {}
    for hf_name, tensor in named_tensors:
        name = hf_to_local_name(hf_name)
        if name is None or (name == "lm_head.weight" and model.lm_head is None):
            continue  # tied checkpoints may still carry a copy of the embedding as lm_head
        if name not in params:
            unexpected.append(hf_name)
            continue
        param = params[name]
        tensor = shard_for_rank(model, name, tensor)  # all of it unless the model is one TP rank's shard
        owner, _, leaf = name.rpartition(".")
        if _quantizes(param, tensor):  # a linear's weight, or a stack of experts
            filled = [f"{owner}.{leaf}" for leaf in load_quantizing(model.get_submodule(owner), tensor, leaf)]
        else:
            _fill(param, tensor, (hf_name, name), adopt)
            filled = [name]
        loaded.update(filled)
        _layer_done(model, filled, waiting, params, on_layer)
    missing = sorted(set(params) - loaded)
    if unexpected or missing:
        raise ValueError(
            f"checkpoint does not match the model: {len(unexpected)} unexpected weights {unexpected[:8]}, "
            f"{len(missing)} missing weights {missing[:8]}"
        )


def _fill(param: torch.Tensor, tensor: torch.Tensor, names: tuple[str, str], adopt: bool) -> None:
    """``param`` := ``tensor`` (``names``: the checkpoint's and ours); ``adopt``: see ``load_weights``."""
    hf_name, name = names
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(f"weight {hf_name}: checkpoint shape {tuple(tensor.shape)}, model expects {tuple(param.shape)}")
    with torch.no_grad():
        if name.endswith("_scale") and param.dtype != tensor.dtype:
            param.data = tensor.to(param.device)  # a checkpoint's scales as stored (AWQ's fp16): exact values
        elif adopt and _whole(tensor) and tensor.dtype == param.dtype and tensor.device == param.device:
            param.data = tensor
        else:
            param.copy_(tensor)


def _whole(tensor: torch.Tensor) -> bool:
    """``tensor`` is all of its storage, in order (not a slice of a bigger one, which adopting would keep alive)."""
    return tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def _layer_params(model: nn.Module, params: dict[str, torch.Tensor]) -> dict[int, set[str]]:
    """Each of ``model.layers``' parameter names, by layer index: ``{0: {"layers.0.mlp.up_proj.weight", ...}}``."""
    waiting: dict[int, set[str]] = {}
    for name in params:
        if name.startswith("layers."):
            waiting.setdefault(int(name.split(".")[1]), set()).add(name)
    return waiting


def _layer_done(model: nn.Module, filled: list[str], waiting: dict[int, set[str]], params: dict[str, torch.Tensor],
                on_layer: Callable[[nn.Module], None] | None) -> None:
    """After ``filled`` loaded: ``on_layer`` for a layer none of whose parameters is still waiting."""
    for name in filled:
        if not name.startswith("layers.") or (index := int(name.split(".")[1])) not in waiting:
            continue
        waiting[index].discard(name)
        if not waiting[index]:
            del waiting[index]
            prefix = f"layers.{index}."
            for done in [n for n in params if n.startswith(prefix)]:
                del params[done]
            on_layer(model.layers[index])


def _quantizes(param: torch.Tensor, tensor: torch.Tensor) -> bool:
    """A float checkpoint weight for a quantized parameter (int32-packed 4-bit, or e4m3 from a bf16 tensor)."""
    float_tensor = tensor.is_floating_point() and tensor.dtype != torch.float8_e4m3fn
    return float_tensor and (param.dtype in (torch.int32, torch.float8_e4m3fn))


def release_freed_memory() -> None:
    """Hand back to the OS the heap pages the load freed (the float32 weights packed 4-bit, the loader's
    temporaries): glibc keeps freed pages of its heap resident until asked, and reuses them for whatever comes
    next only where it fits, so a load that frees as it goes calls this after each layer (~1 ms).
    A no-op where the C library has no ``malloc_trim`` (not glibc)."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


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


def iter_safetensors_slices(files: list[Path], progress: bool = True) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) per tensor; a slice reads from disk only the part it is indexed with, so a
    tensor-parallel rank reads only its shard (``parallel.shard_for_rank``); one rank reads each whole."""
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


def load_safetensors_model(
    path: str | Path, dtype: torch.dtype = torch.float32, progress: bool = True, tp: TPGroup | None = None,
    weights: WeightPlan | None = None,
) -> tuple[CausalLM, dict[str, Any]]:
    """Model (or one tensor-parallel rank's shard) and its raw config dict from a transformers checkpoint
    directory; ``weights``: how its linear weights are kept (None: as the checkpoint's quantization_config says,
    dequantized)."""
    config = load_hf_config(path)
    weights = weights or WeightPlan.of(config)
    model = build_model(config, dtype, tp, weights=weights.kept)
    named = iter_safetensors_slices(safetensors_files(path), progress)
    load_weights(model, weights.reader(config, dtype)(named))
    weights.round_trip(model)
    return model, config
