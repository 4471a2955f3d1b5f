/* Attention for the CPU, token by token: the token at position p of a request reads its slot's
   keys and values at positions max(0, p - window + 1) .. p, and nothing else.

   Each token's output is a fixed sequence of arithmetic on its own query and those keys, so it
   has the same bits whatever else is in the forward: how many rows, how many queries per row
   (decode, verify or prefill), which slots. A request's consecutive tokens share their loads
   (attend_rows), not their arithmetic. That is the engine's batch invariance, here by
   construction (rollout/kernels/attention_kernel.py; torch's fused CPU attention picks its blocking by
   the shapes, and rounds differently for a lone query in bfloat16).

   Scores and the softmax are float32 whatever the cache's type; bfloat16 keys and values are
   widened as they are read, and the output is rounded to bfloat16 at the end. Keys are stored
   transposed (rollout/core/kv_cache.py), so a score is a sum down a column taken for many positions
   side by side, one per vector lane, with no sum across lanes; the softmax's sum keeps LANES
   partial sums added in a fixed tree; exp is written out so that it vectorizes. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_math.h"

#define MAX_GROUP 16
#define SCORE_BLOCK 64 /* positions scored together: several vectors of sums in flight */
/* A request's consecutive tokens (a verify row's drafts, a prompt chunk) read the same keys and
   values: up to MAX_ROWS query rows of one key/value head (ROW_TILE at a time) go through them
   together, each key or value vector loaded once for all of them. */
#define ROW_TILE 4
#define MAX_ROWS 16
/* Vectors of positions such a tile scores at once: its ROW_TILE x ROW_BLOCKS sums and ROW_BLOCKS
   key vectors stay in registers (32 with AVX-512, 16 with AVX2). */
#if MLANES == 16
#define ROW_BLOCKS 4
#else
#define ROW_BLOCKS 2
#endif

/* MLANES bfloat16 values widened to a vector of floats. */
typedef uint16_t mvec16 __attribute__((vector_size(MLANES * sizeof(uint16_t))));
typedef uint32_t mvec32 __attribute__((vector_size(MLANES * sizeof(uint32_t))));

static inline mvec mvec_load_bf16(const uint16_t *p) {
    mvec16 h;
    memcpy(&h, p, sizeof h);
    mvec32 bits = __builtin_convertvector(h, mvec32) << 16;
    mvec v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* s[j] <- e^(s[j] - top) in place; returns their sum (LANES partial sums, a fixed tree). */
static float softmax_numerators(float *s, int64_t n, float top) {
    mvec part[LANES / MLANES];
    for (int b = 0; b < LANES / MLANES; b++)
        part[b] = mvec_splat(0.0f);
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int b = 0; b < LANES / MLANES; b++) {
            mvec e = mvec_exp_nonpositive(mvec_load(s + j + b * MLANES) - top);
            mvec_store(s + j + b * MLANES, e);
            part[b] += e;
        }
    float sum[LANES];
    for (int b = 0; b < LANES / MLANES; b++)
        mvec_store(sum + b * MLANES, part[b]);
    for (; j < n; j++) {
        s[j] = exp_nonpositive(s[j] - top);
        sum[0] += s[j];
    }
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++)
            sum[l] += sum[l + width];
    return sum[0];
}

/* Row r of out ([rows, D]) divided by total[r]: the softmax's denominator, applied last. */
static void divide_rows(float *out, int64_t rows, int64_t D, const float *total) {
    for (int64_t r = 0; r < rows; r++) {
        float inv = 1.0f / total[r];
        for (int64_t d = 0; d < D; d++)
            out[r * D + d] *= inv;
    }
}

/* s[0 .. n-1] <- their softmax's numerators, less their maximum; returns the denominator. The
   maximum is exact, whatever order it is taken in. */
static float exponentiate(float *s, int64_t n) {
    mvec most = mvec_splat(-__builtin_inff());
    int64_t i = 0;
    for (; i + MLANES <= n; i += MLANES) {
        mvec x = mvec_load(s + i);
        most = mvec_select(x > most, x, most);
    }
    float top = -__builtin_inff();
    for (int l = 0; l < MLANES; l++)
        top = most[l] > top ? most[l] : top;
    for (; i < n; i++)
        top = s[i] > top ? s[i] : top;
    return softmax_numerators(s, n, top);
}

