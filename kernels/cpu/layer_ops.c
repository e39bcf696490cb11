// The elementwise parts of a decoder layer on the CPU path, one call each instead of a dozen small torch
// ops: RMSNorm (with the residual add before it, or its float32-scaled variant), rotate-half RoPE and
// SiLU(gate) * up or GELU-tanh(gate) * up; and the greedy rows' argmax over the vocabulary.
//
// Each row or element is one fixed sequence of ops whatever the row count or thread count, so results
// are batch-invariant. Where torch rounds to the element type between two ops, these kernels round at
// the same places (round_to), so RoPE computes torch's bits exactly; RMSNorm's sum of squares and
// SiLU's exp follow an order and polynomial of their own.
#include <math.h>

#include "simd.h"

#define PARALLEL_ROWS 64  // fewer rows run on the calling thread: a decode step's rows cost less than a fork

// 1 / sqrt(mean(x^2) + eps) of one row, its squares summed in 16-lane chunks (every RMSNorm here).
static inline vf16 rms_scale(const void *x, int64_t base, int64_t hidden, float eps, int dtype) {
    vf16 squares = vf_zero();
    for (int64_t c = 0; c < (hidden + 15) / 16; c++) {
        const vf16 v = load16(x, base + c * 16, dtype, hidden - c * 16);
        squares = vf_fma(v, v, squares);
    }
    return vf_set1(1.0f / sqrtf(vf_reduce_add(squares) / (float)hidden + eps));
}

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
                const int64_t left = hidden - c * 16;
                const vf16 sum = vf_add(load16(x, base + c * 16, dtype, left), load16(residual, base + c * 16, dtype, left));
                store16(summed, base + c * 16, dtype, left, sum);
            }
            source = summed;
        }
        const vf16 scale = rms_scale(source, base, hidden, eps, dtype);
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t left = hidden - c * 16;
            const vf16 normed = round_to(dtype, vf_mul(load16(source, base + c * 16, dtype, left), scale));
            store16(out, base + c * 16, dtype, left, vf_mul(load16(weight, c * 16, dtype, left), normed));
        }
    }
}

// out = round(float(weight) * x * rsqrt(mean(x^2) + eps)) per row of `hidden`: the scale applied to the
// float32 normalised row and rounded once (Gemma's and Nemotron-H's convention), the same sum of squares.
void tf_rms_norm_wide(const void *x, const void *weight, void *out, int64_t rows, int64_t hidden, float eps,
                      int dtype, int threads) {
    const int64_t chunks = (hidden + 15) / 16;
#pragma omp parallel for num_threads(threads) if (rows >= PARALLEL_ROWS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * hidden;
        const vf16 scale = rms_scale(x, base, hidden, eps, dtype);
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t left = hidden - c * 16;
            const vf16 normed = vf_mul(load16(x, base + c * 16, dtype, left), scale);
            store16(out, base + c * 16, dtype, left, vf_mul(load16(weight, c * 16, dtype, left), normed));
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
                const int64_t left = half - i;
                const vf16 lo = load16(x, row + i, dtype, left), hi = load16(x, row + half + i, dtype, left);
                const vf16 cos_lo = load16(cos, t * rot + i, dtype, left);
                const vf16 cos_hi = load16(cos, t * rot + half + i, dtype, left);
                const vf16 sin_lo = load16(sin, t * rot + i, dtype, left);
                const vf16 sin_hi = load16(sin, t * rot + half + i, dtype, left);
                const vf16 out_lo =
                    vf_add(round_to(dtype, vf_mul(lo, cos_lo)), round_to(dtype, vf_mul(vf_neg(hi), sin_lo)));
                const vf16 out_hi = vf_add(round_to(dtype, vf_mul(hi, cos_hi)), round_to(dtype, vf_mul(lo, sin_hi)));
                store16(out, row + i, dtype, left, out_lo);
                store16(out, row + half + i, dtype, left, out_hi);
            }
            for (int64_t i = rot; i < dim; i += 16)  // the features RoPE leaves alone
                store16(out, row + i, dtype, dim - i, load16(x, row + i, dtype, dim - i));
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
            const int64_t left = cols - c * 16;
            const vf16 g = load16(gate, r * stride + c * 16, dtype, left);
            const vf16 e = exp_nonpositive(vf_sub(vf_zero(), vf_abs(g)));
            const vf16 numerator = vf_select(vf_lt(g, vf_zero()), vf_mul(g, e), g);
            const vf16 silu = round_to(dtype, vf_div(numerator, vf_add(vf_set1(1.0f), e)));
            store16(out, r * cols + c * 16, dtype, left, vf_mul(silu, load16(up, r * stride + c * 16, dtype, left)));
        }
    }
}

