// Batch-invariant GEMM over GGUF-quantized weights kept as the file stores them: out[M, N] = x[M, K] @ W^T
// for W's rows of Q8_0, Q4_0, Q4_1, Q4_K, Q5_K or Q6_K blocks (docs/engine.md, "Quantized weights").
//
// x's rows are quantized once per call (quant_blocks.h: blocks of 32 values for the 32-weight types, of 256
// for the K types). Each output element then runs one fixed sequence: acc = 0, and for each block in K
// order an exact integer dot product (quant_dot.h) folded into acc by `fold`'s float32 ops; rows of x never
// meet, so a row's bits depend on that row alone, not on M, the thread count or the split of N, and every
// level's SIMD gives the portable build's bits (the integer parts are exact, `fold` is shared C).
// On AVX-512 VNNI the work runs as 16-column tiles (quant_tile_avx512.h, quant_tile32_avx512.h), on AVX2
// as 8-column ones (quant_tile_avx2.h, quant_tile32_avx2.h): they fold the columns on vector lanes, each lane
// the same ops as `fold`.
#include <stdint.h>
#include <stdlib.h>

#include "quant_blocks.h"
#include "quant_dot.h"
#include "quant_tile32_avx2.h"
#include "quant_tile32_avx512.h"
#include "quant_tile_avx2.h"

#define COLUMNS 16     // output columns per work item
#define CHUNK_ROWS 64  // rows per work item: a column's decoded block serves all of them from L1
#define THREAD_BYTES (64 << 10)  // weight bytes times rows a thread at least

// Block b of one row folded into acc. s = the activation block's per-16 sums. With a = the activations'
// scale and S = the block's integer dot product over signed values, each type's sequence is
//   Q8_0, Q4_0, Q6_K:  acc + float(S) * (d * a)
//   Q4_1:              (acc + float(S) * (d * a)) + float(sum of x's codes) * (m * a)
//   Q4_K, Q5_K:        (acc + float(S) * (d * a)) - float(sum of min_g * x's group sum) * (dmin * a)
QDOT_INLINE float fold(const int type, float acc, const wblock *b, float a, int32_t raw, const int32_t *s) {
    int32_t shift = 0, mins = 0;  // the offset's integer share, the mins' integer sum
    if (type == Q6_K)
        for (int j = 0; j < 16; j++) shift += b->scales[j] * s[j];
    else if (type == Q4_K || type == Q5_K)
        for (int j = 0; j < 8; j++) mins += b->mins[j] * (s[2 * j] + s[2 * j + 1]);
    else
        shift = s[0] + s[1];
    if (type == Q4_1) {
        acc = acc + (float)raw * (b->d * a);
        return acc + (float)shift * (b->dmin * a);
    }
    if (type == Q4_K || type == Q5_K) {
        acc = acc + (float)raw * (b->d * a);
        return acc - (float)mins * (b->dmin * a);
    }
    return acc + (float)(raw - QFORMATS[type].offset * shift) * (b->d * a);
}

// Columns [c0, c1) x rows [r0, r1) into out (row stride n). Each column's blocks are decoded once and serve
// every row of the chunk.
QDOT_INLINE void columns(const int type, const int simd, const qacts *x, const uint8_t *w, int64_t n, int64_t c0,
                         int64_t c1, int64_t r0, int64_t r1, float *out) {
    const qformat f = QFORMATS[type];
    const int64_t blocks = x->k / f.block, row_bytes = blocks * f.bytes, act_blocks = x->k / x->block;
    float acc[CHUNK_ROWS];
    wblock b;
    for (int64_t c = c0; c < c1; c++) {
        for (int64_t r = r0; r < r1; r++) acc[r - r0] = 0.0f;
        for (int64_t i = 0; i < blocks; i++) {
            decode_block(type, w + c * row_bytes + i * f.bytes, &b);
            for (int64_t r = r0; r < r1; r++) {
                const int8_t *a = x->q + r * x->k + i * f.block;
                const int32_t raw = simd ? dot_simd(b.q, a, b.scales, f.block, f.group)
                                         : dot_portable(b.q, a, b.scales, f.block, f.group);
                const int32_t *s = x->sums + r * (x->k / 16) + i * (f.block / 16);
                acc[r - r0] = fold(type, acc[r - r0], &b, x->d[r * act_blocks + i], raw, s);
            }
        }
        for (int64_t r = r0; r < r1; r++) out[r * n + c] = acc[r - r0];
    }
}

#define COLUMNS_CASE(T)                                           \
    case T:                                                       \
        if (simd)                                                 \
            columns(T, 1, x, w, n, c0, c1, r0, r1, out);          \
        else                                                      \
            columns(T, 0, x, w, n, c0, c1, r0, r1, out);          \
        return;

// `columns` with the type and the path made constants, so each case's loops are its own.
static void columns_dispatch(int type, int simd, const qacts *x, const uint8_t *w, int64_t n, int64_t c0,
                             int64_t c1, int64_t r0, int64_t r1, float *out) {
    switch (type) { COLUMNS_CASE(Q8_0) COLUMNS_CASE(Q4_0) COLUMNS_CASE(Q4_1) COLUMNS_CASE(Q4_K) COLUMNS_CASE(Q5_K)
                    COLUMNS_CASE(Q6_K) }
}

