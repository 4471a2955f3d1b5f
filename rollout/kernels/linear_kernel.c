/* Small float32 linear layers on the CPU (rollout/kernels/linear_kernel.py): out = x w^T + bias.

   Every output is one fused multiply-add chain down k = 0..K-1 from zero, then the bias added
   once, whatever the row count, the row's position or the tile it falls in: a row's bits never
   depend on what shares the call (MKL's sgemm takes other kernels for one to three rows).

   The weight is packed once into panels of PANEL output columns, [panels][K][PANEL], zero past
   N, so a tile reads PANEL consecutive floats per k. A tile is up to ROWS rows by up to PANELS
   panels of accumulators; the panels of one group stay in the L1 cache while every row block
   streams past them. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PANEL 16
#define ROWS 4
#define PANELS 4

void pack_weight(int64_t n, int64_t k, const float *w, float *packed) {
    int64_t panels = (n + PANEL - 1) / PANEL;
    memset(packed, 0, sizeof(float) * panels * k * PANEL);
    for (int64_t j = 0; j < n; j++)
        for (int64_t i = 0; i < k; i++)
            packed[((j / PANEL) * k + i) * PANEL + j % PANEL] = w[j * k + i];
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define GROUP PANELS /* panels a tile takes at once */

int linear_vectorized(void) { return 1; }

/* rows x panels accumulators (compile-time counts once inlined), columns [col, col + PANEL *
   panels) of which `last` are valid in the last panel. */
static inline __attribute__((always_inline)) void tile(int rows, int panels, int64_t k, const float *x,
                                                       const float *w, int64_t panel_stride,
                                                       const float *bias, float *out, int64_t n,
                                                       int64_t col, __mmask16 last) {
    __m512 acc[ROWS][PANELS];
    for (int r = 0; r < rows; r++)
        for (int p = 0; p < panels; p++) acc[r][p] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        __m512 wv[PANELS];
        for (int p = 0; p < panels; p++) wv[p] = _mm512_loadu_ps(w + p * panel_stride + i * PANEL);
        for (int r = 0; r < rows; r++) {
            __m512 xv = _mm512_set1_ps(x[r * k + i]);
            for (int p = 0; p < panels; p++) acc[r][p] = _mm512_fmadd_ps(xv, wv[p], acc[r][p]);
        }
    }
    for (int p = 0; p < panels; p++) {
        __mmask16 mask = p == panels - 1 ? last : (__mmask16)0xFFFF;
        __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col + p * PANEL) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            __m512 y = bias ? _mm512_add_ps(acc[r][p], b) : acc[r][p];
            _mm512_mask_storeu_ps(out + r * n + col + p * PANEL, mask, y);
        }
    }
}

#define TILE_CASE(R, P) \
    case (R - 1) * PANELS + P - 1: tile(R, P, k, x, w, panel_stride, bias, out, n, col, last); break;
#define TILE_ROW(R) TILE_CASE(R, 1) TILE_CASE(R, 2) TILE_CASE(R, 3) TILE_CASE(R, 4)

