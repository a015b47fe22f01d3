/* The GGUF formats kept as stored, byte for byte (quant_gemv.h's Q5_0_I16 .. Q6_K_F32): Q5_0, Q5_1
   and the K-quants Q4_K, Q5_K, Q6_K (the formats of llama.cpp's Q4_K_M files: Gemma 3's, SmolLM2's).
   Their products (quant_gemv_kq_ref.c, the portable reference; quant_gemv_kq_x86.c, avx2 and
   avx512vnni; quant_gemv_kq_arm.c, neon) read a weight row as the file's blocks [N, row bytes] (w; no d, m tensors):

     Q5_0  22 bytes / 32:  d fp16, qh u32 (bit j: element j's 5th bit), qs[16] (byte j: element j
                           low nibble, j + 16 high);                  w = d (q - 16)
     Q5_1  24 bytes / 32:  d fp16, m fp16, qh u32, qs[16];            w = d q + m
     Q4_K  144 bytes / 256: d, dmin fp16, scales[12] (eight 6-bit scales sc_j and minimums m_j),
                           qs[128] (bytes 32c .. 32c + 31: sub-block 2c in the low nibbles, 2c + 1 in
                           the high ones);                            w = d sc_j q - dmin m_j
     Q5_K  176 bytes / 256: as Q4_K, then qh[32] (bit j of byte l: element l of sub-block j's 5th
                           bit) before qs[128];                        w = d sc_j q - dmin m_j
     Q6_K  210 bytes / 256: ql[128], qh[64], scales int8[16] (one per 16 elements), d fp16;
                           w = d sc (q - 32), q 6 bits

   The activations are quant_gemv_ref.h's per-32 codes: ACT_SPLIT for the _F32 ids (native's fp32
   activations, to within 2^-16 of their block's power-of-two scale), ACT_I16 for the _I16 ids
   (native_i16's). Every 32-block b of a row is one integer sum per 16 or 32 elements, exact in
   int32 (|q| <= 32, |code| <= 32767: < 2^25), and then these fp32 operations, in this order, at
   every level (so every level's products are the reference's bit for bit):
     v     = S (I16), or fmaf(S_l, 2^-15, S_h) (F32: the two codes' sums);
     u     = v, or for Q6_K fmaf(v_lo, sc_lo, v_hi * sc_hi) (its two 16-element halves);
     f     = fw * xd_b, fw the weight's factor (d; Q4_K, Q5_K: d * sc_j; both exact in fp32);
     acc[b % 8] = fmaf(u, f, acc[b % 8]);
     zero-point formats (Q5_1, Q4_K, Q5_K): macc[b % 8] = fmaf(mw, xs_b, macc[b % 8]), mw = m or
       -(dmin * m_j), xs_b the block's fp32 sum of x (F32) or xd_b * sum(codes) (I16);
     y = hsum8(acc) (+ hsum8(macc)) (+ bias), hsum8 = ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)),
   the order of cpu_isa.h's vector hsum8. The eight lanes are a K-quant superblock's eight 32-element
   sub-blocks, and for the 32-element formats eight consecutive blocks: one 256-bit vector of
   factors and sums per superblock in the vector kernels, no horizontal sum until the row's end. */

#ifndef CARAMBA_QUANT_GEMV_KQ_H
#define CARAMBA_QUANT_GEMV_KQ_H

#include "quant_gemv_ref.h"

enum { KQ_Q5_0 = 0, KQ_Q5_1 = 1, KQ_Q4_K = 2, KQ_Q5_K = 3, KQ_Q6_K = 4, KQ_KINDS = 5 };

static inline int is_kq(int fmt) { return fmt >= Q5_0_I16 && fmt <= Q6_K_F32; }
static inline int kq_kind(int fmt) { return (fmt - Q5_0_I16) % KQ_KINDS; }
static inline int kq_split(int fmt) { return fmt >= Q5_0_F32; }
static inline int kq_block_elems(int kind) { return kind >= KQ_Q4_K ? 256 : 32; }
static inline int kq_block_bytes(int kind) {
    static const int bytes[KQ_KINDS] = {22, 24, 144, 176, 210};
    return bytes[kind];
}
static inline long kq_row_bytes(int kind, int K) { return (long)K / kq_block_elems(kind) * kq_block_bytes(kind); }
static inline int kq_zero_point(int kind) { return kind == KQ_Q5_1 || kind == KQ_Q4_K || kind == KQ_Q5_K; }

