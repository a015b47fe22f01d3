/* AArch64's neon kernel for the stored GGUF formats (quant_gemv_kq.h: Q5_0, Q5_1, Q4_K, Q5_K, Q6_K
   with int16 or split int16 activation codes): quant_gemv_kq_x86.c's shape in 128-bit halves. Eight
   32-blocks per step, their codes widened to int16 once, each block's int32 sums by widening
   multiply-adds (vmull_s16 / vmlal_s16) and an across-lanes add (exact), then the header's fp32
   operations with the eight lanes as two float32x4 halves (the same fused multiply-adds lane for
   lane): the reference's products bit for bit (tests/model/test_cross_arm.py, under qemu). */

#include "quant_gemv_kq.h"

#if HAVE_NEON

/* 16 bytes -> two int16x8 (elements 0..7, 8..15), less off */
static inline void kq_widen_neon(uint8x16_t q, int off, int16x8_t *w) {
    const int16x8_t o = vdupq_n_s16((int16_t)off);
    w[0] = vsubq_s16(vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(q))), o);
    w[1] = vsubq_s16(vreinterpretq_s16_u16(vmovl_high_u8(q)), o);
}

/* Blocks b0 .. b0 + 7: codes w[4k .. 4k + 3] (block b0 + k's elements 0..7, 8..15, 16..23, 24..31)
   and kq_block's factors, lane k of each 8-float array. */
INLINE void kq_group_neon(const int kind, const uint8_t *row, int b0, int16x8_t *w, float *fw, float *mw, float *sclo,
                          float *schi) {
    const uint8x16_t low4 = vdupq_n_u8(15);
    if (kind == KQ_Q5_0 || kind == KQ_Q5_1) {
        const int at = kind == KQ_Q5_0 ? 2 : 4;
        static const uint8_t bits[8] = {1, 2, 4, 8, 16, 32, 64, 128};
        const uint8x8_t mask = vld1_u8(bits);
        for (int k = 0; k < 8; k++) {
            const uint8_t *blk = row + (long)(b0 + k) * kq_block_bytes(kind), *qh = blk + at;
            fw[k] = fp16_to_fp32(kq_u16(blk));
            mw[k] = kind == KQ_Q5_1 ? fp16_to_fp32(kq_u16(blk + 2)) : 0.0f;
            const uint8x16_t v = vld1q_u8(blk + at + 4), five = vdupq_n_u8(16);
            const uint8x16_t h0 = vandq_u8(vcombine_u8(vtst_u8(vdup_n_u8(qh[0]), mask), vtst_u8(vdup_n_u8(qh[1]), mask)), five);
            const uint8x16_t h1 = vandq_u8(vcombine_u8(vtst_u8(vdup_n_u8(qh[2]), mask), vtst_u8(vdup_n_u8(qh[3]), mask)), five);
            const int off = kind == KQ_Q5_0 ? 16 : 0;
            kq_widen_neon(vorrq_u8(vandq_u8(v, low4), h0), off, w + 4 * k);
            kq_widen_neon(vorrq_u8(vshrq_n_u8(v, 4), h1), off, w + 4 * k + 2);
        }
        return;
    }
    const uint8_t *blk = row + (long)(b0 / 8) * kq_block_bytes(kind);
    if (kind == KQ_Q6_K) {
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = fp16_to_fp32(kq_u16(blk + 208));
        for (int k = 0; k < 8; k++) sclo[k] = (float)sc[2 * k], schi[k] = (float)sc[2 * k + 1], fw[k] = d, mw[k] = 0.0f;
        for (int n = 0; n < 2; n++)
            for (int half = 0; half < 2; half++) {
                const uint8x16_t qh = vld1q_u8(blk + 128 + 32 * n + 16 * half);
                for (int qd = 0; qd < 4; qd++) {
                    const uint8x16_t v = vld1q_u8(blk + 64 * n + (qd & 1) * 32 + 16 * half);
                    const uint8x16_t l4 = qd < 2 ? vandq_u8(v, low4) : vshrq_n_u8(v, 4);
                    const uint8x16_t h2 = vshlq_n_u8(vandq_u8(vshlq_u8(qh, vdupq_n_s8((int8_t)(-2 * qd))), vdupq_n_u8(3)), 4);
                    kq_widen_neon(vorrq_u8(l4, h2), 32, w + 4 * (4 * n + qd) + 2 * half);
                }
            }
        return;
    }
    const float d = fp16_to_fp32(kq_u16(blk)), dmin = fp16_to_fp32(kq_u16(blk + 2));
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        kq_scale_min(j, blk + 4, &sc, &mn);
        fw[j] = d * (float)sc;
        mw[j] = -(dmin * (float)mn);
    }
    const uint8_t *qs = blk + (kind == KQ_Q4_K ? 16 : 48);
    for (int half = 0; half < 2; half++) {
        const uint8x16_t qh = vld1q_u8(blk + 16 + 16 * half);
        for (int c = 0; c < 4; c++) {
            const uint8x16_t v = vld1q_u8(qs + 32 * c + 16 * half);
            uint8x16_t lo = vandq_u8(v, low4), hi = vshrq_n_u8(v, 4);
            if (kind == KQ_Q5_K) {
                const uint8x16_t one = vdupq_n_u8(1);
                lo = vorrq_u8(lo, vshlq_n_u8(vandq_u8(vshlq_u8(qh, vdupq_n_s8((int8_t)(-2 * c))), one), 4));
                hi = vorrq_u8(hi, vshlq_n_u8(vandq_u8(vshlq_u8(qh, vdupq_n_s8((int8_t)(-2 * c - 1))), one), 4));
            }
            kq_widen_neon(lo, 0, w + 4 * (2 * c) + 2 * half);
            kq_widen_neon(hi, 0, w + 4 * (2 * c + 1) + 2 * half);
        }
    }
}