#if defined(KTILE) || defined(QTILE_K)
// The SIMD tiles (this build's `tile_columns` and `pair_columns`, AVX-512 or AVX2) with the type a constant.
static void tile_dispatch(int type, const qacts *x, const uint8_t *w, int64_t n, int64_t c0, int64_t r0, int64_t r1,
                          float *out) {
    if (type == Q4_K) tile_columns(Q4_K, x, w, n, c0, r0, r1, out);
    if (type == Q5_K) tile_columns(Q5_K, x, w, n, c0, r0, r1, out);
    if (type == Q6_K) tile_columns(Q6_K, x, w, n, c0, r0, r1, out);
    if (type == Q8_0) pair_columns(Q8_0, x, w, n, c0, r0, r1, out);
    if (type == Q4_0) pair_columns(Q4_0, x, w, n, c0, r0, r1, out);
    if (type == Q4_1) pair_columns(Q4_1, x, w, n, c0, r0, r1, out);
}
#endif

// Work item `item` of the call: COLUMNS columns by CHUNK_ROWS rows (items of one column tile adjacent).
static void run_item(int type, int simd, const qacts *x, const uint8_t *w, int64_t m, int64_t n, int64_t item,
                     float *out) {
    const int64_t row_items = (m + CHUNK_ROWS - 1) / CHUNK_ROWS;
    const int64_t c0 = item / row_items * COLUMNS, r0 = item % row_items * CHUNK_ROWS;
    const int64_t c1 = c0 + COLUMNS < n ? c0 + COLUMNS : n, r1 = r0 + CHUNK_ROWS < m ? r0 + CHUNK_ROWS : m;
#if defined(KTILE) || defined(QTILE_K)
    if (simd) {  // every type has a tile on AVX-512 and AVX2
        tile_dispatch(type, x, w, n, c0, r0, r1, out);
        return;
    }
#endif
    columns_dispatch(type, simd, x, w, n, c0, c1, r0, r1, out);
}

// out [M, N] float32 = x [M, K] float32 @ W^T, W [N, K / block * bytes] of `type`'s blocks (K a multiple
// of the block). `simd` 0 runs the portable definition, 1 this build's SIMD dot products (the same bits).
// Threads split the work in items of COLUMNS columns by CHUNK_ROWS rows, at most one thread per
// THREAD_BYTES of weights (a small matrix costs more to share than to compute); one thread runs no
// OpenMP region.
void tf_quant_matmul(const float *xf, int64_t m, int64_t k, const uint8_t *w, int64_t n, int type, float *out,
                     int threads, int simd) {
    const qformat f = QFORMATS[type];
    qacts x = {aligned_alloc(64, (size_t)((m * k + 127) / 64 * 64)), malloc(sizeof(float) * (size_t)(m * (k / f.block))),
               malloc(sizeof(int32_t) * (size_t)(m * (k / 16))), k, f.block};
    const int64_t work = (n + COLUMNS - 1) / COLUMNS * ((m + CHUNK_ROWS - 1) / CHUNK_ROWS);
    const int64_t enough = n * (k / f.block) * f.bytes * m / THREAD_BYTES;  // threads the work pays for
    if (threads > work) threads = (int)work;
    if (threads > enough) threads = enough > 1 ? (int)enough : 1;
    if (threads <= 1) {
        for (int64_t r = 0; r < m; r++)
            quantize_row(xf + r * k, k, f.block, x.q + r * k, x.d + r * (k / f.block), x.sums + r * (k / 16));
        for (int64_t item = 0; item < work; item++) run_item(type, simd, &x, w, m, n, item, out);
    } else {
#pragma omp parallel num_threads(threads)
        {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; r++)
                quantize_row(xf + r * k, k, f.block, x.q + r * k, x.d + r * (k / f.block), x.sums + r * (k / 16));
#pragma omp for schedule(static)
            for (int64_t item = 0; item < work; item++) run_item(type, simd, &x, w, m, n, item, out);
        }
    }
    free(x.q), free(x.d), free(x.sums);
}

// Rows of W [rows, K] of `type` as float32 (out [count, K]): row ids[i] for each i, or rows 0..count-1 in
// order where ids is NULL. The bits equal gguf-py's dequantize (quant_blocks.h's dequantize_value).
void tf_quant_dequantize(const uint8_t *w, int64_t k, int type, const int64_t *ids, int64_t count, float *out,
                         int threads) {
    const qformat f = QFORMATS[type];
    const int64_t blocks = k / f.block, row_bytes = blocks * f.bytes;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && count > 1)
    for (int64_t r = 0; r < count; r++) {
        const uint8_t *row = w + (ids ? ids[r] : r) * row_bytes;
        wblock b;
        for (int64_t i = 0; i < blocks; i++) {
            decode_block(type, row + i * f.bytes, &b);
            for (int e = 0; e < f.block; e++) out[r * k + i * f.block + e] = dequantize_value(type, &b, e);
        }
    }
}
