/* The x86-64 levels' kernels of the quantized products for row-major blocks (quant_gemv.c's
   dispatch picks them; quant_gemv_ref.c holds the reference they reproduce):
     avx2        256-bit integer multiply-adds (maddubs/madd), the kernels tuned on an AMD EPYC;
     avxvnni     the same with AVX-VNNI's vpdpbusd/vpdpwssd (256-bit, VEX);
     avx512      512 bits for the q8 activations: two 32-blocks per instruction (AVX-512 F/BW/VL);
     avx512vnni  512-bit vpdpbusd for the int8 products, 256-bit vpdpwssd for the int16 ones.
   Every level's int32 block sums are exact and go into the same float lanes in the same order as
   avx2's, so every level's products are avx2's bit for bit. Also the activation codes 8 at a
   time, a weight block's candidate codes (quantize_blocks_best) and a weight row's values
   (dequantize_rows). The row-interleaved (x16) layout's kernels: quant_gemv_x86_x16.c. */

#include "quant_gemv_x86.h"

#if HAVE_AVX2
/* --- the activation codes -------------------------------------------------------------------- */

/* The same codes 8 at a time (fmaxf stayed a libm call per element: ~5% of a q4_0 step). */
static void quantize_block_avx2(const float *xb, int mode, int8_t *q8, int16_t *q16, float *d) {
    __m256 v[4], mx = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(xb + 8 * j);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[j]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))), inv;
    __m256 nan = _mm256_setzero_ps();   /* max_ps drops NaNs: they are looked for apart */
    for (int j = 0; j < 4; j++) nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[j], v[j], _CMP_UNORD_Q));
    if (_mm256_movemask_ps(nan)) amax = NAN;
    block_scale(amax, mode, d, &inv);
    __m256i c[4], r[4];   /* cvtps rounds to nearest even (the default mode), as lrintf does */
    for (int j = 0; j < 4; j++) {
        const __m256 scaled = _mm256_mul_ps(v[j], _mm256_set1_ps(inv));
        c[j] = _mm256_cvtps_epi32(scaled);
        if (mode == ACT_SPLIT)   /* the residual x / s - h is exact; l rounds it at 2^-15 */
            r[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(scaled, _mm256_cvtepi32_ps(c[j])),
                                                    _mm256_set1_ps(32768.0f)));
    }
    /* the packs work per 128-bit lane: their output's elements come interleaved, put back in
       order by the permutes */
    if (mode != ACT_Q8)
        for (int j = 0; j < 4; j += 2) {
            _mm256_storeu_si256((__m256i *)(q16 + 8 * j),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(c[j], c[j + 1]), 0xD8));
            if (mode == ACT_SPLIT)
                _mm256_storeu_si256((__m256i *)(q16 + QK + 8 * j),
                                    _mm256_permute4x64_epi64(_mm256_packs_epi32(r[j], r[j + 1]), 0xD8));
        }
    else {
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
        _mm256_storeu_si256((__m256i *)q8, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
}

HIDDEN void quantize_row_avx2(const float *x, int nb, int mode, int8_t *q8, int16_t *q16, float *d) {
    const int width = mode == ACT_SPLIT ? 2 : 1;   /* codes per element */
    for (int b = 0; b < nb; b++) quantize_block_avx2(x + b * QK, mode, q8 + b * QK, q16 + b * QK * width, d + b);
}

/* --- products: one weight row times up to QTR activation rows (quant_gemv_ref.h) -------------- */

/* For RR activation rows r (row r's y and z at y + r ys, z + r zs) and n <= FACTOR_CHUNK blocks:
   f[r][b] = d[b] y_r[b] (y NULL: f[0][b] = d[b] alone, shared by the rows); macc[r] += m[b] z_r[b]
   lane-wise (m NULL: -8 d[b] z_r[b]; z NULL: nothing), the minimums' share of a zero-point row's
   product, summed with the row's products at its end. The fp16 values convert 8 at a time, once
   for all rows: one scalar conversion per block (an insert and a convert, both on the shuffle
   port) took ~20% of a q4_1 row's fp32 product. */
INLINE void factors8(const int RR, const uint16_t *d, const float *y, long ys, const uint16_t *m, const float *z,
                     long zs, int b, __m256 keep, float f[][FACTOR_CHUNK], __m256 *macc) {
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + b)));
    if (!y) _mm256_storeu_ps(f[0] + b, dv);
    if (z) {
        const __m256 mv = m ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + b)))
                            : _mm256_mul_ps(dv, _mm256_set1_ps(-8.0f));
        for (int r = 0; r < RR; r++)
            macc[r] = _mm256_fmadd_ps(mv, _mm256_and_ps(keep, _mm256_loadu_ps(z + r * zs + b)), macc[r]);
    }
    if (y) for (int r = 0; r < RR; r++) _mm256_storeu_ps(f[r] + b, _mm256_mul_ps(dv, _mm256_loadu_ps(y + r * ys + b)));
}

