/* Prefill-sized products of block-quantized weights with int16 activation codes (native_i16's):
   an int16 GEMM.

   native_i16 (caramba.model.quant) multiplies a GGUF's blocks as stored with activations rounded to
   one int16 code per element (quant_gemv.c's quantize_activations_i16: codes xq [M, K], scale
   amax / 32767 per 32-block, xd [M, K/32]). Its decode GEMVs run on those codes; before this file
   a prompt's prefill rounded the rows and dequantized the weight to fp32 for oneDNN's sgemm. Here
   the codes meet the weight's own codes in int16 multiply-adds:

     avx512vnni  vpdpwssd (32 int16 products a 512-bit instruction, summed in pairs into int32), a
     (and amx)   panel of 32 weight rows packed as int16 codes in the lanes (two zmm), 6
                 activation rows broadcast a code pair at a time: 12 int32 sums and 12 fp32
                 accumulators in registers. SmolLM2's shapes at 512 rows, 1 thread, Zen 4: 80-93
                 G products/s (about one vpdpwssd a cycle), 1.9-2.6x the dequantize + oneDNN sgemm
                 path it replaces
     scalar      the portable reference (gemm_i16_ref), one output at a time: what the vector level
     (and avx2,  is tested against, bit for bit; the caller (caramba.model.quant_gemm) keeps
     avxvnni)    torch's dequantize-then-matmul rather than run it (gemm_i16_runs says why).

   Weights (fmt, the I16_* ids below): q8_0 (int8 codes qs [N, K], fp16 scales wd [N, K/32]), q4_0
   and q4_1 (nibbles [N, K/2], fp16 scales wd and q4_1's minimums wm), row-major; and the GGUF
   formats kept as stored (quant_gemv_kq.h: q5_0, q5_1, q4_k, q5_k, q6_k, the file's blocks
   [N, row bytes], no wd or wm). Every 32-block b of a weight row is integer codes q (q8_0's; q4_0
   q - 8; q4_1 q; Q5_0 q - 16; Q5_1, Q4_K q; Q5_K q with its 5th bit; Q6_K q - 32), a factor per
   group of G elements (G = 32: d; Q4_K / Q5_K d sc_j; G = 16 for Q6_K, whose scales are per 16:
   d sc, exact in fp32) and, for the zero-point formats (q4_1, Q5_1, Q4_K, Q5_K), a minimum mw (m,
   or -(dmin m_j)).

   Arithmetic (every level the same, so their outputs are bit-identical): per output (m, n), acc = 0,
   then per group g of G elements in order (block b = g G / 32):
       isum = sum over the group of xq * q           (int32, exact: |isum| <= 32 * 32767 * 127 < 2^31;
                                                       Q6_K per 16: 16 * 32767 * 32)
       acc  = fmaf((float)isum, f[n,g] * xd[m,b], acc)
       zero-point formats (G = 32), after each block: acc = fmaf(mw[n,b], xs[m,b], acc),
                                             xs[m,b] = xd[m,b] * (float)(sum of the block's codes)
   The values multiplied are the ones the decode kernels and the eager path (round_activations
   times the dequantized weight) multiply; only the fp32 rounding differs (the summation order, and
   q4_1's d q + m, Q4_K's fmaf(d sc, q, -dmin m) taken apart).

   out is [M, N] fp32 (no bias: the caller adds it). Parallel over 32-row panels of the weight with
   OpenMP, as quant_gemm.c. The level is quant_gemm.c's (CARAMBA_ISA caps it; gemm_isa_set). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "quant_gemm.h"
#include "quant_gemv_kq.h"   /* the stored formats' blocks (kq_block: static inline, nothing linked) */

enum { I16_Q8_0 = 0, I16_Q4_0 = 1, I16_Q4_1 = 2, I16_Q5_0 = 3, I16_Q5_1 = 4, I16_Q4_K = 5, I16_Q5_K = 6,
       I16_Q6_K = 7, I16_FORMATS = 8 };

