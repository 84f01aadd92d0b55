/* A decode step's per-row arithmetic and its driver (cpu_decode.c), written once and compiled for each instruction
 * set: cpu_decode.c includes this file three times, under a #pragma GCC target, with OPS(name) naming each copy.
 *
 * Why the copies agree bit for bit: the arithmetic is on GCC's vectors of 16 floats (vf16), whose operators work
 * lane by lane with one IEEE rounding each (+, -, *, /; sqrt on one float), whatever registers a target gives
 * them (one AVX-512 register, two AVX2 ones, four SSE ones); -ffp-contract=off (setup.py) keeps the compiler from
 * fusing a multiply and an add, and no libm function is called. Each sum has a fixed order: a long one in 16 lanes
 * (lane l taking elements l, l + 16, ...), then a fixed tree over the lanes. Rounding to an integer is
 * (x + 1.5 * 2^23) - 1.5 * 2^23. Each row, and each chunk of a row's keys in attention (fixed by the row: see
 * cpu_decode.c), is computed by one thread, so a row's result depends neither on the thread count nor on the other
 * rows. */

static inline vf16 OPS(load)(const float *p) {
    vf16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void OPS(store)(float *p, vf16 v) { memcpy(p, &v, sizeof v); }

static inline vf16 OPS(splat)(float x) { return (vf16){0} + x; }

/* the 16 lanes' sum, in a fixed tree: lane l + (l + 8), then + (l + 4), + (l + 2), + (l + 1) */
static inline float OPS(sum16)(vf16 v) {
    v = v + __builtin_shuffle(v, (vi16){8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15});
    v = v + __builtin_shuffle(v, (vi16){4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7});
    v = v + __builtin_shuffle(v, (vi16){2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3});
    return v[0] + v[1];
}

/* sum of a[i] * b[i], n a multiple of 16 */
static inline float OPS(dot)(const float *a, const float *b, int64_t n) {
    vf16 acc = OPS(load)(a) * OPS(load)(b);
    for (int64_t i = 16; i < n; i += 16) acc = acc + OPS(load)(a + i) * OPS(load)(b + i);
    return OPS(sum16)(acc);
}

static inline vf16 OPS(select)(vi16 mask, vf16 yes, vf16 no) {
    return (vf16)(((vi16)yes & mask) | ((vi16)no & ~mask));
}

static inline vf16 OPS(round_even)(vf16 x) { /* nearbyintf's value for |x| < 2^22 */
    return (x + 12582912.f) - 12582912.f;
}

/* exp(x) lane by lane, ~1 ulp: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, n ln2's first part exact),
 * e^r by its Taylor series to r^7 (truncation < 6e-9 relative), times 2^n made in the exponent bits; x clamped to
 * [-87, 88], so 2^n is a normal number (e^-87 ~ 1.6e-38 stands for anything smaller: in a softmax such a weight
 * adds nothing to a sum of 1 or more; in SiLU, x / (1 + e^87) is x * 1.6e-38) */
static inline vf16 OPS(exp)(vf16 x) {
    x = OPS(select)(x < -87.f, OPS(splat)(-87.f), x);
    x = OPS(select)(x > 88.f, OPS(splat)(88.f), x);
    const vf16 n = OPS(round_even)(x * 1.44269504f);
    const vf16 r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    vf16 p = r * (1.f / 5040.f) + 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    return p * (vf16)((__builtin_convertvector(n, vi16) + 127) << 23);
}

/* Q4_1's activations (q4_1_cpu.c): per block of 32, dx = max|x| / 127, a = round(x / dx), b = round(256 (x - dx a)
 * / dx), the block's float sum in order */
static void OPS(quantize)(const void *x, int bf16, int64_t n, int8_t *xq, float *dx, float *sx) {
    for (int64_t b = 0; b < n / BLOCK; b++) {
        float v[BLOCK], amax = 0.f, sum = 0.f;
        if (bf16) {
            for (int i = 0; i < BLOCK; i++) {
                uint32_t bits = (uint32_t)((const uint16_t *)x)[b * BLOCK + i] << 16;
                memcpy(&v[i], &bits, 4);
            }
        } else {
            memcpy(v, (const float *)x + b * BLOCK, sizeof v);
        }
        for (int i = 0; i < BLOCK; i++) {
            amax = fmaxf(amax, fabsf(v[i]));
            sum += v[i];
        }
        const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        int8_t *xb = xq + b * 2 * BLOCK;
        for (int h = 0; h < BLOCK; h += 16) {
            const vf16 x16 = OPS(load)(v + h);
            vf16 hi = OPS(round_even)(x16 * id);
            hi = OPS(select)(hi > 127.f, OPS(splat)(127.f), hi);
            hi = OPS(select)(hi < -127.f, OPS(splat)(-127.f), hi);
            vf16 lo = OPS(round_even)((x16 - hi * d) * id * 256.f);
            lo = OPS(select)(lo > 127.f, OPS(splat)(127.f), lo);
            lo = OPS(select)(lo < -128.f, OPS(splat)(-128.f), lo);
            const vi16 a = __builtin_convertvector(hi, vi16), c = __builtin_convertvector(lo, vi16);
            for (int i = 0; i < 16; i++) {
                xb[h + i] = (int8_t)a[i];
                xb[BLOCK + h + i] = (int8_t)c[i];
            }
        }
        dx[b] = d * (1.f / 256.f);
        sx[b] = sum;
    }
}

/* 1 / sqrt(mean(v^2) + eps) of a row v = y + x (y NULL: x), n values, n a multiple of 16: Llama's RMSNorm scale */
static inline float OPS(inv_rms)(const float *x, const float *y, int64_t n, float eps) {
    vf16 acc = OPS(splat)(0.f);
    for (int64_t i = 0; i < n; i += 16) {
        const vf16 v = y ? OPS(load)(y + i) + OPS(load)(x + i) : OPS(load)(x + i);
        acc = acc + v * v;
    }
    return 1.f / sqrtf(OPS(sum16)(acc) / (float)n + eps);
}

/* A residual add and an RMSNorm, this thread's share of the rows' blocks of 32: dst = y + src (y NULL: src), out =
 * dst / sqrt(mean(dst^2) + eps) * w, quantised for the next linear where quantised. Each thread sums a row's squares
 * itself, over the whole row (the same sums, so the same scale), from src and y: dst is another buffer. */
static void OPS(add_norm)(const decode_step *s, const float *src, const float *y, float *dst, const float *w,
                          float *out, int quantised, int tid, int nth) {
    const int64_t H = s->H, nb = H / BLOCK, units = s->R * nb;
    int64_t row = -1;
    float inv = 0.f;
    for (int64_t u = units * tid / nth; u < units * (tid + 1) / nth; u++) {
        const int64_t r = u / nb, at = r * H + u % nb * BLOCK;
        if (r != row) row = r, inv = OPS(inv_rms)(src + r * H, y ? y + r * H : NULL, H, s->eps);
        for (int64_t i = at; i < at + BLOCK; i += 16) {
            const vf16 v = y ? OPS(load)(y + i) + OPS(load)(src + i) : OPS(load)(src + i);
            OPS(store)(dst + i, v);
            OPS(store)(out + i, v * inv * OPS(load)(w + i - r * H));
        }
        if (quantised) OPS(quantize)(out + at, 0, BLOCK, s->xq + at / BLOCK * 2 * BLOCK, s->dx + at / BLOCK, s->sx + at / BLOCK);
    }
}

/* silu(gate) * up = gate / (1 + e^-gate) * up, this thread's share of the rows' blocks of 32, quantised for down_proj */
static void OPS(silu_mul)(const decode_step *s, int tid, int nth) {
    const int64_t I = s->I, nb = I / BLOCK, units = s->R * nb;
    for (int64_t u = units * tid / nth; u < units * (tid + 1) / nth; u++) {
        const int64_t r = u / nb, at = r * I + u % nb * BLOCK;
        const float *gate = s->gate_up + r * 2 * I + u % nb * BLOCK;
        for (int64_t i = 0; i < BLOCK; i += 16) {
            const vf16 g = OPS(load)(gate + i);
            OPS(store)(s->mlp + at + i, g / (1.f + OPS(exp)(-g)) * OPS(load)(gate + I + i));
        }
        OPS(quantize)(s->mlp + at, 0, BLOCK, s->xq + at / BLOCK * 2 * BLOCK, s->dx + at / BLOCK, s->sx + at / BLOCK);
    }
}

/* RoPE, halves paired (Llama-2/3): out = x cos + roll(x, d / 2) signed_sin, as position_encoding.rope_rolled;
 * d a multiple of 32 */
static inline void OPS(rope)(const float *x, const float *cos, const float *sin, int64_t d, float *out) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < d; i += 16) {
        const float *partner = x + (i < half ? i + half : i - half);
        OPS(store)(out + i, OPS(load)(x + i) * OPS(load)(cos + i) + OPS(load)(partner) * OPS(load)(sin + i));
    }
}

