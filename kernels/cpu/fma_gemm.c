// Batch-invariant bfloat16 GEMM without AVX-512 (the avx2 level: AVX2 + FMA; ARM NEON from the same source):
// out[M, N] = x[M, K] @ W[N, K]^T, bfloat16 widened to fp32 in registers.
//
// Every output element is one fixed sequence of ops: a zeroed fp32 lane, then one FMA per element of K in
// ascending order (a bf16 product is exact in fp32, so each step rounds once), then one round to bfloat16.
// Rows of x never meet inside a lane, so a row's bits do not depend on how many rows share the call, the
// M blocks, which tiles a pass takes, how N is split over threads, or the thread count. W is packed once at
// load in pair_pack.h's layout (the avx512 level's): a 64-byte vector of 16 (even, odd) pairs widens to two
// fp32 vectors, one per element of K.
//
// One row (decode at batch 1) reads the weights at memory bandwidth: `row_block` widens its x values one by
// one. Several rows are compute-bound: `rows_block` widens a slab of their x to fp32 once, then each widened
// weight vector serves up to BLOCK_ROWS rows, each FMA's x a broadcast straight from that slab.
#include "simd.h"
#include "pair_pack.h"  // pack_index, tf_bf16_pack, tf_bf16_unpack_rows

#define BLOCK_ROWS 4   // rows of x per register block: 8 of AVX2's 16 registers (from 5, GCC spills some)
#define ACCUMULATORS 4 // 16-lane accumulators per block (rows x tiles of one pass)
#define CHUNK_ROWS 64  // rows per work item: threads split M in chunks as well as N in groups
#define ROWS CHUNK_ROWS  // rows per block_dispatch call (pair_gemm.h): the whole chunk
#define PREFETCH_PAIRS 32  // pairs of K ahead that a group's first pass prefetches
#define SLAB_K 256     // elements of K widened to fp32 at a time (BLOCK_ROWS x SLAB_K floats on the stack)
#define UNROLL _Pragma("GCC unroll 8")  // R and P unrolled whole, so the accumulators stay in registers

// One row x tiles [t0, t0 + P) of one group of T tiles (cols_left columns remain in W from tile 0).
static inline __attribute__((always_inline)) void row_block(const uint16_t *x, const uint16_t *b, int64_t k_tiles,
                                                             uint16_t *out, int64_t cols_left, int T, int t0,
                                                             const int P) {
    vf16 acc[ACCUMULATORS];
    UNROLL for (int t = 0; t < P; t++) acc[t] = vf_zero();
    for (int64_t kt = 0; kt < k_tiles; kt++) {
        const uint16_t *bk = b + kt * T * TILE_ELEMS, *xk = x + kt * TILE_K;
        for (int p = 0; p < TILE_K / 2; p++) {
            const vf16 even = vf_set1(bf16_to_float(xk[2 * p])), odd = vf_set1(bf16_to_float(xk[2 * p + 1]));
            UNROLL for (int t = 0; t < P; t++) {
                vf16 w_even, w_odd;
                bf16_pairs(bk + (p * T + t0 + t) * 2 * TILE_N, &w_even, &w_odd);
                acc[t] = vf_fma(even, w_even, acc[t]);
                acc[t] = vf_fma(odd, w_odd, acc[t]);
            }
        }
    }
    UNROLL for (int t = 0; t < P; t++) store16(out, (t0 + t) * TILE_N, DT_BF16, cols_left - (t0 + t) * TILE_N, acc[t]);
}

// Rows [0, rows) of x, elements [k0, k0 + len) widened to fp32 into slab[r * SLAB_K + i] (exact).
static inline void widen_slab(const uint16_t *x, int64_t ldx, int rows, int64_t k0, int len, float *slab) {
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < len; i++) slab[r * SLAB_K + i] = bf16_to_float(x[r * ldx + k0 + i]);
}

