"""A quantized checkpoint's tensors, read a linear layer at a time and turned into hybridkv's layout.

A quantized linear comes as several tensors (compressed-tensors INT4: ``weight_packed``, ``weight_scale``,
``weight_shape``, maybe ``weight_zero_point``; AWQ: ``qweight``, ``qzeros``, ``scales``; FP8: an e4m3 ``weight``
and its ``weight_scale``, maybe a static ``input_scale``). ``QuantizedReader`` holds a layer's tensors until they
are all read, then yields the layer either

- kept quantized, under the names the quantized linears hold (``quantized_layers.py``): ``weight`` (e4m3, or INT4
  packed as ``kernels/quant_gemm.py`` says), ``weight_scale`` (FP8: float32 [N]; INT4: [N, K // G]),
  ``weight_zero_point`` (INT4, int8 [N, K // G]) and ``input_scale`` (static FP8 activations); or
- dequantized, as one ``weight`` in the model dtype (the CPU, ``--quantization none``).

E.g. an AWQ layer ``q_proj`` with ``qweight`` [4096, 512], ``qzeros`` [32, 512], ``scales`` [32, 4096] comes out
as ``q_proj.weight`` int32 [4096, 512], ``q_proj.weight_scale`` [4096, 32], ``q_proj.weight_zero_point`` [4096, 32].

Llama-4 checkpoints quantized by llm-compressor store experts one by one (``experts.3.gate_proj``); they are
gathered into the fused ``experts.gate_up_proj`` [E, H, 2I] and ``experts.down_proj`` [E, I, H] transformers uses
or, kept quantized, into the stacks ``quantized_experts.py`` describes: INT4 ``experts.gate_up_proj`` int32
[E, 2I, H // 8] with ``experts.gate_up_proj_scale`` (and ``_zero_point``), ``experts.down_proj`` [E, H, I // 8] with
``experts.down_proj_scale``; FP8 ``experts.gate_up_proj`` e4m3 [E, 2I, H] with float32 scales [E, 2I],
``experts.down_proj`` [E, H, I] with [E, H] (an expert's static ``input_scale`` is dropped: experts run W8A16).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridkv.kv.weight_formats import WeightFormat
from hybridkv.kernels.quant_gemm import dequantize_int4, pack_int4, unpack_int4
from hybridkv.model.quantization.quantize import dequantize_fp8

# AWQ's GEMM packing puts column 8 j + k of a word's 8 in nibble AWQ_NIBBLE[k] (AutoAWQ's order [0, 2, 4, 6, 1, 3,
# 5, 7], inverted)
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)
_EXPERT = re.compile(r"(?P<experts>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


@dataclass(slots=True)
class QuantizedLinear:
    """One linear's weight in hybridkv's layout: ``weight`` e4m3 [N, K] (FP8) or int32 [N, K // 8] (INT4)."""

    weight: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None

    @property
    def is_fp8(self) -> bool:
        return self.weight.dtype == torch.float8_e4m3fn

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        if self.is_fp8:
            return dequantize_fp8(self.weight, self.scale, dtype)
        group_size = self.weight.shape[1] * 8 // self.scale.shape[1]
        return dequantize_int4(self.weight, self.scale, self.zero, group_size, dtype)

    def named(self, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        yield f"{prefix}.weight", self.weight
        yield f"{prefix}.weight_scale", self.scale
        if self.zero is not None:
            yield f"{prefix}.weight_zero_point", self.zero
        if self.input_scale is not None:
            yield f"{prefix}.input_scale", self.input_scale


def _tensor(source: Any) -> torch.Tensor:
    return source if isinstance(source, torch.Tensor) else source[:]


def _is_fp8(source: Any) -> bool:
    if isinstance(source, torch.Tensor):
        return source.dtype == torch.float8_e4m3fn
    return source.get_dtype() == "F8_E4M3"


def from_compressed_tensors_int4(parts: dict[str, torch.Tensor], fmt: WeightFormat) -> QuantizedLinear:
    rows, cols = (int(n) for n in parts["weight_shape"].tolist())
    packed = parts["weight_packed"]
    if packed.shape != (rows, cols // 8):
        raise ValueError(f"weight_packed {tuple(packed.shape)} does not hold a [{rows}, {cols}] 4-bit weight")
    scale = parts["weight_scale"].reshape(rows, -1)
    zero = parts.get("weight_zero_point")
    if zero is not None:  # packed along the rows (compressed-tensors' packed_dim=0)
        zero = unpack_int4(zero.t().contiguous())[:, :rows].t().contiguous()
    return QuantizedLinear(packed.contiguous(), scale, zero)


def from_awq(parts: dict[str, torch.Tensor], fmt: WeightFormat) -> QuantizedLinear:
    """AWQ's [K, N // 8] ``qweight`` and [K // G, N // 8] ``qzeros`` hold unsigned values packed along the output
    features in AWQ's nibble order; ``scales`` is [K // G, N]."""
    q = _unpack_awq(parts["qweight"])  # [K, N], 0..15
    zeros = _unpack_awq(parts["qzeros"]) if fmt.zero_points else torch.full_like(q[:1], 8)
    scale = parts["scales"]
    if q.shape[1] != scale.shape[1]:
        raise ValueError(f"AWQ qweight {tuple(q.shape)} and scales {tuple(scale.shape)} disagree")
    packed = pack_int4((q.t().to(torch.int16) - 8).to(torch.int8).contiguous())
    zero = (zeros.t().to(torch.int16) - 8).to(torch.int8).contiguous()
    return QuantizedLinear(packed, scale.t().contiguous(), zero if fmt.zero_points else None)


def _unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C // 8] in AWQ's order -> uint8 [R, C]."""
    shifts = torch.tensor([4 * n for n in AWQ_NIBBLE], dtype=torch.int32)
    return ((packed[:, :, None] >> shifts) & 0xF).to(torch.uint8).view(packed.shape[0], -1)


def from_fp8(parts: dict[str, torch.Tensor], fmt: WeightFormat) -> QuantizedLinear:
    """A per-tensor scale becomes a scale per row (exact: every row keeps its values), so linears fused into one
    GEMM (q, k, v) keep their own scales."""
    weight = parts["weight"]
    scale = parts["weight_scale"].float().reshape(-1)
    if scale.numel() == 1:
        scale = scale.expand(weight.shape[0]).contiguous()
    input_scale = parts.get("input_scale")
    return QuantizedLinear(weight, scale, None, None if input_scale is None else input_scale.float().reshape(1))


@dataclass(slots=True)
class _Layout:
    suffixes: tuple[str, ...]  # a layer's tensors, all needed before it converts
    convert: Any  # (parts, fmt) -> QuantizedLinear


def _layout(fmt: WeightFormat) -> _Layout:
    if fmt.source == "awq":
        return _Layout(("qweight", "qzeros", "scales"), from_awq)
    if fmt.name == "int4":
        zero = ("weight_zero_point",) if fmt.zero_points else ()
        return _Layout(("weight_packed", "weight_scale", "weight_shape", *zero), from_compressed_tensors_int4)
    static = () if fmt.dynamic_activations else ("input_scale",)
    return _Layout(("weight", "weight_scale", *static), from_fp8)


@dataclass(slots=True)
class QuantizedReader:
    """Turns a quantized checkpoint's (name, tensor) stream into the (name, tensor) stream a model loads.

    ``keep``: quantized linears stay quantized (``QuantizedLinear.named``), else they come dequantized to
    ``dtype``. ``num_experts``: experts stored one by one are gathered into the fused tensors (0: no MoE)."""

    fmt: WeightFormat
    keep: bool
    dtype: torch.dtype
    num_experts: int = 0
    _layers: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    _experts: dict[str, dict[tuple[int, str], torch.Tensor]] = field(default_factory=dict)

    def __call__(self, named: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        layout = _layout(self.fmt)
        for name, source in named:
            prefix, _, suffix = name.rpartition(".")
            if suffix not in layout.suffixes or (suffix == "weight" and not _is_fp8(source)):
                yield from self._expert_or_plain(name, source)
                continue
            parts = self._layers.setdefault(prefix, {})
            parts[suffix] = _tensor(source)
            if all(s in parts for s in layout.suffixes):
                del self._layers[prefix]
                yield from self._linear(prefix, layout.convert(parts, self.fmt))
        self._check_done(layout)

    def _linear(self, prefix: str, linear: QuantizedLinear) -> Iterator[tuple[str, Any]]:
        if self.keep:
            yield from self._expert_or_plain(f"{prefix}.weight", linear)
        else:
            yield from self._expert_or_plain(f"{prefix}.weight", linear.dequantized(self.dtype))

    def _expert_or_plain(self, name: str, source: Any) -> Iterator[tuple[str, Any]]:
        """``source`` (a tensor, or a linear kept quantized) as it is, or held until its expert's peers are read."""
        match = _EXPERT.match(name)
        if match is None or not self.num_experts:
            if isinstance(source, QuantizedLinear):
                yield from source.named(name.removesuffix(".weight"))
            else:
                yield name, source
            return
        experts = self._experts.setdefault(match["experts"], {})
        kept = isinstance(source, QuantizedLinear)
        experts[int(match["e"]), match["proj"]] = source if kept else _tensor(source).to(self.dtype)
        if len(experts) == 3 * self.num_experts:
            del self._experts[match["experts"]]
            yield from (self._stacked_experts if kept else self._fused_experts)(match["experts"], experts)

    def _fused_experts(self, prefix: str, experts: dict[tuple[int, str], torch.Tensor]) -> Iterator[tuple[str, Any]]:
        """transformers' fused layout: gate_up [E, H, 2I] (x @ gate_up), down [E, I, H]."""
        e_range = range(self.num_experts)
        gate_up = torch.stack([torch.cat((experts[e, "gate_proj"], experts[e, "up_proj"])).t() for e in e_range])
        yield f"{prefix}.gate_up_proj", gate_up
        yield f"{prefix}.down_proj", torch.stack([experts[e, "down_proj"].t() for e in e_range])

    def _stacked_experts(self, prefix: str, experts: dict[tuple[int, str], QuantizedLinear]
                         ) -> Iterator[tuple[str, Any]]:
        """The quantized stacks (``quantized_experts.py``): gate_up [E, 2I, H // 8] (INT4; FP8 [E, 2I, H]: each
        expert's gate rows, then its up rows), down [E, H, I // 8] (FP8 [E, H, I]); their scales and zero points
        stacked alike."""
        for stack, projs in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            for suffix, part in (("", "weight"), ("_scale", "scale"), ("_zero_point", "zero")):
                per_expert = [[getattr(experts[e, p], part) for p in projs] for e in range(self.num_experts)]
                if any(t is None for ts in per_expert for t in ts):
                    continue
                yield f"{prefix}.{stack}{suffix}", torch.stack([torch.cat(ts) for ts in per_expert])

    def _check_done(self, layout: _Layout) -> None:
        if self._layers:
            prefix, parts = next(iter(self._layers.items()))
            missing = sorted(set(layout.suffixes) - set(parts))
            raise ValueError(f"quantized checkpoint ({self.fmt.source} {self.fmt.name}): layer {prefix} lacks "
                             f"{', '.join(missing)} ({len(self._layers)} layers incomplete)")
        if self._experts:
            prefix, got = next(iter(self._experts.items()))
            raise ValueError(f"checkpoint holds {len(got)} of the {3 * self.num_experts} expert weights of {prefix}")
