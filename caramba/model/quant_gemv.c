/* Matrix-vector products straight from block-quantized weights (caramba.model.quant).

   A batch-1 decode step is a string of GEMVs: each weight is read once per token, so the time is
   the bytes read. These loops read llama.cpp's block formats where they lie (no fp32 copy of the
   weight is ever made): q8_0 is 32 int8 codes and one fp16 scale per block (34 bytes for 32
   weights, 8.5 bits), q4_1 is 32 4-bit codes, an fp16 scale d and an fp16 minimum m (20 bytes).

   Layouts (row n of an [N, K] weight, K a multiple of 32, blocks along K):
     q8_0: qs int8 [N, K], d fp16 [N, K/32];            w = d * q
     q4_0: qs uint8 [N, K/2], d fp16 [N, K/32];         w = d * (q - 8), nibbles as q4_1's (18 bytes)
     q4_1: qs uint8 [N, K/2], d, m fp16 [N, K/32];      w = d * q + m, q in 0..15, byte j of a block
           holds element j in its low nibble and element j + 16 in its high one (ggml's layout).

   The same blocks row-interleaved, 16 rows to a group (quant_gemv.h's X16 formats), are what the
   decode products read where the level has an x16 kernel for the format (x16_vector):
   "row-interleaved weights" below.

   Three activation modes:
     gemv_q8_0_q8 / gemv_q4_1_q8: the activations are quantized to q8_0 on the fly (per 32-block,
       scale amax/127) and the dot product runs in int8 x int8 -> int32, as llama.cpp's q8_0 x q8_0
       does: fastest, and adds the activation rounding error (relative ~1/254 per block).
     gemv_q8_0_i16 / gemv_q4_1_i16: int16 codes (scale amax/32767) in int16 x int16 -> int32
       multiply-adds: about the q8 kernels' speed at 1/258 of their rounding error.
     gemv_q8_0_f32 / gemv_q4_1_f32: fp32 activations times the exact weight values: the product
       differs from dequantize-then-matmul only at the level of fp32 rounding. At the vector levels
       (AVX2 and up, and ARM's neon, bit-identical to AVX2's) each block of x is split into two int16 code vectors on a power-of-two scale, x = s (h + l / 2^15) to
       within s / 2^16 (below fp32's own rounding of the block's largest element: s <= 2 amax /
       32767), and runs through the int16 multiply-adds twice; an int-to-float conversion per
       weight (the portable build's way) took ~1.5x as long with AVX2 (the instruction count, not
       the bytes, bounds these products).

   x is [M, K] fp32 (M small: a decode step or a few rows), out is [M, N] fp32. Every weight row
   is read once for all M rows. Parallel over output rows with OpenMP (the process shares
   torch's libgomp).

   Levels (cpu_isa.c): the portable reference (scalar), the x86 vector kernels (avx2 .. avx512vnni)
   and ARM's neon, which runs every row-major format with avx2's lanes and order (vdotq_s32, or
   widening multiplies without the dot-product extension; "ARM" below); the row-interleaved (x16)
   layout has kernels at avx512vnni (512 bits, every format), at avx2, avxvnni and avx512 (256
   bits: all but q8_0 with int16 codes) and at neon with sdot (q8 activations), the reference
   elsewhere. */

#include "quant_gemv.h"

#include <stdlib.h>
#include <math.h>
#include <omp.h>

/* The activation codes of the integer products (mode), per 32-block of x [M, K]:
     ACT_Q8:    int8 codes [M, K], scale amax / 127, rounded to nearest (llama.cpp's q8_0 rule);
     ACT_I16:   int16 codes [M, K], scale amax / 32767: at most amax / 65534 off per element, 258
                times less than q8 and of the order of fp16's rounding;
     ACT_SPLIT: two int16 codes per element, [M, 2K] (per block 32 h then 32 l), on the
                power-of-two scale s = 2^e >= amax / 32767: h = round(x / s), l = round((x / s - h)
                2^15), x = s (h + l / 2^15) to within s / 2^16. x / s and its residual are exact
                (a power of two scales without rounding), so only l's rounding is an error.
   scales d [M, K/32]. With these codes a block-quantized weight's product runs in integer
   multiply-adds (madd_epi16) instead of an int-to-float conversion per weight. */
enum { ACT_Q8 = 0, ACT_I16 = 1, ACT_SPLIT = 2 };

/* The int16-activation X16 formats: byte planes of their codes per block (2, or 4 for ACT_SPLIT's
   two codes), and whether the weights are q8_0 (else q4_1). */
