"""Where a Scout rank's decode step goes, stage by stage, from its CUDA graph alone (GPU time, no host).

`benchmarks/gpu/decode.py`'s model and engine (random bf16 weights, a random-filled cache), then:

- ``--replay``: the median replay of the step's graph per (batch, context); run it from two checkouts to set two
  builds side by side (``cd other && PYTHONPATH=. python ../tools/kernel_dev/decode_stages.py --replay``).
- ``--stages``: the graph captured again with one stage taken out (its output replaced by its input, so the
  step's results are wrong on purpose) and replayed at batch 1, ``--context``. What the step loses is what the
  stage costs in the chain of dependent kernels, beyond the bytes it reads.
- ``--splits``: one full layer's attention and split combine at ``--context``, by split count, from graphs of
  20 calls; and the attention alone (the combine left out).
- ``--variants``: the graph captured again with a tile choice changed (the results stay right) and replayed at
  each of ``--variant-cases``: ``attn=ROWSxBLOCK_NxWARPSxSTAGES`` (the decode attention's tiles, any batch),
  ``moe_gu=NxKxWARPSxSTAGES`` / ``moe_dn=...`` (the fused MoE's gate/up and down tiles), ``moe_splits=S``,
  ``moe_programs=P`` (``fused_moe.SPLIT_PROGRAMS``); ``a+b`` both at once.

    PYTHONPATH=. python tools/kernel_dev/decode_stages.py --stages base,no_norm,no_rope,no_combine,no_attention,\\
        no_attention_full,no_attention_chunked,no_router,no_moe --context 16384

(``no_rope`` takes out the kernel that encodes q and k and stores k and v in the cache; ``no_kv_write`` is for
builds whose KV write was a kernel of its own.)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"))
from decode import graph_us, start_decoding  # noqa: E402
from scout_rank import engine_for, fill_random, rank_config, random_model  # noqa: E402

import hybridkv.kernels.fused_moe as fused_moe  # noqa: E402
from hybridkv.model.architectures import llama  # noqa: E402
from hybridkv.model.architectures.norms import RMSNorm  # noqa: E402
from hybridkv.model.attention.triton_paged import TritonPagedAttention  # noqa: E402
from hybridkv.model.loading.checkpoint import LoadedModel  # noqa: E402
from hybridkv.model.loading.tokenizer import word_tokenizer  # noqa: E402


class _Skip:
    """A kernel table whose named kernels launch nothing."""

    def __init__(self, kernels, names: set[str]) -> None:
        self.kernels, self.names = kernels, names

    def __getattr__(self, name):
        if name in self.names:
            return _NoLaunch()
        return getattr(self.kernels, name)


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


class Patches:
    """Attributes replaced for one stage's run, put back by ``undo``."""

    def __init__(self) -> None:
        self.saved: list[tuple[object, str, object]] = []

    def set(self, obj, name: str, value) -> None:
        self.saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def undo(self) -> None:
        for obj, name, value in reversed(self.saved):
            setattr(obj, name, value)
        self.saved.clear()


def take_out(stage: str, engine, model, patches: Patches) -> None:
    backend = engine.runner.backend
    # a layer's dispatched ops are bound on each instance when the model is placed (``device_ops.py``): patched
    # there, not on the class
    if stage == "no_norm":
        for norm in (m for m in model.modules() if isinstance(m, RMSNorm)):
            patches.set(norm, "add_forward", lambda x, residual, tp=None: (x, residual))
            patches.set(norm, "forward", lambda x: x)
    elif stage == "no_rope":
        patches.set(llama.Attention, "_rope_kernel", lambda self, q, k, tables, v=None, slots=None: (q, k))
    elif stage in ("no_kv_write", "no_combine"):
        name = "kv_write_kernel" if stage == "no_kv_write" else "combine_splits_kernel"
        patches.set(backend, "kernels", _Skip(backend.kernels, {name}))
    elif stage == "no_attention":  # KV write, attention and combine
        patches.set(TritonPagedAttention, "attend", lambda self, layer_id, q, k, v, scale: q)
    elif stage in ("no_attention_full", "no_attention_chunked"):
        attend, chunked = TritonPagedAttention.attend, stage == "no_attention_chunked"

        def some(self, layer_id, q, k, v, scale):
            return q if model.cfg.uses_rope(layer_id) == chunked else attend(self, layer_id, q, k, v, scale)

        patches.set(TritonPagedAttention, "attend", some)
    elif stage == "no_router":  # the first step's routing, replayed
        route, first = fused_moe.route, {}

        def routed_once(x, w, top_k, arrived):
            first.setdefault("ids", route(x, w, top_k, arrived))
            return first["ids"]

        patches.set(fused_moe, "route", routed_once)
    elif stage == "no_moe":
        for moe in (m for m in model.modules() if isinstance(m, llama.MoE)):
            patches.set(moe, "forward", lambda x: x)
    elif stage != "base":
        raise SystemExit(f"unknown stage {stage!r}")


