/*
 * Fused float32 elementwise ops of the decoder layer on the CPU. Each replaces
 * several torch ops (and their temporaries) with one pass over the rows:
 *
 *   add_rms_norm:  residual += x (optional), out = weight * rmsnorm(residual)
 *   rope_and_cache: rotate q and k (neox layout), write k and v to their
 *                   paged-cache slots (slot -1 skipped), q and k out
 *   silu_and_mul:   out = silu(gate) * up for rows of [gate | up]
 *   apply_token_bitmask: -inf where a grammar's bitmask disallows a token
 *
 * Rows are independent, so work is split over threads by row ranges.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "csrc_vec_math.h"

typedef void (*row_fn)(void *ctx, int64_t begin, int64_t end);
/* 16 floats; aligned(4) so loads need no vector alignment. */
typedef float v16 __attribute__((vector_size(64), aligned(4)));

/* Below this many floats of work a thread costs more than it saves: waking
 * and joining the second thread takes microseconds, and far more when the
 * other core is busy with another process (a Ray actor's neighbours). */
#define MIN_FLOATS_PER_THREAD 16384

/* OpenMP, linked by soname so that it shares torch's libgomp thread pool. */
static void parallel_rows(row_fn fn, void *ctx, int64_t rows, int64_t row_floats, int num_threads) {
    const int64_t most = rows * row_floats / MIN_FLOATS_PER_THREAD;
    if (num_threads > most) num_threads = (int)most;
    if (num_threads < 2) {
        fn(ctx, 0, rows);
        return;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static, 1)
    for (int w = 0; w < num_threads; w++) fn(ctx, rows * w / num_threads, rows * (w + 1) / num_threads);
}

/* ---- add_rms_norm --------------------------------------------------------- */

typedef struct {
    const float *x;
    float *residual; /* NULL: no residual add, normalise x itself */
    const float *weight;
    float *out;
    int64_t hidden;
    float eps;
} norm_ctx;

/* Sixteen-lane partial sums in two chains: a single running sum is one
 * dependent add per element, which left the norm latency-bound (it cannot
 * vectorise without reassociation, which -ffp-contract=off files keep off). */
static float sum_squares(const float *x, int64_t n) {
    v16 a0 = {0}, a1 = {0};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const v16 u = *(const v16 *)(x + i), w = *(const v16 *)(x + i + 16);
        a0 += u * u;
        a1 += w * w;
    }
    const v16 a = a0 + a1;
    float ss = 0.f;
    for (int l = 0; l < 16; l++) ss += a[l];
    for (; i < n; i++) ss += x[i] * x[i];
    return ss;
}

static void norm_rows(void *arg, int64_t begin, int64_t end) {
    norm_ctx *c = (norm_ctx *)arg;
    const int64_t n = c->hidden;
    for (int64_t r = begin; r < end; r++) {
        const float *x = c->x + r * n;
        float *o = c->out + r * n;
        const float *src = x;
        if (c->residual) {
            float *res = c->residual + r * n;
            for (int64_t i = 0; i < n; i++) res[i] += x[i];
            src = res;
        }
        const float inv = 1.0f / sqrtf(sum_squares(src, n) / (float)n + c->eps);
        for (int64_t i = 0; i < n; i++) o[i] = c->weight[i] * (src[i] * inv);
    }
}

int add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out, int64_t rows,
                     int64_t hidden, float eps, int num_threads) {
    norm_ctx c = {x, residual, weight, out, hidden, eps};
    parallel_rows(norm_rows, &c, rows, hidden, num_threads);
    return 0;
}

/* ---- rope_and_cache ------------------------------------------------------- */

typedef struct {
    const float *q, *k, *v; /* rows of heads x D, row strides below */
    int64_t q_stride, k_stride, v_stride;
    const int64_t *positions;
    const float *cos, *sin; /* [max_pos, D/2] */
    const int64_t *slots;
    float *key_cache;   /* [blocks, KVH, D, bs]: positions innermost */
    float *value_cache; /* [blocks, bs, KVH, D] */
    float *q_out, *k_out; /* [T, H, D], [T, KVH, D] */
    int64_t H, KVH, D, bs;
} rope_ctx;

static inline void rotate(const float *x, float *y, const float *cs, const float *sn, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        y[i] = a * cs[i] - b * sn[i];
        y[i + half] = b * cs[i] + a * sn[i];
    }
}

