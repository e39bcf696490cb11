// The recurrent layers' per-token work on the CPU path (kernels/recurrent_scan.py holds the torch reference):
// the depthwise causal conv over a slot's history, the delta rule of Gated DeltaNet and of Kimi delta attention
// (KDA: a decay per key channel) and Mamba2's state update.
//
// Portable C: no intrinsics; the compiler vectorises the inner loops, which run elementwise over a row (the
// reductions here run over an outer index, or over 16 fixed lanes then a fixed tree), and -ffp-contract=off
// keeps every multiply and add two roundings. An element's ops are therefore the same at any vector width,
// and each sequence runs token after token: a token's bits never depend on the chunk, batch or thread
// count. Threads split only (sequence, head) or (sequence, channel block) pairs, never a reduction.
//
// Sequences are given as flat rows [starts[s], ends[s]) with a state slot each; captures (sorted by row per
// sequence, cap_begin[s] .. cap_begin[s + 1]) copy the states after a row into another slot. A call touching
// fewer than `parallel_work` state or input elements stays on the calling thread (a fork would cost more).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DT_F32 = 0, DT_BF16 = 1 };

#define CONV_BLOCK 64    // channels per conv work item
#define LANES 16         // Mamba2's dot products over d_state: this many running sums, then a fixed tree

static inline float bf16_to_float(uint16_t bits) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)bits << 16};
    return v.f;
}

// Round to nearest even bfloat16 (NaN stays a quiet NaN), as torch's conversion does.
static inline uint16_t float_to_bf16(float value) {
    union { float f; uint32_t u; } v = {.f = value};
    if (value != value) return 0x7FC0;
    return (uint16_t)((v.u + 0x7FFF + ((v.u >> 16) & 1)) >> 16);
}

static inline float element(const void *base, int64_t index, int dtype) {
    return dtype == DT_BF16 ? bf16_to_float(((const uint16_t *)base)[index]) : ((const float *)base)[index];
}

// A value as the element type would hold it (what torch's op in that type returns).
static inline float round_to(float value, int dtype) {
    return dtype == DT_BF16 ? bf16_to_float(float_to_bf16(value)) : value;
}

static void to_float(const void *src, int64_t offset, int dtype, float *dst, int64_t count) {
    if (dtype == DT_BF16) {
        const uint16_t *from = (const uint16_t *)src + offset;
        for (int64_t i = 0; i < count; i++) dst[i] = bf16_to_float(from[i]);
    } else {
        memcpy(dst, (const float *)src + offset, (size_t)count * sizeof(float));
    }
}

// Exact: the values came from the element type.
static void from_float(const float *src, void *dst, int64_t offset, int dtype, int64_t count) {
    if (dtype == DT_BF16) {
        uint16_t *to = (uint16_t *)dst + offset;
        for (int64_t i = 0; i < count; i++) to[i] = float_to_bf16(src[i]);
    } else {
        memcpy((float *)dst + offset, src, (size_t)count * sizeof(float));
    }
}

// torch's softplus (beta 1, threshold 20), in float32.
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// ---- causal conv -----------------------------------------------------------------------------------------

typedef struct {
    const void *x;  // [T, row stride] in the element type: each row's first `channels` are the conv's inputs
    int64_t x_stride;
    void *history;  // [slots, K - 1, channels] in the element type, advanced in place
    const void *weight;  // [channels, K]
    const void *bias;    // [channels] or NULL
    float *out;          // [T, channels]
    int64_t channels, kernel;
    int dtype;
} ConvArgs;

// window rows 0 .. K - 2 (the last K - 1 inputs) to `slot`'s history, channels c0 .. c0 + width.
static void store_history(const ConvArgs *p, const float *window, int64_t slot, int64_t c0, int64_t width) {
    for (int64_t r = 0; r + 1 < p->kernel; r++) {
        const int64_t at = (slot * (p->kernel - 1) + r) * p->channels + c0;
        from_float(window + r * CONV_BLOCK, p->history, at, p->dtype, width);
    }
}

