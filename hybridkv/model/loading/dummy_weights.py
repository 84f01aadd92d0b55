"""``load_format="dummy"`` (vLLM's name): a model built from its config.json alone, with seeded random weights
initialised directly on the target device. For benchmarks of a model's shapes without carrying its checkpoint.

Norm weights are 1, every other weight N(0, 0.02); each tensor-parallel rank draws its own shard from
``seed + rank``. The tokenizer is the directory's if it has one, else a word-level stand-in over the vocabulary
(token i is "w<i>"), so detokenization still costs what it would.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers

from hybridkv.kv.layer_specs import load_hf_config
from hybridkv.model.loading.checkpoint import LoadedModel
from hybridkv.model.architectures.llama_config import ModelConfig
from hybridkv.model.architectures.llama import LlamaForCausalLM
from hybridkv.model.architectures.parallel import TPGroup
from hybridkv.model.loading.tokenizer import Tokenizer


def dummy_checkpoint(path: str, dtype: torch.dtype, device: str, tp: TPGroup | None = None, seed: int = 0,
                     tokenizer: bool = True) -> LoadedModel:
    config = load_hf_config(path)
    tp = tp or TPGroup()
    with torch.device("meta"):
        model = LlamaForCausalLM(ModelConfig.from_hf(config), dtype=dtype, tp=tp)
    model = model.to_empty(device=device).eval()
    gen = torch.Generator(device=device).manual_seed(seed + tp.rank)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    tok = _tokenizer(Path(path), model.cfg.vocab_size) if tokenizer else None
    return LoadedModel(f"{Path(path).name} (dummy weights)", model, tok, config)


def _tokenizer(path: Path, vocab: int) -> Tokenizer:
    if (path / "tokenizer.json").is_file():
        return Tokenizer.from_hf_dir(path)
    return word_tokenizer(vocab)


def word_tokenizer(vocab: int) -> Tokenizer:
    """A stand-in over a model's vocabulary: token i is the word "w<i>", EOS is w1."""
    backend = BackendTokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, eos_token="w1", eos_token_ids=[1])
