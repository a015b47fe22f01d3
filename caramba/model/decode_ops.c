/* Small fused ops of a CPU forward (caramba.model.transformer): a decode step's and a prefill's.

   At batch 1 a decode step's elementwise work is tiny (a 576-wide vector), so torch's per-op
   dispatch dominates it: RMSNorm alone is five aten ops (pow, mean, add, rsqrt, mul), ~60 us per
   norm on a loaded 2-core box against ~1 us of arithmetic. One C call does it. A prefill's rows
   take the same kernels split over threads (the `_par` entries below, for caramba.fused):
   five passes over a [512, 576] activation cost more than one, and a row's result is the same
   whichever call computes it, so a prompt fed whole or in chunks rounds the same.

   rms_norm: y[r] = w * x[r] / sqrt(mean(x[r]^2) + eps), in fp32 like the reference (transformers'
   LlamaRMSNorm): the sum of squares is accumulated in double, so the result is at least as close
   to the exact value as torch's fp32 reduction. */

#include "decode_ops.h"

#include <math.h>
#include <stddef.h>

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

/* ---- a prefill's rows, split over threads ------------------------------------------------------

   The same per-row arithmetic as above (so the same bits for a row, whatever the row count or the
   thread count), rows in static chunks. Called from Python (caramba.fused), never from
   inside decode_step.c's parallel region. */

void rms_norm_par(const float *x, const float *w, float *y, long rows, int dim, float eps, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1)
    for (long r = 0; r < rows; r++) rms_norm(x + r * dim, w, y + r * dim, 1, dim, eps);
}

void add_rms_norm_par(const float *x, const float *h, const float *w, float *s, float *y, long rows, int dim,
                      float eps, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1)
    for (long r = 0; r < rows; r++)
        add_rms_norm(x + r * dim, h + r * dim, w, s + r * dim, y + r * dim, 1, dim, eps);
}

void glu_par(const float *gu, float *y, long rows, int hidden, int gelu, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1)
    for (long r = 0; r < rows; r++) glu(gu + r * 2 * hidden, y + r * hidden, 1, hidden, gelu);
}

/* Rotary embeddings of a projection's q and k heads in HF's half-rotation convention:
   out[r, h] = x[r, h] * cos[r] + roll(x[r, h], D / 2) * signed_sin[r] for the first `heads` heads
   of each row of qkv (row stride `stride` floats, heads D wide), cos and signed_sin [rows, D]
   (caramba.model.rope.RotaryTable: sin's first half negated), out [rows, heads, D]. */
void rope_rows(const float *qkv, const float *cos, const float *ssin, float *out, long rows, int heads, int D,
               long stride, int nthreads) {
    const int half = D / 2;
    #pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1)
    for (long r = 0; r < rows; r++) {
        const float *c = cos + r * D, *sn = ssin + r * D;
        for (int h = 0; h < heads; h++) {
            const float *x = qkv + r * stride + (long)h * D;
            float *o = out + (r * heads + h) * D;
            for (int i = 0; i < half; i++) o[i] = x[i] * c[i] + x[i + half] * sn[i];
            for (int i = half; i < D; i++) o[i] = x[i] * c[i] + x[i - half] * sn[i];
        }
    }
}

/* A causal softmax in place over score rows [rows, end] of a block of attention queries
   (caramba.cache.sdpa): row i is query t = i / rep of the block (each query's `rep` heads side by
   side), and sees keys [0, first + t] (first: the block's first query's slot), those of them a
   mask row allows where `mask` is given (bytes [rows / rep, mask_stride], nonzero: seen; left
   padding). Keys it does not see get probability 0. Every row sees at least one key (its own). */
#if defined(__AVX2__) && defined(__FMA__)
/* 8 of a row's scores, those its mask bytes hide (if any) at -inf; *seen: the lanes shown. */
static inline __m256 masked8(const float *s, const unsigned char *m, __m256 *seen) {
    const __m256 v = _mm256_loadu_ps(s);
    if (!m) return v;
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)m));
    *seen = _mm256_castsi256_ps(_mm256_cmpgt_epi32(bytes, _mm256_setzero_si256()));
    return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), v, *seen);
}
#endif

/* One row: the max over the keys shown (two vector accumulators: a max is exact in any order),
   exp(s - max) summed in double, times 1 / sum; keys hidden or past len get 0. */
static void softmax_row(float *s, int len, const unsigned char *m, int end) {
    float mx = -INFINITY;
    int j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 seen = _mm256_castsi256_ps(_mm256_set1_epi32(-1)), m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
    for (; j + 16 <= len; j += 16) {
        m0 = _mm256_max_ps(m0, masked8(s + j, m ? m + j : NULL, &seen));
        m1 = _mm256_max_ps(m1, masked8(s + j + 8, m ? m + j + 8 : NULL, &seen));
    }
    for (; j + 8 <= len; j += 8) m0 = _mm256_max_ps(m0, masked8(s + j, m ? m + j : NULL, &seen));
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(m0, m1));
    for (int k = 0; k < 8; k++) mx = lanes[k] > mx ? lanes[k] : mx;
#endif
    for (; j < len; j++) if ((!m || m[j]) && s[j] > mx) mx = s[j];
    double sum = 0.0;
    j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 vm = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    for (; j + 8 <= len; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(masked8(s + j, m ? m + j : NULL, &seen), vm));
        if (m) e = _mm256_and_ps(e, seen);   /* exp8 of -inf is ~1e-38, not 0 */
        _mm256_storeu_ps(s + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    _mm256_storeu_ps(lanes, acc);
    for (int k = 0; k < 8; k++) sum += lanes[k];
#endif
    for (; j < len; j++) {
        const float e = (!m || m[j]) ? expf(s[j] - mx) : 0.0f;
        s[j] = e;
        sum += e;
    }
    const float inv = (float)(1.0 / sum);
    for (j = 0; j < len; j++) s[j] *= inv;
    for (; j < end; j++) s[j] = 0.0f;
}

void causal_softmax(float *scores, long rows, int end, int rep, int first, const unsigned char *mask,
                    long mask_stride, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1)
    for (long i = 0; i < rows; i++) {
        const int t = (int)(i / rep), len = first + t + 1 < end ? first + t + 1 : end;
        softmax_row(scores + i * end, len, mask ? mask + t * mask_stride : NULL, end);
    }
}
