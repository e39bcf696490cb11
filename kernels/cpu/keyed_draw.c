// The keyed draw on CPU, each row on its own (kernels/cpu_sampling.py, docs/engine.md "Keyed sampling"):
// deployments/model_rank/keyed_draw.py's rule, op for op.
//
// Rank order is logit descending, ties by lower id, NaN as -inf. Each token's mass is keyed_mass.masses'
// float64 ops in its order, with its constants (passed in), each rounded once (-ffp-contract=off); masses
// are whole numbers below 2^53 kept in doubles, so every sum is exact in any order. A top-k set of up to
// SMALL_HEAD tokens is kept sorted during one scan that skips each 16-value block with nothing above the
// set's last value. Wider rows never sort: the tokens at or above the mass floor are collected in id order,
// and each question "which token's running mass in rank order first exceeds t" is answered by a histogram
// of mass over the rank code's upper BUCKET_BITS bits, then the one bucket that holds the answer, sorted.
#include <math.h>
#include <stdlib.h>

#include "simd.h"

#define SMALL_HEAD 64
#define PARALLEL_LOGITS (1 << 18)  // fewer logits in a call are read on the calling thread: less than a fork costs
#define BUCKET_BITS 12  // the first look at a wide row: 4096 buckets of its rank codes, in L1
#define BUCKETS (1 << BUCKET_BITS)

// The constants keyed_mass.py computes masses with, in the order of its MASS_CONSTANTS.
enum { C_INV_LN2, C_LN2_HI, C_LN2_LO, C_FLOOR, C_TAYLOR };
#define TAYLOR_TERMS 12

static inline float weighable(float v) { return v != v ? -INFINITY : v; }

// Ascending in rank order: the value's bits made to order as unsigned, descending (-0 ties +0).
static inline uint32_t rank_code(float v) {
    v = weighable(v);
    if (v == 0.0f) v = 0.0f;
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return ~((u & 0x80000000u) ? ~u : (u | 0x80000000u));
}

static inline uint64_t rank_key(float v, int64_t id) { return ((uint64_t)rank_code(v) << 32) | (uint64_t)id; }

// The floor under every token of non-zero mass at temperature t (rank_head.mass_floor's bound: top +
// margin * t rounded down to a float, -inf where that bound cannot be trusted); t <= 0: none.
static float mass_floor(float top, double t, double margin) {
    const double x = (double)top;
    if (!(t > 0.0) || !(x > -INFINITY) || !(fabs(x) < 0x1p50 * t)) return -INFINITY;
    const double bound = x + margin * t;
    float lowest = (float)bound;
    if ((double)lowest > bound) lowest = nextafterf(lowest, -INFINITY);
    return lowest;
}

static float row_max(const float *row, int64_t cols) {
    vf16 best = vf_set1(-INFINITY);
    for (int64_t c = 0; c < cols; c += 16) {  // NaN and the lanes past the row are skipped
        const vf16 v = vf_select(vf_tail(cols - c), vf_load_f32(row + c, cols - c), vf_set1(-INFINITY));
        best = vf_max(v, best);
    }
    float lanes[16], top = -INFINITY;
    vf_store_f32(lanes, 16, best);
    for (int l = 0; l < 16; l++) top = lanes[l] > top ? lanes[l] : top;
    return top;
}

// round(exp(y) * 2^bits) for y = x / t - top / t, 0 below the floor or when top is -inf: the ops of
// keyed_mass.masses from y on, in its order.
static inline __attribute__((always_inline)) double mass_of(double y, int alive, double biased, const double *c) {
    const int live = alive & (y >= c[C_FLOOR]);
    y = live ? y : 0.0;
    const double k = rint(y * c[C_INV_LN2]);  // to nearest, ties to even, as torch.round
    const double r = (y - k * c[C_LN2_HI]) - k * c[C_LN2_LO];
    double p = c[C_TAYLOR + TAYLOR_TERMS - 1];
#pragma GCC unroll 16
    for (int j = TAYLOR_TERMS - 2; j >= 0; j--) p = p * r + c[C_TAYLOR + j];
    const double field = (k + biased) + 0x1p52;  // k + bits + 1023 in the low bits of its mantissa
    uint64_t bits_of_scale;
    memcpy(&bits_of_scale, &field, sizeof field);
    bits_of_scale <<= 52;  // 2^(k + bits), exactly
    double scale;
    memcpy(&scale, &bits_of_scale, sizeof scale);
    return rint(p * scale) * (double)live;  // a whole number times 1 or 0, exactly (a select here stops AVX2)
}