// out [rows, cols] = round(gelu_tanh(gate)) * up, rounded, as tf_silu_mul lays rows out. gelu_tanh(g) =
// g (1 + tanh(u)) / 2 = g / (1 + exp(-2u)), u = sqrt(2 / pi) (g + 0.044715 g^3), with exp taken of -2|u|
// only (u >= 0: g / (1 + e); u < 0: g e / (1 + e)), as tf_silu_mul takes silu.
void tf_gelu_tanh_mul(const void *gate, const void *up, void *out, int64_t rows, int64_t cols, int64_t stride,
                      int dtype, int threads) {
    const int64_t chunks = (cols + 15) / 16;
#pragma omp parallel for num_threads(threads) if (rows * chunks >= 4096) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t left = cols - c * 16;
            const vf16 g = load16(gate, r * stride + c * 16, dtype, left);
            const vf16 cube = vf_mul(vf_mul(g, g), g);
            const vf16 u = vf_mul(vf_set1(0.7978845608028654f), vf_fma(vf_set1(0.044715f), cube, g));
            const vf16 e = exp_nonpositive(vf_mul(vf_set1(-2.0f), vf_abs(u)));
            const vf16 numerator = vf_select(vf_lt(u, vf_zero()), vf_mul(g, e), g);
            const vf16 gelu = round_to(dtype, vf_div(numerator, vf_add(vf_set1(1.0f), e)));
            store16(out, r * cols + c * 16, dtype, left, vf_mul(gelu, load16(up, r * stride + c * 16, dtype, left)));
        }
    }
}

// out[r] = the index of row r's largest value, the lowest index on ties and the first NaN if any (as
// torch.argmax). Each lane keeps its own earliest best; lanes then meet by value, then index.
void tf_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out, int threads) {
#pragma omp parallel for num_threads(threads) if (rows > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * cols;
        vf16 best = vf_set1(-INFINITY);
        vi16 where = vi_set1(-1), at = vi_iota();
        vmask16 unordered = vf_tail(0);
        for (int64_t c = 0; c < cols; c += 16) {
            const vmask16 m = vf_tail(cols - c);
            const vf16 v = vf_select(m, vf_load_f32(row + c, cols - c), vf_set1(-INFINITY));
            unordered = mask_or(unordered, vf_nan(v));
            const vmask16 better = mask_and(mask_or(vf_gt(v, best), vi_eq(where, vi_set1(-1))), m);
            best = vf_select(better, v, best);
            where = vi_select(better, at, where);
            at = vi_add(at, vi_set1(16));
        }
        int64_t index = -1;
        if (mask_any(unordered)) {
            for (int64_t c = 0; c < cols && index < 0; c++)
                if (row[c] != row[c]) index = c;
        } else {
            float lanes[16];
            int32_t ids[16];
            vf_store_f32(lanes, 16, best);
            vi_store(ids, where);
            for (int l = 0; l < 16; l++) {
                if (ids[l] < 0) continue;
                if (index < 0 || lanes[l] > row[index] || (lanes[l] == row[index] && ids[l] < index)) index = ids[l];
            }
        }
        out[r] = index;
    }
}
