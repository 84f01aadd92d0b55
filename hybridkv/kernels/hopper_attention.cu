// Paged hybrid attention prefill for Hopper (sm_90a), FlashAttention-3 style, compiled at run time by NVRTC.
//
// One CTA computes one query tile (128 rows: a sequence's query heads of one KV head stacked per token, taken in
// that order across tokens, so a tile may start and end inside a token's heads) over the keys [start, end) of its
// KV split, in key tiles of 128 (FP8 compute: 192). Three warpgroups:
//   producer  (warpgroup 0): brings each K and V tile into swizzled shared memory, STAGES tiles ahead, landing on
//             an mbarrier. A tile inside the reach comes by TMA, one box per page (and 64-column panel; a warp's
//             lanes issue them); an edge tile, whose rows outside [lo, end) may be dropped blocks or NaN, is
//             gathered row by row with cp.async, zero-filling those rows (FP8: K still by TMA, its scores there
//             become -inf; V^T loaded by the producer with those keys' bytes zeroed).
//   consumers (warpgroups 1, 2): 64 query rows each. S = Q K^T and O += P V are wgmma (float32 accumulators); P
//             goes from the S registers straight into the second dot's A operand. Q K_{t+1}^T is issued before
//             P_t V_t and the softmax of tile t+1 runs while P_t V_t does (OVERLAP); named barriers make the two
//             consumers take turns at the tensor cores (PINGPONG).
// setmaxnreg moves registers from the producer to the consumers.
//
// Two instances of the one kernel body (``prefill<FP8>``):
//   paged_prefill_hopper      bf16 Q, K, V (a bf16 cache, or an FP8 cache's segments widened to bf16); m64n128k16.
//   paged_prefill_hopper_fp8  FP8 compute over an e4m3 cache (m64n192k32 and m64n128k32, twice bf16's rate;
//             192-key tiles, as the softmax binds here: FP8_BN): each query row is
//             quantized to e4m3 with its own scale (its max |q| to 448) as it enters shared memory; K tiles come
//             from the e4m3 pages as they are; 8-bit wgmma takes B K-major only, so V comes from V^T, a copy of
//             the segment's V transposed ([heads x 128 rows, key columns]) by the backend; P is scaled by 2^8 and
//             rounded to e4m3 in registers (weights down to 2^-17 survive instead of flushing below e4m3's 2^-9;
//             the row sum carries the same factor).
//
// A CTA's start: its tile's four numbers (``tiles``) in one load, then the queries (consumers) and the first page
// table entries (producer) go out before the barriers are set up. Its end (one split): O is staged in shared memory
// (bf16: each consumer's query tile; FP8: a K/V stage no tile uses any more) and stored in whole rows.
// (``tools/kernel_dev/hopper_timeline.py`` times these phases.)
//
// Shared memory (1024-aligned): Q [2 consumers][64 rows], then per stage a K tile and a V tile. bf16: 64-column
// panels of 128-byte rows, 16-byte chunk c of row r at chunk c ^ (r % 8) (wgmma's and TMA's 128-byte swizzle); a
// key tile's rows are keys, so the same bytes serve as Q K^T's B (K-major) and, transposed, as P V's B (MN-major).
// FP8: Q and K rows are 128 bytes (one panel); V^T is panels of 64 keys (three in a 192-key tile), 128 rows of 64
// bytes, chunk c of row r at c ^ (r / 2 % 4) (the 64-byte swizzle).
//
// FP8's P layout: the S accumulator gives a thread of quad position t the columns 8j + 2t + {0, 1}; the A fragment
// of an m64n128k32 wgmma wants its 4-byte registers to hold k-indices 4t..4t+3 (and 16 + 4t..). Instead of shuffling
// P across lanes, V^T's columns are permuted within each 16 keys: k-index a = 4t + 2b + e holds key 8b + 2t + e
// (``V_PERM16`` in hopper_attention.py), so each thread packs its own S values as they are.
//
// ``tools/kernel_dev/hopper_kernel.py`` times the compile-time switches and what each stage costs.

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;
typedef unsigned char u8;

#ifndef STAGES
#define STAGES 3
#endif
#ifndef FP8_STAGES
#define FP8_STAGES 4
#endif
// FP8_BN: the FP8 kernel's keys per tile. 192 (FlashAttention-3's choice for FP8 at d128 with V^T): the softmax binds
// FP8 compute, and each tile's fixed work (its row max and sum reductions, the waits for the two dots, O's rescale,
// the barriers) is spread over 1.5x the scores. Its S accumulators take the registers FP8_PROMOTE's second O would,
// so 192 goes without it. 128: the tile of the bf16 kernel, with FP8_PROMOTE.
#ifndef FP8_BN
#define FP8_BN 192
#endif
// OVERLAP 1: a consumer issues Q K_{t+1}^T before P_t V_t and waits for the scores alone, so its exponentials run
// while its P V dot does (FlashAttention-3's intra-warpgroup overlap). 0: both dots, then the softmax.
#ifndef OVERLAP
#define OVERLAP 1
#endif
// PINGPONG 1: two named barriers make the consumers take turns issuing their dots, so one's softmax runs while
// the other's dots do (FlashAttention-3's ping-pong). 0: each issues when ready.
#ifndef PINGPONG
#define PINGPONG 1
#endif
// TREE 1: the FP8 kernel's softmax runs each row's max and sum as 4 independent chains of 8 instead of one chain
// of 32 (H200, 64K one-shot: 779 vs 755 TFLOP/s). The bf16 kernel keeps one chain: 4 measured slower there (573 vs
// 592), its register budget being tighter.
#ifndef TREE
#define TREE 1
#endif
// FP8_PROMOTE 1: each tile's P V goes into fresh accumulators, added to O in float32 (O = O alpha + PV, one FMA as
// the rescale was): Hopper's FP8 wgmma accumulates in reduced precision, which a long reach would otherwise pile up
// in O. 0: P V accumulates straight into O.
#ifndef FP8_PROMOTE
#define FP8_PROMOTE (FP8_BN == 128)
#endif
static_assert(!(FP8_PROMOTE && FP8_BN > 128), "FP8_PROMOTE's second O does not fit beside a wider S tile");
static_assert(FP8_BN == 128 || FP8_BN == 192, "FP8 key tiles of 128 or 192 keys (256 spills: S 128 + P 32 + O 64)");

