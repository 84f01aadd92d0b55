/* A decode step of a 4-bit Llama-2/3 on CPU in one call: every layer's norms, Q4_1 linears (q4_1_cpu.c's tile
 * kernels), RoPE, K/V store, attention over the paged KV cache and SiLU, and the final norm, for R rows of one
 * generated token each (one a sequence), inside one OpenMP parallel region.
 *
 * Why: a step of SmolLM2-135M in torch calls ~30 small ops a layer; at ~10 us each they cost more than the 4-bit
 * matmuls, and a second thread does not shorten them. Here the threads stay in one parallel region and meet at a
 * barrier between phases (9 a layer), with no dispatch between them.
 *
 * The caller (hybridkv/model/architectures/llama_cpu_decode.py) passes three int64 tables of data pointers and
 * sizes, with fields in the orders named below: the layers' weights (LAYER_*), each layer's K and V in the cache
 * with the strides of its [block, slot, head, dim] view (CACHE_*: the cache's layout is hybridkv/model/attention/
 * kv_cache.py's, read here only through those strides), and, per layer group and row, the slot its token's K/V go
 * to and the keys it reads (ROW_*: TorchPagedAttention's step state). The per-row arithmetic is in
 * cpu_decode_ops.h, compiled once per instruction set, every copy giving the scalar one's bits. */
#include "q4_1_cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

/* GCC's vectors of 16 lanes (cpu_decode_ops.h): one AVX-512 register, two AVX2 or four SSE ones */
typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));

enum { L_IN_NORM, L_POST_NORM, L_QKV, L_QKV_BIAS, L_O, L_O_BIAS, L_GATE_UP, L_GATE_UP_BIAS, L_DOWN, L_DOWN_BIAS,
       LAYER_FIELDS };
enum { C_KEYS, C_VALUES, C_BLOCK_STRIDE, C_SLOT_STRIDE, C_HEAD_STRIDE, C_GROUP, CACHE_FIELDS };
enum { R_WRITE_BLOCK, R_WRITE_OFFSET, R_START, R_LO, R_COUNT, ROW_FIELDS };

typedef struct {
    const int64_t *layers, *caches, *rows, *blocks; /* the tables above; blocks: the rows' block ids, end to end */
    const float *x, *cos, *sin, *final_norm;        /* x [R][H] embedded; cos, sin [R][D]: rope_rolled's tables */
    float *out;                                     /* [R][H] final-normed hidden states */
    int64_t L, H, Hq, Hkv, D, I, R, block_size, block_shift, n_qkv; /* block_size: a power of two */
    float eps, scale;
    tile_fn tile;
    /* scratch */
    float *res[2], *h, *qkv, *att, *y, *gate_up, *mlp, *scores, *parts, *dx, *sx;
    int8_t *xq;
    int64_t *first_part; /* [R + 1]: where row r's attention partials start in parts, in chunks */
    int64_t scores_per_thread, chunk_keys;
} decode_step;

/* Attention splits a row's keys into chunks of this many slots of its blocks laid end to end (at least a block):
 * units for the threads (a decode row of SmolLM2's 160 keys: 6), each reading whole rows of K and V, merged in
 * chunk order, so a row's chunks and their arithmetic do not depend on the thread count */
#define CHUNK_KEYS 32

/* how many chunks of ``chunk`` slots hold a row's keys (slots lo .. lo + count - 1) */
static inline int64_t chunks_of(const int64_t *row, int64_t chunk) {
    return (row[R_LO] + row[R_COUNT] + chunk - 1) / chunk;
}

static void barrier(int nth) {
    if (nth > 1) {
#ifdef _OPENMP
#pragma omp barrier
#endif
    }
}

/* this thread's share of a linear's output tiles, every row, from the quantised inputs in s->xq */
static void linear(const decode_step *s, int64_t w, int64_t bias, int64_t n, int64_t k, float *y, int tid, int nth) {
    const acts a = {s->xq, s->dx, s->sx, k, k / BLOCK};
    const int64_t tiles = (n + TILE - 1) / TILE;
    q41_run_tiles(s->tile, (const uint8_t *)(uintptr_t)w, &a, s->R, n, (const float *)(uintptr_t)bias, y, n,
                  tiles * tid / nth, tiles * (tid + 1) / nth);
}

#define OPS(name) name##_scalar
#include "cpu_decode_ops.h"
#undef OPS

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define OPS(name) name##_avx2
#include "cpu_decode_ops.h"
#undef OPS
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#define OPS(name) name##_vnni
#include "cpu_decode_ops.h"
#undef OPS
#pragma GCC pop_options
#define HAVE_X86_OPS 1
#endif

typedef void (*run_fn)(const decode_step *, int, int);

static run_fn run_of(int isa) {
#ifdef HAVE_X86_OPS
    if (isa == ISA_AVX512_VNNI) return run_vnni;
    if (isa == ISA_AVX2) return run_avx2;
#endif
    return isa == ISA_SCALAR ? run_scalar : NULL;
}

quantize_fn q41_quantizer_of(int isa) {
#ifdef HAVE_X86_OPS
    if (isa == ISA_AVX512_VNNI) return quantize_vnni;
    if (isa == ISA_AVX2) return quantize_avx2;
#endif
    return isa == ISA_SCALAR ? quantize_scalar : NULL;
}

