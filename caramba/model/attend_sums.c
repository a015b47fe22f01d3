/* The decode step's attention sums (attend_sums.h): a part's softmax weights and the weighted sum
   of its value rows, moved out of decode_step.c (which calls them once a part and VCHUNK slots)
   to keep it under the layout's 900 lines (tests/test_c_layout.py). */

#include "attend_sums.h"

#include <math.h>

/* Columns [c, D) of the chunk, slot by slot: the reference's arithmetic. */
static void value_cols(float *restrict o, const ValueChunk *vc, int c) {
    for (int k = 0; k < vc->cn; k++) {
        if (!vc->rows[k] || vc->e[k] == 0.0f) continue;
        const float e = vc->e[k], *pk = vc->ppb + (long)k * vc->vnp, *rk = vc->rows[k];
        for (int cc = c; cc < vc->D; cc++) o[cc] += (vc->coded[k] ? e * pk[cc / vc->vqb] : e) * rk[cc];
    }
}

/* A zero point's minimums times the weights, per block: the coded rows listed once, then each
   sum in a register (perf: the three tests per slot and block were ~15% of a KIVI step). */
static void value_minimums(const ValueChunk *vc, float *bsum) {
    int act[VCHUNK], na = 0;
    for (int k = 0; k < vc->cn; k++)
        if (vc->rows[k] && vc->e[k] != 0.0f && vc->coded[k]) act[na++] = k;
    for (int b = 0; b < vc->vnb; b++) {
        float acc = bsum[b];
        for (int i = 0; i < na; i++) acc += vc->e[act[i]] * vc->ppb[(long)act[i] * vc->vnp + vc->vnb + b];
        bsum[b] = acc;
    }
}

static void value_chunk_ref(float *restrict o, const ValueChunk *vc, float *bsum) {
    value_cols(o, vc, 0);
    if (vc->vzp) value_minimums(vc, bsum);
}

#if HAVE_AVX2
/* The same with o in registers 64 floats at a time where the blocks allow it. */
static void value_chunk_avx2(float *restrict o, const ValueChunk *vc, float *bsum) {
    const int D = vc->D, vqb = vc->vqb, vnb = vc->vnb;
    int c = 0;
    if (vqb % 8 == 0 || vnb == 0)
        for (; c + 64 <= D; c += 64) {
            int blk[8];                     /* each vector's block (a block holds whole vectors) */
            for (int v = 0; v < 8; v++) blk[v] = vnb ? (c + 8 * v) / vqb : 0;
            __m256 acc[8];
            for (int v = 0; v < 8; v++) acc[v] = _mm256_loadu_ps(o + c + 8 * v);
            for (int k = 0; k < vc->cn; k++) {
                const float e = vc->e[k];
                if (!vc->rows[k] || e == 0.0f) continue;
                const float *restrict rk = vc->rows[k] + c;
                if (vc->coded[k]) {
                    const float *pk = vc->ppb + (long)k * vc->vnp;
                    for (int v = 0; v < 8; v++)
                        acc[v] = _mm256_fmadd_ps(_mm256_set1_ps(e * pk[blk[v]]), _mm256_loadu_ps(rk + 8 * v), acc[v]);
                } else {
                    const __m256 w = _mm256_set1_ps(e);
                    for (int v = 0; v < 8; v++) acc[v] = _mm256_fmadd_ps(w, _mm256_loadu_ps(rk + 8 * v), acc[v]);
                }
            }
            for (int v = 0; v < 8; v++) _mm256_storeu_ps(o + c + 8 * v, acc[v]);
        }
    value_cols(o, vc, c);
    if (vc->vzp) value_minimums(vc, bsum);
}
#endif

HIDDEN void value_chunk(float *restrict o, const ValueChunk *vc, float *bsum) {
#if HAVE_AVX2
    if (g_isa >= ISA_AVX2) {
        value_chunk_avx2(o, vc, bsum);
        return;
    }
#endif
    value_chunk_ref(o, vc, bsum);
}

