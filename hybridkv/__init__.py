"""hybridkv: an LLM serving engine built around a hybrid paged KV cache."""

from hybridkv.engine.llm import LLM
from hybridkv.engine.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]
