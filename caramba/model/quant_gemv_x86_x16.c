/* The x86-64 levels' kernels for the row-interleaved (x16) layout (quant_gemv.h's X16 formats:
   16 weight rows side by side, the vector lanes being rows), which quant_gemv.c's dispatch picks
   where x16_vector says so: every X16 format at avx512vnni (512 bits), and at avx2, avxvnni and
   avx512 (256 bits) the q8-activation ones and q4_1's int16 ones. Each lane's int32 sums are
   exact, and its FMAs are the reference's (quant_gemv_ref.c: x16_rows_ref, x16w_rows_ref) in the
   same order: the same bits at every level. llama.cpp keeps its repacked kernels apart the same
   way (ggml-cpu's repack). */

#include "quant_gemv_x86_x16.h"

#if HAVE_AVX2
#if defined(__F16C__)
/* --- row-interleaved weights at 256 bits (the avx2, avxvnni and avx512 levels) ------------------

   The X16 groups above, read as two halves of 8 rows (a unit's 64 bytes: rows 0-7, then 8-15),
   the lanes again weight rows, for the q8-activation formats (q8_0, q4_0, q4_1 weights). avxvnni
   has vpdpbusd at 256 bits and runs x16_block512's arithmetic. avx2 has no 4-byte dot product:
   vpmaddubsw sums byte pairs into int16 and vpmaddwd with ones adds a lane's two pairs.
     q4 nibbles: a pair is at most 2 x 15 x 128 = 3840, so a block's 16 pairs per int16 lane
       (30720) stay exact and one vpmaddwd per block finishes them.
     q8_0: |w| against a with w's sign, as the row-major avx2 kernel does (|w| <= 128, and
       |a| <= 127: prepare_activations' q8 codes), a pair at most 32512: one vpmaddwd per unit.
   Either way each lane holds the exact sum(w a), and the FMAs are x16_rows512's lane for lane:
   the same bits as the reference (x16_rows_ref) and the 512-bit kernel. llama.cpp's AVX2 build
   repacks Q4_0 the same way (block_q4_0x8, 8 rows a pass). */

#ifndef XPF
#define XPF 2048   /* bytes ahead of the block in hand: from L3 the q8_0 head streamed at 19 GB/s without, 28 with 1-2 KiB (4-8 KiB worse); from DRAM 11 -> 13.9 GB/s at 2 KiB */
#endif

INLINE __m256i bcast4_256(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

#if defined(__AVXVNNI__)
#define HAVE_AVXVNNI_256 1
/* u8 x s8 products of 4-byte lanes added to acc (the avxvnni level; the avx2 code uses maddubs
   directly: its int16 sums run longer than one unit). A build without AVX-VNNI compiles the
   avx2 arithmetic alone, whatever ISA a caller names. */
INLINE __m256i dpbusd256(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
#define HAVE_AVXVNNI_256 0
#endif

/* Block wb's 16 rows' int32 sums with activation block a (sum asum): s[0] rows 0-7, s[1] 8-15. */
INLINE void x16_block256(const int ISA, const int FMT, const uint8_t *wb, const int8_t *a, int32_t asum, __m256i *s) {
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    (void)ISA;   /* read only where the build has AVX-VNNI */
#if defined(__AVXVNNI__)
    if (ISA == ISA_AVXVNNI) {
        __m256i t[2][2];   /* [half][chain] */
        if (FMT == Q8_0_Q8_X16) {
            const __m256i flip = _mm256_set1_epi8((char)0x80);
            for (int h = 0; h < 2; h++) {
                t[h][0] = _mm256_set1_epi32(-128 * asum);
                t[h][1] = _mm256_setzero_si256();
            }
            for (int j = 0; j < 8; j++) {
                const __m256i av = bcast4_256(a + 4 * j);
                for (int h = 0; h < 2; h++)
                    t[h][j & 1] = dpbusd256(t[h][j & 1], _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wb + 64 * j + 32 * h)), flip), av);
            }
        } else {
            for (int h = 0; h < 2; h++) {
                t[h][0] = FMT == Q4_0_Q8_X16 ? _mm256_set1_epi32(-8 * asum) : _mm256_setzero_si256();
                t[h][1] = _mm256_setzero_si256();
            }
            for (int j = 0; j < 4; j++) {
                const __m256i alo = bcast4_256(a + 4 * j), ahi = bcast4_256(a + 16 + 4 * j);
                for (int h = 0; h < 2; h++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + 64 * j + 32 * h));
                    t[h][0] = dpbusd256(t[h][0], _mm256_and_si256(v, low), alo);
                    t[h][1] = dpbusd256(t[h][1], _mm256_and_si256(_mm256_srli_epi16(v, 4), low), ahi);
                }
            }
        }
        for (int h = 0; h < 2; h++) s[h] = _mm256_add_epi32(t[h][0], t[h][1]);
    } else