INLINE void block_factors(const int RR, const uint16_t *d, const float *y, long ys, const uint16_t *m,
                          const float *z, long zs, int n, float f[][FACTOR_CHUNK], __m256 *macc) {
    int b = 0;
#if defined(__F16C__)
    static const int32_t lanes[16] = {0, 0, 0, 0, 0, 0, 0, 0, -1, -1, -1, -1, -1, -1, -1, -1};
    const __m256 all = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (; b + 8 <= n; b += 8) factors8(RR, d, y, ys, m, z, zs, b, all, f, macc);
    if (b < n && n >= 8) {   /* the last 8 blocks again: the same factors rewritten, the minimums of the
                                n - b new lanes only, the top ones (with the minimums summed into the row's
                                vector, 2-4% of a step less than scalar conversions and a second
                                horizontal sum) */
        const __m256 fresh = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(lanes + (n - b))));
        factors8(RR, d, y, ys, m, z, zs, n - 8, fresh, f, macc);
        b = n;
    }
#endif
    float ms[QTR] = {0.0f};
    for (; b < n; b++) {
        const float dw = fp16_to_fp32(d[b]), mw = m ? fp16_to_fp32(m[b]) : -8.0f * dw;
        if (!y) f[0][b] = dw;
        for (int r = 0; r < RR; r++) {
            if (y) f[r][b] = dw * y[r * ys + b];
            if (z) ms[r] = fmaf(mw, z[r * zs + b], ms[r]);   /* fused, as -ffp-contract=fast made it: neon's too */
        }
    }
    if (z) for (int r = 0; r < RR; r++) macc[r] = _mm256_add_ps(macc[r], _mm256_setr_ps(ms[r], 0, 0, 0, 0, 0, 0, 0));
}

/* The 8 int32 lanes of u8 x s8 products, lane i summing bytes 4i..4i+3: vpdpbusd with VNNI, else
   maddubs (pairs into int16: the operands here stay far from its saturation, |u s| <= 127 x 127
   or 15 x 128, so the sums are exact) and madd with ones. The same exact lanes every way. */
INLINE __m256i dot_u8s8(const int ISA, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
    if (ISA == ISA_AVXVNNI) return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#endif
#if HAVE_AVX512VNNI
    if (ISA == ISA_AVX512VNNI) return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#endif
    (void)ISA;
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* acc + the int16 products lo . a0 + hi . a1 in 8 int32 lanes (vpdpwssd with VNNI, else madd). */
INLINE __m256i dot_i16(const int ISA, __m256i acc, __m256i lo, __m256i a0, __m256i hi, __m256i a1) {
#if defined(__AVXVNNI__)
    if (ISA == ISA_AVXVNNI) return _mm256_dpwssd_avx_epi32(_mm256_dpwssd_avx_epi32(acc, lo, a0), hi, a1);
#endif
#if HAVE_AVX512VNNI
    if (ISA == ISA_AVX512VNNI) return _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(acc, lo, a0), hi, a1);
#endif
    (void)ISA;
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(lo, a0), _mm256_madd_epi16(hi, a1)));
}

/* One q8_0 block (codes w) times RR rows' blocks (codes a + r K), added to acc[r] with factor
   f[r][b]. */
INLINE void q8_0_q8_block(const int RR, const int ISA, const int8_t *w8, const int8_t *a8, int K,
                          float f[][FACTOR_CHUNK], int b, __m256 *acc) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)w8), aw = _mm256_sign_epi8(w, w);
    for (int r = 0; r < RR; r++) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(a8 + (long)r * K));
        const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(ISA, aw, _mm256_sign_epi8(a, w)));
        acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(f[r] + b), dot, acc[r]);
    }
}

/* q8_0 weights (nb blocks: codes wq, scales wd) . RR rows of q8 activations (codes xq + r K,
   scales xd + r nb): per block d_w d_x sum(w_i a_i) in int8 x int8 -> int32 (llama.cpp's
   q8_0 x q8_0: maddubs takes |w| and a with w's sign; |w| is taken once per block). */
