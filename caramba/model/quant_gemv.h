/* Block-quantized weight products (quant_gemv.c): what the fused decode step (decode_step.c)
   takes from them. */

#ifndef CARAMBA_QUANT_GEMV_H
#define CARAMBA_QUANT_GEMV_H

#include "cpu_isa.h"

#define QK 32   /* weights per block */

/* A projection's format: the step's fp32 layouts (decode_step.c), then the block formats (weight
   format x activation codes). fast_decode.py mirrors these ids. */
enum { F32_ROWS = 0, F32_COLS = 1, Q8_0_Q8 = 2, Q8_0_F32 = 3, Q4_1_F32 = 4, Q4_1_Q8 = 5, Q4_0_Q8 = 6, Q8_0_I16 = 7,
       Q4_1_I16 = 8, Q8_0_Q8_X16 = 9, Q4_0_Q8_X16 = 10, Q4_1_Q8_X16 = 11, Q8_0_I16_X16 = 12, Q4_1_I16_X16 = 13,
       Q8_0_F32_X16 = 14, Q4_1_F32_X16 = 15,
       /* GGUF blocks kept as stored (quant_gemv_kq.h): int16 activation codes, then split ones */
       Q5_0_I16 = 16, Q5_1_I16 = 17, Q4_K_I16 = 18, Q5_K_I16 = 19, Q6_K_I16 = 20,
       Q5_0_F32 = 21, Q5_1_F32 = 22, Q4_K_F32 = 23, Q5_K_F32 = 24, Q6_K_F32 = 25, FORMATS = 26 };

/* The X16 formats hold the same blocks row-interleaved, 16 weight rows to a group (the decode
   products' lanes are those rows: quant_gemv_x86_x16.c, quant_gemv_arm.c):
     codes [ceil(N/16), B/4, 16, 4] bytes, B the row's code bytes (K for q8_0, K/2 for q4): a row's
     bytes in 4-byte units, unit u of the 16 rows of a group side by side (rows past N are zeros);
     scales d (and q4_1's minimums m) [ceil(N/16), K/32, 16] fp16. */
#define XG 16
static inline int is_x16(int fmt) { return fmt >= Q8_0_Q8_X16 && fmt <= Q4_1_F32_X16; }
/* the X16 formats with int16 activation codes (ACT_I16's, or ACT_SPLIT's two), taken as byte planes */
static inline int is_x16_wide(int fmt) { return fmt >= Q8_0_I16_X16 && fmt <= Q4_1_F32_X16; }

/* The activation codes a block format's product takes, for M rows of x [M, K]: codes xq (int8,
   int16 or split int16: up to 4 K bytes a row), scales xd and sums xs [M, K/32]. */
HIDDEN void prepare_activations(int fmt, const float *x, int M, int K, int8_t *xq, float *xd, float *xs);

#define ROWS_CHUNK 16   /* weight rows per quant_rows call (one X16 group: XG) */
static inline int row_chunks(int N) { return (N + ROWS_CHUNK - 1) / ROWS_CHUNK; }

/* y[r * N + n] = x_r . weight row n (+ bias[n]) for the weight rows of chunk c (of row_chunks(N))
   and the M activation rows, at the library's instruction set level (g_isa). */
HIDDEN void quant_rows(int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,
                       const float *x, const int8_t *xq, const float *xd, const float *xs, int M, float *y,
                       const float *bias);

#endif
