/* AArch64's level (neon) of the quantized products (quant_gemv.c's dispatch picks it;
   quant_gemv_ref.c holds the reference it reproduces): 128-bit sdot (vdotq_s32) for the int8
   products where the build has the dot-product extension, else widening multiplies; vmull_s16 for
   the int16 ones. Every row-major format runs with avx2's lanes and order (quant_gemv_x86.c), so
   its products are the x86 avx2 products bit for bit (tests/model/test_cross_arm.py); the row-
   interleaved (x16) layout has kernels for the q8 activations in a +dotprod build (sdot by lane),
   bit-identical to the reference. Also the activation codes 4 at a time. */

#include "quant_gemv_arm.h"

#if HAVE_NEON
/* --- the activation codes -------------------------------------------------------------------- */

/* The same codes 4 at a time on ARM: vmaxq keeps a NaN (as the reference's test does: x86's max_ps
   drops it), vcvtnq rounds to nearest even (as rintf), the saturating narrows are the packs. */
static void quantize_block_neon(const float *xb, int mode, int8_t *q8, int16_t *q16, float *d) {
    float32x4_t v[8], mx = vdupq_n_f32(0.0f);
    for (int j = 0; j < 8; j++) {
        v[j] = vld1q_f32(xb + 4 * j);
        mx = vmaxq_f32(mx, vabsq_f32(v[j]));
    }
    float inv;
    block_scale(vmaxvq_f32(mx), mode, d, &inv);
    int32x4_t c[8], r[8];
    for (int j = 0; j < 8; j++) {
        const float32x4_t scaled = vmulq_f32(v[j], vdupq_n_f32(inv));
        c[j] = vcvtnq_s32_f32(scaled);
        if (mode == ACT_SPLIT)   /* the residual x / s - h is exact; l rounds it at 2^-15 */
            r[j] = vcvtnq_s32_f32(vmulq_f32(vsubq_f32(scaled, vcvtq_f32_s32(c[j])), vdupq_n_f32(32768.0f)));
    }
    int16x8_t h[4];
    for (int j = 0; j < 4; j++) h[j] = vcombine_s16(vqmovn_s32(c[2 * j]), vqmovn_s32(c[2 * j + 1]));
    if (mode == ACT_Q8) {
        vst1q_s8(q8, vcombine_s8(vqmovn_s16(h[0]), vqmovn_s16(h[1])));
        vst1q_s8(q8 + 16, vcombine_s8(vqmovn_s16(h[2]), vqmovn_s16(h[3])));
        return;
    }
    for (int j = 0; j < 4; j++) {
        vst1q_s16(q16 + 8 * j, h[j]);
        if (mode == ACT_SPLIT)
            vst1q_s16(q16 + QK + 8 * j, vcombine_s16(vqmovn_s32(r[2 * j]), vqmovn_s32(r[2 * j + 1])));
    }
}

HIDDEN void quantize_row_neon(const float *x, int nb, int mode, int8_t *q8, int16_t *q16, float *d) {
    const int width = mode == ACT_SPLIT ? 2 : 1;   /* codes per element */
    for (int b = 0; b < nb; b++) quantize_block_neon(x + b * QK, mode, q8 + b * QK, q16 + b * QK * width, d + b);
}

/* --- ARM (the neon level): avx2's lanes, two 128-bit halves at a time --------------------------

   avx2's block_rows, lane for lane: a block's 8 int32 lanes (lane i summing elements 4i..4i+3 of
   the int8 products, or 2i, 2i+1, 16+2i, 17+2i of the int16 ones) are the same exact sums here,
   held as two int32x4 (lanes 0-3, 4-7); each converts to float exactly and goes into its row's even
   or odd accumulator by one fused multiply-add with the same factor; the factors, the minimums'
   lanes (block_factors' groups of 8 blocks, its masked tail and its scalar remainder), the sum of
   the two accumulators and hsum8's order are avx2's too. So a neon product is avx2's bit for bit
   (tests/model/test_cross_arm.py compares them). */

/* The 4 int32 lanes of 16 int8 x int8 products, lane i summing bytes 4i..4i+3 (vpdpbusd's and
   maddubs/madd's lanes): sdot where the build has the dot-product extension, else widening
   multiplies (int16, |w a| <= 128 x 128) and two pairwise widening adds. Exact either way. */