/* One q4 block (16 bytes of nibble pairs) times RR rows' q8 blocks, added to acc[r]. */
INLINE void q4_q8_block(const int RR, const int ISA, const uint8_t *w4, const int8_t *a8, int K,
                        float f[][FACTOR_CHUNK], int b, __m256 *acc) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)w4);
    const __m128i lo = _mm_and_si128(bytes, _mm_set1_epi8(15));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(15));
    const __m256i w = _mm256_set_m128i(hi, lo);       /* elements 0..15 | 16..31 */
    for (int r = 0; r < RR; r++) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(a8 + (long)r * K));
        const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(ISA, w, a));
        acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(f[r] + b), dot, acc[r]);
    }
}

/* One q8_0 block (w4 NULL: codes w8) or q4_1 block (nibbles w4) times RR rows' int16 blocks
   (a + r stride; split: h then l, ACT_SPLIT's codes), added to acc[r] with factor f[r][b]. */
INLINE void i16_block(const int RR, const int ISA, const int split, const int8_t *w8, const uint8_t *w4,
                      const int16_t *a, long stride, float f[][FACTOR_CHUNK], int b, __m256 *acc) {
    __m256i lo, hi;   /* elements 0..15 and 16..31 as int16 */
    if (w4) {
        const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)w4));
        lo = _mm256_and_si256(bytes, _mm256_set1_epi16(15));
        hi = _mm256_srli_epi16(bytes, 4);
    } else {
        lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w8));
        hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w8 + 16)));
    }
    for (int r = 0; r < RR; r++) {
        const int16_t *ab = a + r * stride;
        const __m256i s = dot_i16(ISA, _mm256_setzero_si256(), lo, _mm256_loadu_si256((const __m256i *)ab),
                                  hi, _mm256_loadu_si256((const __m256i *)(ab + 16)));
        __m256 sf = _mm256_cvtepi32_ps(s);
        if (split) {   /* + the residual codes' sum / 2^15: one rounding, where the sums meet */
            const __m256i t = dot_i16(ISA, _mm256_setzero_si256(), lo, _mm256_loadu_si256((const __m256i *)(ab + 32)),
                                      hi, _mm256_loadu_si256((const __m256i *)(ab + 48)));
            sf = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(1.0f / 32768.0f), sf);
        }
        acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(f[r] + b), sf, acc[r]);
    }
}

/* The n blocks from block c0 of one weight row (w: the row's codes) times RR activation rows
   (codes xq, rows K codes apart, twice that for ACT_SPLIT's), even blocks into acc0 and odd into
   acc1 (two chains per row hide FMA latency), with factors f[r][b]:
     q8_0 x q8: d_w d_x sum(w_i a_i) in int8 x int8 -> int32 (llama.cpp's q8_0 x q8_0);
     q4 x q8: the same with the unsigned nibbles (llama.cpp's q4_1 x q8_1), the minimums apart;
     x int16 codes (ACT_I16's or ACT_SPLIT's): madd_epi16 sums, exact in int32 (at most
       4 x 128 x 32767 < 2^24 a lane), so their conversion to float is exact too. */
INLINE void unit_blocks(const int RR, const int FMT, const int ISA, const void *w, long c0, int n, const int8_t *xq, int K,
                        float f[][FACTOR_CHUNK], __m256 *acc0, __m256 *acc1) {
    const int split = FMT == Q8_0_F32 || FMT == Q4_1_F32, width = split ? 2 : 1, q4 = ZERO_POINT(FMT);
    const int8_t *w8 = (const int8_t *)w + c0 * QK;
    const uint8_t *w4 = (const uint8_t *)w + c0 * QK / 2;
#define BLOCK(B, ACC)                                                                                       \
    if (FMT == Q8_0_Q8) q8_0_q8_block(RR, ISA, w8 + (long)(B) * QK, xq + (c0 + (B)) * QK, K, f, B, ACC);      \
    else if (FMT == Q4_1_Q8 || FMT == Q4_0_Q8)                                                               \
        q4_q8_block(RR, ISA, w4 + (long)(B) * QK / 2, xq + (c0 + (B)) * QK, K, f, B, ACC);                    \
    else i16_block(RR, ISA, split, q4 ? NULL : w8 + (long)(B) * QK, q4 ? w4 + (long)(B) * QK / 2 : NULL,           \
                   (const int16_t *)xq + (c0 + (B)) * QK * width, (long)K * width, f, B, ACC);
    int b = 0;
    for (; b + 1 < n; b += 2) {
        BLOCK(b, acc0)
        BLOCK(b + 1, acc1)
    }
    if (b < n) {
        BLOCK(b, acc0)
    }
#undef BLOCK
}