static inline int i16_stored(int fmt) { return fmt >= I16_Q5_0; }
static inline int i16_zero_point(int fmt) {
    return fmt == I16_Q4_1 || fmt == I16_Q5_1 || fmt == I16_Q4_K || fmt == I16_Q5_K;
}
static inline int i16_group(int fmt) { return fmt == I16_Q6_K ? 16 : 32; }   /* elements per factor */

/* A weight as its layer holds it: fmt, codes qs, fp16 scales wd and minimums wm (q4_1), row-major
   or, for q8_0 / q4_0 / q4_1, x16 (quant_gemv.h: 16 rows a group, 4-byte units of their codes
   side by side, codes [ceil(N/16), bytes/4, 16, 4] and scales [ceil(N/16), nb, 16]), read in place
   (a copy to row-major per call cost 12% of a 2048-wide product). */
struct wsrc {
    int fmt, x16, K, nb;
    long bytes;   /* code bytes per row */
    const uint8_t *qs;
    const uint16_t *wd, *wm;
};

static struct wsrc wsrc_of(int fmt, const void *qs, const uint16_t *wd, const uint16_t *wm, int x16, int K) {
    const long bytes = i16_stored(fmt) ? kq_row_bytes(fmt - I16_Q5_0, K) : fmt == I16_Q8_0 ? K : K / 2;
    const struct wsrc w = {fmt, x16 && !i16_stored(fmt), K, K / QK, bytes, qs, wd, wm};
    return w;
}

/* code byte i of row n; its fp16 field of block b in t (wd or wm) */
static inline uint8_t wsrc_byte(const struct wsrc *w, long n, long i) {
    return w->x16 ? w->qs[(n / 16) * w->bytes * 16 + (i / 4) * 64 + (n % 16) * 4 + i % 4] : w->qs[n * w->bytes + i];
}
static inline float wsrc_half(const struct wsrc *w, const uint16_t *t, long n, int b) {
    return fp16_to_fp32(w->x16 ? t[(n / 16) * w->nb * 16 + (long)b * 16 + n % 16] : t[n * w->nb + b]);
}

/* Block b of weight row n: its codes q[32], the factors f[2] of its two 16-element halves (equal
   but for Q6_K) and its minimum mw (0 without one). */
static inline void i16_block(const struct wsrc *w, long n, int b, int16_t *q, float *f, float *mw) {
    const int fmt = w->fmt;
    if (i16_stored(fmt)) {
        float fw, sc6[2] = {1.0f, 1.0f};
        kq_block(fmt - I16_Q5_0, w->qs + n * w->bytes, b, q, &fw, mw, sc6);
        f[0] = fw * sc6[0];   /* exact: an fp16 times an int8 (Q6_K), else times 1 */
        f[1] = fw * sc6[1];
        return;
    }
    f[0] = f[1] = wsrc_half(w, w->wd, n, b);
    *mw = fmt == I16_Q4_1 ? wsrc_half(w, w->wm, n, b) : 0.0f;
    if (fmt == I16_Q8_0) {
        if (!w->x16) {
            for (int l = 0; l < QK; l++) q[l] = (int8_t)w->qs[n * w->bytes + b * QK + l];
            return;
        }
        for (int l = 0; l < QK; l++) q[l] = (int8_t)wsrc_byte(w, n, (long)b * QK + l);
        return;
    }
    const int off = fmt == I16_Q4_0 ? 8 : 0;
    for (int j = 0; j < QK / 2; j++) {
        const uint8_t byte = wsrc_byte(w, n, (long)b * QK / 2 + j);
        q[j] = (int16_t)((byte & 15) - off);
        q[j + QK / 2] = (int16_t)((byte >> 4) - off);
    }
}

/* xs [M, nb] = xd * the block's code sum (the zero-point formats' minimum terms) */
static void code_sums(const int16_t *xq, const float *xd, int M, int K, float *xs) {
    const int nb = K / QK;
    for (long i = 0; i < (long)M * nb; i++) {
        int32_t s = 0;
        for (int k = 0; k < QK; k++) s += xq[i * QK + k];
        xs[i] = xd[i] * (float)s;
    }
}

