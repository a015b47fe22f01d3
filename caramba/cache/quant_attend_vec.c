/* The vector level of quant_attend.c's loops: one work item's keys or values, 16 key positions
   (keys) or 16 elements (values) per vector, with GCC/Clang vector extensions that the compiler
   lowers to the build's widest SIMD (AVX-512, AVX2, NEON, ...). quant_attend.c runs these at every
   level but scalar (quant_attend_ref.c holds the reference). */

#include "quant_attend_vec.h"

#include <string.h>

#if defined(__GNUC__) && !defined(__clang__)
/* vf values are returned only by the force-inlined helpers below, never through a call: the
   notice that a 64-byte vector's return convention differs without AVX-512 concerns none of them */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

static float code_offset(int kind) { return KIND_OFFSET[kind]; }

/* GCC/Clang vector extensions: 16 floats, lowered to whatever SIMD -march=native offers. The
   per-item bodies are force-inlined into one copy per (kind, rows) so that both are constants
   there: the accumulators of up to RMAX query rows then live in registers. */
#define VW 16
_Static_assert(VW == 16, "the NF4 lookup permutes one 16-lane vector");
typedef float vf __attribute__((vector_size(VW * 4)));
typedef uint8_t vu8 __attribute__((vector_size(VW)));
typedef int32_t vi32 __attribute__((vector_size(VW * 4)));

/* w <= VW bytes (the rest zero) as a vector. */
INLINE vu8 load_bytes(const void *src, int w) {
    vu8 b;
    if (w == VW) {
        memcpy(&b, src, VW);
        return b;
    }
    b = (vu8){0};
    for (int i = 0; i < w; i++) b[i] = ((const uint8_t *)src)[i];
    return b;
}

INLINE vf load_floats(const float *src, int w) {
    vf v = {0};
    if (w == VW) memcpy(&v, src, VW * 4);
    else for (int i = 0; i < w; i++) v[i] = src[i];
    return v;
}

INLINE void store_floats(float *dst, const vf *v, int w) {
    if (w == VW) memcpy(dst, v, VW * 4);
    else for (int i = 0; i < w; i++) dst[i] = (*v)[i];
}

/* Values of w <= VW codes, one byte each from `src` (4-bit: the `high` or low nibble of each). */
INLINE vf code_vector(const void *src, int w, const int kind, int high) {
    const vu8 b = load_bytes(src, w);
    /* Widen unsigned bytes to int32, then sign-extend by shifts: GCC (12) turns a direct or
       signed int8 -> float conversion into scalar code, this into vpmovzxbd + shifts. */
    if (kind == KIND_Q8_0) return __builtin_convertvector((__builtin_convertvector(b, vi32) << 24) >> 24, vf);
    const vu8 u = high ? b >> 4 : b & 15;
    const vi32 idx = __builtin_convertvector(u, vi32);
    if (kind == KIND_Q4_0 || kind == KIND_Q4_0L) return __builtin_convertvector(idx, vf);
#if defined(__clang__)
    vf v;
    for (int i = 0; i < VW; i++) v[i] = NF4_LEVELS[idx[i]];
    return v;
#else
    vf table;   /* the 16-entry codebook is one vector: the lookup is a lane permute */
    memcpy(&table, NF4_LEVELS, sizeof table);
    return __builtin_shuffle(table, idx);
#endif
}

/* One key work item: rows [0, rr) of qh against positions [t0, t1). */
INLINE void key_item(const int kind, const int rr, const float *qh, const uint8_t *base, const float *sh,
                     float *oh, int D, int blk, int n, long row_stride, int t0, int t1) {
    const int nb = D / blk, half = D / 2, packed = kind != KIND_Q8_0;
    const float off = code_offset(kind);
    for (int v0 = t0; v0 < t1; v0 += VW) {
        const int w = t1 - v0 < VW ? t1 - v0 : VW;
        vf score[RMAX] = {0};
        for (int j = 0; j < nb; j++) {
            vf acc[RMAX] = {0};
            float qs[RMAX] = {0};   /* the offset term: value(c) = c + off for every code */
            for (int e = j * blk; e < (j + 1) * blk; e++) {
                const int high = packed && e >= half;
                const vf c = code_vector(base + (high ? e - half : e) * row_stride + v0, w, kind, high);
                for (int r = 0; r < rr; r++) {
                    acc[r] += qh[(long)r * D + e] * c;
                    qs[r] += qh[(long)r * D + e];
                }
            }
            const vf s = load_floats(sh + (long)j * n + v0, w);
            for (int r = 0; r < rr; r++) score[r] += s * (acc[r] + off * qs[r]);
        }
        for (int r = 0; r < rr; r++) store_floats(oh + (long)r * n + v0, &score[r], w);
    }
}