INLINE int32x4_t dot_s8x16(int8x16_t w, int8x16_t a) {
#if HAVE_NEON_DOT
    return vdotq_s32(vdupq_n_s32(0), w, a);
#else
    return vpaddq_s32(vpaddlq_s16(vmull_s8(vget_low_s8(w), vget_low_s8(a))), vpaddlq_s16(vmull_high_s8(w, a)));
#endif
}

/* madd_epi16's 4 int32 lanes of 8 int16 products: lane i = w[2i] a[2i] + w[2i+1] a[2i+1]. */
INLINE int32x4_t madd_s16x8(int16x8_t w, int16x8_t a) {
    return vpaddq_s32(vmull_s16(vget_low_s16(w), vget_low_s16(a)), vmull_high_s16(w, a));
}

/* One q8_0 block's codes (w8) or q4 block's nibbles (w4) as two int8x16: elements 0..15, 16..31. */
INLINE void weights_s8(const int8_t *w8, const uint8_t *w4, int8x16_t *lo, int8x16_t *hi) {
    if (w4) {
        const uint8x16_t bytes = vld1q_u8(w4);
        *lo = vreinterpretq_s8_u8(vandq_u8(bytes, vdupq_n_u8(15)));
        *hi = vreinterpretq_s8_u8(vshrq_n_u8(bytes, 4));
    } else {
        *lo = vld1q_s8(w8);
        *hi = vld1q_s8(w8 + 16);
    }
}

/* The block's 8 exact int32 lanes against q8 codes a (int8 weights lo, hi from weights_s8). */
INLINE void dots_q8(int8x16_t lo, int8x16_t hi, const int8_t *a, int32x4_t *s) {
    s[0] = dot_s8x16(lo, vld1q_s8(a));
    s[1] = dot_s8x16(hi, vld1q_s8(a + 16));
}

/* The block's 8 exact int32 lanes against int16 codes a (the weights widened: w16[0..3] elements
   0..7, 8..15, 16..23, 24..31): avx2's madd(lo, a0) + madd(hi, a1). */
INLINE void dots_i16(const int16x8_t *w16, const int16_t *a, int32x4_t *s) {
    s[0] = vaddq_s32(madd_s16x8(w16[0], vld1q_s16(a)), madd_s16x8(w16[2], vld1q_s16(a + 16)));
    s[1] = vaddq_s32(madd_s16x8(w16[1], vld1q_s16(a + 8)), madd_s16x8(w16[3], vld1q_s16(a + 24)));
}

INLINE void weights_s16(int8x16_t lo, int8x16_t hi, int16x8_t *w16) {
    w16[0] = vmovl_s8(vget_low_s8(lo));
    w16[1] = vmovl_high_s8(lo);
    w16[2] = vmovl_s8(vget_low_s8(hi));
    w16[3] = vmovl_high_s8(hi);
}

/* 8 fp16 values from p as two float32x4 (exact). */
INLINE void fp16x8(const uint16_t *p, float32x4_t *v) {
    v[0] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
    v[1] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4)));
}

/* avx2's factors8: blocks b..b+7's factors f[r][b] = d y_r, and macc[r] += m z_r lane-wise where
   keep (all ones, or the fresh lanes of a tail) lets z through. */
INLINE void factors8_neon(const int RR, const uint16_t *d, const float *y, long ys, const uint16_t *m, const float *z,
                          long zs, int b, const uint32x4_t *keep, float f[][FACTOR_CHUNK], float32x4_t (*macc)[2]) {
    float32x4_t dv[2], mv[2];
    fp16x8(d + b, dv);
    if (z) {
        if (m) fp16x8(m + b, mv);
        else for (int h = 0; h < 2; h++) mv[h] = vmulq_f32(dv[h], vdupq_n_f32(-8.0f));
        for (int r = 0; r < RR; r++)
            for (int h = 0; h < 2; h++) {
                const uint32x4_t zv = vandq_u32(keep[h], vreinterpretq_u32_f32(vld1q_f32(z + r * zs + b + 4 * h)));
                macc[r][h] = vfmaq_f32(macc[r][h], mv[h], vreinterpretq_f32_u32(zv));
            }
    }
    for (int r = 0; r < RR; r++)
        for (int h = 0; h < 2; h++) vst1q_f32(f[r] + b + 4 * h, vmulq_f32(dv[h], vld1q_f32(y + r * ys + b + 4 * h)));
}

/* avx2's block_factors for n <= FACTOR_CHUNK blocks (y never NULL here): groups of 8, the last 8
   again with only the fresh lanes' minimums, or (n < 8) one block at a time summed into lane 0. */
