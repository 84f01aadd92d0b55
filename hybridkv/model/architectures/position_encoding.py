"""Rotary position encoding (RoPE) in plain torch, shared by the architectures: the inverse frequencies of each
RoPE type, a step's cos/sin tables, and the two pair layouts (Llama-2/3 and Gemma-3 rotate halves, Llama-4
interleaved pairs); and Llama-4's NoPE temperature. The CUDA path encodes q and k in one kernel
(``kernels/rope.py``), tested against these.

E.g. head_dim 4, a token at position 1, inverse frequencies [1, 0.01]: angles [1, 0.01]; ``rope_halves`` pairs
dims (0, 2) and (1, 3) and rotates each pair by its angle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybridkv.model.architectures.llama_config import RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    # on the CPU even inside a meta-device build (``factory.build_model``): a model never placed still runs there
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended linearly in 1/wavelen.
    old_len = rope.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    band = rope.high_freq_factor - rope.low_freq_factor
    # Scout has low == high factor: no blend band; avoid the 0/0 that transformers hides behind torch.where.
    smooth = (old_len / wavelen - rope.low_freq_factor) / band if band else torch.zeros_like(inv_freq)
    blended = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, blended)
    return torch.where(wavelen < high_freq_wavelen, inv_freq, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, 1, D/2] in float32 (broadcast over heads)."""
    angles = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def rope_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama-2/3 layout: dim i pairs with dim i + D/2."""
    return rope_rolled(x, *rope_halves_tables(cos, sin))


def rope_halves_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_halves``' tables [T, 1, D]: cos twice, and -sin then sin (what multiplies the rolled x)."""
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def rope_rolled(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``rope_halves`` with its full-width tables: ``x * cos + roll(x, D/2) * signed_sin``, i.e. ``x1 cos - x2 sin``
    and ``x2 cos + x1 sin``, bit for bit (``a + b * -s`` is ``a - b * s``); four ops over any number of heads."""
    if x.dtype != torch.float32:
        return rope_rolled(x.float(), cos, signed_sin).to(x.dtype)
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama-4 layout: dim 2i pairs with dim 2i + 1 (a complex multiply by e^{i angle})."""
    pairs = x.float().unflatten(-1, (-1, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    return torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1).flatten(-2).to(x.dtype)


def temperature_scales(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """Per-token q multiplier of Llama-4 NoPE layers, shape [T, 1, 1]."""
    scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
    return scales[:, None, None]


@dataclass(slots=True)
class PositionTables:
    """What position encoding needs of a step's tokens, computed once per forward and shared by every layer:
    RoPE's cos and sin [T, 1, D/2] and, for Llama-4's NoPE layers, the q temperature [T, 1, 1] (or None). On the
    CPU for Llama-2/3's layout also ``rope_halves_tables``' [T, 1, D] (``rolled``): one ``rope_rolled`` over q and
    k (``LlamaForCausalLM.position_tables_native``)."""

    cos: torch.Tensor
    sin: torch.Tensor
    temperature: torch.Tensor | None
    rolled: tuple[torch.Tensor, torch.Tensor] | None = None

    def rows(self, rows: slice) -> PositionTables:
        temperature = None if self.temperature is None else self.temperature[rows]
        rolled = None if self.rolled is None else (self.rolled[0][rows], self.rolled[1][rows])
        return PositionTables(self.cos[rows], self.sin[rows], temperature, rolled)
