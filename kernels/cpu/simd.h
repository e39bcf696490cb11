// The one SIMD header of the CPU kernels: 16-lane float and int32 vectors and lane predicates, over an
// AVX-512 backend and a portable one (AVX2, ARM NEON).
//
// A 16-lane float vector (vf16), a 16-lane int32 vector (vi16) and a lane predicate (vmask16), with loads
// and stores from float32, bfloat16 or float16 arrays, tail handling, rounding to the element type and exp.
// Two backends compile from it:
//   - AVX-512 (the amx and avx512 levels): one zmm register per vector, __mmask16 predicates;
//   - portable (the avx2 level, and ARM NEON): GCC/Clang vector extensions over the machine's own width
//     (two 8-float halves on AVX2, four 4-float quarters on NEON), FMA and float16 conversions by intrinsics.
// Every helper is a fixed sequence of ops, so an element's bits never depend on where it sits or how many
// elements a call covers; each backend computes its own bits (a level is a build).
#ifndef TENSORFOLD_SIMD_H
#define TENSORFOLD_SIMD_H

#include <stdint.h>
#include <string.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

#define VF_INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__)
#include "simd_avx512.h"
#elif defined(__AVX2__) || defined(__ARM_NEON)
#include "simd_portable.h"
#else
#error "the CPU kernels need AVX-512, AVX2 + FMA + F16C, or ARM NEON"
#endif

// exp(x) for x <= 0 (attention scores less their max, SiLU's exp(-|x|)): 2^n * (1 + r + r^2 P(r)),
// Cephes' expf polynomial.
VF_INLINE vf16 exp_nonpositive(vf16 x) {
    x = vf_max(x, vf_set1(-87.0f));
    const vf16 n = vf_round_nearest(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf16 r = vf_fnma(n, vf_set1(0.693359375f), x);
    r = vf_fnma(n, vf_set1(-2.12194440e-4f), r);
    vf16 p = vf_set1(1.9875691500e-4f);
    p = vf_fma(p, r, vf_set1(1.3981999507e-3f));
    p = vf_fma(p, r, vf_set1(8.3334519073e-3f));
    p = vf_fma(p, r, vf_set1(4.1665795894e-2f));
    p = vf_fma(p, r, vf_set1(1.6666665459e-1f));
    p = vf_fma(p, r, vf_set1(5.0000001201e-1f));
    p = vf_fma(p, vf_mul(r, r), vf_add(r, vf_set1(1.0f)));
    return vf_scale2(p, n);
}

// A bfloat16 weight's 16 (even, odd) pairs of K, as two fp32 vectors: element 2i widened into lane i of
// `even`, element 2i + 1 into lane i of `odd` (a bf16 is the top half of its fp32).
VF_INLINE void bf16_pairs(const uint16_t *pairs, vf16 *even, vf16 *odd) {
    const vi16 raw = vi_loadu(pairs);
    *even = vi_as_vf(vi_shl16(raw));
    *odd = vi_as_vf(vi_and(raw, vi_set1((int32_t)0xFFFF0000u)));
}

// The even (element 2i into lane i) or the odd elements of 16 bfloat16 pairs, as fp32: bf16_pairs one at a
// time, so a register block holds one weight vector, not two.
VF_INLINE vf16 bf16_even(const uint16_t *pairs) { return vi_as_vf(vi_shl16(vi_loadu(pairs))); }
VF_INLINE vf16 bf16_odd(const uint16_t *pairs) {
    return vi_as_vf(vi_and(vi_loadu(pairs), vi_set1((int32_t)0xFFFF0000u)));
}

// One bfloat16 as a float (exact).
VF_INLINE float bf16_to_float(uint16_t bits) {
    const uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof(value));
    return value;
}

#endif
