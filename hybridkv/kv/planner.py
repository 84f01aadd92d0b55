"""Capacity planner: how long a request, and how many at once, fit in the KV pool, before launching anything.

Answers from a Hugging Face ``config.json`` alone, with the same layout and the same peak formula the cache
manager uses for admission, so the planned ``max_model_len`` is exactly what ``KVCacheManager.can_ever_fit``
accepts. ``hybrid=False`` plans a cache that ignores layer types (every layer kept in full): the comparison
column, and what vLLM reports with its hybrid manager off.

Llama-4 Scout, TP 8, bf16, 89.71 GiB of KV per rank::

    hybrid:    pages of 96 KiB (12 layers), 1 full + 3 chunked groups -> max_model_len 15,628,784
    no-hybrid: pages of 384 KiB (48 layers), 1 group                   -> max_model_len  3,919,472

Given GPU memory instead of KV memory, the KV budget is
``gpu_memory * utilization - weights - runtime - step reserve``, all per rank, and the plan says it is an estimate.
The step reserve is the engine's own (``capacity.step_reserve_bytes``); weights and the runtime (CUDA context,
NCCL buffers), which the engine measures as memory in use, are estimated (``estimate_weights``, ``RUNTIME_BYTES``).
The weights are counted byte for byte in the format ``--quantization`` gives (``kv/weight_formats.py``): Scout on
one rank is 200.74 GiB in bf16, 102.37 GiB with FP8, 54.62 GiB with INT4 (group 128), routed experts included.
Given the same KV memory, ``plan_capacity`` and the engine size the same number of blocks and the same
``max_model_len`` (``tests/engine/test_plan_matches_engine.py``).

Pure Python: nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterator

from hybridkv.kv.capacity import GIB, longest_fitting, peak_blocks, pool_tokens, step_reserve_bytes
from hybridkv.kv.dtypes import dtype_bytes
from hybridkv.kv.layer_specs import checkpoint_dtype, kv_heads_per_rank, layer_specs_from_hf_config, text_config
from hybridkv.kv.layout import KVLayout, plan_layout
from hybridkv.kv.specs import ATTENTION_KINDS, AttentionSpec, FullAttentionSpec, cdiv
from hybridkv.kv.weight_formats import UNQUANTIZED, WeightFormat, checkpoint_format, weight_format

# Lengths at which concurrency is reported, besides the requested one: 8K, 128K, 1M tokens.
CONCURRENCY_LENGTHS = (8 * 1024, 128 * 1024, 1024 * 1024)
# Memory in use before the KV cache besides the weights, per rank: CUDA context (~0.5 GiB), NCCL buffers, CUDA
# graphs. The engine measures it; the planner can only estimate it.
RUNTIME_BYTES = GIB
# Tensor-parallel sizes a plan whose weights leave no KV memory is tried at, to name the smallest that fits.
TP_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)
# --quantization values such a plan is also tried with when the checkpoint is unquantized (quantized at load).
QUANTIZE_AT_LOAD = ("fp8", "int4")


@dataclass(slots=True)
class TypeUsage:
    """One attention type's share of the cache."""

    kind: str  # full | sliding | chunked
    label: str  # full | sliding(W) | chunked(C)
    layers: int
    groups: int
    bytes_per_token_per_layer: int
    bytes_per_token: int  # all layers of this type
    blocks_per_group: int  # most blocks one request of ``CapacityPlan.row_tokens`` keeps in each group
    padding_bytes_per_page: int


@dataclass(slots=True)
class Concurrency:
    num_tokens: int
    blocks_per_request: int  # the request's peak, all groups together (what admission reserves)
    requests: int  # how many such requests fit in the pool together
    ratio: float  # usable blocks / blocks per request (vLLM's "maximum concurrency ... x")


