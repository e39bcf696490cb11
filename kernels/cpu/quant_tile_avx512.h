// The AVX-512 VNNI path of the quantized GEMM for the 256-weight K types (Q4_K, Q5_K, Q6_K): 16 output
// columns at a time, each column's block decoded once into vectors and reused by every row, and the fold
// (quant_gemm.c's `fold`; docs/gguf.md, "Quantized weights stay quantized") run on the 16 columns' lanes at once.
//
// A lane runs its column's ops in the scalar order, so the bits equal the portable C's: the integer parts
// (VPDPBUSD's u8 x s8 products, VPDPWSSD's int16 group scales, the activation sums' offsets) are exact, and
// the float32 ops are the same multiply, add and subtract on each lane.
#ifndef TENSORFOLD_QUANT_TILE_AVX512_H
#define TENSORFOLD_QUANT_TILE_AVX512_H

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <stdint.h>

#include "quant_blocks.h"

#define KTILE 16  // columns a tile: one float32 vector of results per row

// One column's decoded block in registers: what its dot products with a row's activations read.
typedef struct {
    __m512i codes[4];
    __m512i scales[2];       // int16 group scales matching packs(p0, p1) and packs(p2, p3)
    __m512i offset_scales;   // Q6_K: -32 * the 16 scales, int16 (zero for the others)
} kcol;

// One block index of 16 columns, decoded. Code vector c holds 64 codes; lane l's 4 bytes are elements
// `tile_element(type, c, 4l)` onward (Q6_K: natural order; Q4_K, Q5_K: the nibble layout, whose
// activations `tile_acts` permutes to match).
typedef struct {
    kcol col[KTILE];
    int32_t pairs[4][KTILE];    // Q4_K, Q5_K: the mins as int16 pairs (groups 2j, 2j + 1) per column
    float d[KTILE], dmin[KTILE];
} ktile;

// The element of a block at byte p of code vector c.
static inline int tile_element(int type, int c, int p) {
    if (type == Q6_K) return 64 * c + p;
    return 128 * (c / 2) + 64 * (p / 32) + 32 * (c % 2) + p % 32;
}

// The int16 lane j of packs(p_{2P}, p_{2P+1}) reads p's int32 lane 4L + j % 4 (L = j / 8) of the first
// vector for j % 8 < 4, else of the second: idx[P] gathers each lane's group scale.
static inline void tile_scale_index(int type, __m512i idx[2]) {
    const int group = QFORMATS[type].group;
    int16_t at[2][32];
    for (int pair = 0; pair < 2; pair++)
        for (int j = 0; j < 32; j++) {
            const int c = 2 * pair + (j % 8) / 4, lane = 4 * (j / 8) + j % 4;
            at[pair][j] = (int16_t)(tile_element(type, c, 4 * lane) / group);
        }
    idx[0] = _mm512_loadu_si512(at[0]);
    idx[1] = _mm512_loadu_si512(at[1]);
}

// lo and hi as the low and high int16 of one int32 lane (VPDPWSSD's pair).
static inline uint32_t int16_pair(int32_t lo, int32_t hi) {
    return (uint16_t)(int16_t)lo | (uint32_t)(uint16_t)(int16_t)hi << 16;
}

// F16C's conversion: exact, as half_to_float.
static inline float tile_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof(h));
    return _cvtsh_ss(h);
}

// Shift counts: words 0-15 (bytes 0-31) by `lo`, words 16-31 by `hi`.
static inline __m512i halves_epi16(int lo, int hi) {
    return _mm512_inserti64x4(_mm512_set1_epi16((short)lo), _mm256_set1_epi16((short)hi), 1);
}

// Bits of h shifted by (lo | hi) per half, masked to `mask`, moved to bit 4: the codes' high bits.
static inline __m512i high_bits(__m512i h, int lo, int hi, int mask) {
    const __m512i bits = _mm512_and_si512(_mm512_srlv_epi16(h, halves_epi16(lo, hi)), _mm512_set1_epi8((char)mask));
    return _mm512_slli_epi16(bits, 4);
}