constexpr int D = 128;        // head dim
template <bool FP8>
constexpr int BN = FP8 ? FP8_BN : 128;  // keys per tile
constexpr int WG_ROWS = 64;   // query rows per consumer warpgroup
constexpr u32 PANEL = 128 * 128;  // bf16: one 64-column panel of a key tile (16 KB)
constexpr u32 VT_PANEL = D * 64;  // FP8: 64 keys of V^T, 128 rows of 64 bytes (8 KB)
constexpr unsigned FULL = 0xffffffffu;

// one CTA's shared memory, per element type (the loader's ``shared_bytes`` adds 1 KB of alignment)
template <bool FP8>
struct Smem {
  static constexpr int stages = FP8 ? FP8_STAGES : STAGES;
  static constexpr u32 elem = FP8 ? 1 : 2;
  static constexpr u32 q_bytes = WG_ROWS * D * elem;  // per consumer
  static constexpr u32 k_bytes = BN<FP8> * D * elem;  // a key tile (bf16: 2 panels; FP8 V^T: BN / 64)
  static constexpr u32 stage_bytes = 2 * k_bytes;     // K, then V (FP8: V^T)
  static constexpr u32 kv = 2 * q_bytes;              // the first stage
  static constexpr u32 bars = kv + stages * stage_bytes;  // full[stages], empty[stages]
  static constexpr u32 q_scales = bars + 16 * stages;     // FP8: each query row's factor, float[128]
  static constexpr u32 bytes = q_scales + (FP8 ? 4 * 2 * WG_ROWS : 0);
  // setmaxnreg: 128 x producer + 256 x consumer <= 64K registers. FP8_PROMOTE's second set of O accumulators
  // wants 240 in a consumer (FP8_BN 192 without it: S 96 + O 64 + P 24).
  static constexpr int producer_regs = FP8 && FP8_PROMOTE ? 24 : 40;
  static constexpr int consumer_regs = FP8 && FP8_PROMOTE ? 240 : 232;
};
// a CTA may have 227 KB of shared memory; the launch asks for ``bytes`` + 1 KB to align the tiles
static_assert(Smem<false>::bytes + 1024 <= 227 * 1024 && Smem<true>::bytes + 1024 <= 227 * 1024, "shared memory");
// FP8's O (bf16, 2 x 64 rows of 256 bytes) is staged in one K/V stage, which needs NS >= 3 (the epilogue says why)
static_assert(Smem<true>::stage_bytes >= 2 * WG_ROWS * D * 2 && Smem<true>::stages >= 3, "FP8 O staging");

struct Params {
  const u16* q;
  u16* out;
  float* part;
  float* lse;
  const void* cache;  // the layer's first element (bf16, or e4m3 for FP8 compute)
  const int* table;
  // per work item (CTA x): its sequence, its first token's row in q and out, that token's position, and (low 16
  // bits) how many tokens its rows touch, (high 16) the head of the first token its row 0 holds (one load a CTA
  // at its start, where five arrays took two dependent round trips)
  const int4* tiles;
  const u8* vt;          // FP8 compute: the segment's V^T (e4m3, [kv heads x D, columns])
  const int* vt_table;   // FP8 compute: each block's row in V^T (a row is block_size columns); table's strides
  long long stride_qt, stride_qh, stride_ot, stride_oh, stride_table;
  long long stride_block, stride_tok, v_offset;
  long long stride_ps, stride_pt, stride_ph, stride_ls, stride_lt;
  long long stride_vt;   // bytes between V^T's rows
  float qk_scale;  // softmax scale x k_scale x log2(e)
  float v_scale;
  int kind;        // 0 full, 1 sliding, 2 chunked
  int reach;       // window or chunk (1 for full)
  int block_size;  // tokens per page
  int group;       // query heads per KV head
  int num_splits;
  int seg_lo, seg_hi;  // keys [seg_lo, seg_hi) only: one segment of an FP8 cache's reach (widened, or V^T)
  int segmented;       // always write partial outputs and LSE (``accumulate``: merged into the previous segment's)
  int accumulate;
  int tma;             // 1: ``kmap`` describes the cache's token rows, tiles inside the reach arrive by TMA
  int rows_per_block;  // token rows of a page in ``kmap``: its K rows, then its V rows
};

// CUtensorMap, opaque: 128 bytes, 64-byte aligned
struct __align__(64) TensorMap {
  u64 data[16];
};

