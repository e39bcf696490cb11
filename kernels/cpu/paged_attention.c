// Paged causal attention for the CPU path in float32, a few query rows at a time.
//
// A row (sequence s, query head h, query i at position p) reads keys lo..p of its sequence through the
// block table (lo = 0, or p - window + 1 on a sliding-window layer) and always runs the same sequence of ops: scores in ascending key order (a 16-lane dot and
// one fixed horizontal sum each), the max, exp in 16-key chunks, their sum in the same chunks, then the
// weighted V sum in ascending key order. Rows that share a sequence and a KV head are computed together in
// tiles, so each K and V row is loaded and widened once for the tile and the tile's independent V sums hide
// each other's FMA latency; but a tile only interleaves its rows' ops, never mixes them, so a row's bits are
// the same alone, batched, in any tile, any prefill chunking, during decode and on any thread count. Keys below
// a row's lo are never read (their blocks may be reused), and the 16-key chunks stay counted from key 0: a
// chunk of keys wholly below lo only ever added exact zeros, so skipping it changes no bit.
#include <math.h>
#include <stdlib.h>

#include "simd.h"

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
    int64_t hq, hkv, d, dv, block_size, window;  // window 0: every earlier key
    float scale;
    int dtype;
} attention_args;

#define MAX_TILE 4  // rows computed together
// Vectors of each row's output a V pass sums (MAX_TILE x V_CHUNK accumulators, half the register file): a
// pass covers one chunk of the head, so a tile keeps MAX_TILE rows whatever the head size.
#define V_CHUNK (VF_REGISTERS / 2 / MAX_TILE)