/* sum of w[0..n) . a (int16x8 each) in int32 (exact: |products| < 2^21, 8 per lane) */
static inline int32_t kq_dot_neon(const int16x8_t *w, const int16_t *a, int n) {
    int32x4_t s = vdupq_n_s32(0);
    for (int i = 0; i < n; i++) {
        const int16x8_t av = vld1q_s16(a + 8 * i);
        s = vmlal_s16(s, vget_low_s16(w[i]), vget_low_s16(av));
        s = vmlal_high_s16(s, w[i], av);
    }
    return vaddvq_s32(s);
}

/* The eight blocks' values v (kq_value) as two float32x4 (blocks 0..3, 4..7): all 32 elements, or
   (half 1 / 2) one 16-element half of each. */
INLINE void kq_values_neon(const int split, const int half, const int16x8_t *w, const int16_t *a, float32x4_t *v) {
    const int P = split ? 2 : 1;
    int32_t sh[8], sl[8];
    for (int k = 0; k < 8; k++) {
        const int16_t *h = a + (long)k * QK * P;
        const int16x8_t *wk = w + 4 * k + (half ? 2 * (half - 1) : 0);
        const int n = half ? 2 : 4, at = half ? 16 * (half - 1) : 0;
        sh[k] = kq_dot_neon(wk, h + at, n);
        sl[k] = split ? kq_dot_neon(wk, h + QK + at, n) : 0;
    }
    for (int i = 0; i < 2; i++) {
        const float32x4_t vh = vcvtq_f32_s32(vld1q_s32(sh + 4 * i));
        v[i] = split ? vfmaq_f32(vh, vcvtq_f32_s32(vld1q_s32(sl + 4 * i)), vdupq_n_f32(1.0f / 32768.0f)) : vh;
    }
}