__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 r;
  asm("{\n.reg .u64 t;\ncvta.to.shared.u64 t, %1;\ncvt.u32.u64 %0, t;\n}\n" : "=r"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  u32 done;
  do {
    asm volatile(
        "{\n.reg .pred P;\nmbarrier.try_wait.parity.shared::cta.b64 P, [%1], %2;\nselp.u32 %0, 1, 0, P;\n}\n"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, u32 src_bytes) {
  // src_bytes 0: nothing is read and the 16 bytes are zero-filled
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// one TMA box (64 columns x some rows of the cache's token rows) into swizzled shared memory
__device__ __forceinline__ void tma_load(u32 dst, const TensorMap* map, int col, int row, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      ::"r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(col), "r"(row), "r"(bar) : "memory");
}
// a TMA map's 128 bytes fetched ahead, so that the first copies through it do not wait for them
__device__ __forceinline__ void prefetch_map(const TensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<u64>(map)) : "memory");
}
__device__ __forceinline__ void cp_async_arrive(u32 bar) {
  // the barrier counts this thread's arrival once all its earlier cp.async have landed
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() {
  // writes by the generic proxy (cp.async, st.shared) become visible to wgmma's reads (the async proxy)
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void bar_sync(u32 id, u32 n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive(u32 id, u32 n) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}
// the ping-pong turns: both consumers (256 threads) meet at barrier 2 (consumer 0's turn) or 3 (consumer 1's)
__device__ __forceinline__ void wait_turn(u32 id) {
  if (PINGPONG) bar_sync(id, 256);
}
__device__ __forceinline__ void give_turn(u32 id) {
  if (PINGPONG) bar_arrive(id, 256);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
  // keeps the compiler from reading accumulators before the wait that completes them
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float lg2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
  // the barrier's phase also waits for ``bytes`` of TMA copies (this is not an arrival)
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void st_shared16(u32 dst, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ uint4 ld_shared16(u32 src) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(src)
               : "memory");
  return v;
}
// (written out: NVRTC split a plain 16-byte store of a uint4 into four 4-byte ones, each touching 16 sectors a warp)
__device__ __forceinline__ void st_global16(void* dst, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ void st_shared4(u32 dst, u32 v) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(dst), "r"(v) : "memory");
}
// four floats to e4m3 (round to nearest, saturating at 448), a in the lowest byte
__device__ __forceinline__ u32 pack_e4m3(float a, float b, float c, float d) {
  u32 r;
  asm("{\n.reg .b16 lo, hi;\ncvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\ncvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
      "mov.b32 %0, {lo, hi};\n}\n"
      : "=r"(r) : "f"(a), "f"(b), "f"(c), "f"(d));
  return r;
}
__device__ __forceinline__ float bf16_lo(u32 x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float bf16_hi(u32 x) { return __uint_as_float(x & 0xffff0000u); }
// wgmma shared-memory descriptor. ``mode`` 1: 128-byte swizzle, 2: 64-byte. K-major operands: rows 128 (64) B
// apart, 8-row groups ``sbo`` = 1024 (512) B apart (``lbo`` unused). MN-major (bf16 V as P V's B): ``lbo`` = bytes
// between 64-column panels.
__device__ __forceinline__ u64 smem_desc(u32 addr, u32 lbo, u32 sbo, u64 mode = 1) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((lbo & 0x3FFFF) >> 4) << 16) | ((u64)((sbo & 0x3FFFF) >> 4) << 32) |
         (mode << 62);
}
// the descriptor of ``bytes`` further on: the address field holds addr / 16 in 14 bits, and a CTA's shared memory
// (< 2^18 bytes) never carries out of it. One add per wgmma, where each built its own in five uniform instructions
__device__ __forceinline__ u64 desc_at(u64 desc, u32 bytes) { return desc + (bytes >> 4); }
// A wgmma's float accumulators d[0..N/2) of one thread (N/2 = 64, or 96 for FP8's m64n192 Q K^T): as its
// template names them (operands %0..) and as the asm statement binds them (read and written)
#define WG_REGS_64 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WG_ACC "{" WG_REGS_64 "}"
#define WG_ACC96 "{" WG_REGS_64 ", " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95" \
  "}"
#define WG_ACC_OPERANDS \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define WG_ACC96_OPERANDS WG_ACC_OPERANDS, \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
  "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
  "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
// S (+)= A B: both operands in shared memory, K-major
__device__ __forceinline__ void wgmma_ss(float (&d)[64], u64 a, u64 b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " WG_ACC ", %64, %65, p, 1, 1, 0, 0;\n}\n"
      : WG_ACC_OPERANDS
      : "l"(a), "l"(b), "r"(scale_d));
}
// O += P V: P from registers, V the MN-major (transposed) B
__device__ __forceinline__ void wgmma_rs_tb(float (&d)[64], u32 a0, u32 a1, u32 a2, u32 a3, u64 b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " WG_ACC ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : WG_ACC_OPERANDS
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b), "r"(1));
}
// FP8 (e4m3): K-major operands only (8-bit wgmma has no transpose); S = Q K^T over 128 or 192 keys
template <int N>
__device__ __forceinline__ void wgmma_ss_e4m3(float (&d)[N / 2], u64 a, u64 b, int scale_d) {
  static_assert(N == 128 || N == 192, "FP8 key tiles of 128 or 192");
  if constexpr (N == 128) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " WG_ACC ", %64, %65, p, 1, 1;\n}\n"
        : WG_ACC_OPERANDS
        : "l"(a), "l"(b), "r"(scale_d));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k32.f32.e4m3.e4m3 " WG_ACC96 ", %96, %97, p, 1, 1;\n}\n"
        : WG_ACC96_OPERANDS
        : "l"(a), "l"(b), "r"(scale_d));
  }
}
__device__ __forceinline__ void wgmma_rs_e4m3(float (&d)[64], u32 a0, u32 a1, u32 a2, u32 a3, u64 b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " WG_ACC ", {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
      : WG_ACC_OPERANDS
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b), "r"(scale_d));
}
__device__ __forceinline__ int type_lo(int pos, int kind, int reach) {
  // first key a query at ``pos`` sees
  if (kind == 1) return max(pos - reach + 1, 0);
  if (kind == 2) return pos / reach * reach;
  return 0;
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// A consumer thread's S accumulators (half a tile's keys: 64, FP8_BN 192: 96) and its P (bf16 pairs, or FP8 quads)
template <bool FP8>
constexpr int S_REGS = BN<FP8> / 2;
template <bool FP8>
constexpr int P_REGS = FP8 ? BN<FP8> / 8 : BN<FP8> / 4;

// S = Q K^T over the head dim. bf16: 8 steps of 16 (4 per 64-column panel, 32 bytes apart inside the swizzle);
// FP8: 4 steps of 32 along one 128-byte row.
template <bool FP8>
__device__ __forceinline__ void qk_dot(float (&s)[S_REGS<FP8>], u32 q_smem, u32 k_smem) {
  const u64 q = smem_desc(q_smem, 16, 1024), k = smem_desc(k_smem, 16, 1024);
  if constexpr (FP8) {
#pragma unroll
    for (int kk = 0; kk < D / 32; ++kk)
      wgmma_ss_e4m3<BN<FP8>>(s, desc_at(q, kk * 32), desc_at(k, kk * 32), kk > 0);
  } else {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const u64 a = desc_at(q, (kk >> 2) * (WG_ROWS * 128) + (kk & 3) * 32);
      const u64 b = desc_at(k, (kk >> 2) * PANEL + (kk & 3) * 32);
      wgmma_ss(s, a, b, kk > 0);
    }
  }
}

