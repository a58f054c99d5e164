/*
 * float32 GEMM against a pre-packed weight: y[M, N] = x[M, K] @ W^T, with W
 * ([N, K] as checkpoints store it) packed once into column tiles of TILE
 * outputs, each [K][TILE] contiguous (the last tile zero-padded).
 *
 * Why: a decode step multiplies a few rows (one per running request) by
 * every weight of the model, so it is bound by reading the weights once.
 * MKL's sgemm packs its B operand on every call, i.e. reads and writes the
 * whole weight again; measured in a decode step of the 25M Llama at 16 rows,
 * the decoder layers' products ran 3-4x slower than with their weights hot
 * in cache, the LM head's 1.7x slower. Here each weight tile
 * is read from memory once per call and then kept in L1/L2 while every block
 * of rows is multiplied by it.
 *
 * The microkernel keeps ROWS x TILE accumulators in vector registers and
 * adds x[r, k] * Wp[k, :] for k = 0..K-1 in order, so every output is a
 * sequential float32 sum over k (like a naive dot product, not MKL's order).
 * Threads split the column tiles.
 *
 * The register blocking follows the ISA the file is compiled for (the
 * variants of kernels/cpu_isa.py), so that the accumulators, the NV weight
 * vectors of a tile row and one broadcast always fit the register file:
 *   AVX-512: 16-float vectors, TILE 48 (3 vectors), 8 rows: 24 + 3 of 32 zmm
 *   AVX2:     8-float vectors, TILE 16 (2 vectors), 6 rows: 12 + 2 of 16 ymm
 *   baseline: 4-float vectors, TILE 8  (2 vectors), 6 rows: 12 + 2 of 16 xmm
 *             (SSE2; NEON has 32)
 * On AVX-512, 8 x 3 needs 11 loads per 24 FMAs where 12 x 2 needed 14, and
 * ran 5-10% faster with the tile in cache; on AVX2, 4 x 3 and 3 x 4 ran
 * behind 6 x 2 (docs/BENCHMARKS.md). The AVX-512 blocking built for AVX2
 * spills its accumulators in the inner loop (issue 14 measured it 10-50x
 * slower). The packed layout depends on TILE, so callers ask
 * `gemm_tile_cols()` of the library they pack for.
 */
#include <stdint.h>
#include <stddef.h>
#include <string.h>

#if defined(__AVX512F__)
#define VEC 16
#define ROWS 8
#define NV 3
#elif defined(__AVX2__)
#define VEC 8
#define ROWS 6
#define NV 2
#else
#define VEC 4
#define ROWS 6
#define NV 2
#endif
#define TILE (NV * VEC)
#define ROW_CHUNK (16 * ROWS)
/* Weight-tile rows fetched ahead (2 KiB); hardware prefetch alone left the
 * 16-row LM head product 20% slower on AVX-512. */
#define PREFETCH_ROWS (2048 / (TILE * 4))

/* VEC floats; aligned(4) so loads and stores need no vector alignment. */
typedef float vf __attribute__((vector_size(VEC * 4), aligned(4)));

int64_t gemm_tile_cols(void) { return TILE; }

/* Tile by tile, each written in order (its TILE source rows read side by
 * side), threads splitting the tiles: a weight update repacks every layer
 * (writing column by column after a memset of the whole packing was the
 * largest part of a reload; docs/BENCHMARKS.md). Only the last tile's
 * padding columns are zeroed. */
static void pack_tiles(const float *w, float *packed, int64_t n, int64_t k, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
        float *dst = packed + t * TILE * k;
        int64_t cols = n - t * TILE < TILE ? n - t * TILE : TILE;
        const float *src = w + t * TILE * k;
        for (int64_t i = 0; i < k; i++) {
            float *row = dst + i * TILE;
            for (int64_t c = 0; c < cols; c++) row[c] = src[c * k + i];
            for (int64_t c = cols; c < TILE; c++) row[c] = 0.0f;
        }
    }
}

/* `fn` over units [0, units) of an n x k weight, the threads (at most one
 * per unit) taking equal runs of them. */