/* y[r, n] = x_r . weight row n (+ bias[n]) for weight rows [n0, n1) and RR activation rows (their
   codes xq, scales xd and block sums xs; y rows N apart). Each (weight row, chunk of FACTOR_CHUNK
   blocks) unit's factors are made while the unit before it runs: made just before their own
   blocks, their conversion, multiply and store lay on each row's critical path, and a 576-wide
   q4_1 row took ~1.6x as long as it did with the factors ready (/tmp microbenchmark). The
   arithmetic is the same as one row at a time, in any tile, on any thread. */
INLINE void block_rows(const int RR, const int FMT, const int ISA, const void *w, const uint16_t *d, const uint16_t *m, int n0,
                      int n1, int N, int K, const int8_t *xq, const float *xd, const float *xs, float *y,
                      const float *bias) {
    const int nb = K / QK, zp = ZERO_POINT(FMT);
    const long row_bytes = zp ? K / 2 : K;
    float f[2][QTR][FACTOR_CHUNK];   /* the running unit's factors and the next one's */
    __m256 macc[2][QTR];             /* the minimums' sums of this row and the next */
#define FACTORS(ROW, C, F, MACC)                                                                               \
    block_factors(RR, d + (long)(ROW) * nb + (C), xd + (C), nb, m ? m + (long)(ROW) * nb + (C) : NULL,         \
                  zp ? xs + (C) : NULL, nb, nb - (C) < FACTOR_CHUNK ? nb - (C) : FACTOR_CHUNK, F, MACC)
    for (int r = 0; r < RR; r++) macc[0][r] = _mm256_setzero_ps();
    FACTORS(n0, 0, f[0], macc[0]);
    int u = 0;   /* f[u]: the running unit's */
    for (int n = n0; n < n1; n++) {
        const int row = (n - n0) & 1;
        __m256 acc0[QTR], acc1[QTR];
        for (int r = 0; r < RR; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
        for (int c = 0; c < nb; c += FACTOR_CHUNK, u ^= 1) {
            if (c + FACTOR_CHUNK < nb) FACTORS(n, c + FACTOR_CHUNK, f[u ^ 1], macc[row]);
            else if (n + 1 < n1) {
                for (int r = 0; r < RR; r++) macc[row ^ 1][r] = _mm256_setzero_ps();
                FACTORS(n + 1, 0, f[u ^ 1], macc[row ^ 1]);
            }
            unit_blocks(RR, FMT, ISA, (const int8_t *)w + n * row_bytes, c, nb - c < FACTOR_CHUNK ? nb - c : FACTOR_CHUNK,
                        xq, K, f[u], acc0, acc1);
        }
        for (int r = 0; r < RR; r++) {
            __m256 sum = _mm256_add_ps(acc0[r], acc1[r]);
            if (zp) sum = _mm256_add_ps(sum, macc[row][r]);
            y[(long)r * N + n] = hsum8(sum) + (bias ? bias[n] : 0.0f);
        }
    }
#undef FACTORS
}

#if HAVE_AVX512
/* --- 512 bits: two 32-blocks per vector --------------------------------------------------------

   Lanes 0-7 take block b's eight int32 sums and lanes 8-15 block b+1's, the lanes avx2's even and
   odd accumulators (acc0, acc1) hold: each lane sees the same products, in the same order, as
   there, and the halves are added at the row's end as acc0 + acc1 are. So a 512-bit row is
   bit-identical to an avx2 one, and twice the blocks go through each instruction. An odd last
   block of a unit runs in the low half alone (masked loads: nothing read past the rows). */

INLINE __m512i dot_u8s8_512(const int VNNI, __m512i u, __m512i s) {
#if HAVE_AVX512VNNI
    if (VNNI) return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#endif
    (void)VNNI;
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
}

/* f[b] in lanes 0-7, f[b + 1] in lanes 8-15 (pair) or 0 there (the odd block alone). */
INLINE __m512 pair_factors(const float *f, int pair) {
    const __m128 two = pair ? _mm_castpd_ps(_mm_load_sd((const double *)f)) : _mm_load_ss(f);
    return _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                                 _mm512_castps128_ps512(two));
}

/* One or two (pair) q8_0 blocks times RR rows' q8 blocks: |w| against a with w's sign, as avx2's
   sign_epi8 gives it (AVX-512 has no vpsignb: a masked negation where w < 0). */
static inline __mmask64 pair_bytes(int pair) { return pair ? ~0ULL : 0xFFFFFFFFULL; }

