/* A decoder layer's row-wise operations on the CPU (rollout/pointwise_kernel.py), one pass over
   the rows each where torch takes several passes and temporary tensors.

   rotate_rows: the half-split rotary embedding of the Hugging Face checkpoints, out = x * cos +
   rotate_half(x) * sin with rotate_half(x) = cat(-x[half:], x[:half]), each product rounded
   before the sum (-ffp-contract=off, as rollout/c_kernels.py builds every kernel): the torch
   expression's bits.

   rms_norm_rows: w * (x * 1 / sqrt(mean(x^2) + eps)) per row, the mean's sum kept in LANES
   partial sums added in a fixed tree, so a row's result depends on that row alone. */
#include <math.h>
#include <stdint.h>

#include "kernel_math.h"

/* x, out: [n, heads, D] float32; cos, sin: [n, D] (one row per token, shared by its heads). */
void rotate_rows(int64_t n, int64_t heads, int64_t D, const float *x, const float *cos, const float *sin,
                 float *out) {
    int64_t half = D / 2;
    for (int64_t t = 0; t < n; t++) {
        const float *c = cos + t * D, *s = sin + t * D;
        for (int64_t h = 0; h < heads; h++) {
            const float *xr = x + (t * heads + h) * D;
            float *o = out + (t * heads + h) * D;
            for (int64_t i = 0; i < half; i++)
                o[i] = xr[i] * c[i] + (-xr[i + half]) * s[i];
            for (int64_t i = half; i < D; i++)
                o[i] = xr[i] * c[i] + xr[i - half] * s[i];
        }
    }
}

/* x, out: [n, D] float32; w: [D]. */
void rms_norm_rows(int64_t n, int64_t D, const float *x, const float *w, float eps, float *out) {
    for (int64_t r = 0; r < n; r++) {
        const float *xr = x + r * D;
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
        float inv = 1.0f / sqrtf(part[0] / (float)D + eps);
        float *o = out + r * D;
        for (i = 0; i < D; i++)
            o[i] = w[i] * (xr[i] * inv);
    }
}
