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
 * seq_rows[t] and attends to keys 0 .. ctx_lens[t]-1, or with a sliding
 * window of W keys (window > 0) to keys ctx_lens[t]-W .. ctx_lens[t]-1 only.
 * A windowed token starts at the block holding its window's first key and
 * reads nothing before it: the blocks before may have been freed (their
 * entries in the block table then name blocks that other sequences own).
 * With a soft cap c > 0 (Gemma 2's attention logits), each scaled score s
 * becomes c * tanh(s / c) before the soft-max.
 * Work is split over threads by runs of tokens balanced on keys read.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "csrc_vec_math.h"

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
    int64_t window; /* keys a token sees; 0: all of its context */
    float softcap;  /* 0: none */
    float scale;
    int64_t t_begin, t_end;
    int64_t max_ctx;
} job_t;

/* Each of `heads` rows of `scores` (stride `stride`): its first `ctx`
 * entries s capped to cap * tanh(s / cap) in place (nothing when cap is 0).
 * tanh from exp_nonpos (a loop that vectorises): tanh|x| = (1 - e) / (1 + e),
 * e = exp(-2|x|). */
static void softcap_rows(float *scores, int64_t heads, int64_t stride, int64_t ctx, float cap) {
    if (cap <= 0.f) return;
    for (int64_t h = 0; h < heads; h++) {
        float *s = scores + h * stride;
        for (int64_t p = 0; p < ctx; p++) {
            const float x = s[p] / cap, e = exp_nonpos(-2.f * fabsf(x)), t = (1.f - e) / (1.f + e);
            s[p] = cap * (x < 0.f ? -t : t);
        }
    }
}

/* Each of `heads` rows of `scores` (stride `stride`): soft-max of its first
 * `ctx` entries in place, max-subtracted. */
static void softmax_rows(float *scores, int64_t heads, int64_t stride, int64_t ctx) {
    for (int64_t h = 0; h < heads; h++) {
        float *s = scores + h * stride;
        /* The max in 16 independent lanes: one running max would be a chain of
         * scalar compares (a strict-FP reduction GCC does not vectorise). */
        float lanes[16];
        for (int l = 0; l < 16; l++) lanes[l] = -INFINITY;
        int64_t p = 0;
        for (; p + 16 <= ctx; p += 16)
            for (int l = 0; l < 16; l++) lanes[l] = s[p + l] > lanes[l] ? s[p + l] : lanes[l];
        for (; p < ctx; p++) lanes[0] = s[p] > lanes[0] ? s[p] : lanes[0];
        float m = lanes[0], sum = 0.f;
        for (int l = 1; l < 16; l++) m = lanes[l] > m ? lanes[l] : m;
        for (p = 0; p < ctx; p++) { s[p] = exp_nonpos(s[p] - m); sum += s[p]; }
        const float inv = 1.f / sum;
        for (p = 0; p < ctx; p++) s[p] *= inv;
    }
}