// Q4_K, Q5_K's codes in the nibble layout (`tile_element`).
static inline void q45k_codes(const int type, const uint8_t *src, __m512i c[4]) {
    const uint8_t *qs = src + (type == Q4_K ? 16 : 48);
    const __m512i low = _mm512_set1_epi8(0x0F), z0 = _mm512_loadu_si512(qs), z1 = _mm512_loadu_si512(qs + 64);
    c[0] = _mm512_and_si512(z0, low), c[1] = _mm512_and_si512(_mm512_srli_epi16(z0, 4), low);
    c[2] = _mm512_and_si512(z1, low), c[3] = _mm512_and_si512(_mm512_srli_epi16(z1, 4), low);
    if (type == Q5_K) {  // element 32j + l's fifth bit is bit j of qh[l]; vector c's halves hold j and j + 2
        const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(src + 16)));
        for (int v = 0; v < 4; v++) {
            const int j = 4 * (v / 2) + v % 2;
            c[v] = _mm512_or_si512(c[v], high_bits(h, j, j + 2, 1));
        }
    }
}

// Q6_K's codes in element order.
static inline void q6k_codes(const uint8_t *src, __m512i c[4]) {
    const __m512i low = _mm512_set1_epi8(0x0F), h = _mm512_loadu_si512(src + 128);
    const __m512i l0 = _mm512_loadu_si512(src), l1 = _mm512_loadu_si512(src + 64);
    const __m512i h0 = _mm512_shuffle_i64x2(h, h, 0x44), h1 = _mm512_shuffle_i64x2(h, h, 0xEE);
    c[0] = _mm512_or_si512(_mm512_and_si512(l0, low), high_bits(h0, 0, 2, 3));
    c[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), low), high_bits(h0, 4, 6, 3));
    c[2] = _mm512_or_si512(_mm512_and_si512(l1, low), high_bits(h1, 0, 2, 3));
    c[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), low), high_bits(h1, 4, 6, 3));
}

// Q4_K, Q5_K: the 12 bytes of 6-bit scales and mins (k_scales' packing) unpacked 4 at a time in 32-bit words.
static inline void tile_decode_q45k(const int type, const uint8_t *src, const __m512i idx[2], kcol *k, ktile *t,
                                    int col) {
    uint32_t u[3];
    memcpy(u, src + 4, sizeof(u));
    const uint32_t sc_lo = u[0] & 0x3F3F3F3Fu, mn_lo = u[1] & 0x3F3F3F3Fu;
    const uint32_t sc_hi = (u[2] & 0x0F0F0F0Fu) | ((u[0] >> 6) & 0x03030303u) << 4;
    const uint32_t mn_hi = ((u[2] >> 4) & 0x0F0F0F0Fu) | ((u[1] >> 6) & 0x03030303u) << 4;
    const __m128i bytes = _mm_cvtsi64_si128((long long)(sc_lo | (uint64_t)sc_hi << 32));
    const __m512i sv = _mm512_zextsi128_si512(_mm_cvtepu8_epi16(bytes));
    k->scales[0] = _mm512_permutexvar_epi16(idx[0], sv);
    k->scales[1] = _mm512_permutexvar_epi16(idx[1], sv);
    t->pairs[0][col] = (int32_t)((mn_lo & 0xFF) | (mn_lo >> 8 & 0xFF) << 16);
    t->pairs[1][col] = (int32_t)((mn_lo >> 16 & 0xFF) | (mn_lo >> 24) << 16);
    t->pairs[2][col] = (int32_t)((mn_hi & 0xFF) | (mn_hi >> 8 & 0xFF) << 16);
    t->pairs[3][col] = (int32_t)((mn_hi >> 16 & 0xFF) | (mn_hi >> 24) << 16);
    t->d[col] = tile_half(src);
    t->dmin[col] = tile_half(src + 2);
    q45k_codes(type, src, k->codes);
    k->offset_scales = _mm512_setzero_si512();
}

// Q6_K: -32 * scale per group beside the scales, so a column's dot against the per-16 sums subtracts the
// codes' offset (32 * sum of scale_g * sum_g) inside the same exact integer sum.
static inline void tile_decode_q6k(const uint8_t *src, const __m512i idx[2], kcol *k, ktile *t, int col) {
    q6k_codes(src, k->codes);
    const __m512i sv = _mm512_zextsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(src + 192))));
    k->scales[0] = _mm512_permutexvar_epi16(idx[0], sv);
    k->scales[1] = _mm512_permutexvar_epi16(idx[1], sv);
    k->offset_scales = _mm512_sub_epi16(_mm512_setzero_si512(), _mm512_slli_epi16(sv, 5));
    t->d[col] = tile_half(src + 208);
    t->dmin[col] = 0.0f;
}