// out[i]: the mass of values[i] against the row's largest logit `top` at temperature t. Ties with the top
// have y = 0 by the subtraction itself while top / t is finite; only past that is it set (a separate loop,
// as the select keeps the compiler from vectorising the common one).
static void masses_of(const float *values, int64_t n, float top, double t, int bits, const double *c, double *out) {
    const double high = (double)top, shift = high / t, biased = (double)(bits + 1023);
    const int alive = high > -INFINITY;
    if (fabs(shift) < INFINITY) {
        for (int64_t i = 0; i < n; i++) out[i] = mass_of((double)values[i] / t - shift, alive, biased, c);
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        const double wide = (double)values[i];
        out[i] = mass_of(wide == high ? 0.0 : wide / t - shift, alive, biased, c);
    }
}

// out[i]: the mass of values[i] against `top` at temperature t (for the tests holding it to torch's).
void tf_keyed_masses(const float *values, int64_t n, float top, double t, int bits, const double *constants,
                     int64_t *out) {
    double *masses = malloc((size_t)(n > 0 ? n : 1) * sizeof *masses);
    if (!masses) return;
    masses_of(values, n, top, t, bits, constants, masses);
    for (int64_t i = 0; i < n; i++) out[i] = (int64_t)masses[i];
    free(masses);
}

// The first `limit` (<= SMALL_HEAD) tokens at or above `lowest`, keys ascending in `keys`; returns how many.
static int64_t small_head(const float *row, int64_t cols, int64_t limit, float lowest, uint64_t *keys) {
    float last[SMALL_HEAD];
    int64_t n = 0;
    for (int64_t c = 0; c < cols; c += 16) {
        if (n == limit && !mask_any(vf_gt(vf_load_f32(row + c, cols - c), vf_set1(last[n - 1])))) continue;
        const int64_t end = c + 16 < cols ? c + 16 : cols;
        for (int64_t id = c; id < end; id++) {
            const float v = weighable(row[id]);
            if (!(v >= lowest) || (n == limit && !(v > last[n - 1]))) continue;
            int64_t at = n < limit ? n++ : n - 1;  // a full buffer drops its last
            const uint64_t key = rank_key(v, id);
            for (; at > 0 && keys[at - 1] > key; at--) keys[at] = keys[at - 1], last[at] = last[at - 1];
            keys[at] = key, last[at] = v;
        }
    }
    return n;
}

// keys[0..n) sorted by their upper 32 bits, stably (ids ascending stay so within a value).
static void radix_sort(uint64_t *keys, uint64_t *spare, int64_t n) {
    for (int shift = 32; shift < 64; shift += 8) {
        int64_t counts[257] = {0};
        for (int64_t i = 0; i < n; i++) counts[((keys[i] >> shift) & 255) + 1]++;
        if (counts[((keys[0] >> shift) & 255) + 1] == n) continue;  // one digit throughout: already in order
        for (int d = 0; d < 256; d++) counts[d + 1] += counts[d];
        for (int64_t i = 0; i < n; i++) spare[counts[(keys[i] >> shift) & 255]++] = keys[i];
        memcpy(keys, spare, (size_t)n * sizeof *keys);
    }
}

typedef struct {  // one row's tokens at or above its floor, in id order, and room to answer questions
    int64_t n;
    int32_t *ids;
    float *values;      // NaN as -inf
    uint32_t *codes;    // rank_code of each value
    uint64_t *bucket;   // [2 n]: one bucket's keys (code, then index among the tokens), and a sort's spare
    double hist[BUCKETS];
} Wide;

// The tokens at or above `lowest`, in id order; returns how many.
static int64_t collect(const float *row, int64_t cols, float lowest, Wide *w) {
    int64_t n = 0;
    const vf16 below = vf_set1(nextafterf(lowest, -INFINITY));
    for (int64_t c = 0; c < cols; c += 16) {
        if (lowest > -INFINITY && !mask_any(vf_gt(vf_load_f32(row + c, cols - c), below))) continue;
        const int64_t end = c + 16 < cols ? c + 16 : cols;
        for (int64_t id = c; id < end; id++) {
            const float v = weighable(row[id]);
            if (v >= lowest) w->ids[n] = (int32_t)id, w->values[n] = v, w->codes[n++] = rank_code(v);
        }
    }
    return n;
}