/* The reference: one output at a time, in the header's order. */
void gemm_i16_ref(int fmt, const int16_t *xq, const float *xd, int M, int K, const void *qs, const uint16_t *wd,
                  const uint16_t *wmin, int x16, int N, float *out) {
    const int nb = K / QK, G = i16_group(fmt), zp = i16_zero_point(fmt);
    const struct wsrc w = wsrc_of(fmt, qs, wd, wmin, x16, K);
    int16_t *q = malloc((size_t)K * sizeof(int16_t));
    float *f = malloc((size_t)nb * 2 * sizeof(float)), *mw = malloc((size_t)nb * sizeof(float));
    float *xs = malloc((size_t)M * nb * sizeof(float) + 1);
    if (!q || !f || !mw || !xs) abort();   /* the reference is for tests */
    code_sums(xq, xd, M, K, xs);
    for (long n = 0; n < N; n++) {
        for (int b = 0; b < nb; b++) i16_block(&w, n, b, q + b * QK, f + 2 * b, mw + b);
        for (int m = 0; m < M; m++) {
            const int16_t *x = xq + (long)m * K;
            float acc = 0.0f;
            for (int g = 0; g < K / G; g++) {
                const int b = g * G / QK;
                int32_t isum = 0;
                for (int k = g * G; k < (g + 1) * G; k++) isum += (int32_t)x[k] * q[k];
                const float s = f[2 * b + (G == 16 ? g % 2 : 0)] * xd[(long)m * nb + b];
                acc = fmaf((float)isum, s, acc);
                if (zp) acc = fmaf(mw[b], xs[(long)m * nb + b], acc);
            }
            out[(long)m * N + n] = acc;
        }
    }
    free(q); free(f); free(mw); free(xs);
}

/* Whether the level in force multiplies format fmt (else the caller keeps torch's path): avx512vnni
   and amx (whose CPUs have AVX-512 VNNI). A 256-bit level (vpmaddwd + vpaddd, 4 activation rows
   by 16 weight rows, the fp32 accumulators in L1) was no faster than torch's path on Zen 4 at
   CARAMBA_ISA=avx2 (SmolLM2 Q6_K / Q4_K_M, 512 tokens, 1 thread: 346 / 334 tok/s against 345 /
   335; each projection 6-9% slower in CPU time), so avx2 and avxvnni keep torch's. */
int gemm_i16_runs(int fmt) {
#if HAVE_AVX512VNNI
    return fmt >= 0 && fmt < I16_FORMATS && gemm_level() >= LVL_VNNI;
#else
    (void)fmt;
    return 0;
#endif
}

#if HAVE_AVX512VNNI
#define NP 32   /* weight rows per panel: two zmm of 16 int32 lanes */

/* A panel of NP weight rows n0 ..: codes as int32 units wu [K/2][NP] (unit u of row i: its codes
   2u, 2u + 1 as two int16), factors wf [K/G][NP], minimums wm [nb][NP]; rows past N zero. Block
   by block from i16_block (Q5_0 / Q5_1; the others have pack_panel_blocks and pack_panel_kquant). */
static void pack_panel_ref(const struct wsrc *w, long n0, int N, int32_t *wu, float *wf, float *wm) {
    const int nb = w->nb, G = i16_group(w->fmt);
    int16_t q[QK];
    float f[2], mw;
    for (int i = 0; i < NP; i++) {
        const long n = n0 + i;
        for (int b = 0; b < nb; b++) {
            if (n < N) i16_block(w, n, b, q, f, &mw);
            else memset(q, 0, sizeof q), f[0] = f[1] = mw = 0.0f;
            for (int u = 0; u < QK / 2; u++)
                wu[((long)b * (QK / 2) + u) * NP + i] = (int32_t)((uint32_t)(uint16_t)q[2 * u] | (uint32_t)(uint16_t)q[2 * u + 1] << 16);
            if (G == 16) wf[(2L * b) * NP + i] = f[0], wf[(2L * b + 1) * NP + i] = f[1];
            else wf[(long)b * NP + i] = f[0];
            wm[(long)b * NP + i] = mw;
        }
    }
}

