// Batch-invariant bfloat16 GEMM on Intel AMX: out[M, N] = x[M, K] @ W[N, K]^T, rounded to bfloat16.
//
// Every output element is one fixed sequence of tile ops: a zeroed fp32 tile, then TDPBF16PS over the
// 32-wide K blocks in ascending order, then one round to bfloat16. Rows of x never meet inside a tile, so
// a row's bits do not depend on how many rows share the call, how N is split over threads, or the thread
// count. x is copied into a zero-padded 16-row panel; W is packed once at load into AMX's pair layout
// (tf_bf16_pack).
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define TILE_M 16   // rows of x per tile
#define TILE_N 16   // columns of W per tile
#define TILE_K 32   // bfloat16 elements of K per tile (16 pairs)
#define GROUP_N 4   // n tiles accumulated together (tiles 0..3)

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

// Ask the kernel for the AMX register state (once per process); 0 on success.
int tf_amx_init(void) {
    return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
}

static void configure_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {  // 0-3: fp32 accumulators, 4: x panel, 5-7: packed W
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

// Where tile (nt, kt) of W starts in the pack: groups of GROUP_N n tiles, each group K-major, so one
// group's tiles for consecutive kt lie in one forward stream (what the hardware prefetcher follows).
static int64_t tile_offset(int64_t nt, int64_t kt, int64_t n_tiles, int64_t k_tiles) {
    const int64_t group = nt / GROUP_N, g = nt % GROUP_N;
    const int64_t count = n_tiles - group * GROUP_N < GROUP_N ? n_tiles - group * GROUP_N : GROUP_N;
    return (group * GROUP_N * k_tiles + kt * count + g) * (TILE_K * TILE_N);
}

// Element (nt*16 + j, kt*32 + 2p + h) of W in the pack: 1 KiB tiles of [16 pairs][16 n][2] (AMX's B
// layout), placed by tile_offset.
static inline int64_t pack_index(int64_t nt, int64_t kt, int p, int j, int h, int64_t n_tiles, int64_t k_tiles) {
    return tile_offset(nt, kt, n_tiles, k_tiles) + (p * TILE_N + j) * 2 + h;
}

#include "bf16_pack.h"  // tf_bf16_pack, tf_bf16_unpack_rows over pack_index

// fp32 accumulator tile [16][16] -> rows [0, rows) of out (bf16, row stride ldo), columns [0, cols).
static void store_bf16(const float *acc, int rows, int cols, uint16_t *out, int64_t ldo) {
    const __mmask16 mask = (__mmask16)((1u << cols) - 1u);
    for (int m = 0; m < rows; m++) {
        __m256bh v = _mm512_cvtneps_pbh(_mm512_loadu_ps(acc + m * TILE_N));
        _mm256_mask_storeu_epi16(out + m * ldo, mask, (__m256i)v);
    }
}

// One 16-row panel of x against the n tiles of one group [nt0, nt1) of W.
static void panel_times_tiles(const uint16_t *panel, int64_t k_tiles, int64_t n_tiles, const uint16_t *packed,
                              int64_t nt0, int64_t nt1, int rows, int64_t n, uint16_t *out, int64_t ldo) {
    float acc[GROUP_N][TILE_M * TILE_N] __attribute__((aligned(64)));
    const int64_t panel_stride = k_tiles * TILE_K * 2, tile_elems = TILE_K * TILE_N;
    int64_t nt = nt0;
    if (nt1 - nt0 == GROUP_N) {
        const uint16_t *b = packed + tile_offset(nt0, 0, n_tiles, k_tiles);
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t kt = 0; kt < k_tiles; kt++) {
            _tile_loadd(4, panel + kt * TILE_K, panel_stride);
            const uint16_t *bk = b + kt * GROUP_N * tile_elems;
            _tile_loadd(5, bk, 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, bk + tile_elems, 64);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(7, bk + 2 * tile_elems, 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, bk + 3 * tile_elems, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, acc[0], 64); _tile_stored(1, acc[1], 64);
        _tile_stored(2, acc[2], 64); _tile_stored(3, acc[3], 64);
        for (int g = 0; g < GROUP_N; g++) {
            const int64_t col = (nt + g) * TILE_N;
            const int cols = (int)(n - col < TILE_N ? n - col : TILE_N);
            store_bf16(acc[g], rows, cols, out + col, ldo);
        }
        return;
    }
    for (; nt < nt1; nt++) {  // the last, short group: the same op sequence per element, a tile at a time
        _tile_zero(0);
        for (int64_t kt = 0; kt < k_tiles; kt++) {
            _tile_loadd(4, panel + kt * TILE_K, panel_stride);
            _tile_loadd(5, packed + tile_offset(nt, kt, n_tiles, k_tiles), 64);
            _tile_dpbf16ps(0, 4, 5);
        }
        _tile_stored(0, acc[0], 64);
        const int64_t col = nt * TILE_N;
        const int cols = (int)(n - col < TILE_N ? n - col : TILE_N);
        store_bf16(acc[0], rows, cols, out + col, ldo);
    }
}

// out [M, N] (row stride ldo) = x [M, K] (row stride ldx) @ W^T, with W packed by tf_bf16_pack.
// `panels` is scratch of ceil(M/16)*16 * k_pad bf16 elements. Threads split N in groups of n tiles.
void tf_amx_gemm(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                 uint16_t *out, int64_t ldo, uint16_t *panels, int threads) {
    const int64_t k_tiles = (k + TILE_K - 1) / TILE_K, k_pad = k_tiles * TILE_K;
    const int64_t m_tiles = (m + TILE_M - 1) / TILE_M, n_tiles = (n + TILE_N - 1) / TILE_N;
    for (int64_t r = 0; r < m_tiles * TILE_M; r++) {
        uint16_t *dst = panels + r * k_pad;
        if (r < m) {
            memcpy(dst, x + r * ldx, (size_t)k * 2);
            memset(dst + k, 0, (size_t)(k_pad - k) * 2);
        } else {
            memset(dst, 0, (size_t)k_pad * 2);
        }
    }
    const int64_t groups = (n_tiles + GROUP_N - 1) / GROUP_N;
    const int64_t work = m_tiles * groups;
#pragma omp parallel num_threads(threads)
    {
        configure_tiles();
#pragma omp for schedule(static)
        for (int64_t item = 0; item < work; item++) {
            const int64_t group = item / m_tiles, mt = item % m_tiles;  // a thread keeps its W group in cache
            const int64_t nt0 = group * GROUP_N;
            const int64_t nt1 = nt0 + GROUP_N < n_tiles ? nt0 + GROUP_N : n_tiles;
            const int rows = (int)(m - mt * TILE_M < TILE_M ? m - mt * TILE_M : TILE_M);
            panel_times_tiles(panels + mt * TILE_M * k_pad, k_tiles, n_tiles, packed, nt0, nt1, rows, n,
                              out + mt * TILE_M * ldo, ldo);
        }
        _tile_release();
    }
}