/* attend_one over keys and values of type T, widened to float by LOAD (one) and MLOAD (a
   vector) as they are read: one token's G query heads (q: [G, D] float32) against n positions
   of one head, into out [G, D] float32. k points at the first position's column of a head's
   transposed keys ([D, stride]: key d of position j at k[d * stride + j]); v at its first
   position's row ([n, D]).
   A score is q . k_j summed over d in order, one position per vector lane: SCORE_BLOCK positions
   (several vectors, so that their sums run side by side) at a time while `room` (the positions
   from the first to the end of the cache row) allows, then MLANES, then one; a last block runs
   past the n positions wanted, into the cache row's later entries, whose scores are not used.
   Every position gets the same arithmetic whichever way it was reached. The output is the
   weights times the values summed position by position in order, MLANES of its D entries at a
   time in a vector that stays in a register (a sum kept in memory waits on its own store at
   every position), several such vectors of the G heads side by side (WEIGHTED_VALUES). scores:
   G rows of `width` floats (n rounded up to SCORE_BLOCK) of scratch. */
#define LOAD_F32(x) (x)
#define LOAD_BF16(x) from_bf16(x)
/* Scores of HEADS query heads g .. g + HEADS - 1 (qg: the first one's query, sg: its row of
   scores), BLOCKS vectors of positions at a time: each key vector is loaded once for all of them,
   and HEADS x BLOCKS sums run side by side. */
#define SCORES(T, MLOAD, HEADS, BLOCKS)                                                            \
    for (; j < n && j + (BLOCKS) * MLANES <= room; j += (BLOCKS) * MLANES) {                     \
        mvec acc[HEADS][BLOCKS];                                                                    \
        for (int h = 0; h < (HEADS); h++)                                                           \
            for (int b = 0; b < (BLOCKS); b++)                                                      \
                acc[h][b] = mvec_splat(0.0f);                                                       \
        for (int64_t d = 0; d < D; d++) {                                                           \
            const T *kd = k + d * stride + j;                                                       \
            mvec kb[BLOCKS];                                                                        \
            for (int b = 0; b < (BLOCKS); b++)                                                      \
                kb[b] = MLOAD(kd + b * MLANES);                                                     \
            for (int h = 0; h < (HEADS); h++) {                                                     \
                float qd = qg[h * D + d];                                                           \
                for (int b = 0; b < (BLOCKS); b++)                                                  \
                    acc[h][b] += qd * kb[b];                                                        \
            }                                                                                       \
        }                                                                                           \
        for (int h = 0; h < (HEADS); h++)                                                           \
            for (int b = 0; b < (BLOCKS); b++)                                                      \
                mvec_store(sg + h * width + j + b * MLANES, acc[h][b] * scale);                     \
    }
/* Heads scored together by attend_one: two where their 2 x SCORE_BLOCK / MLANES sums and the key
   vectors fit in the registers (32 with AVX-512), else one (16 with AVX2). */
#if MLANES == 16
#define PAIRED 2
#else
#define PAIRED 1
#endif
/* Every score of heads g .. g + HEADS - 1, then their softmax numerators and denominators. */
#define SCORE_HEADS(T, LOAD, MLOAD, HEADS)                                                         \
    {                                                                                               \
        const float *qg = q + g * D;                                                                \
        float *sg = scores + g * width;                                                             \
        int64_t j = 0;                                                                              \
        SCORES(T, MLOAD, HEADS, SCORE_BLOCK / MLANES)                                               \
        SCORES(T, MLOAD, HEADS, 1)                                                                  \
        for (; j < n; j++)                                                                          \
            for (int h = 0; h < (HEADS); h++) {                                                     \
                float acc = 0.0f;                                                                   \
                for (int64_t d = 0; d < D; d++)                                                     \
                    acc += qg[h * D + d] * LOAD(k[d * stride + j]);                                 \
                sg[h * width + j] = acc * scale;                                                    \
            }                                                                                       \
        for (int h = 0; h < (HEADS); h++)                                                           \
            total[g + h] = exponentiate(sg + h * width, n);                                         \
    }
