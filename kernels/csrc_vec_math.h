/*
 * Branch-free float math that GCC vectorises, shared by the C kernels.
 * glibc's expf is a scalar call (~20 ns): in a loop it costs more than the
 * loop's own arithmetic and keeps the loop from vectorising.
 */
#ifndef RAYVLLM_CSRC_VEC_MATH_H
#define RAYVLLM_CSRC_VEC_MATH_H
#include <stdint.h>

/* exp for x <= 0. Cephes' range reduction and polynomial: within 1e-6
 * relative of exp on [-30, 0]; below -87.3 it returns 0. */
static inline float exp_nonpos(float x) {
    x = x < -87.3f ? -87.3f : x;
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return x <= -87.3f ? 0.0f : p * scale.f;
}

/* x * sigmoid(x), with exp only of non-positive arguments so it never
 * overflows: sigmoid(x) = 1 / (1 + e) for x >= 0 and e / (1 + e) below,
 * where e = exp(-|x|). */
static inline float silu(float x) {
    const float e = exp_nonpos(x < 0.f ? x : -x);
    return x * ((x >= 0.f ? 1.f : e) / (1.f + e));
}
#endif
