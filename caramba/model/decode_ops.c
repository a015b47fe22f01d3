/* Small fused ops of a CPU decode step (caramba.model.transformer).

   At batch 1 a decode step's elementwise work is tiny (a 576-wide vector), so torch's per-op
   dispatch dominates it: RMSNorm alone is five aten ops (pow, mean, add, rsqrt, mul), ~60 us per
   norm on a loaded 2-core box against ~1 us of arithmetic. One C call does it.

   rms_norm: y[r] = w * x[r] / sqrt(mean(x[r]^2) + eps), in fp32 like the reference (transformers'
   LlamaRMSNorm): the sum of squares is accumulated in double, so the result is at least as close
   to the exact value as torch's fp32 reduction. */

#include "decode_ops.h"

#include <math.h>

void rms_norm(const float *x, const float *w, float *y, long rows, int dim, float eps) {
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *yr = y + r * dim;
        double ss = 0.0;
        for (int i = 0; i < dim; i++) ss += (double)xr[i] * xr[i];
        const float inv = 1.0f / sqrtf((float)(ss / dim) + eps);
        for (int i = 0; i < dim; i++) yr[i] = w[i] * (xr[i] * inv);
    }
}

/* The residual add and the next norm in one pass: s = x + h (written to s), y = rms_norm(s). */
void add_rms_norm(const float *x, const float *h, const float *w, float *s, float *y, long rows, int dim,
                  float eps) {
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * dim, *hr = h + r * dim;
        float *sr = s + r * dim;
        double ss = 0.0;
        for (int i = 0; i < dim; i++) {
            sr[i] = xr[i] + hr[i];
            ss += (double)sr[i] * sr[i];
        }
        const float inv = 1.0f / sqrtf((float)(ss / dim) + eps);
        float *yr = y + r * dim;
        for (int i = 0; i < dim; i++) yr[i] = w[i] * (sr[i] * inv);
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* e^x for 8 floats: x = n ln2 + r, |r| <= ln2 / 2, e^r by Cephes' degree-6 polynomial (relative
   error ~1e-7, about 1 ulp), times 2^n built in the exponent bits; x is clamped to [-87.3, 88.3]
   so 2^n stays a normal float, and above 88.3 the result is +inf as expf's is (silu(g) of a gate
   below -88.3 is then -0 where the exact value is under 1e-36). libm's expf, one call per
   element, took ~9% of a batch-8 step and ~5% of a batch-1 one. */
static inline __m256 exp8(__m256 x0) {
    const __m256 x = _mm256_min_ps(_mm256_max_ps(x0, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);          /* ln2 in two parts */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_blendv_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), _mm256_set1_ps(INFINITY),
                            _mm256_cmp_ps(x0, _mm256_set1_ps(88.3f), _CMP_GT_OQ));
}
#endif

/* The gated MLPs' y = act(g) * u for gu = [g | u] rows of width 2 * hidden, act(g) = g / (1 + exp(z)):
   SwiGLU's SiLU with z = -g, or GeGLU's tanh GELU (Gemma) with z = -2 sqrt(2 / pi) (g + 0.044715 g^3),
   since g (1 + tanh(x)) / 2 = g / (1 + exp(-2 x)). `gelu` is a constant at each call, so each use
   compiles to its own loop. */
static inline float glu_arg(float g, int gelu) {
    return gelu ? -1.5957691216057308f * (g + 0.044715f * g * g * g) : -g;
}
static inline float glu_one(float g, float u, int gelu) { return g / (1.0f + expf(glu_arg(g, gelu))) * u; }

/* The portable reference (libm's expf). */
static inline void glu_ref(const float *gu, float *y, long rows, int hidden, int gelu) {
    for (long r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * hidden, *u = g + hidden;
        float *yr = y + r * hidden;
        for (int i = 0; i < hidden; i++) yr[i] = glu_one(g[i], u[i], gelu);
    }
}

/* The same with exp8, 8 at a time (the reference's arithmetic for the last hidden % 8). */
static inline void glu(const float *gu, float *y, long rows, int hidden, int gelu) {
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 c = _mm256_set1_ps(-1.5957691216057308f), c3 = _mm256_set1_ps(0.044715f);
    for (long r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * hidden, *u = g + hidden;
        float *yr = y + r * hidden;
        int i = 0;
        for (; i + 8 <= hidden; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 z = gelu ? _mm256_mul_ps(c, _mm256_fmadd_ps(_mm256_mul_ps(c3, gv), _mm256_mul_ps(gv, gv), gv))
                                  : _mm256_sub_ps(_mm256_setzero_ps(), gv);
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(z))),
                                                   _mm256_loadu_ps(u + i)));
        }
        for (; i < hidden; i++) yr[i] = glu_one(g[i], u[i], gelu);
    }
#else
    glu_ref(gu, y, rows, hidden, gelu);
#endif
}

void silu_mul_ref(const float *gu, float *y, long rows, int hidden) { glu_ref(gu, y, rows, hidden, 0); }
void silu_mul(const float *gu, float *y, long rows, int hidden) { glu(gu, y, rows, hidden, 0); }
void gelu_mul_ref(const float *gu, float *y, long rows, int hidden) { glu_ref(gu, y, rows, hidden, 1); }
void gelu_mul(const float *gu, float *y, long rows, int hidden) { glu(gu, y, rows, hidden, 1); }
