"""Chained block hashes for prefix caching.

``hash_i = H(hash_{i-1} | token ids of block i | extra keys)``: equal hashes mean equal whole prefixes, so a
lookup can stop at the first miss. Extra keys: the cache salt on the first block only (it reaches every later
block through the chain) and the adapter id on every block.

Worked example (block size 2, tokens [5, 6, 7, 8, 9])::

    h0 = H(b"" | [5, 6] | salt, adapter)
    h1 = H(h0  | [7, 8] | adapter)
    token 9 is in a partial block and has no hash yet.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Sequence

import numpy as np
import xxhash

HASH_ALGORITHMS = ("xxh3_128", "sha256")


def _hash_fn(algorithm: str) -> Callable[[bytes], bytes]:
    if algorithm == "xxh3_128":
        return lambda data: xxhash.xxh3_128_digest(data)
    if algorithm == "sha256":
        return lambda data: hashlib.sha256(data).digest()
    raise ValueError(f"unknown prefix-cache hash {algorithm!r}; choose one of {HASH_ALGORITHMS}")


def _extra_bytes(cache_salt: str | None, adapter_id: str | int | None) -> bytes:
    parts = []
    if cache_salt is not None:
        parts.append(b"salt:" + str(cache_salt).encode())
    if adapter_id is not None:
        parts.append(b"adapter:" + str(adapter_id).encode())
    return b"\x00".join(parts)


class BlockHasher:
    """Hashes the full blocks of a token sequence, one block at a time, chaining on the previous hash."""

    __slots__ = ("block_size", "algorithm", "_fn")

    def __init__(self, block_size: int, algorithm: str = "xxh3_128") -> None:
        self.block_size = block_size
        self.algorithm = algorithm
        self._fn = _hash_fn(algorithm)

    def extend(
        self,
        hashes: list[bytes],
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        adapter_id: str | int | None = None,
    ) -> None:
        """Append to ``hashes`` the hash of every full block of ``token_ids`` not hashed yet (O(new blocks))."""
        bs = self.block_size
        start = len(hashes)
        end = len(token_ids) // bs
        if end <= start:
            return
        tokens = np.asarray(token_ids[start * bs : end * bs], dtype="<i8")
        adapter = _extra_bytes(None, adapter_id)
        parent = hashes[-1] if hashes else b""
        for i in range(end - start):
            extra = _extra_bytes(cache_salt, adapter_id) if start + i == 0 else adapter
            parent = self._fn(parent + tokens[i * bs : (i + 1) * bs].tobytes() + b"\x01" + extra)
            hashes.append(parent)
