"""The decode path's Triton kernels compile for Hopper (sm_90), with the configurations a Scout rank's decode step
launches, on the CPU: no GPU needed.

The GPU tests run the kernels and the Triton interpreter runs their arithmetic on the CPU, but the interpreter does
not type-check: a variable that one branch of a kernel redefines with another type runs there and fails to compile
on a GPU. This compiles each kernel to a cubin through Triton's own NVIDIA backend, as a GPU would, and checks that
a kernel launched with programmatic dependent launch waits where it must."""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hybridkv.kernels import fused_moe, paged_attention, quant_moe, rms_norm, rope, skinny_gemm  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
FLOATS = {"scale", "k_scale", "v_scale", "eps"}


def compile_for_hopper(kernel, constexprs: dict, types: dict, num_warps: int = 4, num_stages: int = 3,
                       divisible: tuple[str, ...] = (), stage: str = "ptx") -> str:
    """The kernel's PTX (or another ``stage``: "ttgir") for sm_90. A parameter is a constexpr (``constexprs``, else
    its default), a type named in ``types``, a bf16 pointer if its name says pointer, a float32 if it is a scale or
    epsilon, else an int32. Those ``divisible`` are known multiples of 16, as Triton specializes such pointers and
    integers at launch."""
    signature, values = {}, {}
    for p in kernel.params:
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            values[p.name] = constexprs[p.name] if p.name in constexprs else p.default
        elif p.name in types:
            signature[p.name] = types[p.name]
        elif p.name.endswith(("_ptr", "_out", "_desc")):
            signature[p.name] = "*bf16"
        else:
            signature[p.name] = "fp32" if p.name in FLOATS else "i32"
    try:
        attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=values, attrs=attrs),
                                  target=HOPPER,
                                  options={"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": True})
    except RuntimeError as e:
        if "ptxas" in str(e).lower() and "not found" in str(e).lower():
            pytest.skip(f"this Triton has no ptxas: {e}")
        raise
    return compiled.asm[stage]


GLOBAL_WRITE = re.compile(r"^(@!?%p\d+\s+)?(st\.global|atom\.|red\.)")  # a store or atomic, predicated or not


