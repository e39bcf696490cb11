// The GEMM driver both pair-packed GEMMs share (avx512_gemm.c, fma_gemm.c): the same split of the work,
// with the including file's register block. Include it after defining ROWS, CHUNK_ROWS and block_dispatch;
// each output element's sum over K stays inside one block call, so the split never changes a bit.
#ifndef TENSORFOLD_PAIR_GEMM_H
#define TENSORFOLD_PAIR_GEMM_H

#include <stdint.h>

#include "pair_pack.h"

// out [M, N] (row stride ldo) = x [M, K] (row stride ldx) @ W^T, with W packed by tf_bf16_pack; K must be
// a multiple of TILE_K (the pack's padding would meet x's next elements otherwise). Threads take work
// items of one W group (n tiles, kept in cache) by one chunk of CHUNK_ROWS rows.
static void pair_gemm(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                      uint16_t *out, int64_t ldo, int threads) {
    const int64_t k_tiles = k / TILE_K, n_tiles = (n + TILE_N - 1) / TILE_N;
    const int64_t groups = (n_tiles + GROUP_N - 1) / GROUP_N, chunks = (m + CHUNK_ROWS - 1) / CHUNK_ROWS;
    const int64_t work = groups * chunks;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && work > 1)
    for (int64_t item = 0; item < work; item++) {
        const int64_t group = item / chunks, chunk = item % chunks;
        const int64_t nt0 = group * GROUP_N;
        const int tiles = (int)(n_tiles - nt0 < GROUP_N ? n_tiles - nt0 : GROUP_N);
        const uint16_t *b = packed + pack_index(nt0, 0, 0, 0, 0, n_tiles, k_tiles);
        const int64_t end = (chunk + 1) * CHUNK_ROWS < m ? (chunk + 1) * CHUNK_ROWS : m;
        for (int64_t r0 = chunk * CHUNK_ROWS; r0 < end; r0 += ROWS) {
            const int rows = (int)(end - r0 < ROWS ? end - r0 : ROWS);
            block_dispatch(x + r0 * ldx, ldx, b, k_tiles, out + r0 * ldo + nt0 * TILE_N, ldo, n - nt0 * TILE_N, rows,
                           tiles);
        }
    }
}

#endif