#endif
    if (FMT == Q8_0_Q8_X16) {
        __m256i t[2][2] = {{_mm256_setzero_si256(), _mm256_setzero_si256()}, {_mm256_setzero_si256(), _mm256_setzero_si256()}};
        for (int j = 0; j < 8; j++) {
            const __m256i av = bcast4_256(a + 4 * j);
            for (int h = 0; h < 2; h++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + 64 * j + 32 * h));
                t[h][j & 1] = _mm256_add_epi32(t[h][j & 1], _mm256_madd_epi16(
                    _mm256_maddubs_epi16(_mm256_sign_epi8(v, v), _mm256_sign_epi8(av, v)), ones));
            }
        }
        for (int h = 0; h < 2; h++) s[h] = _mm256_add_epi32(t[h][0], t[h][1]);
    } else {
        __m256i t[2][2] = {{_mm256_setzero_si256(), _mm256_setzero_si256()}, {_mm256_setzero_si256(), _mm256_setzero_si256()}};
        for (int j = 0; j < 4; j++) {
            const __m256i alo = bcast4_256(a + 4 * j), ahi = bcast4_256(a + 16 + 4 * j);
            for (int h = 0; h < 2; h++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + 64 * j + 32 * h));
                t[h][0] = _mm256_add_epi16(t[h][0], _mm256_maddubs_epi16(_mm256_and_si256(v, low), alo));
                t[h][1] = _mm256_add_epi16(t[h][1], _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), ahi));
            }
        }
        for (int h = 0; h < 2; h++) {
            s[h] = _mm256_madd_epi16(_mm256_add_epi16(t[h][0], t[h][1]), ones);
            if (FMT == Q4_0_Q8_X16) s[h] = _mm256_sub_epi32(s[h], _mm256_set1_epi32(8 * asum));
        }
    }
}

/* x16_rows512 at 256 bits: per block, lane i of acc += float(sum_i) (d_w,i d_x) (q4_1: macc +=
   m_w,i (d_x sum(a))), in block order; then acc (+ macc) (+ bias) for the group's live rows. */
INLINE void x16_rows256(const int RR, const int ISA, const int FMT, const uint8_t *w, const uint16_t *d,
                        const uint16_t *m, int c, int N, int K, const int8_t *xq, const float *xd,
                        const int32_t *asum, float *y, const float *bias) {
    const int nb = K / QK, bb = FMT == Q8_0_Q8_X16 ? QK * XG : QK * XG / 2;
    const uint8_t *wg = w + (long)c * nb * bb;
    const uint16_t *dg = d + (long)c * nb * XG, *mg = m ? m + (long)c * nb * XG : NULL;
    __m256 acc[QTR][2], macc[QTR][2];
    for (int r = 0; r < RR; r++)
        for (int h = 0; h < 2; h++) acc[r][h] = macc[r][h] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const __m256 dw[2] = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dg + b * XG))),
                              _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dg + b * XG + 8)))};
#if XPF
        for (int l = 0; l < bb; l += 64) _mm_prefetch((const char *)wg + (long)b * bb + XPF + l, _MM_HINT_T0);