def waits_before_its_first_store(ptx: str) -> bool:
    lines = [line.strip() for line in ptx.splitlines()]
    wait = next(i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait"))
    return wait < next(i for i, line in enumerate(lines) if GLOBAL_WRITE.match(line))


I32, I64, F32 = "*i32", "*i64", "*fp32"
METADATA = dict.fromkeys(("table_ptr", "vt_table_ptr", "tile_seq_ptr", "tile_q0_ptr", "q_loc_ptr", "q_len_ptr",
                          "ctx_len_ptr", "slot_block_ptr", "slot_offset_ptr"), I32)


@pytest.mark.parametrize("kind,reach,splits,fp8,block_n", [(0, 1, 256, False, 128), (2, 8192, 16, False, 128),
                                                            (0, 1, 256, True, 128), (0, 1, 256, False, 64),
                                                            (2, 8192, 32, True, 64)])
def test_decode_attention_and_its_split_combine(kind, reach, splits, fp8, block_n):
    """A full layer (256 splits) and a chunked one over bf16 pages, and a full one over an FP8 cache; 128-key
    tiles (``DECODE``) and 64-key ones (``DECODE_FEW``)."""
    cache = "*fp8e4nv" if fp8 else "*bf16"
    ptx = compile_for_hopper(
        paged_attention.paged_attention_kernel,
        dict(KIND=kind, REACH=reach, BLOCK_SIZE=64, GROUP=5, ROWS=16, TOKENS=1, D=128, D_PAD=128, BLOCK_N=block_n,
             NUM_SPLITS=splits, PRECISION="tf32", QUANT=fp8, FP16_DOT=fp8, SEGMENTED=False, ACCUMULATE=False,
             PDL=True),
        {**METADATA, "part_out_ptr": F32, "part_lse_ptr": F32, "cache_ptr": cache, "kv_desc": cache,
         "vt_ptr": cache, "vt_desc": cache})
    assert waits_before_its_first_store(ptx)
    ptx = compile_for_hopper(paged_attention.combine_splits_kernel,
                             dict(NUM_SPLITS=splits, CHUNK=min(splits, 128), D=128, D_SLICE=32, PDL=True),
                             {"part_out_ptr": F32, "part_lse_ptr": F32})
    assert waits_before_its_first_store(ptx)
    ptx = compile_for_hopper(paged_attention.kv_write_kernel, dict(HD=128, HD_PAD=128, TOKENS=32, QUANT=fp8, PDL=True),
                             {**METADATA, "cache_ptr": cache})
    assert waits_before_its_first_store(ptx)


def test_attention_over_widened_segments():
    """The prefill kernel's segmented path, each segment merged into the partials the one before left."""
    compile_for_hopper(
        paged_attention.paged_attention_kernel,
        dict(KIND=0, REACH=1, BLOCK_SIZE=64, GROUP=5, ROWS=256, TOKENS=51, D=128, D_PAD=128, BLOCK_N=64,
             NUM_SPLITS=2, PRECISION="tf32", QUANT=False, FP16_DOT=False, SEGMENTED=True, ACCUMULATE=True),
        {**METADATA, "part_out_ptr": F32, "part_lse_ptr": F32}, num_warps=8)


@pytest.mark.parametrize("rotate,temperature,store,quant", [(True, False, False, False), (False, True, False, False),
                                                           (True, False, True, False), (True, False, True, True),
                                                           (False, True, True, True), (False, False, True, False)])
def test_rope_and_norms(rotate, temperature, store, quant):
    """The position encoding, alone or storing k and v into the cache (bf16 or e4m3), a token a program (decode) or
    a tile of them (prefill)."""
    cache = "*fp8e4nv" if quant else "*bf16"
    for tile, warps in ((1, 1), rope.PREFILL_TILE):
        ptx = compile_for_hopper(rope.rope_qk_kernel, dict(D=128, ROTATE=rotate, INTERLEAVED=True, QK_NORM=rotate,
                                                           TEMPERATURE=temperature, STORE=store, QUANT=quant, PDL=True,
                                                           BLOCK_T=tile),
                                 {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "scale_ptr": "*fp32", "cache_ptr": cache,
                                  "slot_block_ptr": I32, "slot_offset_ptr": I32}, num_warps=warps)
        assert waits_before_its_first_store(ptx)
    ptx = compile_for_hopper(rms_norm.rms_norm_kernel, dict(N=5120, BLOCK=8192, ROWS=1, HAS_WEIGHT=True, ADD=True,
                                                            PDL=True), {}, num_warps=8)
    assert waits_before_its_first_store(ptx)


def test_skinny_gemm():
    ptx = compile_for_hopper(skinny_gemm.skinny_gemm_kernel,
                             dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLITS=4, BIAS=False, IEEE=False, PDL=True),
                             {"part_ptr": F32, "arrived_ptr": I32})
    assert waits_before_its_first_store(ptx)


@pytest.mark.parametrize("one_tile", [True, False])
def test_router(one_tile):
    ptx = compile_for_hopper(fused_moe.route_kernel, dict(E_PAD=16, PER_PROGRAM=1, TOP_K=1,
                                                          BLOCK_K=8192 if one_tile else 2048, ONE_TILE=one_tile,
                                                          PDL=True),
                             {"logits_ptr": F32, "arrived_ptr": I32, "ids_ptr": I64})
    assert waits_before_its_first_store(ptx)


