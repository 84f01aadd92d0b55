"""Read a llama- or gemma3-architecture GGUF checkpoint as HF-named tensors and an HF-style config dict.

The output is meant to be indistinguishable from what transformers' ``LlamaForCausalLM.state_dict()``
(``Gemma3ForCausalLM``'s for gemma3) and ``config.json`` hold for the same checkpoint, so the weight loader
needs no GGUF special cases.

gemma3 differs from llama (as transformers' GGUF loader and llama.cpp's converter treat it):

- llama.cpp stores every RMSNorm weight (``*norm.weight``, QK-norms included) with Gemma's ``+1`` folded in;
  HF keeps them zero-centred, so 1 is subtracted here.
- Q/K rows are *not* permuted (llama.cpp permutes only llama-family Q/K; gemma3 keeps HF's half-split order).
- ``ffn_norm`` is the pre-feedforward norm (in llama it is ``post_attention_layernorm``); the sandwich norms
  are ``post_attention_norm`` and ``post_ffw_norm``.
- The file has no layer-pattern key: like transformers, every 6th layer is full attention, the others slide
  over ``gemma3.attention.sliding_window`` tokens with RoPE base 10,000 (full layers: ``rope.freq_base``).
"""

from __future__ import annotations

import mmap
import re
from collections.abc import Iterator
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tqdm.auto import tqdm

SUPPORTED_ARCHITECTURE = "llama"
SUPPORTED_ARCHITECTURES = ("llama", "gemma3")
# transformers' Gemma3TextConfig defaults, which its GGUF loader keeps (the file has no keys for them).
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_ROPE_LOCAL_BASE_FREQ = 10000.0
GEMMA3_QUERY_PRE_ATTN_SCALAR = 256

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# llama.cpp stores Llama-3 rope frequency factors as a tensor; HF recomputes them from the config,
# so the tensor has no place in the state dict.
_SKIPPED_TENSORS = frozenset({"rope_freqs.weight"})

_GEMMA3_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_LAYER_TENSORS_BY_ARCH = {"llama": _LAYER_TENSORS, "gemma3": _GEMMA3_LAYER_TENSORS}

