// GLM-5.3-Flash's hyper-connection weights per token, one call instead of a hundred small torch ops.
//
// The Sinkhorn loop alone was forty ops per block. From the block's projection `mix` [T, (2 + n) n],
//   pre = sigmoid(mix_pre * s0 + b_pre) + eps,  post = 2 sigmoid(mix_post * s1 + b_post),
//   comb = softmax_rows(mix_comb * s2 + b_comb) + eps, columns normalised, then (iters - 1) times rows then
//   columns normalised (each divided by its sum + eps).
// Each token is one fixed sequence of scalar float32 ops (libm's expf), so results are batch-invariant.
#include <math.h>
#include <stdint.h>

#include "simd.h"

#define HC_MAX 16  // streams a token's comb matrix may have on the stack

static inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

static void normalise_columns(float *comb, int n, float eps) {
    for (int j = 0; j < n; j++) {
        float sum = 0.0f;
        for (int i = 0; i < n; i++) sum += comb[i * n + j];
        for (int i = 0; i < n; i++) comb[i * n + j] /= sum + eps;
    }
}

static void normalise_rows(float *comb, int n, float eps) {
    for (int i = 0; i < n; i++) {
        float sum = 0.0f;
        for (int j = 0; j < n; j++) sum += comb[i * n + j];
        for (int j = 0; j < n; j++) comb[i * n + j] /= sum + eps;
    }
}

static void token_weights(const float *mix, const float *base, const float *scale, int n, int iters, float eps,
                          float *pre, float *post, float *comb) {
    for (int i = 0; i < n; i++) {
        pre[i] = sigmoidf(mix[i] * scale[0] + base[i]) + eps;
        post[i] = 2.0f * sigmoidf(mix[n + i] * scale[1] + base[n + i]);
    }
    for (int i = 0; i < n; i++) {
        float *row = comb + i * n;
        const float *logits = mix + 2 * n + i * n, *bias = base + 2 * n + i * n;
        float top = -INFINITY, sum = 0.0f;
        for (int j = 0; j < n; j++) {
            row[j] = logits[j] * scale[2] + bias[j];
            top = row[j] > top ? row[j] : top;
        }
        for (int j = 0; j < n; j++) {
            row[j] = expf(row[j] - top);
            sum += row[j];
        }
        for (int j = 0; j < n; j++) row[j] = row[j] / sum + eps;
    }
    normalise_columns(comb, n, eps);
    for (int k = 1; k < iters; k++) {
        normalise_rows(comb, n, eps);
        normalise_columns(comb, n, eps);
    }
}

// pre [T, n], post [T, n], comb [T, n, n] from mix [T, (2 + n) n], base [(2 + n) n] and scale [3]
// (float32 all). Returns -1 for more than HC_MAX streams, else 0.
int tf_hyper_weights(const float *mix, const float *base, const float *scale, int64_t tokens, int n, int iters,
                     float eps, float *pre, float *post, float *comb, int threads) {
    if (n < 1 || n > HC_MAX) return -1;
    const int64_t width = (int64_t)(2 + n) * n;
    (void)threads;  // a token's work is a few hundred flops: a fork would cost more than it saves
    for (int64_t t = 0; t < tokens; t++) {
        token_weights(mix + t * width, base, scale, n, iters, eps, pre + t * n, post + t * n, comb + t * n * n);
    }
    return 0;
}

// The streams' collapse and merge around a block, [T, n, H] streams in the model's dtype (0 float32, 1 bfloat16,
// 2 float16), every sum over streams in float32, first stream to last, rounded where the torch reference rounds:
//   collapse: out [T, H] = round(sum_j pre_j * stream_j)
//   merge:    out [T, n, H] = round(round(round(post_i) * block) + round(sum_j round(comb_ji) * stream_j))
void tf_hyper_collapse(const void *streams, const float *pre, void *out, int64_t tokens, int n, int64_t hidden,
                       int dtype, int threads) {
    const int64_t chunks = (hidden + 15) / 16;
#pragma omp parallel for num_threads(threads) if (tokens * n * chunks >= 8192) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t left = hidden - c * 16;
            vf16 sum = vf_mul(vf_set1(pre[t * n]), load16(streams, (t * n) * hidden + c * 16, dtype, left));
            for (int j = 1; j < n; j++) {
                const vf16 s = load16(streams, (t * n + j) * hidden + c * 16, dtype, left);
                sum = vf_add(sum, vf_mul(vf_set1(pre[t * n + j]), s));
            }
            store16(out, t * hidden + c * 16, dtype, left, sum);
        }
    }
}

static inline float rounded(int dtype, float x) {
    float lanes[16];
    store16(lanes, 0, 0, 16, round_to(dtype, vf_set1(x)));
    return lanes[0];
}

void tf_hyper_merge(const void *streams, const void *block, const float *post, const float *comb, void *out,
                    int64_t tokens, int n, int64_t hidden, int dtype, int threads) {
    const int64_t chunks = (hidden + 15) / 16;
#pragma omp parallel for num_threads(threads) if (tokens * n * chunks >= 8192) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        float weights[HC_MAX * HC_MAX], posts[HC_MAX];
        for (int k = 0; k < n * n; k++) weights[k] = rounded(dtype, comb[t * n * n + k]);
        for (int i = 0; i < n; i++) posts[i] = rounded(dtype, post[t * n + i]);
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t left = hidden - c * 16;
            const vf16 b = load16(block, t * hidden + c * 16, dtype, left);
            for (int i = 0; i < n; i++) {
                vf16 mixed = vf_mul(vf_set1(weights[i]), load16(streams, (t * n) * hidden + c * 16, dtype, left));
                for (int j = 1; j < n; j++) {
                    const vf16 s = load16(streams, (t * n + j) * hidden + c * 16, dtype, left);
                    mixed = vf_add(mixed, vf_mul(vf_set1(weights[j * n + i]), s));
                }
                const vf16 scaled = round_to(dtype, vf_mul(vf_set1(posts[i]), b));
                const vf16 sum = vf_add(scaled, round_to(dtype, mixed));
                store16(out, (t * n + i) * hidden + c * 16, dtype, left, sum);
            }
        }
    }
}