// A row's 256 activations as the code vectors' lanes expect them.
static inline void tile_acts(const int type, const int8_t *a, __m512i act[4]) {
    const __m512i x0 = _mm512_loadu_si512(a), x1 = _mm512_loadu_si512(a + 64);
    const __m512i x2 = _mm512_loadu_si512(a + 128), x3 = _mm512_loadu_si512(a + 192);
    if (type == Q6_K) {
        act[0] = x0, act[1] = x1, act[2] = x2, act[3] = x3;
        return;
    }
    act[0] = _mm512_shuffle_i64x2(x0, x1, 0x44), act[1] = _mm512_shuffle_i64x2(x0, x1, 0xEE);
    act[2] = _mm512_shuffle_i64x2(x2, x3, 0x44), act[3] = _mm512_shuffle_i64x2(x2, x3, 0xEE);
}

// One column's 16 int32 partial sums of sum_g scale_g * (codes . acts over g).
static inline __m512i tile_column_dot(const int type, const kcol *k, const __m512i act[4], __m512i sums16) {
    const __m512i zero = _mm512_setzero_si512();
    const __m512i p0 = _mm512_dpbusd_epi32(zero, k->codes[0], act[0]);
    const __m512i p1 = _mm512_dpbusd_epi32(zero, k->codes[1], act[1]);
    const __m512i p2 = _mm512_dpbusd_epi32(zero, k->codes[2], act[2]);
    const __m512i p3 = _mm512_dpbusd_epi32(zero, k->codes[3], act[3]);
    // Each int32 lane is 4 products, within int16 for these types (Q6_K: 4 * 63 * 127 < 2^15).
    const __m512i s = _mm512_dpwssd_epi32(zero, _mm512_packs_epi32(p0, p1), k->scales[0]);
    const __m512i raw = _mm512_dpwssd_epi32(s, _mm512_packs_epi32(p2, p3), k->scales[1]);
    return type == Q6_K ? _mm512_dpwssd_epi32(raw, k->offset_scales, sums16) : raw;
}

// 16 vectors' sums over each 256-bit half: lane c of `low` sums v[c]'s lanes 0-7, of `high` its lanes 8-15.
static inline void reduce16_halves(const __m512i v[16], __m512i *low, __m512i *high) {
    __m512i t[8], u[4];
    for (int j = 0; j < 8; j++)
        t[j] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * j], v[2 * j + 1]),
                                _mm512_unpackhi_epi32(v[2 * j], v[2 * j + 1]));
    for (int j = 0; j < 4; j++)  // u[j]: columns 4j..4j+3 in each 128-bit lane
        u[j] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * j], t[2 * j + 1]),
                                _mm512_unpackhi_epi64(t[2 * j], t[2 * j + 1]));
    const __m512i w01 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], 0x88),
                                         _mm512_shuffle_i32x4(u[0], u[1], 0xDD));
    const __m512i w23 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2], u[3], 0x88),
                                         _mm512_shuffle_i32x4(u[2], u[3], 0xDD));
    *low = _mm512_shuffle_i32x4(w01, w23, 0x88);
    *high = _mm512_shuffle_i32x4(w01, w23, 0xDD);
}

// 16 vectors' lane sums as one vector: lane c is the sum of v[c]'s lanes.
static inline __m512i reduce16(const __m512i v[16]) {
    __m512i low, high;
    reduce16_halves(v, &low, &high);
    return _mm512_add_epi32(low, high);
}

// Q4_K, Q5_K: per column, sum over groups of min_g times the activations' sum over g (s: per-16 sums).
static inline __m512i tile_mins(const ktile *t, const int32_t *s) {
    __m512i acc = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {
        const uint32_t sums = int16_pair(s[4 * j] + s[4 * j + 1], s[4 * j + 2] + s[4 * j + 3]);
        acc = _mm512_dpwssd_epi32(acc, _mm512_load_si512(t->pairs[j]), _mm512_set1_epi32((int)sums));
    }
    return acc;
}

// acc (16 columns of one row) folded with this block, as `fold` does per column.
static inline __m512 tile_fold(const int type, __m512 acc, const ktile *t, float a, __m512i raw, __m512i mins) {
    const __m512 av = _mm512_set1_ps(a), da = _mm512_mul_ps(_mm512_load_ps(t->d), av);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(raw), da));
    if (type == Q6_K) return acc;  // raw already holds -32 * shift
    const __m512 dma = _mm512_mul_ps(_mm512_load_ps(t->dmin), av);
    return _mm512_sub_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(mins), dma));
}

