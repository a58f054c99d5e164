/*
 * Paged attention for single-query tokens (decode) on the CPU, float32.
 *
 * Reads each key and value of the paged cache exactly once per token, in
 * place: no gathered copy of the context. One position's keys for all heads
 * are contiguous, so a token walks whole blocks sequentially (friendly to the
 * hardware prefetcher) and every query head, GQA groups included, is scored
 * against a row while it is in cache. Scores are soft-maxed exactly
 * (max-subtracted) in a scratch buffer, then V is accumulated per head.
 *
 * Layout: q/out [T, H, D]; caches [num_blocks, block_size, KVH, D];
 * block_tables [rows, bt_stride] (int64); token t uses block-table row
 * seq_rows[t] and attends to keys 0 .. ctx_lens[t]-1.
 * Work is split over threads by runs of tokens balanced on context length.
 */
#include <math.h>
#include <pthread.h>
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

static inline float dot(const float *a, const float *b, int64_t d) {
    float acc[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= d; i += 16)
        for (int l = 0; l < 16; l++) acc[l] += a[i + l] * b[i + l];
    float s = 0.f;
    for (int l = 0; l < 16; l++) s += acc[l];
    for (; i < d; i++) s += a[i] * b[i];
    return s;
}

static void *run(void *arg) {
    job_t *j = (job_t *)arg;
    const int64_t H = j->H, G = j->H / j->KVH, D = j->D, KVH = j->KVH, bs = j->bs;
    const int64_t row = KVH * D; /* one position's keys for all heads: contiguous */
    const int64_t max_ctx = j->max_ctx > 0 ? j->max_ctx : 1;
    float *scores = (float *)malloc(sizeof(float) * H * max_ctx);
    float *acc = (float *)malloc(sizeof(float) * H * D);
    for (int64_t t = j->t_begin; t < j->t_end; t++) {
        const int64_t ctx = j->ctx_lens[t];
        const int64_t *bt = j->block_tables + j->seq_rows[t] * j->bt_stride;
        const float *qt = j->q + t * H * D;
        /* Pass 1: scores. Positions stream through whole blocks of contiguous memory. */
        for (int64_t p = 0; p < ctx; p++) {
            const float *k = j->kc + (bt[p / bs] * bs + p % bs) * row;
            for (int64_t h = 0; h < H; h++)
                scores[h * max_ctx + p] = dot(qt + h * D, k + (h / G) * D, D) * j->scale;
        }
        for (int64_t h = 0; h < H; h++) {
            float *s = scores + h * max_ctx;
            float m = -INFINITY, sum = 0.f;
            for (int64_t p = 0; p < ctx; p++) m = s[p] > m ? s[p] : m;
            for (int64_t p = 0; p < ctx; p++) { s[p] = expf(s[p] - m); sum += s[p]; }
            const float inv = 1.f / sum;
            for (int64_t p = 0; p < ctx; p++) s[p] *= inv;
        }
        /* Pass 2: weighted sum of values, accumulated per head in L1. */
        memset(acc, 0, sizeof(float) * H * D);
        for (int64_t p = 0; p < ctx; p++) {
            const float *v = j->vc + (bt[p / bs] * bs + p % bs) * row;
            for (int64_t h = 0; h < H; h++) {
                const float w = scores[h * max_ctx + p];
                const float *vh = v + (h / G) * D;
                float *a = acc + h * D;
                for (int64_t d = 0; d < D; d++) a[d] += w * vh[d];
            }
        }
        memcpy(j->out + t * H * D, acc, sizeof(float) * H * D);
    }
    free(scores);
    free(acc);
    return NULL;
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
    job_t jobs[64];
    pthread_t threads[64];
    int launched[64] = {0};
    int64_t t = 0, done = 0;
    for (int w = 0; w < num_threads; w++) {
        /* Contiguous runs of tokens with roughly equal key counts. */
        const int64_t target = total * (w + 1) / num_threads;
        const int64_t begin = t;
        while (t < T && (w == num_threads - 1 || done < target)) done += ctx_lens[t++];
        jobs[w] = (job_t){q, out, kc, vc, block_tables, bt_stride, seq_rows, ctx_lens, H, KVH, D,
                          bs, scale, begin, t, max_ctx};
    }
    for (int w = 1; w < num_threads; w++)
        if (jobs[w].t_begin < jobs[w].t_end)
            launched[w] = pthread_create(&threads[w], NULL, run, &jobs[w]) == 0;
    run(&jobs[0]);
    for (int w = 1; w < num_threads; w++) {
        if (launched[w]) pthread_join(threads[w], NULL);
        else if (jobs[w].t_begin < jobs[w].t_end) run(&jobs[w]);
    }
    return 0;
}
