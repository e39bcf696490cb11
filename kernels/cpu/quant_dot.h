// The quantized GEMM's integer dot products (quant_gemm.c): sum over groups g of scales[g] * sum of
// q[i] * a[i] over the group, q the weights' unsigned codes (0..255), a the activations' int8 values.
//
// Exact in every build, so the SIMD paths give the portable loop's result whatever their order: AVX-512
// VNNI's VPDPBUSD (u8 x s8, 4 products per int32 lane), AVX2's VPMADDUBSW into int16 pairs (codes under 64
// only: two products stay below 2^15) then VPMADDWD by the group scale, and NEON's widening multiplies
// (VMLAL on int16 halves). `n` is 32 (one group) or 256 (groups of 32 or 16).
#ifndef TENSORFOLD_QUANT_DOT_H
#define TENSORFOLD_QUANT_DOT_H

#include <stdint.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#define QDOT_INLINE static inline __attribute__((always_inline))

// The definition: plain loops.
QDOT_INLINE int32_t dot_portable(const uint8_t *q, const int8_t *a, const int32_t *scales, int n, int group) {
    int32_t total = 0;
    for (int g = 0; g < n / group; g++) {
        int32_t s = 0;
        for (int i = 0; i < group; i++) s += (int32_t)q[g * group + i] * a[g * group + i];
        total += scales[g] * s;
    }
    return total;
}

#if defined(__AVX512F__)
QDOT_INLINE int32_t dot_simd(const uint8_t *q, const int8_t *a, const int32_t *scales, int n, int group) {
    if (n == 32) {
        const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_load_si256((const __m256i *)q),
                                              _mm256_loadu_si256((const __m256i *)a));
        const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
        const __m128i s = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
        return scales[0] * _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
    }
    // 64 codes a vector: lane l holds 4 products of element 4l onward, so its group is 4l / group.
    const __m512i all = _mm512_loadu_si512(scales), lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                                            12, 13, 14, 15);
    const __m512i first = group == 32 ? _mm512_srli_epi32(lane, 3) : _mm512_srli_epi32(lane, 2);
    const int per_vector = 64 / group;
    __m512i acc = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_load_si512(q + 64 * c),
                                              _mm512_loadu_si512(a + 64 * c));
        const __m512i s = _mm512_permutexvar_epi32(_mm512_add_epi32(first, _mm512_set1_epi32(c * per_vector)), all);
        acc = _mm512_add_epi32(acc, _mm512_mullo_epi32(p, s));
    }
    return _mm512_reduce_add_epi32(acc);
}
#elif defined(__AVX2__)
// 32 codes times 32 int8, as 8 int32 lanes: VPMADDUBSW where two products fit int16, else widened.
QDOT_INLINE __m256i madd32(const uint8_t *q, const int8_t *a, __m256i scale16, int wide) {
    const __m256i qv = _mm256_load_si256((const __m256i *)q), av = _mm256_loadu_si256((const __m256i *)a);
    if (!wide) return _mm256_madd_epi16(_mm256_maddubs_epi16(qv, av), scale16);
    const __m256i lo = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(qv)),
                                         _mm256_cvtepi8_epi16(_mm256_castsi256_si128(av)));
    const __m256i hi = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(qv, 1)),
                                         _mm256_cvtepi8_epi16(_mm256_extracti128_si256(av, 1)));
    return _mm256_add_epi32(lo, hi);
}

QDOT_INLINE int32_t dot_simd(const uint8_t *q, const int8_t *a, const int32_t *scales, int n, int group) {
    __m256i acc;
    if (n == 32) {  // the 32-weight types: Q8_0's codes reach 255
        acc = madd32(q, a, _mm256_set1_epi16(1), 1);
    } else {
        acc = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {  // 32 codes a vector; a group of 16 is its low or high 128 bits
            const __m256i s = group == 32 ? _mm256_set1_epi16((int16_t)scales[c])
                                          : _mm256_setr_m128i(_mm_set1_epi16((int16_t)scales[2 * c]),
                                                              _mm_set1_epi16((int16_t)scales[2 * c + 1]));
            acc = _mm256_add_epi32(acc, madd32(q + 32 * c, a + 32 * c, s, 0));
        }
    }
    const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
    const __m128i s = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    const int32_t total = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
    return n == 32 ? scales[0] * total : total;
}
#elif defined(__ARM_NEON)
QDOT_INLINE int32_t dot_simd(const uint8_t *q, const int8_t *a, const int32_t *scales, int n, int group) {
    int32_t total = 0;
    for (int g = 0; g < n / group; g++) {
        int32x4_t acc = vdupq_n_s32(0);
        for (int i = g * group; i < (g + 1) * group; i += 16) {
            const uint8x16_t qv = vld1q_u8(q + i);
            const int8x16_t av = vld1q_s8(a + i);
            const int16x8_t ql = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(qv)));
            const int16x8_t qh = vreinterpretq_s16_u16(vmovl_high_u8(qv));
            const int16x8_t al = vmovl_s8(vget_low_s8(av)), ah = vmovl_high_s8(av);
            acc = vmlal_s16(acc, vget_low_s16(ql), vget_low_s16(al));
            acc = vmlal_high_s16(acc, ql, al);
            acc = vmlal_s16(acc, vget_low_s16(qh), vget_low_s16(ah));
            acc = vmlal_high_s16(acc, qh, ah);
        }
        total += scales[g] * vaddvq_s32(acc);
    }
    return total;
}
#endif

#endif
