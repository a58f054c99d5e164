/*
 * Paged attention for single-query tokens (decode) on the CPU, float32.
 *
 * Reads each key and value row of the paged cache exactly once per
 * (token, kv head), in place: no gathered copy of the context. The query
 * heads that share a KV head (GQA) are processed together so that a K/V row
 * is loaded once for all of them. Scores are kept in a scratch buffer and
 * soft-maxed exactly (max-subtracted), then V is accumulated.
 *
 * Layout: q/out [T, H, D]; caches [num_blocks, block_size, KVH, D];
 * block_tables [rows, bt_stride] (int64); token t uses block-table row
 * seq_rows[t] and attends to keys 0 .. ctx_lens[t]-1.
 * Work is split over threads by (token, kv head) pairs balanced on ctx length.
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
    int64_t item_begin, item_end; /* items are t * KVH + kvh */
    int64_t max_ctx;
} job_t;

static inline float dot(const float *a, const float *b, int64_t d) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= d; i += 8)
        for (int l = 0; l < 8; l++) acc[l] += a[i + l] * b[i + l];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < d; i++) s += a[i] * b[i];
    return s;
}

static void *run(void *arg) {
    job_t *j = (job_t *)arg;
    const int64_t G = j->H / j->KVH, D = j->D, KVH = j->KVH, bs = j->bs;
    float *scores = (float *)malloc(sizeof(float) * G * (j->max_ctx > 0 ? j->max_ctx : 1));
    float *acc = (float *)malloc(sizeof(float) * G * D);
    for (int64_t item = j->item_begin; item < j->item_end; item++) {
        const int64_t t = item / KVH, h = item % KVH;
        const int64_t ctx = j->ctx_lens[t];
        const int64_t *bt = j->block_tables + j->seq_rows[t] * j->bt_stride;
        const float *qh = j->q + (t * j->H + h * G) * D;
        for (int64_t p = 0; p < ctx; p++) {
            const float *k = j->kc + ((bt[p / bs] * bs + p % bs) * KVH + h) * D;
            for (int64_t g = 0; g < G; g++) scores[g * ctx + p] = dot(qh + g * D, k, D) * j->scale;
        }
        for (int64_t g = 0; g < G; g++) {
            float *s = scores + g * ctx;
            float m = -INFINITY, sum = 0.f;
            for (int64_t p = 0; p < ctx; p++) m = s[p] > m ? s[p] : m;
            for (int64_t p = 0; p < ctx; p++) { s[p] = expf(s[p] - m); sum += s[p]; }
            const float inv = 1.f / sum;
            for (int64_t p = 0; p < ctx; p++) s[p] *= inv;
        }
        memset(acc, 0, sizeof(float) * G * D);
        for (int64_t p = 0; p < ctx; p++) {
            const float *v = j->vc + ((bt[p / bs] * bs + p % bs) * KVH + h) * D;
            for (int64_t g = 0; g < G; g++) {
                const float w = scores[g * ctx + p];
                float *a = acc + g * D;
                for (int64_t d = 0; d < D; d++) a[d] += w * v[d];
            }
        }
        for (int64_t g = 0; g < G; g++)
            memcpy(j->out + (t * j->H + h * G + g) * D, acc + g * D, sizeof(float) * D);
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
    const int64_t items = T * KVH;
    int64_t total = 0, max_ctx = 0;
    for (int64_t t = 0; t < T; t++) {
        total += ctx_lens[t];
        if (ctx_lens[t] > max_ctx) max_ctx = ctx_lens[t];
    }
    total *= KVH;
    job_t jobs[64];
    pthread_t threads[64];
    int launched[64] = {0};
    int64_t item = 0, done = 0;
    for (int w = 0; w < num_threads; w++) {
        /* Contiguous chunks with roughly equal key counts. */
        const int64_t target = total * (w + 1) / num_threads;
        const int64_t begin = item;
        while (item < items && (w == num_threads - 1 || done < target)) done += ctx_lens[item++ / KVH];
        jobs[w] = (job_t){q, out, kc, vc, block_tables, bt_stride, seq_rows, ctx_lens, H, KVH, D,
                          bs, scale, begin, item, max_ctx};
    }
    for (int w = 1; w < num_threads; w++)
        if (jobs[w].item_begin < jobs[w].item_end)
            launched[w] = pthread_create(&threads[w], NULL, run, &jobs[w]) == 0;
    run(&jobs[0]);
    for (int w = 1; w < num_threads; w++) {
        if (launched[w]) pthread_join(threads[w], NULL);
        else if (jobs[w].item_begin < jobs[w].item_end) run(&jobs[w]);
    }
    return 0;
}