// O += P V over the tile's keys. bf16: 8 steps of 16 keys (2 KB of rows each), V the MN-major B. FP8: steps of
// 32 keys, V^T the K-major B (64-key panels, 32 bytes apart inside a 64-byte row).
template <bool FP8>
__device__ __forceinline__ void pv_dot(float (&o)[64], const u32 (&p)[P_REGS<FP8>], u32 v_smem) {
  if constexpr (FP8) {
    const u64 v = smem_desc(v_smem, 16, 512, 2);
#pragma unroll
    for (int kk = 0; kk < BN<FP8> / 32; ++kk) {
      const u64 b = desc_at(v, (kk >> 1) * VT_PANEL + (kk & 1) * 32);
      wgmma_rs_e4m3(o, p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3], b, FP8_PROMOTE ? kk > 0 : 1);
    }
  } else {
    const u64 v = smem_desc(v_smem, PANEL, 1024);
#pragma unroll
    for (int kk = 0; kk < BN<FP8> / 16; ++kk)
      wgmma_rs_tb(o, p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3], desc_at(v, kk * 16 * 128));
  }
}

// Online softmax of one S tile (keys n..n + BN - 1) in the wgmma accumulator layout: s[4j + 2h + e] is row
// (lane / 4 + 8h) of this warp's 16, column 8j + 2 (lane % 4) + e. ``softmax_scores`` turns s into the tile's
// weights in place, 2^(s scale - m + BIAS), and updates the running max m and sum; then ``update_o`` rescales O,
// which must be complete by then, and ``pack_p`` packs P in the layout of the next dot's A fragments. ``scale`` is
// per row (FP8: each query row's quantization factor is in it).
template <bool MASKED, bool FP8>
__device__ __forceinline__ void softmax_scores(float (&s)[S_REGS<FP8>], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                               const int (&row_lo)[2], const int (&row_hi)[2], int n, int lane,
                                               const float (&scale)[2]) {
  constexpr float BIAS = FP8 ? 8.f : 0.f;  // FP8: P x 2^8 before its e4m3 rounding
  const float NEG_INF = __int_as_float(0xff800000);
  constexpr int CHAINS = FP8 && TREE ? 4 : 1;
  float m_new[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float part[CHAINS];
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) part[c] = NEG_INF;
#pragma unroll
    for (int j = 0; j < BN<FP8> / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float x = s[4 * j + 2 * h + e];
        if (MASKED) {
          const int key = n + 8 * j + 2 * (lane & 3) + e;
          x = (key >= row_lo[h] && key <= row_hi[h]) ? x * scale[h] : NEG_INF;
          s[4 * j + 2 * h + e] = x;
        }
        part[(2 * j + e) % CHAINS] = fmaxf(part[(2 * j + e) % CHAINS], x);
      }
    }
#pragma unroll
    for (int c = 1; c < CHAINS; ++c) part[0] = fmaxf(part[0], part[c]);
    const float mx = quad_max(part[0]);
    // scale > 0: the max of the scaled scores is the scaled max
    m_new[h] = fmaxf(m[h], MASKED ? mx : mx * scale[h]);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    alpha[h] = ex2(m[h] - m_new[h]);
    m[h] = m_new[h];
    const float shift = BIAS - m[h];
    float sum[CHAINS];
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) sum[c] = 0.f;
#pragma unroll
    for (int j = 0; j < BN<FP8> / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int i = 4 * j + 2 * h + e;
        const float x = MASKED ? ex2(s[i] + shift) : ex2(fmaf(s[i], scale[h], shift));
        s[i] = x;
        sum[(2 * j + e) % CHAINS] += x;
      }
    }
#pragma unroll
    for (int c = 1; c < CHAINS; ++c) sum[0] += sum[c];
    l[h] = l[h] * alpha[h] + sum[0];  // this thread's columns only: the quad adds its four at the end
  }
}

// bf16: p[4kk + i] packs s[8kk + 2i], s[8kk + 2i + 1]. FP8 (k32 steps): p[4kk + i], row half h = i % 2 and k half
// u = i / 2, packs s[16kk + 8u + 2h + {0, 1}] and s[16kk + 8u + 4 + 2h + {0, 1}]: columns 16u + 2t + {0, 1} and
// 16u + 8 + 2t + {0, 1}, which V^T's permuted columns put at k-indices 16u + 4t .. 16u + 4t + 3.
template <bool FP8>
__device__ __forceinline__ void pack_p(const float (&s)[S_REGS<FP8>], u32 (&p)[P_REGS<FP8>]) {
  if constexpr (FP8) {
#pragma unroll
    for (int i = 0; i < P_REGS<FP8>; ++i) {
      const int j = 16 * (i >> 2) + 8 * ((i >> 1) & 1) + 2 * (i & 1);
      p[i] = pack_e4m3(s[j], s[j + 1], s[j + 4], s[j + 5]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 32; ++i) p[i] = pack_bf16(s[2 * i], s[2 * i + 1]);
  }
}

// O once P_t V_t is in: O x alpha_{t+1} where the dot accumulated into O; O alpha_t + (P_t V_t) where it went to
// fresh accumulators ``pv`` (PROMOTE)
template <bool PROMOTE>
__device__ __forceinline__ void update_o(float (&o)[64], const float (&pv)[64], const float (&alpha)[2]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = PROMOTE ? fmaf(o[i], alpha[(i >> 1) & 1], pv[i]) : o[i] * alpha[(i >> 1) & 1];
}

template <bool FP8>
__device__ __forceinline__ void softmax_any(float (&s)[S_REGS<FP8>], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                            const int (&row_lo)[2], const int (&row_hi)[2], int n, int lane,
                                            const float (&scale)[2], bool masked) {
  if (masked)
    softmax_scores<true, FP8>(s, m, l, alpha, row_lo, row_hi, n, lane, scale);
  else
    softmax_scores<false, FP8>(s, m, l, alpha, row_lo, row_hi, n, lane, scale);
}

// FP8 compute, an edge tile's V^T: the 16 keys key0.. of one chunk in V^T's column order (k-index 4w + b holds key
// 8 (b / 2) + 2w + b % 2); word w's bytes are kept where their key lies in [lo, end), zeroed elsewhere
__device__ __forceinline__ u32 key_mask(int key0, int w, int lo, int end) {
  u32 mask = 0;
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    const int key = key0 + 8 * (b >> 1) + 2 * w + (b & 1);
    if (key >= lo && key < end) mask |= 0xffu << (8 * b);
  }
  return mask;
}

