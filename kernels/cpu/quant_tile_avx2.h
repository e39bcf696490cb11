// The AVX2 path of the quantized GEMM for the 256-weight K types (Q4_K, Q5_K, Q6_K): 8 output columns a
// tile, each column's block unpacked to byte codes in vectors once for every row, and the fold (quant_gemm.c's
// `fold`; docs/gguf.md, "Quantized weights stay quantized") run on the 8 columns' lanes.
//
// The integer dot is VPMADDUBSW (codes under 64 times int8: two products stay within int16) then VPMADDWD by
// the group scale, exact; each lane runs its column's float32 ops in `fold`'s order, so the bits equal the
// portable C's.
#ifndef TENSORFOLD_QUANT_TILE_AVX2_H
#define TENSORFOLD_QUANT_TILE_AVX2_H

#if defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
#include <immintrin.h>
#include <stdint.h>

#include "quant_blocks.h"

#define QTILE_K 16  // columns a work item (two tiles of 8)
#define YTILE 8

// One column's block: 8 vectors of 32 codes in element order, and a 16-bit scale per code pair's group.
typedef struct {
    __m256i codes[8], scales[8];
    __m256i offset_scales;  // Q6_K: -32 * the 16 scales, int16
} ycol;

typedef struct {
    ycol col[YTILE];
    int32_t pairs[4][YTILE];  // Q4_K, Q5_K: the mins as int16 pairs (groups 2j, 2j + 1)
    float d[YTILE], dmin[YTILE];
} ytile;

static inline float ytile_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof(h));
    return _cvtsh_ss(h);
}

static inline void ytile_decode(const int type, const uint8_t *src, ycol *k, ytile *t, int col) {
    for (int line = 0; line < QFORMATS[type].bytes + 64; line += 64)  // the column's next block, into L1
        _mm_prefetch((const char *)(src + QFORMATS[type].bytes + line), _MM_HINT_T0);
    const __m256i low = _mm256_set1_epi8(0x0F);
    if (type == Q6_K) {  // elements 128h + 32v + l: ql[64h + l (+32)], nibble v / 2, top bits 2v of qh[32h + l]
        for (int h = 0; h < 2; h++) {
            const __m256i q0 = _mm256_loadu_si256((const __m256i *)(src + 64 * h));
            const __m256i q1 = _mm256_loadu_si256((const __m256i *)(src + 64 * h + 32));
            const __m256i top = _mm256_loadu_si256((const __m256i *)(src + 128 + 32 * h));
            const __m256i nib[4] = {_mm256_and_si256(q0, low), _mm256_and_si256(q1, low),
                                    _mm256_and_si256(_mm256_srli_epi16(q0, 4), low),
                                    _mm256_and_si256(_mm256_srli_epi16(q1, 4), low)};
            for (int v = 0; v < 4; v++) {
                const __m256i bits = _mm256_and_si256(_mm256_srli_epi16(top, 2 * v), _mm256_set1_epi8(3));
                k->codes[4 * h + v] = _mm256_or_si256(nib[v], _mm256_slli_epi16(bits, 4));
            }
        }
        const __m256i sv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(src + 192)));
        int16_t sc[16];
        _mm256_storeu_si256((__m256i *)sc, sv);
        for (int v = 0; v < 8; v++)  // a vector of 32 codes holds groups 2v (low half) and 2v + 1
            k->scales[v] = _mm256_setr_m128i(_mm_set1_epi16(sc[2 * v]), _mm_set1_epi16(sc[2 * v + 1]));
        k->offset_scales = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(sv, 5));
        t->d[col] = ytile_half(src + 208);
        t->dmin[col] = 0.0f;
        return;
    }
    wblock b;
    k_scales(src + 4, &b);
    for (int g = 0; g < 8; g++) k->scales[g] = _mm256_set1_epi16((short)b.scales[g]);
    for (int j = 0; j < 4; j++)
        t->pairs[j][col] = (int32_t)((uint32_t)b.mins[2 * j] | (uint32_t)b.mins[2 * j + 1] << 16);
    t->d[col] = ytile_half(src);
    t->dmin[col] = ytile_half(src + 2);
    const uint8_t *qs = src + (type == Q4_K ? 16 : 48);
    for (int j = 0; j < 4; j++) {  // byte l of chunk j: element 64j + l (low nibble), 64j + 32 + l (high)
        const __m256i z = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
        k->codes[2 * j] = _mm256_and_si256(z, low);
        k->codes[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(z, 4), low);
    }
    if (type == Q5_K) {  // element 32g + l's fifth bit is bit g of qh[l]
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(src + 16));
        for (int g = 0; g < 8; g++) {
            const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(qh, g), _mm256_set1_epi8(1));
            k->codes[g] = _mm256_or_si256(k->codes[g], _mm256_slli_epi16(bit, 4));
        }
    }
    k->offset_scales = _mm256_setzero_si256();
}

// One column's 8 int32 partial sums of sum_g scale_g * (codes . acts over g) (Q6_K: less 32 * its offsets).
static inline __m256i ytile_dot(const int type, const ycol *k, const int8_t *a, __m256i sums16) {
    __m256i acc = type == Q6_K ? _mm256_madd_epi16(k->offset_scales, sums16) : _mm256_setzero_si256();
    for (int v = 0; v < 8; v++) {
        const __m256i p = _mm256_maddubs_epi16(k->codes[v], _mm256_loadu_si256((const __m256i *)(a + 32 * v)));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, k->scales[v]));
    }
    return acc;
}