/* One value work item: rows [0, rr) of the weights wt = p * scale over all n positions, for the
   elements [e0, e1) of one block. */
INLINE void value_item(const int kind, const int rr, const float *wt, const float *wsum, const uint8_t *base,
                       float *oh, int D, int n, long row_stride, int e0, int e1) {
    const int half = D / 2, packed = kind != KIND_Q8_0;
    const float off = code_offset(kind);
    for (int e = e0; e < e1;) {
        int w = e1 - e < VW ? e1 - e : VW;
        const int high = packed && e >= half;
        if (packed && e < half && e + w > half) w = half - e;   /* never straddle the nibble halves */
        const uint8_t *col = base + (high ? e - half : e);
        vf acc[RMAX] = {0};
        for (int t = 0; t < n; t++) {
            const vf c = code_vector(col + (long)t * row_stride, w, kind, high);
            for (int r = 0; r < rr; r++) acc[r] += wt[(long)r * n + t] * c;
        }
        for (int r = 0; r < rr; r++) {
            const vf o = acc[r] + off * wsum[r];
            store_floats(oh + (long)r * D + e, &o, w);
        }
        e += w;
    }
}

#define FOR_ROWS(X, K) X(K, 1) X(K, 2) X(K, 3) X(K, 4) X(K, 5) X(K, 6) X(K, 7) X(K, 8)
#define FOR_KINDS_ROWS(X) FOR_ROWS(X, KIND_Q8_0) FOR_ROWS(X, KIND_Q4_0) FOR_ROWS(X, KIND_NF4) FOR_ROWS(X, KIND_Q4_0L)


HIDDEN void key_item_vec(int kind, int rr, const float *qh, const uint8_t *base, const float *sh, float *oh, int D,
                         int blk, int n, long row_stride, int t0, int t1) {
    switch (kind * 16 + rr) {
#define KEY_CASE(K, RR) case K * 16 + RR: key_item(K, RR, qh, base, sh, oh, D, blk, n, row_stride, t0, t1); break;
        FOR_KINDS_ROWS(KEY_CASE)
#undef KEY_CASE
    }
}

HIDDEN void value_item_vec(int kind, int rr, const float *wt, const float *wsum, const uint8_t *base, float *oh, int D,
                           int n, long row_stride, int e0, int e1) {
    switch (kind * 16 + rr) {
#define VALUE_CASE(K, RR) case K * 16 + RR: value_item(K, RR, wt, wsum, base, oh, D, n, row_stride, e0, e1); break;
        FOR_KINDS_ROWS(VALUE_CASE)
#undef VALUE_CASE
    }
}

/* ---- zero-point kinds (quant_attend_ref.h) */

INLINE vf field_vector(const void *src, int w, int shift, int mask) {
    const vu8 b = load_bytes(src, w);
    return __builtin_convertvector(__builtin_convertvector((b >> shift) & (uint8_t)mask, vi32), vf);
}

/* Per-token blocks: score[r, t] = sum_j s_j(t) (q_j . u_j(t)) + m_j(t) sum(q_j). */
INLINE void key_item_zp(const int bits, const int rr, const float *qh, const uint8_t *base, const float *ph,
                        float *oh, int D, int blk, int n, long pstride, long row_stride, int t0, int t1) {
    const int nb = D / blk, fw = D * bits / 8, mask = (1 << bits) - 1;
    for (int v0 = t0; v0 < t1; v0 += VW) {
        const int w = t1 - v0 < VW ? t1 - v0 : VW;
        vf score[RMAX] = {0};
        for (int j = 0; j < nb; j++) {
            vf acc[RMAX] = {0};
            float qs[RMAX] = {0};
            for (int e = j * blk; e < (j + 1) * blk; e++) {
                const vf c = field_vector(base + (e % fw) * row_stride + v0, w, bits * (e / fw), mask);
                for (int r = 0; r < rr; r++) {
                    acc[r] += qh[(long)r * D + e] * c;
                    qs[r] += qh[(long)r * D + e];
                }
            }
            const vf s = load_floats(ph + (long)j * pstride + v0, w), m = load_floats(ph + (long)(nb + j) * pstride + v0, w);
            for (int r = 0; r < rr; r++) score[r] += s * acc[r] + m * qs[r];
        }
        for (int r = 0; r < rr; r++) store_floats(oh + (long)r * n + v0, &score[r], w);
    }
}