// Rows [0, R) x tiles [t0, t0 + P) of one group of T tiles, SLAB_K elements of K at a time. Per element of
// K, each tile's weights widen once (the even, then the odd element of each pair) and serve all R rows.
// `fetch` (the group's first pass, t0 = 0) prefetches every tile's weights ahead: the pass strides past the
// other tiles' lines, which the hardware prefetcher then leaves to a slow miss each.
static inline __attribute__((always_inline)) void rows_block(const uint16_t *x, int64_t ldx, const uint16_t *b,
                                                              int64_t k_tiles, uint16_t *out, int64_t ldo,
                                                              int64_t cols_left, int T, int t0, const int R,
                                                              const int P, int fetch) {
    float slab[BLOCK_ROWS * SLAB_K];
    vf16 acc[BLOCK_ROWS][ACCUMULATORS];
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int t = 0; t < P; t++) acc[r][t] = vf_zero();
    for (int64_t k0 = 0; k0 < k_tiles * TILE_K; k0 += SLAB_K) {
        const int len = (int)(k_tiles * TILE_K - k0 < SLAB_K ? k_tiles * TILE_K - k0 : SLAB_K);
        widen_slab(x, ldx, R, k0, len, slab);
        const int64_t pair_step = (int64_t)T * 2 * TILE_N;  // a group's pack holds its pairs of K in order
        const uint16_t *w = b + k0 / 2 * pair_step + t0 * 2 * TILE_N;
        for (int i = 0; i < len; i += 2, w += pair_step) {
            if (fetch)  // the group's first pass reads its tiles' lines of a pair (64 bytes each) for one tile
                for (int t = 0; t < T; t++) __builtin_prefetch(w + PREFETCH_PAIRS * pair_step + t * 2 * TILE_N);
            UNROLL for (int t = 0; t < P; t++) {
                const vf16 w_even = bf16_even(w + t * 2 * TILE_N);
                UNROLL for (int r = 0; r < R; r++) acc[r][t] = vf_fma(vf_set1(slab[r * SLAB_K + i]), w_even, acc[r][t]);
            }
            UNROLL for (int t = 0; t < P; t++) {
                const vf16 w_odd = bf16_odd(w + t * 2 * TILE_N);
                UNROLL for (int r = 0; r < R; r++)
                    acc[r][t] = vf_fma(vf_set1(slab[r * SLAB_K + i + 1]), w_odd, acc[r][t]);
            }
        }
    }
    UNROLL for (int t = 0; t < P; t++)
        UNROLL for (int r = 0; r < R; r++)
            store16(out + r * ldo, (t0 + t) * TILE_N, DT_BF16, cols_left - (t0 + t) * TILE_N, acc[r][t]);
}

#define ROW_CASE(P) \
    case P: row_block(x, b, k_tiles, out, cols_left, tiles, t0, P); break;
#define ROWS_CASE(R, P) \
    case (R) * 8 + (P): rows_block(xr, ldx, b, k_tiles, outr, ldo, cols_left, tiles, t0, R, P, t0 == 0 && r0 == 0); break;

// One group's tiles for the rows of one chunk. One row streams the group in one pass. More rows take it a
// pass of tiles at a time, every block of the chunk's rows over that pass before the next: each tile's weights
// come from memory once and serve the whole chunk from cache. R and P made constants so each case keeps its
// accumulators in registers.
static void block_dispatch(const uint16_t *x, int64_t ldx, const uint16_t *b, int64_t k_tiles, uint16_t *out,
                           int64_t ldo, int64_t cols_left, int rows, int tiles) {
    if (rows == 1) {
        const int t0 = 0;
        switch (tiles) { ROW_CASE(1) ROW_CASE(2) ROW_CASE(3) ROW_CASE(4) }
        return;
    }
    const int per_pass = rows == 2 ? 2 : 1;  // two rows take two tiles a pass (4 accumulators)
    for (int t0 = 0; t0 < tiles; t0 += per_pass) {
        const int pass = tiles - t0 < per_pass ? tiles - t0 : per_pass;
        for (int r0 = 0; r0 < rows; r0 += BLOCK_ROWS) {
            const int block = rows - r0 < BLOCK_ROWS ? rows - r0 : BLOCK_ROWS;
            const uint16_t *xr = x + r0 * ldx;
            uint16_t *outr = out + r0 * ldo;
            switch (block * 8 + pass) { ROWS_CASE(1, 1) ROWS_CASE(2, 1) ROWS_CASE(2, 2) ROWS_CASE(3, 1) ROWS_CASE(4, 1) }
        }
    }
}

#include "pair_gemm.h"  // pair_gemm: the work split, over block_dispatch above

// out [M, N] = x [M, K] @ W^T, W packed by tf_bf16_pack (pair_gemm.h says how the work is split).
void tf_fma_gemm(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                 uint16_t *out, int64_t ldo, int threads) {
    pair_gemm(x, m, k, ldx, packed, n, out, ldo, threads);
}