#if HAVE_AVX2
/* e^x for 4 floats x <= 0 in double: x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor series to
   r^10 (relative error < 3e-13), times 2^n built in the exponent bits, then rounded to float: the
   correctly rounded e^x but for inputs within ~1e-9 ulp of a rounding tie, so the scalar level's
   libm expf values (glibc's differs on ~1 in 20000 inputs, where it is the one a ulp off). x below
   -200 gives 0, as e^x rounds to. */
static inline __m128 exp4_rounded(__m128 xf) {
    const __m256d x = _mm256_max_pd(_mm256_cvtps_pd(xf), _mm256_set1_pd(-200.0));
    const __m256d shift = _mm256_set1_pd(6755399441055744.0);          /* 1.5 2^52: n in the low bits */
    const __m256d kd = _mm256_fmadd_pd(x, _mm256_set1_pd(1.4426950408889634), shift);
    const __m256d n = _mm256_sub_pd(kd, shift);
    const __m256d r = _mm256_fnmadd_pd(n, _mm256_set1_pd(1.9082149292705877e-10),
                                       _mm256_fnmadd_pd(n, _mm256_set1_pd(0.6931471803691238), x));
    __m256d p = _mm256_set1_pd(1.0 / 3628800);
    static const double inv_fact[10] = {1.0 / 362880, 1.0 / 40320, 1.0 / 5040, 1.0 / 720, 1.0 / 120,
                                        1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0};
    for (int i = 0; i < 10; i++) p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(inv_fact[i]));
    const __m256i e = _mm256_slli_epi64(_mm256_add_epi64(_mm256_castpd_si256(kd), _mm256_set1_epi64x(1023)), 52);
    return _mm256_cvtpd_ps(_mm256_mul_pd(p, _mm256_castsi256_pd(e)));
}
#endif

/* The softmax weights e_j = exp(score - m_j) of the rep heads' s_j [a0, a1) (s_j = s + j ld) in
   place (0: a masked slot, -inf), their sums into sum [rep]. With AVX2 8 slots of every head at a
   time (exp4_rounded: expf's values; libm's expf, a call a slot with the sum carried through
   memory, was a fifth of the attention's work over a long cache), each sum still taken slot by slot
   in order as the scalar reference takes it (a sum in lanes moved logits by a q8 activation's
   rounding); the heads' sums are independent chains, so their latency hides behind the exps. */
HIDDEN void softmax_weights(float *restrict s, long ld, int rep, int a0, int a1, const float *m, float *sum) {
    int i = a0;
#if HAVE_AVX2
    if (g_isa >= ISA_AVX2) {
        const __m256 ninf = _mm256_set1_ps(-INFINITY);
        for (; i + 8 <= a1; i += 8)
            for (int j = 0; j < rep; j++) {
                float *sj = s + j * ld + i;
                const __m256 x = _mm256_loadu_ps(sj), d = _mm256_sub_ps(x, _mm256_set1_ps(m[j]));
                const __m256 ex = _mm256_set_m128(exp4_rounded(_mm256_extractf128_ps(d, 1)),
                                                  exp4_rounded(_mm256_castps256_ps128(d)));
                _mm256_storeu_ps(sj, _mm256_andnot_ps(_mm256_cmp_ps(x, ninf, _CMP_EQ_OQ), ex));
                float acc = sum[j];
                for (int l = 0; l < 8; l++) acc += sj[l];
                sum[j] = acc;
            }
    }
#endif
    for (int j = 0; j < rep; j++) {
        float *sj = s + j * ld, acc = sum[j];
        for (int k = i; k < a1; k++) {
            if (sj[k] == -INFINITY) { sj[k] = 0.0f; continue; }
            sj[k] = expf(sj[k] - m[j]);
            acc += sj[k];
        }
        sum[j] = acc;
    }
}
