"""vLLM 0.32's own v1 ``KVCacheManager`` behind ``prefix_trace.CacheUnderTest``, called the way vLLM's v1
``Scheduler`` (vllm/v1/core/sched/scheduler.py) calls it, with the engine's default settings.

Imported by ``prefix_trace.py`` when ``vllm`` is importable (run it with the vLLM venv's python; see there).

What the engine would build for the same model, and what this builds (same grouping as our layout, so the same
layer count per group and the same page bytes; the same block count, block 0 being the null block in both):

* one ``KVCacheGroupSpec`` per group of ours: ``FullAttentionSpec``, ``SlidingWindowSpec(sliding_window=w)`` or
  ``ChunkedLocalAttentionSpec(attention_chunk_size=c)``, block_size 16, our heads / head size / dtype. vLLM's own
  grouping (``_get_kv_cache_groups_uniform_page_size``) gives these layouts the same groups (Gemma-3: 1 full + 5
  sliding of 3 layers; Scout: 1 full + 3 chunked of 12; control: 1 of 18); it puts other layers together
  (round-robin), which the manager never sees. The hybrid manager is on by default for both (``VllmConfig``:
  chunked-local keeps it unless ``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=0``; it is turned off on
  non-GPU platforms, which is why this builds the manager directly instead of through a CPU engine).
* ``prefix_cache_retention_interval = 0``: ``CacheConfig``'s default, copied into ``KVCacheConfig`` by
  ``get_kv_cache_config_from_groups``. Sliding-window groups then keep (hash) only the window's tail ending at the
  request's replay boundary (``num_prompt_tokens - 1``) and at a detected shared-prefix junction
  (``request.shared_prefix_boundary``, set from ``get_computed_blocks``); full and chunked groups cache densely.
* ``scheduler_block_size = hash_block_size = 16``: ``resolve_kv_cache_block_sizes`` (one group: the block size;
  several: lcm / gcd of the groups' block sizes, all 16). Partial (sub-block) hits are off: they need a Mamba group.
* hash: ``CacheConfig.prefix_caching_hash_algo`` default ``"sha256"``, ``init_none_hash`` +
  ``get_request_block_hasher(hash_block_size, fn)`` as ``EngineCore.__init__`` does.
* ``max_in_flight_tokens``: the one setting taken from the replay rather than from vLLM's defaults. It is read
  only to cap what the full-sequence admission gate asks of a sliding / chunked group per request
  (``min(len, window - 1 + in_flight)`` tokens; ``attention_chunk + in_flight`` for chunked). The engine resolves
  it to ``max_concurrent_batches * max_num_batched_tokens`` = 2 (async scheduling, on by default) x 8192 (the
  H100/H200 OpenAI-server default) = 16384, which assumes one request may be handed a whole batch. The replay is
  synchronous and hands a request at most ``chunk`` tokens a step, so its true bound is ``chunk`` (what vLLM
  resolves with ``--max-num-batched-tokens chunk --no-async-scheduling``). With 16384 the gate for a 17k-token
  prompt wants nearly the whole prompt in every sliding group (Gemma-3 layout: 6372 blocks; Scout: 4348), more
  than the 10% pools hold, so vLLM with that setting cannot serve the trace there at all (its startup check would
  shrink max_model_len below the longest prompt). Pass ``max_in_flight_tokens=ENGINE_DEFAULT_MAX_IN_FLIGHT_TOKENS``
  to get the engine's value where the pool allows it.
* ``watermark = 0.0``, ``scheduler_reserve_full_isl = True`` (admission asks ``allocate_slots`` with
  ``full_sequence_must_fit``), no connector, no spec decode (``num_lookahead_tokens = 0``, ``use_eagle=False``),
  prefix caching on, ``enable_mamba_shared_prefix_checkpoint = False``.
"""

from __future__ import annotations

import logging
import os

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import torch  # noqa: E402

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus  # noqa: E402

logging.getLogger("vllm").setLevel(logging.ERROR)

