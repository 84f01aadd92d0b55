/* A prompt's attention on CPU (AVX-512): one sequence's query rows over its keys in the paged cache, causal, each row
 * seeing keys first[t] .. its own position (full, sliding and chunked layers alike), all in float32.
 *
 * Why: an 8,000-token prompt of SmolLM2-135M spends most of its time in attention (~2.2 TFLOP), which torch's CPU
 * flash kernel runs at ~70 GFLOP/s a Zen 4 core. Here a key block's K is laid out once per call so that one
 * 64-byte load holds 16 keys' value of one dim: a query's dim broadcast then makes 16 scores' partial sums in one
 * FMA, 6 query rows x 64 keys stay in 24 registers, and no score needs a horizontal sum. The weights times V go
 * the same way with V's rows as they lie in the cache. (bf16 weights or scores through vdpbf16ps, twice the
 * multiply-adds an instruction, moved a test chat's greedy reply off float32's: benchmarks/cpu.py --error.)
 *
 * Same row, same numbers: a row (query token t, head h) is computed over key blocks at fixed positions [64 b,
 * 64 b + 64), in block order, with an online softmax whose arithmetic is the row's alone (the lanes of a vector
 * hold one row's keys or output dims; sums run in fixed orders). A block a row does not see leaves its state as it
 * was (weights 0, rescale 1). So a row's output depends neither on the other rows of the call, nor on how a prompt
 * is cut into chunks, a prefix cache hit or the thread count (units of rows go to threads whole).
 *
 * Layouts: K, per KV head and key block, [4 groups of 16 keys][D][16 keys]; Q, [KV head][token][query head of
 * the group][D]. Key positions of a block outside the sequence's keys read as zero and are masked.
 *
 * E.g. first = [0, 0, 0], query tokens at positions 62..64: token 62 reads block 0 (keys 0..62 visible), token 64
 * reads block 0 whole and key 64 of block 1. */
#include "q4_1_cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define KEYS 64   /* a key block */
#define ROWS 6    /* query rows whose scores and outputs stay in registers at once (6 x 4 accumulators) */
#define TOKENS 32 /* query tokens of a unit of work (times the query heads of a KV head: its rows) */

typedef struct {
    const float *q;       /* [T][Hq][D], the query tokens at positions pos0 .. pos0 + T - 1 */
    const float *k, *v;   /* the paged cache's K and V of the layer: element strides sb (block), ss (slot), sh (head) */
    const int64_t *pages; /* the sequence's pages in position order, the first holding position base */
    float *out;           /* [T][Hq][D] */
    const int64_t *first; /* [T] each query token's first visible key position (non-decreasing, >= key0) */
    int64_t T, Hq, Hkv, D, pos0, key0, base, page_size, sb, ss, sh; /* keys: positions key0 .. pos0 + T - 1 */
    int64_t per, b0, nb, page_shift; /* query heads a KV head; key blocks; page_size = 2^page_shift */
    float scale;
    float *qp, *kp;      /* the packs above */
    const float **vrows; /* [Hkv][nb * 64] each key position's V row in the cache (or zeros) */
} prompt_attn;

static const float zeros[PROMPT_ATTENTION_MAX_D];

/* the cache row of KV head g's key or value at position pos (zeros outside the sequence's keys) */
static inline const float *key_row(const prompt_attn *a, const float *cache, int64_t g, int64_t pos) {
    if (pos < a->key0 || pos >= a->pos0 + a->T) return zeros;
    const int64_t at = pos - a->base;
    return cache + a->pages[at >> a->page_shift] * a->sb + (at & (a->page_size - 1)) * a->ss + g * a->sh;
}

/* KV head g's key block b into its pack, and its V rows' addresses into vrows (every unit of rows reads both) */
static void pack_keys(const prompt_attn *a, int64_t g, int64_t b) {
    const int64_t D = a->D;
    float *kp = a->kp + (g * a->nb + b - a->b0) * KEYS * D;
    const float **vrows = a->vrows + (g * a->nb + b - a->b0) * KEYS;
    for (int64_t i = 0; i < KEYS; i++) {
        const float *k = key_row(a, a->k, g, b * KEYS + i);
        vrows[i] = key_row(a, a->v, g, b * KEYS + i);
        for (int64_t d = 0; d < D; d++) kp[(i / 16 * D + d) * 16 + i % 16] = k[d];
    }
}