@dataclass(slots=True)
class MemoryEstimate:
    """Per-rank split of GPU memory when KV memory was not given; every number here is an estimate."""

    gpu_memory_bytes: int
    gpu_memory_utilization: float
    weights_bytes: int
    weights_breakdown: dict[str, int]
    weights_format: str  # the linear layers' format, short: bfloat16 | fp8 | int4 (``format_name``)
    weights_format_detail: str  # e.g. "int4 (group 128, W4A16, quantized at load)" (``format_detail``)
    runtime_bytes: int  # CUDA context, NCCL buffers (``RUNTIME_BYTES``)
    activation_reserve_bytes: int  # one step's working set, the engine's formula (``capacity.step_reserve_bytes``)
    kv_memory_bytes: int


@dataclass(slots=True)
class CapacityPlan:
    model_type: str
    hybrid: bool
    tensor_parallel_size: int
    kv_cache_dtype: str  # resolved ("auto" -> the model's dtype)
    block_size: int
    max_num_batched_tokens: int
    types: list[TypeUsage]
    row_tokens: int  # length the per-type ``blocks_per_group`` are given for (requested L, else max_model_len)
    page_bytes: int
    num_groups: int
    num_blocks: int  # the null block included
    usable_blocks: int
    kv_memory_bytes: int
    kv_memory_is_estimate: bool
    fixed_bytes: int  # length-independent bytes (FP8 scales)
    padding_bytes: int  # unused bytes per page, all types together; 0 for every model we know
    pool_tokens: int  # tokens the pool holds when every group holds the same number of blocks
    max_model_len: int  # longest single request whose peak fits the pool
    requested_max_model_len: int | None
    fits: bool  # the requested length fits (True when none was requested and max_model_len > 0)
    reason: str  # one line with the numbers when it does not fit; "" otherwise
    physical_limit_tokens: int | None  # KV memory / bytes per token of the full layers; None without full layers
    max_position_embeddings: int | None
    concurrency: list[Concurrency]
    memory: MemoryEstimate | None = None
    notes: list[str] = field(default_factory=list)


@dataclass(slots=True)
class PlanInputs:
    """What a plan is asked about: one rank's memory and the engine settings that size its KV pool.

    Give exactly one of ``kv_memory_bytes`` (the KV pool itself) and ``gpu_memory_bytes`` (the pool is then
    estimated: ``gpu_memory * utilization - weights - runtime - step reserve``). ``max_num_seqs``,
    ``segment_bytes`` (the attention backend's FP8 widening scratch) and ``collective_bytes`` (the tensor-parallel
    collectives' scratch at a tensor-parallel size: a function, as the search for the smallest size that fits asks
    it at other sizes) only size the step reserve of that estimate, as the engine's do. ``quantization`` is
    ``--quantization`` (``weight_formats.QUANTIZATIONS``): the format the weights estimate counts.

    >>> PlanInputs(tensor_parallel_size=8, kv_memory_bytes=89 << 30).block_size
    16
    """

    tensor_parallel_size: int = 1
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    kv_memory_bytes: int | None = None
    gpu_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None  # the length to check; None: report the longest that fits
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    segment_bytes: int = 0
    # tensor-parallel size -> the collectives' scratch (``CopyEngineSums.scratch_bytes``); None: no scratch
    collective_bytes: Callable[[int], int] | None = None
    quantization: str = "auto"


def plan_capacity(hf_config: dict[str, Any], inputs: PlanInputs, *, hybrid: bool = True) -> CapacityPlan:
    """Plan the KV pool of one rank. Raises ValueError only for bad input, never because a length does not fit.

    Llama-4 Scout at TP 8 with 89.71 GiB of KV per rank (the module docstring's numbers)::

        plan_capacity(scout, PlanInputs(tensor_parallel_size=8, kv_memory_bytes=int(89.71 * GIB)))

    A plan that does not fit says why in ``reason``; when the GPU memory leaves nothing for the KV cache (Scout's
    200.7 GiB of bf16 weights on one 139.8 GiB GPU), it names the smallest tensor-parallel size that fits, and for
    an unquantized checkpoint the smallest with ``--quantization`` fp8 and int4 where those need fewer ranks.
    """
    _check_inputs(inputs)
    fitted_format(hf_config, inputs.quantization)  # a quantization the checkpoint cannot take is bad input
    plan, layout = _plan(hf_config, inputs, hybrid)
    lengths = list(CONCURRENCY_LENGTHS)
    if plan.row_tokens > 0 and plan.row_tokens not in lengths:
        lengths.append(plan.row_tokens)
    plan.concurrency = [concurrency_at(layout, plan.usable_blocks, plan.max_num_batched_tokens, n) for n in lengths]
    if not plan.fits:
        plan.reason = _not_fit_reason(plan, layout, hf_config, inputs)
    plan.notes = _notes(plan, hf_config, layout)
    return plan