#endif
        for (int r = 0; r < RR; r++) {
            const int32_t as = asum[r * nb + b];
            __m256i s[2];
            x16_block256(ISA, FMT, wg + (long)b * bb, xq + (long)r * K + b * QK, as, s);
            const __m256 xdv = _mm256_set1_ps(xd[r * nb + b]);
            for (int h = 0; h < 2; h++) {
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[h]), _mm256_mul_ps(dw[h], xdv), acc[r][h]);
                if (FMT == Q4_1_Q8_X16)
                    macc[r][h] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mg + b * XG + 8 * h))),
                                                 _mm256_set1_ps(xd[r * nb + b] * (float)as), macc[r][h]);
            }
        }
    }
    const int n0 = c * XG, live = N - n0 < XG ? N - n0 : XG;
    for (int r = 0; r < RR; r++) {
        float o[XG];
        for (int h = 0; h < 2; h++)
            _mm256_storeu_ps(o + 8 * h, FMT == Q4_1_Q8_X16 ? _mm256_add_ps(acc[r][h], macc[r][h]) : acc[r][h]);
        float *yr = y + (long)r * N + n0;
        for (int i = 0; i < live; i++) yr[i] = bias ? o[i] + bias[n0 + i] : o[i];
    }
}

HIDDEN void x16_group256(int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,
                         const int8_t *xq, const float *xd, const float *xs, int M, float *y, const float *bias) {
    const int nb = K / QK;
#define ROWS(RR, ISA, FMT) x16_rows256(RR, ISA, FMT, w, d, m, c, N, K, xq + (long)r0 * K, xd + r0 * nb, \
                                       (const int32_t *)xs + r0 * nb, y + (long)r0 * N, bias)
#define FMTS(RR, ISA) if (fmt == Q8_0_Q8_X16) ROWS(RR, ISA, Q8_0_Q8_X16); \
                      else if (fmt == Q4_0_Q8_X16) ROWS(RR, ISA, Q4_0_Q8_X16); else ROWS(RR, ISA, Q4_1_Q8_X16);
#if defined(__AVXVNNI__)
#define TILE(RR) if (g_isa == ISA_AVXVNNI) { FMTS(RR, ISA_AVXVNNI) } else { FMTS(RR, ISA_AVX2) }
#else
#define TILE(RR) FMTS(RR, ISA_AVX2)
#endif
    FOR_ROW_TILES(M, TILE)
#undef TILE
#undef FMTS
#undef ROWS
}
/* q4_1 weights with int16 activation codes (native_i16's ACT_I16, native's two ACT_SPLIT codes), as
   byte planes (prepare_activations: per block lo(h), hi(h) [, lo(l), hi(l)], 32 bytes each):
   sum(w c) = 256 sum(w hi) + sum(w lo), as x16w_block512 makes it. avxvnni: vpdpbusd as there.
   avx2: vpmaddubsw with lo (unsigned, <= 255) against the nibbles as signed bytes, a pair at most
   2 x 255 x 15 = 7650, so 4 units' pairs (30600) per int16 chain, one chain for the low nibbles
   and one for the high; and the nibbles as unsigned against hi (signed), a pair at most 3840, all
   8 of a block's in one chain (30720). Exact in int32 as before; q8_0's weights (signed, up to
   128) would overflow these pairs, so its int16 formats keep the rows layout below avx512vnni. */
