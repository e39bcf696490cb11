// The AVX2 path of the quantized GEMM for the 32-weight types (Q8_0, Q4_0, Q4_1): 8 output columns a tile,
// one block of each column in one vector of 32 codes, and the fold (quant_gemm.c's `fold`; docs/gguf.md,
// "Quantized weights stay quantized") run on the 8 columns' lanes, block after block in K order.
//
// The integer dot is VPMADDUBSW then VPMADDWD by ones, exact: the 4-bit types' codes (0..15) times int8 keep
// two products within int16, and Q8_0 multiplies |w| by the activations with w's sign (VPSIGNB), at most
// 128 * 127 per product since an activation code is never -128 (|x * (1 / d)| rounds to at most 127). Its
// signed sum is `fold`'s raw less 128 * (the activations' block sum); Q4_0's offset of 8 is taken off as there.
#ifndef TENSORFOLD_QUANT_TILE32_AVX2_H
#define TENSORFOLD_QUANT_TILE32_AVX2_H

#include "quant_tile_avx2.h"

#ifdef QTILE_K

// One block index of 8 columns: each column's 32 codes (Q8_0: its int8 weights and their magnitudes), and
// its block's scales as lanes.
typedef struct {
    __m256i codes[YTILE], mags[YTILE];  // mags: Q8_0's |w|
    float d[YTILE], m[YTILE];           // m: Q4_1's per-block min
} y32tile;

// A block's codes at src: Q8_0's 32 int8 weights, or the 4-bit types' 16 bytes of nibbles as 32 codes in
// element order (byte l's low nibble is element l, its high nibble element l + 16).
static inline __m256i y32_codes(const int type, const uint8_t *src) {
    if (type == Q8_0) return _mm256_loadu_si256((const __m256i *)(src + 2));
    const __m128i qs = _mm_loadu_si128((const __m128i *)(src + (type == Q4_0 ? 2 : 4))), low = _mm_set1_epi8(0x0F);
    return _mm256_setr_m128i(_mm_and_si128(qs, low), _mm_and_si128(_mm_srli_epi16(qs, 4), low));
}

// Column col's block at src into t: its codes and scales.
static inline void y32_decode(const int type, const uint8_t *src, y32tile *t, int col) {
    _mm_prefetch((const char *)(src + QFORMATS[type].bytes + 64), _MM_HINT_T0);  // this column's next blocks
    t->codes[col] = y32_codes(type, src);
    if (type == Q8_0) t->mags[col] = _mm256_abs_epi8(t->codes[col]);
    t->d[col] = ytile_half(src);
    if (type == Q4_1) t->m[col] = ytile_half(src + 2);
}

// One column's 8 int32 partial sums of its block's dot with the activations act (Q8_0: over signed weights,
// the 4-bit types: over the unsigned codes).
static inline __m256i y32_dot(const int type, __m256i codes, __m256i mags, __m256i act) {
    const __m256i pairs = type == Q8_0 ? _mm256_maddubs_epi16(mags, _mm256_sign_epi8(act, codes))
                                       : _mm256_maddubs_epi16(codes, act);
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// acc (8 columns of one row) folded with this block, as `fold` does per column: raw the columns' dots, sum the
// activations' block sum, a their scale.
static inline __m256 y32_fold(const int type, __m256 acc, const y32tile *t, __m256i raw, int32_t sum, float a) {
    const __m256 av = _mm256_set1_ps(a), da = _mm256_mul_ps(_mm256_loadu_ps(t->d), av);
    if (type == Q4_1) {
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(raw), da));
        const __m256 ma = _mm256_mul_ps(_mm256_loadu_ps(t->m), av);
        return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps((float)sum), ma));
    }
    const __m256i shifted = type == Q4_0 ? _mm256_sub_epi32(raw, _mm256_set1_epi32(QFORMATS[Q4_0].offset * sum)) : raw;
    return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(shifted), da));
}

// Row r's dots with block i of the tile's columns folded into acc.
static inline __m256 y32_row(const int type, __m256 acc, const y32tile *t, const qacts *x, int64_t r, int64_t i) {
    const __m256i act = _mm256_loadu_si256((const __m256i *)(x->q + r * x->k + 32 * i));
    __m256i dots[YTILE];
    for (int c = 0; c < YTILE; c++) dots[c] = y32_dot(type, t->codes[c], t->mags[c], act);
    const int32_t *s = x->sums + r * (x->k / 16) + 2 * i;
    return y32_fold(type, acc, t, reduce8(dots), s[0] + s[1], x->d[r * (x->k / 32) + i]);
}

