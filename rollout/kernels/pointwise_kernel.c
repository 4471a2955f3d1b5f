/* A decoder layer's row-wise operations on the CPU (rollout/kernels/pointwise_kernel.py), one pass over
   the rows each where torch takes several passes and temporary tensors.

   rotate_rows: the half-split rotary embedding of the Hugging Face checkpoints, out = x * cos +
   rotate_half(x) * sin with rotate_half(x) = cat(-x[half:], x[:half]), each product rounded
   before the sum (-ffp-contract=off, as rollout/kernels/c_kernels.py builds every kernel): the torch
   expression's bits.

   rms_norm_rows: w * (x * 1 / sqrt(mean(x^2) + eps)) per row, the mean's sum kept in LANES
   partial sums added in a fixed tree, so a row's result depends on that row alone.

   The _bf16 versions take and give bfloat16 and compute on widened values, rounding where torch
   rounds: each operation of the rotation (the expression's bits), and RMSNorm's normalised row
   before the weight multiplies it (transformers' order; the sum in float32 as above). */
#include <math.h>
#include <stdint.h>

#include "kernel_math.h"

/* x, out: [n, heads, D] of T; cos, sin: [n, D] (one row per token, shared by its heads). WIDE
   widens a T to float, ROUND rounds a float as T does (nothing for float), NARROW stores one. */
#define ROTATE_ROWS(NAME, T, WIDE, ROUND, NARROW)                                                  \
    void NAME(int64_t n, int64_t heads, int64_t D, const T *x, const T *cos, const T *sin, T *out) { \
        int64_t half = D / 2;                                                                      \
        for (int64_t t = 0; t < n; t++) {                                                          \
            const T *c = cos + t * D, *s = sin + t * D;                                            \
            for (int64_t h = 0; h < heads; h++) {                                                  \
                const T *xr = x + (t * heads + h) * D;                                             \
                T *o = out + (t * heads + h) * D;                                                  \
                for (int64_t i = 0; i < half; i++)                                                 \
                    o[i] = NARROW(ROUND(WIDE(xr[i]) * WIDE(c[i])) + ROUND(-WIDE(xr[i + half]) * WIDE(s[i]))); \
                for (int64_t i = half; i < D; i++)                                                 \
                    o[i] = NARROW(ROUND(WIDE(xr[i]) * WIDE(c[i])) + ROUND(WIDE(xr[i - half]) * WIDE(s[i]))); \
            }                                                                                      \
        }                                                                                          \
    }
#define AS_IS(v) (v)
#define ROUND_BF16(v) from_bf16(to_bf16(v))
ROTATE_ROWS(rotate_rows, float, AS_IS, AS_IS, AS_IS)
ROTATE_ROWS(rotate_rows_bf16, uint16_t, from_bf16, ROUND_BF16, to_bf16)

/* 1 / sqrt(mean(x^2) + eps) of a row of D widened values. */
static float inverse_rms(const float *xr, int64_t D, float eps) {
    float part[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= D; i += LANES)
        for (int l = 0; l < LANES; l++)
            part[l] += xr[i + l] * xr[i + l];
    for (; i < D; i++)
        part[0] += xr[i] * xr[i];
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++)
            part[l] += part[l + width];
    return 1.0f / sqrtf(part[0] / (float)D + eps);
}

/* x, out: [n, D] float32; w: [D]. */
void rms_norm_rows(int64_t n, int64_t D, const float *x, const float *w, float eps, float *out) {
    for (int64_t r = 0; r < n; r++) {
        const float *xr = x + r * D;
        float inv = inverse_rms(xr, D, eps), *o = out + r * D;
        for (int64_t i = 0; i < D; i++)
            o[i] = w[i] * (xr[i] * inv);
    }
}

/* x, out: [n, D] bfloat16; w: [D] bfloat16; wide: D floats of scratch. */
void rms_norm_rows_bf16(int64_t n, int64_t D, const uint16_t *x, const uint16_t *w, float eps, uint16_t *out,
                        float *wide) {
    for (int64_t r = 0; r < n; r++) {
        const uint16_t *xr = x + r * D;
        for (int64_t i = 0; i < D; i++)
            wide[i] = from_bf16(xr[i]);
        float inv = inverse_rms(wide, D, eps);
        uint16_t *o = out + r * D;
        for (int64_t i = 0; i < D; i++)
            o[i] = to_bf16(from_bf16(w[i]) * from_bf16(to_bf16(wide[i] * inv)));
    }
}