INLINE void x16w_block256(const int ISA, const int FMT, const uint8_t *wb, const int8_t *a, __m256 *out) {
    const int P = X16_PLANES(FMT);
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256i ln[2][4], hn[2][4];   /* [half][unit]: low and high nibbles */
    for (int j = 0; j < 4; j++)
        for (int h = 0; h < 2; h++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + 64 * j + 32 * h));
            ln[h][j] = _mm256_and_si256(v, low);
            hn[h][j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
    for (int pair = 0; pair < P / 2; pair++) {
        const int8_t *pl = a + pair * 64;
        __m256i tl[2][2], th[2];   /* [half][low/high nibbles] with the lo plane; [half] with hi */
        for (int h = 0; h < 2; h++) tl[h][0] = tl[h][1] = th[h] = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256i loa = bcast4_256(pl + 4 * j), lob = bcast4_256(pl + 16 + 4 * j);
            const __m256i hia = bcast4_256(pl + 32 + 4 * j), hib = bcast4_256(pl + 48 + 4 * j);
            for (int h = 0; h < 2; h++) {
#if defined(__AVXVNNI__)
                if (ISA == ISA_AVXVNNI) {
                    tl[h][0] = dpbusd256(tl[h][0], loa, ln[h][j]);
                    tl[h][1] = dpbusd256(tl[h][1], lob, hn[h][j]);
                    th[h] = dpbusd256(dpbusd256(th[h], ln[h][j], hia), hn[h][j], hib);
                } else
#endif
                {
                    tl[h][0] = _mm256_add_epi16(tl[h][0], _mm256_maddubs_epi16(loa, ln[h][j]));
                    tl[h][1] = _mm256_add_epi16(tl[h][1], _mm256_maddubs_epi16(lob, hn[h][j]));
                    th[h] = _mm256_add_epi16(th[h], _mm256_add_epi16(_mm256_maddubs_epi16(ln[h][j], hia),
                                                                     _mm256_maddubs_epi16(hn[h][j], hib)));
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            __m256i sl = tl[h][0], sl1 = tl[h][1], sh = th[h];
            if (!(ISA == ISA_AVXVNNI && HAVE_AVXVNNI_256)) {   /* avx2's int16 chains to int32 */
                sl = _mm256_madd_epi16(sl, ones);
                sl1 = _mm256_madd_epi16(sl1, ones);
                sh = _mm256_madd_epi16(sh, ones);
            }
            const __m256 s = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(sh, 8), _mm256_add_epi32(sl, sl1)));
            out[h] = pair ? _mm256_fmadd_ps(s, _mm256_set1_ps(1.0f / 32768.0f), out[h]) : s;
        }
    }
}

/* x16w_rows512 at 256 bits for q4_1's int16 formats (xs: the minimum factors as floats). */
INLINE void x16w_rows256(const int RR, const int ISA, const int FMT, const uint8_t *w, const uint16_t *d,
                         const uint16_t *m, int c, int N, int K, const int8_t *xq, const float *xd, const float *xs,
                         float *y, const float *bias) {
    const int nb = K / QK, bb = QK * XG / 2, P = X16_PLANES(FMT);
    const uint8_t *wg = w + (long)c * nb * bb;
    const uint16_t *dg = d + (long)c * nb * XG, *mg = m + (long)c * nb * XG;
    __m256 acc[QTR][2], macc[QTR][2];
    for (int r = 0; r < RR; r++)
        for (int h = 0; h < 2; h++) acc[r][h] = macc[r][h] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const __m256 dw[2] = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dg + b * XG))),
                              _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dg + b * XG + 8)))};
        const __m256 mw[2] = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mg + b * XG))),
                              _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mg + b * XG + 8)))};
#if XPF
        for (int l = 0; l < bb; l += 64) _mm_prefetch((const char *)wg + (long)b * bb + XPF + l, _MM_HINT_T0);
#endif
        for (int r = 0; r < RR; r++) {
            __m256 sf[2];
            x16w_block256(ISA, FMT, wg + (long)b * bb, xq + ((long)r * K + b * QK) * P, sf);
            const __m256 xdv = _mm256_set1_ps(xd[r * nb + b]), xsv = _mm256_set1_ps(xs[r * nb + b]);
            for (int h = 0; h < 2; h++) {
                acc[r][h] = _mm256_fmadd_ps(sf[h], _mm256_mul_ps(dw[h], xdv), acc[r][h]);
                macc[r][h] = _mm256_fmadd_ps(mw[h], xsv, macc[r][h]);
            }
        }
    }
    const int n0 = c * XG, live = N - n0 < XG ? N - n0 : XG;
    for (int r = 0; r < RR; r++) {
        float o[XG];
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(o + 8 * h, _mm256_add_ps(acc[r][h], macc[r][h]));
        float *yr = y + (long)r * N + n0;
        for (int i = 0; i < live; i++) yr[i] = bias ? o[i] + bias[n0 + i] : o[i];
    }
}