#ifndef MR
#define MR 6    /* activation rows per register tile */
#endif

static void pack_panel_blocks(const struct wsrc *w, long n0, int N, int32_t *wu, float *wf, float *wm);
static void pack_panel_kquant(const struct wsrc *w, long n0, int N, int32_t *wu, float *wf, float *wm);

/* pack_panel_ref's panel, 16 rows and a dword at a time where the format has a packer here */
static void pack_panel(const struct wsrc *w, long n0, int N, int32_t *wu, float *wf, float *wm) {
    if (!i16_stored(w->fmt)) pack_panel_blocks(w, n0, N, wu, wf, wm);
    else if (w->fmt >= I16_Q4_K) pack_panel_kquant(w, n0, N, wu, wf, wm);
    else pack_panel_ref(w, n0, N, wu, wf, wm);
}

/* Dword J (code bytes 4J .. 4J+3) of the 16 weight rows r0 .. r0+15 (zero past N): x16's are one
   run of 64 bytes, row-major ones a gather. */
static inline __m512i rows_dword(const struct wsrc *w, long r0, int N, long at) {   /* at: a byte offset in each row */
    if (r0 >= N) return _mm512_setzero_si512();
    const __mmask16 live = N - r0 >= 16 ? 0xffff : (__mmask16)((1u << (N - r0)) - 1);
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)w->bytes));
    return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, rows, w->qs + r0 * w->bytes + at, 1);
}

static inline __m512i group_dword(const struct wsrc *w, long r0, int N, long J) {
    if (r0 >= N) return _mm512_setzero_si512();
    if (w->x16) return _mm512_loadu_si512(w->qs + (r0 / 16) * w->bytes * 16 + J * 64);
    return rows_dword(w, r0, N, 4 * J);
}

/* Four codes a dword (int16 in each word: a = codes 0 and 2, c = codes 1 and 3) -> the pair units
   (0, 1) and (2, 3), stored at their lanes of units U and U + 1. */
static inline void store_pairs(__m512i a, __m512i c, int32_t *wu, long U, int lane0) {
    const __mmask32 high = 0xAAAAAAAAu;
    _mm512_store_si512(wu + U * NP + lane0, _mm512_mask_blend_epi16(high, a, _mm512_slli_epi32(c, 16)));
    _mm512_store_si512(wu + (U + 1) * NP + lane0, _mm512_mask_blend_epi16(high, _mm512_srli_epi32(a, 16), c));
}

/* pack_panel_ref's panel for q8_0, q4_0 and q4_1 (either layout), 16 rows and a dword at a time. */
static void pack_panel_blocks(const struct wsrc *w, long n0, int N, int32_t *wu, float *wf, float *wm) {
    const int nb = w->nb, fmt = w->fmt;
    const __m512i nib = _mm512_set1_epi8(15), bytes02 = _mm512_set1_epi32(0x00FF00FF);
    const __m512i off = _mm512_set1_epi16(fmt == I16_Q4_0 ? 8 : 0);
    for (int g = 0; g < NP / 16; g++) {
        const long r0 = n0 + 16 * g;
        for (long J = 0; J < w->bytes / 4; J++) {
            const __m512i v = group_dword(w, r0, N, J);
            if (fmt == I16_Q8_0) {   /* 8 dwords a block: units 2j, 2j + 1 */
                store_pairs(_mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8), _mm512_srai_epi16(v, 8), wu,
                            (J / 8) * 16 + 2 * (J % 8), 16 * g);
                continue;
            }
            /* 4 dwords a block: low nibbles elements 4j .., high ones 16 + 4j .. */
            const __m512i half[2] = {_mm512_and_si512(v, nib), _mm512_and_si512(_mm512_srli_epi32(v, 4), nib)};
            for (int h = 0; h < 2; h++) {
                const __m512i a = _mm512_sub_epi16(_mm512_and_si512(half[h], bytes02), off);
                const __m512i c = _mm512_sub_epi16(_mm512_and_si512(_mm512_srli_epi32(half[h], 8), bytes02), off);
                store_pairs(a, c, wu, (J / 4) * 16 + 8 * h + 2 * (J % 4), 16 * g);
            }
        }
        for (int b = 0; b < nb; b++)
            for (int i = 0; i < 16; i++) {
                const long n = r0 + i;
                wf[(long)b * NP + 16 * g + i] = n < N ? wsrc_half(w, w->wd, n, b) : 0.0f;
                wm[(long)b * NP + 16 * g + i] = n < N && fmt == I16_Q4_1 ? wsrc_half(w, w->wm, n, b) : 0.0f;
            }
    }
}

