// Paged hybrid attention prefill for Hopper (sm_90a), FlashAttention-3 style, compiled at run time by NVRTC.
//
// One CTA computes one query tile (128 rows: the query heads of one KV head stacked per token, as in the Triton
// kernel) over the keys [start, end) of its KV split, in key tiles of 128. Three warpgroups:
//   producer  (warpgroup 0): brings each K and V tile into 128-byte-swizzled shared memory, STAGES tiles ahead,
//             landing on an mbarrier. A tile inside the reach comes by TMA, one box per page and 64-column panel
//             (a warp's lanes issue them); an edge tile, whose rows outside [lo, end) may be dropped blocks or
//             NaN, is gathered row by row with cp.async, zero-filling those rows.
//   consumers (warpgroups 1, 2): 64 query rows each. S = Q K^T and O += P V are wgmma (m64n128k16, bf16 in,
//             float32 accumulators); P goes from the S registers straight into the second dot's A operand.
//             Q K_{t+1}^T is issued before P_t V_t and the softmax of tile t+1 runs while P_t V_t does (OVERLAP);
//             named barriers make the two consumers take turns at the tensor cores (PINGPONG).
// setmaxnreg moves registers from the producer to the consumers.
//
// Shared memory (1024-aligned): Q [2 consumers][2 panels of 64 columns][64 rows x 128 B], then per stage K and V
// [2 panels][128 rows x 128 B]; 16-byte chunk c of row r sits at chunk c ^ (r % 8), the layout of wgmma's and
// TMA's 128-byte swizzle. A key tile's rows are keys: the same bytes serve as Q K^T's B (K-major) and, transposed,
// as P V's B (MN-major).
//
// ``benchmarks/gpu/hopper_kernel.py`` times the compile-time switches and what each stage costs.

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;

#ifndef STAGES
#define STAGES 3
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

constexpr int D = 128;        // head dim
constexpr int BN = 128;       // keys per tile
constexpr int WG_ROWS = 64;   // query rows per consumer warpgroup
constexpr u32 Q_BYTES = WG_ROWS * D * 2;          // 16 KB per consumer
constexpr u32 PANEL = BN * 128;                   // one 64-column panel of a key tile: 16 KB
constexpr u32 KV_BYTES = 2 * PANEL;               // K (or V) tile: 32 KB
constexpr u32 STAGE_BYTES = 2 * KV_BYTES;         // K then V
constexpr u32 BAR_OFFSET = 2 * Q_BYTES + STAGES * STAGE_BYTES;

struct Params {
  const u16* q;
  u16* out;
  float* part;
  float* lse;
  const u16* cache;  // the layer's first element
  const int* table;
  const int* tile_seq;
  const int* tile_q0;
  const int* q_loc;
  const int* q_len;
  const int* ctx_len;
  long long stride_qt, stride_qh, stride_ot, stride_oh, stride_table;
  long long stride_block, stride_tok, v_offset;
  long long stride_ps, stride_pt, stride_ph, stride_ls, stride_lt;
  float qk_scale;  // softmax scale x k_scale x log2(e)
  float v_scale;
  int kind;        // 0 full, 1 sliding, 2 chunked
  int reach;       // window or chunk (1 for full)
  int block_size;  // tokens per page
  int group;       // query heads per KV head
  int tokens;      // query tokens per tile
  int num_splits;
  int seg_lo, seg_hi;  // keys [seg_lo, seg_hi) only: one segment of an FP8 cache's reach, widened to bf16
  int segmented;       // always write partial outputs and LSE (``accumulate``: merged into the previous segment's)
  int accumulate;
  int tma;             // 1: ``tmap`` describes the cache's token rows, tiles inside the reach arrive by TMA
  int rows_per_block;  // token rows of a page in ``tmap``: its K rows, then its V rows
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
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// one TMA box (64 columns x some rows of the cache's token rows) into swizzled shared memory
__device__ __forceinline__ void tma_load(u32 dst, const TensorMap* map, int col, int row, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      ::"r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(col), "r"(row), "r"(bar) : "memory");
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
__device__ __forceinline__ void fence_regs(float (&d)[64]) {
  // keeps the compiler from reading accumulators before the wait that completes them
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
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
// wgmma shared-memory descriptor, 128-byte swizzle. K-major operands: rows 128 B apart, 8-row groups
// ``sbo`` = 1024 B apart (``lbo`` unused). MN-major (V as P V's B): ``lbo`` = bytes between 64-column panels.
__device__ __forceinline__ u64 smem_desc(u32 addr, u32 lbo, u32 sbo) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((lbo & 0x3FFFF) >> 4) << 16) | ((u64)((sbo & 0x3FFFF) >> 4) << 32) |
         (1ull << 62);
}
__device__ __forceinline__ void wgmma_ss(float (&d)[64], u64 a, u64 b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a), "l"(b), "r"(scale_d));
}

