/* The draft head's attention on the CPU (drafter/head_kernel.py): rotate, write, attend.

   A draft position of the head (drafter/head.py, forward_rows) writes the key and value of every
   new row into the head's one-layer cache (drafter/head_cache.py), then attends from each
   request's last row to the rows it sees: positions (p - window, p] with a window, else 0 .. p.
   Row j of a slot lives in cell j mod R (R: the cache's rows; a windowed head's ring is shorter
   than the context). Keys are stored transposed, [slots, kv, D, R], so the scores of many cells
   are taken side by side, one per vector lane; values are [slots, kv, R, D]. In torch that is
   about twenty small operations (index the RoPE tables, rotate, two indexed copies, a query grid,
   a mask, two batched matmuls, a softmax); here two passes over the rows.

   The rotation is the torch code's arithmetic (x * cos + roll(x) * sin_signed, each product
   rounded: -ffp-contract=off), so the cached keys have the same bits. Scores and the softmax are
   float32 sums in another order than torch's matmul, and exp is a polynomial: an output may
   differ from the torch path's in its last bits, as the cached attention already differs from
   the unrolled one. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "../rollout/kernels/kernel_math.h"

#define SPLIT 4 /* independent vector sums in flight */
#define MAX_DIM 512
#define MAX_ROWS 4096

/* y = x * cos + roll(x, D / 2) * sin_signed for one head vector of D floats. */
static void rotate(const float *x, const float *cos, const float *sin_signed, int64_t dim, float *y) {
    int64_t half = dim / 2;
    for (int64_t d = 0; d < dim; d++) {
        float rolled = x[d < half ? d + half : d - half];
        float a = x[d] * cos[d];
        float b = rolled * sin_signed[d];
        y[d] = a + b;
    }
}

/* Rows n0..n1 - 1: qkv [N, heads + 2 kv, D]; row n goes to slot slots[n], cell positions[n] mod
   kept. Writes the rotated key (a column of the transposed keys) and the value of each kv head. */
void head_write_rows(int64_t n0, int64_t n1, int64_t heads, int64_t kv, int64_t dim, int64_t kept,
                     const float *qkv, const float *cos, const float *sin_signed, const int64_t *slots,
                     const int64_t *positions, float *k_cache, float *v_cache) {
    float k[MAX_DIM];
    int64_t stride = (heads + 2 * kv) * dim;
    for (int64_t n = n0; n < n1; n++) {
        int64_t p = positions[n], cell = p % kept;
        const float *row = qkv + n * stride;
        for (int64_t h = 0; h < kv; h++) {
            int64_t head = (slots[n] * kv + h) * kept * dim;
            rotate(row + (heads + h) * dim, cos + p * dim, sin_signed + p * dim, dim, k);
            for (int64_t d = 0; d < dim; d++)
                k_cache[head + d * kept + cell] = k[d];
            const float *v = row + (heads + kv + h) * dim;
            for (int64_t d = 0; d < dim; d++)
                v_cache[head + cell * dim + d] = v[d];
        }
    }
}

/* Scores q . k * scale into w[c] for the cells c of [c0, c1), both multiples of LANES, of one
   head's transposed keys kt [D, kept]: SPLIT * LANES cells at a time where they fit, their sums
   kept down the D rows in machine vectors (independent additions in flight). */
#define CELL_VECTORS (SPLIT * LANES / MLANES)
static void scores(const float *q, const float *kt, int64_t kept, int64_t dim, int64_t c0, int64_t c1, float scale,
                   float *w) {
    int64_t j0 = c0;
    for (; j0 + SPLIT * LANES <= c1; j0 += SPLIT * LANES) {
        mvec acc[CELL_VECTORS];
        for (int s = 0; s < CELL_VECTORS; s++)
            acc[s] = mvec_splat(0.0f);
        for (int64_t d = 0; d < dim; d++)
            for (int s = 0; s < CELL_VECTORS; s++)
                acc[s] += q[d] * mvec_load(kt + d * kept + j0 + s * MLANES);
        for (int s = 0; s < CELL_VECTORS; s++)
            mvec_store(w + j0 + s * MLANES, acc[s] * scale);
    }
    for (; j0 < c1; j0 += MLANES) {
        mvec acc = mvec_splat(0.0f);
        for (int64_t d = 0; d < dim; d++)
            acc += q[d] * mvec_load(kt + d * kept + j0);
        mvec_store(w + j0, acc * scale);
    }
}

/* o[d] += sum_j w[j] v[j, d] over n value rows of D floats: LANES columns at a time (in machine
   vectors), the rows split among SPLIT sums added at the end (independent additions). */
