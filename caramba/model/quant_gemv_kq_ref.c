/* The portable reference of the stored GGUF formats' products (quant_gemv_kq.h defines them and
   their arithmetic): what the scalar level runs, and what tests hold the avx2, avx512vnni and
   neon kernels to, bit for bit. Also a
   weight row's values (dequantize-then-matmul, the prefill of these formats). */

#include "quant_gemv_kq.h"

HIDDEN void kq_rows_ref(int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,
                        const float *x, const int8_t *xq, const float *xd, const float *xs, int M, float *y,
                        const float *bias) {
    (void)d, (void)m, (void)x;
    const int kind = kq_kind(fmt), split = kq_split(fmt), nb = K / QK;
    const int n0 = c * ROWS_CHUNK, n1 = N - n0 < ROWS_CHUNK ? N : n0 + ROWS_CHUNK;
    const long rb = kq_row_bytes(kind, K);
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = (const uint8_t *)w + n * rb;
        for (int r = 0; r < M; r++) {
            const int16_t *a = (const int16_t *)xq + (long)r * K * (split ? 2 : 1);
            float acc[8] = {0}, macc[8] = {0};
            for (int b = 0; b < nb; b++) kq_block_step(kind, split, row, b, a, xd + (long)r * nb, xs + (long)r * nb, acc, macc);
            float o = kq_hsum8(acc);
            if (kq_zero_point(kind)) o = o + kq_hsum8(macc);
            if (bias) o += bias[n];
            y[(long)r * N + n] = o;
        }
    }
}

HIDDEN void kq_dequantize_row_ref(int kind, const uint8_t *row, int K, float *out) {
    for (int b = 0; b < K / QK; b++) kq_dequantize_block(kind, row, b, out + b * QK);
}