@pytest.mark.parametrize("top_k,splits,shared,down_stages", [(1, 8, True, 5), (2, 1, False, 3), (1, 1, False, 3)])
def test_fused_moe(top_k, splits, shared, down_stages):
    """Batch 1 with the shared expert, its K split over 8 programs and the down kernel's 5 stages; top-2 (its
    rows summed by the down kernel); top-1 alone (no sum)."""
    types = {"ids_ptr": I64, "part_ptr": F32, "arrived_ptr": I32}
    ptx = compile_for_hopper(fused_moe.gate_up_kernel,
                             dict(TOP_K=top_k, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLITS=splits, IEEE=False,
                                  SHARED=shared, E_PAD=16, PDL=True), types)
    assert waits_before_its_first_store(ptx)
    ptx = compile_for_hopper(fused_moe.down_kernel,
                             dict(TOP_K=top_k, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, IEEE=False, SHARED=shared,
                                  SUM=shared or top_k > 1, E_PAD=16, PDL=True), types, num_stages=down_stages)
    assert waits_before_its_first_store(ptx)


def test_one_shot_sum_and_norm_of_tensor_parallelism():
    """Rank 0 of 2: parts stored into the peer's slots, the peer's read back until they land, then the norm."""
    import triton.language as tl

    from hybridkv.kernels import one_shot_norm

    compile_for_hopper(one_shot_norm.one_shot_add_norm_kernel,
                       dict(RANK=0, WORLD=2, N=5120, BLOCK=8192, SLOT=1 << 19, BITS=tl.int16, NAN_BITS=0x7FC0,
                            GENS=one_shot_norm.GENERATIONS),
                       {"peers_ptr": I64, "counter_ptr": I32}, num_warps=8)


@pytest.mark.parametrize("rank,world", [(0, 2), (2, 4)])
def test_pushed_sum_and_norm_of_prefill_halves(rank, world):
    """The norm that sums a prefill half's parts the peers' copy engines delivered: it waits on each peer's flag with
    an acquire at system scope (the atomic add of 0 compiles to an acquire load), and reads the slots past L1."""
    from hybridkv.kernels import one_shot_norm

    ptx = compile_for_hopper(one_shot_norm.pushed_add_norm_kernel,
                             dict(RANK=rank, WORLD=world, N=5120, BLOCK=8192, SLOT=8192 * 5120),
                             {"flags_ptr": I32, "seq": "i32"}, num_warps=8)
    assert re.search(r"ld\.global\.sys\.acquire|atom\.(global\.)?acquire\.sys", ptx) and "ld.global.cg" in ptx


def test_prefill_moe_kernels():
    """The prefill MoE's counting sort (Scout's 16 experts, 1,024 pairs a program; 128 experts), row gathers and
    ``silu * up``. The gathers' rows take 16-byte loads: the row kernels are bound by memory."""
    from hybridkv.kernels import moe_prefill

    for e_pad, block in ((16, 1024), (128, 128)):
        compile_for_hopper(moe_prefill.count_by_expert_kernel, dict(E_PAD=e_pad, BLOCK=block), {"ids_ptr": I32,
                           "counts_ptr": I32}, num_warps=8)
        compile_for_hopper(moe_prefill.place_by_expert_kernel, dict(E_PAD=e_pad, B_PAD=16, BLOCK=block),
                           {"ids_ptr": I32, "counts_ptr": I32, "order_ptr": I64, "place_ptr": I64, "ends_ptr": I32},
                           num_warps=8)
    rows = ("x_ptr", "out_ptr", "gate_up_ptr", "shared_ptr", "routed_ptr", "hidden", "inter", "stride_x",
            "stride_o", "stride_g", "stride_s", "stride_r")  # Scout's rows: 5,120 and 2 x 1,024 values
    for kernel, consts, types in ((moe_prefill.gather_gated_kernel, dict(TOP_K=1, BLOCK=1024), {"order_ptr": I64}),
                                  (moe_prefill.silu_mul_kernel, dict(BLOCK=1024), {}),
                                  (moe_prefill.add_routed_kernel, dict(TOP_K=2, BLOCK=1024), {"place_ptr": I64})):
        ptx = compile_for_hopper(kernel, consts, types, divisible=tuple(n for n in rows if n in kernel.arg_names))
        assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx), kernel.fn.__name__


