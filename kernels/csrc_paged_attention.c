/*
 * Paged attention for single-query tokens (decode) on the CPU, float32.
 *
 * Reads each key and value of the paged cache exactly once per token, in
 * place: no gathered copy of the context. A token walks its blocks, each a
 * contiguous run of memory, scoring every query head (GQA groups included)
 * while the block is in cache. Scores are soft-maxed exactly (max-subtracted)
 * in a scratch buffer, then V is accumulated per head.
 *
 * Layout: q/out [T, H, D]; keys [num_blocks, KVH, D, block_size]; values
 * [num_blocks, block_size, KVH, D];
 * block_tables [rows, bt_stride] (int64); token t uses block-table row
 * seq_rows[t] and attends to keys 0 .. ctx_lens[t]-1.
 * Work is split over threads by runs of tokens balanced on context length.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const float *q;
    float *out;
    const float *kc;
    const float *vc;
    const int64_t *block_tables;
    int64_t bt_stride;
    const int64_t *seq_rows;
    const int64_t *ctx_lens;
    int64_t H, KVH, D, bs;
    float scale;
    int64_t t_begin, t_end;
    int64_t max_ctx;
} job_t;

/* exp for x <= 0, branch-free so the softmax loop vectorises (glibc's expf is
 * a scalar call, ~20 ns, a fifth of the kernel's time). Cephes' range
 * reduction and polynomial: within 1e-6 relative of exp on [-30, 0]; below -87.3 it returns 0. */
static inline float exp_nonpos(float x) {
    x = x < -87.3f ? -87.3f : x;
    const float n = __builtin_roundf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return x <= -87.3f ? 0.0f : p * scale.f;
}

/* Inlined once per common head size (with the default block size) so that
 * loops over D and the block have compile-time trip counts. D must be a
 * multiple of 4 and the block size at most MAX_BLOCK. */
#define MAX_BLOCK 256
static inline __attribute__((always_inline)) void run_impl(job_t *j, const int64_t D, const int64_t bs) {
    const int64_t H = j->H, G = j->H / j->KVH, KVH = j->KVH;
    const int64_t row = KVH * D; /* one position's values for all heads: contiguous */
    const int64_t max_ctx = j->max_ctx > 0 ? j->max_ctx : 1;
    float *scores = (float *)malloc(sizeof(float) * H * max_ctx);
    float *acc = (float *)malloc(sizeof(float) * H * D);
    for (int64_t t = j->t_begin; t < j->t_end; t++) {
        const int64_t ctx = j->ctx_lens[t];
        const int64_t *bt = j->block_tables + j->seq_rows[t] * j->bt_stride;
        const float *qt = j->q + t * H * D;
        /* Pass 1: scores a block at a time. Keys are [KVH][D][bs] per block, so
         * a head's scores for the block's positions accumulate as vectors over
         * d: no horizontal sums. Four partial sums break the FMA latency chain. */
        for (int64_t b = 0; b * bs < ctx; b++) {
            const int64_t n = ctx - b * bs < bs ? ctx - b * bs : bs;
            const float *kb = j->kc + bt[b] * KVH * D * bs;
            for (int64_t h = 0; h < H; h++) {
                const float *__restrict kh = kb + (h / G) * D * bs;
                const float *__restrict qh = qt + h * D;
                float part[4][MAX_BLOCK];
                for (int l = 0; l < 4; l++)
                    for (int64_t i = 0; i < bs; i++) part[l][i] = 0.f;
                for (int64_t d = 0; d < D; d += 4)
                    for (int l = 0; l < 4; l++)
                        for (int64_t i = 0; i < bs; i++) part[l][i] += qh[d + l] * kh[(d + l) * bs + i];
                float *s = scores + h * max_ctx + b * bs;
                for (int64_t i = 0; i < n; i++)
                    s[i] = ((part[0][i] + part[1][i]) + (part[2][i] + part[3][i])) * j->scale;
            }
        }
        for (int64_t h = 0; h < H; h++) {
            float *s = scores + h * max_ctx;
            float m = -INFINITY, sum = 0.f;
            for (int64_t p = 0; p < ctx; p++) m = s[p] > m ? s[p] : m;
            for (int64_t p = 0; p < ctx; p++) { s[p] = exp_nonpos(s[p] - m); sum += s[p]; }
            const float inv = 1.f / sum;
            for (int64_t p = 0; p < ctx; p++) s[p] *= inv;
        }
        /* Pass 2: weighted sum of values, accumulated per head in L1. */
        memset(acc, 0, sizeof(float) * H * D);
        for (int64_t p = 0; p < ctx; p++) {
            const float *v = j->vc + (bt[p / bs] * bs + p % bs) * row;
            for (int64_t h = 0; h < H; h++) {
                const float w = scores[h * max_ctx + p];
                const float *__restrict vh = v + (h / G) * D;
                float *__restrict a = acc + h * D;
                for (int64_t d = 0; d < D; d++) a[d] += w * vh[d];
            }
        }
        memcpy(j->out + t * H * D, acc, sizeof(float) * H * D);
    }
    free(scores);
    free(acc);
}

static void run(job_t *j) {
    if (j->bs == 16) {
        switch (j->D) {
            case 32: run_impl(j, 32, 16); return;
            case 48: run_impl(j, 48, 16); return;
            case 64: run_impl(j, 64, 16); return;
            case 80: run_impl(j, 80, 16); return;
            case 96: run_impl(j, 96, 16); return;
            case 128: run_impl(j, 128, 16); return;
            case 256: run_impl(j, 256, 16); return;
        }
    }
    run_impl(j, j->D, j->bs);
}

int paged_attention_decode_f32(const float *q, float *out, const float *kc, const float *vc,
                               const int64_t *block_tables, int64_t bt_stride,
                               const int64_t *seq_rows, const int64_t *ctx_lens, int64_t T,
                               int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale,
                               int num_threads) {
    if (num_threads < 1) num_threads = 1;
    if (num_threads > 64) num_threads = 64;
    int64_t total = 0, max_ctx = 0;
    for (int64_t t = 0; t < T; t++) {
        total += ctx_lens[t];
        if (ctx_lens[t] > max_ctx) max_ctx = ctx_lens[t];
    }
    /* Contiguous runs of tokens with roughly equal key counts, one per thread.
     * OpenMP, not pthreads: linked by soname, this shares torch's libgomp and
     * its thread pool, so no torch worker is left spinning against us. */
    int64_t bounds[65];
    bounds[0] = 0;
    int64_t t = 0, done = 0;
    for (int w = 0; w < num_threads; w++) {
        const int64_t target = total * (w + 1) / num_threads;
        while (t < T && (w == num_threads - 1 || done < target)) done += ctx_lens[t++];
        bounds[w + 1] = t;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static, 1)
    for (int w = 0; w < num_threads; w++) {
        job_t job = {q, out, kc, vc, block_tables, bt_stride, seq_rows, ctx_lens, H, KVH, D,
                     bs, scale, bounds[w], bounds[w + 1], max_ctx};
        if (job.t_begin < job.t_end) run(&job);
    }
    return 0;
}
