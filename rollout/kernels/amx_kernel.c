/* Exact bfloat16 linear layers on AMX tiles (rollout/kernels/amx_linear.py): out = x w^T + bias.

   Every output is its float32 sum of products taken down k in blocks of 32 (one tile
   instruction each), always in the same order from zero, then the bias added in float32 and the
   sum rounded once to bfloat16 (to nearest, ties to even). TDPBF16PS computes each element of its
   result from that element's row of A and column of B alone, so a row gets the same bits whatever
   rows share the call, whatever its position and however the columns are split between threads:
   unlike oneDNN on AMX, which picks its blocking, and on several threads whether to split the
   sum, by the call's row count (docs/dtypes.md).

   The weight is packed once in the B tile's layout: K padded with zeros to a multiple of 32 and N
   to a multiple of 16, [N/16 panels][K/2 pairs][16 columns][2]. x's rows are read in place (the
   caller pads K); the last rows of a call run with a tile configuration of fewer rows. */
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>

#define PANEL 16  /* output columns per tile */
#define KBLOCK 32 /* k per tile instruction: 64 bytes of bfloat16 per tile row */
#define TILE_ROWS 16

void pack_weight(int64_t n, int64_t k, int64_t k_padded, const uint16_t *w, uint16_t *packed) {
    int64_t panels = (n + PANEL - 1) / PANEL, pairs = k_padded / 2;
    memset(packed, 0, sizeof(uint16_t) * panels * pairs * PANEL * 2);
    for (int64_t j = 0; j < n; j++)
        for (int64_t i = 0; i < k; i++)
            packed[((j / PANEL) * pairs + i / 2) * PANEL * 2 + (j % PANEL) * 2 + i % 2] = w[j * k + i];
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands a process AMX's tile state only once it asks (arch/x86/kernel/fpu/xstate.c); the
   permission covers every thread of the process. 1: tiles usable. */
int amx_ready(void) {
    unsigned long features = 0;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &features) != 0) return 0;
    return (int)((features >> XFEATURE_XTILEDATA) & 1);
}

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

/* Tiles 0-3: sums for (row block 0 or 1) x (panel 0 or 1); 4-5: x's two row blocks; 6-7: the
   weight's two panels. `rows` rows per row block (16, or fewer for a call's last rows). */
static void configure(int rows) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = t >= 6 ? KBLOCK / 2 : (uint8_t)rows;
    }
    _tile_loadconfig(&cfg);
}

/* The sums of a tile (rows x 16 floats) plus bias, rounded to bfloat16 (to nearest, ties to even:
   VCVTNEPS2BF16) into out's columns [col, col + 16). */
static void finish(float sums[TILE_ROWS][PANEL], int rows, const float *bias, uint16_t *out, int64_t n,
                   int64_t col) {
    int64_t valid = n - col < PANEL ? n - col : PANEL;
    __mmask16 mask = (__mmask16)((1u << valid) - 1u);
    __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        __m512 y = _mm512_loadu_ps(sums[r]);
        if (bias) y = _mm512_add_ps(y, b);
        _mm256_mask_storeu_epi16(out + r * n + col, mask, (__m256i)_mm512_cvtneps_pbh(y));
    }
}

/* One or two row blocks (x at `x`, rows apart by k_padded) by one or two panels (from panel p). */
static void block(int two_rows, int two_panels, int rows, int64_t k_padded, const uint16_t *x, const uint16_t *w,
                  int64_t p, const float *bias, uint16_t *out, int64_t n) {
    const int64_t stride = k_padded * 2, panel = (k_padded / 2) * PANEL * 2;
    const uint16_t *w0 = w + p * panel, *w1 = w0 + panel, *x1 = x + TILE_ROWS * k_padded;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t i = 0; i < k_padded / KBLOCK; i++) {
        _tile_loadd(4, x + i * KBLOCK, stride);
        _tile_loadd(6, w0 + i * KBLOCK * PANEL, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two_panels) {
            _tile_loadd(7, w1 + i * KBLOCK * PANEL, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (two_rows) {
            _tile_loadd(5, x1 + i * KBLOCK, stride);
            _tile_dpbf16ps(2, 5, 6);
            if (two_panels) _tile_dpbf16ps(3, 5, 7);
        }
    }
    float sums[TILE_ROWS][PANEL];
    int64_t col = p * PANEL;
    _tile_stored(0, sums, 64);
    finish(sums, rows, bias, out, n, col);
    if (two_panels) {
        _tile_stored(1, sums, 64);
        finish(sums, rows, bias, out, n, col + PANEL);
    }
    if (two_rows) {
        _tile_stored(2, sums, 64);
        finish(sums, rows, bias, out + TILE_ROWS * n, n, col);
        if (two_panels) {
            _tile_stored(3, sums, 64);
            finish(sums, rows, bias, out + TILE_ROWS * n, n, col + PANEL);
        }
    }
}

/* Rows per pass over the weight's panels: a pass's rows of x stay in the L2 cache while each
   pair of panels meets them (a multiple of two row blocks; at least one pair). */
static int64_t chunk_rows(int64_t k_padded) {
    int64_t rows = (256 * 1024 / (k_padded * 2)) / (2 * TILE_ROWS) * (2 * TILE_ROWS);
    return rows > 2 * TILE_ROWS ? rows : 2 * TILE_ROWS;
}

/* Panels [p0, p1) of out [m, n] (bfloat16) = x [m, k_padded] times the packed weight, plus bias
   [n] float32 (or NULL). Full row blocks go in pairs where they can, then the last rows. */
void linear_panels(int64_t p0, int64_t p1, int64_t m, int64_t k_padded, int64_t n, const uint16_t *x,
                   const uint16_t *packed, const float *bias, uint16_t *out) {
    int64_t full = m / TILE_ROWS * TILE_ROWS, chunk = chunk_rows(k_padded);
    configure(TILE_ROWS);
    for (int64_t r0 = 0; r0 < full; r0 += chunk) {
        int64_t r1 = r0 + chunk < full ? r0 + chunk : full;
        for (int64_t p = p0; p < p1; p += 2) {
            int two_panels = p + 1 < p1;
            int64_t r = r0;
            for (; r + 2 * TILE_ROWS <= r1; r += 2 * TILE_ROWS)
                block(1, two_panels, TILE_ROWS, k_padded, x + r * k_padded, packed, p, bias, out + r * n, n);
            if (r < r1) block(0, two_panels, TILE_ROWS, k_padded, x + r * k_padded, packed, p, bias, out + r * n, n);
        }
    }
    if (full < m) {
        configure((int)(m - full));
        for (int64_t p = p0; p < p1; p += 2)
            block(0, p + 1 < p1, (int)(m - full), k_padded, x + full * k_padded, packed, p, bias, out + full * n, n);
    }
    _tile_release();
}

#else

int amx_ready(void) { return 0; }

void linear_panels(int64_t p0, int64_t p1, int64_t m, int64_t k_padded, int64_t n, const uint16_t *x,
                   const uint16_t *packed, const float *bias, uint16_t *out) {
    (void)p0, (void)p1, (void)m, (void)k_padded, (void)n, (void)x, (void)packed, (void)bias, (void)out;
}

#endif
