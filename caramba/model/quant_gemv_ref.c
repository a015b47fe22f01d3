/* The portable reference of the quantized products (quant_gemv.c): every loop one element at a
   time, in plain C. It is what the scalar level runs (cpu_isa.c: CARAMBA_ISA=scalar, or a CPU or
   build without a vector level), what a vector level falls back to for a format it has no kernel
   for, and what tests hold every level against (tests/model/test_isa.py): each level's int32 block sums
   are exactly dot_*_ref's, and the X16 references make the vector kernels' FMAs lane by lane, so
   those agree bit for bit; the row-major fp32 sums here run in another order than the vector
   levels' (within fp32 rounding of them). Also the block formats' own quantization (the search
   for a weight block's scale) and dequantization, the definitions the vector versions reproduce.
   ggml keeps its *_generic references the same way, apart from the per-architecture files. */

#include "quant_gemv_ref.h"

#include <math.h>

/* --- the activation codes (quant_gemv.c's quantize_rows) ----------------------------------- */

static void quantize_block_ref(const float *xb, int mode, int8_t *q8, int16_t *q16, float *d) {
    float amax = 0.0f, inv;
    for (int i = 0; i < QK; i++) amax = isnan(xb[i]) || isnan(amax) ? NAN : fmaxf(amax, fabsf(xb[i]));
    block_scale(amax, mode, d, &inv);
    for (int i = 0; i < QK; i++) {
        const float scaled = xb[i] * inv, h = rintf(scaled);
        if (mode == ACT_Q8) q8[i] = (int8_t)h;
        else q16[i] = (int16_t)h;
        if (mode == ACT_SPLIT) q16[QK + i] = (int16_t)lrintf((scaled - h) * 32768.0f);
    }
}

HIDDEN void quantize_row_ref(const float *x, int nb, int mode, int8_t *q8, int16_t *q16, float *d) {
    const int width = mode == ACT_SPLIT ? 2 : 1;   /* codes per element */
    for (int b = 0; b < nb; b++) quantize_block_ref(x + b * QK, mode, q8 + b * QK, q16 + b * QK * width, d + b);
}

/* --- the integer sums ------------------------------------------------------------------------ */

int32_t dot_q8_0_q8_ref(const int8_t *w, const int8_t *a) {
    int32_t s = 0;
    for (int i = 0; i < QK; i++) s += (int32_t)w[i] * a[i];
    return s;
}

int32_t dot_q4_q8_ref(const uint8_t *w, const int8_t *a) {
    int32_t s = 0;
    for (int j = 0; j < QK / 2; j++) s += (w[j] & 15) * a[j] + (w[j] >> 4) * a[j + QK / 2];
    return s;
}

int32_t dot_q8_0_i16_ref(const int8_t *w, const int16_t *a) {
    int32_t s = 0;
    for (int i = 0; i < QK; i++) s += (int32_t)w[i] * a[i];
    return s;
}

int32_t dot_q4_i16_ref(const uint8_t *w, const int16_t *a) {
    int32_t s = 0;
    for (int j = 0; j < QK / 2; j++) s += (w[j] & 15) * a[j] + (w[j] >> 4) * a[j + QK / 2];
    return s;
}

/* The X16 formats' portable reference: each row's block gathered back into row order and summed by
   dot_*_ref, q4_0's -8 and q8_0's offset folded into the int32 sum as the vector kernel folds
   them; then the same FMAs, lane by lane and block by block, as x16_rows512: the same bits. */
static int32_t x16_block_ref(int fmt, const uint8_t *wb, int i, const int8_t *a, int32_t asum) {
    uint8_t row[QK];
    const int units = fmt == Q8_0_Q8_X16 ? QK / 4 : QK / 8;
    for (int u = 0; u < units; u++) memcpy(row + 4 * u, wb + (long)u * 4 * XG + 4 * i, 4);
    if (fmt == Q8_0_Q8_X16) return dot_q8_0_q8_ref((const int8_t *)row, a);
    return dot_q4_q8_ref(row, a) - (fmt == Q4_0_Q8_X16 ? 8 * asum : 0);
}