// The index of the first token in rank order whose running weight exceeds `target` (weights NULL: 1 each;
// they must sum above target >= 0): a histogram of weight over the codes' upper bits finds the bucket,
// whose tokens are then sorted.
static int64_t first_past(Wide *w, const double *weights, double target) {
    memset(w->hist, 0, sizeof w->hist);
    for (int64_t i = 0; i < w->n; i++) w->hist[w->codes[i] >> (32 - BUCKET_BITS)] += weights ? weights[i] : 1.0;
    double before = 0.0;
    uint32_t b = 0;
    while (b < BUCKETS - 1 && before + w->hist[b] <= target) before += w->hist[b++];
    int64_t members = 0;
    for (int64_t i = 0; i < w->n; i++)
        if ((w->codes[i] >> (32 - BUCKET_BITS)) == b) w->bucket[members++] = ((uint64_t)w->codes[i] << 32) | (uint64_t)i;
    if (members > 1) radix_sort(w->bucket, w->bucket + w->n, members);
    for (int64_t j = 0; j < members; j++) {
        const int64_t i = (int64_t)(w->bucket[j] & 0xffffffffu);
        before += weights ? weights[i] : 1.0;
        if (before > target) return i;
    }
    return members ? (int64_t)(w->bucket[members - 1] & 0xffffffffu) : 0;
}

static inline int ranks_after(const Wide *w, int64_t i, int64_t pivot) {
    return w->codes[i] > w->codes[pivot] || (w->codes[i] == w->codes[pivot] && i > pivot);
}

// The kept masses (in place) of a wide row under top-k (`limit`), top-p and min-p; returns their sum.
static double keep_wide(Wide *w, double *masses, int64_t limit, const double *s, int bits) {
    if (limit < w->n) {
        const int64_t last = first_past(w, NULL, (double)(limit - 1));
        for (int64_t i = 0; i < w->n; i++) masses[i] = ranks_after(w, i, last) ? 0.0 : masses[i];
    }
    double total = 0.0;
    for (int64_t i = 0; i < w->n; i++) total += masses[i];
    const double p_total = s[1] * total, least = ldexp(s[2], bits);
    int64_t last_kept = -1;  // top-p keeps through the first token whose running mass reaches p_total
    if (total > 0.0 && p_total < total) last_kept = first_past(w, masses, ceil(p_total) - 1.0);
    double kept = 0.0;
    for (int64_t i = 0; i < w->n; i++) {
        const int cut = (last_kept >= 0 && ranks_after(w, i, last_kept)) || !(masses[i] >= least);
        masses[i] = cut ? 0.0 : masses[i];
        kept += masses[i];
    }
    return kept;
}

static int64_t first_in_rank(const Wide *w) {
    int64_t best = 0;
    for (int64_t i = 1; i < w->n; i++)
        if (w->codes[i] < w->codes[best]) best = i;
    return best;
}

// The drawn position in a sorted head of n masses (keyed_draw.draw_from_head): top-p keeps a token while the
// mass before it is below top_p times the head's, min-p while its mass is at least min_p * 2^bits; the first
// kept token whose running kept mass exceeds floor(u * kept mass).
static int64_t drawn_position(double *masses, int64_t n, const double *s, int bits) {
    double total = 0.0, before = 0.0, kept_total = 0.0;
    for (int64_t i = 0; i < n; i++) total += masses[i];
    const double p_total = s[1] * total, least = ldexp(s[2], bits);
    for (int64_t i = 0; i < n; i++) {
        const double m = masses[i];
        masses[i] = m > 0.0 && before < p_total && m >= least ? m : 0.0;
        before += m;
        kept_total += masses[i];
    }
    const double target = fmin(floor(s[3] * kept_total), kept_total - 1.0);
    double running = 0.0;
    for (int64_t i = 0; i < n; i++) {
        running += masses[i];
        if (running > target) return i;
    }
    return 0;
}