INLINE void block_factors_neon(const int RR, const uint16_t *d, const float *y, long ys, const uint16_t *m,
                               const float *z, long zs, int n, float f[][FACTOR_CHUNK], float32x4_t (*macc)[2]) {
    static const uint32_t lanes[16] = {0, 0, 0, 0, 0, 0, 0, 0, ~0u, ~0u, ~0u, ~0u, ~0u, ~0u, ~0u, ~0u};
    const uint32x4_t all[2] = {vdupq_n_u32(~0u), vdupq_n_u32(~0u)};
    int b = 0;
    for (; b + 8 <= n; b += 8) factors8_neon(RR, d, y, ys, m, z, zs, b, all, f, macc);
    if (b < n && n >= 8) {
        const uint32x4_t fresh[2] = {vld1q_u32(lanes + (n - b)), vld1q_u32(lanes + (n - b) + 4)};
        factors8_neon(RR, d, y, ys, m, z, zs, n - 8, fresh, f, macc);
        b = n;
    }
    float ms[QTR] = {0.0f};
    for (; b < n; b++) {   /* fmaf: avx2's fused multiply-add, stated (block_factors) */
        const float dw = fp16_to_fp32(d[b]), mw = m ? fp16_to_fp32(m[b]) : -8.0f * dw;
        for (int r = 0; r < RR; r++) {
            f[r][b] = dw * y[r * ys + b];
            if (z) ms[r] = fmaf(mw, z[r * zs + b], ms[r]);
        }
    }
    if (z)
        for (int r = 0; r < RR; r++) {
            macc[r][0] = vaddq_f32(macc[r][0], vsetq_lane_f32(ms[r], vdupq_n_f32(0.0f), 0));
            macc[r][1] = vaddq_f32(macc[r][1], vdupq_n_f32(0.0f));
        }
}

/* One block (blk: its index in the row w8) times RR rows' codes, added to acc[r] (lanes 0-3, 4-7)
   with factor f[r]: avx2's q8_0_q8_block, q4_q8_block and i16_block. */
INLINE void block_neon(const int RR, const int FMT, const int8_t *w8, long blk, const int8_t *xq, int K,
                       const float *f, long fs, float32x4_t (*acc)[2]) {
    const int zp = ZERO_POINT(FMT), split = FMT == Q8_0_F32 || FMT == Q4_1_F32, width = split ? 2 : 1;
    const int q8 = FMT == Q8_0_Q8 || FMT == Q4_1_Q8 || FMT == Q4_0_Q8;
    int8x16_t lo, hi;
    weights_s8(zp ? NULL : w8 + blk * QK, zp ? (const uint8_t *)w8 + blk * QK / 2 : NULL, &lo, &hi);
    int16x8_t w16[4];
    if (!q8) weights_s16(lo, hi, w16);
    for (int r = 0; r < RR; r++) {
        int32x4_t s[2], t[2];
        if (q8) dots_q8(lo, hi, xq + (long)r * K + blk * QK, s);
        else dots_i16(w16, (const int16_t *)xq + ((long)r * K + blk * QK) * width, s);
        if (split)   /* + the residual codes' sum / 2^15: one rounding, where the sums meet */
            dots_i16(w16, (const int16_t *)xq + ((long)r * K + blk * QK) * width + QK, t);
        const float32x4_t fv = vdupq_n_f32(f[r * fs]);
        for (int h = 0; h < 2; h++) {
            float32x4_t sf = vcvtq_f32_s32(s[h]);
            if (split) sf = vfmaq_f32(sf, vcvtq_f32_s32(t[h]), vdupq_n_f32(1.0f / 32768.0f));
            acc[r][h] = vfmaq_f32(acc[r][h], fv, sf);
        }
    }
}