def _plan(hf_config: dict[str, Any], inputs: PlanInputs, hybrid: bool) -> tuple[CapacityPlan, KVLayout]:
    """The pool, its longest request and whether the asked length fits (no concurrency, reason or notes)."""
    tensor_parallel_size, kv_cache_dtype, block_size = (
        inputs.tensor_parallel_size, inputs.kv_cache_dtype, inputs.block_size
    )
    kv_memory_bytes, max_model_len = inputs.kv_memory_bytes, inputs.max_model_len
    cfg = text_config(hf_config)
    real_specs = layer_specs_from_hf_config(hf_config, tensor_parallel_size, kv_cache_dtype)
    specs = real_specs if hybrid else [FullAttentionSpec(s.num_kv_heads, s.head_dim, s.dtype) for s in real_specs]
    layout = plan_layout(specs, block_size)

    memory = None
    if kv_memory_bytes is None:
        collectives = inputs.collective_bytes(tensor_parallel_size) if inputs.collective_bytes else 0
        memory = estimate_memory(
            hf_config, tensor_parallel_size, inputs.gpu_memory_bytes, inputs.gpu_memory_utilization,
            inputs.max_num_batched_tokens, inputs.max_num_seqs, inputs.segment_bytes, collectives,
            fitted_format(hf_config, inputs.quantization, tensor_parallel_size),
        )
        kv_memory_bytes = memory.kv_memory_bytes
    num_blocks = layout.num_blocks(kv_memory_bytes)
    usable = max(0, num_blocks - 1)  # block 0 is the null block
    step = inputs.max_num_batched_tokens
    max_pos = cfg.get("max_position_embeddings")

    longest = longest_fitting(layout, usable, step, _search_upper(layout, usable, max_model_len, max_pos))
    fits = max_model_len <= longest if max_model_len is not None else longest > 0
    row_tokens = max_model_len if max_model_len is not None else longest
    plan = CapacityPlan(
        model_type=str(cfg.get("model_type", "")),
        hybrid=hybrid,
        tensor_parallel_size=tensor_parallel_size,
        kv_cache_dtype=specs[0].dtype,
        block_size=block_size,
        max_num_batched_tokens=step,
        types=type_usage(layout, row_tokens, step),
        row_tokens=row_tokens,
        page_bytes=layout.page_bytes,
        num_groups=len(layout.groups),
        num_blocks=num_blocks,
        usable_blocks=usable,
        kv_memory_bytes=kv_memory_bytes,
        kv_memory_is_estimate=memory is not None,
        fixed_bytes=layout.fixed_bytes,
        padding_bytes=sum(layout.padding_bytes.values()),
        pool_tokens=pool_tokens(layout, usable),
        max_model_len=longest,
        requested_max_model_len=max_model_len,
        fits=fits,
        reason="",
        physical_limit_tokens=physical_limit(real_specs, kv_memory_bytes),
        max_position_embeddings=int(max_pos) if max_pos else None,
        concurrency=[],
        memory=memory,
    )
    return plan, layout


def _check_inputs(inputs: PlanInputs) -> None:
    kv_memory_bytes, gpu_memory_bytes = inputs.kv_memory_bytes, inputs.gpu_memory_bytes
    if (kv_memory_bytes is None) == (gpu_memory_bytes is None):
        raise ValueError("give exactly one of kv_memory_bytes and gpu_memory_bytes")
    if kv_memory_bytes is not None and kv_memory_bytes < 0:
        raise ValueError(f"KV memory must be >= 0 bytes, got {kv_memory_bytes}")
    if gpu_memory_bytes is not None and gpu_memory_bytes <= 0:
        raise ValueError(f"GPU memory must be > 0 bytes, got {gpu_memory_bytes}")
    if not 0 < inputs.gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {inputs.gpu_memory_utilization}")
    if inputs.max_model_len is not None and inputs.max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {inputs.max_model_len}")
    if inputs.max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be >= 1, got {inputs.max_num_batched_tokens}")
    if inputs.max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {inputs.max_num_seqs}")