/* The int32 lanes of a q8_0 pair (|w| aw, w's sign bits neg) times one row's q8 codes a8. */
INLINE __m512i q8_0_q8_dots512(const int VNNI, const int pair, __m512i aw, __mmask64 neg, const int8_t *a8) {
    const __m512i a = _mm512_maskz_loadu_epi8(pair_bytes(pair), a8);
    return dot_u8s8_512(VNNI, aw, _mm512_mask_sub_epi8(a, neg, _mm512_setzero_si512(), a));
}

INLINE void q8_0_q8_pair(const int RR, const int VNNI, const int pair, const int8_t *w8, const int8_t *a8, int K,
                         const float *f, long fs, __m512 *acc) {
    const __m512i w = _mm512_maskz_loadu_epi8(pair_bytes(pair), w8), aw = _mm512_abs_epi8(w);
    const __mmask64 neg = _mm512_movepi8_mask(w);
    for (int r = 0; r < RR; r++) {
        const __m512 dot = _mm512_cvtepi32_ps(q8_0_q8_dots512(VNNI, pair, aw, neg, a8 + (long)r * K));
        acc[r] = _mm512_mask3_fmadd_ps(pair_factors(f + r * fs, pair), dot, acc[r], pair ? 0xFFFF : 0x00FF);
    }
}

/* One or two q4 blocks (16 bytes of nibble pairs each) times RR rows' q8 blocks: the 128-bit
   lanes hold block b's low nibbles (elements 0..15), its high ones (16..31), then block b+1's. */
INLINE __m512i q4_nibbles512(const int pair, const uint8_t *w4) {
    const __m512i two = _mm512_castsi256_si512(_mm256_maskz_loadu_epi8(pair ? 0xFFFFFFFFu : 0xFFFFu, w4));
    const __m512i spread = _mm512_shuffle_i64x2(two, two, 0x50);   /* 128-bit lanes 0, 0, 1, 1 */
    return _mm512_and_si512(_mm512_srlv_epi64(spread, _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0)), _mm512_set1_epi8(15));
}

INLINE void q4_q8_pair(const int RR, const int VNNI, const int pair, const uint8_t *w4, const int8_t *a8, int K,
                       const float *f, long fs, __m512 *acc) {
    const __m512i w = q4_nibbles512(pair, w4);
    for (int r = 0; r < RR; r++) {
        const __m512 dot = _mm512_cvtepi32_ps(dot_u8s8_512(VNNI, w, _mm512_maskz_loadu_epi8(pair_bytes(pair), a8 + (long)r * K)));
        acc[r] = _mm512_mask3_fmadd_ps(pair_factors(f + r * fs, pair), dot, acc[r], pair ? 0xFFFF : 0x00FF);
    }
}

/* unit_blocks' blocks for the q8-activation formats, two at a time. */
INLINE void unit_pairs(const int RR, const int FMT, const int VNNI, const void *w, long c0, int n, const int8_t *xq,
                       int K, float f[][FACTOR_CHUNK], __m512 *acc) {
    const int8_t *w8 = (const int8_t *)w + c0 * QK;
    const uint8_t *w4 = (const uint8_t *)w + c0 * QK / 2;
    for (int b = 0; b < n; b += 2) {
        const int pair = b + 1 < n;
        if (FMT == Q8_0_Q8) q8_0_q8_pair(RR, VNNI, pair, w8 + (long)b * QK, xq + (c0 + b) * QK, K, f[0] + b, FACTOR_CHUNK, acc);
        else q4_q8_pair(RR, VNNI, pair, w4 + (long)b * QK / 2, xq + (c0 + b) * QK, K, f[0] + b, FACTOR_CHUNK, acc);
    }
}