/* The output's vectors, MLANES entries of one query head each (G heads x D / MLANES of them,
   numbered p = g * vectors + d / MLANES), CHAINS at a time: each is the weights times the values
   summed position by position in order, in a vector that stays in a register, and CHAINS of
   them advance together (a lone sum waits on its own addition at every position). */
#define PV_CHAINS 8
#define WEIGHTED_VALUES(T, MLOAD, CHAINS)                                                          \
    for (; p + (CHAINS) <= G * vectors; p += (CHAINS)) {                                           \
        const float *wc[CHAINS];                                                                    \
        int64_t at[CHAINS];                                                                         \
        mvec acc[CHAINS];                                                                           \
        for (int c = 0; c < (CHAINS); c++) {                                                        \
            int64_t g = (p + c) / vectors;                                                          \
            wc[c] = scores + g * width;                                                             \
            at[c] = (p + c) % vectors * MLANES;                                                     \
            acc[c] = mvec_splat(0.0f);                                                              \
        }                                                                                           \
        for (int64_t j = 0; j < n; j++) {                                                           \
            const T *vj = v + j * D;                                                                \
            for (int c = 0; c < (CHAINS); c++)                                                      \
                acc[c] += wc[c][j] * MLOAD(vj + at[c]);                                             \
        }                                                                                           \
        for (int c = 0; c < (CHAINS); c++)                                                          \
            mvec_store(out + (p + c) / vectors * D + at[c], acc[c]);                                \
    }
#define ATTEND_ONE(NAME, T, LOAD, MLOAD)                                                           \
    static void NAME(const float *q, int64_t G, int64_t D, const T *k, int64_t stride, int64_t room, \
                     const T *v, int64_t n, float scale, float *scores, float *out) {               \
        float total[MAX_GROUP];                                                                     \
        int64_t width = (n + SCORE_BLOCK - 1) / SCORE_BLOCK * SCORE_BLOCK;                          \
        int64_t g = 0;                                                                              \
        for (; g + PAIRED <= G; g += PAIRED)                                                        \
            SCORE_HEADS(T, LOAD, MLOAD, PAIRED)                                                     \
        for (; g < G; g++)                                                                          \
            SCORE_HEADS(T, LOAD, MLOAD, 1)                                                          \
        int64_t vectors = D / MLANES, p = 0;                                                        \
        WEIGHTED_VALUES(T, MLOAD, PV_CHAINS)                                                        \
        WEIGHTED_VALUES(T, MLOAD, 4)                                                                \
        WEIGHTED_VALUES(T, MLOAD, 2)                                                                \
        WEIGHTED_VALUES(T, MLOAD, 1)                                                                \
        for (int64_t g = 0; g < G; g++) {                                                           \
            const float *wg = scores + g * width;                                                   \
            for (int64_t d0 = vectors * MLANES; d0 < D; d0++) {                                     \
                float acc = 0.0f;                                                                   \
                for (int64_t j = 0; j < n; j++)                                                     \
                    acc += wg[j] * LOAD(v[j * D + d0]);                                             \
                out[g * D + d0] = acc;                                                              \
            }                                                                                       \
        }                                                                                           \
        divide_rows(out, G, D, total);                                                              \
    }

ATTEND_ONE(attend_one_f32, float, LOAD_F32, mvec_load)
ATTEND_ONE(attend_one_bf16, uint16_t, LOAD_BF16, mvec_load_bf16)

/* attend_rows: what attend_one does for each of R query rows (q: [R padded to ROW_TILE, D]
   float32, zeros past R), where row r sees positions 0 .. n0 + r / G - 1 (rows token-major: G
   heads of a token, then the next token one position on). Every score and every output entry
   is the same arithmetic in the same order as attend_one's (a sum over d, then one over
   positions, for each position and row alike); only the loads are shared: ROW_TILE rows are
   scored against a vector of positions, and summed over a vector of values, per load. */
