/* Decode-step attention reads straight from quantized KV codes (caramba.cache.kernel).

   The eager path (caramba.cache.attend) must convert every code of the prefix to a float in a
   scratch tensor before a matmul can read it: 4 bytes written and read back per 1-byte code, at
   every layer and step. These two loops read the codes where they lie and fold the block scales
   and code offsets in on the fly, so a decode step touches each code once.

   Layouts are caramba.cache.streams.QuantStream's: keys [BH, Dc, S] (keys-major), values
   [BH, S, Dc]; 4-bit codes hold element i in the low nibble of byte i and element i + D/2 in its
   high nibble. Scales arrive as float [BH, nb, n] (converted from the stored fp16 by the caller).
   Code values: q8_0 c + 1/2, q4_0 u - 15/2, nf4 the NF4 codebook, q4_0l u - 8; times the block
   scale (q4_0l's is signed).
   Parallel over independent output pieces with OpenMP (the process shares torch's libgomp).

   Levels: the run-time instruction set choice of the model's kernels (caramba/model/cpu_isa.c,
   compiled into this library too: CARAMBA_ISA when it loads, caramba.model.isa.use_isa after).
   scalar runs the portable reference (quant_attend_ref.c: one position and element at a time);
   every other level runs the vector loops (quant_attend_vec.c: GCC vector extensions, lowered to
   the build's widest SIMD). The two agree within fp32 rounding (whether a multiply and an add
   fuse differs by target and vector width); every vector level runs the same vector code, so
   those agree bit for bit. This file: the exported functions, which split the work into items
   and run each through the library's level. */

#include "quant_attend_ref.h"
#include "quant_attend_vec.h"

#include <stdint.h>
#include <stdlib.h>

#define TILE 256  /* key positions per work item */

/* scores[bh, r, t] = sum_j scale[bh, j, t] * sum_{e in block j} q[bh, r, e] * value(code[bh, e, t]),
   for positions t in [0, n). q: [BH, R, D] floats (already scaled), out: [BH, R, n]. Keys-major
   codes make 16 neighbouring positions of one element one vector load. */
void key_scores(const float *q, const void *codes, const float *scales, float *out,
                int BH, int R, int D, int blk, int n, long head_stride, long row_stride,
                int kind, int nthreads) {
    const int nb = D / blk, tiles = (n + TILE - 1) / TILE, groups = (R + RMAX - 1) / RMAX;
    key_item_fn *const run = g_isa == ISA_SCALAR ? key_item_ref : key_item_vec;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (long item = 0; item < (long)BH * groups * tiles; item++) {
        const int bh = (int)(item / ((long)groups * tiles)), g = (int)(item / tiles % groups);
        const int t0 = (int)(item % tiles) * TILE, t1 = t0 + TILE < n ? t0 + TILE : n;
        const int r0 = g * RMAX, rr = R - r0 < RMAX ? R - r0 : RMAX;
        const float *qh = q + ((long)bh * R + r0) * D, *sh = scales + (long)bh * nb * n;
        const uint8_t *base = (const uint8_t *)codes + bh * head_stride;
        float *oh = out + ((long)bh * R + r0) * n;
        run(kind, rr, qh, base, sh, oh, D, blk, n, row_stride, t0, t1);
    }
}

/* out[bh, r, e] = sum_t p[bh, r, t] * scale[bh, j(e), t] * value(code[bh, t, e]) over positions
   t in [0, n). p: [BH, R, n] softmax weights, out: [BH, R, D]. Work items: (head, block, rows). */
void value_mix(const float *p, const void *codes, const float *scales, float *out,
               int BH, int R, int D, int blk, int n, long head_stride, long row_stride,
               int kind, int nthreads) {
    const int nb = D / blk, groups = (R + RMAX - 1) / RMAX;
    value_item_fn *const run = g_isa == ISA_SCALAR ? value_item_ref : value_item_vec;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (long item = 0; item < (long)BH * nb * groups; item++) {
        const int bh = (int)(item / ((long)nb * groups)), j = (int)(item / groups % nb), g = (int)(item % groups);
        const int r0 = g * RMAX, rr = R - r0 < RMAX ? R - r0 : RMAX;
        const float *ph = p + ((long)bh * R + r0) * n, *s = scales + ((long)bh * nb + j) * n;
        float *wt = malloc((size_t)rr * n * sizeof(float));   /* [rr][n]: p * the block's scale */
        float wsum[RMAX] = {0};
        for (int r = 0; r < rr; r++)
            for (int t = 0; t < n; t++) {
                wt[(long)r * n + t] = ph[(long)r * n + t] * s[t];
                wsum[r] += wt[(long)r * n + t];
            }
        const uint8_t *base = (const uint8_t *)codes + bh * head_stride;
        float *oh = out + ((long)bh * R + r0) * D;
        run(kind, rr, wt, wsum, base, oh, D, n, row_stride, j * blk, (j + 1) * blk);
        free(wt);
    }
}

