// Packing a bfloat16 weight W [N, K] once at load for a GEMM kernel, and reading rows of it back out (the
// tied embedding reads the lm_head's pack).
//
// The including source defines its layout first:
//   static inline int64_t pack_index(int64_t nt, int64_t kt, int p, int j, int h, int64_t n_tiles,
//                                    int64_t k_tiles)
// where element (row nt*16 + j, column kt*32 + 2p + h) of W lies in the pack, then includes this file.
// The pack is zero-padded to n_pad = ceil(N/16)*16 rows and k_pad = ceil(K/32)*32 columns.
#ifndef TENSORFOLD_BF16_PACK_H
#define TENSORFOLD_BF16_PACK_H

#include <stdint.h>

// Pack W [N, K] (row stride ldw elements) into `packed` (n_pad * k_pad elements).
void tf_bf16_pack(const uint16_t *w, int64_t n, int64_t k, int64_t ldw, uint16_t *packed) {
    const int64_t n_tiles = (n + TILE_N - 1) / TILE_N, k_tiles = (k + TILE_K - 1) / TILE_K;
    for (int64_t nt = 0; nt < n_tiles; nt++) {
        for (int64_t kt = 0; kt < k_tiles; kt++) {
            for (int p = 0; p < TILE_K / 2; p++) {
                for (int j = 0; j < TILE_N; j++) {
                    const int64_t row = nt * TILE_N + j;
                    for (int h = 0; h < 2; h++) {
                        const int64_t col = kt * TILE_K + 2 * p + h;
                        packed[pack_index(nt, kt, p, j, h, n_tiles, k_tiles)] =
                            (row < n && col < k) ? w[row * ldw + col] : 0;
                    }
                }
            }
        }
    }
}

// Rows `ids` [count] of the original W out of the pack, into out [count, K].
void tf_bf16_unpack_rows(const uint16_t *packed, int64_t n, int64_t k, const int64_t *ids, int64_t count,
                         uint16_t *out) {
    const int64_t k_tiles = (k + TILE_K - 1) / TILE_K, n_tiles = (n + TILE_N - 1) / TILE_N;
    for (int64_t r = 0; r < count; r++) {
        const int64_t row = ids[r], nt = row / TILE_N;
        const int j = (int)(row % TILE_N);
        for (int64_t col = 0; col < k; col++) {
            const int64_t kt = col / TILE_K;
            const int p = (int)(col % TILE_K) / 2, h = (int)(col % 2);
            out[r * k + col] = packed[pack_index(nt, kt, p, j, h, n_tiles, k_tiles)];
        }
    }
}

#endif