/* A chunk's scores of one head, sc[j] for j < n, padded to a multiple of 16 (sc has room): sc[j] := e^(sc[j] -
 * top), top the largest (exact in any order); returns the weights' sum, lane by lane over the vectors, then a tree */
static inline float OPS(softmax_weights)(float *sc, int64_t n, float *top_out) {
    for (int64_t j = n; j % 16; j++) sc[j] = sc[0]; /* a real score: the maximum stands; weighed 0 below */
    vf16 m = OPS(load)(sc);
    for (int64_t j = 16; j < n; j += 16) m = OPS(select)(OPS(load)(sc + j) > m, OPS(load)(sc + j), m);
    float top = m[0];
    for (int l = 1; l < 16; l++) top = m[l] > top ? m[l] : top;
    vf16 total = OPS(splat)(0.f);
    for (int64_t j = 0; j < n; j += 16) {
        const vi16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        const vf16 w = OPS(select)(lane < (int32_t)(n - j), OPS(exp)(OPS(load)(sc + j) - top), OPS(splat)(0.f));
        OPS(store)(sc + j, w);
        total = total + w;
    }
    *top_out = top;
    return OPS(sum16)(total);
}

/* The keys of a row's chunk c (cpu_decode.c's chunks_of): slots [c * chunk, (c + 1) * chunk) of its blocks laid
 * end to end, less those before lo or past lo + count. Every query head's scores over them, their softmax weights
 * against the chunk's own maximum, and the weights' sum and weighted values: the chunk's partial (merge). The
 * chunk holding the row's own token first rotates its k and stores k and v in the token's slot; each chunk
 * rotates the queries for itself (576 products for SmolLM2: no barrier for them). scores: [Hq][chunk] scratch
 * (chunk a multiple of 16). */