HIDDEN void x16_rows_ref(int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,
                         const int8_t *xq, const float *xd, const float *xs, int M, float *y, const float *bias) {
    const int nb = K / QK, bb = fmt == Q8_0_Q8_X16 ? QK * XG : QK * XG / 2, n0 = c * XG;
    const uint8_t *wg = (const uint8_t *)w + (long)c * nb * bb;
    const int32_t *asum = (const int32_t *)xs;
    for (int r = 0; r < M; r++)
        for (int i = 0; i < XG && n0 + i < N; i++) {
            float acc = 0.0f, macc = 0.0f;
            for (int b = 0; b < nb; b++) {
                const int32_t as = asum[r * nb + b];
                const int32_t s = x16_block_ref(fmt, wg + (long)b * bb, i, xq + (long)r * K + b * QK, as);
                const long at = ((long)c * nb + b) * XG + i;
                acc = fmaf((float)s, fp16_to_fp32(d[at]) * xd[r * nb + b], acc);
                if (fmt == Q4_1_Q8_X16) macc = fmaf(fp16_to_fp32(m[at]), xd[r * nb + b] * (float)as, macc);
            }
            float o = fmt == Q4_1_Q8_X16 ? acc + macc : acc;
            if (bias) o += bias[n0 + i];
            y[(long)r * N + n0 + i] = o;
        }
}

/* The int16-activation X16 formats' reference: each lane's block value from the codes rebuilt
   (c = 256 hi + lo) and dot_*_i16_ref, then x16w_rows512's FMAs in its order. */
static float x16w_block_ref(int fmt, const uint8_t *wb, int i, const int8_t *a) {
    uint8_t row[QK];
    const int units = X16_Q8W(fmt) ? QK / 4 : QK / 8, P = X16_PLANES(fmt);
    for (int u = 0; u < units; u++) memcpy(row + 4 * u, wb + (long)u * 4 * XG + 4 * i, 4);
    float out = 0.0f;
    for (int pair = 0; pair < P / 2; pair++) {
        int16_t c[QK];
        for (int j = 0; j < QK; j++) c[j] = (int16_t)(a[pair * 64 + 32 + j] * 256 + (uint8_t)a[pair * 64 + j]);
        const int32_t s = X16_Q8W(fmt) ? dot_q8_0_i16_ref((const int8_t *)row, c) : dot_q4_i16_ref(row, c);
        out = pair ? fmaf((float)s, 1.0f / 32768.0f, out) : (float)s;
    }
    return out;
}

HIDDEN void x16w_rows_ref(int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,
                          const int8_t *xq, const float *xd, const float *xs, int M, float *y, const float *bias) {
    const int nb = K / QK, bb = X16_Q8W(fmt) ? QK * XG : QK * XG / 2, n0 = c * XG, P = X16_PLANES(fmt);
    const uint8_t *wg = (const uint8_t *)w + (long)c * nb * bb;
    for (int r = 0; r < M; r++)
        for (int i = 0; i < XG && n0 + i < N; i++) {
            float acc = 0.0f, macc = 0.0f;
            for (int b = 0; b < nb; b++) {
                const float sf = x16w_block_ref(fmt, wg + (long)b * bb, i, xq + ((long)r * K + b * QK) * P);
                const long at = ((long)c * nb + b) * XG + i;
                acc = fmaf(sf, fp16_to_fp32(d[at]) * xd[r * nb + b], acc);
                if (!X16_Q8W(fmt)) macc = fmaf(fp16_to_fp32(m[at]), xs[r * nb + b], macc);
            }
            float o = X16_Q8W(fmt) ? acc : acc + macc;
            if (bias) o += bias[n0 + i];
            y[(long)r * N + n0 + i] = o;
        }
}

/* x16_block_ref for the 16 rows of one block */
HIDDEN void x16_sums_ref(int fmt, const uint8_t *wb, const int8_t *a, int32_t asum, int32_t *out) {
    for (int i = 0; i < XG; i++) out[i] = x16_block_ref(fmt, wb, i, a, asum);
}

/* block_sums at the scalar level: dot_*_ref per block */
HIDDEN void block_sums_ref(int kind, const void *w, const void *a, int n, int32_t *out) {
    const int8_t *w8 = w, *a8 = a;
    const uint8_t *w4 = w;
    const int16_t *a16 = a;
    for (int b = 0; b < n; b++) {
        const int8_t *wb8 = w8 + b * QK, *ab8 = a8 + b * QK;
        const uint8_t *wb4 = w4 + b * QK / 2;
        const int16_t *ab16 = a16 + b * QK;
        out[b] = kind == 0 ? dot_q8_0_q8_ref(wb8, ab8) : kind == 1 ? dot_q4_q8_ref(wb4, ab8)
                 : kind == 2 ? dot_q8_0_i16_ref(wb8, ab16) : dot_q4_i16_ref(wb4, ab16);
    }
}

