"""``hybridkv plan``: how long a request and how many at once fit in the KV cache, before launching.

    hybridkv plan --model /models/Llama-4-Scout --tensor-parallel-size 8 --kv-memory-gib 89.71
    hybridkv plan --model gemma-3-270m --kv-memory-gib 1 --max-model-len 32768    # a known (GGUF) model name
    hybridkv plan --model /models/Llama-4-Scout --gpu-memory-gib 139.8 --quantization int4 --kv-cache-dtype fp8_e4m3
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from hybridkv.engine.args import add_kv_offload_arg, kv_offload_bytes
from hybridkv.kv.dtypes import KV_CACHE_DTYPES
from hybridkv.kv.host_tier import host_tier_tokens
from hybridkv.kv.layer_specs import text_config
from hybridkv.kv.planner import CONCURRENCY_LENGTHS, CapacityPlan, PlanInputs, plan_capacity, plan_to_dict
from hybridkv.kv.weight_formats import QUANTIZATIONS
from hybridkv.model.loading.hf_config import load_hf_config, model_hf_config

GIB = 1 << 30
EXIT_USAGE = 2


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="how long a request and how many at once fit in the KV cache, before launching",
        description="Plan the KV cache of one tensor-parallel rank from a model's config.json.",
    )
    p.add_argument(
        "--model", required=True, metavar="PATH",
        help="model directory, config.json, .gguf file or known model name",
    )
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N", help="ranks the model is split over")
    p.add_argument(
        "--kv-cache-dtype", default="auto", metavar="DTYPE",
        help=f"auto | {' | '.join(KV_CACHE_DTYPES)} (auto: what the model computes in on a GPU, bfloat16)",
    )
    p.add_argument("--block-size", type=int, default=16, metavar="B", help="tokens per block, a power of two")
    # serve's --quantization (EngineConfig.quantization), with the GPU formats the weights estimate counts
    p.add_argument(
        "--quantization", default="auto", choices=QUANTIZATIONS,
        help="with --gpu-memory-gib: the weights' format (auto: the checkpoint's own quantization_config; none: "
             "the model dtype; fp8, int4: a bf16 checkpoint quantized at load; awq, compressed-tensors: such a "
             "checkpoint)",
    )
    mem = p.add_mutually_exclusive_group(required=True)
    mem.add_argument("--kv-memory-gib", type=float, metavar="G",
                     help="KV cache memory per rank (this or --gpu-memory-gib is required)")
    mem.add_argument("--gpu-memory-gib", type=float, metavar="G",
                     help="GPU memory per rank; the KV memory is estimated from it "
                          "(this or --kv-memory-gib is required)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="U",
                   help="with --gpu-memory-gib: the share of GPU memory the engine may use")
    p.add_argument("--max-model-len", type=int, metavar="L", help="length to check; default: the longest that fits")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, metavar="N", help="most tokens in one step")
    p.add_argument(
        "--max-num-seqs", type=int, default=256, metavar="N", help="sequences per step (sizes the sampler's reserve)"
    )
    p.add_argument("--no-hybrid", action="store_true", help="plan a cache that keeps every layer in full")
    add_kv_offload_arg(p)  # the same flag as serve's: plan prints how many tokens of context it holds
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    try:
        config = _load_config(args.model)
        inputs = _plan_inputs(args, config)
        plan = plan_capacity(config, inputs, hybrid=not args.no_hybrid)
        other = plan_capacity(config, inputs, hybrid=args.no_hybrid)
    except json.JSONDecodeError as e:
        return _fail(f"{args.model}: not valid JSON ({e.msg}, line {e.lineno})")
    except (OSError, ValueError) as e:
        return _fail(str(e))
    except KeyError as e:
        return _fail(f"{args.model}: config lacks {e.args[0]!r}")
    try:
        host_bytes = kv_offload_bytes(args.kv_offload_gib)
    except ValueError as e:
        return _fail(str(e))
    host = host_tier_summary(plan, host_bytes) if host_bytes else None
    if args.json:
        out = plan_to_dict(plan)
        out["comparison"] = plan_to_dict(other)
        if host is not None:
            out["host_tier"] = host
        print(json.dumps(out, indent=2))
    else:
        hybrid, flat = (plan, other) if plan.hybrid else (other, plan)
        print(format_plan(plan, hybrid, flat))
        if host is not None:
            print(format_host_tier(host))
    return 0


def host_tier_summary(plan: CapacityPlan, host_bytes: int) -> dict[str, int | None]:
    """The host tier's pages and the tokens of context they hold (full-attention layers whole)."""
    full_groups = sum(r.groups for r in plan.types if r.kind == "full")
    return {
        "bytes": host_bytes,
        "pages": host_bytes // plan.page_bytes,
        "tokens": host_tier_tokens(host_bytes, plan.page_bytes, plan.block_size, full_groups),
    }


