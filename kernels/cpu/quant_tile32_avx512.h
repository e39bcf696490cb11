// The AVX-512 VNNI path of the quantized GEMM for the 32-weight types (Q8_0, Q4_0, Q4_1): 16 output columns
// at a time, two blocks of each column in one vector of codes, and the fold (quant_gemm.c's `fold`,
// docs/gguf.md "Quantized weights stay quantized") run on the 16 columns' lanes, block after block in K order.
//
// The codes are unsigned (Q8_0: its int8 plus 128), so each block's exact dot over signed values is
// VPDPBUSD's sum less offset * (the activations' block sum), an exact integer as in `fold`.
#ifndef TENSORFOLD_QUANT_TILE32_AVX512_H
#define TENSORFOLD_QUANT_TILE32_AVX512_H

#include "quant_tile_avx512.h"

#ifdef KTILE

// Two blocks (i, i + 1) of 16 columns: each column's 64 codes, and its blocks' scales as lanes.
typedef struct {
    __m512i codes[KTILE];
    float d[2][KTILE], m[2][KTILE];  // m: Q4_1's per-block min
} ptile;

// Codes of one block at src: Q8_0's 32 bytes, or the 4-bit types' 16 bytes of two nibbles.
static inline __m256i block32_codes(const int type, const uint8_t *src) {
    if (type == Q8_0)
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(src + 2)), _mm256_set1_epi8((char)0x80));
    const __m128i qs = _mm_loadu_si128((const __m128i *)(src + (type == Q4_0 ? 2 : 4)));
    const __m256i both = _mm256_broadcastsi128_si256(qs);  // low nibbles are elements 0-15, high ones 16-31
    const __m256i by4 = _mm256_setr_epi64x(0, 0, 0x0004000400040004ll, 0x0004000400040004ll);  // high half
    const __m256i shifted = _mm256_srlv_epi16(both, by4);
    return _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F));
}

// Column col's blocks i and (if `two`) i + 1 at src into t, returning its codes.
static inline __m512i pair_decode(const int type, const uint8_t *src, int two, ptile *t, int col) {
    const int bytes = QFORMATS[type].bytes;
    _mm_prefetch((const char *)(src + 2 * bytes + 64), _MM_HINT_T0);  // this column's next pair, into L1
    t->d[0][col] = tile_half(src);
    if (type == Q4_1) t->m[0][col] = tile_half(src + 2);
    const __m512i first = _mm512_zextsi256_si512(block32_codes(type, src));
    if (!two) return first;
    t->d[1][col] = tile_half(src + bytes);
    if (type == Q4_1) t->m[1][col] = tile_half(src + bytes + 2);
    return _mm512_inserti64x4(first, block32_codes(type, src + bytes), 1);
}

// acc (16 columns of one row) folded with block h of the pair: raw the columns' dots over the codes, sum the
// activations' block sum, a their scale.
static inline __m512 pair_fold(const int type, __m512 acc, const ptile *t, int h, __m512i raw, int32_t sum, float a) {
    const __m512 av = _mm512_set1_ps(a), da = _mm512_mul_ps(_mm512_load_ps(t->d[h]), av);
    if (type == Q4_1) {
        acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(raw), da));
        const __m512 ma = _mm512_mul_ps(_mm512_load_ps(t->m[h]), av);
        return _mm512_add_ps(acc, _mm512_mul_ps(_mm512_set1_ps((float)sum), ma));
    }
    const __m512i shifted = _mm512_sub_epi32(raw, _mm512_set1_epi32(QFORMATS[type].offset * sum));
    return _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(shifted), da));
}

// Row r's dots with the pair's codes folded into acc: blocks i and (if `two`) i + 1.
static inline __m512 pair_row(const int type, __m512 acc, const ptile *t, const __m512i codes[KTILE], const qacts *x,
                              int64_t r, int64_t i, int two) {
    const int8_t *q = x->q + r * x->k + 32 * i;
    const __m512i act = two ? _mm512_loadu_si512(q) : _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)q));
    __m512i dots[KTILE], low, high;
    for (int c = 0; c < KTILE; c++) dots[c] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[c], act);
    reduce16_halves(dots, &low, &high);
    const int32_t *s = x->sums + r * (x->k / 16) + 2 * i;
    const float *a = x->d + r * (x->k / 32) + i;
    acc = pair_fold(type, acc, t, 0, low, s[0] + s[1], a[0]);
    return two ? pair_fold(type, acc, t, 1, high, s[2] + s[3], a[1]) : acc;
}

// Columns [c0, c0 + 16) (those below n) x rows [r0, r1), at most 64 rows, into out (row stride n).
static inline __attribute__((always_inline)) void pair_columns(const int type, const qacts *x, const uint8_t *w,
                                                               int64_t n, int64_t c0, int64_t r0, int64_t r1,
                                                               float *out) {
    const qformat f = QFORMATS[type];
    const int64_t blocks = x->k / 32, row_bytes = blocks * f.bytes, cols = n - c0 < KTILE ? n - c0 : KTILE;
    ptile t __attribute__((aligned(64)));
    if (cols < KTILE) memset(&t, 0, sizeof(t));
    __m512i codes[KTILE];
    for (int c = 0; c < KTILE; c++) codes[c] = _mm512_setzero_si512();
    __m512 acc[64];
    for (int64_t r = r0; r < r1; r++) acc[r - r0] = _mm512_setzero_ps();
    // The next tile's bytes into L2 as one sequential stream, a share per pair of blocks.
    const int64_t next_c = c0 + KTILE, steps = (blocks + 1) / 2;
    const uint8_t *next = w + next_c * row_bytes;
    const int64_t next_bytes = (n - next_c < KTILE ? n - next_c : KTILE) * row_bytes;
    const int64_t share = (next_bytes / 64 + steps) / steps * 64;
    for (int64_t i = 0; i < blocks; i += 2) {
        for (int64_t at = i / 2 * share; at < (i / 2 + 1) * share && at < next_bytes; at += 64)
            _mm_prefetch((const char *)(next + at), _MM_HINT_T1);
        const int two = i + 1 < blocks;
        const uint8_t *src = w + c0 * row_bytes + i * f.bytes;
        for (int c = 0; c < cols; c++) codes[c] = pair_decode(type, src + c * row_bytes, two, &t, c);
        for (int64_t r = r0; r < r1; r++) acc[r - r0] = pair_row(type, acc[r - r0], &t, codes, x, r, i, two);
    }
    const __mmask16 keep = (__mmask16)((1u << cols) - 1);
    for (int64_t r = r0; r < r1; r++) _mm512_mask_storeu_ps(out + r * n + c0, keep, acc[r - r0]);
}

#endif
#endif