@pytest.mark.parametrize("block_m,block_k,split,nibble_dots,scale_weights,even_k,warps,stages", [
    (16, 128, True, True, False, True, 4, 4),     # decode, group 128: a dot per nibble, K split
    (64, 32, True, False, False, True, 4, 4),     # decode, group 32: the reshaped tile
    (128, 64, False, False, True, True, 8, 3),    # prefill: the scaled weights into the tensor cores
    (64, 128, False, False, True, False, 4, 4),   # one group a row, K not a multiple of the tile
])
def test_int4_gemm(block_m, block_k, split, nibble_dots, scale_weights, even_k, warps, stages):
    """The INT4 GEMM's tiles: tensor-core dots (wgmma where Triton takes it: the prefill tiles), nothing spilled
    to local memory; with EVEN_K the packed weights are copied 8 or 16 bytes at a time. Launched with PDL, it
    waits before its first store; split along K, the last split to arrive (an atomic) sums the partials."""
    from hybridkv.kernels import quant_triton

    ptx = compile_for_hopper(
        quant_triton.int4_gemm_kernel,
        dict(BLOCK_M=block_m, BLOCK_N=128 if block_m == 128 else 64, BLOCK_K=block_k, GROUP_M=8, SPLIT=split,
             EVEN_K=even_k, ZERO=True, BIAS=True, SCALE_WEIGHTS=scale_weights, PRECISION="tf32",
             NIBBLE_DOTS=nibble_dots, PDL=True),
        {"p_ptr": I32, "z_ptr": "*i8", "part_ptr": F32, "arrived_ptr": I32}, num_warps=warps, num_stages=stages,
        divisible=("x_ptr", "p_ptr", "stride_xm", "stride_pn", "k", "k_per_split"))
    assert re.search(r"mma\.sync|wgmma\.mma_async", ptx) and ".local" not in ptx
    assert waits_before_its_first_store(ptx)
    assert bool(re.search(r"atom\.global\.(gpu\.)?acq_rel", ptx)) == split
    if block_m == 128:
        assert "wgmma.mma_async" in ptx
    if even_k:
        assert re.search(r"cp\.async\.c[ag]\.shared\.global \[[^]]+\], \[[^]]+\], 0x(8|10)", ptx)


@pytest.mark.parametrize("rows,block_n,warps,zero,scale_weights,even_k", [
    (1, 64, 4, False, False, True),   # decode at batch 1
    (1, 128, 8, True, False, True),   # zero points
    (4, 64, 4, False, True, True),    # the scale on the weights
    (2, 32, 2, True, False, False),   # K not a multiple of the tile
    (1, 128, 4, True, False, True),   # as many columns as threads: the scales read in the words' shape
])
def test_int4_gemv(rows, block_n, warps, zero, scale_weights, even_k):
    """The INT4 GEMV: no dots, the packed weights 16 bytes a thread (EVEN_K), nothing spilled; in its K loop no
    layout conversion (the scales and x read in the weights' layout: no round trip through shared memory). bf16 x
    read 4 values a load (``X_WIDE``) takes a quarter of x's loads; launched with PDL, it waits before its
    first store, and the last split to arrive sums the partials."""
    from hybridkv.kernels import quant_triton

    def compiled(wide: bool, stage: str = "ptx") -> str:
        return compile_for_hopper(
            quant_triton.int4_gemv_kernel,
            dict(ROWS=rows, BLOCK_N=block_n, BLOCK_K=128, GROUP_TILES=1, SPLIT=True, EVEN_K=even_k, ZERO=zero,
                 BIAS=True, SCALE_WEIGHTS=scale_weights, STAGES=1, X_WIDE=wide, WIDE_TILE=block_n >= 32 * warps,
                 PDL=True),
            {"p_ptr": I32, "z_ptr": "*i8", "part_ptr": F32, "arrived_ptr": I32, "x_ptr": I64 if wide else "*bf16"},
            warps, 1, ("x_ptr", "p_ptr", "stride_xm", "stride_pn", "k"), stage)

    def loop_loads(ptx: str) -> int:
        body = ptx[ptx.index("$L__BB0_2"):]
        return len(re.findall(r"ld\.global", body[:body.index("bra")]))

    ptx, wide = compiled(False), compiled(True)
    for code in (ptx, wide):
        assert not re.search(r"mma|wgmma", code) and ".local" not in code
        assert waits_before_its_first_store(code) and re.search(r"atom\.global\.(gpu\.)?acq_rel", code)
        if even_k:  # (else the mask along K is not known to be whole across four words)
            assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", code)
    # a thread's 4 words of a K tile take 32 values of a row of x: 8 loads of 4 instead of 32 of one
    assert loop_loads(ptx) - loop_loads(wide) == 24 * rows
    for x_wide in (False, True):
        ttgir = compiled(x_wide, "ttgir")
        loop = ttgir[ttgir.index("scf.for"):ttgir.index("scf.yield")]
        assert "convert_layout" not in loop and "local_alloc" not in loop