// One tile: `n` rows (query row ts[r], head hs[r]) of one sequence and one KV head, each over its own keys
// 0..pos in ascending order. DQ and DVQ are the head sizes in 16-float vectors when known at compile time
// (0: read them from `a`). `scores` holds MAX_TILE * padded floats; `rows` padded key-row offsets.
static inline __attribute__((always_inline)) void attend_tile_as(
    const attention_args *a, const int64_t *ts, const int64_t *hs, const int n, float *scores, int64_t padded,
    int64_t *rows, const int dtype, const int DQ, const int DVQ) {
    const int64_t dq = DQ ? DQ : (a->d + 15) / 16, dvq = DVQ ? DVQ : (a->dv + 15) / 16;
    const int64_t s = a->row_seq[ts[0]], kv_head = hs[0] / (a->hq / a->hkv);
    const int64_t *table = a->tables + a->table_starts[s];
    int64_t keys[MAX_TILE], lo[MAX_TILE], most = 0, fewest = INT64_MAX, lowest = INT64_MAX;
    for (int r = 0; r < n; r++) {
        keys[r] = a->row_pos[ts[r]] + 1;
        lo[r] = a->window > 0 && keys[r] > a->window ? keys[r] - a->window : 0;
        most = keys[r] > most ? keys[r] : most;
        fewest = keys[r] < fewest ? keys[r] : fewest;
        lowest = lo[r] < lowest ? lo[r] : lowest;
    }
    const int64_t first = lowest / 16 * 16;  // the first 16-key chunk any row of the tile reads
    for (int64_t j = first, b = first / a->block_size; j < most; b++) {  // each key's cache row, by block table
        const int64_t base = table[b] * a->block_size;
        for (int64_t slot = j % a->block_size; slot < a->block_size && j < most; slot++, j++)
            rows[j] = (base + slot) * a->hkv + kv_head;
    }
    vf16 q[MAX_TILE][MAX_HEAD_DIM / 16], best[MAX_TILE];
    for (int r = 0; r < n; r++) {
        best[r] = vf_set1(-INFINITY);
        for (int64_t c = 0; c < dq; c++)
            q[r][c] = load16(a->q, (ts[r] * a->hq + hs[r]) * a->d + c * 16, dtype, a->d - c * 16);
    }
    for (int64_t j0 = first; j0 < most; j0 += 16) {  // scores of 16 keys at a time
        vf16 partial[MAX_TILE][16];
        for (int i = 0; i < 16; i++) {
            const int64_t j = j0 + i;
            if (j >= most || j < lowest) {
                for (int r = 0; r < n; r++) partial[r][i] = vf_zero();
                continue;
            }
            vf16 k[MAX_HEAD_DIM / 16];
            for (int64_t c = 0; c < dq; c++) k[c] = load16(a->k_cache, rows[j] * a->d + c * 16, dtype, a->d - c * 16);
            for (int r = 0; r < n; r++) {
                vf16 dot = vf_zero();
                if (j < keys[r] && j >= lo[r])
                    for (int64_t c = 0; c < dq; c++) dot = vf_fma(q[r][c], k[c], dot);
                partial[r][i] = dot;
            }
        }
        for (int r = 0; r < n; r++) {
            if (j0 >= keys[r] || j0 + 16 <= lo[r]) continue;
            const int64_t below = lo[r] > j0 ? lo[r] - j0 : 0;  // lanes left of the window
            const vf16 group = vf_select(vf_tail(below), vf_set1(-INFINITY),
                                         vf_mul(sum_lanes_of_16(partial[r]), vf_set1(a->scale)));
            vf_store_f32(scores + r * padded + j0, keys[r] - j0, group);
            best[r] = vf_select(vf_tail(keys[r] - j0), vf_max(best[r], group), best[r]);
        }
    }
    float inverse[MAX_TILE];
    for (int r = 0; r < n; r++) {
        float *row_scores = scores + r * padded;
        const vf16 top = vf_set1(vf_reduce_max(best[r]));
        vf16 total = vf_zero();
        for (int64_t j0 = lo[r] / 16 * 16; j0 < keys[r]; j0 += 16) {
            const int64_t left = keys[r] - j0, below = lo[r] > j0 ? lo[r] - j0 : 0;
            vf16 e = vf_select(vf_tail(left), exp_nonpositive(vf_sub(vf_load_f32(row_scores + j0, left), top)), vf_zero());
            e = vf_select(vf_tail(below), vf_zero(), e);  // exp of -inf is not 0 here: the window's left edge
            vf_store_f32(row_scores + j0, left, e);
            total = vf_add(total, e);
        }
        inverse[r] = 1.0f / vf_reduce_add(total);
    }
    for (int64_t c0 = 0; c0 < dvq; c0 += V_CHUNK) {  // the V sums, V_CHUNK vectors of each row's output at a time
        // A compiled head size's chunks are whole (4, 8 or 16 vectors by 1 or 4): a constant, kept in registers.
        const int chunk = DVQ ? (DVQ < V_CHUNK ? DVQ : V_CHUNK) : (int)(dvq - c0 < V_CHUNK ? dvq - c0 : V_CHUNK);
        vf16 acc[MAX_TILE][V_CHUNK];
        for (int r = 0; r < n; r++)
            for (int c = 0; c < chunk; c++) acc[r][c] = vf_zero();
        for (int64_t j = lowest; j < most; j++) {  // every row in ascending key order, each over its own keys
            vf16 v[V_CHUNK];
            for (int c = 0; c < chunk; c++)
                v[c] = load16(a->v_cache, rows[j] * a->dv + (c0 + c) * 16, dtype, a->dv - (c0 + c) * 16);
            for (int r = 0; r < n; r++) {
                if ((j >= fewest && j >= keys[r]) || j < lo[r]) continue;  // a key outside this row's span
                const vf16 p = vf_set1(scores[r * padded + j]);
                for (int c = 0; c < chunk; c++) acc[r][c] = vf_fma(p, v[c], acc[r][c]);
            }
        }
        for (int r = 0; r < n; r++)
            for (int c = 0; c < chunk; c++)
                store16(a->out, (ts[r] * a->hq + hs[r]) * a->dv + (c0 + c) * 16, dtype, a->dv - (c0 + c) * 16,
                        vf_mul(acc[r][c], vf_set1(inverse[r])));
    }
}