/* avx2's block_rows for one tile of RR activation rows: weight rows [n0, n1). */
INLINE void block_rows_neon(const int RR, const int FMT, const void *w, const uint16_t *d, const uint16_t *m, int n0,
                            int n1, int N, int K, const int8_t *xq, const float *xd, const float *xs, float *y,
                            const float *bias) {
    const int nb = K / QK, zp = ZERO_POINT(FMT);
    const long row_bytes = zp ? K / 2 : K;
    for (int n = n0; n < n1; n++) {
        const int8_t *w8 = (const int8_t *)w + n * row_bytes;
        /* even blocks' and odd blocks' accumulators, the minimums' sums: [row][lanes 0-3, 4-7] */
        float32x4_t acc0[QTR][2], acc1[QTR][2], macc[QTR][2];
        for (int r = 0; r < RR; r++)
            for (int h = 0; h < 2; h++) acc0[r][h] = acc1[r][h] = macc[r][h] = vdupq_n_f32(0.0f);
        for (int c = 0; c < nb; c += FACTOR_CHUNK) {
            const int cn = nb - c < FACTOR_CHUNK ? nb - c : FACTOR_CHUNK;
            float f[QTR][FACTOR_CHUNK];
            block_factors_neon(RR, d + (long)n * nb + c, xd + c, nb, m ? m + (long)n * nb + c : NULL,
                               zp ? xs + c : NULL, nb, cn, f, macc);
            int b = 0;
            for (; b + 1 < cn; b += 2) {
                block_neon(RR, FMT, w8, c + b, xq, K, f[0] + b, FACTOR_CHUNK, acc0);
                block_neon(RR, FMT, w8, c + b + 1, xq, K, f[0] + b + 1, FACTOR_CHUNK, acc1);
            }
            if (b < cn) block_neon(RR, FMT, w8, c + b, xq, K, f[0] + b, FACTOR_CHUNK, acc0);
        }
        for (int r = 0; r < RR; r++) {
            float32x4_t lo = vaddq_f32(acc0[r][0], acc1[r][0]), hi = vaddq_f32(acc0[r][1], acc1[r][1]);
            if (zp) {
                lo = vaddq_f32(lo, macc[r][0]);
                hi = vaddq_f32(hi, macc[r][1]);
            }
            const float32x4_t s4 = vaddq_f32(lo, hi);   /* hsum8: (l0 + l4 + l2 + l6) + (l1 + l5 + l3 + l7) */
            const float sum = (vgetq_lane_f32(s4, 0) + vgetq_lane_f32(s4, 2))
                              + (vgetq_lane_f32(s4, 1) + vgetq_lane_f32(s4, 3));
            y[(long)r * N + n] = sum + (bias ? bias[n] : 0.0f);
        }
    }
}

#if HAVE_NEON_DOT
/* --- row-interleaved weights on ARM (neon, in a build with the dot product) ---------------------

   sdot's indexed form (vdotq_laneq_s32) multiplies one 16-byte vector of a group's unit (4 rows'
   4 bytes) by one 4-byte word of the activation block, each int32 lane summing its row: a group's
   16 rows are 4 such vectors, lanes again rows, as in the x86 x16 kernels (llama.cpp's ARM
   repack, q4_0 4x4 / 4x8, is the same idea). Signed by signed: q8_0's codes go in as they are,
   q4 nibbles (0..15) too, q4_0's -8 as -8 sum(a). The lanes are the exact sums, and the FMAs are
   x16_rows512's lane for lane: the same bits as the reference on any CPU. Without the dot
   product (ARMv8.0-A builds) x16 layers keep the reference, so there they are made 'rows'. */

/* acc[q] += the 4 rows of quad q of unit wb (64 bytes) times word LANE of a */
#define SDOT_UNIT(ACC, WB, A, LANE)                                                                   \
    for (int q = 0; q < 4; q++) ACC[q] = vdotq_laneq_s32(ACC[q], vld1q_s8((const int8_t *)(WB) + 16 * q), A, LANE);
/* the same with unit wb's low nibbles against word LANE of lo, its high ones against hi's */
#define SDOT_NIBBLES(ACL, ACH, WB, LO, HI, LANE)                                                      \
    for (int q = 0; q < 4; q++) {                                                                     \
        const uint8x16_t v = vld1q_u8((WB) + 16 * q);                                                 \
        ACL[q] = vdotq_laneq_s32(ACL[q], vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(15))), LO, LANE); \
        ACH[q] = vdotq_laneq_s32(ACH[q], vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), HI, LANE);            \
    }