/* ---- zero-point kinds (q4_1, q2_1 per token; q4_1c, q2_1c per channel): code u stands for
   m + u * s with a per-block scale s and minimum m. Codes of `bits` (4 or 2) are packed
   8/bits per byte: element e sits in bit field e / fw of byte e % fw, fw = D * bits / 8.
   Parameters arrive as float [BH, 2 nb, n] for per-token blocks (scales, then minimums) and
   [BH, 2 D, ng] for per-channel groups of G tokens (keys only; G a multiple of 16: a vector). */

/* group == 0: per-token blocks of blk elements; group > 0: per-channel groups of `group` tokens. */
void key_scores_zp(const float *q, const void *codes, const float *params, float *out,
                   int BH, int R, int D, int blk, int n, long head_stride, long row_stride,
                   int bits, int group, long pstride, int nthreads) {
    const int nb = D / blk, tiles = (n + TILE - 1) / TILE, groups = (R + RMAX - 1) / RMAX;
    const long prows = group ? 2L * D : 2L * nb;
    key_item_zp_fn *const run = group ? (g_isa == ISA_SCALAR ? key_item_channel_ref : key_item_channel_vec)
                                      : (g_isa == ISA_SCALAR ? key_item_zp_ref : key_item_zp_vec);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (long item = 0; item < (long)BH * groups * tiles; item++) {
        const int bh = (int)(item / ((long)groups * tiles)), gr = (int)(item / tiles % groups);
        const int t0 = (int)(item % tiles) * TILE, t1 = t0 + TILE < n ? t0 + TILE : n;
        const int r0 = gr * RMAX, rr = R - r0 < RMAX ? R - r0 : RMAX;
        const float *qh = q + ((long)bh * R + r0) * D, *ph = params + (long)bh * prows * pstride;
        const uint8_t *base = (const uint8_t *)codes + bh * head_stride;
        float *oh = out + ((long)bh * R + r0) * n;
        run(bits, rr, qh, base, ph, oh, D, group ? group : blk, n, pstride, row_stride, t0, t1);
    }
}

void value_mix_zp(const float *p, const void *codes, const float *params, float *out,
                  int BH, int R, int D, int blk, int n, long head_stride, long row_stride,
                  int bits, int group, long pstride, int nthreads) {
    (void)group;
    const int nb = D / blk, groups = (R + RMAX - 1) / RMAX;
    value_item_zp_fn *const run = g_isa == ISA_SCALAR ? value_item_zp_ref : value_item_zp_vec;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (long item = 0; item < (long)BH * nb * groups; item++) {
        const int bh = (int)(item / ((long)nb * groups)), j = (int)(item / groups % nb), gr = (int)(item % groups);
        const int r0 = gr * RMAX, rr = R - r0 < RMAX ? R - r0 : RMAX;
        const float *ph = p + ((long)bh * R + r0) * n;
        const float *s = params + ((long)bh * 2 * nb + j) * pstride, *m = params + ((long)bh * 2 * nb + nb + j) * pstride;
        float *wt = malloc((size_t)rr * n * sizeof(float));
        float moff[RMAX] = {0};
        for (int r = 0; r < rr; r++)
            for (int t = 0; t < n; t++) {
                wt[(long)r * n + t] = ph[(long)r * n + t] * s[t];
                moff[r] += ph[(long)r * n + t] * m[t];
            }
        const uint8_t *base = (const uint8_t *)codes + bh * head_stride;
        float *oh = out + ((long)bh * R + r0) * D;
        run(bits, rr, wt, moff, base, oh, D, n, row_stride, j * blk, (j + 1) * blk);
        free(wt);
    }
}