typedef void (*unit_fn)(const float *w, float *out, int64_t n, int64_t k, int64_t u0, int64_t u1);
static void over_threads(unit_fn fn, const float *w, float *out, int64_t n, int64_t k, int64_t units,
                         int num_threads) {
    if (num_threads > units) num_threads = (int)units;
    if (num_threads < 2) {
        fn(w, out, n, k, 0, units);
        return;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static, 1)
    for (int t = 0; t < num_threads; t++) fn(w, out, n, k, units * t / num_threads, units * (t + 1) / num_threads);
}

void pack_weight_f32(const float *w, float *packed, int64_t n, int64_t k, int num_threads) {
    over_threads(pack_tiles, w, packed, n, k, (n + TILE - 1) / TILE, num_threads);
}

/* out [k, n] = w [n, k] transposed, for torch.mm's `[in, out]` layout of a
 * weight: TBLOCK x TBLOCK blocks (the block of w read across and the block
 * of out written along both stay in L1), threads splitting out's rows by
 * blocks. A strided copy (torch's `copy_` of `w.t()`) was the largest part
 * of a weight update (docs/BENCHMARKS.md). */
#define TBLOCK 32
static void transpose_blocks(const float *w, float *out, int64_t n, int64_t k, int64_t b0, int64_t b1) {
    for (int64_t ib = b0 * TBLOCK; ib < b1 * TBLOCK && ib < k; ib += TBLOCK) {
        int64_t ie = ib + TBLOCK < k ? ib + TBLOCK : k;
        for (int64_t cb = 0; cb < n; cb += TBLOCK) {
            int64_t ce = cb + TBLOCK < n ? cb + TBLOCK : n;
            for (int64_t i = ib; i < ie; i++)
                for (int64_t c = cb; c < ce; c++) out[i * n + c] = w[c * k + i];
        }
    }
}

void transpose_f32(const float *w, float *out, int64_t n, int64_t k, int num_threads) {
    over_threads(transpose_blocks, w, out, n, k, (k + TBLOCK - 1) / TBLOCK, num_threads);
}

/* rows (<= ROWS) x TILE outputs; `rows` is a literal at every call site, so
 * the accumulators become registers. The block also fetches `pf_lines`
 * lines of `pf` into L2, part of the next tile, so that its read from memory
 * overlaps this tile's arithmetic. The fetches are spread evenly over the k
 * iterations, at most one per iteration: issued back to back they held the
 * line-fill buffers that this tile's own loads from L2 need (48 rows: 10%
 * slower), and two per iteration slowed the one-block products of 4-8 rows
 * (docs/BENCHMARKS.md); what is left over goes to the hardware prefetcher. */