static inline uint16_t kq_u16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static inline uint32_t kq_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Sub-block j's 6-bit scale and minimum of a Q4_K / Q5_K superblock (ggml's get_scale_min_k4). */
static inline void kq_scale_min(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* 32-block b of a weight row: its codes q[32] (Q5_0's - 16 and Q6_K's - 32 applied: signed), the
   factor fw, the minimum mw (0 without one) and Q6_K's two 16-element scales sc6. */
INLINE void kq_block(int kind, const uint8_t *row, int b, int16_t *q, float *fw, float *mw, float *sc6) {
    *mw = 0.0f;
    if (kind == KQ_Q5_0 || kind == KQ_Q5_1) {
        const uint8_t *blk = row + (long)b * kq_block_bytes(kind);
        const int off = kind == KQ_Q5_0 ? 16 : 0, at = kind == KQ_Q5_0 ? 2 : 4;
        const uint32_t qh = kq_u32(blk + at);
        const uint8_t *qs = blk + at + 4;
        *fw = fp16_to_fp32(kq_u16(blk));
        if (kind == KQ_Q5_1) *mw = fp16_to_fp32(kq_u16(blk + 2));
        for (int j = 0; j < 16; j++) {
            q[j] = (int16_t)(((qs[j] & 15) | ((qh >> j) & 1) << 4) - off);
            q[j + 16] = (int16_t)(((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - off);
        }
        return;
    }
    const uint8_t *blk = row + (long)(b / 8) * kq_block_bytes(kind);
    const int j = b % 8;
    if (kind == KQ_Q6_K) {
        const int n = j / 4, qd = j % 4;
        const uint8_t *ql = blk + 64 * n + (qd & 1) * 32, *qh = blk + 128 + 32 * n;
        const int8_t *sc = (const int8_t *)(blk + 192);
        for (int l = 0; l < 32; l++) {
            const int lo = qd < 2 ? ql[l] & 15 : ql[l] >> 4;
            q[l] = (int16_t)((lo | ((qh[l] >> (2 * qd)) & 3) << 4) - 32);
        }
        *fw = fp16_to_fp32(kq_u16(blk + 208));
        sc6[0] = (float)sc[2 * j];
        sc6[1] = (float)sc[2 * j + 1];
        return;
    }
    int sc, m;
    kq_scale_min(j, blk + 4, &sc, &m);
    const uint8_t *qs = blk + (kind == KQ_Q4_K ? 16 : 48) + 32 * (j / 2), *qh = blk + 16;
    for (int l = 0; l < 32; l++) {
        const int lo = j & 1 ? qs[l] >> 4 : qs[l] & 15;
        q[l] = (int16_t)(kind == KQ_Q5_K ? lo | ((qh[l] >> j) & 1) << 4 : lo);
    }
    *fw = fp16_to_fp32(kq_u16(blk)) * (float)sc;
    *mw = -(fp16_to_fp32(kq_u16(blk + 2)) * (float)m);
}

/* The float value of one code-sum: the int16 codes' sum, or the split codes' h + l / 2^15. */
static inline float kq_value(int split, int32_t sh, int32_t sl) {
    return split ? fmaf((float)sl, 1.0f / 32768.0f, (float)sh) : (float)sh;
}

/* The header's hsum8 on eight floats. */
static inline float kq_hsum8(const float *a) { return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); }

/* Block b's terms into acc[b % 8] (and macc[b % 8]) for one activation row (a: the row's codes,
   xd, xs its scales and sums): the reference's step, which the vector kernels' tails take too. */
INLINE void kq_block_step(int kind, int split, const uint8_t *row, int b, const int16_t *a, const float *xd,
                          const float *xs, float *acc, float *macc) {
    int16_t q[QK];
    float fw, mw, sc6[2] = {0.0f, 0.0f};
    kq_block(kind, row, b, q, &fw, &mw, sc6);
    const int16_t *h = a + (long)b * QK * (split ? 2 : 1), *l = h + QK;
    int32_t sh[2] = {0, 0}, sl[2] = {0, 0};
    for (int i = 0; i < QK; i++) {
        sh[i / 16] += q[i] * h[i];
        if (split) sl[i / 16] += q[i] * l[i];
    }
    const float u = kind == KQ_Q6_K ? fmaf(kq_value(split, sh[0], sl[0]), sc6[0], kq_value(split, sh[1], sl[1]) * sc6[1])
                                    : kq_value(split, sh[0] + sh[1], sl[0] + sl[1]);
    acc[b % 8] = fmaf(u, fw * xd[b], acc[b % 8]);
    if (kq_zero_point(kind)) macc[b % 8] = fmaf(mw, xs[b], macc[b % 8]);
}

/* Block b's 32 values into out: w = fw q + mw rounded once (fw q is exact in fp32: an fp16 scale,
   at most 6 bits of sub-scale and 6 of code), Q6_K's (d sc) q, as gguf's dequantization computes them. */
static inline void kq_dequantize_block(int kind, const uint8_t *row, int b, float *out) {
    int16_t q[QK];
    float fw, mw, sc6[2] = {0.0f, 0.0f};
    kq_block(kind, row, b, q, &fw, &mw, sc6);
    for (int i = 0; i < QK; i++) out[i] = kind == KQ_Q6_K ? fw * sc6[i / 16] * (float)q[i] : fmaf(fw, (float)q[i], mw);
}

/* --- the files' functions -------------------------------------------------------------------- */

/* one weight row's values (dequantize_rows for these formats) */
typedef void kq_dequantize_fn(int kind, const uint8_t *row, int K, float *out);

HIDDEN quant_rows_fn kq_rows_ref;
HIDDEN kq_dequantize_fn kq_dequantize_row_ref;

#if HAVE_AVX2
HIDDEN quant_rows_fn kq_rows_avx2;
HIDDEN kq_dequantize_fn kq_dequantize_row_avx2;
#define KQ_ROWS_AVX2 kq_rows_avx2
#define KQ_DEQUANTIZE_AVX2 kq_dequantize_row_avx2
#else
#define KQ_ROWS_AVX2 NULL
#define KQ_DEQUANTIZE_AVX2 NULL
#endif
#if HAVE_NEON
HIDDEN quant_rows_fn kq_rows_neon;
#define KQ_ROWS_NEON kq_rows_neon
#else
#define KQ_ROWS_NEON NULL
#endif
#if HAVE_AVX512VNNI
HIDDEN quant_rows_fn kq_rows_avx512vnni;
#define KQ_ROWS_AVX512VNNI kq_rows_avx512vnni
#else
#define KQ_ROWS_AVX512VNNI NULL
#endif

#endif
