/* The CPU pass's element-wise steps over bfloat16 rows, each one loop where torch takes several
   ops (and as many passes over memory, and per-op overhead that a decode step of a few rows
   pays thirty times a layer). Each rounds to bfloat16 exactly where the stock transformers
   code rounds, so that its results equal the torch ops they replace (the sum of squares of
   the RMS norm may differ in its last float32 bit: its order is not torch's). Built and loaded
   with cpu_attention.c (engine/kernels/native.py). */
#include "cpu_common.h"

#define PARALLEL_MIN 32768 /* elements below which one thread does it all */

/* out[r, j] = bf16(bf16(silu(g)) * u) with g = gu[r, j], u = gu[r, n + j]: F.silu of the gate
   half, times the up half. gu rows `stride` apart, out rows contiguous. */
void silu_mul_bf16(const uint16_t *gu, int64_t stride, uint16_t *out, int64_t rows, int64_t n) {
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gu + r * stride, *u = g + n;
        uint16_t *o = out + r * n;
#pragma omp simd
        for (int64_t j = 0; j < n; j++) {
            const float x = bf16_to_f32(g[j]);
            const float s = bf16_to_f32(f32_to_bf16(x / (1.0f + exp_f(-x))));
            o[j] = f32_to_bf16(s * bf16_to_f32(u[j]));
        }
    }
}

/* The residual add and RMS norm of one layer's input: res = x + residual (bf16; x itself when
   residual is NULL), norm = bf16(weight * bf16(res * (1 / sqrt(mean(res^2) + eps)))), computed
   in float32 as the stock LlamaRMSNorm computes it. x and residual rows `sx` / `sr` apart;
   norm and res rows contiguous (res may be residual itself). */
void add_rms_norm_bf16(const uint16_t *x, int64_t sx, const uint16_t *residual, int64_t sr, const uint16_t *weight,
                       float eps, int64_t rows, int64_t h, uint16_t *norm, uint16_t *res) {
#pragma omp parallel for schedule(static) if (rows * h >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * sx;
        uint16_t *rr = res + r * h, *nr = norm + r * h;
        if (residual != NULL) {
            const uint16_t *er = residual + r * sr;
#pragma omp simd
            for (int64_t j = 0; j < h; j++) rr[j] = f32_to_bf16(bf16_to_f32(xr[j]) + bf16_to_f32(er[j]));
        } else if (rr != xr) {
            memcpy(rr, xr, (size_t)h * 2);
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < h; j++) { const float v = bf16_to_f32(rr[j]); sum += v * v; }
        const float scale = 1.0f / sqrtf(sum / (float)h + eps);
#pragma omp simd
        for (int64_t j = 0; j < h; j++) nr[j] = f32_to_bf16(bf16_to_f32(weight[j]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(rr[j]) * scale)));
    }
}

/* The rotary embedding in place over the first `heads` heads of each token's row (q's heads,
   then k's): x = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), cos and sin rows
   [position][dim] (bfloat16, halves repeated), as the stock apply_rotary_pos_emb rounds. */
void rope_bf16(uint16_t *qk, int64_t stride, int64_t tokens, int heads, int dim, const uint16_t *cos,
               const uint16_t *sin, const int64_t *positions) {
    const int half = dim / 2;
#pragma omp parallel for schedule(static) if (tokens * heads * dim >= PARALLEL_MIN)
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *c = cos + positions[t] * dim, *s = sin + positions[t] * dim;
        for (int hd = 0; hd < heads; hd++) {
            uint16_t *x = qk + t * stride + (int64_t)hd * dim;
            uint16_t lo[256], hi[256];
            for (int d = 0; d < half; d++) {
                const float a = bf16_to_f32(x[d]), b = bf16_to_f32(x[d + half]);
                /* rotate_half: (-b, a) */
                lo[d] = f32_to_bf16(bf16_to_f32(f32_to_bf16(a * bf16_to_f32(c[d]))) + bf16_to_f32(f32_to_bf16(-b * bf16_to_f32(s[d]))));
                hi[d] = f32_to_bf16(bf16_to_f32(f32_to_bf16(b * bf16_to_f32(c[d + half]))) + bf16_to_f32(f32_to_bf16(a * bf16_to_f32(s[d + half]))));
            }
            memcpy(x, lo, (size_t)half * 2);
            memcpy(x + half, hi, (size_t)half * 2);
        }
    }
}