static void OPS(attend_chunk)(const decode_step *s, int64_t l, int64_t r, int64_t c, float *scores) {
    const int64_t D = s->D, Hq = s->Hq, Hkv = s->Hkv, per = Hq / Hkv, bs = s->block_size, chunk = s->chunk_keys;
    const int64_t *t = s->caches + l * CACHE_FIELDS, *row = s->rows + (t[C_GROUP] * s->R + r) * ROW_FIELDS;
    const int64_t sb = t[C_BLOCK_STRIDE], ss = t[C_SLOT_STRIDE], sh = t[C_HEAD_STRIDE];
    float *keys = (float *)(uintptr_t)t[C_KEYS], *values = (float *)(uintptr_t)t[C_VALUES];
    const float *qkv = s->qkv + r * s->n_qkv, *cos = s->cos + r * D, *sin = s->sin + r * D;
    const int64_t *blocks = s->blocks + row[R_START], lo = row[R_LO], end = lo + row[R_COUNT];
    const int64_t first = c * chunk > lo ? c * chunk : lo, last = (c + 1) * chunk < end ? (c + 1) * chunk : end;
    float q[Hq * D];
    for (int64_t h = 0; h < Hq; h++) OPS(rope)(qkv + h * D, cos, sin, D, q + h * D);
    if (last == end) {
        const int64_t slot = row[R_WRITE_BLOCK] * sb + row[R_WRITE_OFFSET] * ss;
        for (int64_t g = 0; g < Hkv; g++) {
            OPS(rope)(qkv + (Hq + g) * D, cos, sin, D, keys + slot + g * sh);
            memcpy(values + slot + g * sh, qkv + (Hq + Hkv + g) * D, D * sizeof(float));
        }
    }
    const int64_t n = last - first;
    for (int64_t i = first; i < last; i++) {
        const float *k = keys + blocks[i >> s->block_shift] * sb + (i & (bs - 1)) * ss;
        for (int64_t g = 0, h = 0; g < Hkv; g++)
            for (int64_t e = 0; e < per; e++, h++)
                scores[h * chunk + i - first] = OPS(dot)(q + h * D, k + g * sh, D) * s->scale;
    }
    float *part = s->parts + (s->first_part[r] + c) * Hq * (D + 2); /* [Hq][D] values, [Hq] maxima, [Hq] sums */
    for (int64_t h = 0; h < Hq; h++)
        part[Hq * D + Hq + h] = OPS(softmax_weights)(scores + h * chunk, n, part + Hq * D + h);
    vf16 acc[Hq * D / 16];
    for (int64_t i = 0; i < Hq * D / 16; i++) acc[i] = OPS(splat)(0.f);
    for (int64_t i = first; i < last; i++) {
        const float *v = values + blocks[i >> s->block_shift] * sb + (i & (bs - 1)) * ss;
        vf16 *a = acc;
        for (int64_t g = 0, h = 0; g < Hkv; g++)
            for (int64_t e = 0; e < per; e++, h++) {
                const float p = scores[h * chunk + i - first];
                for (int64_t f = 0; f < D; f += 16, a++) *a = *a + p * OPS(load)(v + g * sh + f);
            }
    }
    for (int64_t i = 0; i < Hq * D / 16; i++) OPS(store)(part + 16 * i, acc[i]);
}

/* Query head h of row r's attention output from its chunks' partials, in chunk order: with M the largest chunk
 * maximum and w_c = e^(max_c - M), out = sum_c w_c values_c / sum_c w_c sum_c; quantised for o_proj (D % 32 == 0:
 * a head is whole blocks) */
