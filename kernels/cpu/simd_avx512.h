// simd.h's AVX-512 backend (the amx and avx512 levels): each vector one zmm register, predicates __mmask16.
// Included by simd.h only.
#include <immintrin.h>

typedef __m512 vf16;
typedef __m512i vi16;
typedef __mmask16 vmask16;

#define VF_REGISTERS 32  // vectors the register file holds (tiles size their accumulators by it)

VF_INLINE vf16 vf_zero(void) { return _mm512_setzero_ps(); }
VF_INLINE vf16 vf_set1(float x) { return _mm512_set1_ps(x); }
VF_INLINE vf16 vf_add(vf16 a, vf16 b) { return _mm512_add_ps(a, b); }
VF_INLINE vf16 vf_sub(vf16 a, vf16 b) { return _mm512_sub_ps(a, b); }
VF_INLINE vf16 vf_mul(vf16 a, vf16 b) { return _mm512_mul_ps(a, b); }
VF_INLINE vf16 vf_div(vf16 a, vf16 b) { return _mm512_div_ps(a, b); }
VF_INLINE vf16 vf_max(vf16 a, vf16 b) { return _mm512_max_ps(a, b); }
VF_INLINE vf16 vf_fma(vf16 a, vf16 b, vf16 c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c, one rounding
VF_INLINE vf16 vf_fnma(vf16 a, vf16 b, vf16 c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b, one rounding
VF_INLINE vf16 vf_abs(vf16 a) { return _mm512_abs_ps(a); }
VF_INLINE vf16 vf_neg(vf16 a) {  // the sign bit flipped, as torch's neg
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(INT32_MIN)));
}
VF_INLINE vf16 vf_round_nearest(vf16 a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
VF_INLINE vf16 vf_scale2(vf16 p, vf16 n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral
VF_INLINE float vf_reduce_add(vf16 a) { return _mm512_reduce_add_ps(a); }
VF_INLINE float vf_reduce_max(vf16 a) { return _mm512_reduce_max_ps(a); }

VF_INLINE vmask16 vf_tail(int64_t left) {  // the first min(left, 16) lanes
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
}
VF_INLINE vmask16 vf_lt(vf16 a, vf16 b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
VF_INLINE vmask16 vf_gt(vf16 a, vf16 b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
VF_INLINE vmask16 vf_nan(vf16 a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
VF_INLINE vmask16 mask_and(vmask16 a, vmask16 b) { return a & b; }
VF_INLINE vmask16 mask_or(vmask16 a, vmask16 b) { return a | b; }
VF_INLINE int mask_any(vmask16 a) { return a != 0; }
VF_INLINE vf16 vf_select(vmask16 m, vf16 yes, vf16 no) { return _mm512_mask_mov_ps(no, m, yes); }

VF_INLINE vi16 vi_set1(int32_t x) { return _mm512_set1_epi32(x); }
VF_INLINE vi16 vi_iota(void) { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
VF_INLINE vi16 vi_add(vi16 a, vi16 b) { return _mm512_add_epi32(a, b); }
VF_INLINE vi16 vi_and(vi16 a, vi16 b) { return _mm512_and_si512(a, b); }
VF_INLINE vi16 vi_shl16(vi16 a) { return _mm512_slli_epi32(a, 16); }
VF_INLINE vi16 vi_loadu(const void *p) { return _mm512_loadu_si512(p); }
VF_INLINE vf16 vi_as_vf(vi16 a) { return _mm512_castsi512_ps(a); }
VF_INLINE vmask16 vi_eq(vi16 a, vi16 b) { return _mm512_cmpeq_epi32_mask(a, b); }
VF_INLINE vi16 vi_select(vmask16 m, vi16 yes, vi16 no) { return _mm512_mask_mov_epi32(no, m, yes); }
VF_INLINE void vi_store(int32_t *p, vi16 a) { _mm512_storeu_si512(p, a); }

VF_INLINE vf16 vf_load_f32(const float *p, int64_t left) { return _mm512_maskz_loadu_ps(vf_tail(left), p); }
VF_INLINE void vf_store_f32(float *p, int64_t left, vf16 v) { _mm512_mask_storeu_ps(p, vf_tail(left), v); }

// 16 elements of a float32, bfloat16 or float16 array from `index` (the first `left`; zeros past them).
VF_INLINE vf16 load16(const void *base, int64_t index, int dtype, int64_t left) {
    const __mmask16 mask = vf_tail(left);
    if (dtype == DT_F32) return _mm512_maskz_loadu_ps(mask, (const float *)base + index);
    const __m256i raw = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)base + index);
    if (dtype == DT_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    return _mm512_cvtph_ps(raw);
}

// v rounded to the element type into `index` onward (the first `left` lanes).
VF_INLINE void store16(void *base, int64_t index, int dtype, int64_t left, vf16 v) {
    const __mmask16 mask = vf_tail(left);
    if (dtype == DT_F32) {
        _mm512_mask_storeu_ps((float *)base + index, mask, v);
    } else if (dtype == DT_BF16) {
        _mm256_mask_storeu_epi16((uint16_t *)base + index, mask, (__m256i)_mm512_cvtneps_pbh(v));
    } else {
        _mm256_mask_storeu_epi16((uint16_t *)base + index, mask, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    }
}

// v rounded to the element type and widened back (what torch's elementwise ops keep between two ops).
VF_INLINE vf16 round_to(int dtype, vf16 v) {
    if (dtype == DT_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
    if (dtype == DT_F16) return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    return v;
}

// Lane i of the result = the sum of v[i]'s 16 lanes, by one fixed tree whatever the other vectors hold.
VF_INLINE vf16 sum_lanes_of_16(const vf16 v[16]) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; i++)  // per 128-bit quad: [a0+a2, b0+b2, a1+a3, b1+b3]
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  // per quad: the quad's sum for each of 4 vectors
        const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 h01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88), _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
    const __m512 h23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88), _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(h01, h23, 0x88), _mm512_shuffle_f32x4(h01, h23, 0xDD));
}
