// GLM-5.3-Flash's hyper-connection weights per token, one call instead of a hundred small torch ops.
//
// The Sinkhorn loop alone was forty ops per block. From the block's projection `mix` [T, (2 + n) n],
//   pre = sigmoid(mix_pre * s0 + b_pre) + eps,  post = 2 sigmoid(mix_post * s1 + b_post),
//   comb = softmax_rows(mix_comb * s2 + b_comb) + eps, columns normalised, then (iters - 1) times rows then
//   columns normalised (each divided by its sum + eps).
// Each token is one fixed sequence of scalar float32 ops (libm's expf), so results are batch-invariant.
#include <math.h>
#include <stdint.h>

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
