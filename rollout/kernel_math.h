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

/* The machine's own vector (MLANES floats: one register) for arithmetic that is the same in
   every lane, where the vector's width changes no bits: a 16-float vec takes two AVX2 registers,
   and loops that keep several of them in flight spill to the stack there. LANES stays the width
   of every sum across lanes (a fixed tree), so results are the same on both. */
#ifndef MLANES /* (a test builds both widths on one machine) */
#if defined(__AVX512F__)
#define MLANES 16
#else
#define MLANES 8
#endif
#endif
typedef float mvec __attribute__((vector_size(MLANES * sizeof(float))));
typedef int32_t mivec __attribute__((vector_size(MLANES * sizeof(int32_t))));

static inline mvec mvec_load(const float *p) {
    mvec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void mvec_store(float *p, mvec v) {
    memcpy(p, &v, sizeof v);
}

static inline mvec mvec_splat(float x) {
    return (mvec){0} + x;
}

/* Where mask (all ones or zero per lane), a, else b. */
static inline mvec mvec_select(mivec mask, mvec a, mvec b) {
    return (mvec)(((mivec)a & mask) | ((mivec)b & ~mask));
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

/* exp_nonpositive in every lane: the same operations in the same order. */
static inline mvec mvec_exp_nonpositive(mvec x) {
    mivec under = x < mvec_splat(-87.0f);
    mvec y = mvec_select(under, mvec_splat(-87.0f), x);
    mvec t = y * 1.44269504f + 12582912.0f;
    mvec k = t - 12582912.0f;
    mvec r = y - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    mvec p = mvec_splat(1.0f / 720.0f);
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    mivec bits = (__builtin_convertvector(k, mivec) + 127) << 23;
    return mvec_select(under, mvec_splat(0.0f), p * (mvec)bits);
}

#endif