/* Four unsigned byte codes a dword, minus sub, -> pair units U, U + 1 (store_pairs). */
static inline void store_bytes(__m512i v, int sub, int32_t *wu, long U, int lane0) {
    const __m512i bytes02 = _mm512_set1_epi32(0x00FF00FF), off = _mm512_set1_epi16((short)sub);
    store_pairs(_mm512_sub_epi16(_mm512_and_si512(v, bytes02), off),
                _mm512_sub_epi16(_mm512_and_si512(_mm512_srli_epi32(v, 8), bytes02), off), wu, U, lane0);
}

/* pack_panel_ref's panel for Q4_K, Q5_K and Q6_K (quant_gemv_kq.h's layouts), 16 rows and a dword of each
   code run at a time; the factors and minimums row by row (kq_block's arithmetic). */
static void pack_panel_kquant(const struct wsrc *w, long n0, int N, int32_t *wu, float *wf, float *wm) {
    const int kind = w->fmt - I16_Q5_0, sbytes = kq_block_bytes(kind), nsb = w->K / 256;
    const __m512i nib = _mm512_set1_epi8(15), bit0 = _mm512_set1_epi8(1), bits01 = _mm512_set1_epi8(3);
    for (int g = 0; g < NP / 16; g++) {
        const long r0 = n0 + 16 * g;
        for (int sb = 0; sb < nsb; sb++) {
            const long base = (long)sb * sbytes;
            for (int t = 0; t < 8; t++) {
                if (kind == KQ_Q6_K) {
                    for (int n = 0; n < 2; n++) {
                        const __m512i a = rows_dword(w, r0, N, base + 64 * n + 4 * t);
                        const __m512i c = rows_dword(w, r0, N, base + 64 * n + 32 + 4 * t);
                        const __m512i h = rows_dword(w, r0, N, base + 128 + 32 * n + 4 * t);
                        for (int qd = 0; qd < 4; qd++) {
                            const __m512i src = qd & 1 ? c : a;
                            const __m512i lo = _mm512_and_si512(qd < 2 ? src : _mm512_srli_epi32(src, 4), nib);
                            const __m512i hb = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 2 * qd), bits01), 4);
                            store_bytes(_mm512_or_si512(lo, hb), 32, wu, ((long)sb * 8 + 4 * n + qd) * 16 + 2 * t, 16 * g);
                        }
                    }
                    continue;
                }
                const __m512i h = kind == KQ_Q5_K ? rows_dword(w, r0, N, base + 16 + 4 * t) : _mm512_setzero_si512();
                for (int c = 0; c < 4; c++) {
                    const __m512i v = rows_dword(w, r0, N, base + (kind == KQ_Q4_K ? 16 : 48) + 32 * c + 4 * t);
                    __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), nib);
                    if (kind == KQ_Q5_K) {
                        lo = _mm512_or_si512(lo, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 2 * c), bit0), 4));
                        hi = _mm512_or_si512(hi, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 2 * c + 1), bit0), 4));
                    }
                    store_bytes(lo, 0, wu, ((long)sb * 8 + 2 * c) * 16 + 2 * t, 16 * g);
                    store_bytes(hi, 0, wu, ((long)sb * 8 + 2 * c + 1) * 16 + 2 * t, 16 * g);
                }
            }
        }
        for (int i = 0; i < 16; i++) {
            const long n = r0 + i;
            const uint8_t *row = w->qs + n * w->bytes;
            for (int b = 0; b < w->nb; b++) {
                const uint8_t *blk = row + (long)(b / 8) * sbytes;
                const int j = b % 8, lane = 16 * g + i;
                if (n >= N) {
                    wf[(2L * b) * NP + lane] = wf[(2L * b + 1) * NP + lane] = wf[(long)b * NP + lane] = 0.0f;
                    wm[(long)b * NP + lane] = 0.0f;
                } else if (kind == KQ_Q6_K) {   /* as kq_block: d times each half's int8 scale */
                    const float d = fp16_to_fp32(kq_u16(blk + 208));
                    wf[(2L * b) * NP + lane] = d * (float)((const int8_t *)(blk + 192))[2 * j];
                    wf[(2L * b + 1) * NP + lane] = d * (float)((const int8_t *)(blk + 192))[2 * j + 1];
                    wm[(long)b * NP + lane] = 0.0f;
                } else {
                    int sc, m;
                    kq_scale_min(j, blk + 4, &sc, &m);
                    wf[(long)b * NP + lane] = fp16_to_fp32(kq_u16(blk)) * (float)sc;
                    wm[(long)b * NP + lane] = -(fp16_to_fp32(kq_u16(blk + 2)) * (float)m);
                }
            }
        }
    }
}