/* Per-channel groups: score[r, t] = sum_e (q_e s_e(g)) u_e(t) + sum_e q_e m_e(g), g = t / G. */
INLINE void key_item_channel(const int bits, const int rr, const float *qh, const uint8_t *base, const float *ph,
                             float *oh, int D, int G, int n, long pstride, long row_stride, int t0, int t1) {
    const int fw = D * bits / 8, mask = (1 << bits) - 1;
    for (int v0 = t0; v0 < t1; v0 += VW) {
        const int w = t1 - v0 < VW ? t1 - v0 : VW, g = v0 / G;
        vf acc[RMAX] = {0};
        float cst[RMAX] = {0};
        for (int e = 0; e < D; e++) {
            const float s = ph[(long)e * pstride + g], m = ph[(long)(D + e) * pstride + g];
            const vf c = field_vector(base + (e % fw) * row_stride + v0, w, bits * (e / fw), mask);
            for (int r = 0; r < rr; r++) {
                acc[r] += (qh[(long)r * D + e] * s) * c;
                cst[r] += qh[(long)r * D + e] * m;
            }
        }
        for (int r = 0; r < rr; r++) {
            const vf o = acc[r] + cst[r];
            store_floats(oh + (long)r * n + v0, &o, w);
        }
    }
}

#define FOR_BITS_ROWS(X) FOR_ROWS(X, 4) FOR_ROWS(X, 2)

/* Per-token blocks of values: out[r, e] = sum_t (p_t s_j(t)) u_e(t) + sum_t p_t m_j(t), j = e / blk. */
INLINE void value_item_zp(const int bits, const int rr, const float *wt, const float *moff, const uint8_t *base,
                          float *oh, int D, int n, long row_stride, int e0, int e1) {
    const int fw = D * bits / 8, mask = (1 << bits) - 1;
    for (int e = e0; e < e1;) {
        int w = e1 - e < VW ? e1 - e : VW;
        const int field = e / fw;
        if ((e + w - 1) / fw != field) w = (field + 1) * fw - e;   /* never straddle two bit fields */
        const uint8_t *col = base + e % fw;
        vf acc[RMAX] = {0};
        for (int t = 0; t < n; t++) {
            const vf c = field_vector(col + (long)t * row_stride, w, bits * field, mask);
            for (int r = 0; r < rr; r++) acc[r] += wt[(long)r * n + t] * c;
        }
        for (int r = 0; r < rr; r++) {
            const vf o = acc[r] + moff[r];
            store_floats(oh + (long)r * D + e, &o, w);
        }
        e += w;
    }
}

HIDDEN void key_item_zp_vec(int bits, int rr, const float *qh, const uint8_t *base, const float *ph, float *oh, int D,
                            int blk, int n, long pstride, long row_stride, int t0, int t1) {
    switch (bits * 16 + rr) {
#define KEYZ_CASE(B, RR) case B * 16 + RR: key_item_zp(B, RR, qh, base, ph, oh, D, blk, n, pstride, row_stride, t0, t1); break;
        FOR_BITS_ROWS(KEYZ_CASE)
#undef KEYZ_CASE
    }
}

HIDDEN void key_item_channel_vec(int bits, int rr, const float *qh, const uint8_t *base, const float *ph, float *oh,
                                 int D, int G, int n, long pstride, long row_stride, int t0, int t1) {
    switch (bits * 16 + rr) {
#define KEYC_CASE(B, RR) case B * 16 + RR: key_item_channel(B, RR, qh, base, ph, oh, D, G, n, pstride, row_stride, t0, t1); break;
        FOR_BITS_ROWS(KEYC_CASE)
#undef KEYC_CASE
    }
}

HIDDEN void value_item_zp_vec(int bits, int rr, const float *wt, const float *moff, const uint8_t *base, float *oh,
                              int D, int n, long row_stride, int e0, int e1) {
    switch (bits * 16 + rr) {
#define VALUEZ_CASE(B, RR) case B * 16 + RR: value_item_zp(B, RR, wt, moff, base, oh, D, n, row_stride, e0, e1); break;
        FOR_BITS_ROWS(VALUEZ_CASE)
#undef VALUEZ_CASE
    }
}