__device__ __forceinline__ void wgmma_rs_tb(float (&d)[64], u32 a0, u32 a1, u32 a2, u32 a3, u64 b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b), "r"(1));
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

// S = Q K^T over the head dim: 8 steps of 16 (4 per 64-column panel, 32 bytes apart inside the swizzle)
__device__ __forceinline__ void qk_dot(float (&s)[64], u32 q_smem, u32 k_smem) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const u64 a = smem_desc(q_smem + (kk >> 2) * (WG_ROWS * 128) + (kk & 3) * 32, 16, 1024);
    const u64 b = smem_desc(k_smem + (kk >> 2) * PANEL + (kk & 3) * 32, 16, 1024);
    wgmma_ss(s, a, b, kk > 0);
  }
}

// O += P V over the tile's keys: 8 steps of 16 keys (2 KB of rows each); V is the MN-major B (transposed)
__device__ __forceinline__ void pv_dot(float (&o)[64], const u32 (&p)[32], u32 v_smem) {
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    const u64 b = smem_desc(v_smem + kk * 16 * 128, PANEL, 1024);
    wgmma_rs_tb(o, p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3], b);
  }
}

// Online softmax of one S tile (keys n..n+127) in the wgmma accumulator layout: s[4j + 2h + e] is row
// (lane / 4 + 8h) of this warp's 16, column 8j + 2 (lane % 4) + e. Part one (``softmax_scores``) turns s into the
// tile's weights in place and updates the running max and sum; part two (``rescale_pack``) rescales O, which must
// be complete by then, and packs P (bf16) in the layout of the next dot's A fragments: p[4kk + i] packs
// s[8kk + 2i], s[8kk + 2i + 1].
template <bool MASKED>
__device__ __forceinline__ void softmax_scores(float (&s)[64], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                               const int (&row_lo)[2], const int (&row_hi)[2], int n, int lane,
                                               float scale) {
  const float NEG_INF = __int_as_float(0xff800000);
  float m_new[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = NEG_INF;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float x = s[4 * j + 2 * h + e];
        if (MASKED) {
          const int key = n + 8 * j + 2 * (lane & 3) + e;
          x = (key >= row_lo[h] && key <= row_hi[h]) ? x * scale : NEG_INF;
          s[4 * j + 2 * h + e] = x;
        }
        mx = fmaxf(mx, x);
      }
    }
    mx = quad_max(mx);
    // scale > 0: the max of the scaled scores is the scaled max
    m_new[h] = fmaxf(m[h], MASKED ? mx : mx * scale);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    alpha[h] = ex2(m[h] - m_new[h]);
    m[h] = m_new[h];
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int i = 4 * j + 2 * h + e;
        const float x = MASKED ? ex2(s[i] - m[h]) : ex2(fmaf(s[i], scale, -m[h]));
        s[i] = x;
        sum += x;
      }
    }
    l[h] = l[h] * alpha[h] + sum;  // this thread's columns only: the quad adds its four at the end
  }
}

__device__ __forceinline__ void rescale_pack(const float (&s)[64], float (&o)[64], u32 (&p)[32],
                                             const float (&alpha)[2]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] *= alpha[(i >> 1) & 1];
#pragma unroll
  for (int i = 0; i < 32; ++i) p[i] = pack_bf16(s[2 * i], s[2 * i + 1]);
}