def _search_upper(layout: KVLayout, usable: int, requested: int | None, max_pos: Any) -> int:
    # A full group alone needs cdiv(L, B) blocks, so no length beyond usable * B fits. Without full layers the
    # peak stops growing and KV never bounds the length: the bound is the trained one, or the length asked for.
    bound = usable * layout.block_size
    if any(g.spec.keeps_every_token for g in layout.groups):
        return bound
    return max(requested or 0, int(max_pos or 0)) or bound


def concurrency_at(layout: KVLayout, usable_blocks: int, max_step_tokens: int, num_tokens: int) -> Concurrency:
    # Each request is counted at its own peak, as admission reserves it; concurrent decodes need less (their
    # steps are one token), so this is the number the scheduler guarantees, not an upper bound.
    per_request = peak_blocks(layout, num_tokens, max_step_tokens)
    return Concurrency(num_tokens, per_request, usable_blocks // per_request, usable_blocks / per_request)


def physical_limit(specs: list[AttentionSpec], kv_memory_bytes: int) -> int | None:
    """Tokens an ideal cache reaches if local layers stored nothing: KV memory / full layers' bytes per token."""
    full = sum(s.bytes_per_token for s in specs if s.keeps_every_token)
    if not full:
        return None
    fixed = sum(s.fixed_bytes_per_layer for s in specs)
    return max(0, kv_memory_bytes - fixed) // full


def type_usage(layout: KVLayout, num_tokens: int, max_step_tokens: int) -> list[TypeUsage]:
    rows: dict[str, TypeUsage] = {}
    for g in layout.groups:
        spec = g.spec
        row = rows.get(spec.label)
        if row is None:
            row = rows[spec.label] = TypeUsage(
                kind=spec.kind,
                label=spec.label,
                layers=0,
                groups=0,
                bytes_per_token_per_layer=spec.bytes_per_token,
                bytes_per_token=0,
                blocks_per_group=spec.max_live_blocks(num_tokens, layout.block_size, max_step_tokens),
                padding_bytes_per_page=layout.padding_bytes.get(spec.label, 0),
            )
        row.layers += len(g.layer_ids)
        row.groups += 1
        row.bytes_per_token += len(g.layer_ids) * spec.bytes_per_token
    return sorted(rows.values(), key=lambda r: (ATTENTION_KINDS.index(r.kind), r.label))


def _not_fit_reason(plan: CapacityPlan, layout: KVLayout, hf_config: dict[str, Any], inputs: PlanInputs) -> str:
    if plan.memory is not None and plan.memory.kv_memory_bytes == 0:
        fitting = _what_fits(hf_config, inputs, plan.hybrid, plan.memory.weights_format)
        return f"{_no_kv_memory(plan.memory, plan.tensor_parallel_size)}; {fitting}"
    if plan.requested_max_model_len is None:
        need = peak_blocks(layout, 1, plan.max_num_batched_tokens)
        return (
            f"no request fits: {plan.kv_memory_bytes / GIB:.2f} GiB holds {plan.usable_blocks:,} usable blocks of "
            f"{plan.page_bytes:,} B, and one token needs {need:,}"
        )
    need = peak_blocks(layout, plan.requested_max_model_len, plan.max_num_batched_tokens)
    parts = " + ".join(f"{r.label} {r.groups} x {r.blocks_per_group:,}" for r in plan.types)
    return (
        f"max_model_len {plan.requested_max_model_len:,} needs {need:,} blocks ({parts}) of {plan.page_bytes:,} B "
        f"but {plan.kv_memory_bytes / GIB:.2f} GiB holds {plan.usable_blocks:,} usable; "
        f"the longest that fits is {plan.max_model_len:,}"
    )


def _no_kv_memory(memory: MemoryEstimate, tensor_parallel_size: int) -> str:
    """Why the estimate left no KV memory: the weights alone, or with the runtime and the step reserve."""
    budget = int(memory.gpu_memory_bytes * memory.gpu_memory_utilization)
    usable = (
        f"the {budget / GIB:.2f} GiB the engine may use ({memory.gpu_memory_bytes / GIB:.2f} GiB x "
        f"{memory.gpu_memory_utilization})"
    )
    if memory.weights_bytes > budget:
        return (
            f"the weights alone ({memory.weights_bytes / GIB:.2f} GiB per rank at tensor-parallel size "
            f"{tensor_parallel_size}, {memory.weights_format}) exceed {usable}"
        )
    return (
        f"weights {memory.weights_bytes / GIB:.2f} GiB ({memory.weights_format}) + runtime "
        f"{memory.runtime_bytes / GIB:.2f} GiB + step reserve {memory.activation_reserve_bytes / GIB:.2f} GiB per rank "
        f"at tensor-parallel size {tensor_parallel_size} leave no KV memory of {usable}"
    )


def _what_fits(hf_config: dict[str, Any], inputs: PlanInputs, hybrid: bool, asked: str) -> str:
    """The smallest tensor-parallel size that fits in the asked format; for an unquantized checkpoint, each format
    it can be quantized to at load that fits on fewer ranks, e.g. Scout on one 139.8 GiB GPU: "the smallest
    tensor-parallel size that fits is 2 (bfloat16); with --quantization fp8 it fits at tensor-parallel size 1; with
    --quantization int4 it fits at tensor-parallel size 1". ``asked``: the asked format's ``format_name``."""
    tp = _smallest_fitting_tp(hf_config, inputs, hybrid, inputs.tensor_parallel_size + 1)
    parts = [f"the smallest tensor-parallel size that fits is {tp} ({asked})" if tp is not None
             else f"no tensor-parallel size up to {TP_CANDIDATES[-1]} fits ({asked})"]
    if not checkpoint_format(hf_config).quantized:
        for quantization in QUANTIZE_AT_LOAD:
            if quantization == asked:
                continue
            at = _smallest_fitting_tp(hf_config, replace(inputs, quantization=quantization), hybrid, 1)
            if at is not None and (tp is None or at < tp):
                parts.append(f"with --quantization {quantization} it fits at tensor-parallel size {at}")
    return "; ".join(parts)


def _smallest_fitting_tp(hf_config: dict[str, Any], inputs: PlanInputs, hybrid: bool, least: int) -> int | None:
    """The smallest tensor-parallel size from ``least`` on over which the model's heads split and at which the
    plan fits (its weights, collectives' scratch and KV pool all at that size); None if no size up to
    ``TP_CANDIDATES[-1]`` does."""
    heads = int(text_config(hf_config)["num_attention_heads"])
    for tp in TP_CANDIDATES:
        if tp < least or heads % tp:
            continue
        try:
            plan, _ = _plan(hf_config, replace(inputs, tensor_parallel_size=tp), hybrid)
        except ValueError:  # the KV heads do not split evenly over tp ranks, or a quantization group a slice
            continue
        if plan.fits:
            return tp
    return None


def _notes(plan: CapacityPlan, hf_config: dict[str, Any], layout: KVLayout) -> list[str]:
    notes: list[str] = []
    max_pos = plan.max_position_embeddings
    if max_pos and plan.max_model_len > max_pos:
        notes.append(f"max_model_len exceeds the config's max_position_embeddings {max_pos:,} (the trained bound)")
    if max_pos and plan.requested_max_model_len and plan.requested_max_model_len > max_pos:
        notes.append(f"requested length is above max_position_embeddings {max_pos:,}")
    if not any(g.spec.keeps_every_token for g in layout.groups):
        notes.append("every layer is local: KV memory does not bound the length")
    if plan.padding_bytes:
        notes.append(f"{plan.padding_bytes:,} B of every page are padding: {layout.padding_bytes}")
    if plan.memory is not None:
        notes.append("KV memory is an estimate: GPU memory x utilization - estimated weights, runtime - step reserve")
        dtype = checkpoint_dtype(hf_config)
        if plan.memory.weights_format == dtype:
            notes.append(f"the weights estimate counts every weight in {dtype}")
        else:
            notes.append(f"the weights estimate counts the linear layers of attention, MLPs and experts in "
                         f"{plan.memory.weights_format_detail}; embeddings, LM head, routers and norms in {dtype}")
    return notes


# ---- GPU memory -> KV memory -------------------------------------------------------------------------------
def estimate_memory(
    hf_config: dict[str, Any],
    tensor_parallel_size: int,
    gpu_memory_bytes: int | None,
    utilization: float,
    max_num_batched_tokens: int,
    max_num_seqs: int = 256,
    segment_bytes: int = 0,
    collective_bytes: int = 0,
    fmt: WeightFormat = UNQUANTIZED,
) -> MemoryEstimate:
    breakdown = estimate_weights(hf_config, tensor_parallel_size, fmt)
    weights = sum(breakdown.values())
    cfg = text_config(hf_config)
    reserve = step_reserve_bytes(
        max_num_batched_tokens, max_num_seqs, int(cfg["hidden_size"]), int(cfg.get("vocab_size", 0)), segment_bytes,
        collective_bytes,
    )
    kv = planned_kv_bytes(gpu_memory_bytes or 0, utilization, weights, reserve)
    dtype = checkpoint_dtype(hf_config)
    return MemoryEstimate(gpu_memory_bytes or 0, utilization, weights, breakdown, format_name(fmt, dtype),
                          format_detail(fmt, dtype), RUNTIME_BYTES, reserve, kv)


def planned_kv_bytes(gpu_memory_bytes: int, utilization: float, weights: int, reserve: int) -> int:
    """The plan's KV memory on one rank: ``gpu_memory * utilization - weights - RUNTIME_BYTES - reserve``, at least
    0. The engine on a GPU takes no more than this either (``engine/kv_sizing.py``), so the plan and the engine
    agree from the same card's memory.

    >>> planned_kv_bytes(80 * GIB, 0.9, 54 * GIB, 4 * GIB) / GIB
    13.0
    """
    return max(0, int(gpu_memory_bytes * utilization) - weights - RUNTIME_BYTES - reserve)


def planned_weight_bytes(hf_config: dict[str, Any], quantization: str | None, tensor_parallel_size: int) -> int:
    """One rank's weight bytes as the plan counts them (``estimate_weights`` in the format the engine serves)."""
    fmt = fitted_format(hf_config, quantization, tensor_parallel_size)
    return sum(estimate_weights(hf_config, tensor_parallel_size, fmt).values())


def format_name(fmt: WeightFormat, model_dtype: str) -> str:
    """What the linear layers are stored as, in a word: ``model_dtype`` unquantized, else fp8 or int4."""
    return fmt.name if fmt.quantized else model_dtype


def format_detail(fmt: WeightFormat, model_dtype: str) -> str:
    """``format_name`` with its scales and where it comes from: ``format_detail(INT4, "bfloat16")`` ->
    "int4 (group 128, W4A16, quantized at load)"; an AWQ checkpoint's -> "int4 (group 128, zero points, W4A16,
    awq checkpoint)"."""
    if not fmt.quantized:
        return model_dtype
    scales = {0: "channel scales", -1: "tensor scale"}.get(fmt.group_size, f"group {fmt.group_size}")
    parts = [scales] + ["zero points"] * fmt.zero_points
    if fmt.bits == 8:
        parts.append("W8A8, " + ("dynamic" if fmt.dynamic_activations else "static") + " activation scales")
    else:
        parts.append(f"W{fmt.bits}A16")
    parts.append("quantized at load" if fmt.source == "at load" else f"{fmt.source} checkpoint")
    return f"{fmt.name} ({', '.join(parts)})"


def model_dtype_bytes(hf_config: dict[str, Any]) -> int:
    return dtype_bytes(checkpoint_dtype(hf_config))


def estimate_weights(
    hf_config: dict[str, Any], tensor_parallel_size: int = 1, fmt: WeightFormat = UNQUANTIZED
) -> dict[str, int]:
    """Bytes of weights on one tensor-parallel rank, by part.

    The linear layers of attention, dense MLPs, experts and shared experts are counted in ``fmt``
    (``WeightFormat.linear_bytes``, scales and zero points included) on the rank's slice of each
    (``rank_linears``); those the format's ignore list names, and the embeddings, LM head (vocab-parallel),
    routers and norms (replicated) in the model dtype. E.g. Scout, one rank: 200.74 GiB in bfloat16, 102.37 GiB in
    fp8, 54.62 GiB in int4 (group 128), of each 3.85 GiB are embeddings and LM head.
    """
    cfg = text_config(hf_config)
    tp = tensor_parallel_size
    dtype = model_dtype_bytes(hf_config)
    n_layers = int(cfg["num_hidden_layers"])
    hidden = int(cfg["hidden_size"])
    vocab = int(cfg.get("vocab_size", 0))
    embed = vocab * hidden // tp
    tied = cfg.get("tie_word_embeddings", hf_config.get("tie_word_embeddings", False))
    parts = {"embedding": embed * dtype, "lm_head": 0 if tied else embed * dtype, "attention": 0, "mlp": 0,
             "moe": hidden * _num_experts(cfg) * len(_moe_layer_ids(cfg, n_layers)) * dtype,  # the routers
             "norms": (2 * n_layers + 1) * hidden * dtype}
    for linear in rank_linears(hf_config, tp):
        parts[linear.part] += _linear_bytes(linear, fmt, tp, dtype)
    return parts


# INT4 quantized at load takes the widest of these groups that divides every quantized linear's inputs on a rank
INT4_AT_LOAD_GROUPS = (128, 64, 32)


def fitted_format(hf_config: dict[str, Any], quantization: str, tensor_parallel_size: int = 1) -> WeightFormat:
    """``weight_format``, INT4 quantized at load in the widest of ``INT4_AT_LOAD_GROUPS`` that divides the input
    columns of every linear it quantizes on a rank: 128 for Scout, 64 for SmolLM2-135M (hidden size 576)."""
    fmt = weight_format(hf_config, quantization)
    if fmt.bits != 4 or fmt.source != "at load":
        return fmt
    cols = {linear.cols for linear in rank_linears(hf_config, tensor_parallel_size)}
    for group in INT4_AT_LOAD_GROUPS:
        if all(c % group == 0 for c in cols):
            return replace(fmt, group_size=group)
    raise ValueError(f"--quantization int4: no group of {', '.join(map(str, INT4_AT_LOAD_GROUPS))} inputs divides "
                     f"every linear layer's input columns at tensor-parallel size {tensor_parallel_size} "
                     f"({', '.join(map(str, sorted(cols)))})")


@dataclass(frozen=True, slots=True)
class RankLinear:
    """One linear layer's slice on a tensor-parallel rank: a [rows, cols] weight (out features x in features)."""

    part: str  # attention | mlp | moe (``estimate_weights``' keys)
    name: str  # as the checkpoint names it, e.g. "model.layers.0.mlp.down_proj", for a format's ignore list
    rows: int
    cols: int


def rank_linears(hf_config: dict[str, Any], tensor_parallel_size: int) -> Iterator[RankLinear]:
    """Every linear layer of the decoder layers, sliced for one rank as the engine shards them: column-parallel
    ones (q, k, v, gate, up) keep 1/TP of their output rows, row-parallel ones (o, down) 1/TP of their input
    columns. Experts are counted one by one: Llama-4's fused [E, H, 2I] gate_up and [E, I, H] down are E x (two
    [I/TP, H] weights and one [H, I/TP]), as a checkpoint stores them per expert.

    E.g. Scout at TP 2: q_proj [2560, 5120], k_proj and v_proj [512, 5120], o_proj [5120, 2560]; each of the 17
    experts (16 routed, 1 shared) gate_proj and up_proj [4096, 5120], down_proj [5120, 4096]."""
    cfg = text_config(hf_config)
    tp = tensor_parallel_size
    n_layers = int(cfg["num_hidden_layers"])
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    q_rows = cdiv(heads, tp) * head_dim
    kv_rows = kv_heads_per_rank(int(cfg.get("num_key_value_heads") or heads), tp) * head_dim
    prefix = "language_model.model.layers" if "text_config" in hf_config else "model.layers"
    mlp_name = "feed_forward" if str(cfg.get("model_type", "")).startswith("llama4") else "mlp"
    moe_ids = set(_moe_layer_ids(cfg, n_layers))
    expert_inter, shared_inter = _expert_sizes(cfg)
    for i in range(n_layers):
        attn = f"{prefix}.{i}.self_attn"
        for proj, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
            yield RankLinear("attention", f"{attn}.{proj}", rows, hidden)
        yield RankLinear("attention", f"{attn}.o_proj", hidden, q_rows)
        mlp = f"{prefix}.{i}.{mlp_name}"
        if i not in moe_ids:
            yield from _mlp_linears("mlp", mlp, hidden, cdiv(_dense_mlp_size(cfg), tp))
            continue
        for e in range(_num_experts(cfg)):
            yield from _mlp_linears("moe", f"{mlp}.experts.{e}", hidden, cdiv(expert_inter, tp))
        if shared_inter:
            yield from _mlp_linears("moe", f"{mlp}.shared_expert", hidden, cdiv(shared_inter, tp))


def _mlp_linears(part: str, name: str, hidden: int, inter_per_rank: int) -> Iterator[RankLinear]:
    yield RankLinear(part, f"{name}.gate_proj", inter_per_rank, hidden)
    yield RankLinear(part, f"{name}.up_proj", inter_per_rank, hidden)
    yield RankLinear(part, f"{name}.down_proj", hidden, inter_per_rank)


def _linear_bytes(linear: RankLinear, fmt: WeightFormat, tensor_parallel_size: int, dtype_bytes: int) -> int:
    # the quantization groups run along a slice's input columns, so a group must divide the rank's columns
    if fmt.keeps_unquantized(linear.name):
        return linear.rows * linear.cols * dtype_bytes
    try:
        return fmt.linear_bytes(linear.rows, linear.cols, dtype_bytes)
    except ValueError:
        raise ValueError(
            f"{linear.name}: its slice at tensor-parallel size {tensor_parallel_size} has {linear.cols} input "
            f"columns, not a multiple of the {fmt.name} quantization group {fmt.group_size}"
        ) from None


def _moe_layer_ids(cfg: dict[str, Any], n_layers: int) -> list[int]:
    experts = _num_experts(cfg)
    if not experts:
        return []
    if cfg.get("moe_layers") is not None:
        return [i for i in cfg["moe_layers"] if i < n_layers]
    step = int(cfg.get("interleave_moe_layer_step") or cfg.get("decoder_sparse_step") or 1)
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    return [i for i in range(first_dense, n_layers) if (i + 1) % step == 0]


def _num_experts(cfg: dict[str, Any]) -> int:
    return int(cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0)


def _dense_mlp_size(cfg: dict[str, Any]) -> int:
    # Llama-4 names its dense MLP size intermediate_size_mlp (intermediate_size is the expert size there).
    return int(cfg.get("intermediate_size_mlp") or cfg.get("intermediate_size") or 4 * int(cfg["hidden_size"]))


def _expert_sizes(cfg: dict[str, Any]) -> tuple[int, int]:
    """(a routed expert's, the shared experts' together) intermediate size of one MoE layer; 0: no shared."""
    inter = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0)
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) or int(cfg.get("n_shared_experts") or 0) * inter
    if str(cfg.get("model_type", "")).startswith("llama4"):
        shared = inter  # one shared expert the size of a routed one
    return inter, shared


def plan_to_dict(plan: CapacityPlan) -> dict[str, Any]:
    """Plain JSON-ready dict."""
    return asdict(plan)
