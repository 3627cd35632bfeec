/* Decode and prefill attention over a bfloat16 page pool, read in place (pdserve's CPU pass).

   Built at first use with the machine's C compiler (-O3 -march=native -fopenmp) by
   engine/kernels/native.py and called through ctypes; its OpenMP pool is torch's (the same
   libgomp.so.1, already loaded). Per row: q . k in float32 (q and K are bfloat16 values, so the
   products are exact): where the CPU has AVX512-BF16 and the head size is a multiple of 32, by
   its bfloat16 dot product with the sums scaled, elsewhere as float32 multiply-adds with q
   scaled first; softmax in float32 (e^x to about 1 ulp), the probabilities' product with V
   accumulated in float32, rounded once to bfloat16. */
#include <stdlib.h>
#include "cpu_common.h"
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_BF16_DOT 1
#endif

#define MAXG 16
#define MAXD 256

#ifdef HAVE_BF16_DOT
/* The sums of a, b, c and d's 16 lanes each, in that order. */
static inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512 lo = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd)));
    const __m512 hi = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd)));
    const __m512 blocks = _mm512_add_ps(lo, hi); /* per 128-bit block: a, b, c, d's part */
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(blocks), _mm512_extractf32x8_ps(blocks, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* Scores of keys t .. t+3 for each of `group` query heads (bfloat16 rows qr, dim a multiple of
   32), scaled: bfloat16 dot products, exact products summed in float32. */
static inline __attribute__((always_inline)) void scores4_bf16(
    const uint16_t *qr, const uint16_t *k0, const uint16_t *k1, const uint16_t *k2, const uint16_t *k3, int group,
    float scale, float *scores, int64_t count, const int dim) {
    const __m128 sc = _mm_set1_ps(scale);
    for (int g = 0; g < group; g++) {
        const uint16_t *qg = qr + g * dim;
        __m512 a = _mm512_setzero_ps(), b = a, c = a, d = a;
        for (int i = 0; i < dim; i += 32) {
            const __m512bh qv = (__m512bh)_mm512_loadu_si512(qg + i);
            a = _mm512_dpbf16_ps(a, qv, (__m512bh)_mm512_loadu_si512(k0 + i));
            b = _mm512_dpbf16_ps(b, qv, (__m512bh)_mm512_loadu_si512(k1 + i));
            c = _mm512_dpbf16_ps(c, qv, (__m512bh)_mm512_loadu_si512(k2 + i));
            d = _mm512_dpbf16_ps(d, qv, (__m512bh)_mm512_loadu_si512(k3 + i));
        }
        _mm_storeu_ps(scores + g * count, _mm_mul_ps(sum4(a, b, c, d), sc));
    }
}
#endif

/* Where row t of one head's K (or V, by `off`) lies in the pool. */
static inline const uint16_t *row_at(const uint16_t *pool, const int32_t *table, int t, int page,
                                     int64_t page_stride, int64_t off, int dim) {
    return pool + table[t / page] * page_stride + off + (int64_t)(t % page) * dim;
}

/* Rows t .. t+3 in float32. */
static inline void load4(float rows4[4][MAXD], const uint16_t *pool, const int32_t *table, int t, int page,
                         int64_t page_stride, int64_t off, int dim) {
    for (int i = 0; i < 4; i++) {
        const uint16_t *x = row_at(pool, table, t + i, page, page_stride, off, dim);
        for (int d = 0; d < dim; d++) rows4[i][d] = bf16_to_f32(x[d]);
    }
}

/* One (row, KV head): its `group` query heads over keys first .. n-1. Inlined with a constant
   `dim` (64, 128) so that the loops over it are unrolled and vectorised for that size. */
static inline __attribute__((always_inline)) void attend(
    const uint16_t *pool, const uint16_t *qr, uint16_t *o, const int32_t *table, int first, int n, int64_t k_off,
    int64_t v_off, int64_t page_stride, int page, int group, float scale, float *scores, const int dim) {
    const int count = n - first;
    float qf[MAXG * MAXD], acc[MAXG * MAXD], x4[4][MAXD];
    for (int i = 0; i < group * dim; i++) { qf[i] = bf16_to_f32(qr[i]) * scale; acc[i] = 0.0f; }
    int t = first;
#ifdef HAVE_BF16_DOT
    if (dim % 32 == 0) { /* four keys at once by bfloat16 dot products */
        for (; t + 4 <= n; t += 4)
            scores4_bf16(qr, row_at(pool, table, t, page, page_stride, k_off, dim),
                         row_at(pool, table, t + 1, page, page_stride, k_off, dim),
                         row_at(pool, table, t + 2, page, page_stride, k_off, dim),
                         row_at(pool, table, t + 3, page, page_stride, k_off, dim), group, scale,
                         scores + (t - first), count, dim);
    }
#endif
    for (; t + 4 <= n; t += 4) { /* four keys at once: four independent sums per query head */
        load4(x4, pool, table, t, page, page_stride, k_off, dim);
        for (int g = 0; g < group; g++) {
            const float *qg = qf + g * dim;
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
            for (int d = 0; d < dim; d++) {
                s0 += qg[d] * x4[0][d]; s1 += qg[d] * x4[1][d];
                s2 += qg[d] * x4[2][d]; s3 += qg[d] * x4[3][d];
            }
            float *sg = scores + g * count + (t - first);
            sg[0] = s0; sg[1] = s1; sg[2] = s2; sg[3] = s3;
        }
    }
    for (; t < n; t++) {
        const uint16_t *k = row_at(pool, table, t, page, page_stride, k_off, dim);
        for (int d = 0; d < dim; d++) x4[0][d] = bf16_to_f32(k[d]);
        for (int g = 0; g < group; g++) {
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int d = 0; d < dim; d++) s += qf[g * dim + d] * x4[0][d];
            scores[g * count + (t - first)] = s;
        }
    }
    for (int g = 0; g < group; g++) {
        float *sg = scores + g * count, m = -INFINITY, sum = 0.0f;
        for (int i = 0; i < count; i++) m = sg[i] > m ? sg[i] : m;
#pragma omp simd reduction(+ : sum)
        for (int i = 0; i < count; i++) { float e = exp_f(sg[i] - m); sg[i] = e; sum += e; }
        const float inv = 1.0f / sum;
        for (int i = 0; i < count; i++) sg[i] *= inv;
    }
    t = first;
    for (; t + 4 <= n; t += 4) { /* four values at once: one read and write of the sums per four */
        load4(x4, pool, table, t, page, page_stride, v_off, dim);
        for (int g = 0; g < group; g++) {
            const float *pg = scores + g * count + (t - first);
            const float p0 = pg[0], p1 = pg[1], p2 = pg[2], p3 = pg[3];
            float *ag = acc + g * dim;
#pragma omp simd
            for (int d = 0; d < dim; d++) ag[d] += p0 * x4[0][d] + p1 * x4[1][d] + p2 * x4[2][d] + p3 * x4[3][d];
        }
    }
    for (; t < n; t++) {
        const uint16_t *v = row_at(pool, table, t, page, page_stride, v_off, dim);
        for (int d = 0; d < dim; d++) x4[0][d] = bf16_to_f32(v[d]);
        for (int g = 0; g < group; g++) {
            const float p = scores[g * count + (t - first)];
#pragma omp simd
            for (int d = 0; d < dim; d++) acc[g * dim + d] += p * x4[0][d];
        }
    }
    for (int i = 0; i < group * dim; i++) o[i] = f32_to_bf16(acc[i]);
}

