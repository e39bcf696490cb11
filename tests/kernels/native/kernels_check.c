// A C check of the portable native kernels (kernels/cpu/fma_gemm.c, paged_attention.c, layer_ops.c built
// through simd.h's portable backend), for builds Python cannot load here: ARM NEON under qemu-aarch64, and
// the avx2 level natively. Each check prints "ok <name>" or "FAIL <name>: why"; the exit status counts
// the failures. Driven by tests/kernels/test_kernels_native_c.py.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"  // the SIMD helpers the kernels are written over

void tf_bf16_pack(const uint16_t *w, int64_t n, int64_t k, int64_t ldw, uint16_t *packed);
void tf_fma_gemm(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                 uint16_t *out, int64_t ldo, int threads);
void tf_paged_attention(const void *q, const void *k_cache, const void *v_cache, void *out, const int64_t *tables,
                        const int64_t *table_starts, const int64_t *row_seq, const int64_t *row_pos, int64_t rows,
                        int64_t hq, int64_t hkv, int64_t d, int64_t dv, int64_t block_size, int64_t max_keys,
                        int64_t window, float scale, int dtype, int threads);
void tf_rms_norm(const void *x, const void *residual, const void *weight, void *out, void *summed, int64_t rows,
                 int64_t hidden, float eps, int dtype, int threads);
void tf_rotary(const void *x, void *out, const void *cos, const void *sin, int64_t tokens, int64_t heads,
               int64_t dim, int64_t rot, int dtype, int threads);
void tf_silu_mul(const void *gate, const void *up, void *out, int64_t rows, int64_t cols, int64_t stride, int dtype,
                 int threads);
void tf_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out, int threads);

enum { F32 = 0, BF16 = 1 };
static int failures = 0;

static void report(const char *name, int ok, const char *why) {
    if (ok) {
        printf("ok %s\n", name);
    } else {
        printf("FAIL %s: %s\n", name, why);
        failures++;
    }
}

static uint64_t state = 0x9E3779B97F4A7C15ull;
static float uniform(void) {  // in [-1, 1)
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((state >> 40) & 0xFFFFFF) / 8388608.0f - 1.0f;
}

static uint16_t to_bf16(float f) {  // round to nearest even (finite inputs)
    uint32_t bits;
    memcpy(&bits, &f, sizeof(bits));
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}
static float from_bf16(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

// The GEMM's contract: each element is acc = 0, acc += x[k] * w[k] in fp32 for k ascending (the product of
// two bfloat16 is exact, so an FMA and a multiply-then-add agree), rounded once to bfloat16; and a row's bits
// are the same at any row count and thread count. A large first product that the last one cancels makes
// every sum between round at its scale, so any other order of K shows in the bfloat16 result.
static void check_gemm(void) {
    const int64_t n = 80, k = 96, m = 300;
    uint16_t *w = malloc(n * k * 2), *packed = malloc(n * k * 2), *x = malloc(m * k * 2);
    uint16_t *alone = malloc(m * n * 2), *got = malloc(m * n * 2);
    for (int64_t i = 0; i < n * k; i++) w[i] = to_bf16(uniform());
    for (int64_t i = 0; i < m * k; i++) x[i] = to_bf16(uniform());
    for (int64_t r = 0; r < m; r++) x[r * k] = x[r * k + k - 1] = to_bf16(1.0f);
    for (int64_t c = 0; c < n; c++) {
        w[c * k] = to_bf16(65536.0f * (1.5f + 0.5f * uniform()));
        w[c * k + k - 1] = w[c * k] ^ 0x8000;  // its negation
    }
    tf_bf16_pack(w, n, k, k, packed);
    int exact = 1, invariant = 1;
    for (int64_t r = 0; r < m; r++) {
        tf_fma_gemm(x + r * k, 1, k, k, packed, n, alone + r * n, n, 1);
        for (int64_t c = 0; c < n; c++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < k; i++) acc += from_bf16(x[r * k + i]) * from_bf16(w[c * k + i]);
            exact &= alone[r * n + c] == to_bf16(acc);
        }
    }
    const int64_t counts[] = {1, 2, 3, 16, 17, 300};
    for (int threads = 1; threads <= 2; threads++)
        for (int i = 0; i < 6; i++) {
            tf_fma_gemm(x, counts[i], k, k, packed, n, got, n, threads);
            invariant &= memcmp(got, alone, counts[i] * n * 2) == 0;
        }
    report("gemm_is_the_fp32_sum_in_k_order", exact, "an element differs from acc += x*w rounded once");
    report("gemm_rows_invariant", invariant, "a row's bits changed with the row or thread count");
    free(w), free(packed), free(x), free(alone), free(got);
}