static void rope_rows(void *arg, int64_t begin, int64_t end) {
    rope_ctx *c = (rope_ctx *)arg;
    const int64_t D = c->D, half = D / 2, kvw = c->KVH * D;
    for (int64_t t = begin; t < end; t++) {
        const float *cs = c->cos + c->positions[t] * half;
        const float *sn = c->sin + c->positions[t] * half;
        for (int64_t h = 0; h < c->H; h++)
            rotate(c->q + t * c->q_stride + h * D, c->q_out + (t * c->H + h) * D, cs, sn, half);
        float *k_out = c->k_out + t * kvw;
        for (int64_t h = 0; h < c->KVH; h++) rotate(c->k + t * c->k_stride + h * D, k_out + h * D, cs, sn, half);
        const int64_t slot = c->slots[t];
        if (slot >= 0) {
            float *kb = c->key_cache + (slot / c->bs) * kvw * c->bs + slot % c->bs;
            for (int64_t i = 0; i < kvw; i++) kb[i * c->bs] = k_out[i];
            memcpy(c->value_cache + slot * kvw, c->v + t * c->v_stride, sizeof(float) * kvw);
        }
    }
}

int rope_and_cache_f32(const float *q, const float *k, const float *v, int64_t q_stride,
                       int64_t k_stride, int64_t v_stride, const int64_t *positions,
                       const float *cos, const float *sin, const int64_t *slots, float *key_cache,
                       float *value_cache, float *q_out, float *k_out, int64_t T, int64_t H,
                       int64_t KVH, int64_t D, int64_t bs, int num_threads) {
    rope_ctx c = {q, k, v, q_stride, k_stride, v_stride, positions, cos, sin, slots,
                  key_cache, value_cache, q_out, k_out, H, KVH, D, bs};
    parallel_rows(rope_rows, &c, T, (H + KVH) * D, num_threads);
    return 0;
}

/* ---- silu_and_mul --------------------------------------------------------- */

typedef struct {
    const float *x; /* [rows, 2n]: gate then up */
    float *out;     /* [rows, n] */
    int64_t n;
} act_ctx;

static void silu_mul_rows(void *arg, int64_t begin, int64_t end) {
    act_ctx *c = (act_ctx *)arg;
    const int64_t n = c->n;
    for (int64_t r = begin; r < end; r++) {
        const float *__restrict g = c->x + r * 2 * n, *__restrict u = g + n;
        float *__restrict o = c->out + r * n;
        for (int64_t i = 0; i < n; i++) o[i] = silu(g[i]) * u[i];
    }
}

int silu_and_mul_f32(const float *x, float *out, int64_t rows, int64_t n, int num_threads) {
    act_ctx c = {x, out, n};
    parallel_rows(silu_mul_rows, &c, rows, n, num_threads);
    return 0;
}

/* ---- apply_token_bitmask -------------------------------------------------- */

/* Row r of `bitmask` (int32 words, xgrammar's layout) allows token t iff bit
 * t % 32 of word t / 32 is set; the others get -inf, in the rows listed in
 * `rows` (bitmask row r goes with logits row r). A
 * grammar usually allows few tokens: whole words of zeros are filled 32 at
 * a time, words of ones skipped, only mixed words go bit by bit. */
typedef struct {
    float *logits;
    const int32_t *bitmask;
    const int64_t *rows;
    int64_t logits_stride, words, vocab;
} mask_ctx;

static void mask_rows(void *arg, int64_t begin, int64_t end) {
    mask_ctx *c = (mask_ctx *)arg;
    const float ninf = -INFINITY;
    for (int64_t i = begin; i < end; i++) {
        const int64_t r = c->rows[i];
        float *__restrict row = c->logits + r * c->logits_stride;
        const int32_t *__restrict bits = c->bitmask + r * c->words;
        for (int64_t w = 0; w < c->words; w++) {
            const uint32_t word = (uint32_t)bits[w];
            const int64_t base = w * 32, n = c->vocab - base < 32 ? c->vocab - base : 32;
            if (word == 0xffffffffu || n <= 0) continue;
            if (word == 0) {
                for (int64_t k = 0; k < n; k++) row[base + k] = ninf;
                continue;
            }
            for (int64_t k = 0; k < n; k++)
                if (!((word >> k) & 1u)) row[base + k] = ninf;
        }
    }
}

int apply_token_bitmask_f32(float *logits, int64_t logits_stride, const int32_t *bitmask, int64_t words,
                            const int64_t *rows, int64_t num_rows, int64_t vocab, int num_threads) {
    mask_ctx c = {logits, bitmask, rows, logits_stride, words, vocab};
    parallel_rows(mask_rows, &c, num_rows, vocab, num_threads);
    return 0;
}
