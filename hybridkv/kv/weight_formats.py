"""How a model's linear weights are stored: the one description the loader, the kernels and ``hybridkv plan`` read.

A ``WeightFormat`` comes from the checkpoint's ``quantization_config`` or from ``--quantization`` (a bf16
checkpoint quantized at load), as vLLM decides it::

    weight_format({}, "auto")                  -> UNQUANTIZED       (every weight in the model dtype)
    weight_format({}, "fp8")                   -> FP8 at load:  e4m3 weights, one float32 scale per output row,
                                                  activations quantized per token at run time
    weight_format({}, "int4")                  -> INT4 at load: 4-bit symmetric, a bf16 scale per 128 inputs
    weight_format(<compressed-tensors W4A16>)  -> INT4, its group size and zero points
    weight_format(<AWQ>, "awq")                -> INT4 with 4-bit zero points (AWQ's GEMM packing)

Only the linear layers of attention, MLPs and experts are quantized; embeddings, the LM head, routers and norms
stay in the model dtype (as vLLM's ``fp8`` and the RedHatAI Scout checkpoints keep them). Bytes of one [rows, cols]
weight::

    UNQUANTIZED.linear_bytes(4096, 4096, 2) = 33,554,432
    FP8 (channel).linear_bytes(4096, 4096)  = 16,777,216 + 4096 x 4 (scales) = 16,793,600
    INT4 (group 128).linear_bytes(4096, 4096) = 8,388,608 + 4096 x 32 x 2 (scales) = 8,650,752

Pure Python: nothing here imports torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

# --quantization values: auto (the checkpoint's own), none (every weight in the model dtype: a quantized
# checkpoint is dequantized at load), or a format (a bf16 checkpoint is quantized at load; a checkpoint already in
# that format loads as it is)
QUANTIZATIONS = ("auto", "none", "fp8", "int4", "awq", "compressed-tensors")


@dataclass(frozen=True, slots=True)
class WeightFormat:
    """``bits`` 16: unquantized. 8: float8 e4m3 weights. 4: signed 4-bit integers (``zero_points``: asymmetric).

    ``group_size``: input columns per scale (0: one scale per output row, the "channel" strategy; -1: one scale for
    the whole tensor in the checkpoint, held as one per row). ``dynamic_activations``: FP8 activations get a scale
    per token at run time (else ``static``: one scale per layer from the checkpoint). ``source``: where the format
    came from, for messages.
    ``ignore``: compressed-tensors' names (or ``re:`` patterns) of linear layers left unquantized."""

    name: str
    bits: int
    group_size: int = 0
    zero_points: bool = False
    dynamic_activations: bool = True
    scale_bytes: int = 4
    source: str = "at load"
    ignore: tuple[str, ...] = ()

    @property
    def quantized(self) -> bool:
        """Every linear layer is kept in this format, a MoE's routed experts too (``kernels/quant_moe.py`` runs
        them): INT4 as W4A16, FP8 experts as W8A16 (e4m3 weights with a float32 scale per output channel; the
        activations stay in the model dtype, a static ``input_scale`` of a checkpoint's expert is not read)."""
        return self.bits < 16

    def linear_bytes(self, rows: int, cols: int, unquantized_bytes: int = 2) -> int:
        """Bytes of a [rows, cols] weight in this format (its scales and zero points included)."""
        if not self.quantized:
            return rows * cols * unquantized_bytes
        groups = self.groups_per_row(cols)
        # a per-tensor FP8 scale is held as one per row (exact), so linears and experts fused together keep theirs
        zeros = rows * groups if self.zero_points else 0  # held as int8 (a byte each), as the kernels read them
        return rows * cols * self.bits // 8 + rows * groups * self.scale_bytes + zeros

    def groups_per_row(self, cols: int) -> int:
        if self.group_size <= 0:
            return 1
        if cols % self.group_size:
            raise ValueError(f"{cols} input features are not a multiple of the quantization group {self.group_size}")
        return cols // self.group_size

    def keeps_unquantized(self, layer_name: str) -> bool:
        """``layer_name`` (a linear's dotted name, as transformers names it) is in the format's ignore list."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], layer_name):
                    return True
            elif layer_name == pattern or layer_name.endswith("." + pattern):
                return True
        return False


UNQUANTIZED = WeightFormat("none", 16)
FP8 = WeightFormat("fp8", 8)  # vLLM's --quantization fp8: per-channel weight scales, dynamic per-token activations
INT4 = WeightFormat("int4", 4, group_size=128, scale_bytes=2)  # W4A16, symmetric


def weight_format(hf_config: dict[str, Any], quantization: str = "auto") -> WeightFormat:
    """The format the engine keeps a checkpoint's linear weights in (see the module docstring)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
    own = checkpoint_format(hf_config)
    if quantization == "none":
        return UNQUANTIZED
    if quantization == "auto":
        return own
    if not own.quantized:
        if quantization in ("awq", "compressed-tensors"):
            raise ValueError(f"quantization {quantization} needs a checkpoint in that format; this one has no "
                             "quantization_config (to quantize a bf16 checkpoint at load: fp8 or int4)")
        return FP8 if quantization == "fp8" else INT4
    if quantization in (own.name, own.source):
        return own
    raise ValueError(f"quantization {quantization} does not match the checkpoint's own ({own.source} {own.name}); "
                     "use auto to load it as it is, or none to dequantize it")


