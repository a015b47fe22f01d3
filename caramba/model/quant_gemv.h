/* Block-quantized weight products (quant_gemv.c): what the fused decode step (decode_step.c)
   takes from them. */

#ifndef CARAMBA_QUANT_GEMV_H
#define CARAMBA_QUANT_GEMV_H

#include "cpu_isa.h"

#define QK 32   /* weights per block */

/* A projection's format: the step's fp32 layouts (decode_step.c), then the block formats (weight
   format x activation codes). fast_decode.py mirrors these ids. */
enum { F32_ROWS = 0, F32_COLS = 1, Q8_0_Q8 = 2, Q8_0_F32 = 3, Q4_1_F32 = 4, Q4_1_Q8 = 5, Q4_0_Q8 = 6, Q8_0_I16 = 7,
       Q4_1_I16 = 8 };

/* The activation codes a block format's product takes, for M rows of x [M, K]: codes xq (int8,
   int16 or split int16: up to 4 K bytes a row), scales xd and sums xs [M, K/32]. */
HIDDEN void prepare_activations(int fmt, const float *x, int M, int K, int8_t *xq, float *xd, float *xs);

#define ROWS_CHUNK 16   /* weight rows per quant_rows call */
static inline int row_chunks(int N) { return (N + ROWS_CHUNK - 1) / ROWS_CHUNK; }

/* y[r * N + n] = x_r . weight row n (+ bias[n]) for the weight rows of chunk c (of row_chunks(N))
   and the M activation rows, at the library's instruction set level (g_isa). */
HIDDEN void quant_rows(int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,
                       const float *x, const int8_t *xq, const float *xd, const float *xs, int M, float *y,
                       const float *bias);

#endif
