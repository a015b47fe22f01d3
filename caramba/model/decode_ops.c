/* Small fused ops of a CPU decode step (caramba.model.transformer).

   At batch 1 a decode step's elementwise work is tiny (a 576-wide vector), so torch's per-op
   dispatch dominates it: RMSNorm alone is five aten ops (pow, mean, add, rsqrt, mul), ~60 us per
   norm on a loaded 2-core box against ~1 us of arithmetic. One C call does it.

   rms_norm: y[r] = w * x[r] / sqrt(mean(x[r]^2) + eps), in fp32 like the reference (transformers'
   LlamaRMSNorm): the sum of squares is accumulated in double, so the result is at least as close
   to the exact value as torch's fp32 reduction. */

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

/* SwiGLU's gate: y = silu(g) * u for gu = [g | u] rows of width 2 * hidden. */
void silu_mul(const float *gu, float *y, long rows, int hidden) {
    for (long r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * hidden, *u = g + hidden;
        float *yr = y + r * hidden;
        for (int i = 0; i < hidden; i++) yr[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
