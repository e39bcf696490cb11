// simd.h's portable backend (the avx2 level, and ARM NEON): a 16-lane vector is PARTS vectors of the
// machine's own width, written with GCC/Clang vector extensions; only FMA and the float16 conversions are
// intrinsics. Predicates are int32 lanes of all ones or zeros. Included by simd.h only.
#if defined(__AVX2__)
#include <immintrin.h>
#define NATIVE_LANES 8
#else
#include <arm_neon.h>
#define NATIVE_LANES 4
#endif

#define PARTS (16 / NATIVE_LANES)
#define VF_REGISTERS 8  // 16-lane vectors the register file holds (AVX2: 16 x 8 lanes, NEON: 32 x 4)

typedef float vn __attribute__((vector_size(NATIVE_LANES * 4)));
typedef int32_t vin __attribute__((vector_size(NATIVE_LANES * 4)));
typedef uint32_t vun __attribute__((vector_size(NATIVE_LANES * 4)));
typedef uint16_t vhn __attribute__((vector_size(NATIVE_LANES * 2)));

typedef struct {
    vn p[PARTS];  // lanes [i * NATIVE_LANES, (i + 1) * NATIVE_LANES)
} vf16;
typedef struct {
    vin p[PARTS];
} vi16;
typedef vi16 vmask16;

// The one fused multiply-add of the machine's width: a * b + c, one rounding.
VF_INLINE vn native_fma(vn a, vn b, vn c) {
#if defined(__AVX2__)
    return (vn)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return (vn)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b);
#endif
}

VF_INLINE vn native_from_f16(const uint16_t *p) {
#if defined(__AVX2__)
    return (vn)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    return (vn)vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
#endif
}

// NATIVE_LANES bfloat16 widened to floats (exact). On AVX2 one zero-extending load and a shift: GCC splits
// the vector extensions' conversion of 8 uint16 into five instructions.
VF_INLINE vn native_from_bf16(const uint16_t *p) {
#if defined(__AVX2__)
    return (vn)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    vhn half;
    memcpy(&half, p, sizeof(half));
    return (vn)(__builtin_convertvector(half, vun) << 16);
#endif
}

VF_INLINE void native_to_f16(uint16_t *p, vn v) {
#if defined(__AVX2__)
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT));
#else
    vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32((float32x4_t)v)));
#endif
}

#define EACH_PART _Pragma("GCC unroll 4") for (int i_ = 0; i_ < PARTS; i_++)
#define VF_MAP(name, expr)                       \
    VF_INLINE vf16 name(vf16 a, vf16 b) {        \
        vf16 r;                                  \
        EACH_PART { vn x = a.p[i_], y = b.p[i_]; r.p[i_] = (expr); } \
        return r;                                \
    }

VF_INLINE vn vn_set1(float x) {  // a broadcast (adding x to zeros would cost an add and lose -0.0)
#if defined(__AVX2__)
    return (vn)_mm256_set1_ps(x);
#else
    return (vn)vdupq_n_f32(x);
#endif
}
VF_INLINE vf16 vf_set1(float x) {
    vf16 r;
    EACH_PART r.p[i_] = vn_set1(x);
    return r;
}
VF_INLINE vf16 vf_zero(void) { return vf_set1(0.0f); }
VF_MAP(vf_add, x + y)
VF_MAP(vf_sub, x - y)
VF_MAP(vf_mul, x * y)
VF_MAP(vf_div, x / y)

VF_INLINE vf16 vf_fma(vf16 a, vf16 b, vf16 c) {
    vf16 r;
    EACH_PART r.p[i_] = native_fma(a.p[i_], b.p[i_], c.p[i_]);
    return r;
}
VF_INLINE vf16 vf_fnma(vf16 a, vf16 b, vf16 c) {  // c - a * b, one rounding: (-a) * b + c
    vf16 r;
    EACH_PART r.p[i_] = native_fma(-a.p[i_], b.p[i_], c.p[i_]);
    return r;
}