// 8 vectors' lane sums as one vector: lane c is the sum of v[c]'s lanes.
static inline __m256i reduce8(const __m256i v[8]) {
    const __m256i t0 = _mm256_hadd_epi32(v[0], v[1]), t1 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i t2 = _mm256_hadd_epi32(v[4], v[5]), t3 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
    return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

// acc (8 columns of one row) folded with this block, as `fold` does per column.
static inline __m256 ytile_fold(const int type, __m256 acc, const ytile *t, float a, __m256i raw, const int32_t *s) {
    const __m256 av = _mm256_set1_ps(a), da = _mm256_mul_ps(_mm256_loadu_ps(t->d), av);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(raw), da));
    if (type == Q6_K) return acc;
    __m256i mins = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        const int32_t lo = s[4 * j] + s[4 * j + 1], hi = s[4 * j + 2] + s[4 * j + 3];
        const __m256i sums = _mm256_set1_epi32((int)((uint32_t)(uint16_t)lo | (uint32_t)(uint16_t)hi << 16));
        mins = _mm256_add_epi32(mins, _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)t->pairs[j]), sums));
    }
    const __m256 dma = _mm256_mul_ps(_mm256_loadu_ps(t->dmin), av);
    return _mm256_sub_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(mins), dma));
}

// A block's 16 activation sums as int16 in order.
static inline __m256i ysums16(const int32_t *s) {
    const __m256i packed = _mm256_packs_epi32(_mm256_loadu_si256((const __m256i *)s),
                                              _mm256_loadu_si256((const __m256i *)(s + 8)));
    return _mm256_permute4x64_epi64(packed, 0xD8);  // packs leaves sums 0-3, 8-11, 4-7, 12-15
}

// Columns [c0, c0 + 8) (those below n) x rows [r0, r1), at most 64 rows, into out (row stride n).
static inline __attribute__((always_inline)) void ytile_columns(const int type, const qacts *x, const uint8_t *w,
                                                                int64_t n, int64_t c0, int64_t r0, int64_t r1,
                                                                float *out) {
    const qformat f = QFORMATS[type];
    const int64_t blocks = x->k / 256, row_bytes = blocks * f.bytes, cols = n - c0 < YTILE ? n - c0 : YTILE;
    ytile t;
    if (cols < YTILE) memset(&t, 0, sizeof(t));
    __m256 acc[64];
    for (int64_t r = r0; r < r1; r++) acc[r - r0] = _mm256_setzero_ps();
    // The next tile's bytes (whole rows, contiguous) into L2 as one stream, a share per block.
    const int64_t next_c = c0 + YTILE, next_bytes = (n - next_c < YTILE ? n - next_c : YTILE) * row_bytes;
    const int64_t share = (next_bytes / 64 + blocks) / blocks * 64;
    for (int64_t i = 0; i < blocks; i++) {
        for (int64_t at = i * share; at < (i + 1) * share && at < next_bytes; at += 64)
            _mm_prefetch((const char *)(w + next_c * row_bytes + at), _MM_HINT_T1);
        const uint8_t *src = w + c0 * row_bytes + i * f.bytes;
        __m256i dots[YTILE];
        if (r1 - r0 == 1) {  // one row: each column's dot as it is decoded, the codes kept in registers
            const int32_t *s = x->sums + r0 * (x->k / 16) + i * 16;
            const __m256i sums16 = ysums16(s);
            for (int c = 0; c < YTILE; c++) {
                ycol k;
                if (c < cols) ytile_decode(type, src + c * row_bytes, &k, &t, c);
                else k = t.col[c];
                dots[c] = ytile_dot(type, &k, x->q + r0 * x->k + i * 256, sums16);
            }
            acc[0] = ytile_fold(type, acc[0], &t, x->d[r0 * blocks + i], reduce8(dots), s);
            continue;
        }
        for (int64_t c = 0; c < cols; c++) ytile_decode(type, src + c * row_bytes, &t.col[c], &t, (int)c);
        for (int64_t r = r0; r < r1; r++) {
            const int32_t *s = x->sums + r * (x->k / 16) + i * 16;
            const __m256i sums16 = ysums16(s);
            for (int c = 0; c < YTILE; c++) dots[c] = ytile_dot(type, &t.col[c], x->q + r * x->k + i * 256, sums16);
            acc[r - r0] = ytile_fold(type, acc[r - r0], &t, x->d[r * blocks + i], reduce8(dots), s);
        }
    }
    for (int64_t r = r0; r < r1; r++) {
        float lanes[YTILE];
        _mm256_storeu_ps(lanes, acc[r - r0]);
        for (int64_t c = 0; c < cols; c++) out[r * n + c0 + c] = lanes[c];
    }
}

// A work item's 16 columns as two tiles of 8.
static inline __attribute__((always_inline)) void tile_columns(const int type, const qacts *x, const uint8_t *w,
                                                               int64_t n, int64_t c0, int64_t r0, int64_t r1,
                                                               float *out) {
    ytile_columns(type, x, w, n, c0, r0, r1, out);
    if (c0 + YTILE < n) ytile_columns(type, x, w, n, c0 + YTILE, r0, r1, out);
}

#endif
#endif