#define X16_PLANES(FMT) ((FMT) == Q8_0_F32_X16 || (FMT) == Q4_1_F32_X16 ? 4 : 2)
#define X16_Q8W(FMT) ((FMT) == Q8_0_I16_X16 || (FMT) == Q8_0_F32_X16)

/* A block's scale d and its inverse for the codes of `mode`, from its largest magnitude. */
static inline void block_scale(float amax, int mode, float *scale, float *inv) {
    if (!(amax <= 3.4e38f))   /* a NaN or an infinity in the block: its products come out NaN */
        *scale = *inv = NAN;
    else if (mode == ACT_SPLIT) {
        int e;
        frexpf(amax / 32767.0f, &e);        /* amax / 32767 < 2^e */
        if (e < -100) e = -100;             /* tiny blocks: 2^-e stays finite */
        *scale = amax ? ldexpf(1.0f, e) : 0.0f;
        *inv = amax ? ldexpf(1.0f, -e) : 0.0f;
    } else {
        *scale = amax / (mode == ACT_I16 ? 32767.0f : 127.0f);
        *inv = *scale ? 1.0f / *scale : 0.0f;
    }
}

/* The portable reference: one element at a time. */
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

#if HAVE_AVX2
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
#endif

#if HAVE_NEON
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
#endif

/* All give the same codes and scales (tests/test_isa.py); the library's ISA level picks. Rows
   m0 .. m1-1. */
static void quantize_range(const float *x, int m0, int m1, int K, int mode, void *q, float *d) {
    const int nb = K / QK, width = mode == ACT_SPLIT ? 2 : 1;   /* codes per element */
    for (int m = m0; m < m1; m++)
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (long)m * K + b * QK;
            int8_t *q8 = (int8_t *)q + (long)m * K + b * QK;
            int16_t *q16 = (int16_t *)q + ((long)m * K + b * QK) * width;
#if HAVE_AVX2
            if (g_isa >= ISA_AVX2) {
                quantize_block_avx2(xb, mode, q8, q16, d + m * nb + b);
                continue;
            }
#endif
#if HAVE_NEON
            if (g_isa == ISA_NEON) {
                quantize_block_neon(xb, mode, q8, q16, d + m * nb + b);
                continue;
            }
#endif
            quantize_block_ref(xb, mode, q8, q16, d + m * nb + b);
        }
}

/* A prompt's rows (a prefill GEMM's activations) split among the threads: on one thread a
   [512, 1536] input took 0.11 ms, 13% of its q8_0 layer at two threads. A decode step's few
   rows stay on the calling thread: an OpenMP region costs ~1 us, and with the loop outlined into
   it one thread ran 20% slower. */
static void quantize_rows(const float *x, int M, int K, int mode, void *q, float *d) {
    if (M < 64 || omp_get_max_threads() < 2 || omp_in_parallel()) {
        quantize_range(x, 0, M, K, mode, q, d);
        return;
    }
#pragma omp parallel
    {
        const int t = omp_get_thread_num(), n = omp_get_num_threads();
        quantize_range(x, (int)((long)M * t / n), (int)((long)M * (t + 1) / n), K, mode, q, d);
    }
}

/* The codes for tests (the activations the integer products take). */
void quantize_activations_q8(const float *x, int M, int K, int8_t *q, float *d) { quantize_rows(x, M, K, ACT_Q8, q, d); }

void quantize_activations_i16(const float *x, int M, int K, int16_t *q, float *d) { quantize_rows(x, M, K, ACT_I16, q, d); }

void split_activations(const float *x, int M, int K, int16_t *q, float *d) { quantize_rows(x, M, K, ACT_SPLIT, q, d); }

/* Rows ids [n] of a q8_0 weight [N, K] (codes qs, scales d) dequantized into out [n, K], one
   product per element as dequantize_q8_0 takes it: a quantized head's embedding lookup in one
   call, where ~8 torch ops took ~0.09 ms of each decode step. Returns 0, or 1 + the index of the
   first id outside [0, N) (nothing is read for it). */
long embed_rows_q8_0(const int64_t *ids, long n, const int8_t *qs, const uint16_t *d, long N, int K, float *out) {
    for (long i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= N) return i + 1;
    const int nb = K / QK;
    for (long i = 0; i < n; i++) {
        const int8_t *q = qs + ids[i] * K;
        const uint16_t *dr = d + ids[i] * nb;
        float *o = out + i * K;
        for (int b = 0; b < nb; b++) {
            const float s = fp16_to_fp32(dr[b]);
            for (int j = 0; j < QK; j++) o[b * QK + j] = (float)q[b * QK + j] * s;
        }
    }
    return 0;
}

