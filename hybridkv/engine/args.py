"""Engine flags with vLLM's names, shared by ``hybridkv generate`` and ``hybridkv serve``: one per
``EngineConfig`` field (``max_num_seqs`` -> ``--max-num-seqs``), its help text and type from the field."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import replace
from typing import Any

from hybridkv.engine.config import EngineConfig


def engine_flags() -> list[dataclasses.Field]:
    """The config fields that are command-line flags, in declaration order."""
    return [f for f in dataclasses.fields(EngineConfig) if f.metadata.get("cli", True)]


def add_engine_args(p: argparse.ArgumentParser, model_positional: bool = False) -> None:
    hints = typing.get_type_hints(EngineConfig)
    for f in engine_flags():
        if f.name == "model" and model_positional:
            p.add_argument("model", nargs="?", default=None, help=f.metadata["help"])
            continue
        flag, kind = "--" + f.name.replace("_", "-"), _value_type(hints[f.name])
        help_text = f.metadata["help"]
        if kind is bool:
            # on by default, or decided by the device (None): --flag and --no-flag
            action = argparse.BooleanOptionalAction if f.default or f.default is None else "store_true"
            p.add_argument(flag, action=action, default=f.default, help=help_text)
        else:
            p.add_argument(flag, type=kind, default=f.default, help=help_text)
    add_kv_offload_arg(p)


def _value_type(hint: Any) -> type:
    """``int | None`` -> int: a flag left out keeps the field's default (None)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def add_kv_offload_arg(p: argparse.ArgumentParser) -> None:
    """The host-memory tier's size (vLLM: --kv-offloading-size GiB; SGLang: --hicache-size GB)."""
    p.add_argument("--kv-offload-gib", type=float, default=0.0, metavar="G",
                   help="host memory per rank for KV blocks evicted from the GPU pool, found again by prefix hits "
                        "(0: off)")


def kv_offload_bytes(gib: float) -> int:
    if gib < 0:
        raise ValueError(f"--kv-offload-gib must be >= 0, got {gib}")
    return int(gib * (1 << 30))


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    if args.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {args.tensor_parallel_size}")
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {args.data_parallel_size}")
    if args.data_parallel_backend not in ("mp", "ray"):
        raise ValueError(f"--data-parallel-backend must be mp or ray, got {args.data_parallel_backend!r}")
    config = EngineConfig(**{f.name: getattr(args, f.name) for f in engine_flags()})
    return replace(config, kv_offload_bytes=kv_offload_bytes(args.kv_offload_gib))