BLOCK_SIZE = 16
MAX_MODEL_LEN = 131_072
HASH_ALGO = "sha256"  # CacheConfig.prefix_caching_hash_algo default
RETENTION_INTERVAL = 0  # CacheConfig.prefix_cache_retention_interval default
WATERMARK = 0.0  # SchedulerConfig.watermark default
RESERVE_FULL_ISL = True  # SchedulerConfig.scheduler_reserve_full_isl default
# VllmConfig.max_in_flight_tokens = max_concurrent_batches (2: async scheduling, the default) x
# max_num_batched_tokens (8192: the H100/H200 OpenAI-server default of EngineArgs.get_batch_defaults).
# Not the default here: see the module docstring (the replay's own bound, ``chunk``, is).
ENGINE_DEFAULT_MAX_IN_FLIGHT_TOKENS = 2 * 8192

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

_hash_fn = get_hash_fn_by_name(HASH_ALGO)
init_none_hash(_hash_fn)
_block_hasher = get_request_block_hasher(BLOCK_SIZE, _hash_fn)


def vllm_group_spec(spec, block_size: int = BLOCK_SIZE):
    """vLLM's KV cache spec for one layer of ours."""
    common = dict(
        block_size=block_size,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_dim,
        dtype=_DTYPES.get(spec.dtype, torch.bfloat16),
    )
    if spec.kind == "full":
        return FullAttentionSpec(**common)
    if spec.kind == "sliding":
        return SlidingWindowSpec(**common, sliding_window=spec.window)
    if spec.kind == "chunked":
        return ChunkedLocalAttentionSpec(**common, attention_chunk_size=spec.chunk)
    raise ValueError(f"no vLLM spec for attention kind {spec.kind!r}")


def vllm_kv_cache_config(layout, num_blocks: int) -> KVCacheConfig:
    """One KVCacheGroupSpec per group of ours (same layers, so the same page bytes), ``num_blocks`` blocks."""
    if layout.block_size != BLOCK_SIZE:
        raise ValueError(f"the comparison runs at block size {BLOCK_SIZE}, the layout has {layout.block_size}")
    groups = [
        KVCacheGroupSpec(
            layer_names=[f"model.layers.{i}.self_attn.attn" for i in g.layer_ids],
            kv_cache_spec=vllm_group_spec(g.spec),
        )
        for g in layout.groups
    ]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],  # only the workers read these; the manager never does
        kv_cache_groups=groups,
        prefix_cache_retention_interval=RETENTION_INTERVAL,
        hash_block_size=BLOCK_SIZE,
        cache_hit_alignment_tokens=BLOCK_SIZE,
    )


