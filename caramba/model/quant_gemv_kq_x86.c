/* x86-64's kernels for the stored GGUF formats (quant_gemv_kq.h: Q5_0, Q5_1, Q4_K, Q5_K, Q6_K with
   int16 or split int16 activation codes). One weight row at a time, eight 32-blocks per step (a
   K-quant superblock, or eight consecutive blocks of the 32-element formats): their codes are
   widened to int16 once (nibbles, the 5th and 6th bits, the offsets), their factors made as one
   vector, and each of up to QTR activation rows multiplies them with 16-bit multiply-adds
   (madd_epi16 at avx2, avxvnni and avx512; vpdpwssd on ymm at avx512vnni), the eight blocks' int32
   sums gathered into one vector by horizontal adds (exact), and then the header's fp32
   operations lane for lane: acc[b % 8] is lane b % 8 of one accumulator, so the products are the
   reference's bit for bit. A row's tail of fewer than eight blocks (Q5_0 / Q5_1 rows whose K is
   not a multiple of 256: SmolLM2's 576, Gemma 3's 640) is one more group whose missing blocks are
   zeros and whose lanes are blended in only where a block is (the reference's step there took
   about as long as the row's other sixteen blocks). */

#include "quant_gemv_kq.h"

#include <string.h>

#if HAVE_AVX2

/* Eight vectors' int32 lanes summed per vector, from their pairs' hadds t[p] = hadd(s[2p], s[2p + 1]):
   lane k of the result is the sum of s[k]'s lanes. */
static inline __m256i kq_reduce4(const __m256i *t) {
    const __m256i t0 = _mm256_hadd_epi32(t[0], t[1]), t1 = _mm256_hadd_epi32(t[2], t[3]);
    return _mm256_add_epi32(_mm256_permute2x128_si256(t0, t1, 0x20), _mm256_permute2x128_si256(t0, t1, 0x31));
}

/* 32 bits -> 32 bytes, 0xFF where the bit is set (byte j: bit j) */
static inline __m256i kq_bits_to_bytes(uint32_t bits) {
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    const __m256i v = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuf),
                                      _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
}

/* 32 byte codes -> two int16 vectors (elements 0..15, 16..31), less off */
static inline void kq_widen(__m256i q, int off, __m256i *w) {
    w[0] = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(q)), _mm256_set1_epi16((short)off));
    w[1] = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(q, 1)), _mm256_set1_epi16((short)off));
}

/* Blocks b0 .. b0 + 7 of a row: codes w[2k], w[2k + 1] (block b0 + k's two halves, int16), the
   factors fw, minimums mw and Q6_K's scales of the halves (kq_block's values, lane k each). Q5_0 /
   Q5_1 only: the first `cnt` blocks (a row's tail), the other lanes' codes and factors zeros. */
