"""What a server serves, in the log once it is ready: model, device and dtypes, the weights' format and bytes,
``max_model_len`` and what bound it, the KV pool per attention type, prefix caching, the host tier, the tool parser
and the URL.

Every number is one the engine or the planner already computed (``plan.type_usage``, ``capacity.pool_tokens``,
``planner.concurrency_at``, ``host_tier.host_tier_tokens``); nothing here recomputes a formula.
"""

from __future__ import annotations

from hybridkv.kv.capacity import pool_tokens
from hybridkv.kv.host_tier import host_tier_tokens
from hybridkv.kv.planner import concurrency_at, fitted_format, format_detail, type_usage

GIB = 1 << 30


def startup_summary(state, url: str) -> str:
    """``state``: the app's ``ServerState`` (not imported: the engines import this module, and the app them)."""
    return "\n".join([
        f"hybridkv serve ready at {url}",
        *state.engine.summary_lines(state.model_name),
        f"  tools: {_tools(state)}",
    ])


def engine_lines(engine, model_name: str) -> list[str]:
    """What one engine serves: model, weights, ``max_model_len``, KV pool, caches (a replica's, under data
    parallelism)."""
    return [
        _model_line(engine, model_name),
        _weights_line(engine),
        f"  max_model_len: {engine.max_model_len:,} tokens (why: {engine.max_model_len_bound})",
        *_pool_lines(engine),
        _cache_line(engine),
    ]


def _model_line(engine, model_name: str) -> str:
    name = engine.loaded.name
    served = "" if model_name == name else f", served as {model_name!r}"
    from hybridkv.model.dtypes import dtype_name  # torch: loaded with the engine already

    dtype = dtype_name(next(engine.model.parameters()).dtype)
    tp = engine.config.tensor_parallel_size
    ranks = f", tensor parallel {tp}" if tp > 1 else ""
    return (f"  model: {name}{served} on {engine.config.device}{ranks}, {dtype} "
            f"(KV cache {engine.layout.groups[0].spec.dtype})")


def _weights_line(engine) -> str:
    """The linear weights' format and the bytes this rank holds (parameters and buffers, as loaded)."""
    from hybridkv.model.dtypes import dtype_name  # torch: loaded with the engine already

    model = engine.loaded.model
    held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    config = engine.config
    fmt = fitted_format(engine.loaded.hf_config, config.quantization, config.tensor_parallel_size)
    detail = format_detail(fmt, dtype_name(next(engine.model.parameters()).dtype))
    cpu = ", dequantized to the model dtype on the CPU" if fmt.quantized and engine.config.device == "cpu" else ""
    rank = " per rank" if engine.config.tensor_parallel_size > 1 else ""
    return f"  weights: {detail}{cpu}, {held / GIB:.2f} GiB{rank}"


def _pool_lines(engine) -> list[str]:
    layout, usable = engine.layout, engine.kv.pool.num_usable_blocks
    step = engine.config.max_num_batched_tokens
    types = ", ".join(f"{t.label} {t.groups} group{'s' * (t.groups > 1)} of {t.layers // t.groups} layers"
                      for t in type_usage(layout, engine.max_model_len, step))
    fits = concurrency_at(layout, usable, step, engine.max_model_len)
    return [
        f"  KV pool: {usable:,} blocks of {layout.block_size} tokens ({layout.page_bytes:,} B pages), "
        f"{pool_tokens(layout, usable):,} tokens per group when shared evenly: {types}",
        f"  concurrency at max_model_len: {fits.ratio:,.2f}x ({fits.blocks_per_request:,} blocks per request)",
    ]


def _cache_line(engine) -> str:
    config = engine.config
    prefix = f"on ({config.prefix_caching_hash_algo})" if config.enable_prefix_caching else "off"
    host = "off"
    if config.kv_offload_bytes:
        layout = engine.layout
        full_groups = sum(1 for g in layout.groups if g.spec.keeps_every_token)
        tokens = host_tier_tokens(config.kv_offload_bytes, layout.page_bytes, layout.block_size, full_groups)
        held = f"{tokens:,} tokens of context" if tokens is not None else "windows only"
        host = (f"{config.kv_offload_bytes / GIB:.2f} GiB per rank = "
                f"{config.kv_offload_bytes // layout.page_bytes:,} pages = {held}")
    return f"  prefix caching: {prefix}; host tier: {host}"


def _tools(state) -> str:
    tools = state.tools
    if tools.tool_call_parser is None:
        return 'no tool call parser (tool_choice "required" and named functions work; "auto" is refused)'
    auto = "on" if tools.enable_auto_tool_choice else "off"
    return f"tool call parser {tools.tool_call_parser}, auto tool choice {auto}"