__device__ __forceinline__ void softmax_any(float (&s)[64], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                            const int (&row_lo)[2], const int (&row_hi)[2], int n, int lane,
                                            float scale, bool masked) {
  if (masked)
    softmax_scores<true>(s, m, l, alpha, row_lo, row_hi, n, lane, scale);
  else
    softmax_scores<false>(s, m, l, alpha, row_lo, row_hi, n, lane, scale);
}

extern "C" __global__ void __launch_bounds__(384, 1) paged_prefill_hopper(const Params p,
                                                                        const __grid_constant__ TensorMap tmap) {
  extern __shared__ unsigned char smem_raw[];
  const u32 base = (smem_u32(smem_raw) + 1023) & ~1023u;
  const u32 full_bar = base + BAR_OFFSET;   // [STAGES]: a tile has landed
  const u32 empty_bar = full_bar + 8 * STAGES;  // [STAGES]: both consumers are done with it

  const int tid = threadIdx.x;
  // broadcast so the compiler knows the role is warp-uniform (wgmma under a divergent branch is serialized)
  const int wg = __shfl_sync(0xffffffff, tid >> 7, 0);
  const int tile = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z;
  const int seq = p.tile_seq[tile], q0 = p.tile_q0[tile];
  const int q_loc = p.q_loc[seq], q_len = p.q_len[seq], ctx = p.ctx_len[seq];
  const int G = p.group;

  // keys this tile sees, its split's share, and the interior tiles (every query sees every key: no mask);
  // the same arithmetic as the Triton kernel, with 128-key tiles
  const int first = ctx + q0;
  const int last = ctx + min(q0 + p.tokens, q_len) - 1;
  const int hi = min(last + 1, p.seg_hi);
  const int lo = max(type_lo(first, p.kind, p.reach), p.seg_lo);
  const int lo_tile = lo / BN * BN;
  const int num_tiles = (hi - lo_tile + BN - 1) / BN;
  const int per_split = (num_tiles + p.num_splits - 1) / p.num_splits;
  const int start = lo_tile + split * per_split * BN;
  const int end = min(start + per_split * BN, hi);
  const int n_iter = __shfl_sync(0xffffffff, end > start ? (end - start + BN - 1) / BN : 0, 0);
  const int inner_lo = min(max((type_lo(last, p.kind, p.reach) + BN - 1) / BN * BN, start), end);
  const int full_tiles = first + 1 - start > 0 ? (first + 1 - start) / BN : 0;
  const int inner_hi = max(min(start + full_tiles * BN, end), inner_lo);

  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full_bar + 8 * s, 128);   // every producer thread arrives (and a TMA tile's bytes land)
      mbar_init(empty_bar + 8 * s, 8);    // one arrival per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {
    // ---------------- producer: K/V tiles by TMA, edge tiles by page gathers ----------------
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    const int chunk = tid & 15;  // 16-byte chunk of a 256-byte row
    const int row0 = (tid >> 4) & 7;  // rows row0, row0 + 8, ...
    const int lane = tid & 31;
    const int bs = p.block_size;
    const int* table = p.table + (long long)seq * p.stride_table;
    const u16* src_base = p.cache + (long long)kv_head * D + chunk * 8;
    const u32 dst_base = (chunk >> 3) * PANEL + row0 * 128 + (((chunk & 7) ^ row0) << 4);
    // a tile (aligned to 128 keys, pages a power of two) spans 128 / bs pages, or one: lane i holds the i-th;
    // loading the next tile's while this one's copies go out keeps the table's latency off the critical path
    const int tile_pages = bs >= BN ? 1 : BN / bs;
    auto page_of = [&](int t) {
      const int first_page = (start + t * BN) / bs;
      const int i = first_page + lane;
      return (t < n_iter && lane < tile_pages && i * bs < end) ? table[i] : 0;
    };
    int pages = page_of(0);
    // TMA boxes: 64 columns x min(page, 128) rows; per tile 2 (K, V) x 2 panels x boxes_per_panel, one a lane
    const int box_rows = bs < BN ? bs : BN;
    const int boxes = BN / box_rows;
    for (int t = 0; t < n_iter; ++t) {
      const int next_pages = page_of(t + 1);
      const int s = t % STAGES;
      mbar_wait(empty_bar + 8 * s, ((t / STAGES) & 1) ^ 1);
      const int n = start + t * BN;
      const int first_page = n / bs;
      const u32 stage = base + 2 * Q_BYTES + s * STAGE_BYTES;
      if (p.tma && n >= lo && n + BN <= end) {
        // the whole tile lies in the reach: its pages hold keys this tile may see, copied as they are
        if (tid < 32) {
          const int i = lane < 4 * boxes ? lane : 0;
          const int which = i / (2 * boxes), panel = (i / boxes) & 1, box = i % boxes;
          const int key = n + box * box_rows;
          const int page = __shfl_sync(0xffffffff, pages, key / bs - first_page);
          if (lane == 0) mbar_arrive_expect_tx(full_bar + 8 * s, STAGE_BYTES);
          __syncwarp();
          if (lane < 4 * boxes)
            tma_load(stage + which * KV_BYTES + panel * PANEL + box * box_rows * 128, &tmap,
                     kv_head * D + panel * 64, page * p.rows_per_block + key % bs + which * bs, full_bar + 8 * s);
          if (lane != 0) mbar_arrive(full_bar + 8 * s);
        } else {
          mbar_arrive(full_bar + 8 * s);
        }
      } else {
        // an edge tile: rows outside [lo, end) may be dropped blocks or NaN; zero-filled instead of read
        const u32 k_dst = stage + dst_base;
#pragma unroll
        for (int m = 0; m < BN / 8; ++m) {
          const int key = n + row0 + 8 * m;
          const bool ok = key >= lo && key < end;
          const int page = __shfl_sync(0xffffffff, pages, key / bs - first_page);
          const long long off = ok ? (long long)page * p.stride_block + (long long)(key % bs) * p.stride_tok : 0;
          cp_async16(k_dst + m * 8 * 128, src_base + off, ok ? 16 : 0);
          cp_async16(k_dst + KV_BYTES + m * 8 * 128, src_base + off + p.v_offset, ok ? 16 : 0);
        }
        cp_async_arrive(full_bar + 8 * s);
      }
      pages = next_pages;
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    return;
  }

  // ---------------- consumers ----------------
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int cw = wg - 1;
  const int ct = tid - 128 * wg;
  const int warp = ct >> 5, lane = ct & 31;
  const u32 q_smem = base + cw * Q_BYTES;

  // this consumer's 64 query rows into shared memory (zeros for rows past the tile's tokens)
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int idx = ct + 128 * i;
    const int r = idx >> 4, c = idx & 15;
    const int row = cw * WG_ROWS + r;
    const int tok = q0 + row / G;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row < p.tokens * G && tok < q_len)
      v = *reinterpret_cast<const uint4*>(p.q + (long long)(q_loc + tok) * p.stride_qt +
                                          (long long)(kv_head * G + row % G) * p.stride_qh + c * 8);
    const u32 dst = q_smem + (c >> 3) * (WG_ROWS * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4);
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
  }
  fence_proxy_async();
  bar_sync(4 + cw, 128);

  // the two rows this thread holds in the accumulators, and the keys each may see
  const int row_a = cw * WG_ROWS + warp * 16 + (lane >> 2);
  int row_lo[2], row_hi[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int pos = ctx + q0 + (row_a + 8 * h) / G;
    row_lo[h] = max(type_lo(pos, p.kind, p.reach), lo);
    row_hi[h] = min(pos, end - 1);
  }

  float o[64], s[64];
  u32 pf[32];
  float m[2] = {-1e30f, -1e30f}, l[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  const float scale = p.qk_scale;
  const u32 my_turn = 2 + cw, other_turn = 3 - cw;

  if (n_iter > 0) {
    float alpha[2];
    if (cw == 1) give_turn(other_turn);  // consumer 0 goes first
    mbar_wait(full_bar, 0);
    fence_proxy_async();
    wait_turn(my_turn);
    wg_fence();
    qk_dot(s, q_smem, base + 2 * Q_BYTES);
    wg_commit();
    give_turn(other_turn);
    wg_wait<0>();
    fence_regs(s);
    softmax_any(s, m, l, alpha, row_lo, row_hi, start, lane, scale, start < inner_lo || start >= inner_hi);
    rescale_pack(s, o, pf, alpha);

    // phases t = 0 .. n_iter - 2: P_t V_t and Q K_{t+1}^T; the last phase P V alone (no wgmma sits under a
    // data-dependent branch: ptxas would serialize them)
    for (int t = 0; t + 1 < n_iter; ++t) {
      const int cur = t % STAGES, nxt = (t + 1) % STAGES;
      const int n = start + (t + 1) * BN;
      mbar_wait(full_bar + 8 * nxt, ((t + 1) / STAGES) & 1);
      fence_proxy_async();
      wait_turn(my_turn);
      wg_fence();
#if OVERLAP
      qk_dot(s, q_smem, base + 2 * Q_BYTES + nxt * STAGE_BYTES);
      wg_commit();
      pv_dot(o, pf, base + 2 * Q_BYTES + cur * STAGE_BYTES + KV_BYTES);
      wg_commit();
      give_turn(other_turn);
      wg_wait<1>();  // the scores are in; P_t V_t may still run
      fence_regs(s);
      softmax_any(s, m, l, alpha, row_lo, row_hi, n, lane, scale, n < inner_lo || n >= inner_hi);
      wg_wait<0>();
      fence_regs(o);
#else
      pv_dot(o, pf, base + 2 * Q_BYTES + cur * STAGE_BYTES + KV_BYTES);
      qk_dot(s, q_smem, base + 2 * Q_BYTES + nxt * STAGE_BYTES);
      wg_commit();
      give_turn(other_turn);
      wg_wait<0>();
      fence_regs(o);
      fence_regs(s);
      softmax_any(s, m, l, alpha, row_lo, row_hi, n, lane, scale, n < inner_lo || n >= inner_hi);
#endif
      __syncwarp();
      if (lane == 0) mbar_arrive(empty_bar + 8 * cur);
      rescale_pack(s, o, pf, alpha);
    }
    const int cur = (n_iter - 1) % STAGES;
    wait_turn(my_turn);
    wg_fence();
    pv_dot(o, pf, base + 2 * Q_BYTES + cur * STAGE_BYTES + KV_BYTES);
    wg_commit();
    // consumer 1's last phase needs this arrival; consumer 1's own last one has no taker
    if (cw == 0) give_turn(other_turn);
    wg_wait<0>();
    fence_regs(o);
  }

  // ---------------- epilogue: normalise, or write this split's partial output and LSE ----------------
  // (rows past the tile's tokens skip the memory accesses, never the warp's shuffles and sync)
  const float NEG_INF = __int_as_float(0xff800000);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float sum = quad_sum(l[h]);
    const int row = row_a + 8 * h;
    const int tok = q0 + row / G;
    const bool valid = row < p.tokens * G && tok < q_len;
    const long long t_idx = q_loc + tok;
    const int head = kv_head * G + row % G;
    const float inv = p.v_scale / fmaxf(sum, 1e-30f);
    const int col = 2 * (lane & 3);
    if (p.num_splits == 1 && !p.segmented) {
      u16* dst = p.out + t_idx * p.stride_ot + (long long)head * p.stride_oh + col;
      if (valid) {
#pragma unroll
        for (int j = 0; j < 16; ++j)
          *reinterpret_cast<u32*>(dst + 8 * j) = pack_bf16(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv);
      }
      continue;
    }
    float* dst = p.part + split * p.stride_ps + t_idx * p.stride_pt + (long long)head * p.stride_ph + col;
    float* lse_at = p.lse + split * p.stride_ls + t_idx * p.stride_lt + head;
    float lse = sum > 0.f ? (m[h] + lg2(sum)) * 0.6931471805599453f : NEG_INF;
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
