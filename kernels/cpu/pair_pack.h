// The pair-major pack of a bfloat16 weight W [N, K] that the avx512 and avx2 (and NEON) GEMMs read.
//
// Groups of GROUP_N tiles of 16 columns, each group K-major, and in each 32-wide K step pair-major, the group's
// tiles side by side: [kt][p][tile][16 n][2]. One pair of K of one tile is 64 bytes: a 16-lane vector of
// (even, odd) bfloat16 pairs. Every load of a block walks forward through memory (tiles 1 KiB apart read
// together stream at a third of the bandwidth).
#ifndef TENSORFOLD_PAIR_PACK_H
#define TENSORFOLD_PAIR_PACK_H

#include <stdint.h>

#define TILE_N 16   // columns of W per tile: one fp32 vector of accumulators
#define TILE_K 32   // bfloat16 elements of K per step (16 pairs)
#define GROUP_N 4   // n tiles streamed together
#define TILE_ELEMS (TILE_K * TILE_N)

// Element (nt*16 + j, kt*32 + 2p + h) of W in the pack.
static inline int64_t pack_index(int64_t nt, int64_t kt, int p, int j, int h, int64_t n_tiles, int64_t k_tiles) {
    const int64_t group = nt / GROUP_N, g = nt % GROUP_N;
    const int64_t count = n_tiles - group * GROUP_N < GROUP_N ? n_tiles - group * GROUP_N : GROUP_N;
    return group * GROUP_N * k_tiles * TILE_ELEMS + (kt * TILE_K / 2 + p) * count * TILE_N * 2 + g * TILE_N * 2 +
           j * 2 + h;
}

#include "bf16_pack.h"  // tf_bf16_pack, tf_bf16_unpack_rows over pack_index

#endif
