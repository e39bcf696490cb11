// The GGUF weight blocks the quantized GEMM reads (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) and the activation
// quantization it pairs them with (docs/engine.md, "Quantized weights").
//
// A weight block decodes to unsigned integer codes q (Q8_0: its int8 plus 128; Q6_K: its 6 bits, so the
// value is q - 32), integer group scales and mins, and its float scales. All integer work (decoding, dot
// products) is exact; only `fold` (quant_gemm.c) and `dequantize_block` round, in a fixed order.
#ifndef TENSORFOLD_QUANT_BLOCKS_H
#define TENSORFOLD_QUANT_BLOCKS_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q4_K = 3, Q5_K = 4, Q6_K = 5 };

typedef struct {
    int block;   // weights per block
    int bytes;   // bytes per block
    int group;   // weights per integer scale (the whole block for the 32-weight types)
    int offset;  // subtracted from q to give the signed value (Q4_1, Q4_K, Q5_K use a min instead)
} qformat;

static const qformat QFORMATS[6] = {
    {32, 34, 32, 128}, {32, 18, 32, 8}, {32, 20, 32, 0}, {256, 144, 32, 0}, {256, 176, 32, 0}, {256, 210, 16, 32},
};

typedef struct {
    uint8_t q[256] __attribute__((aligned(64)));  // the codes, in the block's element order
    int32_t scales[16];                           // per group (1 for the 32-weight types)
    int32_t mins[8];                              // Q4_K, Q5_K: per group of 32
    float d, dmin;                                // dmin: Q4_1's m, the K types' dmin
} wblock;

// An IEEE half as a float, exactly (subnormals included), as numpy's astype(float32).
static inline float half_to_float(const uint8_t *p) {
    const uint32_t h = (uint32_t)p[0] | (uint32_t)p[1] << 8;
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    if (exp == 0) {
        const float f = (float)man * 0x1p-24f;
        return sign ? -f : f;
    }
    const uint32_t bits = sign | (exp == 31 ? 0x7F800000u : (exp + 112) << 23) | man << 13;
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

// Q4_K and Q5_K's 12 bytes of 6-bit scales and mins (ggml's packing: groups 4-7 keep their top bits in the
// top two bits of bytes 0-7).
static inline void k_scales(const uint8_t *s, wblock *b) {
    for (int j = 0; j < 4; j++) {
        b->scales[j] = s[j] & 63;
        b->mins[j] = s[j + 4] & 63;
        b->scales[j + 4] = (s[j + 8] & 0x0F) | (s[j] >> 6) << 4;
        b->mins[j + 4] = (s[j + 8] >> 4) | (s[j + 4] >> 6) << 4;
    }
}

// Nibbles of 32 bytes: byte l's low nibble is element l, its high nibble element l + 32 (Q4_K, Q5_K).
static inline void nibbles32(const uint8_t *qs, uint8_t *q) {
    for (int l = 0; l < 32; l++) {
        q[l] = qs[l] & 0x0F;
        q[l + 32] = qs[l] >> 4;
    }
}

static inline void decode_q6_k(const uint8_t *src, wblock *b) {
    const uint8_t *ql = src, *qh = src + 128;
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++) {
            const uint8_t lo = ql[64 * h + l], hi = ql[64 * h + l + 32], top = qh[32 * h + l];
            uint8_t *q = b->q + 128 * h + l;
            q[0] = (lo & 0x0F) | (top & 3) << 4;
            q[32] = (hi & 0x0F) | (top >> 2 & 3) << 4;
            q[64] = (lo >> 4) | (top >> 4 & 3) << 4;
            q[96] = (hi >> 4) | (top >> 6 & 3) << 4;
        }
    for (int j = 0; j < 16; j++) b->scales[j] = (int8_t)src[192 + j];
    b->d = half_to_float(src + 208);
}