static void pack_queries(const prompt_attn *a, int64_t t) {
    const int64_t D = a->D;
    for (int64_t h = 0; h < a->Hq; h++)
        memcpy(a->qp + ((h / a->per * a->T + t) * a->per + h % a->per) * D, a->q + (t * a->Hq + h) * D,
               D * sizeof(float));
}

#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_AVX512 1
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f")

/* S[r][j] = q_r . k_j for ROWS rows and the block's 64 keys (FMAs in dim order) */
static inline void scores(const float *const q[ROWS], const float *kb, int64_t D, float S[ROWS][KEYS]) {
    __m512 acc[ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        __m512 k[4];
        for (int j = 0; j < 4; j++) k[j] = _mm512_loadu_ps(kb + (j * D + d) * 16);
        for (int r = 0; r < ROWS; r++) {
            const __m512 qv = _mm512_set1_ps(q[r][d]);
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_fmadd_ps(k[j], qv, acc[r][j]);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(S[r] + 16 * j, acc[r][j]);
}

/* O[r] := O[r] alpha[r] + sum_i P[r][i] v_i for ROWS rows over the block's keys i (in key order), 64 dims at a time */
static inline void weighted_values(const float *const v[KEYS], const float P[ROWS][KEYS], const float alpha[ROWS],
                                   float *const O[ROWS], int64_t D) {
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        __m512 acc[ROWS][4];
        for (int r = 0; r < ROWS; r++)
            for (int j = 0; j < 4; j++)
                acc[r][j] = _mm512_mul_ps(_mm512_loadu_ps(O[r] + d0 + 16 * j), _mm512_set1_ps(alpha[r]));
        for (int64_t i = 0; i < KEYS; i++) {
            __m512 x[4];
            for (int j = 0; j < 4; j++) x[j] = _mm512_loadu_ps(v[i] + d0 + 16 * j);
            for (int r = 0; r < ROWS; r++) {
                const __m512 p = _mm512_set1_ps(P[r][i]);
                for (int j = 0; j < 4; j++) acc[r][j] = _mm512_fmadd_ps(x[j], p, acc[r][j]);
            }
        }
        for (int r = 0; r < ROWS; r++)
            for (int j = 0; j < 4; j++) _mm512_storeu_ps(O[r] + d0 + 16 * j, acc[r][j]);
    }
}

/* e^x lane by lane (x <= 0 here), ~1 ulp: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts), e^r by its Taylor
 * series to r^7, times 2^n by vscalefps (0 below the float range) */
static inline __m512 exp_lanes(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    static const float taylor[] = {1.f / 5040.f, 1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};
    __m512 p = _mm512_set1_ps(taylor[0]);
    for (int i = 1; i < 8; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(taylor[i]));
    return _mm512_scalef_ps(p, n);
}

/* the lanes [lo - 16 j, hi - 16 j] of vector j of a block's 64 keys */
static inline __mmask16 seen_lanes(int64_t lo, int64_t hi, int j) {
    const int64_t a = lo - 16 * j, b = hi - 16 * j + 1; /* lanes [a, b) */
    const uint32_t below_b = b >= 16 ? 0xffffu : b <= 0 ? 0u : (1u << b) - 1u;
    const uint32_t from_a = a <= 0 ? 0xffffu : a >= 16 ? 0u : ~((1u << a) - 1u);
    return (__mmask16)(below_b & from_a);
}

/* One row's online softmax over a block it sees (keys lo..hi of it visible): its maximum m and lane sums l move
 * on; P its weights, alpha the rescale of its output so far */
static inline void softmax(const float *s, int64_t lo, int64_t hi, float scale, float *m, __m512 *l, float *P,
                           float *alpha) {
    __m512 x[4];
    __mmask16 seen[4];
    for (int j = 0; j < 4; j++) {
        seen[j] = seen_lanes(lo, hi, j);
        x[j] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), seen[j], _mm512_loadu_ps(s + 16 * j),
                                  _mm512_set1_ps(scale));
    }
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3])));
    const float m_new = *m > top ? *m : top;
    *alpha = *m == -INFINITY ? 0.f : _mm512_cvtss_f32(exp_lanes(_mm512_set1_ps(*m - m_new)));
    *m = m_new;
    __m512 w[4];
    for (int j = 0; j < 4; j++) {
        w[j] = _mm512_maskz_mov_ps(seen[j], exp_lanes(_mm512_sub_ps(x[j], _mm512_set1_ps(m_new))));
        _mm512_storeu_ps(P + 16 * j, w[j]);
    }
    *l = _mm512_add_ps(_mm512_mul_ps(*l, _mm512_set1_ps(*alpha)),
                       _mm512_add_ps(_mm512_add_ps(w[0], w[1]), _mm512_add_ps(w[2], w[3])));
}