/* embed_rows_q8_0 for Q8_0_Q8_X16's interleaved codes and scales (quant_gemv.h). */
long embed_rows_q8_0_x16(const int64_t *ids, long n, const int8_t *qs, const uint16_t *d, long N, int K, float *out) {
    for (long i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= N) return i + 1;
    const int nb = K / QK;
    for (long i = 0; i < n; i++) {
        const long g = ids[i] / XG, lane = ids[i] % XG;
        const int8_t *q = qs + g * (long)K * XG + 4 * lane;
        const uint16_t *dr = d + g * (long)nb * XG + lane;
        float *o = out + i * K;
        for (int b = 0; b < nb; b++) {
            const float s = fp16_to_fp32(dr[(long)b * XG]);
            for (int j = 0; j < QK; j++) o[b * QK + j] = (float)q[((long)b * QK + j) / 4 * 4 * XG + j % 4] * s;
        }
    }
    return 0;
}

/* --- products: one weight row times up to QTR activation rows --------------------------------

   A decode step has one activation row per projection; a batch, a speculative verify or a short
   chunk has several. Every weight block is then unpacked once (its signs taken, its nibbles
   spread, its codes widened, its fp16 factors converted) and multiplied into QTR
   activation rows held in registers: before, each row repeated the unpacking, and a batch-8
   q8_0 step cost 4.3x a batch-1 step. A row's arithmetic is the same whichever tile it lands
   in (RR = 1 is the decode step's), so a row's product never depends on the batch around it. */

#define QTR 4   /* activation rows per tile */
/* The M activation rows in tiles of at most QTR: TILE(RR) for each, RR a constant (the rows
   kernels unroll over it), r0 the tile's first row. */
#define FOR_ROW_TILES(M, TILE)                         \
    for (int r0 = 0; r0 < (M); r0 += QTR)              \
        switch ((M) - r0 < QTR ? (M) - r0 : QTR) {     \
        case 1: TILE(1) break;                         \
        case 2: TILE(2) break;                         \
        case 3: TILE(3) break;                         \
        default: TILE(4)                               \
        }
#define FACTOR_CHUNK 32   /* blocks whose factors block_factors converts at a time */

/* The formats whose weights carry a zero point (q4_1's minimums, q4_0's -8): their products add
   m_w xs per block, xs from prepare_activations. */
#define ZERO_POINT(FMT) ((FMT) == Q4_1_F32 || (FMT) == Q4_1_I16 || (FMT) == Q4_1_Q8 || (FMT) == Q4_0_Q8)

#if HAVE_AVX2

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

static void x16_group256(int isa, int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,
                         const int8_t *xq, const float *xd, const float *xs, int M, float *y, const float *bias) {
    const int nb = K / QK;
    (void)isa;
#define ROWS(RR, ISA, FMT) x16_rows256(RR, ISA, FMT, w, d, m, c, N, K, xq + (long)r0 * K, xd + r0 * nb, \
                                       (const int32_t *)xs + r0 * nb, y + (long)r0 * N, bias)
#define FMTS(RR, ISA) if (fmt == Q8_0_Q8_X16) ROWS(RR, ISA, Q8_0_Q8_X16); \
                      else if (fmt == Q4_0_Q8_X16) ROWS(RR, ISA, Q4_0_Q8_X16); else ROWS(RR, ISA, Q4_1_Q8_X16);
#if defined(__AVXVNNI__)
#define TILE(RR) if (isa == ISA_AVXVNNI) { FMTS(RR, ISA_AVXVNNI) } else { FMTS(RR, ISA_AVX2) }
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

static void x16w_group256(int isa, int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,
                          const int8_t *xq, const float *xd, const float *xs, int M, float *y, const float *bias) {
    const int nb = K / QK, P = X16_PLANES(fmt);
    (void)isa;
#define ROWS(RR, ISA, FMT) x16w_rows256(RR, ISA, FMT, w, d, m, c, N, K, xq + (long)r0 * K * P, xd + r0 * nb, \
                                        xs + r0 * nb, y + (long)r0 * N, bias)
#define FMTS(RR, ISA) if (fmt == Q4_1_I16_X16) ROWS(RR, ISA, Q4_1_I16_X16); else ROWS(RR, ISA, Q4_1_F32_X16);
#if defined(__AVXVNNI__)
#define TILE(RR) if (isa == ISA_AVXVNNI) { FMTS(RR, ISA_AVXVNNI) } else { FMTS(RR, ISA_AVX2) }
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