/* Activation rows m0 .. m0+R-1 times the panel into out[m][n0 ..]: per group, R x 2 int32 sums of
   vpdpwssd, then the header's fp32 steps. R, G and zp constants at each call. */
static inline __attribute__((always_inline)) void tile_i16(const int R, const int G, const int zp, const int32_t *wu,
                                                           const float *wf, const float *wm, const int16_t *xq,
                                                           const float *xd, const float *xs, int m0, int K, int N,
                                                           long n0, float *out) {
    const int nb = K / QK, UG = G / 2;
    __m512 f[MR][2];
    for (int r = 0; r < R; r++) f[r][0] = f[r][1] = _mm512_setzero_ps();
    for (int g = 0; g < K / G; g++) {
        __m512i s[MR][2];
        for (int r = 0; r < R; r++) s[r][0] = s[r][1] = _mm512_setzero_si512();
        const int32_t *w = wu + (long)g * UG * NP;
        const int16_t *x = xq + (long)m0 * K + g * G;
        for (int u = 0; u < UG; u++) {
            const __m512i w0 = _mm512_load_si512(w + u * NP), w1 = _mm512_load_si512(w + u * NP + 16);
            for (int r = 0; r < R; r++) {
                int32_t pair;
                memcpy(&pair, x + (long)r * K + 2 * u, 4);
                const __m512i xb = _mm512_set1_epi32(pair);
                s[r][0] = _mm512_dpwssd_epi32(s[r][0], w0, xb);
                s[r][1] = _mm512_dpwssd_epi32(s[r][1], w1, xb);
            }
        }
        const int b = g * G / QK;
        const __m512 F0 = _mm512_load_ps(wf + (long)g * NP), F1 = _mm512_load_ps(wf + (long)g * NP + 16);
        for (int r = 0; r < R; r++) {
            const __m512 d = _mm512_set1_ps(xd[(long)(m0 + r) * nb + b]);
            f[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][0]), _mm512_mul_ps(F0, d), f[r][0]);
            f[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][1]), _mm512_mul_ps(F1, d), f[r][1]);
        }
        if (zp) {
            const __m512 M0 = _mm512_load_ps(wm + (long)b * NP), M1 = _mm512_load_ps(wm + (long)b * NP + 16);
            for (int r = 0; r < R; r++) {
                const __m512 xv = _mm512_set1_ps(xs[(long)(m0 + r) * nb + b]);
                f[r][0] = _mm512_fmadd_ps(M0, xv, f[r][0]);
                f[r][1] = _mm512_fmadd_ps(M1, xv, f[r][1]);
            }
        }
    }
    const int cols = N - n0 < NP ? (int)(N - n0) : NP;
    const __mmask16 k0 = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1);
    const __mmask16 k1 = cols >= 32 ? 0xffff : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
    for (int r = 0; r < R; r++) {
        float *o = out + (long)(m0 + r) * N + n0;
        _mm512_mask_storeu_ps(o, k0, f[r][0]);
        _mm512_mask_storeu_ps(o + 16, k1, f[r][1]);
    }
}