static void weighted_values(const float *w, const float *v, int64_t n, int64_t dim, float *o) {
    int64_t d0 = 0;
    for (; d0 + LANES <= dim; d0 += LANES)
        for (int64_t m = d0; m < d0 + LANES; m += MLANES) {
            mvec acc[SPLIT];
            for (int s = 0; s < SPLIT; s++)
                acc[s] = mvec_splat(0.0f);
            int64_t j = 0;
            for (; j + SPLIT <= n; j += SPLIT)
                for (int s = 0; s < SPLIT; s++)
                    acc[s] += w[j + s] * mvec_load(v + (j + s) * dim + m);
            for (; j < n; j++)
                acc[0] += w[j] * mvec_load(v + j * dim + m);
            mvec total = acc[0];
            for (int s = 1; s < SPLIT; s++)
                total += acc[s];
            mvec_store(o + m, mvec_load(o + m) + total);
        }
    for (; d0 < dim; d0++)
        for (int64_t j = 0; j < n; j++)
            o[d0] += w[j] * v[j * dim + d0];
}

/* One query head against the cells of two runs (the second empty unless the ring wraps):
   softmax-weighted sum of their values into o [D]. kept is a multiple of LANES, so the scores
   are taken for whole vectors of cells around each run; w [kept] is scratch indexed by cell. */
static void attend_one(const float *q, const float *kt, const float *values, int64_t kept, int64_t dim,
                       const int64_t start[2], const int64_t len[2], float scale, float *w, float *o) {
    float top = -INFINITY;
    for (int r = 0; r < 2; r++) {
        if (len[r] == 0)
            continue;
        int64_t lo = start[r] / LANES * LANES, hi = (start[r] + len[r] + LANES - 1) / LANES * LANES;
        scores(q, kt, kept, dim, lo, hi, scale, w);
        for (int64_t c = start[r]; c < start[r] + len[r]; c++)
            top = w[c] > top ? w[c] : top;
    }
    float part[LANES] = {0};  /* LANES partial sums, added in order at the end */
    for (int r = 0; r < 2; r++) {
        float *e = w + start[r];
        int64_t b = 0;
        for (; b + MLANES <= len[r]; b += MLANES)
            mvec_store(e + b, mvec_exp_nonpositive(mvec_load(e + b) - top));
        for (; b < len[r]; b++)
            e[b] = exp_nonpositive(e[b] - top);
        b = 0;
        for (; b + LANES <= len[r]; b += LANES)
            for (int m = 0; m < LANES; m += MLANES)
                mvec_store(part + m, mvec_load(part + m) + mvec_load(e + b + m));
        for (; b < len[r]; b++)
            part[b % LANES] += e[b];
    }
    float total = 0.0f;
    for (int j = 0; j < LANES; j++)
        total += part[j];
    for (int64_t d = 0; d < dim; d++)
        o[d] = 0.0f;
    for (int r = 0; r < 2; r++)
        weighted_values(w + start[r], values + start[r] * dim, len[r], dim, o);
    float inverse = 1.0f / total;
    for (int64_t d = 0; d < dim; d++)
        o[d] *= inverse;
}

/* Queries c0..c1 - 1: the row last[c] of qkv (last NULL: row c; rotated here) attends, head by head, to the cells
   of its slot holding positions max(0, p - window + 1) .. p (window 0: from 0), kv head h serving
   query heads h * fold .. (h + 1) * fold - 1. out [C, heads * D]. Returns 0, or -1 where a head
   is wider than MAX_DIM, or the cache's rows are more than MAX_ROWS or not a multiple of LANES. */
int head_attend_rows(int64_t c0, int64_t c1, int64_t heads, int64_t kv, int64_t dim, int64_t kept,
                     int64_t window, float scale, const float *qkv, const float *cos,
                     const float *sin_signed, const int64_t *last, const int64_t *slots,
                     const int64_t *positions, const float *k_cache, const float *v_cache, float *out) {
    float q[MAX_DIM], w[MAX_ROWS];
    if (dim > MAX_DIM)
        return -1;
    int64_t stride = (heads + 2 * kv) * dim, fold = heads / kv;
    for (int64_t c = c0; c < c1; c++) {
        int64_t n = last != NULL ? last[c] : c, p = positions[n];
        int64_t seen = window > 0 && window < p + 1 ? window : p + 1;
        if (seen > kept || kept > MAX_ROWS || kept % LANES)
            return -1;
        /* positions p - seen + 1 .. p: cells from (p - seen + 1) mod kept, wrapping at most once */
        int64_t first = (p - seen + 1) % kept;
        int64_t run_start[2] = {first, 0};
        int64_t run_len[2] = {first + seen <= kept ? seen : kept - first, 0};
        run_len[1] = seen - run_len[0];
        for (int64_t g = 0; g < heads; g++) {
            int64_t head = (slots[n] * kv + g / fold) * kept * dim;
            rotate(qkv + n * stride + g * dim, cos + p * dim, sin_signed + p * dim, dim, q);
            attend_one(q, k_cache + head, v_cache + head, kept, dim, run_start, run_len, scale, w,
                       out + (c * heads + g) * dim);
        }
    }
    return 0;
}
