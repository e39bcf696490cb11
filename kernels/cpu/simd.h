// What the CPU kernels share: 16-float vectors loaded from and stored to float32, bfloat16 or float16
// arrays, tail masks, rounding to the element type, and exp. Every helper is a fixed sequence of ops, so
// an element's bits never depend on where it sits or how many elements a call covers.
#ifndef TENSORFOLD_SIMD_H
#define TENSORFOLD_SIMD_H

#include <immintrin.h>
#include <stdint.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

static inline __attribute__((always_inline)) __m512 load16(const void *base, int64_t index, int dtype, __mmask16 mask) {
    if (dtype == DT_F32) return _mm512_maskz_loadu_ps(mask, (const float *)base + index);
    const __m256i raw = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)base + index);
    if (dtype == DT_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    return _mm512_cvtph_ps(raw);
}

static inline void store16(void *base, int64_t index, int dtype, __mmask16 mask, __m512 v) {
    if (dtype == DT_F32) {
        _mm512_mask_storeu_ps((float *)base + index, mask, v);
    } else if (dtype == DT_BF16) {
        _mm256_mask_storeu_epi16((uint16_t *)base + index, mask, (__m256i)_mm512_cvtneps_pbh(v));
    } else {
        _mm256_mask_storeu_epi16((uint16_t *)base + index, mask, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    }
}

// exp(x) for x <= 0 (attention scores less their max, SiLU's exp(-|x|)): 2^n * (1 + r + r^2 P(r)),
// Cephes' expf polynomial.
static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

static inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
}

// v rounded to the element type and widened back (what torch's elementwise ops keep between two ops).
static inline __attribute__((always_inline)) __m512 round_to(int dtype, __m512 v) {
    if (dtype == DT_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
    if (dtype == DT_F16) return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    return v;
}

#endif