class VllmKV:
    """vLLM's KVCacheManager, called the way vLLM's v1 Scheduler calls it (line numbers: vllm 0.32.0 scheduler.py).

    * ``admit`` = the WAITING branch of ``Scheduler.schedule``: ``get_computed_blocks`` (via
      ``_get_local_prefix_cache_hit``, 563-567, 960-967: its third value becomes ``request.shared_prefix_boundary``),
      then ``allocate_slots(request, num_new_tokens, num_new_computed_tokens=hit, new_computed_blocks=blocks,
      full_sequence_must_fit=scheduler_reserve_full_isl, has_scheduled_reqs=bool(running))`` (1256-1272); on None
      nothing is touched (1274-1281); else ``record_prefix_cache_stats`` (1315-1318), status RUNNING and
      ``num_computed_tokens = hit`` (1366-1369).
    * ``extend`` = the RUNNING branch: ``update_from_output`` has appended the sampled token with
      ``append_output_token_ids`` (2502; it extends ``block_hashes``), then ``allocate_slots(request,
      num_new_tokens, num_lookahead_tokens=0)`` (776-782).
    * ``computed`` = ``_update_after_schedule`` (1621-1631: ``num_computed_tokens += scheduled``) followed by
      ``update_from_output`` (2081: the in-flight count back to 0, one batch at a time).
    * ``free`` = ``_free_request_blocks`` -> ``kv_cache_manager.free`` (2766-2772), for a finished request
      (``_free_blocks``) and for a preempted one (``_preempt_request``, 1571-1614: status PREEMPTED,
      ``num_computed_tokens = 0``, ``num_preemptions += 1``). vLLM keeps a preempted ``Request`` (its prompt stays
      the prompt, its outputs stay outputs) and looks it up again on resumption; so does this.
    """

    name = "vllm 0.32"

    def __init__(self, layout, num_blocks: int, chunk: int, *, max_in_flight_tokens: int | None = None,
                 reserve_full_isl: bool = RESERVE_FULL_ISL, log_stats: bool = True) -> None:
        if max_in_flight_tokens is None:
            max_in_flight_tokens = chunk  # the synchronous replay's per-request bound (module docstring)
        self.kv_cache_config = vllm_kv_cache_config(layout, num_blocks)
        self.num_blocks = num_blocks
        self.chunk = chunk
        self.reserve_full_isl = reserve_full_isl
        self.kv = KVCacheManager(
            kv_cache_config=self.kv_cache_config,
            max_model_len=MAX_MODEL_LEN,
            scheduler_block_size=BLOCK_SIZE,
            hash_block_size=BLOCK_SIZE,
            max_in_flight_tokens=max_in_flight_tokens,
            enable_caching=True,
            use_eagle=False,
            num_prefill_lookahead=0,
            log_stats=log_stats,
            enable_kv_cache_events=False,
            dcp_world_size=1,
            pcp_world_size=1,
            metrics_collector=None,
            watermark=WATERMARK,
            enable_mamba_shared_prefix_checkpoint=False,
        )
        self.num_groups = self.kv.num_kv_cache_groups
        self.reqs: dict[str, Request] = {}  # admitted, holding blocks
        self._token_lists: dict[str, list[int]] = {}  # the caller's token list of each admitted request
        self.parked: dict[str, Request] = {}  # freed: preempted (resumable) or finished
        self.stats_hits = 0  # every admission's hit, resumptions included (vLLM's PrefixCacheStats splits those off)
        self.stats_queries = 0

    # -- the scheduler's calls ----------------------------------------------------------------------------------
    def _request(self, rid: str, tokens: list[int]) -> Request:
        old = self.parked.pop(rid, None)
        if old is not None and old.num_tokens == len(tokens) and list(old.all_token_ids) == tokens:
            return old  # resumed after preemption: the same Request, prompt + outputs
        return Request(
            request_id=rid,
            prompt_token_ids=list(tokens),
            sampling_params=SamplingParams(max_tokens=1 << 20),
            pooling_params=None,
            block_hasher=_block_hasher,
        )

    def admit(self, rid: str, tokens: list[int], chunk: int) -> int | None:
        req = self._request(rid, tokens)
        assert req.num_computed_tokens == 0
        blocks, hit, shared_prefix_boundary = self.kv.get_computed_blocks(req)
        req.shared_prefix_boundary = shared_prefix_boundary
        num_new = min(chunk, req.num_tokens - hit)
        new_blocks = self.kv.allocate_slots(
            req,
            num_new,
            num_new_computed_tokens=hit,
            new_computed_blocks=blocks,
            num_lookahead_tokens=0,
            num_external_computed_tokens=0,
            delay_cache_blocks=False,
            num_encoder_tokens=0,
            full_sequence_must_fit=self.reserve_full_isl,
            reserved_blocks=0,
            has_scheduled_reqs=bool(self.reqs),
        )
        if new_blocks is None:
            self.parked[rid] = req  # stays in the waiting queue, untouched
            return None
        self.kv.record_prefix_cache_stats(req, hit)
        self.stats_hits += hit
        self.stats_queries += req.num_tokens
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = hit
        self.reqs[rid] = req
        self._token_lists[rid] = tokens
        return hit

    def extend(self, rid: str, num_new: int) -> bool:
        req = self.reqs[rid]
        tokens = self._token_lists[rid]
        if len(tokens) > req.num_tokens:
            req.append_output_token_ids(tokens[req.num_tokens:])
        return self.kv.allocate_slots(req, num_new, num_lookahead_tokens=0) is not None

    def computed(self, rid: str, num_computed: int) -> None:
        req = self.reqs[rid]
        req.num_computed_tokens = num_computed
        req.is_prefill_chunk = num_computed < req.num_tokens

    def free(self, rid: str) -> None:
        req = self.reqs.pop(rid)
        self._token_lists.pop(rid)
        self.kv.free(req)
        # Preemption and finishing free alike; which one it was shows at the next admit of this rid.
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.parked[rid] = req

    # -- for checks -----------------------------------------------------------------------------------------------
    def free_blocks(self) -> int:
        return self.kv.block_pool.get_num_free_blocks()