/* block_rows for Q8_0_Q8, Q4_1_Q8 and Q4_0_Q8 with 512-bit accumulators (the same factors). */
INLINE void block_rows512(const int RR, const int FMT, const int VNNI, const void *w, const uint16_t *d,
                          const uint16_t *m, int n0, int n1, int N, int K, const int8_t *xq, const float *xd,
                          const float *xs, float *y, const float *bias) {
    const int nb = K / QK, zp = ZERO_POINT(FMT);
    const long row_bytes = zp ? K / 2 : K;
    float f[2][QTR][FACTOR_CHUNK];
    __m256 macc[2][QTR];
#define FACTORS(ROW, C, F, MACC)                                                                               \
    block_factors(RR, d + (long)(ROW) * nb + (C), xd + (C), nb, m ? m + (long)(ROW) * nb + (C) : NULL,         \
                  zp ? xs + (C) : NULL, nb, nb - (C) < FACTOR_CHUNK ? nb - (C) : FACTOR_CHUNK, F, MACC)
    for (int r = 0; r < RR; r++) macc[0][r] = _mm256_setzero_ps();
    FACTORS(n0, 0, f[0], macc[0]);
    int u = 0;
    for (int n = n0; n < n1; n++) {
        const int row = (n - n0) & 1;
        __m512 acc[QTR];
        for (int r = 0; r < RR; r++) acc[r] = _mm512_setzero_ps();
        for (int c = 0; c < nb; c += FACTOR_CHUNK, u ^= 1) {
            if (c + FACTOR_CHUNK < nb) FACTORS(n, c + FACTOR_CHUNK, f[u ^ 1], macc[row]);
            else if (n + 1 < n1) {
                for (int r = 0; r < RR; r++) macc[row ^ 1][r] = _mm256_setzero_ps();
                FACTORS(n + 1, 0, f[u ^ 1], macc[row ^ 1]);
            }
            unit_pairs(RR, FMT, VNNI, (const int8_t *)w + n * row_bytes, c, nb - c < FACTOR_CHUNK ? nb - c : FACTOR_CHUNK,
                       xq, K, f[u], acc);
        }
        for (int r = 0; r < RR; r++) {
            __m256 sum = _mm256_add_ps(_mm512_castps512_ps256(acc[r]),
                                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1)));
            if (zp) sum = _mm256_add_ps(sum, macc[row][r]);
            y[(long)r * N + n] = hsum8(sum) + (bias ? bias[n] : 0.0f);
        }
    }
#undef FACTORS
}
#endif   /* HAVE_AVX512 */

/* A vector level's rows: fp32 products on ACT_SPLIT's codes; at the 512-bit levels the
   q8-activation formats two blocks per vector, the int16 ones 256 bits wide (with vpdpwssd at
   avx512vnni: a 512-bit int16 block would still need its halves added to keep avx2's lanes). */
INLINE void quant_rows_vec(const int ISA, int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N,
                           int K, const int8_t *xq, const float *xd, const float *xs, int M, float *y,
                           const float *bias) {
    const int nb = K / QK, n0 = c * ROWS_CHUNK, n1 = N - n0 < ROWS_CHUNK ? N : n0 + ROWS_CHUNK;
    const int i16 = ISA == ISA_AVX512 ? ISA_AVX2 : ISA;   /* the int16 products' level */
    for (int r0 = 0; r0 < M; r0 += QTR) {
        const int rr = M - r0 < QTR ? M - r0 : QTR;
        float *yr = y + (long)r0 * N;
        const int q8 = fmt == Q8_0_Q8 || fmt == Q4_1_Q8 || fmt == Q4_0_Q8, split = fmt == Q8_0_F32 || fmt == Q4_1_F32;
        const int8_t *xr = xq + (long)r0 * K * (q8 ? 1 : split ? 4 : 2);   /* bytes of codes per row */
#define ROWS(RR, FMT, L) block_rows(RR, FMT, L, w, d, m, n0, n1, N, K, xr, xd + r0 * nb, xs + r0 * nb, yr, bias)
#if HAVE_AVX512
#define ROWS8(RR, FMT)                                                                                   \
        if (ISA >= ISA_AVX512) block_rows512(RR, FMT, ISA == ISA_AVX512VNNI, w, d, m, n0, n1, N, K, xr, xd + r0 * nb, \
                                xs + r0 * nb, yr, bias);                                                 \
        else ROWS(RR, FMT, ISA)
#else
#define ROWS8(RR, FMT) ROWS(RR, FMT, ISA)
#endif
#define QUANT_TILE(RR)                                                                                   \
        switch (fmt) {                                                                                   \
        case Q8_0_Q8: ROWS8(RR, Q8_0_Q8); break;                                                         \
        case Q8_0_F32: ROWS(RR, Q8_0_F32, i16); break;                                                   \
        case Q4_1_F32: ROWS(RR, Q4_1_F32, i16); break;                                                   \
        case Q8_0_I16: ROWS(RR, Q8_0_I16, i16); break;                                                   \
        case Q4_1_I16: ROWS(RR, Q4_1_I16, i16); break;                                                   \
        case Q4_1_Q8: ROWS8(RR, Q4_1_Q8); break;                                                         \
        default: ROWS8(RR, Q4_0_Q8);                                                                     \
        }
        switch (rr) {
        case 1: QUANT_TILE(1) break;
        case 2: QUANT_TILE(2) break;
        case 3: QUANT_TILE(3) break;
        default: QUANT_TILE(4)
        }
#undef QUANT_TILE
#undef ROWS8
#undef ROWS
    }
}