/* first_part: each row's first chunk among all rows', each row's chunks the most its keys take in any group */
static void count_parts(const decode_step *s, int64_t *first_part) {
    int64_t groups = 0;
    for (int64_t l = 0; l < s->L; l++)
        if (s->caches[l * CACHE_FIELDS + C_GROUP] + 1 > groups) groups = s->caches[l * CACHE_FIELDS + C_GROUP] + 1;
    first_part[0] = 0;
    for (int64_t r = 0; r < s->R; r++) {
        int64_t most = 1;
        for (int64_t g = 0; g < groups; g++) {
            const int64_t chunks = chunks_of(s->rows + (g * s->R + r) * ROW_FIELDS, s->chunk_keys);
            most = chunks > most ? chunks : most;
        }
        first_part[r + 1] = first_part[r] + most;
    }
}

/* Runs the step; 0, -1 for bad sizes, -2 when out of memory. */
static int decode(decode_step *s, int threads, int isa) {
    run_fn run = run_of(isa);
    s->tile = q41_kernel_of(isa);
    if (!run || !s->tile || threads < 1 || s->L < 1 || s->R < 1 || s->H % BLOCK || s->I % BLOCK || s->D % BLOCK ||
        s->Hkv < 1 || s->Hq % s->Hkv || s->block_size < 1 || s->block_size & (s->block_size - 1))
        return -1;
    s->block_shift = __builtin_ctzll((unsigned long long)s->block_size);
    const int64_t R = s->R, H = s->H, I = s->I, width = s->Hq * s->D;
    s->n_qkv = width + 2 * s->Hkv * s->D;
    s->chunk_keys = CHUNK_KEYS > s->block_size ? CHUNK_KEYS / s->block_size * s->block_size : s->block_size;
    s->scores_per_thread = s->Hq * s->chunk_keys;
    int64_t *first_part = malloc((size_t)(R + 1) * sizeof(int64_t));
    if (!first_part) return -2;
    count_parts(s, first_part);
    int64_t inputs = H > width ? H : width; /* the most inputs of a linear: acts' row size */
    inputs = I > inputs ? I : inputs;
    const size_t floats = (size_t)R * (4 * H + s->n_qkv + width + 3 * I + 2 * inputs / BLOCK) +
                          (size_t)first_part[R] * s->Hq * (s->D + 2) + (size_t)threads * s->scores_per_thread;
    float *scratch = malloc(floats * sizeof(float) + 2 * (size_t)R * inputs);
    if (!scratch) {
        free(first_part);
        return -2;
    }
    s->first_part = first_part;
    s->res[0] = scratch, s->res[1] = s->res[0] + R * H, s->h = s->res[1] + R * H, s->y = s->h + R * H;
    s->qkv = s->y + R * H, s->att = s->qkv + R * s->n_qkv, s->gate_up = s->att + R * width;
    s->mlp = s->gate_up + R * 2 * I, s->dx = s->mlp + R * I, s->sx = s->dx + R * inputs / BLOCK;
    s->parts = s->sx + R * inputs / BLOCK, s->scores = s->parts + first_part[R] * s->Hq * (s->D + 2);
    s->xq = (int8_t *)(s->scores + threads * s->scores_per_thread);
#ifdef _OPENMP
    if (threads > 1) {
#pragma omp parallel num_threads(threads)
        run(s, omp_get_thread_num(), omp_get_num_threads());
    } else
#endif
        run(s, 0, 1);
    free(scratch);
    free(first_part);
    return 0;
}

PyObject *q41_py_decode_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    enum { POINTERS = 9, SIZES = 8, COUNT = POINTERS + SIZES + 4 };
    long long v[COUNT];
    if (q41_int_args(args, nargs, COUNT, 3ull << (POINTERS + SIZES), v,  /* eps, scale: floats */
                     "decode_step(layers, caches, rows, blocks, x, cos, sin, final_norm, out, L, H, Hq, Hkv, D, I, "
                     "R, block_size, eps, scale, threads, isa)"))
        return NULL;
    const double eps = PyFloat_AsDouble(args[POINTERS + SIZES]), scale = PyFloat_AsDouble(args[POINTERS + SIZES + 1]);
    if (PyErr_Occurred()) return NULL;
    decode_step s = {
        .layers = (const int64_t *)(uintptr_t)v[0], .caches = (const int64_t *)(uintptr_t)v[1],
        .rows = (const int64_t *)(uintptr_t)v[2], .blocks = (const int64_t *)(uintptr_t)v[3],
        .x = (const float *)(uintptr_t)v[4], .cos = (const float *)(uintptr_t)v[5],
        .sin = (const float *)(uintptr_t)v[6], .final_norm = (const float *)(uintptr_t)v[7],
        .out = (float *)(uintptr_t)v[8], .L = v[9], .H = v[10], .Hq = v[11], .Hkv = v[12], .D = v[13], .I = v[14],
        .R = v[15], .block_size = v[16], .eps = (float)eps, .scale = (float)scale,
    };
    int code;
    Py_BEGIN_ALLOW_THREADS
    code = decode(&s, (int)v[19], (int)v[20]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(code);
}