/* Rows r < rows: q[r * q_stride ...] ([heads, group, dim] bfloat16), its pages
   tables[r * table_stride ...], its context length lens[r]; window > 0 keeps the last `window`
   keys. out[r] ([heads, group, dim] bfloat16) rows are contiguous. Returns 0, -1 for shapes
   past MAXG / MAXD, -2 when memory runs out. Pool [pages, layers, 2, heads, page, dim]. */
int paged_decode_bf16(const uint16_t *pool, const uint16_t *q, int64_t q_stride, uint16_t *out,
                      const int32_t *tables, int64_t table_stride, const int32_t *lens, int rows, int layer, int layers, int heads,
                      int group, int page, int dim, float scale, int window) {
    if (group > MAXG || dim > MAXD) return -1;
    const int64_t block = (int64_t)page * dim;
    const int64_t page_stride = (int64_t)layers * 2 * heads * block;
    int longest = 1;
    for (int r = 0; r < rows; r++) longest = lens[r] > longest ? lens[r] : longest;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)group * (size_t)longest);
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for collapse(2) schedule(static)
        for (int r = 0; r < rows; r++) {
            for (int h = 0; h < heads; h++) {
                if (!scores) continue;
                const int n = lens[r];
                const int first = (window > 0 && n > window) ? n - window : 0;
                const int64_t k_off = ((int64_t)(layer * 2) * heads + h) * block;
                const int64_t v_off = ((int64_t)(layer * 2 + 1) * heads + h) * block;
                const uint16_t *qr = q + (int64_t)r * q_stride + (int64_t)h * group * dim;
                uint16_t *o = out + ((int64_t)r * heads + h) * group * dim;
                const int32_t *table = tables + (int64_t)r * table_stride;
                if (dim == 64) attend(pool, qr, o, table, first, n, k_off, v_off, page_stride, page, group, scale, scores, 64);
                else if (dim == 128) attend(pool, qr, o, table, first, n, k_off, v_off, page_stride, page, group, scale, scores, 128);
                else attend(pool, qr, o, table, first, n, k_off, v_off, page_stride, page, group, scale, scores, dim);
            }
        }
        free(scores);
    }
    return failed ? -2 : 0;
}

