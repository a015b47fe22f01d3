/* The decode step's attention sums (attend_sums.c, for decode_step.c's part_partials): a part's
   softmax weights and the weighted sum of its value rows, each with a portable reference and an
   AVX2 loop that give the reference's bits. */

#ifndef CARAMBA_ATTEND_SUMS_H
#define CARAMBA_ATTEND_SUMS_H

#include "cpu_isa.h"

#define VCHUNK 16           /* value rows decoded per pass of every head over them */

/* o [D] += sum over the chunk's slots k of e[k] v_k, v_k a decoded row of codes (coded[k]: per
   block scale pp[k][b], a zero point's minimum in bsum) or an fp32 row; rows[k] NULL: skipped.
   Slot by slot in order, each block's product fused as o += (e s) code. */
typedef struct {
    const float *const *rows;   /* [cn], cn <= VCHUNK */
    const int *coded;           /* [cn] */
    const float *ppb;           /* [cn, vnp] block parameters: scales, then minimums */
    const float *e;             /* [cn] softmax weights */
    int cn, vnb, vnp, vqb, vzp, D;
} ValueChunk;

HIDDEN void value_chunk(float *restrict o, const ValueChunk *vc, float *bsum);

/* The softmax weights e_j = exp(score - m_j) of the rep heads' s_j [a0, a1) (s_j = s + j ld) in
   place (0: a masked slot, -inf), their sums into sum [rep]. */
HIDDEN void softmax_weights(float *restrict s, long ld, int rep, int a0, int a1, const float *m, float *sum);

#endif
