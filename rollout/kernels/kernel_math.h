/* Arithmetic shared by the C kernels (rollout/kernels/attention_kernel.c, rollout/kernels/pointwise_kernel.c,
   drafter/head_kernel.c); rollout/kernels/c_kernels.py rebuilds a kernel when a header it includes
   changes. */
#ifndef SPECTAIL_KERNEL_MATH_H
#define SPECTAIL_KERNEL_MATH_H

#include <stdint.h>
#include <string.h>

#define LANES 16 /* partial sums of every sum across lanes, whatever the machine's vector */

static inline float from_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float f) {  /* round to nearest even */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* The machine's own vector (MLANES floats: one register; GCC / Clang vector extensions, loads and
   stores through memcpy, one unaligned move) for arithmetic that is the same in every lane, where
   the vector's width changes no bits (16-float vectors take two AVX2 registers, and loops that
   keep several in flight spill to the stack there). LANES stays the width of every sum across
   lanes (partial sums in a fixed tree or order), so results are the same on both. */
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

/* e^x in every lane, for x <= 0 (scores less their maximum): 2^k e^r with |r| <= ln2 / 2, a
   degree-6 polynomial for e^r; under -87 it is 0 where float's exponent runs out. */
static inline mvec mvec_exp_nonpositive(mvec x) {
    mivec under = x < mvec_splat(-87.0f);
    mvec y = mvec_select(under, mvec_splat(-87.0f), x);
    mvec t = y * 1.44269504f + 12582912.0f; /* adding 1.5 * 2^23 rounds to an integer */
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

/* The same for one value (the tails of the vector loops): its lane's arithmetic. */
static inline float exp_nonpositive(float x) {
    return mvec_exp_nonpositive(mvec_splat(x))[0];
}

#endif