// One sequence's channels c0 .. c0 + width: out = sum over taps (oldest first) of input * weight, + bias.
static void conv_block(const ConvArgs *p, int64_t start, int64_t end, int64_t slot, const int64_t *cap_rows,
                       const int64_t *cap_slots, int64_t caps, int64_t c0, int64_t width) {
    const int64_t taps = p->kernel;
    float window[taps][CONV_BLOCK], weight[taps][CONV_BLOCK], bias[CONV_BLOCK];
    for (int64_t c = 0; c < width; c++) {
        for (int64_t tap = 0; tap < taps; tap++) weight[tap][c] = element(p->weight, (c0 + c) * taps + tap, p->dtype);
        bias[c] = p->bias ? element(p->bias, c0 + c, p->dtype) : 0.0f;
    }
    for (int64_t r = 0; r + 1 < taps; r++)
        to_float(p->history, (slot * (taps - 1) + r) * p->channels + c0, p->dtype, window[r], width);
    int64_t next_capture = 0;
    for (int64_t row = start; row < end; row++) {
        to_float(p->x, row * p->x_stride + c0, p->dtype, window[taps - 1], width);
        float *out = p->out + row * p->channels + c0;
        for (int64_t c = 0; c < width; c++) out[c] = window[0][c] * weight[0][c];
        for (int64_t tap = 1; tap < taps; tap++)
            for (int64_t c = 0; c < width; c++) out[c] = out[c] + window[tap][c] * weight[tap][c];
        if (p->bias)
            for (int64_t c = 0; c < width; c++) out[c] = out[c] + bias[c];
        for (int64_t tap = 0; tap + 1 < taps; tap++) memcpy(window[tap], window[tap + 1], sizeof(window[0]));
        for (; next_capture < caps && cap_rows[next_capture] == row; next_capture++)
            store_history(p, &window[0][0], cap_slots[next_capture], c0, width);
    }
    if (end > start) store_history(p, &window[0][0], slot, c0, width);
}

void tf_causal_conv_scan(const void *x, int64_t x_stride, void *history, const void *weight, const void *bias,
                         float *out, const int64_t *starts, const int64_t *ends, const int64_t *slots,
                         const int64_t *cap_begin, const int64_t *cap_rows, const int64_t *cap_slots, int64_t seqs,
                         int64_t channels, int64_t kernel, int dtype, int threads, int64_t parallel_work) {
    if (seqs == 0) return;
    const ConvArgs p = {x, x_stride, history, weight, bias, out, channels, kernel, dtype};
    const int64_t blocks = (channels + CONV_BLOCK - 1) / CONV_BLOCK, items = seqs * blocks;
    const int64_t work = (ends[seqs - 1] - starts[0]) * channels * kernel;
#pragma omp parallel for num_threads(threads) if (work >= parallel_work) schedule(static)
    for (int64_t item = 0; item < items; item++) {
        const int64_t s = item / blocks, c0 = (item % blocks) * CONV_BLOCK;
        const int64_t width = channels - c0 < CONV_BLOCK ? channels - c0 : CONV_BLOCK;
        conv_block(&p, starts[s], ends[s], slots[s], cap_rows + cap_begin[s], cap_slots + cap_begin[s],
                   cap_begin[s + 1] - cap_begin[s], c0, width);
    }
}

// ---- gated delta rule and Kimi delta attention ---------------------------------------------------------

typedef struct {
    float *state;  // [slots, H, Dk, Dv], advanced in place
    const float *q, *k;  // [T, H, Dk]
    const float *v;      // [T, H, Dv]
    const float *g;      // KDA: [T, H, Dk] log-decays, one per key channel; NULL for Gated DeltaNet
    const void *a;       // Gated DeltaNet: [T, H] in a_dtype (before dt_bias)
    const float *beta;   // [T, H]
    const float *neg_a;  // Gated DeltaNet: [H]: -exp(A_log)
    const void *dt_bias;  // Gated DeltaNet: [H] in bias_dtype
    float *out;           // [T, H, Dv]
    int64_t heads, dk, dv;
    int a_dtype, bias_dtype;
} DeltaArgs;

// The token's decays into `decay`: KDA's Dk (returns 1, the step between key rows), or Gated DeltaNet's one
// per head (returns 0: every row reads decay[0]).
static int64_t token_decay(const DeltaArgs *p, int64_t at, int64_t head, float *restrict decay) {
    if (p->g) {
        const float *g = p->g + at * p->dk;
        for (int64_t i = 0; i < p->dk; i++) decay[i] = expf(g[i]);
        return 1;
    }
    const float gate = element(p->a, at, p->a_dtype) + element(p->dt_bias, head, p->bias_dtype);
    decay[0] = expf(p->neg_a[head] * softplus(gate));
    return 0;
}