// A row's activation block: its 256 codes as the code vectors expect them, its per-16 sums as int16.
typedef struct {
    __m512i q[4], sums16;
    const int32_t *sums;
    float d;
} krow;

static inline void tile_row(const int type, const qacts *x, int64_t r, int64_t i, krow *a) {
    a->sums = x->sums + r * (x->k / 16) + i * 16;
    a->sums16 = _mm512_zextsi256_si512(_mm512_cvtepi32_epi16(_mm512_loadu_si512(a->sums)));
    tile_acts(type, x->q + r * x->k + i * 256, a->q);
    a->d = x->d[r * (x->k / 256) + i];
}

static inline void tile_decode(const int type, const uint8_t *src, const __m512i idx[2], kcol *k, ktile *t, int col) {
    for (int line = 0; line < QFORMATS[type].bytes + 64; line += 64)  // the column's next block, into L1
        _mm_prefetch((const char *)(src + QFORMATS[type].bytes + line), _MM_HINT_T0);
    if (type == Q6_K)
        tile_decode_q6k(src, idx, k, t, col);
    else
        tile_decode_q45k(type, src, idx, k, t, col);
}

// Columns [c0, c0 + 16) (those below n) x rows [r0, r1), at most 64 rows, into out (row stride n). One row
// takes each column's dot as it is decoded; more keep the decoded tile for every row.
static inline __attribute__((always_inline)) void tile_columns(const int type, const qacts *x, const uint8_t *w,
                                                               int64_t n, int64_t c0, int64_t r0, int64_t r1,
                                                               float *out) {
    const qformat f = QFORMATS[type];
    const int64_t blocks = x->k / 256, row_bytes = blocks * f.bytes, cols = n - c0 < KTILE ? n - c0 : KTILE;
    __m512i idx[2];
    tile_scale_index(type, idx);
    ktile t __attribute__((aligned(64)));
    if (cols < KTILE) memset(&t, 0, sizeof(t));
    __m512 acc[64];
    for (int64_t r = r0; r < r1; r++) acc[r - r0] = _mm512_setzero_ps();
    // The next tile's bytes (contiguous: whole rows) into L2 as one sequential stream, a share per block:
    // the 16 interleaved column streams of this one are more than the hardware prefetcher follows.
    const int64_t next_c = c0 + KTILE;
    const uint8_t *next = w + next_c * row_bytes;
    const int64_t next_bytes = (n - next_c < KTILE ? n - next_c : KTILE) * row_bytes;
    const int64_t share = (next_bytes / 64 + blocks) / blocks * 64;
    for (int64_t i = 0; i < blocks; i++) {
        for (int64_t at = i * share; at < (i + 1) * share && at < next_bytes; at += 64)
            _mm_prefetch((const char *)(next + at), _MM_HINT_T1);
        const uint8_t *src = w + c0 * row_bytes + i * f.bytes;
        __m512i dots[KTILE];
        krow a;
        if (r1 - r0 == 1) {
            tile_row(type, x, r0, i, &a);
            for (int c = 0; c < KTILE; c++) {
                kcol k;
                if (c < cols) tile_decode(type, src + c * row_bytes, idx, &k, &t, c);
                else k = t.col[c];
                dots[c] = tile_column_dot(type, &k, a.q, a.sums16);
            }
            const __m512i mins = type == Q6_K ? a.sums16 : tile_mins(&t, a.sums);
            acc[0] = tile_fold(type, acc[0], &t, a.d, reduce16(dots), mins);
            continue;
        }
        for (int c = 0; c < cols; c++) tile_decode(type, src + c * row_bytes, idx, &t.col[c], &t, c);
        for (int64_t r = r0; r < r1; r++) {
            tile_row(type, x, r, i, &a);
            for (int c = 0; c < KTILE; c++) dots[c] = tile_column_dot(type, &t.col[c], a.q, a.sums16);
            const __m512i mins = type == Q6_K ? a.sums16 : tile_mins(&t, a.sums);
            acc[r - r0] = tile_fold(type, acc[r - r0], &t, a.d, reduce16(dots), mins);
        }
    }
    const __mmask16 keep = (__mmask16)((1u << cols) - 1);
    for (int64_t r = r0; r < r1; r++) _mm512_mask_storeu_ps(out + r * n + c0, keep, acc[r - r0]);
}

#endif
#endif
