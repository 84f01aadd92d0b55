/* A Q4_1 linear's rows on CPU: y[r] = W x[r], W 4-bit in GGUF Q4_1 blocks, x quantised to int8 per block of 32.
 *
 * Plain C, no torch headers: built by setup.py as an optional extension module, called with tensors' data
 * pointers (hybridkv/model/q4_1_cpu.py, which also packs the weights and documents the layout and arithmetic).
 *
 * Weight layout ("Q4_1x16"): output rows in tiles of 16, each tile's blocks of 32 inputs one after another,
 * 320 bytes a tile-block:
 *   bytes [64c, 64c + 64), c = 0..3:  byte 4j + i = q[j][4c + i] | q[j][16 + 4c + i] << 4   (j: row in the tile)
 *   bytes [256, 288): the 16 rows' scales d (fp16);  bytes [288, 320): their minimums m (fp16);  w = d q + m.
 * So one 64-byte load holds, in each 32-bit lane j, 4 consecutive inputs of row j: one vpdpbusd against 4
 * broadcast int8 activations adds them into row j's lane, and a tile's 16 rows need no horizontal sum.
 *
 * Activations: per row and block of 32, dx = max|x| / 127 and two int8 digits, a = round(x / dx) in -127..127 and
 * b = round(256 (x - dx a) / dx) in -128..127, so x ~ (dx / 256) (256 a + b): a grid of max|x| / 32512 (finer
 * than bf16 near the block's largest values); sx = sum(x) (float32, in order). Output row j: the sum over blocks
 * of  d (dx / 256) isum + m sx,  isum = 256 (q . a) + q . b exact in int32 and in float32 (|isum| < 2^24), the
 * two float sums kept apart and added at the end. Every kernel (AVX-512 VNNI, AVX2, scalar) does
 * the same float operations in the same order, so they agree bit for bit, and a row's result does not depend on
 * the other rows of the call or on the number of threads.
 */
#include "q4_1_cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define Q41_X86 1
#endif

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* out[r][j] for rows r < nrows of one tile, scalar: the reference the SIMD kernels match bit for bit */
static void tile_scalar(const uint8_t *w, const acts *a, int64_t r0, int nrows, float out[MAX_ROWS][TILE]) {
    for (int r = 0; r < nrows; r++) {
        const int8_t *xq = a->xq + (r0 + r) * a->nb * 2 * BLOCK;
        const float *dx = a->dx + (r0 + r) * a->nb, *sx = a->sx + (r0 + r) * a->nb;
        for (int j = 0; j < TILE; j++) {
            float accd = 0.f, accm = 0.f;
            for (int64_t b = 0; b < a->nb; b++) {
                const uint8_t *tb = w + b * TILE_BLOCK;
                const int8_t *xb = xq + b * 2 * BLOCK;
                int32_t sa = 0, sb = 0;
                for (int c = 0; c < 4; c++)
                    for (int i = 0; i < 4; i++) {
                        uint8_t byte = tb[64 * c + 4 * j + i];
                        sa += (byte & 15) * xb[4 * c + i] + (byte >> 4) * xb[16 + 4 * c + i];
                        sb += (byte & 15) * xb[BLOCK + 4 * c + i] + (byte >> 4) * xb[BLOCK + 16 + 4 * c + i];
                    }
                int32_t s = sa * 256 + sb;
                uint16_t dh, mh;
                memcpy(&dh, tb + 256 + 2 * j, 2);
                memcpy(&mh, tb + 288 + 2 * j, 2);
                float ddx = half_to_float(dh) * dx[b];
                accd = fmaf((float)s, ddx, accd);
                accm = fmaf(half_to_float(mh), sx[b], accm);
            }
            out[r][j] = accd + accm;
        }
    }
}

#ifdef Q41_X86
static inline int32_t x4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