VF_INLINE vf16 vi_as_vf(vi16 a) {
    vf16 r;
    EACH_PART r.p[i_] = (vn)a.p[i_];
    return r;
}
VF_INLINE vi16 vf_as_vi(vf16 a) {
    vi16 r;
    EACH_PART r.p[i_] = (vin)a.p[i_];
    return r;
}
VF_INLINE vf16 vf_select(vmask16 m, vf16 yes, vf16 no) {
    vf16 r;
    EACH_PART r.p[i_] = (vn)((m.p[i_] & (vin)yes.p[i_]) | (~m.p[i_] & (vin)no.p[i_]));
    return r;
}
VF_INLINE vmask16 vf_lt(vf16 a, vf16 b) {
    vmask16 r;
    EACH_PART r.p[i_] = a.p[i_] < b.p[i_];
    return r;
}
VF_INLINE vmask16 vf_gt(vf16 a, vf16 b) { return vf_lt(b, a); }
VF_INLINE vmask16 vf_nan(vf16 a) {
    vmask16 r;
    EACH_PART r.p[i_] = a.p[i_] != a.p[i_];
    return r;
}
VF_INLINE vf16 vf_max(vf16 a, vf16 b) { return vf_select(vf_gt(a, b), a, b); }  // b where unordered
VF_INLINE vf16 vf_abs(vf16 a) {
    vf16 r;
    EACH_PART r.p[i_] = (vn)((vin)a.p[i_] & INT32_MAX);
    return r;
}
VF_INLINE vf16 vf_neg(vf16 a) {  // the sign bit flipped, as torch's neg
    vf16 r;
    EACH_PART r.p[i_] = (vn)((vin)a.p[i_] ^ INT32_MIN);
    return r;
}
// Round to the nearest integer, ties to even, for |a| < 2^22 (exp's argument): adding and taking away
// 1.5 * 2^23 leaves no fraction bits.
VF_INLINE vf16 vf_round_nearest(vf16 a) {
    const float shift = 12582912.0f;
    vf16 r;
    EACH_PART r.p[i_] = (a.p[i_] + shift) - shift;
    return r;
}
// p * 2^n for integral n in [-126, 127]: 2^n built from its exponent bits is exact, so one rounding.
VF_INLINE vf16 vf_scale2(vf16 p, vf16 n) {
    vf16 r;
    EACH_PART r.p[i_] = p.p[i_] * (vn)((__builtin_convertvector(n.p[i_], vin) + 127) << 23);
    return r;
}

// A vector's 16 lanes summed by one fixed tree: its parts in order, then the lanes pairwise.
VF_INLINE float vf_reduce_add(vf16 a) {
    vn h = a.p[0];
    for (int i = 1; i < PARTS; i++) h = h + a.p[i];
    float lanes[NATIVE_LANES];
    memcpy(lanes, &h, sizeof(lanes));
    for (int width = NATIVE_LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) lanes[l] = lanes[l] + lanes[l + width];
    return lanes[0];
}
VF_INLINE float vf_reduce_max(vf16 a) {
    float lanes[16], best;
    memcpy(lanes, a.p, sizeof(lanes));
    best = lanes[0];
    for (int l = 1; l < 16; l++) best = lanes[l] > best ? lanes[l] : best;
    return best;
}
// Lane i of the result = the sum of v[i]'s 16 lanes (vf_reduce_add's tree). On AVX2 the 16 trees run side by
// side: each step adds the same pairs of lanes as vf_reduce_add, gathered from two vectors by one shuffle.
VF_INLINE vf16 sum_lanes_of_16(const vf16 v[16]) {
    vf16 r;
#if defined(__AVX2__)
    __m256 h[16], quads[8], pairs[4], sums[2];
    for (int i = 0; i < 16; i++) h[i] = (__m256)(v[i].p[0] + v[i].p[1]);
    for (int i = 0; i < 8; i++)  // lanes l + l+4: v[2i]'s four in the low half, v[2i+1]'s in the high
        quads[i] = _mm256_add_ps(_mm256_permute2f128_ps(h[2 * i], h[2 * i + 1], 0x20),
                                 _mm256_permute2f128_ps(h[2 * i], h[2 * i + 1], 0x31));
    for (int i = 0; i < 4; i++)  // lanes l + l+2 of two quads, per half
        pairs[i] = _mm256_add_ps(_mm256_shuffle_ps(quads[2 * i], quads[2 * i + 1], 0x44),
                                 _mm256_shuffle_ps(quads[2 * i], quads[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++)  // lane 0 + lane 1 of each pair: v[8i + 0, 2, 4, 6] low, v[8i + 1, 3, 5, 7] high
        sums[i] = _mm256_add_ps(_mm256_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x88),
                                _mm256_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xDD));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int i = 0; i < 2; i++) r.p[i] = (vn)_mm256_permutevar8x32_ps(sums[i], order);
#else
    float sums[16];
    for (int i = 0; i < 16; i++) sums[i] = vf_reduce_add(v[i]);
    memcpy(r.p, sums, sizeof(sums));
#endif
    return r;
}