/* the 16 lanes' sum in a fixed order */
static inline float sum_lanes(__m512 v) {
    float x[16], total = 0.f;
    _mm512_storeu_ps(x, v);
    for (int i = 0; i < 16; i++) total += x[i];
    return total;
}

/* The rows of KV head g's query tokens t0 .. t1 - 1 over every key block they see. scratch: unit_floats(a) */
static void unit(const prompt_attn *a, int64_t g, int64_t t0, int64_t t1, float *scratch) {
    const int64_t D = a->D, per = a->per, n = (t1 - t0) * per;
    float *O = scratch, *spare = O + n * D, *m = spare + D; /* spare: the output row of rows past the end */
    __m512 *l = (__m512 *)(m + n + (-n & 15));              /* 64-byte aligned after m */
    float S[ROWS][KEYS], P[ROWS][KEYS], alpha[ROWS];
    memset(O, 0, (size_t)n * D * sizeof(float));
    for (int64_t r = 0; r < n; r++) m[r] = -INFINITY, l[r] = _mm512_setzero_ps();
    const float *q = a->qp + (g * a->T + t0) * per * D;
    const int64_t b_first = a->first[t0] / KEYS, b_last = (a->pos0 + t1 - 1) / KEYS;
    for (int64_t b = b_first; b <= b_last; b++) {
        const float *kb = a->kp + (g * a->nb + b - a->b0) * KEYS * D;
        const float *const *v = a->vrows + (g * a->nb + b - a->b0) * KEYS;
        for (int64_t r0 = 0; r0 < n; r0 += ROWS) {
            const float *qr[ROWS];
            float *Or[ROWS];
            int64_t lo[ROWS], hi[ROWS];
            int any = 0;
            for (int r = 0; r < ROWS; r++) {
                const int64_t row = r0 + r < n ? r0 + r : r0, t = t0 + row / per; /* past the end: row r0's query */
                qr[r] = q + row * D, Or[r] = r0 + r < n ? O + row * D : spare;
                lo[r] = a->first[t] - b * KEYS, hi[r] = a->pos0 + t - b * KEYS; /* visible keys of the block */
                lo[r] = lo[r] < 0 ? 0 : lo[r], hi[r] = hi[r] > KEYS - 1 ? KEYS - 1 : hi[r];
                any |= r0 + r < n && lo[r] <= hi[r];
            }
            if (!any) continue;
            scores(qr, kb, D, S);
            for (int r = 0; r < ROWS; r++) {
                if (r0 + r < n && lo[r] <= hi[r]) {
                    softmax(S[r], lo[r], hi[r], a->scale, m + r0 + r, l + r0 + r, P[r], alpha + r);
                } else { /* as it was: no weight, no rescale */
                    memset(P[r], 0, sizeof P[r]);
                    alpha[r] = 1.f;
                }
            }
            weighted_values(v, (const float(*)[KEYS])P, alpha, Or, D);
        }
    }
    for (int64_t row = 0; row < n; row++) {
        const int64_t t = t0 + row / per, h = g * per + row % per;
        const __m512 total = _mm512_set1_ps(sum_lanes(l[row]));
        float *out = a->out + (t * a->Hq + h) * D;
        for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(out + d, _mm512_div_ps(_mm512_loadu_ps(O + row * D + d), total));
    }
}
#pragma GCC pop_options
#endif

