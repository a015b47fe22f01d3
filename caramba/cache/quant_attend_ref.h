/* What quant_attend.c's work items take from its levels: one item's loop each, as the portable
   reference (quant_attend_ref.c, the scalar level's) and as vectors (quant_attend_vec.h). Shapes
   and layouts are quant_attend.c's; an item is up to RMAX query rows (rr) of one head:
     key_item        scores oh [rr, n] at positions [t0, t1) of q rows qh [rr, D] against keys-major
                     codes base (element e's positions row_stride apart) and scales sh [nb, n]
                     (blocks of blk elements) of kind (kinds.h's KIND_*);
     value_item      outputs oh [rr, D] at elements [e0, e1) (one block) of weights wt [rr, n]
                     (p times the block's scale; wsum: their sums) over value codes base;
     key_item_zp     key_item for the zero-point kinds' codes of `bits`, parameters ph: per-token
                     blocks of `blk` ([2 nb, pstride]: scales, then minimums); key_item_channel
                     per-channel groups of `blk` = G tokens ([2 D, pstride]);
     value_item_zp   value_item for per-token zero-point codes (moff: the minimums' sums). */

#ifndef CARAMBA_QUANT_ATTEND_REF_H
#define CARAMBA_QUANT_ATTEND_REF_H

#include <stdint.h>

#include "../model/cpu_isa.h"
#include "kinds.h"

#define RMAX 8    /* query rows handled by one work item */

typedef void key_item_fn(int kind, int rr, const float *qh, const uint8_t *base, const float *sh, float *oh, int D,
                         int blk, int n, long row_stride, int t0, int t1);
typedef void value_item_fn(int kind, int rr, const float *wt, const float *wsum, const uint8_t *base, float *oh,
                           int D, int n, long row_stride, int e0, int e1);
typedef void key_item_zp_fn(int bits, int rr, const float *qh, const uint8_t *base, const float *ph, float *oh,
                            int D, int blk, int n, long pstride, long row_stride, int t0, int t1);
typedef void value_item_zp_fn(int bits, int rr, const float *wt, const float *moff, const uint8_t *base, float *oh,
                              int D, int n, long row_stride, int e0, int e1);

HIDDEN key_item_fn key_item_ref;
HIDDEN value_item_fn value_item_ref;
HIDDEN key_item_zp_fn key_item_zp_ref, key_item_channel_ref;
HIDDEN value_item_zp_fn value_item_zp_ref;

#endif