HIDDEN void x16w_group256(int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,
                          const int8_t *xq, const float *xd, const float *xs, int M, float *y, const float *bias) {
    const int nb = K / QK, P = X16_PLANES(fmt);
#define ROWS(RR, ISA, FMT) x16w_rows256(RR, ISA, FMT, w, d, m, c, N, K, xq + (long)r0 * K * P, xd + r0 * nb, \
                                        xs + r0 * nb, y + (long)r0 * N, bias)
#define FMTS(RR, ISA) if (fmt == Q4_1_I16_X16) ROWS(RR, ISA, Q4_1_I16_X16); else ROWS(RR, ISA, Q4_1_F32_X16);
#if defined(__AVXVNNI__)
#define TILE(RR) if (g_isa == ISA_AVXVNNI) { FMTS(RR, ISA_AVXVNNI) } else { FMTS(RR, ISA_AVX2) }
#else
#define TILE(RR) FMTS(RR, ISA_AVX2)
#endif
    FOR_ROW_TILES(M, TILE)
#undef TILE
#undef FMTS
#undef ROWS
}
#endif   /* __F16C__ */

#if HAVE_AVX512VNNI
/* --- row-interleaved weights (the X16 formats): lanes are weight rows --------------------------

   The row-major kernels above take one weight row at a time: two blocks per vector, lanes partial
   sums within a block, a per-pair permute of the factors and a horizontal sum per row; at ~300
   codes a row (SmolLM2's K = 576) that fixed cost per row is as large as the products. Here 16
   weight rows lie side by side (quant_gemv.h: 4 code bytes of each row per 32-bit lane), so one
   vpdpbusd multiplies the same 4 activation codes (broadcast) into 16 rows, lane i summing row i's
   block; a block's 16 fp16 scales are one vector, its factor one multiply, and the 16 outputs one
   store. As llama.cpp's repacked Q4_0 (block_q4_0x8) and its AMX buffer's VNNI kernels do.

   vpdpbusd multiplies unsigned by signed bytes: q4 nibbles are unsigned already; q8_0's signed
   codes go in as w + 128 (xor 0x80) and the accumulator starts at -128 sum(a), a per activation
   block, shared by every row; q4_0's -8 starts it at -8 sum(a) likewise. So each lane's int32 is
   exactly sum(w a) (with q4_0's w = q - 8), the reference's dot_*_ref sum. */

static inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* The 16 rows' int32 sums of block b (wb: its 16 x B/32 bytes; a: the activation block; asum:
   sum of its codes), in four chains (vpdpbusd's latency, 4-5 cycles, against one a cycle). */
INLINE __m512i x16_block512(const int FMT, const uint8_t *wb, const int8_t *a, int32_t asum) {
    __m512i s0, s1 = _mm512_setzero_si512(), s2 = _mm512_setzero_si512(), s3 = _mm512_setzero_si512();
    if (FMT == Q8_0_Q8_X16) {
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        s0 = _mm512_set1_epi32(-128 * asum);
        for (int j = 0; j < 8; j += 4) {
            s0 = _mm512_dpbusd_epi32(s0, _mm512_xor_si512(_mm512_loadu_si512(wb + 64 * j), flip), bcast4(a + 4 * j));
            s1 = _mm512_dpbusd_epi32(s1, _mm512_xor_si512(_mm512_loadu_si512(wb + 64 * j + 64), flip), bcast4(a + 4 * j + 4));
            s2 = _mm512_dpbusd_epi32(s2, _mm512_xor_si512(_mm512_loadu_si512(wb + 64 * j + 128), flip), bcast4(a + 4 * j + 8));
            s3 = _mm512_dpbusd_epi32(s3, _mm512_xor_si512(_mm512_loadu_si512(wb + 64 * j + 192), flip), bcast4(a + 4 * j + 12));
        }
    } else {   /* unit j's low nibbles are elements 4j..4j+3, its high ones 16+4j.. (ggml's order) */
        const __m512i low = _mm512_set1_epi8(15);
        s0 = FMT == Q4_0_Q8_X16 ? _mm512_set1_epi32(-8 * asum) : _mm512_setzero_si512();
        for (int j = 0; j < 4; j += 2) {
            const __m512i v0 = _mm512_loadu_si512(wb + 64 * j), v1 = _mm512_loadu_si512(wb + 64 * j + 64);
            s0 = _mm512_dpbusd_epi32(s0, _mm512_and_si512(v0, low), bcast4(a + 4 * j));
            s1 = _mm512_dpbusd_epi32(s1, _mm512_and_si512(_mm512_srli_epi16(v0, 4), low), bcast4(a + 16 + 4 * j));
            s2 = _mm512_dpbusd_epi32(s2, _mm512_and_si512(v1, low), bcast4(a + 4 * j + 4));
            s3 = _mm512_dpbusd_epi32(s3, _mm512_and_si512(_mm512_srli_epi16(v1, 4), low), bcast4(a + 20 + 4 * j));
        }
    }
    return _mm512_add_epi32(_mm512_add_epi32(s0, s1), _mm512_add_epi32(s2, s3));
}

/* Group c's 16 outputs of each of RR rows: acc (+ macc, q4_1's minimum terms, when given) (+ bias),
   stored masked past N (a padded tail group). */
INLINE void x16_store(const int RR, const __m512 *acc, const __m512 *macc, int c, int N, float *y, const float *bias) {
    const int n0 = c * XG, live = N - n0 < XG ? N - n0 : XG;
    const __mmask16 k = (__mmask16)((1u << live) - 1);
    for (int r = 0; r < RR; r++) {
        __m512 o = macc ? _mm512_add_ps(acc[r], macc[r]) : acc[r];
        if (bias) o = _mm512_add_ps(o, _mm512_maskz_loadu_ps(k, bias + n0));
        _mm512_mask_storeu_ps(y + (long)r * N + n0, k, o);
    }
}

/* y[r, n0 + i] for the 16 rows of group c and RR activation rows: per block, lane i of acc +=
   float(sum_i) (d_w,i d_x) by one FMA (q4_1: macc += m_w,i (d_x sum(a)), added at the end), in
   block order: the arithmetic of x16_rows_ref, lane for lane. asum: xs as int32 (prepare_activations). */
INLINE void x16_rows512(const int RR, const int FMT, const uint8_t *w, const uint16_t *d, const uint16_t *m, int c,
                        int N, int K, const int8_t *xq, const float *xd, const int32_t *asum, float *y,
                        const float *bias) {
    const int nb = K / QK, bb = FMT == Q8_0_Q8_X16 ? QK * XG : QK * XG / 2;   /* bytes of a group's block */
    const uint8_t *wg = w + (long)c * nb * bb;
    const uint16_t *dg = d + (long)c * nb * XG, *mg = m ? m + (long)c * nb * XG : NULL;
    __m512 acc[QTR], macc[QTR];
    for (int r = 0; r < RR; r++) acc[r] = macc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dg + b * XG)));
#if XPF
        for (int l = 0; l < bb; l += 64) _mm_prefetch((const char *)wg + (long)b * bb + XPF + l, _MM_HINT_T0);
#endif
        for (int r = 0; r < RR; r++) {
            const int32_t as = asum[r * nb + b];
            const __m512i s = x16_block512(FMT, wg + (long)b * bb, xq + (long)r * K + b * QK, as);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_set1_ps(xd[r * nb + b])), acc[r]);
            if (FMT == Q4_1_Q8_X16)
                macc[r] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mg + b * XG))),
                                          _mm512_set1_ps(xd[r * nb + b] * (float)as), macc[r]);
        }
    }
    x16_store(RR, acc, FMT == Q4_1_Q8_X16 ? macc : NULL, c, N, y, bias);
}

HIDDEN void x16_group512(int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,
                         const int8_t *xq, const float *xd, const float *xs, int M, float *y, const float *bias) {
    const int nb = K / QK;
#define ROWS(RR, FMT) x16_rows512(RR, FMT, w, d, m, c, N, K, xq + (long)r0 * K, xd + r0 * nb, \
                                  (const int32_t *)xs + r0 * nb, y + (long)r0 * N, bias)
