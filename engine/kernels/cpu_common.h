/* What the CPU pass's C kernels (cpu_attention.c, cpu_elementwise.c) share: bfloat16 to and
   from float32, and e^x in float32. Part of the kernels' build key (engine/kernels/native.py). */
#ifndef PDSERVE_CPU_COMMON_H
#define PDSERVE_CPU_COMMON_H
#include <stdint.h>
#include <string.h>
#include <math.h>

static inline float bf16_to_f32(uint16_t v) { uint32_t u = ((uint32_t)v) << 16; float f; memcpy(&f, &u, 4); return f; }

/* Round to nearest even (a NaN stays a NaN), branch-free. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, nan = (u >> 16) | 0x40u;
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? nan : rounded);
}

/* e^x to about 1 ulp: 2^n times a degree-6 polynomial of the remainder; +inf past float32's
   range, as expf, and the smallest normal's order below -87.3. */
static inline float exp_f(float x) {
    const int over = x > 88.72283f;
    x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
    float k = x * 1.44269504088896341f + 12582912.0f;
    float n = k - 12582912.0f;
    float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f; p = p * r + 1.0f / 24.0f; p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f; p = p * r + 1.0f; p = p * r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23; float s; memcpy(&s, &e, 4);
    return over ? INFINITY : p * s;
}
#endif