// One block of `type` at src into b (the GGUF layouts, as gguf-py's quants module reads them).
static inline __attribute__((always_inline)) void decode_block(const int type, const uint8_t *src, wblock *b) {
    b->scales[0] = 1;
    b->dmin = 0.0f;
    if (type == Q6_K) return decode_q6_k(src, b);
    b->d = half_to_float(src);
    if (type == Q8_0) {
        for (int i = 0; i < 32; i++) b->q[i] = src[2 + i] ^ 0x80;
    } else if (type == Q4_0 || type == Q4_1) {
        const uint8_t *qs = src + (type == Q4_0 ? 2 : 4);
        if (type == Q4_1) b->dmin = half_to_float(src + 2);
#if defined(__AVX2__)  // one 32-byte store, so the dot product's 32-byte load of the codes is forwarded from it
        const __m128i v = _mm_loadu_si128((const __m128i *)qs), low = _mm_set1_epi8(0x0F);
        _mm256_store_si256((__m256i *)b->q,
                           _mm256_setr_m128i(_mm_and_si128(v, low), _mm_and_si128(_mm_srli_epi16(v, 4), low)));
#else
        for (int l = 0; l < 16; l++) {
            b->q[l] = qs[l] & 0x0F;
            b->q[l + 16] = qs[l] >> 4;
        }
#endif
    } else {  // Q4_K, Q5_K: d, dmin, 12 bytes of scales, (Q5_K: 32 bytes of fifth bits), 128 bytes of nibbles
        b->dmin = half_to_float(src + 2);
        k_scales(src + 4, b);
        const uint8_t *qs = src + (type == Q4_K ? 16 : 48);
        for (int j = 0; j < 4; j++) nibbles32(qs + 32 * j, b->q + 64 * j);
        if (type == Q5_K)
            for (int j = 0; j < 8; j++)
                for (int l = 0; l < 32; l++) b->q[32 * j + l] |= (src[16 + l] >> j & 1) << 4;
    }
}

// Element i's value, with gguf-py's float32 ops in its order (so the bits equal its dequantize's).
static inline float dequantize_value(int type, const wblock *b, int i) {
    const int g = i / QFORMATS[type].group;
    switch (type) {
        case Q8_0: return (float)((int)b->q[i] - 128) * b->d;
        case Q4_0: return b->d * (float)((int)b->q[i] - 8);
        case Q4_1: return b->d * (float)b->q[i] + b->dmin;
        case Q6_K: return (b->d * (float)b->scales[g]) * (float)((int)b->q[i] - 32);
        default: return (b->d * (float)b->scales[g]) * (float)b->q[i] - b->dmin * (float)b->mins[g];
    }
}

// The quantized activations of a call: per row, each block of `block` values as int8 q = rint(x / d) with
// d = max|x| / 127 (float32; q = 0 where d = 0), and the sum of q over each 16 values.
typedef struct {
    int8_t *q;      // [m][k]
    float *d;       // [m][k / block]
    int32_t *sums;  // [m][k / 16]
    int64_t k;
    int block;
} qacts;

#if defined(__AVX512F__)
// quantize_row on 16 lanes: the same max (MAXPS keeps amax over a NaN as fmaxf does), the same products
// rounded by the same rule (VCVTPS2DQ and lrintf both round to nearest even), the same low 8 bits.
static void quantize_row_avx512(const float *x, int64_t k, int block, int8_t *q, float *d, int32_t *sums) {
    for (int64_t b0 = 0; b0 < k; b0 += block) {
        __m512 amax = _mm512_setzero_ps();
        for (int i = 0; i < block; i += 16) amax = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + b0 + i)), amax);
        const float scale = _mm512_reduce_max_ps(amax) / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
        d[b0 / block] = scale;
        for (int i = 0; i < block; i += 16) {
            const __m512 scaled = _mm512_mul_ps(_mm512_loadu_ps(x + b0 + i), _mm512_set1_ps(inverse));
            const __m512i codes = _mm512_cvtps_epi32(scaled);
            const __m512i bytes = _mm512_srai_epi32(_mm512_slli_epi32(codes, 24), 24);  // as int8_t, sign-extended
            _mm_storeu_si128((__m128i *)(q + b0 + i), _mm512_cvtepi32_epi8(codes));
            sums[(b0 + i) / 16] = _mm512_reduce_add_epi32(bytes);
        }
    }
}
#endif

static void quantize_row(const float *x, int64_t k, int block, int8_t *q, float *d, int32_t *sums) {
#if defined(__AVX512F__)
    quantize_row_avx512(x, k, block, q, d, sums);
    return;
#endif
    for (int64_t b0 = 0; b0 < k; b0 += block) {
        float amax = 0.0f;
        for (int i = 0; i < block; i++) amax = fmaxf(amax, fabsf(x[b0 + i]));
        const float scale = amax / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
        d[b0 / block] = scale;
        for (int i = 0; i < block; i++) q[b0 + i] = (int8_t)lrintf(x[b0 + i] * inverse);  // rint: ties to even
    }
    for (int64_t g = 0; g < k / 16; g++) {
        int32_t s = 0;
        for (int i = 0; i < 16; i++) s += q[16 * g + i];
        sums[g] = s;
    }
}

#endif