// A tile's rows stack the G query heads of one KV head per token, from head h0 of its first token on: row r is
// token (r + h0) / G, head (r + h0) % G (h0 0 where G divides the tile: Scout's G 5 packs 128 rows, not 25 x 5).
// Worked out with a float reciprocal instead of integer division by a run-time G (~20 instructions each, and a
// thread needs a dozen at a work item's start and end): r + h0 < 256 and G <= 128, so (r + h0 + 0.5) / G lies at
// least 0.5 / G from an integer, far beyond the rounding of the product.
struct Rows {
  int G, h0;
  float inv;
  __device__ __forceinline__ Rows(int group, int head0) : G(group), h0(head0), inv(__frcp_rn((float)group)) {}
  __device__ __forceinline__ int token(int r) const { return __float2int_rz(((float)(r + h0) + 0.5f) * inv); }
  __device__ __forceinline__ int head(int r, int tok) const { return r + h0 - tok * G; }  // tok = token(r)
};

// This consumer's 64 query rows, in two halves: ``fetch_q`` loads them into registers (zeros for rows past the
// tile's tokens) at the CTA's start, before its barriers are set up, so the round trip to memory overlaps that and
// the producer's first page-table load; ``store_q`` writes them to shared memory (FP8: each row quantized to e4m3
// with its own scale, max |q| -> 448, as the Triton kernel does, its factor max |q| / 448 to ``q_scales``). Thread
// ct holds 16-byte chunk ct % 16 of rows ct / 16 + 8i: a row's 16 chunks are 16 lanes of one warp. Every load
// goes out before any is used (in the FP8 kernel each row's shuffles would otherwise wait for its load in turn).
__device__ __forceinline__ void fetch_q(const Params& p, const Rows& rows, uint4 (&v)[8], int cw, int ct, int q_row0,
                                        int n_tok, int kv_head) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int row = cw * WG_ROWS + (ct >> 4) + 8 * i, c = ct & 15;
    const int tok = rows.token(row);
    v[i] = make_uint4(0, 0, 0, 0);
    if (tok < n_tok)  // (rows past the sequence's last token fail it)
      v[i] = *reinterpret_cast<const uint4*>(p.q + (long long)(q_row0 + tok) * p.stride_qt +
                                             (long long)(kv_head * rows.G + rows.head(row, tok)) * p.stride_qh + c * 8);
  }
}

// bf16 Q and (staged) O: 16-byte chunk c of row r of a consumer's 64 at panel c / 8, chunk (c % 8) ^ (r % 8)
__device__ __forceinline__ u32 q_chunk(u32 q_smem, int r, int c) {
  return q_smem + (c >> 3) * (WG_ROWS * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

template <bool FP8>
__device__ __forceinline__ void store_q(const uint4 (&v)[8], u32 q_smem, float* q_scales, int cw, int ct) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = (ct >> 4) + 8 * i, c = ct & 15;
    if constexpr (FP8) {
      const float f[8] = {bf16_lo(v[i].x), bf16_hi(v[i].x), bf16_lo(v[i].y), bf16_hi(v[i].y),
                          bf16_lo(v[i].z), bf16_hi(v[i].z), bf16_lo(v[i].w), bf16_hi(v[i].w)};
      float amax = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(f[e]));
#pragma unroll
      for (int x = 1; x < 16; x <<= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, x));
      // a fast reciprocal and a product, not IEEE divisions: each of those took a slow-path call, and the calls
      // kept a thread's 8 rows' shuffle chains from overlapping (FP8's queries reached shared memory 6,250 cycles
      // after entry with them, bf16's 3,085). The two factors agree to a few ulp, far inside e4m3's rounding.
      const float q_max = fmaxf(amax, 1e-30f), mul = __fdividef(448.f, q_max);
      const u32 w0 = pack_e4m3(f[0] * mul, f[1] * mul, f[2] * mul, f[3] * mul);
      const u32 w1 = pack_e4m3(f[4] * mul, f[5] * mul, f[6] * mul, f[7] * mul);
      const u32 dst = q_smem + r * 128 + ((((c >> 1) ^ (r & 7)) << 4) | ((c & 1) << 3));
      asm volatile("st.shared.v2.u32 [%0], {%1, %2};" ::"r"(dst), "r"(w0), "r"(w1) : "memory");
      if (c == 0) q_scales[cw * WG_ROWS + r] = q_max * (1.f / 448.f);
    } else {
      st_shared16(q_chunk(q_smem, r, c), v[i]);
    }
  }
}