#define ROW_SCORES(T, MLOAD, BLOCKS)                                                               \
    for (; j < nmax && j + (BLOCKS) * MLANES <= room; j += (BLOCKS) * MLANES) {                  \
        mvec acc[ROW_TILE][BLOCKS];                                                                 \
        for (int r = 0; r < ROW_TILE; r++)                                                          \
            for (int b = 0; b < (BLOCKS); b++)                                                      \
                acc[r][b] = mvec_splat(0.0f);                                                       \
        for (int64_t d = 0; d < D; d++) {                                                           \
            const T *kd = k + d * stride + j;                                                       \
            mvec kb[BLOCKS];                                                                        \
            for (int b = 0; b < (BLOCKS); b++)                                                      \
                kb[b] = MLOAD(kd + b * MLANES);                                                     \
            for (int r = 0; r < ROW_TILE; r++) {                                                    \
                float qd = qt[r * D + d];                                                           \
                for (int b = 0; b < (BLOCKS); b++)                                                  \
                    acc[r][b] += qd * kb[b];                                                        \
            }                                                                                       \
        }                                                                                           \
        for (int r = 0; r < ROW_TILE; r++)                                                          \
            for (int b = 0; b < (BLOCKS); b++)                                                      \
                mvec_store(st + r * width + j + b * MLANES, acc[r][b] * scale);                     \
    }
/* A tile's output, VECTORS vectors of MLANES entries per row at a time: ROW_TILE x VECTORS sums
   side by side, each the weights times the values summed position by position in order. */
#define ROW_VALUES(T, MLOAD, VECTORS)                                                              \
    for (; d0 + (VECTORS) * MLANES <= D; d0 += (VECTORS) * MLANES) {                              \
        mvec acc[ROW_TILE][VECTORS];                                                                \
        for (int r = 0; r < ROW_TILE; r++)                                                          \
            for (int u = 0; u < (VECTORS); u++)                                                     \
                acc[r][u] = mvec_splat(0.0f);                                                       \
        int64_t j = 0;                                                                              \
        for (; j < first; j++) {                                                                    \
            mvec vj[VECTORS];                                                                       \
            for (int u = 0; u < (VECTORS); u++)                                                     \
                vj[u] = MLOAD(v + j * D + d0 + u * MLANES);                                         \
            for (int r = 0; r < ROW_TILE; r++)                                                      \
                for (int u = 0; u < (VECTORS); u++)                                                 \
                    acc[r][u] += w[r * width + j] * vj[u];                                          \
        }                                                                                           \
        for (; j < n0 + (r0 + rows - 1) / G; j++) {                                                 \
            mvec vj[VECTORS];                                                                       \
            for (int u = 0; u < (VECTORS); u++)                                                     \
                vj[u] = MLOAD(v + j * D + d0 + u * MLANES);                                         \
            for (int r = 0; r < rows; r++)                                                          \
                if (j < n0 + (r0 + r) / G)                                                          \
                    for (int u = 0; u < (VECTORS); u++)                                             \
                        acc[r][u] += w[r * width + j] * vj[u];                                      \
        }                                                                                           \
        for (int r = 0; r < rows; r++)                                                              \
            for (int u = 0; u < (VECTORS); u++)                                                     \
                mvec_store(out + (r0 + r) * D + d0 + u * MLANES, acc[r][u]);                        \
    }
