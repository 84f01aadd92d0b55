"""Reading a model's Hugging Face ``config.json`` (or the HF-style dict a GGUF file's metadata gives).

``text_config`` (the language-model part of a nested multimodal config) stays in ``hybridkv.kv.layer_specs``:
the KV layer reads nested configs itself and must not import ``model/``; model code imports it from there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def load_hf_config(path: str | Path) -> dict[str, Any]:
    """Read ``config.json`` from a model directory or a path to the file itself."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json at {path}")
    return json.loads(path.read_text())


def model_hf_config(model: str, cache_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """The HF-style ``config.json`` dict of a known name, a ``.gguf`` file or an HF directory.

    GGUF metadata is read without loading weights (``hybridkv plan --model gemma-3-270m``).
    """
    from hybridkv.model.loading.known_models import resolve_model

    resolved = resolve_model(model, cache_dir)
    if resolved.kind == "hf_dir":
        return load_hf_config(resolved.path)
    from hybridkv.model.loading.gguf_reader import FastGGUFReader, hf_config  # imports torch: only for GGUF models

    return hf_config(FastGGUFReader(resolved.path))