INLINE void kq_rows_arm(const int kind, const int split, const void *wq, int c, int N, int K, const int8_t *xq,
                        const float *xd, const float *xs, int M, float *y, const float *bias) {
    const int nb = K / QK, full = nb / 8 * 8, P = split ? 2 : 1, zp = kq_zero_point(kind);
    const int n0 = c * ROWS_CHUNK, n1 = N - n0 < ROWS_CHUNK ? N : n0 + ROWS_CHUNK;
    const long rb = kq_row_bytes(kind, K);
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = (const uint8_t *)wq + n * rb;
        for (int r0 = 0; r0 < M; r0 += QTR) {
            const int rr = M - r0 < QTR ? M - r0 : QTR;
            float32x4_t acc[QTR][2], macc[QTR][2];
            for (int r = 0; r < rr; r++)
                for (int i = 0; i < 2; i++) acc[r][i] = macc[r][i] = vdupq_n_f32(0.0f);
            for (int b0 = 0; b0 < full; b0 += 8) {
                int16x8_t w[32];
                float fw[8], mw[8], sclo[8] = {0}, schi[8] = {0};
                kq_group_neon(kind, row, b0, w, fw, mw, sclo, schi);
                for (int r = 0; r < rr; r++) {
                    const long at = (long)(r0 + r) * nb + b0;
                    const int16_t *a = (const int16_t *)xq + ((long)(r0 + r) * K + (long)b0 * QK) * P;
                    float32x4_t u[2], lo[2], hi[2];
                    if (kind == KQ_Q6_K) {
                        kq_values_neon(split, 1, w, a, lo);
                        kq_values_neon(split, 2, w, a, hi);
                        for (int i = 0; i < 2; i++)   /* fmaf(v_lo, sc_lo, v_hi * sc_hi) */
                            u[i] = vfmaq_f32(vmulq_f32(hi[i], vld1q_f32(schi + 4 * i)), lo[i], vld1q_f32(sclo + 4 * i));
                    } else {
                        kq_values_neon(split, 0, w, a, u);
                    }
                    for (int i = 0; i < 2; i++) {
                        const float32x4_t f = vmulq_f32(vld1q_f32(fw + 4 * i), vld1q_f32(xd + at + 4 * i));
                        acc[r][i] = vfmaq_f32(acc[r][i], u[i], f);
                        if (zp) macc[r][i] = vfmaq_f32(macc[r][i], vld1q_f32(mw + 4 * i), vld1q_f32(xs + at + 4 * i));
                    }
                }
            }
            for (int r = 0; r < rr; r++) {
                float a8[8], m8[8];
                for (int i = 0; i < 2; i++) {
                    vst1q_f32(a8 + 4 * i, acc[r][i]);
                    vst1q_f32(m8 + 4 * i, macc[r][i]);
                }
                const long rn = (long)(r0 + r) * nb;
                for (int b = full; b < nb; b++)
                    kq_block_step(kind, split, row, b, (const int16_t *)xq + (long)(r0 + r) * K * P, xd + rn, xs + rn, a8, m8);
                float o = kq_hsum8(a8);
                if (zp) o = o + kq_hsum8(m8);
                if (bias) o += bias[n];
                y[(long)(r0 + r) * N + n] = o;
            }
        }
    }
}

HIDDEN void kq_rows_neon(int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,
                         const float *x, const int8_t *xq, const float *xd, const float *xs, int M, float *y,
                         const float *bias) {
    (void)d, (void)m, (void)x;
    switch (fmt) {
    case Q5_0_I16: kq_rows_arm(KQ_Q5_0, 0, w, c, N, K, xq, xd, xs, M, y, bias); break;
    case Q5_1_I16: kq_rows_arm(KQ_Q5_1, 0, w, c, N, K, xq, xd, xs, M, y, bias); break;
    case Q4_K_I16: kq_rows_arm(KQ_Q4_K, 0, w, c, N, K, xq, xd, xs, M, y, bias); break;
    case Q5_K_I16: kq_rows_arm(KQ_Q5_K, 0, w, c, N, K, xq, xd, xs, M, y, bias); break;
    case Q6_K_I16: kq_rows_arm(KQ_Q6_K, 0, w, c, N, K, xq, xd, xs, M, y, bias); break;
    case Q5_0_F32: kq_rows_arm(KQ_Q5_0, 1, w, c, N, K, xq, xd, xs, M, y, bias); break;
    case Q5_1_F32: kq_rows_arm(KQ_Q5_1, 1, w, c, N, K, xq, xd, xs, M, y, bias); break;
    case Q4_K_F32: kq_rows_arm(KQ_Q4_K, 1, w, c, N, K, xq, xd, xs, M, y, bias); break;
    case Q5_K_F32: kq_rows_arm(KQ_Q5_K, 1, w, c, N, K, xq, xd, xs, M, y, bias); break;
    default: kq_rows_arm(KQ_Q6_K, 1, w, c, N, K, xq, xd, xs, M, y, bias);
    }
}

#endif