// The tile kernel compiled per element type and for 64-, 128- and 256-wide heads, so the inner loops carry no
// type switch and keep their vectors in registers. A model's rows always take the same variant.
#define TILE_OF(DT)                                                                                          \
    static void attend_tile_##DT(const attention_args *a, const int64_t *ts, const int64_t *hs, int n,       \
                                 float *scores, int64_t padded, int64_t *rows) {                             \
        if (a->d == 64 && a->dv == 64) attend_tile_as(a, ts, hs, n, scores, padded, rows, DT, 4, 4);          \
        else if (a->d == 128 && a->dv == 128) attend_tile_as(a, ts, hs, n, scores, padded, rows, DT, 8, 8);   \
        else if (a->d == 256 && a->dv == 256) attend_tile_as(a, ts, hs, n, scores, padded, rows, DT, 16, 16); \
        else attend_tile_as(a, ts, hs, n, scores, padded, rows, DT, 0, 0);                                    \
    }
TILE_OF(DT_F32)
TILE_OF(DT_BF16)
TILE_OF(DT_F16)

// Every (query row, head) of one step. Per sequence and KV head, its rows (query-row major, then the heads
// sharing that KV head) are cut into tiles of MAX_TILE; tiles are spread over threads, each computed whole
// by one.
void tf_paged_attention(const void *q, const void *k_cache, const void *v_cache, void *out, const int64_t *tables,
                        const int64_t *table_starts, const int64_t *row_seq, const int64_t *row_pos, int64_t rows,
                        int64_t hq, int64_t hkv, int64_t d, int64_t dv, int64_t block_size, int64_t max_keys,
                        int64_t window, float scale, int dtype, int threads) {
    const attention_args a = {q, k_cache, v_cache, out, tables, table_starts, row_seq, row_pos,
                              hq, hkv, d, dv, block_size, window, scale, dtype};
    const int64_t group = hq / hkv, per_tile = MAX_TILE;
    // Runs of query rows of one sequence (a step's rows are grouped by sequence), and the first tile of each.
    int64_t *run_start = (int64_t *)malloc((size_t)(rows + 1) * sizeof(int64_t));
    int64_t *first_tile = (int64_t *)malloc((size_t)(rows + 1) * sizeof(int64_t));
    int64_t runs = 0, tiles = 0;
    for (int64_t t = 0; t < rows; t++) {
        if (t > 0 && row_seq[t] == row_seq[t - 1]) continue;
        run_start[runs++] = t;
    }
    run_start[runs] = rows;
    for (int64_t r = 0; r < runs; r++) {
        first_tile[r] = tiles;
        tiles += hkv * (((run_start[r + 1] - run_start[r]) * group + per_tile - 1) / per_tile);
    }
    first_tile[runs] = tiles;
#pragma omp parallel num_threads(threads)
    {
        const int64_t padded = (max_keys + 15) / 16 * 16;
        float *scores = (float *)aligned_alloc(64, (size_t)(MAX_TILE * padded) * sizeof(float));
        int64_t *key_rows = (int64_t *)malloc((size_t)padded * sizeof(int64_t));
        int64_t run = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t tile = 0; tile < tiles; tile++) {
            while (first_tile[run + 1] <= tile) run++;  // tiles come in order on each thread
            while (first_tile[run] > tile) run--;
            const int64_t length = run_start[run + 1] - run_start[run], items = length * group;
            const int64_t per_head = (items + per_tile - 1) / per_tile, within = tile - first_tile[run];
            const int64_t kv_head = within / per_head, item0 = within % per_head * per_tile;
            int64_t ts[MAX_TILE], hs[MAX_TILE];
            int n = 0;
            for (int64_t item = item0; item < items && n < per_tile; item++, n++) {
                ts[n] = run_start[run] + item / group;
                hs[n] = kv_head * group + item % group;
            }
            if (dtype == DT_BF16) attend_tile_DT_BF16(&a, ts, hs, n, scores, padded, key_rows);
            else if (dtype == DT_F16) attend_tile_DT_F16(&a, ts, hs, n, scores, padded, key_rows);
            else attend_tile_DT_F32(&a, ts, hs, n, scores, padded, key_rows);
        }
        free(key_rows);
        free(scores);
    }
    free(first_tile);
    free(run_start);
}