static size_t unit_floats(const prompt_attn *a) {
    const int64_t n = TOKENS * a->per;
    return (size_t)((n + 1) * a->D + n + 16 + n * 16);
}

int q41_prompt_attention_supported(void) {
#ifdef HAVE_AVX512
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
#else
    return 0;
#endif
}

/* 0; -1 for bad sizes or a CPU without AVX-512; -2 when out of memory */
static int prompt_attention(prompt_attn *a, int threads) {
    if (!q41_prompt_attention_supported() || threads < 1 || a->T < 1 || a->Hkv < 1 || a->Hq % a->Hkv ||
        a->D % 64 || a->D > PROMPT_ATTENTION_MAX_D || a->key0 < a->base || a->key0 > a->pos0 || a->first[0] < a->key0 ||
        a->page_size < 1 || a->page_size & (a->page_size - 1))
        return -1;
#ifdef HAVE_AVX512
    a->per = a->Hq / a->Hkv, a->page_shift = __builtin_ctzll((unsigned long long)a->page_size);
    a->b0 = a->key0 / KEYS, a->nb = (a->pos0 + a->T - 1) / KEYS - a->b0 + 1;
    const size_t keys = (size_t)a->Hkv * a->nb * KEYS * a->D, floats = keys + (size_t)a->T * a->Hq * a->D;
    float *packs = aligned_alloc(64, (floats + 15) / 16 * 64);
    const float **vrows = malloc((size_t)a->Hkv * a->nb * KEYS * sizeof(float *));
    if (!packs || !vrows) {
        free(packs);
        free(vrows);
        return -2;
    }
    a->kp = packs, a->qp = packs + keys, a->vrows = vrows;
    const int64_t tiles = (a->T + TOKENS - 1) / TOKENS, units = a->Hkv * tiles, blocks = a->Hkv * a->nb;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *scratch = aligned_alloc(64, (unit_floats(a) * sizeof(float) + 63) / 64 * 64);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < blocks; i++) pack_keys(a, i / a->nb, a->b0 + i % a->nb);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < a->T; t++) pack_queries(a, t);
        /* the last tiles see the most keys: handed out first */
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = units - 1; u >= 0; u--) {
            const int64_t t0 = u / a->Hkv * TOKENS, t1 = t0 + TOKENS < a->T ? t0 + TOKENS : a->T;
            if (scratch) unit(a, u % a->Hkv, t0, t1, scratch);
        }
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
        free(scratch);
    }
    free(packs);
    free(vrows);
    return failed ? -2 : 0;
#else
    return -1;
#endif
}

PyObject *q41_py_prompt_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    enum { POINTERS = 6, SIZES = 11, COUNT = POINTERS + SIZES + 2 };
    long long v[COUNT];
    if (q41_int_args(args, nargs, COUNT, 1ull << (POINTERS + SIZES), v,  /* scale: a float */
                     "prompt_attention(q, keys, values, pages, out, first, T, Hq, Hkv, D, pos0, key0, base, "
                     "page_size, sb, ss, sh, scale, threads)"))
        return NULL;
    const double scale = PyFloat_AsDouble(args[POINTERS + SIZES]);
    if (PyErr_Occurred()) return NULL;
    prompt_attn a = {
        .q = (const float *)(uintptr_t)v[0], .k = (const float *)(uintptr_t)v[1], .v = (const float *)(uintptr_t)v[2],
        .pages = (const int64_t *)(uintptr_t)v[3], .out = (float *)(uintptr_t)v[4],
        .first = (const int64_t *)(uintptr_t)v[5], .T = v[6], .Hq = v[7], .Hkv = v[8], .D = v[9], .pos0 = v[10],
        .key0 = v[11], .base = v[12], .page_size = v[13], .sb = v[14], .ss = v[15], .sh = v[16],
        .scale = (float)scale,
    };
    int code;
    Py_BEGIN_ALLOW_THREADS
    code = prompt_attention(&a, (int)v[COUNT - 1]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(code);
}