template <bool FP8>
__device__ __forceinline__ void prefill(const Params& p, const TensorMap* kmap, const TensorMap* vmap,
                                        unsigned char* smem_raw) {
  using L = Smem<FP8>;
  constexpr int NS = L::stages;
  constexpr int bn = BN<FP8>;
  const u32 raw = smem_u32(smem_raw);
  const u32 base = (raw + 1023) & ~1023u;
  const u32 kv0 = base + L::kv;
  const u32 full_bar = base + L::bars;      // [NS]: a tile has landed
  const u32 empty_bar = full_bar + 8 * NS;  // [NS]: both consumers are done with it
  float* q_scales = reinterpret_cast<float*>(smem_raw + (base - raw) + L::q_scales);

  const int tid = threadIdx.x;
  // broadcast so the compiler knows the role is warp-uniform (wgmma under a divergent branch is serialized)
  const int wg = __shfl_sync(FULL, tid >> 7, 0);
  const int tile = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z;
  if (tid == 0 && p.tma) {
    prefetch_map(kmap);
    if constexpr (FP8) prefetch_map(vmap);
  }
  const int4 item = p.tiles[tile];
  const int seq = item.x, q_row0 = item.y, first = item.z, n_tok = item.w & 0xffff;
  const Rows rows(p.group, item.w >> 16);
  uint4 q_regs[8];  // a consumer's queries, on their way while the barriers are set up
  if (wg > 0) fetch_q(p, rows, q_regs, wg - 1, tid - 128 * wg, q_row0, n_tok, kv_head);

  // keys this tile sees (queries at positions first..last), its split's share, and the interior tiles (every
  // query sees every key: no mask); the same arithmetic as the Triton kernel, with tiles of bn keys (segments and
  // reaches need not start on one: keys of a tile below lo are masked). The key tiles start at lo rounded down to
  // a tile (bf16) or to a TMA box of 64 keys (FP8): a chunk of 8,192 keys is no multiple of 192, and tiles from a
  // multiple of 192 spent a third of a tile an item (chunked, on average) on keys below the chunk, in an edge tile.
  const int last = first + n_tok - 1;
  const int hi = min(last + 1, p.seg_hi);
  const int lo = max(type_lo(first, p.kind, p.reach), p.seg_lo);
  constexpr int tile_align = FP8 ? 64 : bn;
  const int lo_tile = lo / tile_align * tile_align;
  const int num_tiles = (hi - lo_tile + bn - 1) / bn;
  const int per_split = (num_tiles + p.num_splits - 1) / p.num_splits;
  const int start = lo_tile + split * per_split * bn;
  const int end = min(start + per_split * bn, hi);
  const int n_iter = __shfl_sync(FULL, end > start ? (end - start + bn - 1) / bn : 0, 0);
  // (a segment's ends, multiples of 128 keys or a page, need not fall on a tile of 192: a tile across seg_lo or
  // end is masked, else it would take keys of the previous segment or past the split; tiles lie on lo_tile's grid)
  const int inner_lo =
      min(max(lo_tile + (max(type_lo(last, p.kind, p.reach), p.seg_lo) - lo_tile + bn - 1) / bn * bn, start), end);
  const int full_tiles = max(min(first + 1, end) - start, 0) / bn;
  const int inner_hi = max(start + full_tiles * bn, inner_lo);

  // the producer's page tables: lane i holds the i-th page a tile touches (FP8: and its row in V^T), for pages
  // that start before the tile's and the split's end (a power of two of 4+ tokens: a tile of 128 spans at most 32).
  // The first tile's go out before the barriers are set up; each next tile's while this one's copies go out,
  // keeping the table's latency off the critical path
  const int lane_id = tid & 31;
  const int bs = p.block_size, bs_log = __ffs(bs) - 1;  // pages of a power of two: shifts, not divisions
  const int* table = p.table + (long long)seq * p.stride_table;
  const int* vt_table = p.vt_table + (long long)seq * p.stride_table;
  auto page_of = [&](const int* t_, int t) {
    const int n = start + t * bn;
    const int i = (n >> bs_log) + lane_id;
    return (t < n_iter && (i << bs_log) < min(n + bn, end)) ? t_[i] : 0;
  };
  int pages = 0, vt_pages = 0;
  if (wg == 0) {
    pages = page_of(table, 0);
    if constexpr (FP8) vt_pages = page_of(vt_table, 0);
  }

  if (tid == 0) {
    for (int s = 0; s < NS; ++s) {
      mbar_init(full_bar + 8 * s, 128);   // every producer thread arrives (and a TMA tile's bytes land)
      mbar_init(empty_bar + 8 * s, 8);    // one arrival per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {
    // ---------------- producer: K/V tiles by TMA, edge tiles by page gathers ----------------
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(L::producer_regs));
    const int lane = lane_id;
    // TMA boxes of min(page, 128) rows (FP8: of 64 rows, so that none straddles a page in a tile of 192): bf16 per
    // tile 2 (K, V) x 2 panels x boxes_per_panel, one a lane
    const int box_rows = FP8 ? 64 : bs < bn ? bs : bn;
    const int boxes = bn / box_rows;
    for (int t = 0; t < n_iter; ++t) {
      const int next_pages = page_of(table, t + 1);
      const int next_vt_pages = FP8 ? page_of(vt_table, t + 1) : 0;
      const int s = t % NS;
      mbar_wait(empty_bar + 8 * s, ((t / NS) & 1) ^ 1);
      const int n = start + t * bn;
      const int first_page = n >> bs_log;
      const u32 stage = kv0 + s * L::stage_bytes;
      const u32 full = full_bar + 8 * s;
      const bool inside = n >= lo && n + bn <= end;
      if constexpr (FP8) {
        // K by TMA always (keys outside the reach get -inf scores, whatever their bytes); V^T by TMA inside the
        // reach, else loaded here with the bytes of keys outside [lo, end) zeroed (P is 0 there, but 0 x NaN is not)
        if (tid < 32) {
          const int i = lane < boxes ? lane : 0;
          const int kkey = n + i * box_rows;
          const int kpage = __shfl_sync(FULL, pages, (kkey >> bs_log) - first_page);
          const int panel = lane >= boxes && lane < boxes + bn / 64 ? lane - boxes : 0;  // of V^T
          const int vkey = n + 64 * panel;
          const int vpage = __shfl_sync(FULL, vt_pages, (vkey >> bs_log) - first_page);
          if (lane == 0) mbar_expect_tx(full, inside ? 2 * L::k_bytes : L::k_bytes);
          __syncwarp();
          if (lane < boxes)
            tma_load(stage + i * box_rows * 128, kmap, kv_head * D, kpage * p.rows_per_block + (kkey & (bs - 1)), full);
          if (inside && lane >= boxes && lane < boxes + bn / 64)
            tma_load(stage + L::k_bytes + panel * VT_PANEL, vmap, vpage * bs + (vkey & (bs - 1)), kv_head * D, full);
        }
        if (!inside) {
          const int r = tid;  // V^T row: element r of the head dim
          const u8* src = p.vt + (long long)(kv_head * D + r) * p.stride_vt;
#pragma unroll 1
          for (int c = 0; c < bn / 16; ++c) {
            const int key0 = n + 16 * c;
            const int vpage = __shfl_sync(FULL, vt_pages, (key0 >> bs_log) - first_page);
            uint4 v = make_uint4(0, 0, 0, 0);
            if (key0 + 16 > lo && key0 < end) {
              v = *reinterpret_cast<const uint4*>(src + (long long)vpage * bs + (key0 & (bs - 1)));
              v.x &= key_mask(key0, 0, lo, end);
              v.y &= key_mask(key0, 1, lo, end);
              v.z &= key_mask(key0, 2, lo, end);
              v.w &= key_mask(key0, 3, lo, end);
            }
            st_shared16(stage + L::k_bytes + (c >> 2) * VT_PANEL + r * 64 + (((c & 3) ^ ((r >> 1) & 3)) << 4), v);
          }
          fence_proxy_async();
        }
        mbar_arrive(full);
      } else if (p.tma && inside) {
        // the whole tile lies in the reach: its pages hold keys this tile may see, copied as they are
        if (tid < 32) {
          const int i = lane < 4 * boxes ? lane : 0;
          const int which = i / (2 * boxes), panel = (i / boxes) & 1, box = i % boxes;
          const int key = n + box * box_rows;
          const int page = __shfl_sync(FULL, pages, (key >> bs_log) - first_page);
          if (lane == 0) mbar_expect_tx(full, L::stage_bytes);
          __syncwarp();
          if (lane < 4 * boxes)
            tma_load(stage + which * L::k_bytes + panel * PANEL + box * box_rows * 128, kmap,
                     kv_head * D + panel * 64, page * p.rows_per_block + (key & (bs - 1)) + which * bs, full);
        }
        mbar_arrive(full);
      } else {
        // an edge tile: rows outside [lo, end) may be dropped blocks or NaN; zero-filled instead of read
        const int chunk = tid & 15;  // 16-byte chunk of a 256-byte row
        const int row0 = (tid >> 4) & 7;  // rows row0, row0 + 8, ...
        const u16* src = static_cast<const u16*>(p.cache) + (long long)kv_head * D + chunk * 8;
        const u32 k_dst = stage + (chunk >> 3) * PANEL + row0 * 128 + (((chunk & 7) ^ row0) << 4);
#pragma unroll
        for (int m = 0; m < bn / 8; ++m) {
          const int key = n + row0 + 8 * m;
          const bool ok = key >= lo && key < end;
          const int page = __shfl_sync(FULL, pages, (key >> bs_log) - first_page);
          const long long off = ok ? (long long)page * p.stride_block + (long long)(key & (bs - 1)) * p.stride_tok : 0;
          cp_async16(k_dst + m * 8 * 128, src + off, ok ? 16 : 0);
          cp_async16(k_dst + L::k_bytes + m * 8 * 128, src + off + p.v_offset, ok ? 16 : 0);
        }
        cp_async_arrive(full);
      }
      pages = next_pages;
      vt_pages = next_vt_pages;
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    return;
  }

  // ---------------- consumers ----------------
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(L::consumer_regs));
  const int cw = wg - 1;
  const int ct = tid - 128 * wg;
  const int warp = ct >> 5, lane = ct & 31;
  const u32 q_smem = base + cw * L::q_bytes;
  // where the epilogue stages O (FP8: the stage after the last tile's, once its last tile is released)
  const u32 o_smem = FP8 ? kv0 + (n_iter % NS) * L::stage_bytes + cw * (WG_ROWS * D * 2) : q_smem;
  store_q<FP8>(q_regs, q_smem, q_scales, cw, ct);
  fence_proxy_async();
  bar_sync(4 + cw, 128);

  // the two rows this thread holds in the accumulators, the keys each may see, and its score factor
  const int row_a = cw * WG_ROWS + warp * 16 + (lane >> 2);
  int row_lo[2], row_hi[2];
  float scale[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int pos = first + rows.token(row_a + 8 * h);
    row_lo[h] = max(type_lo(pos, p.kind, p.reach), lo);
    row_hi[h] = min(pos, end - 1);
    scale[h] = FP8 ? p.qk_scale * q_scales[row_a + 8 * h] : p.qk_scale;
  }

  constexpr bool PROMOTE = FP8 && FP8_PROMOTE;
  float o[64], s[S_REGS<FP8>], ot[64];
  float (&pv)[64] = PROMOTE ? ot : o;  // where P V lands
  u32 pf[P_REGS<FP8>];
  float m[2] = {-1e30f, -1e30f}, l[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  const u32 my_turn = 2 + cw, other_turn = 3 - cw;

  if (n_iter > 0) {
    float alpha[2], alpha_pv[2];  // the rescale of this tile's scores; of the tile whose P V is in flight
    if (cw == 1) give_turn(other_turn);  // consumer 0 goes first
    mbar_wait(full_bar, 0);
    fence_proxy_async();
    wait_turn(my_turn);
    wg_fence();
    qk_dot<FP8>(s, q_smem, kv0);
    wg_commit();
    give_turn(other_turn);
    wg_wait<0>();
    fence_regs(s);
    softmax_any<FP8>(s, m, l, alpha, row_lo, row_hi, start, lane, scale, start < inner_lo || start >= inner_hi);
    alpha_pv[0] = alpha[0], alpha_pv[1] = alpha[1];  // (O is 0 so far)
    pack_p<FP8>(s, pf);

    // phases t = 0 .. n_iter - 2: P_t V_t and Q K_{t+1}^T; the last phase P V alone (no wgmma sits under a
    // data-dependent branch: ptxas would serialize them)
    for (int t = 0; t + 1 < n_iter; ++t) {
      const int cur = t % NS, nxt = (t + 1) % NS;
      const int n = start + (t + 1) * bn;
      mbar_wait(full_bar + 8 * nxt, ((t + 1) / NS) & 1);
      fence_proxy_async();
      wait_turn(my_turn);
      wg_fence();
#if OVERLAP
      qk_dot<FP8>(s, q_smem, kv0 + nxt * L::stage_bytes);
      wg_commit();
      pv_dot<FP8>(pv, pf, kv0 + cur * L::stage_bytes + L::k_bytes);
      wg_commit();
      give_turn(other_turn);
      wg_wait<1>();  // the scores are in; P_t V_t may still run
      fence_regs(s);
      softmax_any<FP8>(s, m, l, alpha, row_lo, row_hi, n, lane, scale, n < inner_lo || n >= inner_hi);
      wg_wait<0>();
      fence_regs(pv);
#else
      pv_dot<FP8>(pv, pf, kv0 + cur * L::stage_bytes + L::k_bytes);
      qk_dot<FP8>(s, q_smem, kv0 + nxt * L::stage_bytes);
      wg_commit();
      give_turn(other_turn);
      wg_wait<0>();
      fence_regs(pv);
      fence_regs(s);
      softmax_any<FP8>(s, m, l, alpha, row_lo, row_hi, n, lane, scale, n < inner_lo || n >= inner_hi);
#endif
      __syncwarp();
      if (lane == 0) mbar_arrive(empty_bar + 8 * cur);
      if constexpr (PROMOTE) {
        update_o<true>(o, ot, alpha_pv);
        alpha_pv[0] = alpha[0], alpha_pv[1] = alpha[1];
      } else {
        update_o<false>(o, o, alpha);
      }
      // P is packed only after P_t V_t's wait, which alone keeps its registers: ptxas counts a dot's register A as
      // read when the dot is issued, and gave those registers to other values while the dot still read them when
      // the next P was packed early (the output was NaN)
      pack_p<FP8>(s, pf);
    }
    const int cur = (n_iter - 1) % NS;
    wait_turn(my_turn);
    wg_fence();
    pv_dot<FP8>(pv, pf, kv0 + cur * L::stage_bytes + L::k_bytes);
    wg_commit();
    // consumer 1's last phase needs this arrival; consumer 1's own last one has no taker
    if (cw == 0) give_turn(other_turn);
    wg_wait<0>();
    fence_regs(pv);
    if constexpr (PROMOTE) update_o<true>(o, ot, alpha_pv);
  }

  // ---------------- epilogue: normalise, or write this split's partial output and LSE ----------------
  // (rows past the tile's tokens skip the memory accesses, never the warp's shuffles and sync)
  const bool unsplit = p.num_splits == 1 && !p.segmented;
  if (unsplit) {
    // O goes through shared memory and out in whole 256-byte rows, 16 bytes a lane, as the queries came in: a
    // quarter of the store instructions of writing the accumulators' 4-byte pieces, 8 rows a warp, straight out
    // (H200, chunked(8192) 128K: the stores held a work item ~1.6 us of its ~57). bf16: through this consumer's
    // query tile (its last Q K^T is done: wgmma reads no more of it once every warp has waited). FP8, whose
    // query tile is half O's size: through the stage after the last tile's, 16 KB a consumer. It last held tile
    // n_iter - NS: once both consumers have released that tile (its phase of the stage's empty barrier), nothing
    // reads it. (With the turns the other consumer is within a phase of this one and has; without, it may not.)
    if (FP8 && n_iter >= NS) mbar_wait(empty_bar + 8 * (n_iter % NS), ((n_iter - NS) / NS) & 1);
    bar_sync(4 + cw, 128);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float inv = __fdividef(p.v_scale, fmaxf(quad_sum(l[h]), 1e-30f));
      const int r = warp * 16 + (lane >> 2) + 8 * h;
#pragma unroll
      for (int j = 0; j < 16; ++j)
        st_shared4(q_chunk(o_smem, r, j) + 4 * (lane & 3),
                   pack_bf16(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv));
    }
    bar_sync(4 + cw, 128);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = (ct >> 4) + 8 * i, c = ct & 15;
      const int row = cw * WG_ROWS + r, tok = rows.token(row);
      const uint4 v = ld_shared16(q_chunk(o_smem, r, c));
      if (tok < n_tok)
        st_global16(p.out + (long long)(q_row0 + tok) * p.stride_ot +
                    (long long)(kv_head * rows.G + rows.head(row, tok)) * p.stride_oh + c * 8, v);
    }
    return;
  }
  const float NEG_INF = __int_as_float(0xff800000);
  constexpr float BIAS = FP8 ? 8.f : 0.f;  // P's 2^8 (FP8), which the sum carries and the LSE must not
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float sum = quad_sum(l[h]);
    const int row = row_a + 8 * h;
    const int tok = rows.token(row);
    const bool valid = tok < n_tok;
    const long long t_idx = q_row0 + tok;
    const int head = kv_head * rows.G + rows.head(row, tok);
    const float inv = __fdividef(p.v_scale, fmaxf(sum, 1e-30f));
    const int col = 2 * (lane & 3);
    float* dst = p.part + split * p.stride_ps + t_idx * p.stride_pt + (long long)head * p.stride_ph + col;
    float* lse_at = p.lse + split * p.stride_ls + t_idx * p.stride_lt + head;
    float lse = sum > 0.f ? (m[h] - BIAS + lg2(sum)) * 0.6931471805599453f : NEG_INF;
    float w_prev = 0.f, w_new = 1.f;
    if (p.accumulate) {
      // merge with what the earlier segments left in this split's slots; the quad's four lanes read the old LSE
      // before the first of them writes the new one
      const float prev_lse = valid ? *lse_at : NEG_INF;
      __syncwarp();
      float mx = fmaxf(prev_lse, lse);
      mx = mx > NEG_INF ? mx : 0.f;
      w_prev = __expf(prev_lse - mx);
      w_new = __expf(lse - mx);
      const float total = w_prev + w_new;
      lse = total > 0.f ? mx + __logf(fmaxf(total, 1e-30f)) : NEG_INF;
      w_prev /= fmaxf(total, 1e-30f);
      w_new /= fmaxf(total, 1e-30f);
    }
    if (valid) {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        float2 v = make_float2(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv);
        if (p.accumulate) {
          const float2 prev = *reinterpret_cast<const float2*>(dst + 8 * j);
          v = make_float2(prev.x * w_prev + v.x * w_new, prev.y * w_prev + v.y * w_new);
        }
        *reinterpret_cast<float2*>(dst + 8 * j) = v;
      }
      if ((lane & 3) == 0) *lse_at = lse;
    }
  }
}

extern "C" __global__ void __launch_bounds__(384, 1) paged_prefill_hopper(const Params p,
                                                                        const __grid_constant__ TensorMap kmap) {
  extern __shared__ unsigned char smem_raw[];
  prefill<false>(p, &kmap, &kmap, smem_raw);
}

extern "C" __global__ void __launch_bounds__(384, 1) paged_prefill_hopper_fp8(const Params p,
                                                                            const __grid_constant__ TensorMap kmap,
                                                                            const __grid_constant__ TensorMap vmap) {
  extern __shared__ unsigned char smem_raw[];
  prefill<true>(p, &kmap, &vmap, smem_raw);
}