HIDDEN void codes_to_planes(int8_t *q, long nblocks, int split, int32_t *hsums) {
    for (long b = 0; b < nblocks; b++) {
        int16_t c[2 * QK];
        int8_t *blk = q + b * QK * 2 * (split ? 2 : 1);
        memcpy(c, blk, sizeof(int16_t) * QK * (split ? 2 : 1));
        int32_t hs[2] = {0, 0};
        for (int pair = 0; pair < (split ? 2 : 1); pair++)
            for (int j = 0; j < QK; j++) {
                const int16_t v = c[pair * QK + j];
                blk[pair * 64 + j] = (int8_t)(uint8_t)(v & 255);
                blk[pair * 64 + 32 + j] = (int8_t)(v >> 8);
                hs[pair] += (int8_t)(v >> 8);
            }
        if (hsums) hsums[b] = (int32_t)((uint32_t)hs[1] << 16) | (hs[0] & 0xFFFF);
    }
}

/* --- the row-major products: one weight row times up to QTR activation rows -------------------- */

INLINE void tile_q8_0_q8(const int RR, const int8_t *wq, const uint16_t *wd, const int8_t *xq,
                         const float *xd, int K, int nb, float *out) {
    for (int r = 0; r < RR; r++) {
        float acc = 0.0f;
        for (int b = 0; b < nb; b++) {
            const int32_t s = dot_q8_0_q8_ref(wq + b * QK, xq + (long)r * K + b * QK);
            acc += fp16_to_fp32(wd[b]) * xd[r * nb + b] * (float)s;
        }
        out[r] = acc;
    }
}

INLINE void tile_q4_1_q8(const int RR, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm,
                         const int8_t *xq, const float *xd, const float *xs, int K, int nb, float *out) {
    for (int r = 0; r < RR; r++) {
        float acc = 0.0f, macc = 0.0f;
        for (int b = 0; b < nb; b++) {
            const int32_t s = dot_q4_q8_ref(wq + b * QK / 2, xq + (long)r * K + b * QK);
            const float dw = fp16_to_fp32(wd[b]);
            acc += dw * xd[r * nb + b] * (float)s;
            macc += (wm ? fp16_to_fp32(wm[b]) : -8.0f * dw) * xs[r * nb + b];
        }
        out[r] = acc + macc;
    }
}

INLINE void tile_q8_0_f32(const int RR, const int8_t *wq, const uint16_t *wd, const float *x, int K, int nb,
                          float *out) {
    for (int r = 0; r < RR; r++) {
        float acc = 0.0f;
        for (int b = 0; b < nb; b++) {
            float s = 0.0f;
            for (int i = 0; i < QK; i++) s += (float)wq[b * QK + i] * x[(long)r * K + b * QK + i];
            acc += fp16_to_fp32(wd[b]) * s;
        }
        out[r] = acc;
    }
}

INLINE void tile_q4_1_f32(const int RR, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm,
                          const float *x, const float *xs, int K, int nb, float *out) {
    for (int r = 0; r < RR; r++) {
        float acc = 0.0f;
        for (int b = 0; b < nb; b++) {
            const uint8_t *qb = wq + b * QK / 2;
            const float *xb = x + (long)r * K + b * QK;
            float s = 0.0f;
            for (int j = 0; j < QK / 2; j++) s += (float)(qb[j] & 15) * xb[j] + (float)(qb[j] >> 4) * xb[j + QK / 2];
            acc += fp16_to_fp32(wd[b]) * s + fp16_to_fp32(wm[b]) * xs[r * nb + b];
        }
        out[r] = acc;
    }
}
INLINE void tile_blocks_i16(const int RR, const int split, const int8_t *w8, const uint8_t *w4, const uint16_t *wd,
                            const uint16_t *wm, const int16_t *xq, const float *xd, const float *xs, int K,
                            int nb, float *out) {
    (void)split;   /* the portable fp32 products multiply floats (tile_q8_0_f32, tile_q4_1_f32) */
    for (int r = 0; r < RR; r++) {
        float acc = 0.0f;
        for (int b = 0; b < nb; b++) {
            const int16_t *a = xq + (long)r * K + b * QK;
            const int32_t s = w4 ? dot_q4_i16_ref(w4 + b * QK / 2, a) : dot_q8_0_i16_ref(w8 + b * QK, a);
            acc += fp16_to_fp32(wd[b]) * xd[r * nb + b] * (float)s;
            if (w4) acc += fp16_to_fp32(wm[b]) * xs[r * nb + b];
        }
        out[r] = acc;
    }
}