// Attention of 3 sequences (one block table each) near a double reference, and each row's bits the same
// alone, in a batch with the other sequences and on 2 threads.
static void check_attention(void) {
    enum { HQ = 4, HKV = 2, D = 64, BS = 16, BLOCKS = 12 };
    const int64_t lengths[3] = {40, 9, 70}, tables[12] = {3, 0, 7, 11, 5, 9, 1, 2, 4, 6, 8, 10};
    const int64_t starts[3] = {0, 3, 4};
    float *kc = malloc(sizeof(float) * BLOCKS * BS * HKV * D), *vc = malloc(sizeof(float) * BLOCKS * BS * HKV * D);
    for (int64_t i = 0; i < BLOCKS * BS * HKV * D; i++) kc[i] = uniform(), vc[i] = uniform();
    const int64_t rows = 40 + 9 + 70;
    float *q = malloc(sizeof(float) * rows * HQ * D), *out = malloc(sizeof(float) * rows * HQ * D);
    float *one = malloc(sizeof(float) * HQ * D);
    int64_t *row_seq = malloc(8 * rows), *row_pos = malloc(8 * rows);
    for (int64_t i = 0; i < rows * HQ * D; i++) q[i] = uniform();
    for (int64_t s = 0, t = 0; s < 3; s++)
        for (int64_t p = 0; p < lengths[s]; p++, t++) row_seq[t] = s, row_pos[t] = p;
    double worst = 0.0;
    int invariant = 1;
    for (int threads = 1; threads <= 2; threads++)
        tf_paged_attention(q, kc, vc, out, tables, starts, row_seq, row_pos, rows, HQ, HKV, D, D, BS, 70, 0, 0.125f, F32,
                           threads);
    for (int64_t t = 0; t < rows; t++) {
        const int64_t s = row_seq[t], pos = row_pos[t], seq[1] = {0};
        tf_paged_attention(q + t * HQ * D, kc, vc, one, tables + starts[s], seq, seq, &pos, 1, HQ, HKV, D, D, BS, pos + 1,
                           0, 0.125f, F32, 1);
        invariant &= memcmp(one, out + t * HQ * D, sizeof(float) * HQ * D) == 0;
        for (int h = 0; h < HQ; h++) {
            double scores[70], top = -INFINITY, total = 0.0;
            const float *qr = q + (t * HQ + h) * D;
            for (int64_t j = 0; j <= pos; j++) {
                const int64_t row = (tables[starts[s] + j / BS] * BS + j % BS) * HKV + h / (HQ / HKV);
                double dot = 0.0;
                for (int c = 0; c < D; c++) dot += (double)qr[c] * kc[row * D + c];
                scores[j] = dot * 0.125;
                top = scores[j] > top ? scores[j] : top;
            }
            for (int64_t j = 0; j <= pos; j++) total += (scores[j] = exp(scores[j] - top));
            for (int c = 0; c < D; c++) {
                double value = 0.0;
                for (int64_t j = 0; j <= pos; j++) {
                    const int64_t row = (tables[starts[s] + j / BS] * BS + j % BS) * HKV + h / (HQ / HKV);
                    value += scores[j] * vc[row * D + c];
                }
                const double gap = fabs(value / total - out[(t * HQ + h) * D + c]);
                worst = gap > worst ? gap : worst;
            }
        }
    }
    report("attention_near_float64", worst < 1e-5, "a value is more than 1e-5 from the float64 reference");
    report("attention_rows_invariant", invariant, "a row's bits changed with the batch or thread count");
    free(kc), free(vc), free(q), free(out), free(one), free(row_seq), free(row_pos);
}

// RMSNorm near a double reference, RoPE and argmax exact, SiLU near libm's; each row the same alone.
static void check_layer_ops(void) {
    enum { ROWS = 70, H = 200 };
    float x[ROWS * H], res[ROWS * H], w[H], out[ROWS * H], summed[ROWS * H], part[H], part_sum[H];
    for (int i = 0; i < ROWS * H; i++) x[i] = 3 * uniform(), res[i] = uniform();
    for (int i = 0; i < H; i++) w[i] = 1 + 0.1f * uniform();
    tf_rms_norm(x, res, w, out, summed, ROWS, H, 1e-6f, F32, 2);
    tf_rms_norm(x + 17 * H, res + 17 * H, w, part, part_sum, 1, H, 1e-6f, F32, 1);
    double worst = 0.0;
    for (int r = 0; r < ROWS; r++) {
        double squares = 0.0;
        for (int c = 0; c < H; c++) squares += (double)summed[r * H + c] * summed[r * H + c];
        const double scale = 1.0 / sqrt(squares / H + 1e-6);
        for (int c = 0; c < H; c++) {
            const double gap = fabs(w[c] * summed[r * H + c] * scale - out[r * H + c]);
            worst = gap > worst ? gap : worst;
        }
    }
    report("rms_norm_near_float64", worst < 1e-4 && memcmp(part, out + 17 * H, sizeof(part)) == 0,
           "far from the reference, or a row's bits changed alone");

    enum { T = 5, HEADS = 3, DIM = 48, ROT = 32 };
    float qx[T * HEADS * DIM], qo[T * HEADS * DIM], cs[T * ROT], sn[T * ROT];
    for (int i = 0; i < T * HEADS * DIM; i++) qx[i] = uniform();
    for (int i = 0; i < T * ROT; i++) cs[i] = uniform(), sn[i] = uniform();
    tf_rotary(qx, qo, cs, sn, T, HEADS, DIM, ROT, F32, 1);
    int exact = 1;
    for (int t = 0; t < T; t++)
        for (int h = 0; h < HEADS; h++)
            for (int i = 0; i < DIM; i++) {
                const float *row = qx + (t * HEADS + h) * DIM;
                float expected = row[i];
                if (i < ROT / 2) expected = row[i] * cs[t * ROT + i] + (-row[i + ROT / 2]) * sn[t * ROT + i];
                else if (i < ROT) expected = row[i] * cs[t * ROT + i] + row[i - ROT / 2] * sn[t * ROT + i];
                exact &= qo[(t * HEADS + h) * DIM + i] == expected;
            }
    report("rotary_exact", exact, "an element differs from x*cos + rotate_half(x)*sin in fp32");

    uint16_t gate[ROWS * H], up[ROWS * H], silu[ROWS * H];
    for (int i = 0; i < ROWS * H; i++) gate[i] = to_bf16(6 * uniform()), up[i] = to_bf16(uniform());
    tf_silu_mul(gate, up, silu, ROWS, H, H, BF16, 2);
    worst = 0.0;
    for (int i = 0; i < ROWS * H; i++) {
        const double g = from_bf16(gate[i]), expected = g / (1.0 + exp(-g)) * from_bf16(up[i]);
        const double gap = fabs(from_bf16(silu[i]) - expected) / (fabs(expected) + 1e-6);
        worst = gap > worst ? gap : worst;
    }
    report("silu_mul_bf16_near_libm", worst < 2.0 / 128, "more than two bfloat16 steps from silu(g) * up");

    enum { COLS = 1001 };
    static float logits[4 * COLS];
    int64_t best[4];
    for (int i = 0; i < 4 * COLS; i++) logits[i] = (float)(int)(3 * (uniform() + 1));  // ties: the lowest index
    logits[2 * COLS + 500] = NAN;  // a NaN row gives its first NaN
    tf_argmax_rows(logits, 4, COLS, best, 2);
    exact = 1;
    for (int r = 0; r < 4; r++) {
        int64_t expected = 0;
        for (int c = 0; c < COLS; c++) {
            const float v = logits[r * COLS + c];
            if (v != v) {
                expected = c;
                break;
            }
            if (v > logits[r * COLS + expected]) expected = c;
        }
        exact &= best[r] == expected;
    }
    report("argmax_exact", exact, "not the lowest index of the largest value (or the first NaN)");
}

// simd.h's 16 horizontal sums at once (attention's scores; a shuffle tree on AVX2) give each lane the bits
// of vf_reduce_add over its vector, for finite values, infinities and signed zeros at many scales.
static void check_sum_lanes(void) {
    int same = 1;
    for (int trial = 0; trial < 2000; trial++) {
        float lanes[16][16];
        for (int i = 0; i < 16; i++)
            for (int l = 0; l < 16; l++) {
                const int kind = (trial * 256 + i * 16 + l) % 97;
                lanes[i][l] = kind == 0 ? INFINITY : kind == 1 ? -0.0f : uniform() * ldexpf(1.0f, kind % 40 - 20);
            }
        vf16 v[16];
        for (int i = 0; i < 16; i++) memcpy(&v[i], lanes[i], sizeof(lanes[i]));
        const vf16 sums = sum_lanes_of_16(v);
        float got[16];
        memcpy(got, &sums, sizeof(got));
        for (int i = 0; i < 16; i++) {
            const float want = vf_reduce_add(v[i]);
            same &= memcmp(&want, &got[i], sizeof(want)) == 0;
        }
    }
    report("sum_lanes_is_reduce_add_per_lane", same, "a lane's sum differs from vf_reduce_add's");
}

int main(void) {
    check_gemm();
    check_attention();
    check_layer_ops();
    check_sum_lanes();
    return failures;
}