@pytest.mark.parametrize("one_tile,static", [(True, False), (False, False), (True, True)])
def test_fp8_quantize(one_tile, static):
    """Round-to-nearest divisions and the saturating e4m3 conversion: the same bits as torch's reference."""
    from hybridkv.kernels import quant_triton

    ptx = compile_for_hopper(quant_triton.fp8_quantize_kernel,
                             dict(BLOCK=8192 if one_tile else 4096, STATIC=static, ONE_TILE=one_tile, E4M3_MAX=448.0,
                                  E4M3_INV_MAX=1 / 448, E4M3_MIN_SCALE=1 / (448 * 512)),
                             {"q_ptr": "*fp8e4nv", "scale_ptr": F32, "static_ptr": F32}, num_warps=8)
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "div.rn.f32" in ptx
    assert not re.search(r"div\.(full|approx)", ptx)


@pytest.mark.parametrize("gated,zero,fp8", [(True, False, False), (False, True, False), (True, False, True),
                                            (False, False, True)])
def test_quant_moe(gated, zero, fp8):
    """The INT4 and FP8 experts' decode GEMM (gate_up: gated token rows; down: the pairs' rows; INT4 with zero
    points), its SiLU over the K-splits and the sum over choices, and the prefill grouped GEMM: Scout's tiles. FP8
    tiles convert e4m3 to bf16 in registers for bf16 dots."""
    weights = {"p_ptr": "*fp8e4nv", "s_ptr": F32, "z_ptr": F32} if fp8 else {"p_ptr": I32, "z_ptr": "*i8"}
    types = {"ids_ptr": I64, "part_ptr": F32, **weights}
    ptx = compile_for_hopper(quant_moe.quant_moe_gemm_kernel,
                             dict(TOP_K=2, GATED=gated, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, FP8=fp8, ZERO=zero,
                                  E_PAD=16, PRECISION="tf32"), types)
    assert ("cvt.rn.bf16x2.e4m3x2" in ptx or "cvt.rn.f16x2.e4m3x2" in ptx) == fp8
    compile_for_hopper(quant_moe.silu_splits_kernel, dict(BLOCK=1024), {"part_ptr": F32})
    compile_for_hopper(quant_moe.sum_choices_kernel, dict(TOP_K=2, BLOCK=1024), {"part_ptr": F32})
    compile_for_hopper(quant_moe.quant_grouped_gemm_kernel,
                       dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, E_PAD=16, FP8=fp8, ZERO=zero, PRECISION="tf32"),
                       {**types, "ends_ptr": I32})