_LAYER_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def gguf_metadata(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as plain Python (str, int, float, bool or list), or ``default`` if absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


@dataclass(slots=True)
class GGUFCheckpoint:
    """A memory-mapped GGUF file; tensors are dequantized lazily by :meth:`named_tensors`."""

    path: Path
    reader: gguf.GGUFReader
    hf_config: dict
    dtype: torch.dtype

    def named_tensors(self, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` pairs, the same set ``LlamaForCausalLM.state_dict()`` holds.

        A tied checkpoint yields ``lm_head.weight`` as the very tensor of ``model.embed_tokens.weight``.
        """
        tensors = tqdm(
            self.reader.tensors, desc=f"Reading {self.path.name}", unit="tensor", disable=not progress
        )
        for tensor in tensors:
            if tensor.name in _SKIPPED_TENSORS:
                continue
            name = hf_tensor_name(tensor.name, self.architecture)
            value = self._to_torch(tensor)
            self._release_pages(tensor)
            yield name, value
            if name == "model.embed_tokens.weight" and self.hf_config["tie_word_embeddings"]:
                yield "lm_head.weight", value  # now, not at the end: the reader holds no weight past its turn
            del value

    def _release_pages(self, tensor: gguf.ReaderTensor) -> None:
        """Drop a read tensor's pages of the file from this process's RSS (they stay in the page cache): mapped
        pages once read count as resident until the map closes, ~93 MB for SmolLM2's GGUF during the load."""
        file_map = getattr(self.reader.data, "_mmap", None)  # np.memmap's mmap.mmap
        if file_map is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = tensor.data_offset - tensor.data_offset % mmap.PAGESIZE
        file_map.madvise(mmap.MADV_DONTNEED, start, tensor.data_offset + tensor.n_bytes - start)

    def _to_torch(self, tensor: gguf.ReaderTensor) -> torch.Tensor:
        value = self._unpermute(tensor.name, _dequantized(tensor))
        return value.to(self.dtype)

    @property
    def architecture(self) -> str:
        return gguf_metadata(self.reader, "general.architecture")

    def _unpermute(self, gguf_name: str, value: torch.Tensor) -> torch.Tensor:
        config = self.hf_config
        if self.architecture == "gemma3":
            # Norms carry llama.cpp's +1 (undone in float32, before any cast); Q/K are stored unpermuted.
            return value - 1 if gguf_name.endswith("norm.weight") else value
        if ".attn_q." in gguf_name:
            return unpermute_rows(value, config["num_attention_heads"])
        if ".attn_k." in gguf_name:
            return unpermute_rows(value, config["num_key_value_heads"])
        return value


# Rows of a quantized tensor dequantized at a time: numpy's dequantization makes a few float32 temporaries of
# its input's size, which for a whole embedding (SmolLM2's: 49,152 x 576) add ~300 MB to the load's peak RSS.
_DEQUANT_ROWS = 1024


def _dequantized(tensor: gguf.ReaderTensor) -> torch.Tensor:
    """float32 values of a GGUF tensor, its rows dequantized ``_DEQUANT_ROWS`` at a time into one tensor."""
    data = tensor.data
    if tensor.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                              gguf.GGMLQuantizationType.BF16) or data.ndim < 2:
        array = gguf.quants.dequantize(data, tensor.tensor_type)
        # unquantized tensors come back as views of the read-only memory map
        return torch.from_numpy(array if array.flags.writeable else np.array(array)).float()
    first = gguf.quants.dequantize(data[:_DEQUANT_ROWS], tensor.tensor_type)
    out = torch.empty((data.shape[0], *first.shape[1:]), dtype=torch.float32)
    out[:_DEQUANT_ROWS] = torch.from_numpy(first)
    for lo in range(_DEQUANT_ROWS, data.shape[0], _DEQUANT_ROWS):
        out[lo : lo + _DEQUANT_ROWS] = torch.from_numpy(gguf.quants.dequantize(data[lo : lo + _DEQUANT_ROWS],
                                                                               tensor.tensor_type))
    return out


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp's converter reorders each head's rows from HF's half-split rotary layout
    (first half, second half) to GPT-J's interleaved pairs; this restores HF's order.
    """
    half_head = weight.shape[0] // num_heads // 2
    split = weight.reshape(num_heads, half_head, 2, *weight.shape[1:])
    return split.transpose(1, 2).reshape(weight.shape).contiguous()


def hf_tensor_name(gguf_name: str, architecture: str = "llama") -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    layer_tensors = _LAYER_TENSORS_BY_ARCH[architecture]
    match = _LAYER_TENSOR_RE.fullmatch(gguf_name)
    if match is None or match[2] not in layer_tensors:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in a {architecture} model")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{layer_tensors[part]}.{kind}"


class FastGGUFReader(gguf.GGUFReader):
    """gguf's reader, its slices cut from a plain ndarray view of the memory map: the same bytes without an
    ``np.memmap`` object per slice (SmolLM2's ~100K tokenizer strings and merges took ~3 s of memmap bookkeeping
    at start-up, more than anything else in reading the file)."""

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        arr = plain[offset : offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def read_gguf(path: str | PathLike, dtype: torch.dtype = torch.float32) -> GGUFCheckpoint:
    """Open a llama or gemma3 GGUF file; raises ValueError naming the architecture if it is neither."""
    path = Path(path)
    reader = FastGGUFReader(path)
    architecture = gguf_metadata(reader, "general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {architecture!r} is not supported; "
            f"only {' and '.join(map(repr, SUPPORTED_ARCHITECTURES))} checkpoints can be read"
        )
    try:
        config = hf_config(reader, dtype)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    return GGUFCheckpoint(path=path, reader=reader, hf_config=config, dtype=dtype)


def hf_config(reader: gguf.GGUFReader, dtype: torch.dtype = torch.float32) -> dict:
    """The ``config.json`` transformers would write for this llama (or gemma3) GGUF."""
    arch = gguf_metadata(reader, "general.architecture")
    if arch == "gemma3":
        return gemma3_hf_config(reader, dtype)

    def key(name: str, default: Any = None) -> Any:
        return gguf_metadata(reader, f"{arch}.{name}", default)

    hidden_size = key("embedding_length")
    num_heads = key("attention.head_count")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    tensor_names = {tensor.name for tensor in reader.tensors}
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        # Older files lack llama.vocab_size; the vocabulary then is the token list.
        "vocab_size": key("vocab_size") or (len(tokens.data) if tokens is not None else None),
        "hidden_size": hidden_size,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": key("attention.head_count_kv", num_heads),
        "head_dim": key("attention.key_length") or key("rope.dimension_count") or hidden_size // num_heads,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": key("rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(reader, arch),
        "max_position_embeddings": key("context_length"),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
        # llama.cpp writes the output projection only when it differs from the embedding.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": gguf_metadata(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf_metadata(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": gguf_metadata(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    return config


def _rope_scaling(reader: gguf.GGUFReader, arch: str) -> dict | None:
    kind = gguf_metadata(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "factor": gguf_metadata(reader, f"{arch}.rope.scaling.factor", 1.0)}
    original = gguf_metadata(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    return scaling


def gemma3_hf_config(reader: gguf.GGUFReader, dtype: torch.dtype = torch.float32) -> dict:
    """The ``config.json`` of transformers' ``Gemma3ForCausalLM`` (``gemma3_text``) for this gemma3 GGUF.

    Raises ValueError if the file lacks what fixes the attention layout (head size, sliding window): guessing
    transformers' defaults there (window 4096) would silently change the model.
    """

    def key(name: str, default: Any = None) -> Any:
        return gguf_metadata(reader, f"gemma3.{name}", default)

    for required in ("block_count", "embedding_length", "attention.head_count", "attention.key_length",
                     "attention.sliding_window"):  # fmt: skip
        if key(required) is None:
            raise ValueError(f"GGUF architecture 'gemma3' file lacks metadata gemma3.{required}")
    num_layers = key("block_count")
    num_heads = key("attention.head_count")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    tensor_names = {tensor.name for tensor in reader.tensors}
    pattern = GEMMA3_SLIDING_WINDOW_PATTERN
    return {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": key("vocab_size") or (len(tokens.data) if tokens is not None else None),
        "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": key("attention.head_count_kv", num_heads),
        "head_dim": key("attention.key_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": key("rope.freq_base", 1_000_000.0),
        "rope_local_base_freq": GEMMA3_ROPE_LOCAL_BASE_FREQ,
        "rope_scaling": _rope_scaling(reader, "gemma3"),
        "sliding_window": key("attention.sliding_window"),
        "sliding_window_pattern": pattern,
        "layer_types": [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)
        ],
        "query_pre_attn_scalar": GEMMA3_QUERY_PRE_ATTN_SCALAR,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "max_position_embeddings": key("context_length"),
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": gguf_metadata(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf_metadata(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": gguf_metadata(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