def vary(variant: str, engine, patches: Patches) -> None:
    """Patch one tile choice of the decode path (see ``--variants``)."""
    backend = engine.runner.backend
    if variant == "base":
        return
    if "+" in variant:
        for part in variant.split("+"):
            vary(part, engine, patches)
        return
    name, _, value = variant.partition("=")
    numbers = tuple(int(v) for v in value.split("x"))
    if name == "attn":
        rows, block_n, warps, stages = numbers
        configs = backend.builder.configs
        config = dataclasses.replace(configs.decode, rows=rows, block_n=block_n, num_warps=warps, num_stages=stages)
        patches.set(backend.builder, "configs", dataclasses.replace(configs, decode=config, decode_few=None))
        patches.set(backend.builder.static, "steps", {})  # step states hold the config they were built with
    elif name in ("moe_gu", "moe_dn", "moe_splits"):
        fused = fused_moe.fused_moe
        key = {"moe_gu": "gate_up_tile", "moe_dn": "down_tile", "moe_splits": "splits"}[name]
        arg = numbers[0] if name == "moe_splits" else numbers
        patches.set(fused_moe, "fused_moe", lambda *a, **k: fused(*a, **{**k, key: arg}))
    elif name == "moe_programs":
        patches.set(fused_moe, "SPLIT_PROGRAMS", numbers[0])
    else:
        raise SystemExit(f"unknown variant {variant!r}")


def replay_ms(engine) -> list[float]:
    """The graph of the engine's last decode step, replayed alone."""
    graphs = engine.runner.graphs
    graph = graphs.graphs[graphs.last]
    return [triton.testing.do_bench(graph.replay, warmup=20, rep=300, return_mode="median") for _ in range(3)]


def split_rows(engine, context: int, heads: int) -> None:
    backend = engine.runner.backend
    engine.step()
    layer_id = 3  # a full layer of Llama-4
    layer = backend.cache.layers[layer_id]
    captured = backend.step_state.groups[layer.group_id]
    q = torch.randn(1, heads, 128, dtype=torch.bfloat16, device="cuda")
    kernels = backend.kernels
    for splits in (512, 256, 128, 64, 32, 16, 8):
        meta = dataclasses.replace(captured, num_splits=splits)
        both = graph_us(lambda: backend._attention(q, layer, meta, 0.088, 1.0, 1.0))
        backend.kernels = _Skip(kernels, {"combine_splits_kernel"})
        alone = graph_us(lambda: backend._attention(q, layer, meta, 0.088, 1.0, 1.0))
        backend.kernels = kernels
        print(f"context {context} full layer, {splits} splits: attention and combine {both:.2f} us, "
              f"attention alone {alone:.2f} us", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replay", action="store_true", help="graph replay per (batch, context) of --cases")
    ap.add_argument("--cases", default="1x16384,1x131072,1x1048576,8x131072,32x131072")
    ap.add_argument("--stages", default="", help="comma-separated: base, no_norm, no_rope, no_combine, ...")
    ap.add_argument("--splits", action="store_true", help="a full layer's attention by split count")
    ap.add_argument("--context", type=int, default=16384, help="batch-1 context of --stages and --splits")
    ap.add_argument("--variants", default="", help="comma-separated: base, attn=16x128x4x2, moe_splits=8, ...")
    ap.add_argument("--variant-cases", default="1x16384,1x1048576", help="(batch)x(context) of --variants")
    ap.add_argument("--shapes-of-tp", type=int, default=8,
                    help="one GPU's shapes of Scout split over this many (8: one KV head; 4: two, as at TP 4)")
    args = ap.parse_args()

    cfg = rank_config(args.shapes_of_tp)
    model = random_model(cfg)
    loaded = LoadedModel("scout-rank (random weights)", model, word_tokenizer(cfg["vocab_size"]), cfg)
    engine = engine_for(loaded, "bfloat16", max_num_seqs=32 if args.replay or args.variants else 1)
    fill_random(engine)
    if args.replay:
        for case in args.cases.split(","):
            batch, context = map(int, case.split("x"))
            start_decoding(engine, batch, context, cfg["vocab_size"], 400)
            print(f"batch {batch} context {context}: graph replay "
                  + " ".join(f"{ms:.3f}" for ms in replay_ms(engine)) + " ms", flush=True)
            for b in range(batch):
                engine.abort_request(f"decode-{context}-{b}")
    if args.stages or args.splits:
        start_decoding(engine, 1, args.context, cfg["vocab_size"], 400)
    patches = Patches()
    for stage in filter(None, args.stages.split(",")):
        take_out(stage, engine, model, patches)
        engine.runner.capture_decode_graphs(1, engine.max_model_len)
        engine.step()
        engine.step()
        print(f"{stage}: graph replay " + " ".join(f"{ms:.3f}" for ms in replay_ms(engine)) + " ms", flush=True)
        patches.undo()
    if args.splits:
        split_rows(engine, args.context, cfg["num_attention_heads"])
    if args.variants:
        engine.abort_request(f"decode-{args.context}-0")
        for case in args.variant_cases.split(","):
            batch, context = map(int, case.split("x"))
            start_decoding(engine, batch, context, cfg["vocab_size"], 400)
            for variant in args.variants.split(","):
                vary(variant, engine, patches)
                engine.runner.capture_decode_graphs(batch, engine.max_model_len)
                engine.step()
                engine.step()
                print(f"batch {batch} context {context} {variant}: graph replay "
                      + " ".join(f"{ms:.3f}" for ms in replay_ms(engine)) + " ms", flush=True)
                patches.undo()
            for b in range(batch):
                engine.abort_request(f"decode-{context}-{b}")


if __name__ == "__main__":
    main()
