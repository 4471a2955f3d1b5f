/* The coupled Gumbel noise of rollout/core/sampling.py, fused into one pass per row for the CPU.

   rollout/kernels/noise_kernel.py compiles this file on first use (-O3 -march=native -ffp-contract=off)
   and calls it through ctypes. It must give bit for bit what sampling.py's torch reference
   gives on any device, so it uses only what IEEE 754 rounds exactly one way: 32-bit integer
   arithmetic, +, -, *, / and conversions. The logarithms are written out below for that reason
   (a libm or SLEEF log may round its last bit differently from the device's), and contraction
   into fused multiply-adds is off, since the reference rounds every product apart.

   Per element of row r and token v (the reference spells out each step):
     a, b = row_keys(seed[r], position[r])  the 64-bit row state
     x  = hash32(a, b, hv[v])              the 32-bit counter-based hash
     u  = x * 2^-32 + 2^-33                in (0, 1), exact in double
     E  = (float)(-log(u))                 ~ Exp(1); log in double keeps E's digits near u = 1
     le = log(E)                           float; the noise is G = -le
*/
#include <stdint.h>
#include <string.h>

#define LANES 16

static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    return x ^ (x >> 16);
}

/* The 64-bit row state (a, b) of a seed and a position: sampling._row_keys. */
static inline void row_keys(int64_t seed, int64_t position, uint32_t *a, uint32_t *b) {
    uint64_t s = (uint64_t)seed, p = (uint64_t)position;
    uint32_t x = mix32((uint32_t)s ^ 0x243F6A88u);
    uint32_t y = mix32((uint32_t)(s >> 32) ^ 0x85A308D3u);
    x = mix32(x ^ y);
    y = mix32(y ^ x);
    x = mix32(x ^ (uint32_t)p);
    y = mix32(y ^ (uint32_t)(p >> 32) ^ x);
    *a = mix32(x ^ y);
    *b = y;
}

/* mix32 of the token's key with the row state entering between its halves. */
static inline uint32_t hash32(uint32_t a, uint32_t b, uint32_t h) {
    uint32_t x = a ^ h;
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= b;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    return x;
}

/* log(x) for positive, normal x: x = 2^e m with m in [sqrt(1/2), sqrt(2)), s = (m-1)/(m+1),
   log m = 2 atanh(s) = 2 s (1 + s^2/3 + s^4/5 + ...): s^2 < 0.0295, so ten terms reach
   double precision. ln 2 is split so that e * LN2_HI is exact. */
static inline double log_f64(double x) {
    uint64_t bits;
    memcpy(&bits, &x, sizeof bits);
    int64_t e = (int64_t)(bits >> 52) - 1023;
    bits = (bits & 0x000FFFFFFFFFFFFFull) | 0x3FF0000000000000ull;
    double m;
    memcpy(&m, &bits, sizeof m);
    if (m > 0x1.6a09e667f3bcdp+0) {
        m = m * 0.5;
        e = e + 1;
    }
    double f = m - 1.0;
    double s = f / (f + 2.0);
    double s2 = s * s;
    double p = 1.0 / 21.0;
    p = p * s2 + 1.0 / 19.0;
    p = p * s2 + 1.0 / 17.0;
    p = p * s2 + 1.0 / 15.0;
    p = p * s2 + 1.0 / 13.0;
    p = p * s2 + 1.0 / 11.0;
    p = p * s2 + 1.0 / 9.0;
    p = p * s2 + 1.0 / 7.0;
    p = p * s2 + 1.0 / 5.0;
    p = p * s2 + 1.0 / 3.0;
    p = p * s2 + 1.0;
    double t = s * p;
    double ed = (double)e;
    return ed * 0x1.62e42feep-1 + ((t + t) + ed * 0x1.a39ef35793c76p-33);
}

/* The same in float: s^2 < 0.0295, so six terms reach float precision. */
static inline float log_f32(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    int32_t e = (int32_t)(bits >> 23) - 127;
    bits = (bits & 0x007FFFFFu) | 0x3F800000u;
    float m;
    memcpy(&m, &bits, sizeof m);
    if (m > 0x1.6a09e6p+0f) {
        m = m * 0.5f;
        e = e + 1;
    }
    float f = m - 1.0f;
    float s = f / (f + 2.0f);
    float s2 = s * s;
    float p = 1.0f / 11.0f;
    p = p * s2 + 1.0f / 9.0f;
    p = p * s2 + 1.0f / 7.0f;
    p = p * s2 + 1.0f / 5.0f;
    p = p * s2 + 1.0f / 3.0f;
    p = p * s2 + 1.0f;
    float t = s * p;
    float ef = (float)e;
    return ef * 0x1.62e3p-1f + ((t + t) + ef * 0x1.2fefa2p-17f);
}