#define QUANT_ROWS_LEVEL(NAME, ISA)                                                                          \
    HIDDEN void NAME(int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,     \
                     const float *x, const int8_t *xq, const float *xd, const float *xs, int M, float *y,    \
                     const float *bias) {                                                                    \
        (void)x;                                                                                             \
        quant_rows_vec(ISA, fmt, w, d, m, c, N, K, xq, xd, xs, M, y, bias);                                  \
    }
QUANT_ROWS_LEVEL(quant_rows_avx2, ISA_AVX2)
#if defined(__AVXVNNI__)
QUANT_ROWS_LEVEL(quant_rows_avxvnni, ISA_AVXVNNI)
#endif
#if HAVE_AVX512
QUANT_ROWS_LEVEL(quant_rows_avx512, ISA_AVX512)
#endif
#if HAVE_AVX512VNNI
QUANT_ROWS_LEVEL(quant_rows_avx512vnni, ISA_AVX512VNNI)
#endif
#undef QUANT_ROWS_LEVEL

/* block_sums through the x86 levels' integer primitives as their products use them (a vector's
   lanes added up in int32, exactly). */
HIDDEN void block_sums_x86(int kind, const void *w, const void *a, int n, int32_t *out) {
    const int8_t *w8 = w, *a8 = a;
    const uint8_t *w4 = w;
    const int16_t *a16 = a;
    for (int b = 0; b < n; b++) {
        const int8_t *wb8 = w8 + b * QK, *ab8 = a8 + b * QK;
        const uint8_t *wb4 = w4 + b * QK / 2;
        const int16_t *ab16 = a16 + b * QK;
        int32_t lanes[16];
#if HAVE_AVX512
        if (g_isa >= ISA_AVX512 && kind < 2) {   /* the 512-bit pair primitives, the odd block alone */
            const int vnni = g_isa == ISA_AVX512VNNI, pair = b + 1 < n;
            __m512i dots;
            if (kind == 0) {
                const __m512i wv = _mm512_maskz_loadu_epi8(pair_bytes(pair), wb8);
                dots = vnni ? q8_0_q8_dots512(1, pair, _mm512_abs_epi8(wv), _mm512_movepi8_mask(wv), ab8)
                            : q8_0_q8_dots512(0, pair, _mm512_abs_epi8(wv), _mm512_movepi8_mask(wv), ab8);
            } else {
                const __m512i wv = q4_nibbles512(pair, wb4), av = _mm512_maskz_loadu_epi8(pair_bytes(pair), ab8);
                dots = vnni ? dot_u8s8_512(1, wv, av) : dot_u8s8_512(0, wv, av);
            }
            _mm512_storeu_si512(lanes, dots);
            out[b] = hsum_i32(lanes, 8);
            if (pair) out[++b] = hsum_i32(lanes + 8, 8);
            continue;
        }
#endif
        {   /* the 256-bit primitives (vpdpwssd's at avx512vnni, avx2's at avx512) */
            const int level = g_isa == ISA_AVX512 ? ISA_AVX2 : g_isa;
            __m256i dots;
            if (kind == 0) {
                const __m256i wv = _mm256_loadu_si256((const __m256i *)wb8);
                dots = level == ISA_AVXVNNI ? dot_u8s8(ISA_AVXVNNI, _mm256_sign_epi8(wv, wv),
                                                       _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)ab8), wv))
                       : level == ISA_AVX512VNNI ? dot_u8s8(ISA_AVX512VNNI, _mm256_sign_epi8(wv, wv),
                                                            _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)ab8), wv))
                       : dot_u8s8(ISA_AVX2, _mm256_sign_epi8(wv, wv), _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)ab8), wv));
            } else if (kind == 1) {
                const __m128i bytes = _mm_loadu_si128((const __m128i *)wb4);
                const __m256i wv = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(15)),
                                                    _mm_and_si128(bytes, _mm_set1_epi8(15)));
                const __m256i av = _mm256_loadu_si256((const __m256i *)ab8);
                dots = level == ISA_AVXVNNI ? dot_u8s8(ISA_AVXVNNI, wv, av)
                       : level == ISA_AVX512VNNI ? dot_u8s8(ISA_AVX512VNNI, wv, av) : dot_u8s8(ISA_AVX2, wv, av);
            } else {
                __m256i lo, hi;
                if (kind == 3) {
                    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)wb4));
                    lo = _mm256_and_si256(bytes, _mm256_set1_epi16(15));
                    hi = _mm256_srli_epi16(bytes, 4);
                } else {
                    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)wb8));
                    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wb8 + 16)));
                }
                const __m256i a0 = _mm256_loadu_si256((const __m256i *)ab16), a1 = _mm256_loadu_si256((const __m256i *)(ab16 + 16));
                const __m256i z = _mm256_setzero_si256();
                dots = level == ISA_AVXVNNI ? dot_i16(ISA_AVXVNNI, z, lo, a0, hi, a1)
                       : level == ISA_AVX512VNNI ? dot_i16(ISA_AVX512VNNI, z, lo, a0, hi, a1) : dot_i16(ISA_AVX2, z, lo, a0, hi, a1);
            }
            _mm256_storeu_si256((__m256i *)lanes, dots);
            out[b] = hsum_i32(lanes, 8);
        }
    }
}