// Row r's dots with block i of the columns at src (cols of them, row_bytes apart) folded into acc, each
// column's codes used as they load; t takes the scales.
static inline __m256 y32_one_row(const int type, __m256 acc, y32tile *t, const uint8_t *src, int64_t row_bytes,
                                 int64_t cols, const qacts *x, int64_t r, int64_t i) {
    const __m256i act = _mm256_loadu_si256((const __m256i *)(x->q + r * x->k + 32 * i));
    __m256i dots[YTILE];
    for (int c = 0; c < YTILE; c++) {
        __m256i codes = _mm256_setzero_si256();
        if (c < cols) {
            const uint8_t *at = src + c * row_bytes;
            _mm_prefetch((const char *)(at + QFORMATS[type].bytes + 64), _MM_HINT_T0);
            codes = y32_codes(type, at);
            t->d[c] = ytile_half(at);
            if (type == Q4_1) t->m[c] = ytile_half(at + 2);
        }
        dots[c] = y32_dot(type, codes, _mm256_abs_epi8(codes), act);
    }
    const int32_t *s = x->sums + r * (x->k / 16) + 2 * i;
    return y32_fold(type, acc, t, reduce8(dots), s[0] + s[1], x->d[r * (x->k / 32) + i]);
}

// Columns [c0, c0 + 8) (those below n) x rows [r0, r1), at most 64 rows, into out (row stride n).
static inline __attribute__((always_inline)) void y32tile_columns(const int type, const qacts *x, const uint8_t *w,
                                                                  int64_t n, int64_t c0, int64_t r0, int64_t r1,
                                                                  float *out) {
    const qformat f = QFORMATS[type];
    const int64_t blocks = x->k / 32, row_bytes = blocks * f.bytes, cols = n - c0 < YTILE ? n - c0 : YTILE;
    y32tile t;
    memset(&t, 0, sizeof(t));  // the columns past n: zero codes and scales
    __m256 acc[64];
    for (int64_t r = r0; r < r1; r++) acc[r - r0] = _mm256_setzero_ps();
    // The next tile's bytes (whole rows, contiguous) into L2 as one stream, a share per block.
    const int64_t next_c = c0 + YTILE, next_bytes = (n - next_c < YTILE ? n - next_c : YTILE) * row_bytes;
    const int64_t share = (next_bytes / 64 + blocks) / blocks * 64;
    for (int64_t i = 0; i < blocks; i++) {
        for (int64_t at = i * share; at < (i + 1) * share && at < next_bytes; at += 64)
            _mm_prefetch((const char *)(w + next_c * row_bytes + at), _MM_HINT_T1);
        const uint8_t *src = w + c0 * row_bytes + i * f.bytes;
        if (r1 - r0 == 1) {  // one row: each column's dot as it is decoded, the codes kept in registers
            acc[0] = y32_one_row(type, acc[0], &t, src, row_bytes, cols, x, r0, i);
            continue;
        }
        for (int c = 0; c < cols; c++) y32_decode(type, src + c * row_bytes, &t, c);
        for (int64_t r = r0; r < r1; r++) acc[r - r0] = y32_row(type, acc[r - r0], &t, x, r, i);
    }
    for (int64_t r = r0; r < r1; r++) {
        float lanes[YTILE];
        _mm256_storeu_ps(lanes, acc[r - r0]);
        for (int64_t c = 0; c < cols; c++) out[r * n + c0 + c] = lanes[c];
    }
}

// A work item's 16 columns as two tiles of 8.
static inline __attribute__((always_inline)) void pair_columns(const int type, const qacts *x, const uint8_t *w,
                                                               int64_t n, int64_t c0, int64_t r0, int64_t r1,
                                                               float *out) {
    y32tile_columns(type, x, w, n, c0, r0, r1, out);
    if (c0 + YTILE < n) y32tile_columns(type, x, w, n, c0 + YTILE, r0, r1, out);
}

#endif
#endif