// One token on one head's state S [Dk, Dv]: S = S * decay (row i by decay[i * step]); delta = (v - k S) * beta;
// S = S + k (x) delta; out = q S. Sums over Dk run in row order, elementwise over Dv. scratch: Dv + Dk floats.
static void delta_token(const DeltaArgs *p, float *restrict state, int64_t row, int64_t head, float *scratch) {
    const int64_t dk = p->dk, dv = p->dv, at = row * p->heads + head;
    const float *q = p->q + at * dk, *k = p->k + at * dk, *v = p->v + at * dv;
    const float beta = p->beta[at];
    float *restrict acc = scratch, *restrict decay = scratch + dv;
    const int64_t step = token_decay(p, at, head, decay);
    float *restrict out = p->out + at * dv;
    for (int64_t j = 0; j < dv; j++) acc[j] = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        float *restrict s = state + i * dv;
        const float d = decay[i * step];
        for (int64_t j = 0; j < dv; j++) {
            s[j] = s[j] * d;
            acc[j] = acc[j] + s[j] * k[i];
        }
    }
    for (int64_t j = 0; j < dv; j++) {
        acc[j] = (v[j] - acc[j]) * beta;
        out[j] = 0.0f;
    }
    for (int64_t i = 0; i < dk; i++) {
        float *restrict s = state + i * dv;
        for (int64_t j = 0; j < dv; j++) {
            s[j] = s[j] + k[i] * acc[j];
            out[j] = out[j] + s[j] * q[i];
        }
    }
}

// Every (sequence, head) pair token after token, captured rows' states copied to their slots.
static void delta_scan(const DeltaArgs *p, const int64_t *starts, const int64_t *ends, const int64_t *slots,
                       const int64_t *cap_begin, const int64_t *cap_rows, const int64_t *cap_slots, int64_t seqs,
                       int threads, int64_t parallel_work) {
    if (seqs == 0) return;
    const int64_t heads = p->heads, size = p->dk * p->dv;
    const int64_t items = seqs * heads, work = (ends[seqs - 1] - starts[0]) * heads * size;
#pragma omp parallel for num_threads(threads) if (work >= parallel_work) schedule(static)
    for (int64_t item = 0; item < items; item++) {
        const int64_t s = item / heads, h = item % heads;
        float *scratch = malloc((size_t)(p->dv + p->dk) * sizeof(float));
        float *own = p->state + (slots[s] * heads + h) * size;
        int64_t next = cap_begin[s];
        for (int64_t row = starts[s]; row < ends[s]; row++) {
            delta_token(p, own, row, h, scratch);
            for (; next < cap_begin[s + 1] && cap_rows[next] == row; next++)
                memcpy(p->state + (cap_slots[next] * heads + h) * size, own, (size_t)size * sizeof(float));
        }
        free(scratch);
    }
}

void tf_gated_delta_scan(float *state, const float *q, const float *k, const float *v, const void *a, int a_dtype,
                         const float *beta, const float *neg_a, const void *dt_bias, int bias_dtype, float *out,
                         const int64_t *starts, const int64_t *ends, const int64_t *slots, const int64_t *cap_begin,
                         const int64_t *cap_rows, const int64_t *cap_slots, int64_t seqs, int64_t heads, int64_t dk,
                         int64_t dv, int threads, int64_t parallel_work) {
    const DeltaArgs p = {state, q, k, v, NULL, a, beta, neg_a, dt_bias, out, heads, dk, dv, a_dtype, bias_dtype};
    delta_scan(&p, starts, ends, slots, cap_begin, cap_rows, cap_slots, seqs, threads, parallel_work);
}

// Kimi delta attention: Gated DeltaNet's rule with the decay exp(g) per key channel (g computed by the layer).
void tf_kda_scan(float *state, const float *q, const float *k, const float *v, const float *g, const float *beta,
                 float *out, const int64_t *starts, const int64_t *ends, const int64_t *slots,
                 const int64_t *cap_begin, const int64_t *cap_rows, const int64_t *cap_slots, int64_t seqs,
                 int64_t heads, int64_t dk, int64_t dv, int threads, int64_t parallel_work) {
    const DeltaArgs p = {state, q, k, v, g, NULL, beta, NULL, NULL, out, heads, dk, dv, DT_F32, DT_F32};
    delta_scan(&p, starts, ends, slots, cap_begin, cap_rows, cap_slots, seqs, threads, parallel_work);
}