/* --- a weight block's codes, a weight row's values ---------------------------------------------- */

/* quantize_blocks_best's candidate codes 8 at a time */
static inline void block_codes_avx2(const float *x, float inv, float qmin, float qmax, float *c, float *xc, float *cc) {
    const __m256 vi = _mm256_set1_ps(inv), lo = _mm256_set1_ps(qmin), hi = _mm256_set1_ps(qmax);
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
    for (int j = 0; j < QK; j += 8) {
        const __m256 xv = _mm256_loadu_ps(x + j);
        __m256 q = _mm256_round_ps(_mm256_mul_ps(xv, vi), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm256_min_ps(_mm256_max_ps(q, lo), hi);
        if (c) _mm256_storeu_ps(c + j, q);
        a = _mm256_fmadd_ps(xv, q, a);
        b = _mm256_fmadd_ps(q, q, b);
    }
    *xc = hsum8(a);
    *cc = hsum8(b);
}

HIDDEN void best_block_avx2(const float *x, int qmin, int qmax, const float *f, int nf, int8_t *codes, float *d) {
    best_block(block_codes_avx2, x, qmin, qmax, f, nf, codes, d);
}

#if defined(__F16C__)
/* 16 code bytes of a row: four 4-byte units qstride apart (one load where they are adjacent) */
static inline __m128i code_bytes16(const uint8_t *p, long qstride) {
    if (qstride == 4) return _mm_loadu_si128((const __m128i *)p);
    int32_t u[4];
    for (int j = 0; j < 4; j++) memcpy(&u[j], p + j * qstride, 4);
    return _mm_setr_epi32(u[0], u[1], u[2], u[3]);
}

/* 16 codes (int8 lanes) -> 16 values o[0..15]: code * s (+ mn where add) */
static inline void store_values16(__m128i codes, __m256 s, __m256 mn, int add, float *o) {
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
    const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(codes, codes)));
    _mm256_storeu_ps(o, add ? _mm256_fmadd_ps(lo, s, mn) : _mm256_mul_ps(lo, s));
    _mm256_storeu_ps(o + 8, add ? _mm256_fmadd_ps(hi, s, mn) : _mm256_mul_ps(hi, s));
}

/* The scalar loop's values, 16 at a time: a native prefill's dequantization took ~9% of its
   product's time at 512 tokens one element at a time. */
HIDDEN void dequantize_row_avx2(int fmt, const uint8_t *qs, long qstride, const uint16_t *d, const uint16_t *m,
                                long sstride, int K, float *out) {
    const int nb = K / QK, units = fmt == 0 ? QK / 4 : QK / 8;
    const __m128i nib = _mm_set1_epi8(15), eight = _mm_set1_epi8(fmt == 1 ? 8 : 0);
    for (int b = 0; b < nb; b++) {
        const uint8_t *p = qs + (long)b * units * qstride;   /* the block's first unit */
        const __m256 s = _mm256_set1_ps(fp16_to_fp32(d[(long)b * sstride]));
        const __m256 mn = _mm256_set1_ps(fmt == 2 ? fp16_to_fp32(m[(long)b * sstride]) : 0.0f);
        float *o = out + (long)b * QK;
        if (fmt == 0) {
            store_values16(code_bytes16(p, qstride), s, mn, 0, o);
            store_values16(code_bytes16(p + 4 * qstride, qstride), s, mn, 0, o + 16);
            continue;
        }
        const __m128i bytes = code_bytes16(p, qstride);
        const __m128i low = _mm_sub_epi8(_mm_and_si128(bytes, nib), eight);
        const __m128i high = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(bytes, 4), nib), eight);
        store_values16(low, s, mn, fmt == 2, o);
        store_values16(high, s, mn, fmt == 2, o + QK / 2);
    }
}
#endif
#endif   /* HAVE_AVX2 */