#define ATTEND_ROWS(NAME, T, LOAD, MLOAD)                                                          \
    static void NAME(const float *q, int64_t R, int64_t G, int64_t D, const T *k, int64_t stride,   \
                     int64_t room, const T *v, int64_t n0, float scale, float *scores, float *out) { \
        float total[MAX_ROWS];                                                                      \
        int64_t last = n0 + (R - 1) / G;                                                            \
        int64_t width = (last + SCORE_BLOCK - 1) / SCORE_BLOCK * SCORE_BLOCK;                       \
        for (int64_t r0 = 0; r0 < R; r0 += ROW_TILE) {                                              \
            const float *qt = q + r0 * D;                                                           \
            float *st = scores + r0 * width;                                                        \
            int64_t nmax = n0 + (r0 + ROW_TILE - 1 < R ? r0 + ROW_TILE - 1 : R - 1) / G, j = 0;    \
            ROW_SCORES(T, MLOAD, ROW_BLOCKS)                                                        \
            ROW_SCORES(T, MLOAD, 1)                                                                 \
            for (; j < nmax; j++)                                                                   \
                for (int r = 0; r < ROW_TILE; r++) {                                                \
                    float acc = 0.0f;                                                               \
                    for (int64_t d = 0; d < D; d++)                                                 \
                        acc += qt[r * D + d] * LOAD(k[d * stride + j]);                             \
                    st[r * width + j] = acc * scale;                                                \
                }                                                                                   \
        }                                                                                           \
        for (int64_t r = 0; r < R; r++)                                                             \
            total[r] = exponentiate(scores + r * width, n0 + r / G);                                \
        for (int64_t r0 = 0; r0 < R; r0 += ROW_TILE) {                                              \
            int64_t rows = R - r0 < ROW_TILE ? R - r0 : ROW_TILE, first = n0 + r0 / G;              \
            const float *w = scores + r0 * width;                                                   \
            int64_t d0 = 0;                                                                         \
            ROW_VALUES(T, MLOAD, 2)                                                                 \
            ROW_VALUES(T, MLOAD, 1)                                                                 \
            for (; d0 < D; d0++)                                                                    \
                for (int r = 0; r < rows; r++) {                                                    \
                    float acc = 0.0f;                                                               \
                    int64_t n = n0 + (r0 + r) / G;                                                  \
                    for (int64_t j = 0; j < n; j++)                                                 \
                        acc += w[r * width + j] * LOAD(v[j * D + d0]);                              \
                    out[(r0 + r) * D + d0] = acc;                                                   \
                }                                                                                   \
        }                                                                                           \
        divide_rows(out, R, D, total);                                                              \
    }

ATTEND_ROWS(attend_rows_f32, float, LOAD_F32, mvec_load)
ATTEND_ROWS(attend_rows_bf16, uint16_t, LOAD_BF16, mvec_load_bf16)

/* Tokens t0 <= t < t1. q, out: [N, H, D]; keys [slots, Hkv, D, max_len] in rows of key_stride
   >= max_len entries (rollout/core/kv_cache.py pads them: rows 4 KiB apart would all fall in the same
   cache set), values [slots, Hkv, max_len, D]; window 0: none.
   bf16 != 0: q, caches and out hold bfloat16 (uint16), else float32. Returns 0, -1 when scratch
   memory could not be had, -2 for more than MAX_GROUP query heads per key/value head. */