INLINE void kq_group(const int kind, const uint8_t *row, int b0, const int cnt, __m256i *w, __m256 *fw, __m256 *mw,
                     __m256 *sclo, __m256 *schi) {
    const __m256i low4 = _mm256_set1_epi8(15);
    if (kind == KQ_Q5_0 || kind == KQ_Q5_1) {
        const int at = kind == KQ_Q5_0 ? 2 : 4;
        float f[8], mn[8];
        for (int k = 0; k < 8; k++) {
            if (k >= cnt) {
                f[k] = mn[k] = 0.0f;
                w[2 * k] = w[2 * k + 1] = _mm256_setzero_si256();
                continue;
            }
            const uint8_t *blk = row + (long)(b0 + k) * kq_block_bytes(kind);
            f[k] = fp16_to_fp32(kq_u16(blk));
            mn[k] = kind == KQ_Q5_1 ? fp16_to_fp32(kq_u16(blk + 2)) : 0.0f;
            const __m128i v = _mm_loadu_si128((const __m128i *)(blk + at + 4));
            const __m128i lo = _mm_and_si128(v, _mm_set1_epi8(15)), hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(15));
            const __m256i q = _mm256_or_si256(_mm256_set_m128i(hi, lo),
                                              _mm256_and_si256(kq_bits_to_bytes(kq_u32(blk + at)), _mm256_set1_epi8(16)));
            kq_widen(q, kind == KQ_Q5_0 ? 16 : 0, w + 2 * k);
        }
        *fw = _mm256_loadu_ps(f);
        *mw = _mm256_loadu_ps(mn);
        return;
    }
    const uint8_t *blk = row + (long)(b0 / 8) * kq_block_bytes(kind);
    if (kind == KQ_Q6_K) {
        const int8_t *sc = (const int8_t *)(blk + 192);
        float lo[8], hi[8];
        for (int k = 0; k < 8; k++) lo[k] = (float)sc[2 * k], hi[k] = (float)sc[2 * k + 1];
        *sclo = _mm256_loadu_ps(lo);
        *schi = _mm256_loadu_ps(hi);
        *fw = _mm256_set1_ps(fp16_to_fp32(kq_u16(blk + 208)));
        for (int n = 0; n < 2; n++) {
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n));
            for (int qd = 0; qd < 4; qd++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * n + (qd & 1) * 32));
                const __m256i l4 = qd < 2 ? _mm256_and_si256(v, low4) : _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                const __m256i h2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * qd), _mm256_set1_epi8(3)), 4);
                kq_widen(_mm256_or_si256(l4, h2), 32, w + 2 * (4 * n + qd));
            }
        }
        return;
    }
    int sc[8], mn[8];
    for (int j = 0; j < 8; j++) kq_scale_min(j, blk + 4, &sc[j], &mn[j]);
    *fw = _mm256_mul_ps(_mm256_set1_ps(fp16_to_fp32(kq_u16(blk))), _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)sc)));
    *mw = _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(fp16_to_fp32(kq_u16(blk + 2))),
                                      _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)mn))),
                        _mm256_set1_ps(-0.0f));
    const uint8_t *qs = blk + (kind == KQ_Q4_K ? 16 : 48);
    const __m256i qh = kind == KQ_Q5_K ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        if (kind == KQ_Q5_K) {
            const __m256i one = _mm256_set1_epi8(1);
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
        }
        kq_widen(lo, 0, w + 4 * c);
        kq_widen(hi, 0, w + 4 * c + 2);
    }
}

/* int16 codes w . a (16 each) -> 8 int32 lanes (added to s) */
INLINE __m256i kq_madd(const int VNNI, __m256i s, __m256i w, const int16_t *a) {
    const __m256i av = _mm256_loadu_si256((const __m256i *)a);
#if HAVE_AVX512VNNI
    if (VNNI) return _mm256_dpwssd_epi32(s, w, av);
#endif
    (void)VNNI;
    return _mm256_add_epi32(s, _mm256_madd_epi16(w, av));
}

/* The eight blocks' values v (kq_value) from codes h (or split h, l): all 32 elements, or (half
   1 / 2) one 16-element half of each. Each pair of blocks' lanes is folded (hadd) as soon as it is
   made, so that few vectors stay live beside the codes. */
INLINE __m256 kq_values(const int VNNI, const int split, const int half, const __m256i *w, const int16_t *a) {
    const int P = split ? 2 : 1;
    __m256i th[4], tl[4];
    for (int p = 0; p < 4; p++) {
        __m256i sh[2], sl[2];
        for (int e = 0; e < 2; e++) {
            const int k = 2 * p + e;
            const int16_t *h = a + (long)k * QK * P;
            const __m256i z = _mm256_setzero_si256();
            if (half) {
                sh[e] = kq_madd(VNNI, z, w[2 * k + half - 1], h + 16 * (half - 1));
                if (split) sl[e] = kq_madd(VNNI, z, w[2 * k + half - 1], h + QK + 16 * (half - 1));
            } else {
                sh[e] = kq_madd(VNNI, kq_madd(VNNI, z, w[2 * k], h), w[2 * k + 1], h + 16);
                if (split) sl[e] = kq_madd(VNNI, kq_madd(VNNI, z, w[2 * k], h + QK), w[2 * k + 1], h + QK + 16);
            }
        }
        th[p] = _mm256_hadd_epi32(sh[0], sh[1]);
        if (split) tl[p] = _mm256_hadd_epi32(sl[0], sl[1]);
    }
    const __m256 vh = _mm256_cvtepi32_ps(kq_reduce4(th));
    if (!split) return vh;
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(kq_reduce4(tl)), _mm256_set1_ps(1.0f / 32768.0f), vh);
}