/* One prefill chunk of one sequence: rows r < n at positions ctx - n + r attend causally to the
   keys before them and themselves (the last `window` of them when window > 0), all read from the
   pool (the chunk's own K and V are written there first). Per KV head its keys are laid out
   once for the rows to share: K transposed, so that a row's scores for 64 keys at a time are
   plain multiply-adds over dim (no horizontal sums), V as it lies. Where the CPU has AVX512-BF16
   (and dim is a multiple of 32), K stays bfloat16 in pairs of dims and q . k is its dot-product
   instruction (bfloat16 products are exact in float32, summed in float32; the scale applied to
   the sums) and V is float32 for the product with the float32 probabilities; elsewhere both are
   float32 and q is scaled first, as paged_decode_bf16 does. Softmax in float32; the output
   rounded once. out: [n, heads, group, dim] contiguous. Returns 0, -1 for shapes past MAXG /
   MAXD, -2 when memory runs out. */
#define KB 64
static inline __attribute__((always_inline)) void prefill_row(
    const void *kt, const float *vf, int64_t kpad, const uint16_t *qr, uint16_t *o, int lo, int hi, int group,
    float scale, float *scores, int pairs, const int dim) {
    float qf[MAXG * MAXD], acc[MAXG * MAXD];
    for (int i = 0; i < group * dim; i++) { qf[i] = bf16_to_f32(qr[i]) * (pairs ? 1.0f : scale); acc[i] = 0.0f; }
    for (int g = 0; g < group; g++) {
        float *sg = scores + (int64_t)g * kpad;
#ifdef HAVE_BF16_DOT
        if (pairs) {
            const uint32_t *kp = (const uint32_t *)kt, *qp = (const uint32_t *)(qr + g * dim);
            const __m512 sc = _mm512_set1_ps(scale);
            for (int tb = lo; tb < hi; tb += KB) {
                __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int d2 = 0; d2 < dim / 2; d2++) {
                    const __m512bh qd = (__m512bh)_mm512_set1_epi32((int)qp[d2]);
                    const uint32_t *k = kp + (int64_t)d2 * kpad + tb;
                    a0 = _mm512_dpbf16_ps(a0, qd, (__m512bh)_mm512_loadu_si512(k));
                    a1 = _mm512_dpbf16_ps(a1, qd, (__m512bh)_mm512_loadu_si512(k + 16));
                    a2 = _mm512_dpbf16_ps(a2, qd, (__m512bh)_mm512_loadu_si512(k + 32));
                    a3 = _mm512_dpbf16_ps(a3, qd, (__m512bh)_mm512_loadu_si512(k + 48));
                }
                _mm512_storeu_ps(sg + tb, _mm512_mul_ps(a0, sc));
                _mm512_storeu_ps(sg + tb + 16, _mm512_mul_ps(a1, sc));
                _mm512_storeu_ps(sg + tb + 32, _mm512_mul_ps(a2, sc));
                _mm512_storeu_ps(sg + tb + 48, _mm512_mul_ps(a3, sc));
            }
        } else
#endif
        {
            const float *qg = qf + g * dim, *kf = (const float *)kt;
            for (int tb = lo; tb < hi; tb += KB) { /* keys tb .. tb+KB-1 (past hi: padding, unused) */
                float s[KB];
                for (int j = 0; j < KB; j++) s[j] = 0.0f;
                for (int d = 0; d < dim; d++) {
                    const float qd = qg[d];
                    const float *k = kf + (int64_t)d * kpad + tb;
#pragma omp simd
                    for (int j = 0; j < KB; j++) s[j] += qd * k[j];
                }
                for (int j = 0; j < KB; j++) sg[tb + j] = s[j];
            }
        }
        float m = -INFINITY, sum = 0.0f;
        for (int t = lo; t < hi; t++) m = sg[t] > m ? sg[t] : m;
#pragma omp simd reduction(+ : sum)
        for (int t = lo; t < hi; t++) { float e = exp_f(sg[t] - m); sg[t] = e; sum += e; }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int t = lo; t < hi; t++) sg[t] *= inv;
    }
    for (int g = 0; g < group; g++) { /* a head at a time: its sums stay in registers */
        const float *pg = scores + (int64_t)g * kpad;
        float *ag = acc + g * dim;
#ifdef HAVE_BF16_DOT
        if (pairs && dim <= 128) {
            __m512 a[8];
            for (int i = 0; i < dim / 16; i++) a[i] = _mm512_setzero_ps();
            for (int t = lo; t < hi; t++) {
                const __m512 p = _mm512_set1_ps(pg[t]);
                const float *v = vf + (int64_t)t * dim;
                for (int i = 0; i < dim / 16; i++) a[i] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16 * i), a[i]);
            }
            for (int i = 0; i < dim / 16; i++) _mm512_storeu_ps(ag + 16 * i, a[i]);
            continue;
        }