static int64_t draw_small(const float *row, int64_t cols, int64_t limit, float lowest, float top, const double *s,
                          int bits, const double *c) {
    uint64_t keys[SMALL_HEAD];
    float values[SMALL_HEAD] = {0};
    double masses[SMALL_HEAD];
    const int64_t n = small_head(row, cols, limit, lowest, keys);  // at least the top: lowest <= top
    for (int64_t i = 0; i < n; i++) values[i] = weighable(row[keys[i] & 0xffffffffu]);
    masses_of(values, n, top, s[0], bits, c, masses);
    return (int64_t)(keys[drawn_position(masses, n, s, bits)] & 0xffffffffu);
}

static int64_t draw_wide(const float *row, int64_t cols, int64_t limit, float lowest, float top, const double *s,
                         int bits, const double *c, Wide *w) {
    w->n = collect(row, cols, lowest, w);
    double *masses = (double *)(w->bucket + 2 * cols);
    masses_of(w->values, w->n, top, s[0], bits, c, masses);
    const double kept = keep_wide(w, masses, limit, s, bits);
    if (!(kept > 0.0)) return w->ids[first_in_rank(w)];
    return w->ids[first_past(w, masses, fmin(floor(s[3] * kept), kept - 1.0))];
}

// A wide row's scratch: the Wide itself, then its arrays (ids, values, codes; bucket and spare; masses).
static Wide *wide_scratch(int64_t cols) {
    Wide *w = malloc(sizeof *w + (size_t)cols * (4 + 4 + 4 + 16 + 8) + 16);
    if (!w) return NULL;
    w->bucket = (uint64_t *)(w + 1);
    w->ids = (int32_t *)(w->bucket + 2 * cols + cols);  // past bucket, spare and masses (8 bytes each)
    w->values = (float *)(w->ids + cols);
    w->codes = (uint32_t *)(w->values + cols);
    return w;
}

// tokens[r]: row r's keyed token, settings[r] = (temperature > 0, top_p, min_p, u, top_k) as
// keyed_draw.DrawSettings holds them, masses in units of 2^-bits of the likeliest token's weight
// (tokens[r] = -1: out of memory).
void tf_keyed_draw(const float *x, int64_t rows, int64_t cols, const double *settings, int bits,
                   const double *constants, int64_t *tokens, int threads) {
    const double margin = constants[C_FLOOR] - 2.0;
#pragma omp parallel for num_threads(threads) if (rows > 1 && rows * cols >= PARALLEL_LOGITS) schedule(dynamic)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * cols;
        const double *s = settings + 5 * r;
        const int64_t limit = s[4] > 0 && s[4] < (double)cols ? (int64_t)s[4] : cols;
        const float top = row_max(row, cols), lowest = mass_floor(top, s[0], margin);
        if (limit <= SMALL_HEAD) {
            tokens[r] = draw_small(row, cols, limit, lowest, top, s, bits, constants);
            continue;
        }
        Wide *w = wide_scratch(cols);
        tokens[r] = w ? draw_wide(row, cols, limit, lowest, top, s, bits, constants, w) : -1;
        free(w);
    }
}

// The first `limit` tokens of one row in rank order, sorted, in `keys` (room for 2 * cols past SMALL_HEAD).
static void sorted_head(const float *row, int64_t cols, int64_t limit, uint64_t *keys) {
    if (limit <= SMALL_HEAD) {
        small_head(row, cols, limit, -INFINITY, keys);
        return;
    }
    for (int64_t id = 0; id < cols; id++) keys[id] = rank_key(row[id], id);
    radix_sort(keys, keys + cols, cols);
}

// For each row r of x [rows, cols]: its first `top` (<= cols) tokens in rank order, as ids and values (NaN as
// -inf) in [rows, top] (a logprob row's best tokens); *failed = 1 when out of memory.
void tf_rank_head(const float *x, int64_t rows, int64_t cols, int64_t top, int64_t *ids, float *values,
                  int64_t *failed, int threads) {
#pragma omp parallel for num_threads(threads) if (rows > 1 && rows * cols >= PARALLEL_LOGITS) schedule(dynamic)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * cols;
        uint64_t small[SMALL_HEAD];
        uint64_t *keys = top <= SMALL_HEAD ? small : malloc(2 * (size_t)cols * sizeof *keys);
        if (!keys) {
            *failed = 1;
            continue;
        }
        sorted_head(row, cols, top, keys);
        for (int64_t i = 0; i < top; i++) {
            ids[r * top + i] = (int64_t)(keys[i] & 0xffffffffu);
            values[r * top + i] = weighable(row[ids[r * top + i]]);
        }
        if (keys != small) free(keys);
    }
}
