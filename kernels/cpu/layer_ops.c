// The elementwise parts of a decoder layer on the CPU path, one call each instead of a dozen small torch
// ops: RMSNorm (with the residual add before it), rotate-half RoPE and SiLU(gate) * up; and the greedy
// rows' argmax over the vocabulary.
//
// Each row or element is one fixed sequence of ops whatever the row count or thread count, so results
// are batch-invariant. Where torch rounds to the element type between two ops, these kernels round at
// the same places (round_to), so RoPE computes torch's bits exactly; RMSNorm's sum of squares and
// SiLU's exp follow an order and polynomial of their own.
#include <math.h>

#include "simd.h"

#define PARALLEL_ROWS 64  // fewer rows run on the calling thread: a decode step's rows cost less than a fork

// out = weight * round(x * rsqrt(mean(x^2) + eps)) per row of `hidden`, as RMSNorm in float32 then the
// element type. With `residual`, x is first round(x + residual), also written to `summed`.
void tf_rms_norm(const void *x, const void *residual, const void *weight, void *out, void *summed, int64_t rows,
                 int64_t hidden, float eps, int dtype, int threads) {
    const int64_t chunks = (hidden + 15) / 16;
#pragma omp parallel for num_threads(threads) if (rows >= PARALLEL_ROWS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * hidden;
        const void *source = x;
        if (residual) {  // summed = round(x + residual), the stream the next sublayer adds to
            for (int64_t c = 0; c < chunks; c++) {
                const __mmask16 m = tail_mask(hidden - c * 16);
                const __m512 sum = _mm512_add_ps(load16(x, base + c * 16, dtype, m),
                                                 load16(residual, base + c * 16, dtype, m));
                store16(summed, base + c * 16, dtype, m, sum);
            }
            source = summed;
        }
        __m512 squares = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; c++) {
            const __m512 v = load16(source, base + c * 16, dtype, tail_mask(hidden - c * 16));
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        const __m512 scale = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)hidden + eps));
        for (int64_t c = 0; c < chunks; c++) {
            const __mmask16 m = tail_mask(hidden - c * 16);
            const __m512 normed = round_to(dtype, _mm512_mul_ps(load16(source, base + c * 16, dtype, m), scale));
            store16(out, base + c * 16, dtype, m, _mm512_mul_ps(load16(weight, c * 16, dtype, m), normed));
        }
    }
}

// Rotate-half RoPE of x [tokens, heads, dim] into out, over the first `rot` features (the rest copied):
// out = round(round(x * cos) + round(rotate_half(x) * sin)), cos/sin [tokens, rot] in the element type.
void tf_rotary(const void *x, void *out, const void *cos, const void *sin, int64_t tokens, int64_t heads,
               int64_t dim, int64_t rot, int dtype, int threads) {
    const int64_t half = rot / 2;
#pragma omp parallel for num_threads(threads) if (tokens >= PARALLEL_ROWS) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t h = 0; h < heads; h++) {
            const int64_t row = (t * heads + h) * dim;
            for (int64_t i = 0; i < half; i += 16) {
                const __mmask16 m = tail_mask(half - i);
                const __m512 lo = load16(x, row + i, dtype, m), hi = load16(x, row + half + i, dtype, m);
                const __m512 cos_lo = load16(cos, t * rot + i, dtype, m);
                const __m512 cos_hi = load16(cos, t * rot + half + i, dtype, m);
                const __m512 sin_lo = load16(sin, t * rot + i, dtype, m);
                const __m512 sin_hi = load16(sin, t * rot + half + i, dtype, m);
                const __m512i sign = _mm512_set1_epi32(INT32_MIN);  // -hi as torch's neg: the sign bit flipped
                const __m512 neg_hi = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(hi), sign));
                const __m512 out_lo = _mm512_add_ps(round_to(dtype, _mm512_mul_ps(lo, cos_lo)),
                                                    round_to(dtype, _mm512_mul_ps(neg_hi, sin_lo)));
                const __m512 out_hi = _mm512_add_ps(round_to(dtype, _mm512_mul_ps(hi, cos_hi)),
                                                    round_to(dtype, _mm512_mul_ps(lo, sin_hi)));
                store16(out, row + i, dtype, m, out_lo);
                store16(out, row + half + i, dtype, m, out_hi);
            }
            for (int64_t i = rot; i < dim; i += 16) {  // the features RoPE leaves alone
                const __mmask16 m = tail_mask(dim - i);
                store16(out, row + i, dtype, m, load16(x, row + i, dtype, m));
            }
        }
    }
}

// out [rows, cols] = round(silu(gate)) * up, rounded, elementwise; gate and up rows start `stride` elements
// apart (the halves of one fused gate/up output, or two tensors of their own). silu(x) = x / (1 + exp(-x)),
// with exp taken of -|x| only (x >= 0: x / (1 + e); x < 0: x * e / (1 + e)).
void tf_silu_mul(const void *gate, const void *up, void *out, int64_t rows, int64_t cols, int64_t stride, int dtype,
                 int threads) {
    const int64_t chunks = (cols + 15) / 16;
#pragma omp parallel for num_threads(threads) if (rows * chunks >= 4096) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < chunks; c++) {
            const __mmask16 m = tail_mask(cols - c * 16);
            const __m512 g = load16(gate, r * stride + c * 16, dtype, m);
            const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
            const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
            const __m512 numerator = _mm512_mask_mul_ps(g, negative, g, e);
            const __m512 silu = round_to(dtype, _mm512_div_ps(numerator, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
            store16(out, r * cols + c * 16, dtype, m, _mm512_mul_ps(silu, load16(up, r * stride + c * 16, dtype, m)));
        }
    }
}

// out[r] = the index of row r's largest value, the lowest index on ties and the first NaN if any (as
// torch.argmax). Each lane keeps its own earliest best; lanes then meet by value, then index.
void tf_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out, int threads) {
#pragma omp parallel for num_threads(threads) if (rows > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * cols;
        __m512 best = _mm512_set1_ps(-INFINITY);
        __m512i where = _mm512_set1_epi32(-1);
        __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __mmask16 unordered = 0;
        for (int64_t c = 0; c < cols; c += 16) {
            const __mmask16 m = tail_mask(cols - c);
            const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, row + c);
            unordered |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
            const __mmask16 better = _mm512_mask_cmp_ps_mask(m, v, best, _CMP_GT_OQ)
                                     | (_mm512_cmpeq_epi32_mask(where, _mm512_set1_epi32(-1)) & m);
            best = _mm512_mask_mov_ps(best, better, v);
            where = _mm512_mask_mov_epi32(where, better, at);
            at = _mm512_add_epi32(at, _mm512_set1_epi32(16));
        }
        int64_t index = -1;
        if (unordered) {
            for (int64_t c = 0; c < cols && index < 0; c++)
                if (row[c] != row[c]) index = c;
        } else {
            float lanes[16];
            int32_t ids[16];
            _mm512_storeu_ps(lanes, best);
            _mm512_storeu_si512(ids, where);
            for (int l = 0; l < 16; l++) {
                if (ids[l] < 0) continue;
                if (index < 0 || lanes[l] > row[index] || (lanes[l] == row[index] && ids[l] < index)) index = ids[l];
            }
        }
        out[r] = index;
    }
}