static void x16_group512(int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,
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

static void x16w_group512(int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,
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
#endif   /* HAVE_AVX2 */

#if HAVE_NEON
/* --- ARM (the neon level): avx2's lanes, two 128-bit halves at a time --------------------------

   avx2's block_rows, lane for lane: a block's 8 int32 lanes (lane i summing elements 4i..4i+3 of
   the int8 products, or 2i, 2i+1, 16+2i, 17+2i of the int16 ones) are the same exact sums here,
   held as two int32x4 (lanes 0-3, 4-7); each converts to float exactly and goes into its row's even
   or odd accumulator by one fused multiply-add with the same factor; the factors, the minimums'
   lanes (block_factors' groups of 8 blocks, its masked tail and its scalar remainder), the sum of
   the two accumulators and hsum8's order are avx2's too. So a neon product is avx2's bit for bit
   (tests/test_cross_arm.py compares them). */

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

static void x16_group_neon(int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,
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
#endif   /* HAVE_NEON_DOT */

/* quant_rows_vec for the neon level: every row-major format, QTR activation rows per tile. */
static void quant_rows_neon(int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,
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
#endif   /* HAVE_NEON */

/* --- the portable reference: the same sums, one element at a time ----------------------------

   The int32 sum of one block's products (q8_0 codes w, q4 nibbles: element j low, j + 16 high),
   exactly what every vector level's lanes add up to. */
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

static void x16_rows_ref(int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,
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

static void x16w_rows_ref(int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,
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

/* int16 codes [n, 32] (per block; split: h then l) -> byte planes lo(h), hi(h) [, lo(l), hi(l)] in
   place, and the sums of the hi planes (q8_0 weights' starts; split: l's in the high half). */
static void codes_to_planes(int8_t *q, long nblocks, int split, int32_t *hsums) {
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

/* Whether the library's level (g_isa) runs a vector kernel for X16 format fmt, rather than the
   reference: every X16 format at avx512vnni; at avx2, avxvnni and avx512 (256 bits) the
   q8-activation ones and q4_1's int16 ones; at neon, where the build has the dot product, the
   q8-activation ones. caramba.model.quant makes layers
   x16 only where this says so. */
int x16_vector(int fmt) {
    if (!is_x16(fmt)) return 0;
#if HAVE_AVX512VNNI
    if (g_isa == ISA_AVX512VNNI) return 1;
#endif
#if HAVE_AVX2 && defined(__F16C__)
    if (g_isa >= ISA_AVX2 && g_isa <= ISA_AVX512 && !X16_Q8W(fmt)) return 1;
#endif
#if HAVE_NEON_DOT
    if (!is_x16_wide(fmt) && g_isa == ISA_NEON) return 1;
#endif
    return 0;
}

/* For tests: the int32 sums of nb blocks of one X16 group (w: its codes, [nb, B/4, 16, 4]) times
   one activation row's q8 codes a [nb * 32] -> out [nb, 16], through the library's level (the
   512-bit kernel's at avx512vnni, the 256-bit one's at avx2, avxvnni and avx512, neon's in a
   build with the dot product, else the reference). */
void x16_block_sums(int fmt, const void *w, const int8_t *a, int nb, int32_t *out) {
    const int bb = fmt == Q8_0_Q8_X16 ? QK * XG : QK * XG / 2;
    for (int b = 0; b < nb; b++) {
        const int8_t *ab = a + b * QK;
        const uint8_t *wb = (const uint8_t *)w + (long)b * bb;
        int32_t asum = 0;
        for (int i = 0; i < QK; i++) asum += ab[i];
#if HAVE_AVX512VNNI
        if (g_isa == ISA_AVX512VNNI) {
            const __m512i s = fmt == Q8_0_Q8_X16 ? x16_block512(Q8_0_Q8_X16, wb, ab, asum)
                              : fmt == Q4_0_Q8_X16 ? x16_block512(Q4_0_Q8_X16, wb, ab, asum)
                              : x16_block512(Q4_1_Q8_X16, wb, ab, asum);
            _mm512_storeu_si512(out + b * XG, s);
            continue;
        }
#endif
#if HAVE_AVX2 && defined(__F16C__)
        if (g_isa >= ISA_AVX2 && g_isa <= ISA_AVX512) {
            __m256i s[2];
#define SUMS(ISA) if (fmt == Q8_0_Q8_X16) x16_block256(ISA, Q8_0_Q8_X16, wb, ab, asum, s);      \
                  else if (fmt == Q4_0_Q8_X16) x16_block256(ISA, Q4_0_Q8_X16, wb, ab, asum, s); \
                  else x16_block256(ISA, Q4_1_Q8_X16, wb, ab, asum, s);
            if (g_isa == ISA_AVXVNNI) { SUMS(ISA_AVXVNNI) } else { SUMS(ISA_AVX2) }
#undef SUMS
            for (int h = 0; h < 2; h++) _mm256_storeu_si256((__m256i *)(out + b * XG + 8 * h), s[h]);
            continue;
        }
#endif
#if HAVE_NEON_DOT
        if (g_isa == ISA_NEON) {
            int32x4_t s[4];
            if (fmt == Q8_0_Q8_X16) x16_block_neon(Q8_0_Q8_X16, wb, ab, asum, s);
            else if (fmt == Q4_0_Q8_X16) x16_block_neon(Q4_0_Q8_X16, wb, ab, asum, s);
            else x16_block_neon(Q4_1_Q8_X16, wb, ab, asum, s);
            for (int q = 0; q < 4; q++) vst1q_s32(out + b * XG + 4 * q, s[q]);
            continue;
        }
#endif
        for (int i = 0; i < XG; i++) out[b * XG + i] = x16_block_ref(fmt, wb, i, ab, asum);
    }
}

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

/* The activations a block format's product takes, for M rows of x [M, K]: codes xq (q8, int16 or,
   for fp32 products at a vector level, ACT_SPLIT's [M, 2K]), their scales xd and, for zero-point weights,
   xs [M, K/32]: d_x sum(a_i), or for q4_1 x fp32 the fp32 block sums of x. */
HIDDEN void prepare_activations(int fmt, const float *x, int M, int K, int8_t *xq, float *xd, float *xs) {
    const int nb = K / QK;
    const int f32 = fmt == Q4_1_F32 || fmt == Q8_0_F32, wide = fmt == Q8_0_I16 || fmt == Q4_1_I16;
    if (is_x16_wide(fmt)) {   /* codes as byte planes; xs: q4_1's minimum factors, q8_0's hi sums */
        const int split = X16_PLANES(fmt) == 4;
        quantize_rows(x, M, K, split ? ACT_SPLIT : ACT_I16, xq, xd);
        if (fmt == Q4_1_I16_X16)
            for (int mb = 0; mb < M * nb; mb++) {
                int32_t s = 0;
                for (int i = 0; i < QK; i++) s += ((const int16_t *)xq)[(long)mb * QK + i];
                xs[mb] = xd[mb] * (float)s;
            }
        if (fmt == Q4_1_F32_X16)
            for (int mb = 0; mb < M * nb; mb++) {
                float s = 0.0f;
                for (int i = 0; i < QK; i++) s += x[(long)mb * QK + i];
                xs[mb] = s;
            }
        codes_to_planes(xq, (long)M * nb, split, X16_Q8W(fmt) ? (int32_t *)xs : NULL);
        return;
    }
    if (fmt == Q4_1_F32)
        for (int m = 0; m < M; m++)
            for (int b = 0; b < nb; b++) {
                float s = 0.0f;
                for (int i = 0; i < QK; i++) s += x[(long)m * K + b * QK + i];
                xs[m * nb + b] = s;
            }
    if (f32) {
        if ((HAVE_AVX2 || HAVE_NEON) && g_isa != ISA_SCALAR) quantize_rows(x, M, K, ACT_SPLIT, xq, xd);
        return;
    }
    quantize_rows(x, M, K, wide ? ACT_I16 : ACT_Q8, xq, xd);
    if (is_x16(fmt)) {   /* the X16 kernels take the codes' integer sums: xs holds int32s */
        int32_t *as = (int32_t *)xs;
        for (int mb = 0; mb < M * nb; mb++) {
            int32_t s = 0;
            for (int i = 0; i < QK; i++) s += xq[(long)mb * QK + i];
            as[mb] = s;
        }
        return;
    }
    if (fmt != Q8_0_Q8 && fmt != Q8_0_I16)
        for (int m = 0; m < M; m++)
            for (int b = 0; b < nb; b++) {
                int32_t s = 0;
                for (int i = 0; i < QK; i++) s += wide ? ((const int16_t *)xq)[(long)m * K + b * QK + i]
                                                       : xq[(long)m * K + b * QK + i];
                xs[m * nb + b] = xd[m * nb + b] * (float)s;
            }
}

/* y[r * N + n] = x_r . weight row n (+ bias[n], bias may be NULL) for the weight rows of chunk c
   (the c-th ROWS_CHUNK of them; row_chunks(N) in all) and the M rows, QTR activation rows per pass
   (w: the codes of an [N, K] weight, d/m: its fp16 scales/minimums; xq, xd, xs from
   prepare_activations). The threads share out the chunks. */
/* ROWS_CHUNK (quant_gemv.h): weight rows per call, the first row's factors wait to be made once per call */

typedef void quant_rows_fn(int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,
                           const float *x, const int8_t *xq, const float *xd, const float *xs, int M, float *y,
                           const float *bias);

/* The portable reference (cpu_isa.c's scalar level): fp32 activations for the fp32 products. */
static void quant_rows_ref(int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,
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

#if HAVE_AVX2
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
    static void NAME(int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,      \
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
#endif   /* HAVE_AVX2 */

/* For tests: the int32 sums of n blocks' products (kind 0: q8_0 x q8, 1: q4 x q8, 2: q8_0 x int16,
   3: q4 x int16; w: the blocks' codes or nibbles, a: the activation codes) into out[n], through
   the library's level's integer primitives as its products use them (a vector's lanes added up
   in int32, exactly), or through the reference. */
static inline int32_t hsum_i32(const int32_t *lanes, int n) {
    int32_t s = 0;
    for (int i = 0; i < n; i++) s += lanes[i];
    return s;
}

void block_sums(int kind, const void *w, const void *a, int n, int32_t *out) {
    const int8_t *w8 = w, *a8 = a;
    const uint8_t *w4 = w;
    const int16_t *a16 = a;
    for (int b = 0; b < n; b++) {
        const int8_t *wb8 = w8 + b * QK, *ab8 = a8 + b * QK;
        const uint8_t *wb4 = w4 + b * QK / 2;
        const int16_t *ab16 = a16 + b * QK;
        int32_t lanes[16];
        (void)lanes;
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
#if HAVE_AVX2
        if (g_isa >= ISA_AVX2) {
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
            continue;
        }
#endif
#if HAVE_NEON
        if (g_isa == ISA_NEON) {
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
            continue;
        }
#endif
        out[b] = kind == 0 ? dot_q8_0_q8_ref(wb8, ab8) : kind == 1 ? dot_q4_q8_ref(wb4, ab8)
                 : kind == 2 ? dot_q8_0_i16_ref(wb8, ab16) : dot_q4_i16_ref(wb4, ab16);
    }
}

/* cpu_isa.c's levels -> their rows (NULL: not built here; isa_pick never chooses those). */
static quant_rows_fn *const QUANT_ROWS[ISA_LEVELS] = {
    quant_rows_ref,
#if HAVE_AVX2
    quant_rows_avx2,
#else
    NULL,
#endif
#if HAVE_AVX2 && defined(__AVXVNNI__)
    quant_rows_avxvnni,
#else
    NULL,
#endif
#if HAVE_AVX512
    quant_rows_avx512,
#else
    NULL,
#endif
#if HAVE_AVX512VNNI
    quant_rows_avx512vnni,
#else
    NULL,
#endif
#if HAVE_NEON
    quant_rows_neon,
#else
    NULL,
#endif
};

/* The library's level's rows (g_isa: set when it loads, or by isa_set, never while a product runs). */
HIDDEN void quant_rows(int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,
                       const float *x, const int8_t *xq, const float *xd, const float *xs, int M, float *y,
                       const float *bias) {
    if (is_x16(fmt)) {
        const int wide = is_x16_wide(fmt);
#if HAVE_AVX512VNNI
        if (g_isa == ISA_AVX512VNNI) {
            (wide ? x16w_group512 : x16_group512)(fmt, w, d, m, c, N, K, xq, xd, xs, M, y, bias);
            return;
        }
#endif
#if HAVE_NEON_DOT
        if (!wide && g_isa == ISA_NEON) {
            x16_group_neon(fmt, w, d, m, c, N, K, xq, xd, xs, M, y, bias);
            return;
        }
#endif
#if HAVE_AVX2 && defined(__F16C__)
        if (x16_vector(fmt)) {   /* the 256-bit levels */
            const int level = g_isa == ISA_AVXVNNI ? ISA_AVXVNNI : ISA_AVX2;
            (wide ? x16w_group256 : x16_group256)(level, fmt, w, d, m, c, N, K, xq, xd, xs, M, y, bias);
            return;
        }
#endif
        (wide ? x16w_rows_ref : x16_rows_ref)(fmt, w, d, m, c, N, K, xq, xd, xs, M, y, bias);
        return;
    }
    QUANT_ROWS[g_isa](fmt, w, d, m, c, N, K, x, xq, xd, xs, M, y, bias);
}

/* x [M, K] fp32 times an [N, K] block-format weight -> out [M, N]; parallel over weight rows. */
static int gemv_blocks(int fmt, const float *x, const void *qs, const uint16_t *d, const uint16_t *mins, float *out,
                       int M, int N, int K, int nthreads) {
    const int nb = K / QK;
    int8_t *xq = malloc(2 * sizeof(int16_t) * (size_t)M * K);   /* q8, int16 or split int16 codes */
    float *xd = malloc(sizeof(float) * (size_t)M * nb), *xs = malloc(sizeof(float) * (size_t)M * nb);
    if (!xq || !xd || !xs) { free(xq); free(xd); free(xs); return 1; }   /* the caller raises MemoryError */
    prepare_activations(fmt, x, M, K, xq, xd, xs);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int c = 0; c < row_chunks(N); c++) quant_rows(fmt, qs, d, mins, c, N, K, x, xq, xd, xs, M, out, NULL);
    free(xq);
    free(xd);
    free(xs);
    return 0;
}

int gemv_q8_0_q8(const float *x, const int8_t *qs, const uint16_t *d, float *out, int M, int N, int K, int nthreads) {
    return gemv_blocks(Q8_0_Q8, x, qs, d, NULL, out, M, N, K, nthreads);
}

int gemv_q8_0_f32(const float *x, const int8_t *qs, const uint16_t *d, float *out, int M, int N, int K, int nthreads) {
    return gemv_blocks(Q8_0_F32, x, qs, d, NULL, out, M, N, K, nthreads);
}

int gemv_q4_1_f32(const float *x, const uint8_t *qs, const uint16_t *d, const uint16_t *mins, float *out,
                  int M, int N, int K, int nthreads) {
    return gemv_blocks(Q4_1_F32, x, qs, d, mins, out, M, N, K, nthreads);
}

int gemv_q8_0_i16(const float *x, const int8_t *qs, const uint16_t *d, float *out, int M, int N, int K, int nthreads) {
    return gemv_blocks(Q8_0_I16, x, qs, d, NULL, out, M, N, K, nthreads);
}

int gemv_q4_1_i16(const float *x, const uint8_t *qs, const uint16_t *d, const uint16_t *mins, float *out,
                  int M, int N, int K, int nthreads) {
    return gemv_blocks(Q4_1_I16, x, qs, d, mins, out, M, N, K, nthreads);
}

/* The X16 formats (quant_gemv.h's ids 9-11: codes, scales and minimums row-interleaved). */
int gemv_x16(int fmt, const float *x, const void *qs, const uint16_t *d, const uint16_t *mins, float *out,
             int M, int N, int K, int nthreads) {
    if (!is_x16(fmt)) return 2;
    return gemv_blocks(fmt, x, qs, d, mins, out, M, N, K, nthreads);
}

/* mins NULL: q4_0 weights (w = d (q - 8)). */
int gemv_q4_1_q8(const float *x, const uint8_t *qs, const uint16_t *d, const uint16_t *mins, float *out,
                 int M, int N, int K, int nthreads) {
    return gemv_blocks(mins ? Q4_1_Q8 : Q4_0_Q8, x, qs, d, mins, out, M, N, K, nthreads);
}

/* --- choosing the codes ------------------------------------------------------------------------

   llama.cpp quantizes a block with the scale that maps its largest element onto the largest code
   (q8_0: amax / 127). That is rarely the scale with the least error, and far from it when the
   weights were quantized before (a Q4_1 checkpoint holds 16 levels per block, which a slightly
   coarser q8_0 step can land on almost exactly): on SmolLM2 the search below cuts the weights'
   squared error to ~0.3x and the q8_0 model's perplexity cost from +1.1 % to ~+0.3 %.

   For every block of 32: the element of largest magnitude M; each candidate scale
   s = f M / qref for f in `f` and qref in {qmin, qmax} (both ends of an asymmetric range such as
   q4_0's -8..7); codes c = clamp(round(x / s), qmin, qmax); the least-squares scale for those
   codes d = sum(x c) / sum(c c), whose squared error is sum(x x) - sum(x c)^2 / sum(c c). The
   candidate with the least error wins. codes [nblocks * 32] int8, d [nblocks] fp32 (the caller
   stores it as fp16). */

static inline void block_codes(const float *x, float inv, float qmin, float qmax, float *c, float *xc, float *cc) {
#if HAVE_AVX2
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
#else
    float a = 0.0f, b = 0.0f;
    for (int j = 0; j < QK; j++) {
        const float q = fminf(fmaxf(rintf(x[j] * inv), qmin), qmax);
        if (c) c[j] = q;
        a += x[j] * q;
        b += q * q;
    }
    *xc = a;
    *cc = b;
#endif
}

void quantize_blocks_best(const float *w, long nblocks, int qmin, int qmax, const float *f, int nf, int8_t *codes,
                          float *d, int nthreads) {
    const int nref = qmin == -qmax ? 1 : 2;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (long b = 0; b < nblocks; b++) {
        const float *x = w + b * QK;
        float M = 0.0f;
        for (int j = 0; j < QK; j++) if (fabsf(x[j]) > fabsf(M)) M = x[j];
        float best = -1.0f, best_inv = 0.0f;
        for (int r = 0; r < nref && M != 0.0f; r++) {
            const float qref = r ? (float)qmin : (float)qmax;
            for (int i = 0; i < nf; i++) {
                const float inv = qref / (f[i] * M);
                float xc, cc;
                block_codes(x, inv, (float)qmin, (float)qmax, NULL, &xc, &cc);
                const float score = cc > 0.0f ? xc * xc / cc : 0.0f;    /* sum(x x) - error */
                if (score > best) { best = score; best_inv = inv; }
            }
        }
        float c[QK], xc = 0.0f, cc = 0.0f;
        if (M != 0.0f) block_codes(x, best_inv, (float)qmin, (float)qmax, c, &xc, &cc);
        else memset(c, 0, sizeof c);
        d[b] = cc > 0.0f ? xc / cc : 0.0f;
        for (int j = 0; j < QK; j++) codes[b * QK + j] = (int8_t)c[j];
    }
}

/* --- the weight's values, for dequantize-then-matmul ---------------------------------------------

   Where no prefill GEMM takes a format (no AMX-BF16 for native's fp32 activations, no int8 level),
   QuantLinear multiplies the dequantized weight with torch. Dequantizing in torch takes five passes
   over the weight (unpack, widen, scale, shift, a layout copy for x16), about a fifth of a 512-token
   native prefill; this is one pass from either layout. Every value is what quant.dequantize_*
   computes: d q is exact in fp32 (an fp16 scale's 11 bits times a code of at most 8), so q4_1's
   d q + m rounds once, fused or not.
   fmt: 0 q8_0, 1 q4_0, 2 q4_1 (quant.py's DEQUANT_FORMATS); x16: the codes and scales interleaved
   (quant_gemv.h) rather than row-major. */
#if HAVE_AVX2 && defined(__F16C__)
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
static void dequantize_row_avx2(int fmt, const uint8_t *qs, long qstride, const uint16_t *d,
                                const uint16_t *m, long sstride, int K, float *out) {
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

static void dequantize_row(int fmt, const uint8_t *qs, long qstride, const uint16_t *d,
                           const uint16_t *m, long sstride, int K, float *out) {
    /* qs: the row's byte i at qs[(i / 4) * qstride + i % 4]; its block b's scale at d[b * sstride] */
#if HAVE_AVX2 && defined(__F16C__)
    if (g_isa != ISA_SCALAR) {
        dequantize_row_avx2(fmt, qs, qstride, d, m, sstride, K, out);
        return;
    }
#endif
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

void dequantize_rows(int fmt, int x16, const uint8_t *qs, const uint16_t *d, const uint16_t *m, int n0, int n1, int K,
                     float *out, int nthreads) {
    /* rows n0 .. n1-1 of the weight into out [n1 - n0, K] */
    const long bytes = fmt == 0 ? K : K / 2, nb = K / QK;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int n = n0; n < n1; n++) {
        const long g = n / XG, lane = n % XG;
        float *o = out + (long)(n - n0) * K;
        if (x16)
            dequantize_row(fmt, qs + g * bytes * XG + 4 * lane, 4 * XG, d + g * nb * XG + lane,
                           m ? m + g * nb * XG + lane : NULL, XG, K, o);
        else
            dequantize_row(fmt, qs + n * bytes, 4, d + n * nb, m ? m + n * nb : NULL, 1, K, o);
    }
}