static void OPS(merge)(const decode_step *s, int64_t l, int64_t r, int64_t h) {
    const int64_t D = s->D, Hq = s->Hq, part = Hq * (D + 2);
    const int64_t *t = s->caches + l * CACHE_FIELDS, *row = s->rows + (t[C_GROUP] * s->R + r) * ROW_FIELDS;
    const int64_t chunks = chunks_of(row, s->chunk_keys);
    const float *parts = s->parts + s->first_part[r] * part;
    float top = parts[Hq * D + h], total = 0.f;
    for (int64_t c = 1; c < chunks; c++) top = parts[c * part + Hq * D + h] > top ? parts[c * part + Hq * D + h] : top;
    vf16 acc[D / 16];
    for (int64_t e = 0; e < D / 16; e++) acc[e] = OPS(splat)(0.f);
    for (int64_t c = 0; c < chunks; c++) {
        const float *p = parts + c * part;
        const float w = OPS(exp)(OPS(splat)(p[Hq * D + h] - top))[0];
        total = total + p[Hq * D + Hq + h] * w;
        for (int64_t e = 0; e < D / 16; e++) acc[e] = acc[e] + OPS(load)(p + h * D + 16 * e) * w;
    }
    const int64_t at = r * Hq * D + h * D;
    for (int64_t e = 0; e < D / 16; e++) OPS(store)(s->att + at + 16 * e, acc[e] / total);
    OPS(quantize)(s->att + at, 0, D, s->xq + at / BLOCK * 2 * BLOCK, s->dx + at / BLOCK, s->sx + at / BLOCK);
}

/* this thread's share of every row's chunks of layer l: the i-th (row, chunk) of them all for i in [u0, u1) */
static void OPS(attend_share)(const decode_step *s, int64_t l, int tid, int nth, float *scores) {
    const int64_t *t = s->caches + l * CACHE_FIELDS, *rows = s->rows + t[C_GROUP] * s->R * ROW_FIELDS;
    int64_t units = 0;
    for (int64_t r = 0; r < s->R; r++) units += chunks_of(rows + r * ROW_FIELDS, s->chunk_keys);
    const int64_t u0 = units * tid / nth, u1 = units * (tid + 1) / nth;
    for (int64_t r = 0, u = 0; r < s->R && u < u1; r++) {
        const int64_t chunks = chunks_of(rows + r * ROW_FIELDS, s->chunk_keys);
        for (int64_t c = 0; c < chunks; c++, u++)
            if (u >= u0 && u < u1) OPS(attend_chunk)(s, l, r, c, scores);
    }
}

/* Thread tid of nth runs its share of every phase of every layer; a barrier between phases (each reads what the
 * one before wrote). Rows' blocks of 32, attention chunks and heads are whole per thread; the linears' tiles are
 * split. The residual stream alternates between two buffers (add_norm). */
static void OPS(run)(const decode_step *s, int tid, int nth) {
    const int64_t R = s->R, H = s->H, Hq = s->Hq;
    float *scores = s->scores + tid * s->scores_per_thread;
    const float *res = s->x; /* the residual stream: the embedding, then each add_norm's dst */
    int next = 0;
    for (int64_t l = 0; l < s->L; l++) {
        const int64_t *lw = s->layers + l * LAYER_FIELDS;
        OPS(add_norm)(s, res, l ? s->y : NULL, s->res[next], (const float *)(uintptr_t)lw[L_IN_NORM], s->h, 1, tid,
                      nth);
        res = s->res[next], next ^= 1;
        barrier(nth);
        linear(s, lw[L_QKV], lw[L_QKV_BIAS], s->n_qkv, H, s->qkv, tid, nth);
        barrier(nth);
        OPS(attend_share)(s, l, tid, nth, scores);
        barrier(nth);
        for (int64_t u = R * Hq * tid / nth; u < R * Hq * (tid + 1) / nth; u++) OPS(merge)(s, l, u / Hq, u % Hq);
        barrier(nth);
        linear(s, lw[L_O], lw[L_O_BIAS], H, Hq * s->D, s->y, tid, nth);
        barrier(nth);
        OPS(add_norm)(s, res, s->y, s->res[next], (const float *)(uintptr_t)lw[L_POST_NORM], s->h, 1, tid, nth);
        res = s->res[next], next ^= 1;
        barrier(nth);
        linear(s, lw[L_GATE_UP], lw[L_GATE_UP_BIAS], 2 * s->I, H, s->gate_up, tid, nth);
        barrier(nth);
        OPS(silu_mul)(s, tid, nth);
        barrier(nth);
        linear(s, lw[L_DOWN], lw[L_DOWN_BIAS], H, s->I, s->y, tid, nth);
        barrier(nth);
    }
    OPS(add_norm)(s, res, s->y, s->res[next], s->final_norm, s->out, 0, tid, nth); /* the final norm */
}