VNNI_TARGET static inline __attribute__((always_inline)) void
tile_vnni_n(const uint8_t *w, const acts *a, int64_t r0, const int nrows, float out[MAX_ROWS][TILE]) {
    const __m512i mask = _mm512_set1_epi8(0x0f);
    __m512 accd[MAX_ROWS], accm[MAX_ROWS];
    for (int r = 0; r < nrows; r++) accd[r] = accm[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *tb = w + b * TILE_BLOCK;
        __m512i lo[4], hi[4];
        for (int c = 0; c < 4; c++) {
            __m512i v = _mm512_loadu_si512((const void *)(tb + 64 * c));
            lo[c] = _mm512_and_si512(v, mask);
            hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tb + 256)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tb + 288)));
        for (int r = 0; r < nrows; r++) {
            const int64_t at = (r0 + r) * a->nb + b;
            const int8_t *xb = a->xq + at * 2 * BLOCK;
            __m512i s[4];
            for (int u = 0; u < 4; u++) /* a's low and high nibbles' inputs, then b's */
                s[u] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u & 1 ? hi[0] : lo[0],
                                           _mm512_set1_epi32(x4(xb + 16 * u)));
            for (int c = 1; c < 4; c++)
                for (int u = 0; u < 4; u++)
                    s[u] = _mm512_dpbusd_epi32(s[u], u & 1 ? hi[c] : lo[c], _mm512_set1_epi32(x4(xb + 16 * u + 4 * c)));
            __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(s[0], s[1]), 8),
                                           _mm512_add_epi32(s[2], s[3]));
            const __m512 ddx = _mm512_mul_ps(d, _mm512_set1_ps(a->dx[at]));
            accd[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), ddx, accd[r]);
            accm[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a->sx[at]), accm[r]);
        }
    }
    for (int r = 0; r < nrows; r++) _mm512_storeu_ps(out[r], _mm512_add_ps(accd[r], accm[r]));
}

VNNI_TARGET static void tile_vnni(const uint8_t *w, const acts *a, int64_t r0, int nrows, float out[MAX_ROWS][TILE]) {
    switch (nrows) {
    case 1: tile_vnni_n(w, a, r0, 1, out); break;
    case 2: tile_vnni_n(w, a, r0, 2, out); break;
    case 3: tile_vnni_n(w, a, r0, 3, out); break;
    default: tile_vnni_n(w, a, r0, 4, out); break;
    }
}

/* AVX2: the tile as two halves of 8 rows (the 32-byte halves of each 64-byte load); u8 x s8 pairs through
 * vpmaddubsw (at most 2 x 15 x 127: no saturation) and vpmaddwd into the same exact int32 sums */
AVX2_TARGET static inline __attribute__((always_inline)) void
half_avx2_n(const uint8_t *w, const acts *a, int64_t r0, const int nrows, int h, float out[MAX_ROWS][TILE]) {
    const __m256i mask = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256 accd[MAX_ROWS], accm[MAX_ROWS];
    for (int r = 0; r < nrows; r++) accd[r] = accm[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *tb = w + b * TILE_BLOCK;
        __m256i lo[4], hi[4];
        for (int c = 0; c < 4; c++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(tb + 64 * c + 32 * h));
            lo[c] = _mm256_and_si256(v, mask);
            hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tb + 256 + 16 * h)));
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tb + 288 + 16 * h)));
        for (int r = 0; r < nrows; r++) {
            const int64_t at = (r0 + r) * a->nb + b;
            const int8_t *xb = a->xq + at * 2 * BLOCK;
            __m256i p[4];
            for (int u = 0; u < 4; u++)
                p[u] = _mm256_maddubs_epi16(u & 1 ? hi[0] : lo[0], _mm256_set1_epi32(x4(xb + 16 * u)));
            for (int c = 1; c < 4; c++)
                for (int u = 0; u < 4; u++)
                    p[u] = _mm256_add_epi16(p[u], _mm256_maddubs_epi16(u & 1 ? hi[c] : lo[c],
                                                                       _mm256_set1_epi32(x4(xb + 16 * u + 4 * c))));
            /* 16-bit lanes: 4 pair sums of at most 2 x 15 x 128 = 3840 each, 15360 < 32767: exact */
            __m256i sa = _mm256_add_epi32(_mm256_madd_epi16(p[0], ones), _mm256_madd_epi16(p[1], ones));
            __m256i sb = _mm256_add_epi32(_mm256_madd_epi16(p[2], ones), _mm256_madd_epi16(p[3], ones));
            __m256i s = _mm256_add_epi32(_mm256_slli_epi32(sa, 8), sb);
            const __m256 ddx = _mm256_mul_ps(d, _mm256_set1_ps(a->dx[at]));
            accd[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), ddx, accd[r]);
            accm[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a->sx[at]), accm[r]);
        }
    }
    for (int r = 0; r < nrows; r++) _mm256_storeu_ps(out[r] + 8 * h, _mm256_add_ps(accd[r], accm[r]));
}

