/* The fused decode step's projections (step_linear.c), for decode_step.c: y = x W^T (+ bias) for
   a projection in the layout the model holds it (quant_gemv.h's formats: fp32 [N, K] or [K, N],
   or block codes), and the fp32 dot product the attention's scores take too. */

#ifndef CARAMBA_STEP_LINEAR_H
#define CARAMBA_STEP_LINEAR_H

#include "decode_step.h"

#define COLS_CHUNK 4096     /* input-major products: a thread's band of columns, its [rows, band] sums L1/L2-resident */

/* A thread's own activations in the formats the integer dot products take. */
typedef struct {
    int8_t *xq;          /* q8 codes, or int16 codes (2 bytes each) */
    float *xd, *xs;
} Act;

/* One fp32 weight row . one fp32 activation row: the portable reference, and 32 at a time. */
static inline float dot_f32_ref(const float *w, const float *x, int K) {
    float acc = 0.0f;
    for (int k = 0; k < K; k++) acc += w[k] * x[k];
    return acc;
}

#if HAVE_AVX2
#ifndef ROW_PF
#define ROW_PF 512   /* floats ahead (2 KiB): the weight rows are consecutive, so this runs into the next row */
#endif
static inline float dot_f32_avx2(const float *w, const float *x, int K) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        _mm_prefetch((const char *)(w + k + ROW_PF), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + k + ROW_PF + 16), _MM_HINT_T0);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
    float acc = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; k < K; k++) acc += w[k] * x[k];
    return acc;
}
#endif

static inline float dot_f32(const float *w, const float *x, int K) {
#if HAVE_AVX2
    if (g_isa >= ISA_AVX2) return dot_f32_avx2(w, x, K);
#endif
    return dot_f32_ref(w, x, K);
}

/* y [M, N] = x [M, K] W^T (+ bias), x private to the calling thread (every thread holds the same
   values), y shared. Called by every thread of a parallel region; ends with a barrier. a: the
   thread's activation codes; cols: shared [threads, M, COLS_CHUNK] sums for input-major weights.
   row_exact: one row of fp32 [N, K] weights summed as the batch tiles sum each row (StepArgs'). */
HIDDEN void linear(const Lin *L, const float *x, int M, float *y, int row_exact, const Act *a, float *cols);

/* Exported, for tests: one projection of M rows of x (1 when scratch could not be allocated). */
int step_linear(const Lin *L, const float *x, int M, float *y, int row_exact, int nthreads);

#endif
