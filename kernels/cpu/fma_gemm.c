// Batch-invariant bfloat16 GEMM without AVX-512 (the avx2 level: AVX2 + FMA; ARM NEON from the same source):
// out[M, N] = x[M, K] @ W[N, K]^T, bfloat16 widened to fp32 in registers.
//
// Every output element is one fixed sequence of ops: a zeroed fp32 lane, then one FMA per element of K in
// ascending order (a bf16 product is exact in fp32, so each step rounds once), then one round to bfloat16.
// Rows of x never meet inside a lane, so a row's bits do not depend on how many rows share the call, the
// M blocks, which tiles a pass takes, how N is split over threads, or the thread count. W is packed once at
// load in pair_pack.h's layout (the avx512 level's): a 64-byte vector of 16 (even, odd) pairs widens to two
// fp32 vectors, one per element of K.
#include "simd.h"
#include "pair_pack.h"  // pack_index, tf_bf16_pack, tf_bf16_unpack_rows

#define ROWS 4         // rows of x per register block
#define ACCUMULATORS 4 // 16-lane accumulators per block (rows x tiles of one pass), half the register file
#define CHUNK_ROWS 64  // rows per work item: threads split M in chunks as well as N in groups
#define UNROLL _Pragma("GCC unroll 4")  // R and P unrolled whole, so the accumulators stay in registers

// out rows [0, R) x tiles [t0, t0 + P) of one group of T tiles (cols_left columns remain in W from tile 0).
static inline __attribute__((always_inline)) void block(const uint16_t *x, int64_t ldx, const uint16_t *b,
                                                         int64_t k_tiles, uint16_t *out, int64_t ldo,
                                                         int64_t cols_left, int T, int t0, const int R,
                                                         const int P) {
    vf16 acc[ROWS][ACCUMULATORS];
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int t = 0; t < P; t++) acc[r][t] = vf_zero();
    for (int64_t kt = 0; kt < k_tiles; kt++) {
        const uint16_t *bk = b + kt * T * TILE_ELEMS, *xk = x + kt * TILE_K;
        for (int p = 0; p < TILE_K / 2; p++) {
            vf16 even[ROWS], odd[ROWS];
            UNROLL for (int r = 0; r < R; r++) {
                even[r] = vf_set1(bf16_to_float(xk[r * ldx + 2 * p]));
                odd[r] = vf_set1(bf16_to_float(xk[r * ldx + 2 * p + 1]));
            }
            UNROLL for (int t = 0; t < P; t++) {
                vf16 w_even, w_odd;
                bf16_pairs(bk + (p * T + t0 + t) * 2 * TILE_N, &w_even, &w_odd);
                UNROLL for (int r = 0; r < R; r++) acc[r][t] = vf_fma(even[r], w_even, acc[r][t]);
                UNROLL for (int r = 0; r < R; r++) acc[r][t] = vf_fma(odd[r], w_odd, acc[r][t]);
            }
        }
    }
    UNROLL for (int t = 0; t < P; t++)
        UNROLL for (int r = 0; r < R; r++)
            store16(out + r * ldo, (t0 + t) * TILE_N, DT_BF16, cols_left - (t0 + t) * TILE_N, acc[r][t]);
}

#define BLOCK_CASE(R, P) \
    case (R) * 8 + (P): block(x, ldx, b, k_tiles, out, ldo, cols_left, tiles, t0, R, P); break;

// One group's tiles for up to ROWS rows, in passes of as many tiles as the accumulators allow; R and P made
// constants so each case keeps its accumulators in registers.
static void block_dispatch(const uint16_t *x, int64_t ldx, const uint16_t *b, int64_t k_tiles, uint16_t *out,
                           int64_t ldo, int64_t cols_left, int rows, int tiles) {
    const int per_pass = ACCUMULATORS / rows > 0 ? ACCUMULATORS / rows : 1;
    for (int t0 = 0; t0 < tiles; t0 += per_pass) {
        const int pass = tiles - t0 < per_pass ? tiles - t0 : per_pass;
        switch (rows * 8 + pass) {
            BLOCK_CASE(1, 1) BLOCK_CASE(1, 2) BLOCK_CASE(1, 3) BLOCK_CASE(1, 4)
            BLOCK_CASE(2, 1) BLOCK_CASE(2, 2) BLOCK_CASE(3, 1) BLOCK_CASE(4, 1)
        }
    }
}

#include "pair_gemm.h"  // pair_gemm: the work split, over block_dispatch above

// out [M, N] = x [M, K] @ W^T, W packed by tf_bf16_pack (pair_gemm.h says how the work is split).
void tf_fma_gemm(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                 uint16_t *out, int64_t ldo, int threads) {
    pair_gemm(x, m, k, ldx, packed, n, out, ldo, threads);
}