INLINE void kq_rows_x86(const int VNNI, const int kind, const int split, const void *wq, int c, int N, int K,
                        const int8_t *xq, const float *xd, const float *xs, int M, float *y, const float *bias) {
    const int nb = K / QK, full = nb / 8 * 8, P = split ? 2 : 1, zp = kq_zero_point(kind);
    const int n0 = c * ROWS_CHUNK, n1 = N - n0 < ROWS_CHUNK ? N : n0 + ROWS_CHUNK;
    const long rb = kq_row_bytes(kind, K);
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = (const uint8_t *)wq + n * rb;
        for (int r0 = 0; r0 < M; r0 += QTR) {
            const int rr = M - r0 < QTR ? M - r0 : QTR;
            __m256 acc[QTR], macc[QTR];
            for (int r = 0; r < rr; r++) acc[r] = macc[r] = _mm256_setzero_ps();
            for (int b0 = 0; b0 < full; b0 += 8) {
                __m256i w[16];
                __m256 fw, mw = _mm256_setzero_ps(), sclo = _mm256_setzero_ps(), schi = _mm256_setzero_ps();
                kq_group(kind, row, b0, 8, w, &fw, &mw, &sclo, &schi);
                for (int r = 0; r < rr; r++) {
                    const long at = (long)(r0 + r) * nb + b0;
                    const int16_t *a = (const int16_t *)xq + ((long)(r0 + r) * K + (long)b0 * QK) * P;
                    __m256 u;
                    if (kind == KQ_Q6_K)
                        u = _mm256_fmadd_ps(kq_values(VNNI, split, 1, w, a), sclo,
                                            _mm256_mul_ps(kq_values(VNNI, split, 2, w, a), schi));
                    else
                        u = kq_values(VNNI, split, 0, w, a);
                    acc[r] = _mm256_fmadd_ps(u, _mm256_mul_ps(fw, _mm256_loadu_ps(xd + at)), acc[r]);
                    if (zp) macc[r] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(xs + at), macc[r]);
                }
            }
            if (full < nb) {   /* the tail (Q5_0 / Q5_1 rows: K = 576, 640), its own lanes; the others kept */
                const int cnt = nb - full;
                __m256i w[16];
                __m256 fw, mw = _mm256_setzero_ps(), sclo = _mm256_setzero_ps(), schi = _mm256_setzero_ps();
                kq_group(kind, row, full, cnt, w, &fw, &mw, &sclo, &schi);
                const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(cnt),
                                                                           _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
                for (int r = 0; r < rr; r++) {
                    /* the tail's activations, zero past the row: kq_values reads eight blocks */
                    int16_t a[8 * QK * 2] = {0};
                    float xdt[8] = {0}, xst[8] = {0};
                    const long at = (long)(r0 + r) * nb + full;
                    memcpy(a, (const int16_t *)xq + ((long)(r0 + r) * K + (long)full * QK) * P,
                           sizeof(int16_t) * cnt * QK * P);
                    memcpy(xdt, xd + at, sizeof(float) * cnt);
                    if (zp) memcpy(xst, xs + at, sizeof(float) * cnt);
                    const __m256 u = kq_values(VNNI, split, 0, w, a);
                    acc[r] = _mm256_blendv_ps(acc[r], _mm256_fmadd_ps(u, _mm256_mul_ps(fw, _mm256_loadu_ps(xdt)), acc[r]),
                                              live);
                    if (zp) macc[r] = _mm256_blendv_ps(macc[r], _mm256_fmadd_ps(mw, _mm256_loadu_ps(xst), macc[r]), live);
                }
            }
            for (int r = 0; r < rr; r++) {
                float a8[8], m8[8];
                _mm256_storeu_ps(a8, acc[r]);
                _mm256_storeu_ps(m8, macc[r]);
                float o = kq_hsum8(a8);
                if (zp) o = o + kq_hsum8(m8);
                if (bias) o += bias[n];
                y[(long)(r0 + r) * N + n] = o;
            }
        }
    }
}

/* A row's values (dequantize_rows: a prefill's weight tiles), eight blocks at a time from kq_group's
   codes and factors, the reference's operations (kq_dequantize_block) lane for lane. */
