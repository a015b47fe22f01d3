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
   decode products read where the level has an x16 kernel for the format (x16_vector; the
   kernels: quant_gemv_x86_x16.c, quant_gemv_arm.c).

   Three activation modes:
     gemv_q8_0_q8 / gemv_q4_1_q8: the activations are quantized to q8_0 on the fly (per 32-block,
       scale amax/127) and the dot product runs in int8 x int8 -> int32, as llama.cpp's q8_0 x q8_0
       does: fastest, and adds the activation rounding error (relative ~1/254 per block).
     gemv_q8_0_i16 / gemv_q4_1_i16: int16 codes (scale amax/32767) in int16 x int16 -> int32
       multiply-adds: about the q8 kernels' speed at 1/258 of their rounding error.
     gemv_q8_0_f32 / gemv_q4_1_f32: fp32 activations times the exact weight values: the product
       differs from dequantize-then-matmul only at the level of fp32 rounding. At the vector levels
       (AVX2 and up, and ARM's neon, bit-identical to AVX2's) each block of x is split into two
       int16 code vectors on a power-of-two scale (quant_gemv_ref.h's ACT_SPLIT),
       x = s (h + l / 2^15) to within s / 2^16 (below fp32's own rounding of the block's largest element: s <= 2 amax /
       32767), and runs through the int16 multiply-adds twice; an int-to-float conversion per
       weight (the portable build's way) took ~1.5x as long with AVX2 (the instruction count, not
       the bytes, bounds these products).

   x is [M, K] fp32 (M small: a decode step or a few rows), out is [M, N] fp32. Every weight row
   is read once for all M rows. Parallel over output rows with OpenMP (the process shares
   torch's libgomp).

   Levels (cpu_isa.c): the portable reference (scalar), the x86 vector kernels (avx2 .. avx512vnni)
   and ARM's neon, which runs every row-major format with avx2's lanes and order (vdotq_s32, or
   widening multiplies without the dot-product extension); the row-interleaved (x16) layout has
   kernels at avx512vnni (512 bits, every format), at avx2, avxvnni and avx512 (256 bits: all but
   q8_0 with int16 codes) and at neon with sdot (q8 activations), the reference elsewhere.

   Files, as ggml lays out its CPU kernels (one library, compiled as one command: quant.SOURCES):
     quant_gemv.c          this file: the exported functions and the dispatch, one table per kind
                           of kernel indexed by the library's level (g_isa);
     quant_gemv_ref.c      the portable reference (*_ref), the block formats' own quantization
                           and dequantization; quant_gemv_ref.h: what every file shares;
     quant_gemv_x86.c      x86-64's levels for row-major blocks (avx2 .. avx512vnni);
     quant_gemv_x86_x16.c  x86-64's kernels for the row-interleaved layout;
     quant_gemv_arm.c      AArch64's neon level.
   An architecture's files compile to nothing on the other's machines; a header names NULL for
   what the build lacks. */

#include "quant_gemv_arm.h"
#include "quant_gemv_kq.h"
#include "quant_gemv_ref.h"
#include "quant_gemv_x86.h"
#include "quant_gemv_x86_x16.h"

#include <omp.h>
#include <stdlib.h>

/* --- the levels' kernels -----------------------------------------------------------------------

   cpu_isa.c's levels -> each kind of kernel (quant_gemv_ref.h's signatures). NULL: the reference
   runs (the level has no kernel of that kind), or the build lacks the level, which isa_pick then
   never chooses. */
#define X86_LEVELS(F) [ISA_AVX2] = F, [ISA_AVXVNNI] = F, [ISA_AVX512] = F, [ISA_AVX512VNNI] = F
static quantize_row_fn *const QUANTIZE_ROW[ISA_LEVELS] = {
    [ISA_SCALAR] = quantize_row_ref, X86_LEVELS(QUANTIZE_ROW_X86), [ISA_NEON] = QUANTIZE_ROW_NEON};
static quant_rows_fn *const QUANT_ROWS[ISA_LEVELS] = {
    [ISA_SCALAR] = quant_rows_ref, [ISA_AVX2] = QUANT_ROWS_AVX2, [ISA_AVXVNNI] = QUANT_ROWS_AVXVNNI,
    [ISA_AVX512] = QUANT_ROWS_AVX512, [ISA_AVX512VNNI] = QUANT_ROWS_AVX512VNNI, [ISA_NEON] = QUANT_ROWS_NEON};
static block_sums_fn *const BLOCK_SUMS[ISA_LEVELS] = {
    [ISA_SCALAR] = block_sums_ref, X86_LEVELS(BLOCK_SUMS_X86), [ISA_NEON] = BLOCK_SUMS_NEON};
static x16_sums_fn *const X16_SUMS[ISA_LEVELS] = {X86_LEVELS(X16_SUMS_X86), [ISA_NEON] = X16_SUMS_NEON};
static dequantize_row_fn *const DEQUANTIZE_ROW[ISA_LEVELS] = {X86_LEVELS(DEQUANTIZE_ROW_X86)};
/* The X16 formats' kernels (quant_gemv.h's ids Q8_0_Q8_X16 .. Q4_1_F32_X16, in that order): every
   format at avx512vnni; at the 256-bit levels the q8-activation ones and q4_1's int16 ones (q8_0's
   signed weights would overflow avx2's int16 pairs with int16 codes); at neon with sdot the
   q8-activation ones. */
#define X16_256 {X16_GROUP256, X16_GROUP256, X16_GROUP256, NULL, X16W_GROUP256, NULL, X16W_GROUP256}
static x16_group_fn *const X16_GROUPS[ISA_LEVELS][Q4_1_F32_X16 - Q8_0_Q8_X16 + 1] = {
    [ISA_AVX2] = X16_256, [ISA_AVXVNNI] = X16_256, [ISA_AVX512] = X16_256,
    [ISA_AVX512VNNI] = {X16_GROUP512, X16_GROUP512, X16_GROUP512, X16W_GROUP512, X16W_GROUP512, X16W_GROUP512,
                        X16W_GROUP512},
    [ISA_NEON] = {X16_GROUP_NEON, X16_GROUP_NEON, X16_GROUP_NEON}};
#undef X16_256
/* The stored GGUF formats (quant_gemv_kq.h): the 16-bit multiply-adds at avx2, avxvnni and avx512
   (avxvnni's VEX vpdpwssd is not used: the EVEX one needs AVX-512 VL), vpdpwssd at avx512vnni;
   widening multiply-adds at neon. */
static quant_rows_fn *const KQ_ROWS[ISA_LEVELS] = {
    [ISA_SCALAR] = kq_rows_ref, [ISA_AVX2] = KQ_ROWS_AVX2, [ISA_AVXVNNI] = KQ_ROWS_AVX2, [ISA_AVX512] = KQ_ROWS_AVX2,
    [ISA_AVX512VNNI] = KQ_ROWS_AVX512VNNI, [ISA_NEON] = KQ_ROWS_NEON};
static kq_dequantize_fn *const KQ_DEQUANTIZE[ISA_LEVELS] = {X86_LEVELS(KQ_DEQUANTIZE_AVX2)};
#undef X86_LEVELS

/* --- the activation codes (quant_gemv_ref.h's ACT_*) --------------------------------------------

   Every level gives the same codes and scales (tests/model/test_isa.py). Rows m0 .. m1-1. */
static void quantize_range(const float *x, int m0, int m1, int K, int mode, void *q, float *d) {
    const int nb = K / QK, width = mode == ACT_SPLIT ? 2 : 1;   /* codes per element */
    quantize_row_fn *const row = QUANTIZE_ROW[g_isa] ? QUANTIZE_ROW[g_isa] : quantize_row_ref;
    for (int m = m0; m < m1; m++)
        row(x + (long)m * K, nb, mode, (int8_t *)q + (long)m * K, (int16_t *)q + (long)m * K * width, d + m * nb);
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

/* --- the products ------------------------------------------------------------------------------ */

/* Whether the library's level (g_isa) runs a vector kernel for X16 format fmt, rather than the
   reference (X16_GROUPS). caramba.model.quant makes layers x16 only where this says so. */
int x16_vector(int fmt) { return is_x16(fmt) && X16_GROUPS[g_isa][fmt - Q8_0_Q8_X16] != NULL; }

/* The activations a block format's product takes, for M rows of x [M, K]: codes xq (q8, int16 or,
   for fp32 products at a vector level, ACT_SPLIT's [M, 2K]), their scales xd and, for zero-point weights,
   xs [M, K/32]: d_x sum(a_i), or for q4_1 x fp32 the fp32 block sums of x. */
HIDDEN void prepare_activations(int fmt, const float *x, int M, int K, int8_t *xq, float *xd, float *xs) {
    const int nb = K / QK;
    const int f32 = fmt == Q4_1_F32 || fmt == Q8_0_F32, wide = fmt == Q8_0_I16 || fmt == Q4_1_I16;
    if (is_kq(fmt)) {   /* int16 or split codes at every level; xs: the minimums' block sums */
        const int split = kq_split(fmt);
        quantize_rows(x, M, K, split ? ACT_SPLIT : ACT_I16, xq, xd);
        if (kq_zero_point(kq_kind(fmt)))
            for (int mb = 0; mb < M * nb; mb++) {
                if (split) {
                    float s = 0.0f;
                    for (int i = 0; i < QK; i++) s += x[(long)mb * QK + i];
                    xs[mb] = s;
                } else {
                    int32_t s = 0;
                    for (int i = 0; i < QK; i++) s += ((const int16_t *)xq)[(long)mb * QK + i];
                    xs[mb] = xd[mb] * (float)s;
                }
            }
        return;
    }
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
   prepare_activations), at the library's level (g_isa: set when it loads, or by isa_set, never
   while a product runs). The threads share out the chunks. */
HIDDEN void quant_rows(int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,
                       const float *x, const int8_t *xq, const float *xd, const float *xs, int M, float *y,
                       const float *bias) {
    if (is_kq(fmt)) {
        (KQ_ROWS[g_isa] ? KQ_ROWS[g_isa] : kq_rows_ref)(fmt, w, d, m, c, N, K, x, xq, xd, xs, M, y, bias);
        return;
    }
    if (is_x16(fmt)) {
        x16_group_fn *const group = X16_GROUPS[g_isa][fmt - Q8_0_Q8_X16];
        (group ? group : is_x16_wide(fmt) ? x16w_rows_ref : x16_rows_ref)(fmt, w, d, m, c, N, K, xq, xd, xs, M, y, bias);
        return;
    }
    (QUANT_ROWS[g_isa] ? QUANT_ROWS[g_isa] : quant_rows_ref)(fmt, w, d, m, c, N, K, x, xq, xd, xs, M, y, bias);
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

/* The stored GGUF formats (quant_gemv.h's ids Q5_0_I16 .. Q6_K_F32): qs the file's blocks [N, row bytes]. */
int gemv_kq(int fmt, const float *x, const void *qs, float *out, int M, int N, int K, int nthreads) {
    if (!is_kq(fmt) || K % kq_block_elems(kq_kind(fmt))) return 2;
    return gemv_blocks(fmt, x, qs, NULL, NULL, out, M, N, K, nthreads);
}

/* mins NULL: q4_0 weights (w = d (q - 8)). */
int gemv_q4_1_q8(const float *x, const uint8_t *qs, const uint16_t *d, const uint16_t *mins, float *out,
                 int M, int N, int K, int nthreads) {
    return gemv_blocks(mins ? Q4_1_Q8 : Q4_0_Q8, x, qs, d, mins, out, M, N, K, nthreads);
}

/* For tests: the int32 sums of n blocks' products (kind 0: q8_0 x q8, 1: q4 x q8, 2: q8_0 x int16,
   3: q4 x int16; w: the blocks' codes or nibbles, a: the activation codes) into out[n], through
   the library's level's integer primitives as its products use them (a vector's lanes added up
   in int32, exactly), or through the reference. */
void block_sums(int kind, const void *w, const void *a, int n, int32_t *out) {
    (BLOCK_SUMS[g_isa] ? BLOCK_SUMS[g_isa] : block_sums_ref)(kind, w, a, n, out);
}

/* For tests: the int32 sums of nb blocks of one X16 group (w: its codes, [nb, B/4, 16, 4]) times
   one activation row's q8 codes a [nb * 32] -> out [nb, 16], through the library's level (the
   512-bit kernel's at avx512vnni, the 256-bit one's at avx2, avxvnni and avx512, neon's in a
   build with the dot product, else the reference). */
void x16_block_sums(int fmt, const void *w, const int8_t *a, int nb, int32_t *out) {
    const int bb = fmt == Q8_0_Q8_X16 ? QK * XG : QK * XG / 2;
    x16_sums_fn *const sums = X16_SUMS[g_isa] ? X16_SUMS[g_isa] : x16_sums_ref;
    for (int b = 0; b < nb; b++) {
        const int8_t *ab = a + b * QK;
        int32_t asum = 0;
        for (int i = 0; i < QK; i++) asum += ab[i];
        sums(fmt, (const uint8_t *)w + (long)b * bb, ab, asum, out + b * XG);
    }
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
void quantize_blocks_best(const float *w, long nblocks, int qmin, int qmax, const float *f, int nf, int8_t *codes,
                          float *d, int nthreads) {
    /* the build's best block_codes, whatever the level (as the weights were always quantized) */
#if HAVE_AVX2
    best_block_fn *const best = best_block_avx2;
#else
    best_block_fn *const best = best_block_ref;
#endif
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (long b = 0; b < nblocks; b++) best(w + b * QK, qmin, qmax, f, nf, codes + b * QK, d + b);
}

/* --- the weight's values, for dequantize-then-matmul ---------------------------------------------

   Where no prefill GEMM takes a format (no AMX-BF16 for native's fp32 activations, no int8 level),
   QuantLinear multiplies the dequantized weight with torch. Dequantizing in torch takes five passes
   over the weight (unpack, widen, scale, shift, a layout copy for x16), about a fifth of a 512-token
   native prefill; this is one pass from either layout. Every value is what quant.dequantize_*
   computes: d q is exact in fp32 (an fp16 scale's 11 bits times a code of at most 8), so q4_1's
   d q + m rounds once, fused or not.
   fmt: 0 q8_0, 1 q4_0, 2 q4_1, 3 .. 7 the stored GGUF formats q5_0, q5_1, q4_k, q5_k, q6_k (quant.py's
   DEQUANT_FORMATS: qs their blocks [N, row bytes], d and m unused); x16: the codes and scales
   interleaved (quant_gemv.h) rather than row-major. */
void dequantize_rows(int fmt, int x16, const uint8_t *qs, const uint16_t *d, const uint16_t *m, int n0, int n1, int K,
                     float *out, int nthreads) {
    /* rows n0 .. n1-1 of the weight into out [n1 - n0, K] */
    if (fmt >= 3) {
        const int kind = fmt - 3;
        const long rb = kq_row_bytes(kind, K);
        kq_dequantize_fn *const krow = KQ_DEQUANTIZE[g_isa] ? KQ_DEQUANTIZE[g_isa] : kq_dequantize_row_ref;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
        for (int n = n0; n < n1; n++) krow(kind, qs + n * rb, K, out + (long)(n - n0) * K);
        return;
    }
    const long bytes = fmt == 0 ? K : K / 2, nb = K / QK;
    dequantize_row_fn *const row = DEQUANTIZE_ROW[g_isa] ? DEQUANTIZE_ROW[g_isa] : dequantize_row_ref;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int n = n0; n < n1; n++) {
        const long g = n / XG, lane = n % XG;
        float *o = out + (long)(n - n0) * K;
        if (x16)
            row(fmt, qs + g * bytes * XG + 4 * lane, 4 * XG, d + g * nb * XG + lane, m ? m + g * nb * XG + lane : NULL,
                XG, K, o);
        else
            row(fmt, qs + n * bytes, 4, d + n * nb, m ? m + n * nb : NULL, 1, K, o);
    }
}