VF_INLINE vi16 vi_set1(int32_t x) {
    vi16 r;
    EACH_PART r.p[i_] = (vin){0} + x;
    return r;
}
VF_INLINE vi16 vi_iota(void) {
    int32_t lanes[16];
    for (int l = 0; l < 16; l++) lanes[l] = l;
    vi16 r;
    memcpy(r.p, lanes, sizeof(lanes));
    return r;
}
VF_INLINE vi16 vi_add(vi16 a, vi16 b) {
    vi16 r;
    EACH_PART r.p[i_] = a.p[i_] + b.p[i_];
    return r;
}
VF_INLINE vi16 vi_and(vi16 a, vi16 b) {
    vi16 r;
    EACH_PART r.p[i_] = a.p[i_] & b.p[i_];
    return r;
}
VF_INLINE vi16 vi_shl16(vi16 a) {
    vi16 r;
    EACH_PART r.p[i_] = (vin)((vun)a.p[i_] << 16);
    return r;
}
// Whole-vector copies go part by part: each memcpy of one part is one unaligned load or store (one copy of
// the whole struct goes through the stack, and its reload stalls on store forwarding).
VF_INLINE vi16 vi_loadu(const void *p) {
    vi16 r;
    EACH_PART memcpy(&r.p[i_], (const char *)p + i_ * sizeof(vin), sizeof(vin));
    return r;
}
VF_INLINE void vi_store(int32_t *p, vi16 a) {
    EACH_PART memcpy(p + i_ * NATIVE_LANES, &a.p[i_], sizeof(vin));
}
VF_INLINE vmask16 vi_eq(vi16 a, vi16 b) {
    vmask16 r;
    EACH_PART r.p[i_] = a.p[i_] == b.p[i_];
    return r;
}
VF_INLINE vi16 vi_select(vmask16 m, vi16 yes, vi16 no) {
    vi16 r;
    EACH_PART r.p[i_] = (m.p[i_] & yes.p[i_]) | (~m.p[i_] & no.p[i_]);
    return r;
}

VF_INLINE vmask16 vf_tail(int64_t left) {  // the first min(left, 16) lanes
    const int32_t count = left >= 16 ? 16 : (int32_t)left;
    const vi16 at = vi_iota();
    vmask16 r;
    EACH_PART r.p[i_] = at.p[i_] < count;
    return r;
}
VF_INLINE vmask16 mask_and(vmask16 a, vmask16 b) { return vi_and(a, b); }
VF_INLINE vmask16 mask_or(vmask16 a, vmask16 b) {
    vmask16 r;
    EACH_PART r.p[i_] = a.p[i_] | b.p[i_];
    return r;
}
VF_INLINE int mask_any(vmask16 a) {
    vin any = a.p[0];
    for (int i = 1; i < PARTS; i++) any = any | a.p[i];
    for (int l = 0; l < NATIVE_LANES; l++)
        if (any[l]) return 1;
    return 0;
}

VF_INLINE vf16 vf_load_f32(const float *p, int64_t left) {
    vf16 r;
    if (left >= 16) {
        EACH_PART memcpy(&r.p[i_], p + i_ * NATIVE_LANES, sizeof(vn));
        return r;
    }
    float lanes[16] = {0};
    memcpy(lanes, p, (size_t)left * sizeof(float));
    memcpy(r.p, lanes, sizeof(lanes));
    return r;
}
VF_INLINE void vf_store_f32(float *p, int64_t left, vf16 v) {
    if (left >= 16) {
        EACH_PART memcpy(p + i_ * NATIVE_LANES, &v.p[i_], sizeof(vn));
        return;
    }
    memcpy(p, v.p, (size_t)left * sizeof(float));
}

// 16 elements of a float32, bfloat16 or float16 array from `index` (the first `left`; zeros past them).
VF_INLINE vf16 load16(const void *base, int64_t index, int dtype, int64_t left) {
    if (dtype == DT_F32) return vf_load_f32((const float *)base + index, left);
    uint16_t staged[16] = {0};
    const uint16_t *raw = (const uint16_t *)base + index;
    if (left < 16) raw = memcpy(staged, raw, (size_t)left * sizeof(uint16_t));
    vf16 r;
    EACH_PART {
        if (dtype == DT_BF16) {
            r.p[i_] = native_from_bf16(raw + i_ * NATIVE_LANES);
        } else {
            r.p[i_] = native_from_f16(raw + i_ * NATIVE_LANES);
        }
    }
    return r;
}

// Float to bfloat16 bits, rounding to nearest even, NaN kept a quiet NaN (torch's rounding).
VF_INLINE vun native_to_bf16_bits(vn v) {
    const vun bits = (vun)v;
    const vun rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    const vun nan = (vun)(v != v);
    return (nan & 0x7FC0u) | (~nan & rounded);
}

// v rounded to the element type into `index` onward (the first `left` lanes).
VF_INLINE void store16(void *base, int64_t index, int dtype, int64_t left, vf16 v) {
    if (dtype == DT_F32) {
        vf_store_f32((float *)base + index, left, v);
        return;
    }
    uint16_t raw[16];
    EACH_PART {
        if (dtype == DT_BF16) {
            const vhn half = __builtin_convertvector(native_to_bf16_bits(v.p[i_]), vhn);
            memcpy(raw + i_ * NATIVE_LANES, &half, sizeof(half));
        } else {
            native_to_f16(raw + i_ * NATIVE_LANES, v.p[i_]);
        }
    }
    memcpy((uint16_t *)base + index, raw, (size_t)(left >= 16 ? 16 : left) * sizeof(uint16_t));
}

// v rounded to the element type and widened back (what torch's elementwise ops keep between two ops).
VF_INLINE vf16 round_to(int dtype, vf16 v) {
    if (dtype == DT_F32) return v;
    uint16_t raw[16];
    store16(raw, 0, dtype, 16, v);
    return load16(raw, 0, dtype, 16);
}