INLINE void kq_dequantize_x86(const int kind, const uint8_t *row, int K, float *out) {
    const int nb = K / QK, full = nb / 8 * 8;
    for (int b0 = 0; b0 < full; b0 += 8) {
        __m256i w[16];
        __m256 fwv, mwv = _mm256_setzero_ps(), sclov = _mm256_setzero_ps(), schiv = _mm256_setzero_ps();
        kq_group(kind, row, b0, 8, w, &fwv, &mwv, &sclov, &schiv);
        float fw[8], mw[8], sclo[8], schi[8];
        _mm256_storeu_ps(fw, fwv);
        _mm256_storeu_ps(mw, mwv);
        _mm256_storeu_ps(sclo, sclov);
        _mm256_storeu_ps(schi, schiv);
        for (int k = 0; k < 8; k++)
            for (int h = 0; h < 2; h++)
                for (int e = 0; e < 2; e++) {
                    const __m128i q16 = e ? _mm256_extracti128_si256(w[2 * k + h], 1) : _mm256_castsi256_si128(w[2 * k + h]);
                    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(q16));
                    float *o = out + (long)(b0 + k) * QK + 16 * h + 8 * e;
                    if (kind == KQ_Q6_K) _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_set1_ps(fw[k] * (h ? schi[k] : sclo[k])), q));
                    else _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_set1_ps(fw[k]), q, _mm256_set1_ps(mw[k])));
                }
    }
    for (int b = full; b < nb; b++) kq_dequantize_block(kind, row, b, out + b * QK);
}

HIDDEN void kq_dequantize_row_avx2(int kind, const uint8_t *row, int K, float *out) {
    switch (kind) {
    case KQ_Q5_0: kq_dequantize_x86(KQ_Q5_0, row, K, out); break;
    case KQ_Q5_1: kq_dequantize_x86(KQ_Q5_1, row, K, out); break;
    case KQ_Q4_K: kq_dequantize_x86(KQ_Q4_K, row, K, out); break;
    case KQ_Q5_K: kq_dequantize_x86(KQ_Q5_K, row, K, out); break;
    default: kq_dequantize_x86(KQ_Q6_K, row, K, out);
    }
}

/* quant_rows_fn for the formats, each (kind, split) its own specialization */
#define KQ_ENTRY(NAME, VNNI)                                                                                        \
    HIDDEN void NAME(int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,             \
                     const float *x, const int8_t *xq, const float *xd, const float *xs, int M, float *y,          \
                     const float *bias) {                                                                           \
        (void)d, (void)m, (void)x;                                                                                  \
        switch (fmt) {                                                                                              \
        case Q5_0_I16: kq_rows_x86(VNNI, KQ_Q5_0, 0, w, c, N, K, xq, xd, xs, M, y, bias); break;                    \
        case Q5_1_I16: kq_rows_x86(VNNI, KQ_Q5_1, 0, w, c, N, K, xq, xd, xs, M, y, bias); break;                    \
        case Q4_K_I16: kq_rows_x86(VNNI, KQ_Q4_K, 0, w, c, N, K, xq, xd, xs, M, y, bias); break;                    \
        case Q5_K_I16: kq_rows_x86(VNNI, KQ_Q5_K, 0, w, c, N, K, xq, xd, xs, M, y, bias); break;                    \
        case Q6_K_I16: kq_rows_x86(VNNI, KQ_Q6_K, 0, w, c, N, K, xq, xd, xs, M, y, bias); break;                    \
        case Q5_0_F32: kq_rows_x86(VNNI, KQ_Q5_0, 1, w, c, N, K, xq, xd, xs, M, y, bias); break;                    \
        case Q5_1_F32: kq_rows_x86(VNNI, KQ_Q5_1, 1, w, c, N, K, xq, xd, xs, M, y, bias); break;                    \
        case Q4_K_F32: kq_rows_x86(VNNI, KQ_Q4_K, 1, w, c, N, K, xq, xd, xs, M, y, bias); break;                    \
        case Q5_K_F32: kq_rows_x86(VNNI, KQ_Q5_K, 1, w, c, N, K, xq, xd, xs, M, y, bias); break;                    \
        default: kq_rows_x86(VNNI, KQ_Q6_K, 1, w, c, N, K, xq, xd, xs, M, y, bias);                                 \
        }                                                                                                           \
    }

KQ_ENTRY(kq_rows_avx2, 0)
#if HAVE_AVX512VNNI
KQ_ENTRY(kq_rows_avx512vnni, 1)
#endif
#undef KQ_ENTRY

#endif