#endif
        for (int t = lo; t < hi; t++) {
            const float p = pg[t], *v = vf + (int64_t)t * dim;
#pragma omp simd
            for (int d = 0; d < dim; d++) ag[d] += p * v[d];
        }
    }
    for (int i = 0; i < group * dim; i++) o[i] = f32_to_bf16(acc[i]);
}

int paged_prefill_bf16(const uint16_t *pool, const uint16_t *q, int64_t q_stride, uint16_t *out, const int32_t *table,
                       int ctx, int n, int layer, int layers, int heads, int group, int page, int dim, float scale,
                       int window) {
    if (group > MAXG || dim > MAXD) return -1;
    if (n <= 0) return 0;
    const int64_t block = (int64_t)page * dim;
    const int64_t page_stride = (int64_t)layers * 2 * heads * block;
    const int start = (window > 0 && ctx - n + 1 > window) ? ctx - n + 1 - window : 0; /* first key any row sees */
    const int nk = ctx - start;
    const int64_t kpad = ((int64_t)nk + KB - 1) / KB * KB + KB;
#ifdef HAVE_BF16_DOT
    const int pairs = dim % 32 == 0;
#else
    const int pairs = 0;
#endif
    const int64_t k_rows = pairs ? dim / 2 : dim; /* rows of the transposed K: dims, or pairs of them */
    float *kt = (float *)calloc((size_t)heads * (size_t)k_rows * (size_t)kpad, sizeof(float));
    float *vf = (float *)malloc(sizeof(float) * (size_t)heads * (size_t)nk * (size_t)dim);
    if (!kt || !vf) { free(kt); free(vf); return -2; }
    int failed = 0;
#pragma omp parallel
    {
#pragma omp for collapse(2) schedule(static)
        for (int h = 0; h < heads; h++) {
            for (int t = 0; t < nk; t++) {
                const int64_t k_off = ((int64_t)(layer * 2) * heads + h) * block;
                const int64_t v_off = ((int64_t)(layer * 2 + 1) * heads + h) * block;
                const uint16_t *k = row_at(pool, table, start + t, page, page_stride, k_off, dim);
                const uint16_t *v = row_at(pool, table, start + t, page, page_stride, v_off, dim);
                float *vth = vf + ((int64_t)h * nk + t) * dim;
                for (int d = 0; d < dim; d++) vth[d] = bf16_to_f32(v[d]);
                if (pairs) { /* two bfloat16 dims per 32-bit element */
                    uint32_t *kth = (uint32_t *)kt + (int64_t)h * k_rows * kpad + t, kw;
                    for (int d2 = 0; d2 < dim / 2; d2++) { memcpy(&kw, k + 2 * d2, 4); kth[(int64_t)d2 * kpad] = kw; }
                } else {
                    float *kth = kt + (int64_t)h * k_rows * kpad + t;
                    for (int d = 0; d < dim; d++) kth[(int64_t)d * kpad] = bf16_to_f32(k[d]);
                }
            }
        }
        float *scores = (float *)malloc(sizeof(float) * (size_t)group * (size_t)kpad);
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
        /* rows interleaved over the threads: a row's work grows with its position */
#pragma omp for collapse(2) schedule(static, 1)
        for (int r = 0; r < n; r++) {
            for (int h = 0; h < heads; h++) {
                if (!scores) continue;
                const int pos = ctx - n + r;
                const int lo = ((window > 0 && pos + 1 > window) ? pos + 1 - window : 0) - start;
                const int hi = pos + 1 - start;
                const void *kth = kt + (int64_t)h * k_rows * kpad;
                const float *vth = vf + (int64_t)h * nk * dim;
                const uint16_t *qr = q + (int64_t)r * q_stride + (int64_t)h * group * dim;
                uint16_t *o = out + ((int64_t)r * heads + h) * group * dim;
                if (dim == 64) prefill_row(kth, vth, kpad, qr, o, lo, hi, group, scale, scores, pairs, 64);
                else if (dim == 128) prefill_row(kth, vth, kpad, qr, o, lo, hi, group, scale, scores, pairs, 128);
                else prefill_row(kth, vth, kpad, qr, o, lo, hi, group, scale, scores, pairs, dim);
            }
        }
        free(scores);
    }
    free(kt);
    free(vf);
    return failed ? -2 : 0;
}
