// Batch-invariant bfloat16 GEMM on AVX512-BF16 (CPUs without AMX): out[M, N] = x[M, K] @ W[N, K]^T.
//
// Every output element is one fixed sequence of ops: a zeroed fp32 lane, then VDPBF16PS over the pairs of
// K in ascending order, then one round to bfloat16. Rows of x never meet inside a lane, so a row's bits do
// not depend on how many rows share the call, the M blocks, how N is split over threads, or the thread
// count. W is packed once at load (pack_index): each pair of K of 16 columns is one 64-byte vector, and a
// block of up to ROWS rows by one group of n tiles reads the group's pack once, front to back.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define ROWS 4          // rows of x per register block (ROWS x GROUP_N accumulators)
#define CHUNK_ROWS 64   // rows per work item: threads split M in chunks as well as N in groups

#include "pair_pack.h"  // the pack's layout (pack_index), tf_bf16_pack, tf_bf16_unpack_rows

// out rows [0, R) x columns of one group's T tiles (cols_left columns remain in W from there).
static inline __attribute__((always_inline)) void block(const uint16_t *x, int64_t ldx, const uint16_t *b,
                                                         int64_t k_tiles, uint16_t *out, int64_t ldo,
                                                         int64_t cols_left, const int R, const int T) {
    __m512 acc[ROWS][GROUP_N];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
    for (int64_t kt = 0; kt < k_tiles; kt++) {
        const uint16_t *bk = b + kt * T * TILE_ELEMS, *xk = x + kt * TILE_K;
        for (int p = 0; p < TILE_K / 2; p++) {
            __m512bh w[GROUP_N];
            for (int t = 0; t < T; t++) w[t] = (__m512bh)_mm512_loadu_si512(bk + (p * T + t) * 2 * TILE_N);
            for (int r = 0; r < R; r++) {
                int32_t pair;
                memcpy(&pair, xk + r * ldx + 2 * p, sizeof(pair));
                const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
                for (int t = 0; t < T; t++) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], a, w[t]);
            }
        }
    }
    for (int t = 0; t < T; t++) {
        const int64_t left = cols_left - t * TILE_N;
        const __mmask16 mask = left >= TILE_N ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
        for (int r = 0; r < R; r++)
            _mm256_mask_storeu_epi16(out + r * ldo + t * TILE_N, mask, (__m256i)_mm512_cvtneps_pbh(acc[r][t]));
    }
}

#define BLOCK_CASE(R, T) \
    case (R) * 8 + (T): block(x, ldx, b, k_tiles, out, ldo, cols_left, R, T); return;

// One block, its R and T made constants so each case keeps its accumulators in registers.
static void block_dispatch(const uint16_t *x, int64_t ldx, const uint16_t *b, int64_t k_tiles, uint16_t *out,
                           int64_t ldo, int64_t cols_left, int rows, int tiles) {
    switch (rows * 8 + tiles) {
        BLOCK_CASE(1, 1) BLOCK_CASE(1, 2) BLOCK_CASE(1, 3) BLOCK_CASE(1, 4)
        BLOCK_CASE(2, 1) BLOCK_CASE(2, 2) BLOCK_CASE(2, 3) BLOCK_CASE(2, 4)
        BLOCK_CASE(3, 1) BLOCK_CASE(3, 2) BLOCK_CASE(3, 3) BLOCK_CASE(3, 4)
        BLOCK_CASE(4, 1) BLOCK_CASE(4, 2) BLOCK_CASE(4, 3) BLOCK_CASE(4, 4)
    }
}

#include "pair_gemm.h"  // pair_gemm: the work split, over block_dispatch above

// out [M, N] = x [M, K] @ W^T, W packed by tf_bf16_pack (pair_gemm.h says how the work is split).
void tf_avx512_gemm(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                    uint16_t *out, int64_t ldo, int threads) {
    pair_gemm(x, m, k, ldx, packed, n, out, ldo, threads);
}