def format_host_tier(host: dict[str, int | None]) -> str:
    tokens = host["tokens"]
    held = (f"{tokens:,} tokens of context (full-attention layers whole, sliding/chunked windows at hit points)"
            if tokens is not None else "windows at hit points only (no full-attention layers)")
    return f"\nhost tier: {host['bytes'] / GIB:.2f} GiB per rank = {host['pages']:,} pages = {held}"


def _load_config(model: str) -> dict:
    """config.json of a directory or file; for a known model name or a .gguf file, the HF-style config its
    GGUF metadata gives (reading metadata only; this imports torch, so only then)."""
    from hybridkv.model.loading.known_models import KNOWN_MODELS

    if model in KNOWN_MODELS or model.endswith(".gguf"):
        return model_hf_config(model)
    return load_hf_config(model)


def _plan_inputs(args: argparse.Namespace, config: dict) -> PlanInputs:
    for name in ("kv_memory_gib", "gpu_memory_gib"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    return PlanInputs(
        tensor_parallel_size=args.tensor_parallel_size,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        kv_memory_bytes=None if args.kv_memory_gib is None else int(args.kv_memory_gib * GIB),
        gpu_memory_bytes=None if args.gpu_memory_gib is None else int(args.gpu_memory_gib * GIB),
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        segment_bytes=_fp8_segment_bytes(args),
        collective_bytes=_collective_bytes(args, config),
        quantization=args.quantization,
    )


def _fp8_segment_bytes(args: argparse.Namespace) -> int:
    """The Triton backend's FP8 widening scratch, which ``serve`` on a GPU reserves with an FP8 cache (read from
    the backend, which imports torch: only when it counts)."""
    if args.gpu_memory_gib is None:
        return 0
    from hybridkv.model.attention.factory import paged_attention_capabilities

    return paged_attention_capabilities("auto", "cuda", args.kv_cache_dtype).segment_bytes


def _collective_bytes(args: argparse.Namespace, config: dict) -> Callable[[int], int] | None:
    """The tensor-parallel collectives' scratch at a tensor-parallel size (the prefill halves' copy-engine slots,
    bf16), which ``serve`` on GPUs reserves (read from the collective, which imports torch: only when it counts).
    A function of the size, as the planner's search for the smallest size that fits asks it at other sizes."""
    if args.gpu_memory_gib is None:
        return None
    from hybridkv.model.architectures.collectives import CopyEngineSums

    hidden, step = int(text_config(config)["hidden_size"]), args.max_num_batched_tokens
    return lambda tensor_parallel_size: CopyEngineSums.scratch_bytes(tensor_parallel_size, step, hidden)


def format_plan(plan: CapacityPlan, hybrid: CapacityPlan, flat: CapacityPlan) -> str:
    """The human table: ``plan``'s per-type rows, then hybrid and no-hybrid side by side."""
    kv = f"{plan.kv_memory_bytes / GIB:.2f} GiB" + (" (estimate)" if plan.kv_memory_is_estimate else "")
    head = (
        f"{plan.model_type or 'model'}: {sum(r.layers for r in plan.types)} layers, TP {plan.tensor_parallel_size}, "
        f"KV {plan.kv_cache_dtype}, block {plan.block_size}, step {plan.max_num_batched_tokens:,} tokens, "
        f"KV memory {kv} per rank"
    )
    lines = [head, "", _types_table(plan), "", _compare_table(hybrid, flat)]
    if plan.memory is not None:
        m = plan.memory
        lines += [
            "",
            f"estimate: {m.gpu_memory_bytes / GIB:.2f} GiB x {m.gpu_memory_utilization}"
            f" - weights {m.weights_bytes / GIB:.2f} GiB - runtime {m.runtime_bytes / GIB:.2f} GiB"
            f" - step reserve {m.activation_reserve_bytes / GIB:.2f} GiB"
            f" = KV {m.kv_memory_bytes / GIB:.2f} GiB per rank",
            f"weights: {m.weights_format_detail} {m.weights_bytes / GIB:.2f} GiB per rank",
        ]
    if plan.reason:
        lines += ["", f"does not fit: {plan.reason}"]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def _types_table(plan: CapacityPlan) -> str:
    rows = [
        [r.label, r.layers, r.groups, r.bytes_per_token_per_layer, r.bytes_per_token, r.blocks_per_group]
        for r in plan.types
    ]
    total_layers = sum(r.layers for r in plan.types)
    total_bytes = sum(r.bytes_per_token for r in plan.types)
    total_blocks = sum(r.groups * r.blocks_per_group for r in plan.types)
    rows.append(["total", total_layers, plan.num_groups, "", total_bytes, total_blocks])
    mode = "hybrid" if plan.hybrid else "no-hybrid"
    at = f"blocks/group @ {plan.row_tokens:,}"
    headers = [f"attention ({mode})", "layers", "groups", "B/tok/layer", "B/tok", at]
    return _table(headers, rows)


def _compare_table(hybrid: CapacityPlan, flat: CapacityPlan) -> str:
    def pair(label: str, get: Callable[[CapacityPlan], object]) -> list:
        return [label, get(hybrid), get(flat)]

    rows = [
        pair("page bytes", lambda p: p.page_bytes),
        pair("groups", lambda p: p.num_groups),
        pair("blocks (usable)", lambda p: p.usable_blocks),
        pair("padding B/page", lambda p: p.padding_bytes),
        pair("pool tokens", lambda p: p.pool_tokens),
        pair("max_model_len", lambda p: p.max_model_len),
        pair("physical limit (full layers)", lambda p: p.physical_limit_tokens or "none"),
        pair("max_model_len / physical", _share_of_physical),
    ]
    lengths = [c.num_tokens for c in hybrid.concurrency if c.num_tokens in CONCURRENCY_LENGTHS]
    if hybrid.requested_max_model_len is not None:
        n = hybrid.requested_max_model_len
        rows.append(pair(f"fits {n:,}", lambda p: "yes" if p.fits else "no"))
        lengths += [n] * (n not in lengths)
    for n in lengths:
        rows.append(pair(f"concurrency @ {_short(n)}", lambda p: _ratio(_concurrency(p, n))))
    if hybrid.max_position_embeddings:
        rows.append(pair("max_position_embeddings", lambda p: p.max_position_embeddings))
    return _table(["", "hybrid", "no-hybrid"], rows)


def _concurrency(plan: CapacityPlan, num_tokens: int) -> float:
    return next(c.ratio for c in plan.concurrency if c.num_tokens == num_tokens)


def _share_of_physical(plan: CapacityPlan) -> str:
    limit = plan.physical_limit_tokens
    return f"{100 * plan.max_model_len / limit:.1f}%" if limit else "-"


def _ratio(x: float) -> str:
    return f"{x:,.2f}x"


def _short(n: int) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return f"{n:,}"


def _table(headers: list[str], rows: list[list]) -> str:
    cells = [headers] + [[f"{v:,}" if isinstance(v, int) else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        # Labels left, numbers right-aligned so digits line up.
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths)))

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])


def _fail(message: str) -> int:
    print(f"hybridkv plan: error: {message}", file=sys.stderr)
    return EXIT_USAGE