AVX2_TARGET static void tile_avx2(const uint8_t *w, const acts *a, int64_t r0, int nrows, float out[MAX_ROWS][TILE]) {
    for (int h = 0; h < 2; h++) {
        switch (nrows) {
        case 1: half_avx2_n(w, a, r0, 1, h, out); break;
        case 2: half_avx2_n(w, a, r0, 2, h, out); break;
        case 3: half_avx2_n(w, a, r0, 3, h, out); break;
        default: half_avx2_n(w, a, r0, 4, h, out); break;
        }
    }
}
#endif

tile_fn q41_kernel_of(int isa) {
#ifdef Q41_X86
    if (isa == ISA_AVX512_VNNI) return tile_vnni;
    if (isa == ISA_AVX2) return tile_avx2;
#endif
    return isa == ISA_SCALAR ? tile_scalar : NULL;
}

/* The best kernel this CPU runs: 2 AVX-512 VNNI, 1 AVX2 (with FMA and F16C), 0 scalar. */
int q41_best_isa(void) {
#ifdef Q41_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        return ISA_AVX512_VNNI;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return ISA_AVX2;
#endif
    return ISA_SCALAR;
}

/* 1: this build splits a call's tiles over threads (OpenMP); 0: one thread whatever is asked */
int q41_threaded(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

void q41_run_tiles(tile_fn fn, const uint8_t *w, const acts *a, int64_t rows, int64_t n, const float *bias, float *y,
                   int64_t y_stride, int64_t t0, int64_t t1) {
    float out[MAX_ROWS][TILE];
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *wt = w + t * a->nb * TILE_BLOCK;
        int64_t cols = n - t * TILE < TILE ? n - t * TILE : TILE;
        for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) {
            int nr = rows - r0 < MAX_ROWS ? (int)(rows - r0) : MAX_ROWS;
            fn(wt, a, r0, nr, out);
            for (int r = 0; r < nr; r++) {
                float *yr = y + (r0 + r) * y_stride + t * TILE;
                memcpy(yr, out[r], cols * sizeof(float));
                if (bias) /* torch's y + bias, value for value */
                    for (int64_t c = 0; c < cols; c++) yr[c] = yr[c] + bias[t * TILE + c];
            }
        }
    }
}

/* y[r][0:n] (float32, row stride y_stride) = W x[r] for r < rows; x float32 (bf16 != 0: bfloat16), row stride
 * x_stride, k inputs (a multiple of 32); W packed as above (ceil(n / 16) tiles). Returns 0, or -1 for bad
 * arguments, -2 when out of memory. */
int q41_linear(const uint8_t *w, int64_t n, int64_t k, const void *x, int bf16, int64_t rows, int64_t x_stride,
               float *y, int64_t y_stride, int threads, int isa) {
    tile_fn fn = q41_kernel_of(isa);
    quantize_fn quantize = q41_quantizer_of(isa);
    if (!fn || !quantize || k <= 0 || k % BLOCK || n <= 0 || rows < 0 || threads < 1) return -1;
    if (rows == 0) return 0;
    int64_t nb = k / BLOCK, tiles = (n + TILE - 1) / TILE;
    size_t bytes = 2 * (size_t)rows * k + 2 * (size_t)rows * nb * sizeof(float);
    char *scratch = malloc(bytes);
    if (!scratch) return -2;
    float *dx = (float *)scratch, *sx = dx + rows * nb;
    int8_t *xq = (int8_t *)(sx + rows * nb);
    acts a = {xq, dx, sx, k, nb};
    for (int64_t r = 0; r < rows; r++)
        quantize((const char *)x + r * x_stride * (bf16 ? 2 : 4), bf16, k, xq + r * nb * 2 * BLOCK, dx + r * nb,
                 sx + r * nb);
    if (threads > tiles) threads = (int)tiles;
#ifdef _OPENMP
    if (threads > 1) {
#pragma omp parallel num_threads(threads)
        {
            int64_t id = omp_get_thread_num(), count = omp_get_num_threads();
            q41_run_tiles(fn, w, &a, rows, n, NULL, y, y_stride, tiles * id / count, tiles * (id + 1) / count);
        }
    } else
#endif
        q41_run_tiles(fn, w, &a, rows, n, NULL, y, y_stride, 0, tiles);
    free(scratch);
    return 0;
}

