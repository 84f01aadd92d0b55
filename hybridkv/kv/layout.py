"""How KV memory is laid out: layer groups that all use pages of one size from one pool.

Every block (page) in the pool has the same number of bytes, whichever attention type uses it. A page holds
``block_size`` tokens of K and V for the ``g`` layers of one *layer group*; all layers of a group have the same
spec, so one block table serves them all. The number of layers per group is chosen so that every type's page
has exactly the same size and every type's layer count divides evenly: nothing is padded.

Llama-4 Scout (12 full layers, 36 chunked, 512 B per token per layer per rank) -> g = gcd(12, 36) = 12::

    group 0: full     layers 3, 7, ..., 47       page = 16 tokens x 12 layers x 512 B = 96 KiB
    group 1: chunked  layers 0, 1, 2, 4, ..., 14
    group 2: chunked  layers 16, ..., 30
    group 3: chunked  layers 32, ..., 46

Gemma-3-270M (3 full, 15 sliding) -> g = 3: one full group, five sliding groups.
Seven sliding and three full layers -> g = 1: ten groups of one layer, still no padding.

The pool is one buffer ``[num_blocks, page_bytes]``; group j's layer at slot s reads it as
``[num_blocks, g, 2 (K, V), block_size, num_kv_heads, head_dim][:, s]``. Block 0 is the null block: tables put it
where a sliding or chunked layer has dropped tokens, and nothing is ever written to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

from hybridkv.kv.specs import AttentionSpec


@dataclass(frozen=True, slots=True)
class LayerGroup:
    group_id: int
    spec: AttentionSpec
    layer_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVLayout:
    block_size: int
    groups: tuple[LayerGroup, ...]
    page_bytes: int
    # Unused bytes per page for types whose pages are smaller than the common size; 0 for every model we know.
    padding_bytes: dict[str, int]
    fixed_bytes: int

    @property
    def num_layers(self) -> int:
        return sum(len(g.layer_ids) for g in self.groups)

    def layer_slot(self, layer_id: int) -> tuple[int, int]:
        """(group id, slot inside the group's page) of a layer."""
        for group in self.groups:
            if layer_id in group.layer_ids:
                return group.group_id, group.layer_ids.index(layer_id)
        raise KeyError(f"layer {layer_id} is not in the layout")

    def num_blocks(self, kv_memory_bytes: int) -> int:
        """Pages that fit in ``kv_memory_bytes`` (the null block included)."""
        return max(0, (kv_memory_bytes - self.fixed_bytes) // self.page_bytes)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan_layout(layer_specs: list[AttentionSpec], block_size: int) -> KVLayout:
    """Group layers so all pages have one size. See the module docstring for examples."""
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 1, got {block_size}")
    if not layer_specs:
        raise ValueError("a model needs at least one attention layer")
    by_spec: dict[AttentionSpec, list[int]] = {}
    for layer_id, spec in enumerate(layer_specs):
        by_spec.setdefault(spec, []).append(layer_id)

    per_token = _common_page_bytes_per_token(by_spec)
    padding: dict[str, int] = {}
    groups: list[LayerGroup] = []
    for spec, layers in by_spec.items():
        if per_token is not None:
            per_group = per_token // spec.bytes_per_token
        else:
            per_group = 1
            padding[spec.label] = block_size * (max(s.bytes_per_token for s in by_spec) - spec.bytes_per_token)
        for start in range(0, len(layers), per_group):
            groups.append(LayerGroup(len(groups), spec, tuple(layers[start : start + per_group])))
    if per_token is None:
        per_token = max(s.bytes_per_token for s in by_spec)
    fixed = sum(spec.fixed_bytes_per_layer for spec in layer_specs)
    return KVLayout(block_size, tuple(groups), per_token * block_size, padding, fixed)


def _common_page_bytes_per_token(by_spec: dict[AttentionSpec, list[int]]) -> int | None:
    """Largest per-token page size that every spec fills exactly with a whole divisor of its layer count."""
    first_spec, first_layers = next(iter(by_spec.items()))
    if len({s.bytes_per_token for s in by_spec}) == 1:
        g = 0
        for layers in by_spec.values():
            g = gcd(g, len(layers))
        return g * first_spec.bytes_per_token
    for per_group in sorted(_divisors(len(first_layers)), reverse=True):
        candidate = per_group * first_spec.bytes_per_token
        if all(
            candidate % spec.bytes_per_token == 0 and len(layers) % (candidate // spec.bytes_per_token) == 0
            for spec, layers in by_spec.items()
        ):
            return candidate
    return None