/* The panel times all M rows, MR at a time (the tail's rows in one smaller tile). */
static inline __attribute__((always_inline)) void panel_rows(const int G, const int zp, const int32_t *wu,
                                                             const float *wf, const float *wm, const int16_t *xq,
                                                             const float *xd, const float *xs, int M, int K, int N,
                                                             long n0, float *out) {
    int m0 = 0;
    for (; m0 + MR <= M; m0 += MR) tile_i16(MR, G, zp, wu, wf, wm, xq, xd, xs, m0, K, N, n0, out);
    switch (M - m0) {
    case 1: tile_i16(1, G, zp, wu, wf, wm, xq, xd, xs, m0, K, N, n0, out); break;
    case 2: tile_i16(2, G, zp, wu, wf, wm, xq, xd, xs, m0, K, N, n0, out); break;
    case 3: tile_i16(3, G, zp, wu, wf, wm, xq, xd, xs, m0, K, N, n0, out); break;
    case 4: tile_i16(4, G, zp, wu, wf, wm, xq, xd, xs, m0, K, N, n0, out); break;
    case 5: tile_i16(5, G, zp, wu, wf, wm, xq, xd, xs, m0, K, N, n0, out); break;
    default: break;
    }
}

static void panel_vnni(int fmt, const int32_t *wu, const float *wf, const float *wm, const int16_t *xq,
                       const float *xd, const float *xs, int M, int K, int N, long n0, float *out) {
    if (fmt == I16_Q6_K) panel_rows(16, 0, wu, wf, wm, xq, xd, xs, M, K, N, n0, out);
    else if (i16_zero_point(fmt)) panel_rows(32, 1, wu, wf, wm, xq, xd, xs, M, K, N, n0, out);
    else panel_rows(32, 0, wu, wf, wm, xq, xd, xs, M, K, N, n0, out);
}
#endif

/* out [M, N] = int16 activations (xq, xd) times the weight (fmt, qs, wd, wm)^T at the library's
   level (the reference where gemm_i16_runs(fmt) is 0). Returns 0, or 1 where a buffer could not
   be allocated (out then incomplete). */
int gemm_i16(int fmt, const int16_t *xq, const float *xd, int M, int K, const void *qs, const uint16_t *wd,
             const uint16_t *wmin, int x16, int N, float *out, int nthreads) {
#if HAVE_AVX512VNNI
    if (gemm_i16_runs(fmt)) {
        const int nb = K / QK, zp = i16_zero_point(fmt);
        const struct wsrc w = wsrc_of(fmt, qs, wd, wmin, x16, K);
        float *xs = zp ? malloc((size_t)M * nb * sizeof(float) + 1) : NULL;
        int failed = zp && !xs;
        if (!failed) {
            if (zp) code_sums(xq, xd, M, K, xs);
            const long panels = (N + NP - 1) / NP;
            #pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1) reduction(|:failed)
            {
                int32_t *wu = aligned_alloc(64, (size_t)K / 2 * NP * sizeof(int32_t));
                float *wf = aligned_alloc(64, (size_t)(K / 16) * NP * sizeof(float));
                float *wm = aligned_alloc(64, (size_t)nb * NP * sizeof(float));
                if (!wu || !wf || !wm) failed = 1;
                #pragma omp for schedule(dynamic)
                for (long p = 0; p < panels; p++) {
                    if (failed) continue;
                    pack_panel(&w, p * NP, N, wu, wf, wm);
                    panel_vnni(fmt, wu, wf, wm, xq, xd, xs, M, K, N, p * NP, out);
                }
                free(wu); free(wf); free(wm);
            }
        }
        free(xs);
        return failed;
    }
#endif
    (void)nthreads;   /* the reference runs on the calling thread */
    gemm_i16_ref(fmt, xq, xd, M, K, qs, wd, wmin, x16, N, out);
    return 0;
}