static void any_tile(int rows, int panels, int64_t k, const float *x, const float *w, int64_t panel_stride,
                     const float *bias, float *out, int64_t n, int64_t col, __mmask16 last) {
    switch ((rows - 1) * PANELS + panels - 1) {
        TILE_ROW(1) TILE_ROW(2) TILE_ROW(3) TILE_ROW(4)
    }
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define GROUP 1 /* one panel's weights stay in the L1 cache while every row block passes */

int linear_vectorized(void) { return 1; }

/* A panel is two AVX2 vectors; a tile of up to ROWS rows by one panel keeps its sums in 8 of the
   16 registers (two panels would not fit: a group is one panel). The sums are named variables
   (GCC stored an array of them to the stack at every step). Each output is the same chain of
   fused multiply-adds as in the AVX-512 tile. */
#define ROW_FMA(R)                                                                                 \
    if ((R) < rows) {                                                                              \
        __m256 xv = _mm256_broadcast_ss(x + (R) * k + i);                                          \
        a##R##0 = _mm256_fmadd_ps(xv, w0, a##R##0);                                                \
        a##R##1 = _mm256_fmadd_ps(xv, w1, a##R##1);                                                \
    }
#define ROW_OUT(R)                                                                                 \
    if ((R) < rows) {                                                                              \
        float y[PANEL];                                                                            \
        _mm256_storeu_ps(y, a##R##0);                                                              \
        _mm256_storeu_ps(y + 8, a##R##1);                                                          \
        for (unsigned j = 0; j < valid; j++)                                                       \
            out[(R) * n + col + j] = bias ? y[j] + bias[col + j] : y[j];                           \
    }
#define PANEL_TILE(ROWS_T)                                                                         \
    static void panel_tile_##ROWS_T(int64_t k, const float *x, const float *w, const float *bias,  \
                                    float *out, int64_t n, int64_t col, unsigned valid) {          \
        const int rows = ROWS_T;                                                                   \
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,  \
               a30 = a00, a31 = a00;                                                               \
        for (int64_t i = 0; i < k; i++) {                                                          \
            __m256 w0 = _mm256_loadu_ps(w + i * PANEL), w1 = _mm256_loadu_ps(w + i * PANEL + 8);  \
            ROW_FMA(0) ROW_FMA(1) ROW_FMA(2) ROW_FMA(3)                                            \
        }                                                                                          \
        ROW_OUT(0) ROW_OUT(1) ROW_OUT(2) ROW_OUT(3)                                                \
    }
PANEL_TILE(1)
PANEL_TILE(2)
PANEL_TILE(3)
PANEL_TILE(4)

static void any_tile(int rows, int panels, int64_t k, const float *x, const float *w, int64_t panel_stride,
                     const float *bias, float *out, int64_t n, int64_t col, unsigned last) {
    for (int p = 0; p < panels; p++) {
        unsigned valid = p == panels - 1 ? (unsigned)__builtin_popcount(last) : PANEL;
        const float *wp = w + p * panel_stride;
        int64_t c = col + p * PANEL;
        switch (rows) {
            case 1: panel_tile_1(k, x, wp, bias, out, n, c, valid); break;
            case 2: panel_tile_2(k, x, wp, bias, out, n, c, valid); break;
            case 3: panel_tile_3(k, x, wp, bias, out, n, c, valid); break;
            default: panel_tile_4(k, x, wp, bias, out, n, c, valid); break;
        }
    }
}

#else
#define GROUP PANELS

int linear_vectorized(void) { return 0; }

/* The same chains one output at a time (fmaf rounds once, as the vector FMA does). */
static void any_tile(int rows, int panels, int64_t k, const float *x, const float *w, int64_t panel_stride,
                     const float *bias, float *out, int64_t n, int64_t col, unsigned last) {
    for (int r = 0; r < rows; r++)
        for (int p = 0; p < panels; p++)
            for (int j = 0; j < PANEL; j++) {
                if (p == panels - 1 && !(last >> j & 1u)) continue;
                float acc = 0.0f;
                for (int64_t i = 0; i < k; i++) acc = fmaf(x[r * k + i], w[p * panel_stride + i * PANEL + j], acc);
                int64_t c = col + p * PANEL + j;
                out[r * n + c] = bias ? acc + bias[c] : acc;
            }
}
#endif

/* Rows [r0, r1) of out [M, n] = x [M, k] times the packed weight, plus bias [n] (or NULL). */
void linear_rows(int64_t r0, int64_t r1, int64_t k, int64_t n, const float *x, const float *packed,
                 const float *bias, float *out) {
    int64_t panels = (n + PANEL - 1) / PANEL, panel_stride = k * PANEL;
    for (int64_t p0 = 0; p0 < panels; p0 += GROUP) {
        int group = (int)(panels - p0 < GROUP ? panels - p0 : GROUP);
        int64_t col = p0 * PANEL, valid = n - (p0 + group - 1) * PANEL;
        unsigned last = valid >= PANEL ? 0xFFFFu : (1u << valid) - 1u;
        for (int64_t r = r0; r < r1; r += ROWS) {
            int rows = (int)(r1 - r < ROWS ? r1 - r : ROWS);
            any_tile(rows, group, k, x + r * k, packed + p0 * panel_stride, panel_stride, bias, out + r * n, n,
                     col, last);
        }
    }
}
