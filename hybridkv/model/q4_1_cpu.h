/* What q4_1_cpu.c (the Q4_1 kernel) and cpu_decode.c (a whole decode step) share: the weight layout's sizes, the
 * quantised activations, the tile kernels and the Python entry points each file defines. q4_1_cpu.c documents the
 * layout and the arithmetic. */
#ifndef HYBRIDKV_Q4_1_CPU_H
#define HYBRIDKV_Q4_1_CPU_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

#define TILE 16
#define BLOCK 32
#define TILE_BLOCK 320
#define MAX_ROWS 4 /* activation rows a pass over a tile computes at once */

enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512_VNNI = 2 };

typedef struct {
    const int8_t *xq; /* [rows][nb][64]: a block's 32 digits a, then its 32 digits b */
    const float *dx;  /* [rows][nb]: dx / 256 */
    const float *sx;  /* [rows][nb] */
    int64_t k, nb;
} acts;

typedef void (*tile_fn)(const uint8_t *, const acts *, int64_t, int, float[MAX_ROWS][TILE]);

/* one row's n inputs (n a multiple of 32; float32, or bfloat16 where bf16) as two int8 digits per block of 32:
 * xq [n / 32][64], dx and sx [n / 32]. The same arithmetic at every instruction set (cpu_decode.c). */
typedef void (*quantize_fn)(const void *x, int bf16, int64_t n, int8_t *xq, float *dx, float *sx);

tile_fn q41_kernel_of(int isa);
quantize_fn q41_quantizer_of(int isa);

/* y[r][t * 16 ..] for rows r < rows and tiles t0 <= t < t1 of a weight of n outputs (+ bias[col] where bias) */
void q41_run_tiles(tile_fn fn, const uint8_t *w, const acts *a, int64_t rows, int64_t n, const float *bias, float *y,
                   int64_t y_stride, int64_t t0, int64_t t1);

/* the call's ``count`` arguments into v, as integers but those whose bit is set in ``floats`` (the caller reads
   them); -1 (a Python error set, naming ``usage``) when there are not ``count`` or one is not an integer */
int q41_int_args(PyObject *const *args, Py_ssize_t nargs, int count, uint64_t floats, long long *v,
                 const char *usage);

PyObject *q41_py_decode_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* prompt_attention_cpu.c: heads up to this wide (the module's PROMPT_ATTENTION_MAX_HEAD_DIM) */
#define PROMPT_ATTENTION_MAX_D 256
int q41_prompt_attention_supported(void);
PyObject *q41_py_prompt_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif
