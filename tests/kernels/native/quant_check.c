// A C check of the quantized GEMM (kernels/cpu/quant_gemm.c) for builds Python cannot load here: ARM NEON
// under qemu-aarch64, and the avx2 level natively. Per type: the build's SIMD dot products give the portable
// path's bits, every row's bits are the same alone, in a batch and on 1 or 2 threads, and the product is
// near the float64 one over the dequantized weights. Prints "ok <name>" or "FAIL <name>: why"; the exit
// status counts the failures. Driven by tests/kernels/test_kernels_native_c.py.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void tf_quant_matmul(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, int type, float *out,
                     int threads, int simd);
void tf_quant_dequantize(const uint8_t *w, int64_t k, int type, const int64_t *ids, int64_t count, float *out,
                         int threads);

static const char *NAMES[6] = {"q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k"};
static const int BLOCK[6] = {32, 32, 32, 256, 256, 256}, BYTES[6] = {34, 18, 20, 144, 176, 210};
static int failures = 0;

static void report(const char *check, const char *type, int ok, const char *why) {
    if (ok) {
        printf("ok %s_%s\n", check, type);
    } else {
        printf("FAIL %s_%s: %s\n", check, type, why);
        failures++;
    }
}

static uint64_t state = 0x9E3779B97F4A7C15ull;
static uint32_t next(void) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(state >> 32);
}

// A small positive float16 (2^-11 to 2^-7), optionally negated, little-endian at p.
static void small_half(uint8_t *p, int negative) {
    const uint16_t h = (uint16_t)(0x1000u + (next() & 0x0FFFu) + (negative ? 0x8000u : 0u));
    p[0] = (uint8_t)h, p[1] = (uint8_t)(h >> 8);
}

// Random codes and scales, with each type's float16 fields at a realistic size.
static void random_weight(int type, uint8_t *w, int64_t blocks) {
    for (int64_t i = 0; i < blocks * BYTES[type]; i++) w[i] = (uint8_t)next();
    for (int64_t b = 0; b < blocks; b++) {
        uint8_t *block = w + b * BYTES[type];
        if (type == 5) {
            small_half(block + 208, 0);
        } else {
            small_half(block, type < 2 && (next() & 1));
            if (type >= 2) small_half(block + 2, type == 2 && (next() & 1));
        }
    }
}

static void check_type(int type) {
    const int64_t n = 21, k = 512, m = 17, blocks = n * k / BLOCK[type];
    uint8_t *w = malloc(blocks * BYTES[type]);
    float *x = malloc(sizeof(float) * m * k), *deq = malloc(sizeof(float) * n * k);
    float *simd = malloc(sizeof(float) * m * n), *portable = malloc(sizeof(float) * m * n);
    float *got = malloc(sizeof(float) * m * n);
    random_weight(type, w, blocks);
    for (int64_t i = 0; i < m * k; i++) x[i] = (float)((int32_t)next()) * 0x1p-31f;
    tf_quant_matmul(x, m, k, w, n, type, simd, 1, 1);
    tf_quant_matmul(x, m, k, w, n, type, portable, 1, 0);
    report("simd_is_portable", NAMES[type], memcmp(simd, portable, sizeof(float) * m * n) == 0,
           "the SIMD path's bits differ from the portable C's");
    int invariant = 1;
    for (int threads = 1; threads <= 2; threads++) {
        for (int64_t r = 0; r < m; r++) {
            tf_quant_matmul(x + r * k, 1, k, w, n, type, got, threads, 1);
            invariant &= memcmp(got, simd + r * n, sizeof(float) * n) == 0;
        }
        tf_quant_matmul(x + 2 * k, 5, k, w, n, type, got, threads, 1);
        invariant &= memcmp(got, simd + 2 * n, sizeof(float) * 5 * n) == 0;
    }
    report("rows_invariant", NAMES[type], invariant, "a row's bits changed with the row or thread count");
    tf_quant_dequantize(w, k, type, NULL, n, deq, 2);
    double worst = 0.0;
    for (int64_t r = 0; r < m; r++)
        for (int64_t c = 0; c < n; c++) {
            double exact = 0.0, size = 0.0;
            for (int64_t i = 0; i < k; i++) {
                exact += (double)x[r * k + i] * deq[c * k + i];
                size += fabs((double)x[r * k + i] * deq[c * k + i]);
            }
            worst = fmax(worst, fabs(simd[r * n + c] - exact) / size);
        }
    report("near_float64", NAMES[type], worst < 0.02, "farther than the activations' rounding allows");
    free(w), free(x), free(deq), free(simd), free(portable), free(got);
}

int main(void) {
    for (int type = 0; type < 6; type++) check_type(type);
    return failures;
}
