"""How one load keeps a model's linear weights: the format served, the checkpoint's own, and whether quantized
tensors are kept (a GPU, with kernels for them) or dequantized into the model dtype (the CPU).

    checkpoint           --quantization  device  served  kept quantized  how
    bf16                 auto            any     bf16    no              as it is
    bf16                 int4            cuda    INT4    yes             quantized as it loads
    bf16                 int4            cpu     INT4    no              quantized, then dequantized (same values)
    compressed-tensors   auto            cuda    its     yes             read into hybridkv's layout
    compressed-tensors   auto | none     cpu     its     no              dequantized as it loads
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hybridkv.kv.layer_specs import text_config
from hybridkv.kv.planner import fitted_format
from hybridkv.kv.weight_formats import UNQUANTIZED, WeightFormat, checkpoint_format
from hybridkv.model.factory import QUANTIZABLE
from hybridkv.model.quantization.checkpoint import QuantizedReader
from hybridkv.model.quantization.quantized_layers import round_trip_linears

Named = Iterable[tuple[str, Any]]


@dataclass(frozen=True, slots=True)
class WeightPlan:
    served: WeightFormat  # the values the model computes with
    checkpoint: WeightFormat  # what the checkpoint holds
    keep: bool  # quantized tensors stay quantized in the model (else dequantized into its dtype)

    @classmethod
    def of(cls, hf_config: dict[str, Any], quantization: str = "auto", device: str = "cpu",
           tensor_parallel_size: int = 1) -> WeightPlan:
        served = fitted_format(hf_config, quantization, tensor_parallel_size)
        return cls(served, checkpoint_format(hf_config), served.quantized and torch.device(device).type == "cuda")

    @property
    def kept(self) -> WeightFormat:
        """The format the model's linears are built in."""
        return self.served if self.keep else UNQUANTIZED

    def reader(self, hf_config: dict[str, Any], dtype: torch.dtype) -> Callable[[Named], Iterator | Named]:
        """The checkpoint's (name, tensor) stream as the model loads it."""
        if not self.checkpoint.quantized:
            return lambda named: named
        experts = int(text_config(hf_config).get("num_local_experts") or 0)
        return QuantizedReader(self.checkpoint, self.keep and self.served == self.checkpoint, dtype, experts)

    def round_trip(self, model: nn.Module) -> None:
        """A float checkpoint served quantized but kept in the model dtype: each quantizable weight replaced by its
        quantized values, so the CPU computes with the weights a GPU would."""
        if self.served.quantized and not self.keep and not self.checkpoint.quantized:
            round_trip_linears(model, self.served, QUANTIZABLE)
