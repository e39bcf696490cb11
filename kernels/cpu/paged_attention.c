// Paged causal attention for the CPU path, one query row at a time in float32.
//
// A row (sequence s, query head h, query i at position p) reads keys 0..p of its sequence through the
// block table and always runs the same sequence of ops: scores in ascending key order (a 16-lane dot and
// one fixed horizontal sum each), the max, exp in 16-key chunks, their sum in the same chunks, then the
// weighted V sum in ascending key order. Nothing depends on the other rows, the batch or the thread count,
// so a row's bits are the same alone, batched, in any prefill chunking, and during decode.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

static inline __attribute__((always_inline)) __m512 load16(const void *base, int64_t index, int dtype, __mmask16 mask) {
    if (dtype == DT_F32) return _mm512_maskz_loadu_ps(mask, (const float *)base + index);
    const __m256i raw = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)base + index);
    if (dtype == DT_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    return _mm512_cvtph_ps(raw);
}

static inline void store16(void *base, int64_t index, int dtype, __mmask16 mask, __m512 v) {
    if (dtype == DT_F32) {
        _mm512_mask_storeu_ps((float *)base + index, mask, v);
    } else if (dtype == DT_BF16) {
        _mm256_mask_storeu_epi16((uint16_t *)base + index, mask, (__m256i)_mm512_cvtneps_pbh(v));
    } else {
        _mm256_mask_storeu_epi16((uint16_t *)base + index, mask, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    }
}

// exp(x) for x <= 0 (scores minus their max): 2^n * (1 + r + r^2 P(r)), Cephes' expf polynomial.
static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

#define MAX_HEAD_DIM 256  // q/k and v head sizes the kernel takes (16 vectors of 16 floats)

typedef struct {
    const void *q;           // [T, Hq, D]
    const void *k_cache;     // [blocks, bs, Hkv, D]
    const void *v_cache;     // [blocks, bs, Hkv, Dv]
    void *out;               // [T, Hq, Dv]
    const int64_t *tables;   // block ids of every sequence, one after another
    const int64_t *table_starts;  // [S]: where sequence s's block ids start in `tables`
    const int64_t *row_seq;  // [T]: the sequence of each query row
    const int64_t *row_pos;  // [T]: each query row's position in its sequence
    int64_t hq, hkv, d, dv, block_size;
    float scale;
    int dtype;
} attention_args;

static inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
}

// Lane i of the result = the sum of v[i]'s 16 lanes, by one fixed tree whatever the other vectors hold.
static inline __m512 sum_lanes_of_16(const __m512 v[16]) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; i++)  // per 128-bit quad: [a0+a2, b0+b2, a1+a3, b1+b3]
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  // per quad: the quad's sum for each of 4 vectors
        const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 h01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88), _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
    const __m512 h23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88), _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(h01, h23, 0x88), _mm512_shuffle_f32x4(h01, h23, 0xDD));
}

// One (query row t, head h): keys 0..pos of its sequence, in ascending order. `scratch` holds max_keys
// floats and max_keys key-row offsets.
static inline __attribute__((always_inline)) void attend_row_as(const attention_args *a, int64_t t, int64_t h,
                                                               float *scores, int64_t *rows, const int dtype) {
    const int64_t s = a->row_seq[t], keys = a->row_pos[t] + 1, kv_head = h / (a->hq / a->hkv);
    const int64_t *table = a->tables + a->table_starts[s];
    for (int64_t j = 0, b = 0; j < keys; b++) {  // each key's cache row, walking the block table
        const int64_t base = table[b] * a->block_size;
        for (int64_t slot = 0; slot < a->block_size && j < keys; slot++, j++) rows[j] = (base + slot) * a->hkv + kv_head;
    }
    const int64_t dq = (a->d + 15) / 16, dvq = (a->dv + 15) / 16;
    __m512 q[MAX_HEAD_DIM / 16];
    for (int64_t c = 0; c < dq; c++) q[c] = load16(a->q, (t * a->hq + h) * a->d + c * 16, dtype, tail_mask(a->d - c * 16));
    __m512 best = _mm512_set1_ps(-INFINITY);
    for (int64_t j0 = 0; j0 < keys; j0 += 16) {  // scores of 16 keys at a time
        __m512 partial[16];
        for (int i = 0; i < 16; i++) {
            partial[i] = _mm512_setzero_ps();
            if (j0 + i >= keys) continue;
            for (int64_t c = 0; c < dq; c++)
                partial[i] = _mm512_fmadd_ps(q[c], load16(a->k_cache, rows[j0 + i] * a->d + c * 16, dtype, tail_mask(a->d - c * 16)), partial[i]);
        }
        const __mmask16 m = tail_mask(keys - j0);
        const __m512 group = _mm512_mul_ps(sum_lanes_of_16(partial), _mm512_set1_ps(a->scale));
        _mm512_mask_storeu_ps(scores + j0, m, group);
        best = _mm512_mask_max_ps(best, m, best, group);
    }
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
    __m512 total = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < keys; j0 += 16) {
        const __mmask16 m = tail_mask(keys - j0);
        const __m512 e = _mm512_maskz_mov_ps(m, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + j0), top)));
        _mm512_mask_storeu_ps(scores + j0, m, e);
        total = _mm512_add_ps(total, e);
    }
    __m512 acc[MAX_HEAD_DIM / 16];
    for (int64_t c = 0; c < dvq; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < keys; j++) {
        const __m512 p = _mm512_set1_ps(scores[j]);
        for (int64_t c = 0; c < dvq; c++)
            acc[c] = _mm512_fmadd_ps(p, load16(a->v_cache, rows[j] * a->dv + c * 16, dtype, tail_mask(a->dv - c * 16)), acc[c]);
    }
    const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
    for (int64_t c = 0; c < dvq; c++)
        store16(a->out, (t * a->hq + h) * a->dv + c * 16, dtype, tail_mask(a->dv - c * 16), _mm512_mul_ps(acc[c], inverse));
}

// The row kernel compiled once per element type, so the inner loops carry no type switch.
static void attend_row(const attention_args *a, int64_t t, int64_t h, float *scores, int64_t *rows) {
    if (a->dtype == DT_BF16) attend_row_as(a, t, h, scores, rows, DT_BF16);
    else if (a->dtype == DT_F16) attend_row_as(a, t, h, scores, rows, DT_F16);
    else attend_row_as(a, t, h, scores, rows, DT_F32);
}

// Every (query row, head) of one step; rows are spread over threads, each row computed whole by one.
void tf_paged_attention(const void *q, const void *k_cache, const void *v_cache, void *out, const int64_t *tables,
                        const int64_t *table_starts, const int64_t *row_seq, const int64_t *row_pos, int64_t rows,
                        int64_t hq, int64_t hkv, int64_t d, int64_t dv, int64_t block_size, int64_t max_keys,
                        float scale, int dtype, int threads) {
    const attention_args a = {q, k_cache, v_cache, out, tables, table_starts, row_seq, row_pos,
                              hq, hkv, d, dv, block_size, scale, dtype};
#pragma omp parallel num_threads(threads)
    {
        const size_t padded = (size_t)((max_keys + 15) / 16 * 16);
        float *scores = (float *)aligned_alloc(64, padded * sizeof(float));
        int64_t *key_rows = (int64_t *)malloc(padded * sizeof(int64_t));
#pragma omp for schedule(dynamic, 4)
        for (int64_t item = 0; item < rows * hq; item++) {
            attend_row(&a, item / hq, item % hq, scores, key_rows);
        }
        free(key_rows);
        free(scores);
    }
}
