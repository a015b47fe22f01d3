/* Small fused ops of a CPU decode step (decode_ops.c): exported for caramba.model.fused, and
   called by decode_step.c. */

#ifndef CARAMBA_DECODE_OPS_H
#define CARAMBA_DECODE_OPS_H

/* y[r] = w * x[r] / sqrt(mean(x[r]^2) + eps) for rows of dim. */
void rms_norm(const float *x, const float *w, float *y, long rows, int dim, float eps);
/* s = x + h; y = rms_norm(s). */
void add_rms_norm(const float *x, const float *h, const float *w, float *s, float *y, long rows, int dim, float eps);
/* y = silu(g) * u for rows gu = [g | u] of width 2 hidden: a vector exp where the build has AVX2;
   silu_mul_ref is the portable reference (libm's expf), what a build without AVX2 runs. */
void silu_mul(const float *gu, float *y, long rows, int hidden);
void silu_mul_ref(const float *gu, float *y, long rows, int hidden);
/* y = gelu_tanh(g) * u (GeGLU: Gemma), the same way. */
void gelu_mul(const float *gu, float *y, long rows, int hidden);
void gelu_mul_ref(const float *gu, float *y, long rows, int hidden);

#endif