/* The first key token t sees: its window's first, or 0. */
static inline int64_t first_key(const job_t *j, int64_t ctx) {
    return j->window > 0 && ctx > j->window ? ctx - j->window : 0;
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
        const int64_t first = first_key(j, j->ctx_lens[t]), base = first / bs * bs;
        /* Positions from `base` (the first key's block start) on, scores indexed from there. */
        const int64_t ctx = j->ctx_lens[t] - base, lead = first - base;
        const int64_t *bt = j->block_tables + j->seq_rows[t] * j->bt_stride + base / bs;
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
        softcap_rows(scores + lead, H, max_ctx, ctx - lead, j->softcap);
        softmax_rows(scores + lead, H, max_ctx, ctx - lead);
        /* Pass 2: weighted sum of values, accumulated per head in L1. */
        memset(acc, 0, sizeof(float) * H * D);
        for (int64_t p = lead; p < ctx; p++) {
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

/* ---- Block size 16, head size a multiple of 16: explicit vectors --------
 *
 * The generic path above keeps its partial sums in stack arrays, which the
 * compiler leaves in memory: every FMA loads and stores an accumulator. Here
 * accumulators are vector registers, sized for the ISA the file is built
 * for (kernels/cpu_isa.py), and the query heads of one KV group share each
 * key and value load. Pass 1 sums over d in two interleaved partials when a
 * block row is one vector (AVX-512), to break the FMA latency chain. */
#if defined(__AVX512F__)
#define VEC 16
#define P1_HEADS 4
#define P2_HEADS 4
#define P2_VECS 4
#elif defined(__AVX2__)
#define VEC 8
#define P1_HEADS 4
#define P2_HEADS 2
#define P2_VECS 4
#else
#define VEC 4
#define P1_HEADS 2
#define P2_HEADS 2
#define P2_VECS 2
#endif
#define ROW_VECS (16 / VEC)
#define P1_PARTS (ROW_VECS == 1 ? 2 : 1)
typedef float vf __attribute__((vector_size(VEC * 4), aligned(4)));

/* Scores of one block's 16 positions for `gh` query rows: row g's query at
 * q + g * qs (consecutive heads: qs = D), scores s [gh][stride]. With `shared` the heads are one
 * KV group and all read the keys kh [D][16]; without it (no GQA) head g
 * reads its own keys at kh + g * D * 16. `gh` and `shared` are literals. */
static inline __attribute__((always_inline)) void block_scores(const float *kh, const float *next, const float *q,
                                                               int64_t qs, int64_t D, float *s, int64_t stride,
                                                               float scale, int gh, int shared) {
    vf acc[P1_HEADS][ROW_VECS][P1_PARTS];
    for (int g = 0; g < gh; g++)
        for (int v = 0; v < ROW_VECS; v++)
            for (int p = 0; p < P1_PARTS; p++) acc[g][v][p] = (vf){0};
    for (int64_t d = 0; d < D; d += P1_PARTS) {
        for (int p = 0; p < P1_PARTS; p++) {
            vf k[ROW_VECS];
            for (int v = 0; v < ROW_VECS; v++) k[v] = *(const vf *)(kh + (d + p) * 16 + v * VEC);
            for (int g = 0; g < (shared ? 1 : gh); g++) __builtin_prefetch(next + g * D * 16 + (d + p) * 16, 0, 3);
            for (int g = 0; g < gh; g++) {
                const float qv = q[g * qs + d + p];
                for (int v = 0; v < ROW_VECS; v++) {
                    const vf kg = shared ? k[v] : *(const vf *)(kh + g * D * 16 + (d + p) * 16 + v * VEC);
                    acc[g][v][p] += kg * qv;
                }
            }
        }
    }
    for (int g = 0; g < gh; g++)
        for (int v = 0; v < ROW_VECS; v++) {
            vf sum = acc[g][v][0];
            for (int p = 1; p < P1_PARTS; p++) sum += acc[g][v][p];
            *(vf *)(s + g * stride + v * VEC) = sum * scale;
        }
}

/* out[g * os ..][0 .. nv*VEC) = sum over positions p < ctx of w[g][p] * V[p]
 * for `gh` rows (consecutive heads: os = D) and `nv` vectors of the head dimension; `voff`
 * selects the first head's KV head and slice within a position's row. With
 * `shared` the heads are one KV group (one V slice), without it head g
 * reads the slice D floats further on. `gh`, `nv`, `shared` are literals. */
static inline __attribute__((always_inline)) void block_values(const job_t *j, const int64_t *bt, int64_t ctx,
                                                               const float *w, int64_t stride, int64_t voff,
                                                               float *out, int64_t os, int gh, int nv, int shared) {
    const int64_t row = j->KVH * j->D;
    vf acc[P2_HEADS][P2_VECS];
    for (int g = 0; g < gh; g++)
        for (int c = 0; c < nv; c++) acc[g][c] = (vf){0};
    for (int64_t b = 0; b * 16 < ctx; b++) {
        const int64_t n = ctx - b * 16 < 16 ? ctx - b * 16 : 16;
        const float *vb = j->vc + bt[b] * 16 * row + voff;
        const float *next = (b + 1) * 16 < ctx ? j->vc + bt[b + 1] * 16 * row + voff : vb;
        for (int64_t i = 0; i < n; i++) {
            for (int g = 0; g < (shared ? 1 : gh); g++)
                for (int c = 0; c < nv; c++) __builtin_prefetch(next + i * row + g * j->D + c * VEC, 0, 3);
            vf v[P2_VECS];
            for (int c = 0; c < nv; c++) v[c] = *(const vf *)(vb + i * row + c * VEC);
            for (int g = 0; g < gh; g++) {
                const float wv = w[g * stride + b * 16 + i];
                for (int c = 0; c < nv; c++)
                    acc[g][c] += (shared ? v[c] : *(const vf *)(vb + i * row + g * j->D + c * VEC)) * wv;
            }
        }
    }
    for (int g = 0; g < gh; g++)
        for (int c = 0; c < nv; c++) *(vf *)(out + g * os + c * VEC) = acc[g][c];
}

/* block_scores with `gh` (1 .. P1_HEADS) and `shared` turned into literals. */
static void scores_run(const float *kh, const float *next, const float *q, int64_t qs, int64_t D, float *s,
                       int64_t stride, float scale, int gh, int shared) {
#define SCORES(GH) shared ? block_scores(kh, next, q, qs, D, s, stride, scale, GH, 1) \
                          : block_scores(kh, next, q, qs, D, s, stride, scale, GH, 0)
    switch (gh) {
        case 1: SCORES(1); break;
#if P1_HEADS > 2
        case 3: SCORES(3); break;
        case 4: SCORES(4); break;
#endif
        default: SCORES(2); break;
    }
#undef SCORES
}

/* block_values with `gh` (1 .. P2_HEADS), `nv` (1 .. P2_VECS) and `shared`
 * turned into literals: all three must be, for the accumulators to be registers. */
static void values_run(const job_t *j, const int64_t *bt, int64_t ctx, const float *w, int64_t stride,
                       int64_t voff, float *o, int64_t os, int gh, int nv, int shared) {
#define VALUES(GH, NV) shared ? block_values(j, bt, ctx, w, stride, voff, o, os, GH, NV, 1) \
                              : block_values(j, bt, ctx, w, stride, voff, o, os, GH, NV, 0)
    switch (gh * 8 + nv) {
        case 8 + 1: VALUES(1, 1); break;
        case 8 + 2: VALUES(1, 2); break;
        case 16 + 1: VALUES(2, 1); break;
        case 16 + 2: VALUES(2, 2); break;
#if P2_VECS > 2
        case 8 + 3: VALUES(1, 3); break;
        case 8 + 4: VALUES(1, 4); break;
        case 16 + 3: VALUES(2, 3); break;
        case 16 + 4: VALUES(2, 4); break;
#endif
#if P2_HEADS > 2
        case 24 + 1: VALUES(3, 1); break;
        case 24 + 2: VALUES(3, 2); break;
        case 24 + 3: VALUES(3, 3); break;
        case 24 + 4: VALUES(3, 4); break;
        case 32 + 1: VALUES(4, 1); break;
        case 32 + 2: VALUES(4, 2); break;
        case 32 + 3: VALUES(4, 3); break;
        case 32 + 4: VALUES(4, 4); break;
#endif
        default: break;
    }
#undef VALUES
}

/* Heads go in runs of up to P*_HEADS that share a KV head (GQA), or, with
 * one query head per KV head, runs of consecutive heads, each with its own
 * keys and values: either way several independent accumulator chains. */
static void run_bs16(job_t *j) {
    const int64_t H = j->H, KVH = j->KVH, G = j->H / j->KVH, D = j->D;
    const int shared = G > 1;
    /* A run never crosses a KV group: runs of a group's G heads, or of any heads without GQA. */
    const int64_t span = shared ? G : H;
    /* Whole blocks of scores are stored, so each row has room up to a block boundary. */
    const int64_t stride = ((j->max_ctx > 0 ? j->max_ctx : 1) + 15) / 16 * 16;
    float *scores = (float *)malloc(sizeof(float) * H * stride);
    for (int64_t t = j->t_begin; t < j->t_end; t++) {
        const int64_t first = first_key(j, j->ctx_lens[t]), base = first / 16 * 16;
        /* Positions from `base` (the first key's block start) on, scores indexed from there. */
        const int64_t ctx = j->ctx_lens[t] - base, lead = first - base;
        const int64_t *bt = j->block_tables + j->seq_rows[t] * j->bt_stride + base / 16;
        const float *qt = j->q + t * H * D;
        for (int64_t b = 0; b * 16 < ctx; b++) {
            const float *kb = j->kc + bt[b] * KVH * D * 16;
            const float *kn = (b + 1) * 16 < ctx ? j->kc + bt[b + 1] * KVH * D * 16 : kb;
            for (int64_t h = 0; h < H;) {
                const int64_t left = span - h % span;
                const int gh = (int)(left < P1_HEADS ? left : P1_HEADS);
                scores_run(kb + (h / G) * D * 16, kn + (h / G) * D * 16, qt + h * D, D, D,
                           scores + h * stride + b * 16, stride, j->scale, gh, shared);
                h += gh;
            }
        }
        softcap_rows(scores + lead, H, stride, ctx - lead, j->softcap);
        softmax_rows(scores + lead, H, stride, ctx - lead);
        /* The block's keys before the window weigh nothing in the value pass. */
        for (int64_t h = 0; h < H; h++) memset(scores + h * stride, 0, sizeof(float) * lead);
        for (int64_t h = 0; h < H;) {
            const int64_t left = span - h % span;
            const int gh = (int)(left < P2_HEADS ? left : P2_HEADS);
            for (int64_t c0 = 0; c0 < D / VEC; c0 += P2_VECS) {
                const int nv = (int)(D / VEC - c0 < P2_VECS ? D / VEC - c0 : P2_VECS);
                values_run(j, bt, ctx, scores + h * stride, stride, (h / G) * D + c0 * VEC,
                           j->out + (t * H + h) * D + c0 * VEC, D, gh, nv, shared);
            }
            h += gh;
        }
    }
    free(scores);
}

static void run(job_t *j) {
    if (j->bs == 16 && j->D % 16 == 0) {
        run_bs16(j);
        return;
    }
    run_impl(j, j->D, j->bs);
}

int paged_attention_decode_f32(const float *q, float *out, const float *kc, const float *vc,
                               const int64_t *block_tables, int64_t bt_stride,
                               const int64_t *seq_rows, const int64_t *ctx_lens, int64_t T,
                               int64_t H, int64_t KVH, int64_t D, int64_t bs, int64_t window,
                               float softcap, float scale, int num_threads) {
    if (num_threads < 1) num_threads = 1;
    if (num_threads > 64) num_threads = 64;
    /* Keys each token reads, from its first key's block start: the scores' extent. */
    int64_t *reads = (int64_t *)malloc(sizeof(int64_t) * (T > 0 ? T : 1));
    int64_t total = 0, max_ctx = 0;
    for (int64_t t = 0; t < T; t++) {
        const int64_t first = window > 0 && ctx_lens[t] > window ? ctx_lens[t] - window : 0;
        reads[t] = ctx_lens[t] - first / bs * bs;
        total += reads[t];
        if (reads[t] > max_ctx) max_ctx = reads[t];
    }
    /* Contiguous runs of tokens with roughly equal key counts, one per thread.
     * OpenMP, not pthreads: linked by soname, this shares torch's libgomp and
     * its thread pool, so no torch worker is left spinning against us. */
    int64_t bounds[65];
    bounds[0] = 0;
    int64_t t = 0, done = 0;
    for (int w = 0; w < num_threads; w++) {
        const int64_t target = total * (w + 1) / num_threads;
        while (t < T && (w == num_threads - 1 || done < target)) done += reads[t++];
        bounds[w + 1] = t;
    }
    free(reads);
#pragma omp parallel for num_threads(num_threads) schedule(static, 1)
    for (int w = 0; w < num_threads; w++) {
        job_t job = {q, out, kc, vc, block_tables, bt_stride, seq_rows, ctx_lens, H, KVH, D,
                     bs, window, softcap, scale, bounds[w], bounds[w + 1], max_ctx};
        if (job.t_begin < job.t_end) run(&job);
    }
    return 0;
}

/* ---- Prefill: many query tokens of one sequence ------------------------
 *
 * A prefill token attends to the keys up to its own position, all in the
 * cache when attention runs, exactly as a decode token does. What differs
 * is that many tokens share one sequence: runs of up to PF_ROWS consecutive
 * tokens of one sequence, one query head at a time, share every key load of
 * the score pass and (P2_HEADS at a time) every value load of the value pass,
 * where decode shares them among the heads of a KV group. A run scores up to
 * its longest context; each row is soft-maxed over its own and its weights
 * past it are zeroed, so the run sums values up to its longest context.
 * With a window, a run starts at the block of its earliest row's first key,
 * and each row's weights before its own first key are zeroed too.
 * Block size 16 and head size a multiple of 16 only (returns -1 otherwise). */
/* Rows per run of the prefill score pass: each key vector load feeds this
 * many FMAs per block; the accumulators (two blocks' worth per row, in
 * P1_PARTS partial sums) stay in registers. */
#if defined(__AVX512F__)
#define PF_ROWS 7
#else
#define PF_ROWS 2
#endif

/* Scores of two blocks' 16 positions each (keys k0, k1: [D][16]) for `rows`
 * query rows (row r at q + r * qs) into s [rows][stride], s[..][0..32). A
 * GEMM micro-kernel: per d, the keys are two vector loads and each row's
 * query element one broadcast. Each score is summed exactly as
 * `block_scores` sums it (the same partial sums over d, added in the same
 * order, then scaled), so a token's attention is the same bits whether it
 * comes as a decode or in a prefill: batch-invariant mode relies on it.
 * `rows` is a literal. */
static inline __attribute__((always_inline)) void pair_scores(const float *k0, const float *k1, const float *q,
                                                              int64_t qs, int64_t D, float *s, int64_t stride,
                                                              float scale, int rows) {
    vf acc[PF_ROWS][2 * ROW_VECS][P1_PARTS];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < 2 * ROW_VECS; v++)
            for (int p = 0; p < P1_PARTS; p++) acc[r][v][p] = (vf){0};
    for (int64_t d = 0; d < D; d += P1_PARTS) {
        for (int p = 0; p < P1_PARTS; p++) {
            vf k[2 * ROW_VECS];
            for (int v = 0; v < ROW_VECS; v++) {
                k[v] = *(const vf *)(k0 + (d + p) * 16 + v * VEC);
                k[ROW_VECS + v] = *(const vf *)(k1 + (d + p) * 16 + v * VEC);
            }
            for (int r = 0; r < rows; r++) {
                const float qv = q[r * qs + d + p];
                for (int v = 0; v < 2 * ROW_VECS; v++) acc[r][v][p] += k[v] * qv;
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < 2 * ROW_VECS; v++) {
            vf sum = acc[r][v][0];
            for (int p = 1; p < P1_PARTS; p++) sum += acc[r][v][p];
            *(vf *)(s + r * stride + v * VEC) = sum * scale;
        }
}

static void pair_scores_run(const float *k0, const float *k1, const float *q, int64_t qs, int64_t D, float *s,
                            int64_t stride, float scale, int rows) {
    switch (rows) {
        case 1: pair_scores(k0, k1, q, qs, D, s, stride, scale, 1); break;
#if PF_ROWS > 2
        case 3: pair_scores(k0, k1, q, qs, D, s, stride, scale, 3); break;
        case 4: pair_scores(k0, k1, q, qs, D, s, stride, scale, 4); break;
        case 5: pair_scores(k0, k1, q, qs, D, s, stride, scale, 5); break;
        case 6: pair_scores(k0, k1, q, qs, D, s, stride, scale, 6); break;
        case 7: pair_scores(k0, k1, q, qs, D, s, stride, scale, 7); break;
#endif
        default: pair_scores(k0, k1, q, qs, D, s, stride, scale, 2); break;
    }
}

static void prefill_run(const job_t *j, int64_t t0, int64_t rows, int64_t h, float *scores, int64_t stride) {
    const int64_t H = j->H, G = j->H / j->KVH, D = j->D, KVH = j->KVH;
    /* From the block of the run's earliest window start on, positions indexed from there. */
    int64_t ctx = 0, first = j->ctx_lens[t0];
    for (int64_t i = 0; i < rows; i++) {
        const int64_t own = j->ctx_lens[t0 + i], own_first = first_key(j, own);
        ctx = own > ctx ? own : ctx;
        first = own_first < first ? own_first : first;
    }
    const int64_t base = first / 16 * 16;
    ctx -= base;
    const int64_t *bt = j->block_tables + j->seq_rows[t0] * j->bt_stride + base / 16;
    const float *q = j->q + t0 * H * D + h * D;
    const int64_t blocks = (ctx + 15) / 16;
    for (int64_t b = 0; b < blocks; b += 2) {
        const float *k0 = j->kc + (bt[b] * KVH + h / G) * D * 16;
        /* An odd last block is scored twice (its pair is itself): the same values. */
        const float *k1 = b + 1 < blocks ? j->kc + (bt[b + 1] * KVH + h / G) * D * 16 : k0;
        pair_scores_run(k0, k1, q, H * D, D, scores + b * 16, stride, j->scale, (int)rows);
    }
    for (int64_t i = 0; i < rows; i++) {
        /* Each row soft-maxed over its own keys exactly as the decode kernel
         * does it (the same extent, from its window's first key), zero elsewhere. */
        const int64_t own_first = first_key(j, j->ctx_lens[t0 + i]) - base, own = j->ctx_lens[t0 + i] - base;
        float *s = scores + i * stride;
        softcap_rows(s + own_first, 1, stride, own - own_first, j->softcap);
        softmax_rows(s + own_first, 1, stride, own - own_first);
        memset(s, 0, sizeof(float) * own_first);
        for (int64_t p = own; p < ctx; p++) s[p] = 0.f;
    }
    for (int64_t i = 0; i < rows; i += P2_HEADS) {
        const int gh = (int)(rows - i < P2_HEADS ? rows - i : P2_HEADS);
        for (int64_t c0 = 0; c0 < D / VEC; c0 += P2_VECS) {
            const int nv = (int)(D / VEC - c0 < P2_VECS ? D / VEC - c0 : P2_VECS);
            values_run(j, bt, ctx, scores + i * stride, stride, (h / G) * D + c0 * VEC,
                       j->out + ((t0 + i) * H + h) * D + c0 * VEC, H * D, gh, nv, 1);
        }
    }
}

int paged_attention_prefill_f32(const float *q, float *out, const float *kc, const float *vc,
                                const int64_t *block_tables, int64_t bt_stride,
                                const int64_t *seq_rows, const int64_t *ctx_lens, int64_t T,
                                int64_t H, int64_t KVH, int64_t D, int64_t bs, int64_t window,
                                float softcap, float scale, int num_threads) {
    if (bs != 16 || D % 16 != 0) return -1;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > 64) num_threads = 64;
    /* Runs: consecutive tokens of one block-table row, at most P1_HEADS each. */
    int64_t *starts = (int64_t *)malloc(sizeof(int64_t) * (T + 1));
    int64_t runs = 0, max_ctx = 1;
    for (int64_t t = 0; t < T; t++) {
        if (t == 0 || seq_rows[t] != seq_rows[t - 1] || t - starts[runs - 1] == PF_ROWS) starts[runs++] = t;
        if (ctx_lens[t] > max_ctx) max_ctx = ctx_lens[t];
    }
    starts[runs] = T;
    /* Room for whole pairs of blocks. */
    const int64_t stride = (max_ctx + 31) / 32 * 32;
    const job_t job = {q, out, kc, vc, block_tables, bt_stride, seq_rows, ctx_lens, H, KVH, D,
                       bs, window, softcap, scale, 0, T, max_ctx};
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * PF_ROWS * stride);
        /* Last runs first: they are the longest, so the dynamic schedule ends balanced. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = runs * H - 1; w >= 0; w--) {
            const int64_t r = w / H;
            prefill_run(&job, starts[r], starts[r + 1] - starts[r], w % H, scores, stride);
        }
        free(scores);
    }
    free(starts);
    return 0;
}