int attend_tokens(int64_t t0, int64_t t1, int64_t H, int64_t Hkv, int64_t D, int64_t max_len, int64_t key_stride,
                  int bf16,
                  const void *q, const void *kc, const void *vc, const int64_t *slots, const int64_t *positions,
                  int64_t window, float scale, void *out) {
    int64_t G = H / Hkv;
    if (G > MAX_GROUP)
        return -2;
    float *scratch = malloc(sizeof(float) * (size_t)(MAX_ROWS * (max_len + SCORE_BLOCK) + 2 * MAX_ROWS * D));
    if (scratch == NULL)
        return -1;
    float *scores = scratch, *qf = scores + MAX_ROWS * (max_len + SCORE_BLOCK), *of = qf + MAX_ROWS * D;
    for (int64_t t = t0; t < t1;) {
        int64_t p = positions[t], lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0, n = p - lo + 1;
        int64_t m = 1;  /* this token and the next ones of its request, at the next positions, seeing from 0 */
        while (lo == 0 && t + m < t1 && (m + 1) * G <= MAX_ROWS && slots[t + m] == slots[t]
               && positions[t + m] == p + m && !(window > 0 && p + m - window + 1 > 0))
            m++;
        for (int64_t h = 0; h < Hkv; h++) {
            int64_t keys = (slots[t] * Hkv + h) * D * key_stride + lo;
            int64_t values = ((slots[t] * Hkv + h) * max_len + lo) * D;
            int64_t qat = (t * H + h * G) * D;
            if (m > 1) {
                int64_t R = m * G, padded = (R + ROW_TILE - 1) / ROW_TILE * ROW_TILE;
                for (int64_t i = 0; i < m; i++) {
                    int64_t at = ((t + i) * H + h * G) * D;
                    for (int64_t x = 0; x < G * D; x++)
                        qf[i * G * D + x] = bf16 ? from_bf16(((const uint16_t *)q)[at + x]) : ((const float *)q)[at + x];
                }
                memset(qf + R * D, 0, sizeof(float) * (size_t)((padded - R) * D));
                if (bf16)
                    attend_rows_bf16(qf, R, G, D, (const uint16_t *)kc + keys, key_stride, max_len - lo,
                                     (const uint16_t *)vc + values, n, scale, scores, of);
                else
                    attend_rows_f32(qf, R, G, D, (const float *)kc + keys, key_stride, max_len - lo,
                                    (const float *)vc + values, n, scale, scores, of);
                for (int64_t i = 0; i < m; i++) {
                    int64_t at = ((t + i) * H + h * G) * D;
                    for (int64_t x = 0; x < G * D; x++)
                        if (bf16)
                            ((uint16_t *)out)[at + x] = to_bf16(of[i * G * D + x]);
                        else
                            ((float *)out)[at + x] = of[i * G * D + x];
                }
            } else if (bf16) {
                const uint16_t *q16 = (const uint16_t *)q + qat;
                for (int64_t i = 0; i < G * D; i++)
                    qf[i] = from_bf16(q16[i]);
                attend_one_bf16(qf, G, D, (const uint16_t *)kc + keys, key_stride, max_len - lo,
                                (const uint16_t *)vc + values, n, scale, scores, of);
                uint16_t *o16 = (uint16_t *)out + qat;
                for (int64_t i = 0; i < G * D; i++)
                    o16[i] = to_bf16(of[i]);
            } else {
                attend_one_f32((const float *)q + qat, G, D, (const float *)kc + keys, key_stride, max_len - lo,
                               (const float *)vc + values, n, scale, scores, (float *)out + qat);
            }
        }
        t += m;
    }
    free(scratch);
    return 0;
}

/* Keys of N new tokens (k: [N, Hkv, D], of the cache's type: 4-byte float or 2-byte bfloat16)
   into a transposed key cache [slots, Hkv, D, rows of key_stride] at (slots[t], positions[t]):
   torch's indexed write into that layout costs several times this loop. */
void write_keys(int64_t N, int64_t Hkv, int64_t D, int64_t key_stride, int64_t elem, const void *k, void *kc,
                const int64_t *slots, const int64_t *positions) {
    for (int64_t t = 0; t < N; t++)
        for (int64_t h = 0; h < Hkv; h++) {
            int64_t from = (t * Hkv + h) * D, to = (slots[t] * Hkv + h) * D * key_stride + positions[t];
            if (elem == 4)
                for (int64_t d = 0; d < D; d++)
                    ((float *)kc)[to + d * key_stride] = ((const float *)k)[from + d];
            else
                for (int64_t d = 0; d < D; d++)
                    ((uint16_t *)kc)[to + d * key_stride] = ((const uint16_t *)k)[from + d];
        }
}

/* vc[slots[t], h, positions[t], :] = v[t, h, :] for a value cache [slots, Hkv, max_len, D]
   (contiguous) of `elem`-byte entries. */
void write_values(int64_t N, int64_t Hkv, int64_t D, int64_t max_len, int64_t elem, const void *v, void *vc,
                  const int64_t *slots, const int64_t *positions) {
    int64_t row = D * elem;
    for (int64_t t = 0; t < N; t++)
        for (int64_t h = 0; h < Hkv; h++)
            memcpy((char *)vc + ((slots[t] * Hkv + h) * max_len + positions[t]) * row,
                   (const char *)v + (t * Hkv + h) * row, (size_t)row);
}