static inline float log_exponential(uint32_t a, uint32_t b, uint32_t h) {
    double u = (double)hash32(a, b, h) * 0x1p-32 + 0x1p-33;
    float e = (float)(-log_f64(u));
    return log_f32(e);
}

/* out[r, v] = G = -log(E) for seeds[r] and positions[r], rows r0 <= r < r1 of a [rows, V] float array. */
void gumbel_rows(int64_t r0, int64_t r1, int64_t V, const int64_t *seeds, const int64_t *positions,
                 const uint32_t *hv, float *out) {
    for (int64_t r = r0; r < r1; r++) {
        float *o = out + r * V;
        uint32_t ar, br;
        row_keys(seeds[r], positions[r], &ar, &br);
        for (int64_t v = 0; v < V; v++)
            o[v] = -log_exponential(ar, br, hv[v]);
    }
}

/* tokens[r] = argmax over v of z[r, v] - log(E) (= z + G), the first index on ties and the
   first NaN if there is one, as torch.argmax; rows r0 <= r < r1. Each of LANES lanes keeps its
   own best (strictly greater, so its first), then the lanes are merged.
   margins (NULL: not wanted): margins[r] = that maximum less the largest of the row's other
   entries (a tie: 0; one entry: inf; a NaN: NaN), what the draft head reads as its confidence.
   Each lane also keeps the largest of its entries but its best; the other lanes' bests and the
   tail complete it. */
static inline __attribute__((always_inline)) void argmax_rows(int64_t r0, int64_t r1, int64_t V,
        const int64_t *seeds, const int64_t *positions, const uint32_t *hv, const float *z, int64_t *tokens,
        float *margins, const int runners) {
    for (int64_t r = r0; r < r1; r++) {
        const float *zr = z + r * V;
        uint32_t ar, br;
        row_keys(seeds[r], positions[r], &ar, &br);
        float best[LANES], runner[LANES];
        int64_t where[LANES];
        int nan_seen = 0;
        for (int l = 0; l < LANES; l++) {
            best[l] = runner[l] = -__builtin_inff();
            where[l] = -1;
        }
        int64_t v = 0;
        for (; v + LANES <= V; v += LANES) {
            for (int l = 0; l < LANES; l++) {
                float s = zr[v + l] - log_exponential(ar, br, hv[v + l]);
                nan_seen |= s != s;
                int up = s > best[l];
                if (runners)
                    runner[l] = up ? best[l] : (s > runner[l] ? s : runner[l]);
                best[l] = up ? s : best[l];
                where[l] = up ? v + l : where[l];
            }
        }
        float top = -__builtin_inff();
        int64_t at = -1;
        int lane = -1;
        for (int l = 0; l < LANES; l++) {
            if (where[l] >= 0 && (best[l] > top || (best[l] == top && where[l] < at))) {
                top = best[l];
                at = where[l];
                lane = l;
            }
        }
        float second = lane >= 0 ? runner[lane] : -__builtin_inff();
        for (int l = 0; l < LANES; l++)
            if (l != lane && best[l] > second)
                second = best[l];
        for (; v < V; v++) {
            float s = zr[v] - log_exponential(ar, br, hv[v]);
            nan_seen |= s != s;
            if (s > top) {
                second = top;
                top = s;
                at = v;
            } else if (s > second) {
                second = s;
            }
        }
        if (nan_seen || at < 0) {  /* rare: redo the row in order, as torch.argmax reads it */
            at = 0;
            top = zr[0] - log_exponential(ar, br, hv[0]);
            for (int64_t w = 1; w < V && top == top; w++) {
                float s = zr[w] - log_exponential(ar, br, hv[w]);
                if (s != s || s > top) {
                    top = s;
                    at = w;
                }
            }
            second = nan_seen ? __builtin_nanf("") : -__builtin_inff();
        }
        tokens[r] = at;
        if (runners)
            margins[r] = top - second;
    }
}

/* Two copies of the loop, so that the sampler's (no margins) keeps no runner-up per lane. */
void perturbed_argmax_rows(int64_t r0, int64_t r1, int64_t V, const int64_t *seeds, const int64_t *positions,
                           const uint32_t *hv, const float *z, int64_t *tokens, float *margins) {
    if (margins != NULL)
        argmax_rows(r0, r1, V, seeds, positions, hv, z, tokens, margins, 1);
    else
        argmax_rows(r0, r1, V, seeds, positions, hv, z, tokens, NULL, 0);
}
