/* What the files of the quantized products share: quant_gemv.c (the dispatch and the exported
   functions), quant_gemv_ref.c (the portable reference, which the scalar level runs and every
   other level is checked against) and the levels' kernels, quant_gemv_x86.c and
   quant_gemv_x86_x16.c (x86-64) and quant_gemv_arm.c (AArch64): the activation codes, the tiles
   of activation rows, the signatures the dispatch tables hold, and the reference's functions. */

#ifndef CARAMBA_QUANT_GEMV_REF_H
#define CARAMBA_QUANT_GEMV_REF_H

#include "quant_gemv.h"

#include <math.h>

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

/* The int32 sum of n lanes (a vector's, stored). */
static inline int32_t hsum_i32(const int32_t *lanes, int n) {
    int32_t s = 0;
    for (int i = 0; i < n; i++) s += lanes[i];
    return s;
}

/* What a level provides, one table per kind in quant_gemv.c (NULL: the reference runs):
     quantize_row_fn  one row of x (nb blocks) into the codes of `mode`: q8 (int8) or q16 (int16;
                      ACT_SPLIT's h then l per block), scales d [nb];
     quant_rows_fn    quant_rows for the row-major formats (quant_gemv.h);
     x16_group_fn     quant_rows for one X16 format (its codes from prepare_activations);
     block_sums_fn    block_sums' int32 sums (kind: 0 q8_0 x q8, 1 q4 x q8, 2 q8_0 x int16, 3 q4 x int16);
     x16_sums_fn      one X16 block's 16 rows' int32 sums with activation block a (sum asum);
     dequantize_row_fn  one weight row's values (qs: byte i at qs[(i / 4) qstride + i % 4]; its
                      block b's scale at d[b sstride], q4_1's minimum at m[b sstride]). */
typedef void quantize_row_fn(const float *x, int nb, int mode, int8_t *q8, int16_t *q16, float *d);
typedef void quant_rows_fn(int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,
                           const float *x, const int8_t *xq, const float *xd, const float *xs, int M, float *y,
                           const float *bias);
typedef void x16_group_fn(int fmt, const void *w, const uint16_t *d, const uint16_t *m, int c, int N, int K,
                          const int8_t *xq, const float *xd, const float *xs, int M, float *y, const float *bias);
typedef void block_sums_fn(int kind, const void *w, const void *a, int n, int32_t *out);
typedef void x16_sums_fn(int fmt, const uint8_t *wb, const int8_t *a, int32_t asum, int32_t *out);
typedef void dequantize_row_fn(int fmt, const uint8_t *qs, long qstride, const uint16_t *d, const uint16_t *m,
                               long sstride, int K, float *out);
/* quantize_blocks_best's search for one block of 32 weights x: its codes and its scale d */
typedef void best_block_fn(const float *x, int qmin, int qmax, const float *f, int nf, int8_t *codes, float *d);

/* --- the portable reference (quant_gemv_ref.c) --------------------------------------------------- */

/* The int32 sum of one block's products (q8_0 codes w, q4 nibbles: element j low, j + 16 high),
   exactly what every vector level's lanes add up to (exported: tests call them too). */
int32_t dot_q8_0_q8_ref(const int8_t *w, const int8_t *a);
int32_t dot_q4_q8_ref(const uint8_t *w, const int8_t *a);
int32_t dot_q8_0_i16_ref(const int8_t *w, const int16_t *a);
int32_t dot_q4_i16_ref(const uint8_t *w, const int16_t *a);

HIDDEN quantize_row_fn quantize_row_ref;
HIDDEN quant_rows_fn quant_rows_ref;
HIDDEN x16_group_fn x16_rows_ref, x16w_rows_ref;
HIDDEN block_sums_fn block_sums_ref;
HIDDEN x16_sums_fn x16_sums_ref;
HIDDEN dequantize_row_fn dequantize_row_ref;
HIDDEN best_block_fn best_block_ref;

/* int16 codes [nblocks, 32] (per block; split: h then l) -> byte planes lo(h), hi(h) [, lo(l),
   hi(l)] in place, and the sums of the hi planes (q8_0 weights' starts; split: l's in the high
   half) where hsums is given. */
HIDDEN void codes_to_planes(int8_t *q, long nblocks, int split, int32_t *hsums);

/* One candidate's codes for quantize_blocks_best: c = clamp(round(x inv), qmin, qmax) (c NULL:
   not stored), xc = sum(x c), cc = sum(c c). */
typedef void block_codes_fn(const float *x, float inv, float qmin, float qmax, float *c, float *xc, float *cc);

/* The search of quantize_blocks_best (quant_gemv.c explains it) for one block x, with a level's
   block_codes (inlined into each level's best_block). */
INLINE void best_block(block_codes_fn *block_codes, const float *x, int qmin, int qmax, const float *f, int nf,
                       int8_t *codes, float *d) {
    const int nref = qmin == -qmax ? 1 : 2;
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
    *d = cc > 0.0f ? xc / cc : 0.0f;
    for (int j = 0; j < QK; j++) codes[j] = (int8_t)c[j];
}

#endif