/* Block wb's 16 rows' int32 sums with activation block a (sum asum): s[q] rows 4q..4q+3. */
INLINE void x16_block_neon(const int FMT, const uint8_t *wb, const int8_t *a, int32_t asum, int32x4_t *s) {
    const int8x16_t a0 = vld1q_s8(a), a1 = vld1q_s8(a + 16);   /* elements 0..15, 16..31 */
    int32x4_t t[4], u[4];
    for (int q = 0; q < 4; q++) t[q] = u[q] = vdupq_n_s32(0);
    if (FMT == Q8_0_Q8_X16) {   /* unit j: elements 4j..4j+3 */
        SDOT_UNIT(t, wb, a0, 0) SDOT_UNIT(u, wb + 64, a0, 1) SDOT_UNIT(t, wb + 128, a0, 2) SDOT_UNIT(u, wb + 192, a0, 3)
        SDOT_UNIT(t, wb + 256, a1, 0) SDOT_UNIT(u, wb + 320, a1, 1) SDOT_UNIT(t, wb + 384, a1, 2) SDOT_UNIT(u, wb + 448, a1, 3)
    } else {                    /* unit j: low nibbles elements 4j.., high ones 16 + 4j.. */
        SDOT_NIBBLES(t, u, wb, a0, a1, 0) SDOT_NIBBLES(t, u, wb + 64, a0, a1, 1)
        SDOT_NIBBLES(t, u, wb + 128, a0, a1, 2) SDOT_NIBBLES(t, u, wb + 192, a0, a1, 3)
    }
    const int32x4_t off = vdupq_n_s32(FMT == Q4_0_Q8_X16 ? -8 * asum : 0);
    for (int q = 0; q < 4; q++) s[q] = vaddq_s32(vaddq_s32(t[q], u[q]), off);
}
#undef SDOT_UNIT
#undef SDOT_NIBBLES

/* x16_rows512 with four 4-lane quads: the same FMAs per lane, in block order. */
INLINE void x16_rows_neon(const int RR, const int FMT, const uint8_t *w, const uint16_t *d, const uint16_t *m, int c,
                          int N, int K, const int8_t *xq, const float *xd, const int32_t *asum, float *y,
                          const float *bias) {
    const int nb = K / QK, bb = FMT == Q8_0_Q8_X16 ? QK * XG : QK * XG / 2;
    const uint8_t *wg = w + (long)c * nb * bb;
    const uint16_t *dg = d + (long)c * nb * XG, *mg = m ? m + (long)c * nb * XG : NULL;
    float32x4_t acc[QTR][4], macc[QTR][4];
    for (int r = 0; r < RR; r++)
        for (int q = 0; q < 4; q++) acc[r][q] = macc[r][q] = vdupq_n_f32(0.0f);
    for (int b = 0; b < nb; b++) {
        float32x4_t dw[4], mw[4];
        fp16x8(dg + b * XG, dw);
        fp16x8(dg + b * XG + 8, dw + 2);
        if (FMT == Q4_1_Q8_X16) {
            fp16x8(mg + b * XG, mw);
            fp16x8(mg + b * XG + 8, mw + 2);
        }
        for (int r = 0; r < RR; r++) {
            const int32_t as = asum[r * nb + b];
            int32x4_t s[4];
            x16_block_neon(FMT, wg + (long)b * bb, xq + (long)r * K + b * QK, as, s);
            const float32x4_t xdv = vdupq_n_f32(xd[r * nb + b]), mf = vdupq_n_f32(xd[r * nb + b] * (float)as);
            for (int q = 0; q < 4; q++) {
                acc[r][q] = vfmaq_f32(acc[r][q], vcvtq_f32_s32(s[q]), vmulq_f32(dw[q], xdv));
                if (FMT == Q4_1_Q8_X16) macc[r][q] = vfmaq_f32(macc[r][q], mw[q], mf);
            }
        }
    }
    const int n0 = c * XG, live = N - n0 < XG ? N - n0 : XG;
    for (int r = 0; r < RR; r++) {
        float o[XG];
        for (int q = 0; q < 4; q++)
            vst1q_f32(o + 4 * q, FMT == Q4_1_Q8_X16 ? vaddq_f32(acc[r][q], macc[r][q]) : acc[r][q]);
        float *yr = y + (long)r * N + n0;
        for (int i = 0; i < live; i++) yr[i] = bias ? o[i] + bias[n0 + i] : o[i];
    }
}

HIDDEN void x16_group_neon(int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,
                           const int8_t *xq, const float *xd, const float *xs, int M, float *y, const float *bias) {
    const int nb = K / QK;
#define ROWS(RR, FMT) x16_rows_neon(RR, FMT, w, d, m, c, N, K, xq + (long)r0 * K, xd + r0 * nb, \
                                    (const int32_t *)xs + r0 * nb, y + (long)r0 * N, bias)