/* The portable reference (cpu_isa.c's scalar level): fp32 activations for the fp32 products. */
HIDDEN void quant_rows_ref(int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,
                           const float *x, const int8_t *xq, const float *xd, const float *xs, int M, float *y,
                           const float *bias) {
    const int nb = K / QK, n0 = c * ROWS_CHUNK, n1 = N - n0 < ROWS_CHUNK ? N : n0 + ROWS_CHUNK;
    for (int r0 = 0; r0 < M; r0 += QTR) {
        const int rr = M - r0 < QTR ? M - r0 : QTR;
        float *yr = y + (long)r0 * N;
        const int8_t *xr = xq + (long)r0 * K * (fmt == Q8_0_I16 || fmt == Q4_1_I16 ? 2 : 1);
        for (int n = n0; n < n1; n++) {
            const int8_t *w8 = (const int8_t *)w + (long)n * K;
            const uint8_t *w4 = (const uint8_t *)w + (long)n * (K / 2);
            const uint16_t *dn = d + (long)n * nb, *mn = m ? m + (long)n * nb : NULL;
            const float *xf = x + (long)r0 * K, *xdr = xd + r0 * nb, *xsr = xs + r0 * nb;
            float o[QTR];
            switch (fmt) {
            case Q8_0_Q8: tile_q8_0_q8(rr, w8, dn, xr, xdr, K, nb, o); break;
            case Q8_0_F32: tile_q8_0_f32(rr, w8, dn, xf, K, nb, o); break;
            case Q4_1_F32: tile_q4_1_f32(rr, w4, dn, mn, xf, xsr, K, nb, o); break;
            case Q8_0_I16: tile_blocks_i16(rr, 0, w8, NULL, dn, NULL, (const int16_t *)xr, xdr, NULL, K, nb, o); break;
            case Q4_1_I16: tile_blocks_i16(rr, 0, NULL, w4, dn, mn, (const int16_t *)xr, xdr, xsr, K, nb, o); break;
            default: tile_q4_1_q8(rr, w4, dn, mn, xr, xdr, xsr, K, nb, o);
            }
            for (int r = 0; r < rr; r++) yr[(long)r * N + n] = o[r] + (bias ? bias[n] : 0.0f);
        }
    }
}

/* --- a weight block's codes (quant_gemv.c's quantize_blocks_best) ------------------------------ */

static inline void block_codes_ref(const float *x, float inv, float qmin, float qmax, float *c, float *xc, float *cc) {
    float a = 0.0f, b = 0.0f;
    for (int j = 0; j < QK; j++) {
        const float q = fminf(fmaxf(rintf(x[j] * inv), qmin), qmax);
        if (c) c[j] = q;
        a += x[j] * q;
        b += q * q;
    }
    *xc = a;
    *cc = b;
}

HIDDEN void best_block_ref(const float *x, int qmin, int qmax, const float *f, int nf, int8_t *codes, float *d) {
    best_block(block_codes_ref, x, qmin, qmax, f, nf, codes, d);
}

/* --- a weight row's values (quant_gemv.c's dequantize_rows) ------------------------------------ */

HIDDEN void dequantize_row_ref(int fmt, const uint8_t *qs, long qstride, const uint16_t *d, const uint16_t *m,
                               long sstride, int K, float *out) {
    const int nb = K / QK, bytes = fmt == 0 ? QK : QK / 2;
    for (int b = 0; b < nb; b++) {
        uint8_t blk[QK];
        for (int i = 0; i < bytes; i++) {
            const int at = b * bytes + i;
            blk[i] = qs[(long)(at / 4) * qstride + at % 4];
        }
        const float s = fp16_to_fp32(d[(long)b * sstride]);
        float *o = out + (long)b * QK;
        if (fmt == 0) {
            for (int j = 0; j < QK; j++) o[j] = (float)(int8_t)blk[j] * s;
        } else if (fmt == 1) {
            for (int j = 0; j < QK / 2; j++) {
                o[j] = (float)((blk[j] & 15) - 8) * s;
                o[j + QK / 2] = (float)((blk[j] >> 4) - 8) * s;
            }
        } else {
            const float mn = fp16_to_fp32(m[(long)b * sstride]);
            for (int j = 0; j < QK / 2; j++) {
                o[j] = (float)(blk[j] & 15) * s + mn;
                o[j + QK / 2] = (float)(blk[j] >> 4) * s + mn;
            }
        }
    }
}