static uint16_t float_to_bf16(float f) { /* round to nearest even, as torch's conversion */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

static float bf16_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* row j of a tile-block's scale and zero as torch's int4 kernel holds them: bf16(d) and bf16(m + 8 d) */
static void scale_zero(const uint8_t *tb, int j, float *scale, float *zero) {
    uint16_t dh, mh;
    memcpy(&dh, tb + 256 + 2 * j, 2);
    memcpy(&mh, tb + 288 + 2 * j, 2);
    const float d = half_to_float(dh), m = half_to_float(mh);
    *scale = bf16_to_float(float_to_bf16(d)), *zero = bf16_to_float(float_to_bf16(m + 8.f * d));
}

static void expand_tiles(const uint8_t *w, int64_t n, int64_t k, uint16_t *out, int64_t t0, int64_t t1) {
    int64_t nb = k / BLOCK;
    for (int64_t t = t0; t < t1; t++) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *tb = w + (t * nb + b) * TILE_BLOCK;
            for (int j = 0; j < TILE && t * TILE + j < n; j++) {
                float scale, zero;
                scale_zero(tb, j, &scale, &zero);
                uint16_t value[16]; /* the block's 16 weights, one a code: each output is a lookup */
                for (int q = 0; q < 16; q++) value[q] = float_to_bf16(((float)q - 8.f) * scale + zero);
                uint16_t *row = out + (t * TILE + j) * k + b * BLOCK;
                for (int c = 0; c < 4; c++)
                    for (int i = 0; i < 4; i++) {
                        uint8_t byte = tb[64 * c + 4 * j + i];
                        row[4 * c + i] = value[byte & 15];
                        row[16 + 4 * c + i] = value[byte >> 4];
                    }
            }
        }
    }
}

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")
/* expand_tiles' values with AVX-512: a row-block's 16 weights made at once (the same multiply, add and rounding
 * to bf16 as float_to_bf16, lane by lane), its 32 codes looked up by one vpermw */
static void expand_tiles_avx512(const uint8_t *w, int64_t n, int64_t k, uint16_t *out, int64_t t0, int64_t t1) {
    const int64_t nb = k / BLOCK;
    const __m512 codes = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8); /* q - 8 */
    for (int64_t t = t0; t < t1; t++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *tb = w + (t * nb + b) * TILE_BLOCK;
            for (int j = 0; j < TILE && t * TILE + j < n; j++) {
                float scale, zero;
                scale_zero(tb, j, &scale, &zero);
                const __m512i u = _mm512_castps_si512(
                    _mm512_add_ps(_mm512_mul_ps(codes, _mm512_set1_ps(scale)), _mm512_set1_ps(zero)));
                const __m512i rounded = _mm512_srli_epi32(
                    _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
                const __m512i table = _mm512_castsi256_si512(_mm512_cvtepi32_epi16(rounded));
                uint32_t word[4]; /* bytes 4 c + i of the row: codes 4 c + i (low nibble) and 16 + 4 c + i (high) */
                for (int c = 0; c < 4; c++) memcpy(word + c, tb + 64 * c + 4 * j, 4);
                const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)word));
                const __m512i index = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_and_si256(bytes, _mm256_set1_epi16(15))),
                    _mm256_srli_epi16(bytes, 4), 1);
                _mm512_storeu_si512(out + (t * TILE + j) * k + b * BLOCK, _mm512_permutexvar_epi16(index, table));
            }
        }
}
#pragma GCC pop_options
#endif

typedef void (*expand_fn)(const uint8_t *, int64_t, int64_t, uint16_t *, int64_t, int64_t);

static expand_fn expander(void) {
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
        return expand_tiles_avx512;
#endif
    return expand_tiles;
}

/* out [n][k] bf16 = (q - 8) * bf16(d) + bf16(m + 8 d), rounded once: the weight torch's int4 kernel's bf16 scales
 * and zeros give (hybridkv/model/int4_cpu.py's _expand), for a prompt row's bf16 GEMM. Returns 0, or -1. */
int q41_expand_bf16(const uint8_t *w, int64_t n, int64_t k, uint16_t *out, int threads) {
    if (k <= 0 || k % BLOCK || n <= 0 || threads < 1) return -1;
    int64_t tiles = (n + TILE - 1) / TILE;
    if (threads > tiles) threads = (int)tiles;
    const expand_fn expand = expander();
#ifdef _OPENMP
    if (threads > 1) {
#pragma omp parallel num_threads(threads)
        {
            int64_t id = omp_get_thread_num(), count = omp_get_num_threads();
            expand(w, n, k, out, tiles * id / count, tiles * (id + 1) / count);
        }
    } else
#endif
        expand(w, n, k, out, 0, tiles);
    return 0;
}

