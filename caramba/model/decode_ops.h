/* Small fused ops of a CPU forward (decode_ops.c): exported for caramba.fused, and the
   single-threaded ones called by decode_step.c. */

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

/* A prefill's rows split over nthreads threads: the same arithmetic per row as the above. */
void rms_norm_par(const float *x, const float *w, float *y, long rows, int dim, float eps, int nthreads);
void add_rms_norm_par(const float *x, const float *h, const float *w, float *s, float *y, long rows, int dim,
                      float eps, int nthreads);
void glu_par(const float *gu, float *y, long rows, int hidden, int gelu, int nthreads);
/* RoPE of the first `heads` heads (D wide) of rows of stride `stride`, into out [rows, heads, D]. */
void rope_rows(const float *qkv, const float *cos, const float *ssin, float *out, long rows, int heads, int D,
               long stride, int nthreads);
/* Causal softmax in place over [rows, end] scores of a block of queries, `rep` rows each (row i:
   query i / rep, keys [0, first + i / rep]), optionally masked by bytes [rows / rep, mask_stride]. */
void causal_softmax(float *scores, long rows, int end, int rep, int first, const unsigned char *mask,
                    long mask_stride, int nthreads);

#endif