#define TILE(RR) if (fmt == Q8_0_Q8_X16) ROWS(RR, Q8_0_Q8_X16); \
                 else if (fmt == Q4_0_Q8_X16) ROWS(RR, Q4_0_Q8_X16); else ROWS(RR, Q4_1_Q8_X16);
    FOR_ROW_TILES(M, TILE)
#undef TILE
#undef ROWS
}

/* x16_block_sums at neon: one block's 16 rows' int32 sums through x16_block_neon */
HIDDEN void x16_sums_neon(int fmt, const uint8_t *wb, const int8_t *ab, int32_t asum, int32_t *out) {
    int32x4_t s[4];
    if (fmt == Q8_0_Q8_X16) x16_block_neon(Q8_0_Q8_X16, wb, ab, asum, s);
    else if (fmt == Q4_0_Q8_X16) x16_block_neon(Q4_0_Q8_X16, wb, ab, asum, s);
    else x16_block_neon(Q4_1_Q8_X16, wb, ab, asum, s);
    for (int q = 0; q < 4; q++) vst1q_s32(out + 4 * q, s[q]);
}
#endif   /* HAVE_NEON_DOT */

/* quant_rows_vec for the neon level: every row-major format, QTR activation rows per tile. */
HIDDEN void quant_rows_neon(int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,
                            const float *x, const int8_t *xq, const float *xd, const float *xs, int M, float *y,
                            const float *bias) {
    (void)x;
    const int nb = K / QK, n0 = c * ROWS_CHUNK, n1 = N - n0 < ROWS_CHUNK ? N : n0 + ROWS_CHUNK;
    const int q8 = fmt == Q8_0_Q8 || fmt == Q4_1_Q8 || fmt == Q4_0_Q8, split = fmt == Q8_0_F32 || fmt == Q4_1_F32;
    for (int r0 = 0; r0 < M; r0 += QTR) {
        const int rr = M - r0 < QTR ? M - r0 : QTR;
        const int8_t *xr = xq + (long)r0 * K * (q8 ? 1 : split ? 4 : 2);   /* bytes of codes per row */
        float *yr = y + (long)r0 * N;
#define ROWS(RR, FMT) block_rows_neon(RR, FMT, w, d, m, n0, n1, N, K, xr, xd + r0 * nb, xs + r0 * nb, yr, bias)
#define NEON_TILE(RR)                                                                                    \
        switch (fmt) {                                                                                   \
        case Q8_0_Q8: ROWS(RR, Q8_0_Q8); break;                                                          \
        case Q8_0_F32: ROWS(RR, Q8_0_F32); break;                                                        \
        case Q4_1_F32: ROWS(RR, Q4_1_F32); break;                                                        \
        case Q8_0_I16: ROWS(RR, Q8_0_I16); break;                                                        \
        case Q4_1_I16: ROWS(RR, Q4_1_I16); break;                                                        \
        case Q4_1_Q8: ROWS(RR, Q4_1_Q8); break;                                                          \
        default: ROWS(RR, Q4_0_Q8);                                                                      \
        }
        switch (rr) {
        case 1: NEON_TILE(1) break;
        case 2: NEON_TILE(2) break;
        case 3: NEON_TILE(3) break;
        default: NEON_TILE(4)
        }
#undef NEON_TILE
#undef ROWS
    }
}

/* block_sums through neon's integer primitives as its products use them (sdot or widening
   multiplies; the 8 lanes added up in int32, exactly). */
HIDDEN void block_sums_neon(int kind, const void *w, const void *a, int n, int32_t *out) {
    const int8_t *w8 = w, *a8 = a;
    const uint8_t *w4 = w;
    const int16_t *a16 = a;
    for (int b = 0; b < n; b++) {
        const int8_t *wb8 = w8 + b * QK, *ab8 = a8 + b * QK;
        const uint8_t *wb4 = w4 + b * QK / 2;
        const int16_t *ab16 = a16 + b * QK;
        int32_t lanes[8];
        int8x16_t lo, hi;
        int16x8_t w16[4];
        int32x4_t s[2];
        weights_s8(kind & 1 ? NULL : wb8, kind & 1 ? wb4 : NULL, &lo, &hi);
        if (kind < 2) dots_q8(lo, hi, ab8, s);
        else {
            weights_s16(lo, hi, w16);
            dots_i16(w16, ab16, s);
        }
        vst1q_s32(lanes, s[0]);
        vst1q_s32(lanes + 4, s[1]);
        out[b] = hsum_i32(lanes, 8);
    }
}
#endif   /* HAVE_NEON */
