/* The portable reference of quant_attend.c's work items (the scalar level's; quant_attend_ref.h
   says what each computes): one key position or value element at a time, each code's value
   taken as quant_attend.c states it, the sums in the vector loops' order (quant_attend_vec.c) but
   with plain fp32 operations, so the two agree within fp32 rounding. */

#include "quant_attend_ref.h"

/* The value of a code byte of `kind` (4-bit kinds: its high or low nibble), before the offset. */
static float code_value(uint8_t byte, int kind, int high) {
    if (kind == KIND_Q8_0) return (float)(int8_t)byte;
    const int u = high ? byte >> 4 : byte & 15;
    return kind == KIND_NF4 ? NF4_LEVELS[u] : (float)u;
}

/* score = sum_j s_j(t) (sum_e q_e value(c_e(t)) + offset sum_e q_e) */
HIDDEN void key_item_ref(int kind, int rr, const float *qh, const uint8_t *base, const float *sh, float *oh, int D,
                         int blk, int n, long row_stride, int t0, int t1) {
    const int nb = D / blk, half = D / 2, packed = kind != KIND_Q8_0;
    const float off = KIND_OFFSET[kind];
    for (int r = 0; r < rr; r++)
        for (int t = t0; t < t1; t++) {
            const float *q = qh + (long)r * D;
            float score = 0.0f;
            for (int j = 0; j < nb; j++) {
                float acc = 0.0f, qs = 0.0f;
                for (int e = j * blk; e < (j + 1) * blk; e++) {
                    const int high = packed && e >= half;
                    acc += q[e] * code_value(base[(long)(high ? e - half : e) * row_stride + t], kind, high);
                    qs += q[e];
                }
                score += sh[(long)j * n + t] * (acc + off * qs);
            }
            oh[(long)r * n + t] = score;
        }
}

/* out_e = sum_t wt(t) value(c_e(t)) + offset sum_t wt(t) */
HIDDEN void value_item_ref(int kind, int rr, const float *wt, const float *wsum, const uint8_t *base, float *oh, int D,
                           int n, long row_stride, int e0, int e1) {
    const int half = D / 2, packed = kind != KIND_Q8_0;
    const float off = KIND_OFFSET[kind];
    for (int r = 0; r < rr; r++)
        for (int e = e0; e < e1; e++) {
            const int high = packed && e >= half;
            const uint8_t *col = base + (high ? e - half : e);
            float acc = 0.0f;
            for (int t = 0; t < n; t++) acc += wt[(long)r * n + t] * code_value(col[(long)t * row_stride], kind, high);
            oh[(long)r * D + e] = acc + off * wsum[r];
        }
}

/* Code u of `bits` for element e: bit field e / fw of byte e % fw, fw = D bits / 8 (quant_attend.c). */
static float field_value(uint8_t byte, int shift, int mask) { return (float)((byte >> shift) & mask); }

/* score = sum_j s_j(t) (q_j . u_j(t)) + m_j(t) sum(q_j) */
HIDDEN void key_item_zp_ref(int bits, int rr, const float *qh, const uint8_t *base, const float *ph, float *oh, int D,
                            int blk, int n, long pstride, long row_stride, int t0, int t1) {
    const int nb = D / blk, fw = D * bits / 8, mask = (1 << bits) - 1;
    for (int r = 0; r < rr; r++)
        for (int t = t0; t < t1; t++) {
            const float *q = qh + (long)r * D;
            float score = 0.0f;
            for (int j = 0; j < nb; j++) {
                float acc = 0.0f, qs = 0.0f;
                for (int e = j * blk; e < (j + 1) * blk; e++) {
                    acc += q[e] * field_value(base[(long)(e % fw) * row_stride + t], bits * (e / fw), mask);
                    qs += q[e];
                }
                score += ph[(long)j * pstride + t] * acc + ph[(long)(nb + j) * pstride + t] * qs;
            }
            oh[(long)r * n + t] = score;
        }
}

/* score = sum_e (q_e s_e(g)) u_e(t) + sum_e q_e m_e(g), g = t / G */
HIDDEN void key_item_channel_ref(int bits, int rr, const float *qh, const uint8_t *base, const float *ph, float *oh,
                                 int D, int G, int n, long pstride, long row_stride, int t0, int t1) {
    const int fw = D * bits / 8, mask = (1 << bits) - 1;
    for (int r = 0; r < rr; r++)
        for (int t = t0; t < t1; t++) {
            const float *q = qh + (long)r * D;
            const int g = t / G;
            float acc = 0.0f, cst = 0.0f;
            for (int e = 0; e < D; e++) {
                const float s = ph[(long)e * pstride + g], m = ph[(long)(D + e) * pstride + g];
                acc += (q[e] * s) * field_value(base[(long)(e % fw) * row_stride + t], bits * (e / fw), mask);
                cst += q[e] * m;
            }
            oh[(long)r * n + t] = acc + cst;
        }
}

/* out_e = sum_t wt(t) u_e(t) + moff */
HIDDEN void value_item_zp_ref(int bits, int rr, const float *wt, const float *moff, const uint8_t *base, float *oh,
                              int D, int n, long row_stride, int e0, int e1) {
    const int fw = D * bits / 8, mask = (1 << bits) - 1;
    for (int r = 0; r < rr; r++)
        for (int e = e0; e < e1; e++) {
            const uint8_t *col = base + e % fw;
            float acc = 0.0f;
            for (int t = 0; t < n; t++)
                acc += wt[(long)r * n + t] * field_value(col[(long)t * row_stride], bits * (e / fw), mask);
            oh[(long)r * D + e] = acc + moff[r];
        }
}