def checkpoint_format(hf_config: dict[str, Any]) -> WeightFormat:
    """The format of a checkpoint's own ``quantization_config`` (in config.json or its text config)."""
    qc = hf_config.get("quantization_config") or (hf_config.get("text_config") or {}).get("quantization_config")
    if not qc:
        return UNQUANTIZED
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors_format(qc)
    if method == "awq":
        return _awq_format(qc)
    if method == "fp8":  # vLLM/transformers' own FP8 checkpoints (block scales are not supported)
        if qc.get("weight_block_size"):
            raise ValueError("fp8 checkpoints with block-wise weight scales (weight_block_size) are not supported")
        return replace(FP8, source="fp8", dynamic_activations=qc.get("activation_scheme", "dynamic") == "dynamic",
                       ignore=tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ()))
    raise ValueError(f"checkpoint quantization {method!r} is not supported; hybridkv loads compressed-tensors "
                     "(FP8 float-quantized, INT4 pack-quantized), awq (GEMM) and fp8")


def _compressed_tensors_format(qc: dict[str, Any]) -> WeightFormat:
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors checkpoints with {len(groups)} config groups are not supported (one)")
    group = groups[0]
    weights, acts = group.get("weights") or {}, group.get("input_activations")
    bits, kind = int(weights.get("num_bits", 0)), weights.get("type")
    strategy = weights.get("strategy")
    ignore = tuple(qc.get("ignore") or ())
    fmt = qc.get("format")
    if kind == "float" and bits == 8 and fmt in ("float-quantized", "naive-quantized"):
        if strategy not in ("channel", "tensor"):
            raise ValueError(f"compressed-tensors FP8 with {strategy} weight scales is not supported (channel, tensor)")
        dynamic = acts is None or bool(acts.get("dynamic", True))
        return WeightFormat("fp8", 8, 0 if strategy == "channel" else -1, dynamic_activations=dynamic,
                            source="compressed-tensors", ignore=ignore)
    if kind == "int" and bits == 4 and fmt == "pack-quantized":
        if acts is not None:
            raise ValueError("compressed-tensors INT4 with quantized activations is not supported (W4A16 only)")
        if strategy not in ("group", "channel"):
            raise ValueError(f"compressed-tensors INT4 with {strategy} scales is not supported (group, channel)")
        group_size = int(weights.get("group_size") or 0) if strategy == "group" else 0
        return WeightFormat("int4", 4, group_size, zero_points=not weights.get("symmetric", True), scale_bytes=2,
                            source="compressed-tensors", ignore=ignore)
    raise ValueError(f"compressed-tensors format {fmt!r} with {bits}-bit {kind} weights is not supported; hybridkv "
                     "loads float-quantized FP8 and pack-quantized INT4")


def _awq_format(qc: dict[str, Any]) -> WeightFormat:
    version = str(qc.get("version", "gemm")).lower()
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits != 4 or version != "gemm":
        raise ValueError(f"AWQ with {bits} bits and version {version!r} is not supported (4 bits, gemm)")
    group_size = int(qc.get("group_size", qc.get("q_group_size", 128)))
    # AWQ's group -1 is a scale per output row (our "channel", 0), not one for the whole tensor
    return WeightFormat("int4", 4, max(group_size, 0),
                        zero_points=bool(qc.get("zero_point", True)), scale_bytes=2, source="awq",
                        ignore=tuple(qc.get("modules_to_not_convert") or ()))