static inline __attribute__((always_inline)) void tile_block(
    const float *x, int64_t ldx, const float *wt, float *out, int64_t ldo, int64_t k, int rows,
    const float *pf, int64_t pf_lines) {
    vf acc[ROWS][NV];
#pragma GCC unroll 12
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = (vf){0};
    int64_t due = 0, line = 0;
    for (int64_t i = 0; i < k; i++) {
        /* One prefetch per 64-byte line of the tile row (a constant trip count). */
        for (int c = 0; c < TILE; c += 16) __builtin_prefetch(wt + (i + PREFETCH_ROWS) * TILE + c);
        due += pf_lines;
        if (due >= k) {
            due -= k;
            __builtin_prefetch(pf + line * 16, 0, 2);
            line++;
        }
        vf w[NV];
        for (int v = 0; v < NV; v++) w[v] = *(const vf *)(wt + i * TILE + v * VEC);
#pragma GCC unroll 12
        for (int r = 0; r < rows; r++) {
            float xv = x[r * ldx + i];
            for (int v = 0; v < NV; v++) acc[r][v] += w[v] * xv;
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < NV; v++) *(vf *)(out + r * ldo + v * VEC) = acc[r][v];
}

/* All m rows against one tile. `next` (or NULL): the tile to fetch ahead,
 * its lines spread over this tile's row blocks. */
static void tile_rows(const float *x, int64_t ldx, const float *wt, float *out, int64_t ldo, int64_t k, int64_t m,
                      const float *next) {
    const int64_t blocks = (m + ROWS - 1) / ROWS;
    const int64_t lines = next ? TILE * k / 16 : 0;
    const int64_t per_block = (lines + blocks - 1) / blocks;
    int64_t r = 0, b = 0;
#define PF_ARGS next + b * per_block * 16, (lines - b * per_block < per_block ? lines - b * per_block : per_block)
    for (; r + ROWS <= m; r += ROWS, b++) tile_block(x + r * ldx, ldx, wt, out + r * ldo, ldo, k, ROWS, PF_ARGS);
    const float *xr = x + r * ldx;
    float *o = out + r * ldo;
    /* `rows` must be a literal for the accumulators to stay in registers. */
    switch (m - r) {
#if ROWS > 6
        case 7: tile_block(xr, ldx, wt, o, ldo, k, 7, PF_ARGS); break;
        case 6: tile_block(xr, ldx, wt, o, ldo, k, 6, PF_ARGS); break;
#endif
        case 5: tile_block(xr, ldx, wt, o, ldo, k, 5, PF_ARGS); break;
        case 4: tile_block(xr, ldx, wt, o, ldo, k, 4, PF_ARGS); break;
        case 3: tile_block(xr, ldx, wt, o, ldo, k, 3, PF_ARGS); break;
        case 2: tile_block(xr, ldx, wt, o, ldo, k, 2, PF_ARGS); break;
        case 1: tile_block(xr, ldx, wt, o, ldo, k, 1, PF_ARGS); break;
        default: break;
    }
#undef PF_ARGS
}

/* Tiles [t0, t1) of the output. A full tile is written in place; the padded
 * last one goes through a scratch buffer so nothing past column n is written. */
static void gemm_tiles(const float *x, const float *packed, float *y, int64_t m, int64_t n, int64_t k,
                       int64_t t0, int64_t t1) {
    float scratch[ROWS * TILE];
    for (int64_t t = t0; t < t1; t++) {
        const float *wt = packed + t * TILE * k;
        int64_t col = t * TILE;
        if (col + TILE <= n) {
            tile_rows(x, k, wt, y + col, n, k, m, t + 1 < t1 ? wt + TILE * k : NULL);
            continue;
        }
        for (int64_t r = 0; r < m; r += ROWS) {
            int64_t rows = m - r < ROWS ? m - r : ROWS;
            tile_rows(x + r * k, k, wt, scratch, TILE, k, rows, NULL);
            for (int64_t i = 0; i < rows; i++) memcpy(y + (r + i) * n + col, scratch + i * TILE, (size_t)(n - col) * sizeof(float));
        }
    }
}

/* x [m, k] and y [m, n] contiguous; `packed` from pack_weight_f32. Rows go
 * in chunks of ROW_CHUNK so a chunk of x stays in L2 while every tile passes
 * over it (one pass over all of x per tile ran 20% behind MKL at 1024 rows). */
void gemm_packed_f32(const float *x, const float *packed, float *y, int64_t m, int64_t n, int64_t k,
                     int num_threads) {
    int64_t tiles = (n + TILE - 1) / TILE;
    if (num_threads > tiles) num_threads = (int)tiles;
    for (int64_t r0 = 0; r0 < m; r0 += ROW_CHUNK) {
        int64_t rows = m - r0 < ROW_CHUNK ? m - r0 : ROW_CHUNK;
        const float *xc = x + r0 * k;
        float *yc = y + r0 * n;
        if (num_threads < 2) {
            gemm_tiles(xc, packed, yc, rows, n, k, 0, tiles);
            continue;
        }
#pragma omp parallel for num_threads(num_threads) schedule(static, 1)
        for (int w = 0; w < num_threads; w++)
            gemm_tiles(xc, packed, yc, rows, n, k, tiles * w / num_threads, tiles * (w + 1) / num_threads);
    }
}
