"""hybridkv: an LLM serving engine built around a hybrid paged KV cache.

``LLM`` and the sampling types load on first use, so that ``hybridkv --help`` (and anything else that only needs
a light submodule) does not import torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridkv.engine.llm import LLM
    from hybridkv.engine.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]
_HOMES = {"LLM": "hybridkv.engine.llm", "SamplingParams": "hybridkv.engine.sampling_params",
          "StructuredOutputsParams": "hybridkv.engine.sampling_params"}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'hybridkv' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
