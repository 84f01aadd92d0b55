"""What the Hopper CUDA kernel and its loader must agree on, checked without a GPU."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

from hybridkv.kernels import cuda_build, hopper_attention
from hybridkv.model.attention.triton_metadata import query_tiles


def test_fp8_v_columns_follow_the_accumulator_layout():
    # The S accumulator gives quad lane t the keys 2t, 2t+1, 8+2t, 9+2t of each 16; an 8-bit wgmma's A fragment
    # reads lane t's 4 bytes as k-indices 4t..4t+3. V^T's columns 4t..4t+3 must hold those keys, in every 16 of a
    # page, or P meets the wrong V rows.
    for block_size in (64, 128):
        columns = hopper_attention.page_columns(block_size)
        assert sorted(columns) == list(range(block_size))
        for group in range(block_size // 16):
            for t in range(4):
                keys = [16 * group + k for k in (2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t)]
                assert columns[16 * group + 4 * t: 16 * group + 4 * t + 4] == keys


def test_launch_parameters_mirror_the_kernel_struct_field_for_field():
    # the ctypes struct is passed by address: a field added to one side only would shift every later field
    source = hopper_attention.SOURCE.read_text()
    body = re.search(r"struct Params \{(.*?)\n\};", source, re.S).group(1)
    names = []
    for line in body.splitlines():
        line = line.split("//")[0].strip().rstrip(";")
        if line:
            declared = re.sub(r"^(const )?[\w ]+?[\s*]+(?=\w+(,|$))", "", line)  # the type goes
            names += [n.strip().lstrip("*") for n in declared.split(",")]
    assert names == [name for name, _ in hopper_attention._Params._fields_]


def test_shared_memory_fits_a_hopper_cta():
    # 227 KB of dynamic shared memory per CTA (1 KB of the SM's 228 is reserved)
    for fp8, stages in ((False, hopper_attention.STAGES), (True, hopper_attention.FP8_STAGES)):
        assert hopper_attention.shared_bytes(stages, fp8) <= 227 * 1024
    assert hopper_attention.shared_bytes(hopper_attention.STAGES + 1) > 227 * 1024  # why bf16 stops at 3
    # FP8 compute: 192-key tiles of 24 KB (K) + 24 KB (V^T) a stage, so 4 stages where 128-key tiles had 5
    assert hopper_attention.shared_bytes(hopper_attention.FP8_STAGES + 1, True) > 227 * 1024
    assert hopper_attention.shared_bytes(5, True, fp8_block_n=128) <= 227 * 1024


def test_fp8_tile_switches_mirror_the_kernel_source():
    # the loader passes FP8_BN and FP8_STAGES to NVRTC and sizes shared memory by them: the source's own defaults
    # and limits must agree (a tile of 192 keys goes without FP8_PROMOTE's second O, for registers)
    source = hopper_attention.SOURCE.read_text()
    assert f"#define FP8_BN {hopper_attention.FP8_BLOCK_N}\n" in source
    assert f"#define FP8_STAGES {hopper_attention.FP8_STAGES}\n" in source
    assert "#define FP8_PROMOTE (FP8_BN == 128)" in source
    assert hopper_attention.FP8_BLOCK_N % 64 == 0  # whole 64-key panels of V^T, TMA boxes of 64 rows


def test_compiled_kernels_are_cached_by_source_and_options(tmp_path):
    # NVRTC's build is kept under a hash of what went into it: the same key loads it back without building, any
    # other key (a changed source, option or compiler) builds anew
    builds = []

    def build(tag):
        def run():
            builds.append(tag)
            return f"cubin of {tag}".encode()
        return run

    cache = tmp_path / "cubins"
    assert cuda_build.cached_cubin(cache, [b"source", b"-DSTAGES=3"], build("a")) == b"cubin of a"
    assert cuda_build.cached_cubin(cache, [b"source", b"-DSTAGES=3"], build("b")) == b"cubin of a"
    assert cuda_build.cached_cubin(cache, [b"source", b"-DSTAGES=4"], build("c")) == b"cubin of c"
    assert builds == ["a", "c"]
    assert sorted(p.suffix for p in cache.iterdir()) == [".cubin", ".cubin"]  # no temporary file left behind
    # no cache, or one that cannot be written (a file stands where the directory would be): it only costs the build
    assert cuda_build.cached_cubin(None, [b"source", b"-DSTAGES=3"], build("d")) == b"cubin of d"
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert cuda_build.cached_cubin(blocked / "cubins", [b"x"], build("e")) == b"cubin of e"
    assert builds == ["a", "c", "d", "e"]


def kernel_rows(item: np.ndarray, group: int) -> list[tuple[int, int, int]]:
    """(token row in q, position, head) of each valid row of one work item, as the kernel's ``Rows`` works them out
    (float32 reciprocal, truncation) and ``fetch_q`` keeps them (token < the item's tokens)."""
    seq, q_row0, first, w = (int(x) for x in item)
    n_tok, h0 = w & 0xFFFF, w >> 16
    r = np.arange(hopper_attention.ROWS)
    inv = np.float32(1) / np.float32(group)
    tok = np.trunc(((r + h0).astype(np.float32) + np.float32(0.5)) * inv).astype(np.int64)
    head = r + h0 - tok * group
    keep = tok < n_tok
    return list(zip((q_row0 + tok[keep]).tolist(), (first + tok[keep]).tolist(), head[keep].tolist()))


def test_work_items_give_each_tile_its_rows_positions_and_tokens():
    # the kernel reads one int4 a CTA: (sequence, first token's row, its position, tokens | first head << 16). G 5:
    # 30 new tokens over 100 cached are 150 rows, tiles of 128 and 22 (the second from token 25's head 3 on); 10 new
    # tokens over none, one tile; longest first
    q_loc, q_len, ctx = np.array([0, 30]), np.array([30, 10]), np.array([100, 0])
    items = hopper_attention.work_items(q_loc, q_len, ctx, group=5)
    assert items.dtype == np.int32 and items.shape == (3, 4)
    assert items.tolist() == [[0, 25, 125, 5 | 3 << 16], [0, 0, 100, 26], [1, 30, 0, 10]]
    assert kernel_rows(items[0], 5)[:3] == [(25, 125, 3), (25, 125, 4), (26, 126, 0)]
    assert kernel_rows(items[1], 5)[-1] == (25, 125, 2) and len(kernel_rows(items[1], 5)) == 128


@pytest.mark.parametrize("group", [1, 3, 5, 6, 7, 8, 40, 128])
def test_work_items_cover_every_query_row_once_in_full_tiles(group):
    # every (token, head) of every sequence in exactly one tile, at its position; every tile but a sequence's last
    # full (Scout's G 5: 128 rows, where tiles of whole tokens held 125)
    rng = np.random.default_rng(group)
    q_len = np.array([1, 2, 25, 26, 129, 1000, 3])
    ctx = rng.integers(0, 5000, len(q_len))
    q_loc = np.concatenate([[0], np.cumsum(q_len)[:-1]])
    items = hopper_attention.work_items(q_loc, q_len, ctx, group)
    assert (np.diff(items[:, 2]) <= 0).all()  # longest first
    seen = [row for item in items for row in kernel_rows(item, group)]
    expected = [(int(q_loc[s] + t), int(ctx[s] + t), h) for s in range(len(q_len)) for t in range(q_len[s])
                for h in range(group)]
    assert sorted(seen) == sorted(expected)
    assert len(items) == sum(-(-n * group // hopper_attention.ROWS) for n in q_len)


def test_rows_map_to_token_and_head_by_a_float_reciprocal_exactly():
    # the kernel splits a tile row r, from head h0 of its first token on, into token (r + h0) / G and head
    # (r + h0) % G as trunc((r + h0 + 0.5) * rcp(G)) in float32 (a correctly rounded reciprocal, one rounded
    # product): exact for r + h0 < 256 (r < 128, h0 < G) and every G up to 128
    source = hopper_attention.SOURCE.read_text()
    assert "__float2int_rz(((float)(r + h0) + 0.5f) * inv)" in source and "inv(__frcp_rn((float)group))" in source
    x = np.arange(2 * hopper_attention.ROWS, dtype=np.float32)
    for group in range(1, hopper_attention.ROWS + 1):
        inv = np.float32(1) / np.float32(group)
        token = np.trunc((x + np.float32(0.5)) * inv).astype(np.int64)
        assert (token == np.arange(2 * hopper_attention.ROWS) // group).all(), group
    # without the half, rows that are multiples of G would round down a token for some G
    bad = [g for g in range(1, 129) if (np.trunc(x * (np.float32(1) / np.float32(g))).astype(np.int64)
                                        != np.arange(256) // g).any()]
    assert bad


def test_query_tiles_go_longest_first():
    # 30 and 10 new tokens over 100 and 0 cached, 25 tokens a tile: (0, 25) reads the most keys, (1, 0) the fewest
    tile_seq, tile_q0 = query_tiles(np.array([30, 10]), np.array([100, 0]), 25)
    assert tile_seq.tolist() == [0, 0, 1] and tile_q0.tolist() == [25, 0, 0]


def test_register_writes_while_a_p_v_dot_reads_its_a_are_found():
    # ptxas counts an RS wgmma's register A as read at issue; a write to those registers before the full wait
    # corrupts the dot (a P packed early gave NaN). The check must see such writes and nothing else.
    sass = "\n".join([
        "        Function : paged_prefill_hopper_fp8",
        "        /*b0b0*/                   QGMMA.64x192x32.F32.E4M3.E4M3 R24, gdesc[UR8], RZ, !UPT ;",  # SS: no A
        "        /*b250*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R120, R184, gdesc[UR8], R120 ;",
        "        /*b2c0*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R120, R188, gdesc[UR8], R120, gsb0 ;",
        "        /*b4d0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;",
        "        /*b4e0*/                   FFMA R24, R9, R24, R6 ;",  # not an A register
        "        /*b4f0*/                   FFMA R186, R9, R25, R6 ;",  # A of the first dot, in flight
        "        /*b500*/              @!P0 LDS.128 R180, [UR4] ;",  # R180..R183: not A
        "        /*b510*/                   LDS.128 R182, [UR4] ;",  # R182..R185: reaches R184
        "        /*b520*/              @!P0 STS.128 [UR4], R184 ;",  # a read
        "        /*b530*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;",
        "        /*b540*/                   F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R184, R25, R24, RZ ;",  # after
    ])
    assert hopper_attention.inflight_register_writes(sass) == ["FFMA R186, R9, R25, R6", "LDS.128 R182, [UR4]"]
    assert hopper_attention.inflight_register_writes(sass.replace("0x1 ;", "0x0 ;")) == []


NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None or cuda_build.cuobjdump() is None, reason="needs nvcc and cuobjdump")
@pytest.mark.parametrize("fp8_tile", [(hopper_attention.FP8_BLOCK_N, hopper_attention.FP8_STAGES), (128, 5)])
def test_kernels_build_for_hopper_without_spills_and_leave_p_alone(tmp_path, fp8_tile):
    # Without a GPU: nvcc builds the .cu file with the loader's options. ptxas must keep every value of both kernels
    # in registers (setmaxnreg leaves a consumer 232; a persistent variant spilled its queries and loop bound),
    # and no instruction may write a register a P V dot still reads (the GPU test checks the
    # NVRTC build that runs; this one catches a change before it reaches a GPU).
    block_n, stages = fp8_tile
    cubin = tmp_path / "kernel.cubin"
    options = hopper_attention.compile_options(fp8_stages=stages, fp8_block_n=block_n)
    build = subprocess.run([NVCC, "-cubin", "-O3", "-Xptxas", "-v", *options, "-o", str(cubin),
                            str(hopper_attention.SOURCE)], capture_output=True, text=True, check=True)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", build.stdout + build.stderr)
    assert spills == [("0", "0"), ("0", "0")], build.stdout + build.stderr
    functions = cuda_build.disassemble(cubin)
    assert sorted(functions) == ["paged_prefill_hopper", "paged_prefill_hopper_fp8"]
    for name, code in functions.items():
        assert hopper_attention._RS_DOT.search(code), name
        assert hopper_attention.inflight_register_writes(code) == [], name


def test_kernel_dev_ablations_still_apply_to_the_source():
    # tools/kernel_dev/hopper_kernel.py times copies of the kernel with text edits (no loads, loads once, ...);
    # an edit whose text the kernel no longer holds would time the kernel as built under the ablation's name
    from tools.kernel_dev.hopper_kernel import EDITS, variant

    source = hopper_attention.SOURCE.read_text()
    for name in EDITS:
        assert variant([name]) != source, name