#define TILE(RR) if (fmt == Q8_0_Q8_X16) ROWS(RR, Q8_0_Q8_X16); \
                 else if (fmt == Q4_0_Q8_X16) ROWS(RR, Q4_0_Q8_X16); else ROWS(RR, Q4_1_Q8_X16);
    FOR_ROW_TILES(M, TILE)
#undef TILE
#undef ROWS
}

/* The int16-activation X16 formats (native_i16's ACT_I16 codes, native's two ACT_SPLIT codes h and
   l): each int16 code c = 256 hi + lo, lo = c & 255 unsigned and hi = c >> 8 signed, so
   sum(w c) = 256 sum(w hi) + sum(w lo), both through vpdpbusd: lo (unsigned) against the weights as
   signed bytes (q4 nibbles and q8_0 codes both are), hi (signed) against nibbles as unsigned
   bytes, or against q8_0's w + 128 with -128 sum(hi) to start (planes_sums). Exact in int32:
   |sum(w c)| <= 128 x 32767 x 32 < 2^31. prepare_activations lays each block's codes out as
   planes of 32 bytes: lo(h), hi(h) [, lo(l), hi(l)]. */

/* lane sums of one weight vector wv (16 rows x 4 elements) with the activation quad at plane
   byte offset o, plane pair (lo, hi) starting at pl: lo into sl, hi into sh. */
#define X16W_QUAD(WV, WX, PL, O, SL, SH)                                                           \
    SL = _mm512_dpbusd_epi32(SL, bcast4(PL + (O)), WV);                                              \
    SH = _mm512_dpbusd_epi32(SH, WX, bcast4(PL + 32 + (O)));

/* One block of a group: the 16 rows' sum(w h) (and sum(w l)) -> the block's float value per lane:
   float(sum(w h)) for i16, float(sum(w h)) + float(sum(w l)) / 2^15 for split (one FMA, as the
   row-major kernels' i16_block). hs: q8_0's -128 sum(hi) starts (two int16 halves for split). */
INLINE __m512 x16w_block512(const int FMT, const uint8_t *wb, const int8_t *a, int32_t hs) {
    const int P = X16_PLANES(FMT);
    __m512 out = _mm512_setzero_ps();
    for (int pair = 0; pair < P / 2; pair++) {
        const int8_t *pl = a + pair * 64;
        const int32_t hsum = pair ? (hs >> 16) : (int16_t)(hs & 0xFFFF);
        __m512i sl0 = _mm512_setzero_si512(), sl1 = _mm512_setzero_si512(), sh1 = _mm512_setzero_si512();
        __m512i sh0 = X16_Q8W(FMT) ? _mm512_set1_epi32(-128 * hsum) : _mm512_setzero_si512();
        if (X16_Q8W(FMT)) {
            const __m512i flip = _mm512_set1_epi8((char)0x80);
            for (int j = 0; j < 8; j += 2) {
                const __m512i v0 = _mm512_loadu_si512(wb + 64 * j), v1 = _mm512_loadu_si512(wb + 64 * j + 64);
                X16W_QUAD(v0, _mm512_xor_si512(v0, flip), pl, 4 * j, sl0, sh0)
                X16W_QUAD(v1, _mm512_xor_si512(v1, flip), pl, 4 * j + 4, sl1, sh1)
            }
        } else {
            const __m512i low = _mm512_set1_epi8(15);
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_loadu_si512(wb + 64 * j);
                const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                X16W_QUAD(lo, lo, pl, 4 * j, sl0, sh0)
                X16W_QUAD(hi, hi, pl, 16 + 4 * j, sl1, sh1)
            }
        }
        const __m512i s = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(sh0, sh1), 8), _mm512_add_epi32(sl0, sl1));
        out = pair ? _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(1.0f / 32768.0f), out) : _mm512_cvtepi32_ps(s);
    }
    return out;
}
#undef X16W_QUAD

/* x16_rows512 for the int16-activation formats (xs: q4_1's minimum factors as floats, q8_0's
   -128 starts as int32: prepare_activations). */
