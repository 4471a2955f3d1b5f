/* Arithmetic shared by the C kernels (rollout/attention_kernel.c, rollout/pointwise_kernel.c,
   drafter/head_kernel.c); rollout/c_kernels.py rebuilds a kernel when a header it includes
   changes. */
#ifndef SPECTAIL_KERNEL_MATH_H
#define SPECTAIL_KERNEL_MATH_H

#include <stdint.h>
#include <string.h>

#define LANES 16 /* floats per vector: one AVX-512 register, two AVX2 ones */

/* LANES floats (GCC / Clang vector extensions: the compiler picks the instructions the CPU has);
   loads and stores go through memcpy, which compiles to one unaligned move. */
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));

static inline vec vec_load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vec_store(float *p, vec v) {
    memcpy(p, &v, sizeof v);
}

/* e^x for x <= 0 (scores less their maximum): 2^k e^r with |r| <= ln2 / 2, a degree-6
   polynomial for e^r; under -87 it is 0 where float's exponent runs out. */
static inline float exp_nonpositive(float x) {
    float y = x < -87.0f ? -87.0f : x;
    float t = y * 1.44269504f + 12582912.0f;  /* adding 1.5 * 2^23 rounds to an integer */
    float k = t - 12582912.0f;
    float r = y - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t e = (int32_t)k + 127;
    uint32_t bits = (uint32_t)e << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.0f ? 0.0f : p * scale;
}

#endif