/* The module's functions: a call on a 16 x 32 weight takes 0.6 us (3.4 us through ctypes; 120 calls a token). */
int q41_int_args(PyObject *const *args, Py_ssize_t nargs, int count, uint64_t floats, long long *v,
                 const char *usage) {
    if (nargs != count) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    for (int i = 0; i < count; i++) {
        if (floats >> i & 1) continue;
        v[i] = PyLong_AsLongLong(args[i]);
        if (v[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

static PyObject *py_linear(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[11];
    if (q41_int_args(args, nargs, 11, 0, v, "linear(w, n, k, x, bf16, rows, x_stride, y, y_stride, threads, isa): "
                                            "11 integers"))
        return NULL;
    int code;
    Py_BEGIN_ALLOW_THREADS
    code = q41_linear((const uint8_t *)(uintptr_t)v[0], v[1], v[2], (const void *)(uintptr_t)v[3], (int)v[4], v[5],
                      v[6], (float *)(uintptr_t)v[7], v[8], (int)v[9], (int)v[10]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(code);
}

static PyObject *py_expand_bf16(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[5];
    if (q41_int_args(args, nargs, 5, 0, v, "expand_bf16(w, n, k, out, threads): 5 integers")) return NULL;
    int code;
    Py_BEGIN_ALLOW_THREADS
    code = q41_expand_bf16((const uint8_t *)(uintptr_t)v[0], v[1], v[2], (uint16_t *)(uintptr_t)v[3], (int)v[4]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(code);
}

static PyObject *py_best_isa(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyLong_FromLong(q41_best_isa());
}

static PyObject *py_threaded(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyLong_FromLong(q41_threaded());
}

static PyObject *py_prompt_attention_supported(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyBool_FromLong(q41_prompt_attention_supported());
}

static PyMethodDef methods[] = {
    {"linear", (PyCFunction)(void (*)(void))py_linear, METH_FASTCALL,
     "linear(w, n, k, x, bf16, rows, x_stride, y, y_stride, threads, isa) -> 0 | -1 (bad arguments) | -2 (memory); "
     "w, x, y: data pointers"},
    {"expand_bf16", (PyCFunction)(void (*)(void))py_expand_bf16, METH_FASTCALL,
     "expand_bf16(w, n, k, out, threads) -> 0 | -1 (bad arguments); w, out: data pointers"},
    {"decode_step", (PyCFunction)(void (*)(void))q41_py_decode_step, METH_FASTCALL,
     "decode_step(layers, caches, rows, blocks, x, cos, sin, final_norm, out, L, H, Hq, Hkv, D, I, R, block_size, "
     "eps, scale, threads, isa) -> 0 | -1 (bad arguments) | -2 (memory); a decode step of every layer "
     "(cpu_decode.c)"},
    {"prompt_attention", (PyCFunction)(void (*)(void))q41_py_prompt_attention, METH_FASTCALL,
     "prompt_attention(q, k, v, out, first, T, Hq, Hkv, D, Kn, pos0, key0, scale, threads) -> 0 | -1 (bad "
     "arguments or no AVX-512 BF16) | -2 (memory); one sequence's prompt rows (prompt_attention_cpu.c)"},
    {"prompt_attention_supported", py_prompt_attention_supported, METH_NOARGS,
     "True where this build and CPU run prompt_attention (AVX-512 BF16)"},
    {"best_isa", py_best_isa, METH_NOARGS, "2: AVX-512 VNNI, 1: AVX2, 0: scalar C"},
    {"threaded", py_threaded, METH_NOARGS, "1: a call splits its tiles over threads (OpenMP)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {.m_base = PyModuleDef_HEAD_INIT, .m_name = "_q4_1_cpu",
                                    .m_doc = "Q4_1 linear rows on CPU (hybridkv/model/q4_1_cpu.py)", .m_size = -1,
                                    .m_methods = methods};

PyMODINIT_FUNC PyInit__q4_1_cpu(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "PROMPT_ATTENTION_MAX_HEAD_DIM", PROMPT_ATTENTION_MAX_D)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