INLINE void x16w_rows512(const int RR, const int FMT, const uint8_t *w, const uint16_t *d, const uint16_t *m, int c,
                         int N, int K, const int8_t *xq, const float *xd, const float *xs, float *y,
                         const float *bias) {
    const int nb = K / QK, bb = X16_Q8W(FMT) ? QK * XG : QK * XG / 2, P = X16_PLANES(FMT), q41 = !X16_Q8W(FMT);
    const uint8_t *wg = w + (long)c * nb * bb;
    const uint16_t *dg = d + (long)c * nb * XG, *mg = m ? m + (long)c * nb * XG : NULL;
    __m512 acc[QTR], macc[QTR];
    for (int r = 0; r < RR; r++) acc[r] = macc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dg + b * XG)));
#if XPF
        for (int l = 0; l < bb; l += 64) _mm_prefetch((const char *)wg + (long)b * bb + XPF + l, _MM_HINT_T0);
#endif
        for (int r = 0; r < RR; r++) {
            const __m512 sf = x16w_block512(FMT, wg + (long)b * bb, xq + ((long)r * K + b * QK) * P, q41 ? 0 :
                                            ((const int32_t *)xs)[r * nb + b]);
            acc[r] = _mm512_fmadd_ps(sf, _mm512_mul_ps(dw, _mm512_set1_ps(xd[r * nb + b])), acc[r]);
            if (q41)
                macc[r] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mg + b * XG))),
                                          _mm512_set1_ps(xs[r * nb + b]), macc[r]);
        }
    }
    x16_store(RR, acc, q41 ? macc : NULL, c, N, y, bias);
}

HIDDEN void x16w_group512(int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,
                          const int8_t *xq, const float *xd, const float *xs, int M, float *y, const float *bias) {
    const int nb = K / QK, P = X16_PLANES(fmt);
#define ROWS(RR, FMT) x16w_rows512(RR, FMT, w, d, m, c, N, K, xq + (long)r0 * K * P, xd + r0 * nb, xs + r0 * nb, \
                                   y + (long)r0 * N, bias)
#define TILE(RR)                                                 \
        switch (fmt) {                                           \
        case Q8_0_I16_X16: ROWS(RR, Q8_0_I16_X16); break;        \
        case Q4_1_I16_X16: ROWS(RR, Q4_1_I16_X16); break;        \
        case Q8_0_F32_X16: ROWS(RR, Q8_0_F32_X16); break;        \
        default: ROWS(RR, Q4_1_F32_X16);                         \
        }
    FOR_ROW_TILES(M, TILE)
#undef TILE
#undef ROWS
}
#endif   /* HAVE_AVX512VNNI */

#if defined(__F16C__)
/* x16_block_sums at the x86 levels: one block's 16 rows' int32 sums through the kernels above */
HIDDEN void x16_sums_x86(int fmt, const uint8_t *wb, const int8_t *ab, int32_t asum, int32_t *out) {
#if HAVE_AVX512VNNI
    if (g_isa == ISA_AVX512VNNI) {
        const __m512i s = fmt == Q8_0_Q8_X16 ? x16_block512(Q8_0_Q8_X16, wb, ab, asum)
                          : fmt == Q4_0_Q8_X16 ? x16_block512(Q4_0_Q8_X16, wb, ab, asum)
                          : x16_block512(Q4_1_Q8_X16, wb, ab, asum);
        _mm512_storeu_si512(out, s);
        return;
    }
#endif
    __m256i s[2];   /* the 256-bit levels */
#define SUMS(ISA) if (fmt == Q8_0_Q8_X16) x16_block256(ISA, Q8_0_Q8_X16, wb, ab, asum, s);      \
                  else if (fmt == Q4_0_Q8_X16) x16_block256(ISA, Q4_0_Q8_X16, wb, ab, asum, s); \
                  else x16_block256(ISA, Q4_1_Q8_X16, wb, ab, asum, s);
    if (g_isa == ISA_AVXVNNI) { SUMS(ISA_AVXVNNI) } else { SUMS(ISA_AVX2) }
#undef SUMS
    for (int h = 0; h < 2; h++) _mm256_storeu_si256((__m256i *)(out + 8 * h), s[h]);
}
#endif
#endif   /* HAVE_AVX2 */