// ---- Mamba2 ------------------------------------------------------------------------------------------------

typedef struct {
    float *state;  // [slots, H, P, N], advanced in place
    const float *x;  // [T, H, P]
    const float *b, *c;  // [T, H, N]
    const void *dt;      // [T, H] in dt_dtype (before dt_bias)
    const void *dt_bias;  // [H] in bias_dtype
    const float *a, *d;   // [H]: -exp(A_log), D
    float *out;           // [T, H, P]
    int64_t heads, p, n;
    int dt_dtype, bias_dtype, step_dtype;  // step_dtype: the type torch computes dt + dt_bias and its softplus in
    int clamp;
    float low, high;
} MambaArgs;

// softplus(dt + dt_bias) rounded where torch rounds it (the sum and the softplus in the promoted type),
// clamped to the time-step limit.
static float mamba_step(const MambaArgs *p, int64_t at, int64_t head) {
    const float sum = round_to(element(p->dt, at, p->dt_dtype) + element(p->dt_bias, head, p->bias_dtype),
                               p->step_dtype);
    float step = round_to(softplus(sum), p->step_dtype);
    if (p->clamp) step = fminf(fmaxf(step, p->low), p->high);
    return step;
}

// sum_n s[n] * c[n] over LANES running sums (lane n % LANES), then a fixed pairwise tree.
static float lane_dot(const float *restrict s, const float *restrict c, int64_t n) {
    float lanes[LANES] = {0.0f};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) lanes[l] = lanes[l] + s[i + l] * c[i + l];
    for (int l = 0; i + l < n; l++) lanes[l] = lanes[l] + s[i + l] * c[i + l];
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) lanes[l] = lanes[l] + lanes[l + width];
    return lanes[0];
}

// One token on one head's state [P, N]: S = S * exp(step * A) + (step * x) (x) B;  y = S C + D x.
static void mamba_token(const MambaArgs *p, float *restrict state, int64_t row, int64_t head) {
    const int64_t at = row * p->heads + head, pn = p->n;
    const float step = mamba_step(p, at, head), decay = expf(step * p->a[head]);
    const float *x = p->x + at * p->p, *b = p->b + at * pn, *c = p->c + at * pn;
    float *y = p->out + at * p->p;
    for (int64_t i = 0; i < p->p; i++) {
        float *restrict s = state + i * pn;
        const float scaled = x[i] * step;
        for (int64_t j = 0; j < pn; j++) s[j] = s[j] * decay + scaled * b[j];
        y[i] = lane_dot(s, c, pn) + p->d[head] * x[i];
    }
}

void tf_mamba2_scan(float *state, const float *x, const float *b, const float *c, const void *dt, int dt_dtype,
                    const void *dt_bias, int bias_dtype, int step_dtype, const float *a, const float *d, int clamp,
                    float low, float high, float *out, const int64_t *starts, const int64_t *ends,
                    const int64_t *slots, const int64_t *cap_begin, const int64_t *cap_rows, const int64_t *cap_slots,
                    int64_t seqs, int64_t heads, int64_t head_dim, int64_t state_size, int threads,
                    int64_t parallel_work) {
    if (seqs == 0) return;
    const MambaArgs p = {state,   x,     b,         c,          dt,         dt_bias, a,   d,    out,
                         heads,   head_dim, state_size, dt_dtype, bias_dtype, step_dtype, clamp, low, high};
    const int64_t items = seqs * heads, size = head_dim * state_size;
    const int64_t work = (ends[seqs - 1] - starts[0]) * heads * size;
#pragma omp parallel for num_threads(threads) if (work >= parallel_work) schedule(static)
    for (int64_t item = 0; item < items; item++) {
        const int64_t s = item / heads, h = item % heads;
        float *own = state + (slots[s] * heads + h) * size;
        int64_t next = cap_begin[s];
        for (int64_t row = starts[s]; row < ends[s]; row++) {
            mamba_token(&p, own, row, h);
            for (; next < cap_begin[s + 1] && cap_rows[next] == row; next++)
                memcpy(state + (cap_slots[next] * heads + h) * size, own, (size_t)size * sizeof(float));
        }
    }
}
