/* The fused decode step's projections (decode_step.c calls linear() once per projection, from
   every thread of its parallel region): fp32 weights row-major ([N, K], nn.Linear) or input-major
   ([K, N], InputMajorLinear), each with a portable reference (*_ref, the scalar level's) and AVX2 /
   AVX-512 loops; the block formats through quant_gemv.c's quant_rows. Every product splits its
   outputs between the threads (rows, or bands of an input-major weight's columns), never a sum, so
   its bits do not depend on the thread count. */

#include "step_linear.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>

/* Several token rows (a batch) make the fp32 products compute-bound rather than read-bound, so
   they go through register tiles: each weight element loaded once feeds up to TR rows' sums held
   in registers (8 accumulators: 2 weight rows x 4 token rows, or 16 columns x 4 token rows; at
   the avx512 levels, whose 32 vector registers hold twice as many, up to TR512 rows). */
#define TR 4
#define TR512 8
#define PF_ROWS 4   /* rows_f32_batch_avx512's prefetch distance, in weight rows */

/* out[0][r], out[1][r] = weight rows w0, w1 . token rows x + r K for r < RR: the reference. */
static void rows_tile_ref(int RR, const float *w0, const float *w1, const float *x, int K, float out[2][TR512]) {
    for (int r = 0; r < RR; r++) {
        out[0][r] = dot_f32_ref(w0, x + (long)r * K, K);
        out[1][r] = dot_f32_ref(w1, x + (long)r * K, K);
    }
}

#if HAVE_AVX2
/* One output's sum: its 8-lane sums added across, then the k past the last whole 8 (from k),
   fused (explicitly: every tile, and rows_one_avx2, that calls this gets the same bits). */
INLINE float tile_sum(__m256 a, const float *w, const float *xr, int k, int K) {
    float s = hsum8(a);
    for (int kk = k; kk < K; kk++) s = fmaf(w[kk], xr[kk], s);
    return s;
}

/* A tile row's two sums (weight rows w0 and w1). */
INLINE void tile_sums(__m256 a, __m256 b, const float *w0, const float *w1, const float *xr, int k, int K,
                      float *o0, float *o1) {
    *o0 = tile_sum(a, w0, xr, k, K), *o1 = tile_sum(b, w1, xr, k, K);
}

/* rows_tile_ref's sums, 8 k at a time for every token row. With several token rows the loop
   computes long enough per byte that the hardware prefetcher falls behind: prefetching the next pair two rows
   ahead took a batch-8 product over the head's shape from ~14 to ~8.4 ms (2 threads, quiet; /tmp
   microbenchmark). L2: the avx512 levels' (rows_f32_batch_avx512) prefetch, PF_ROWS rows ahead
   into L2 rather than L1 (prefetcht1). A row's arithmetic does not depend on RR. */
INLINE void rows_tile_avx2(const int RR, const float *w0, const float *w1, const float *x, int K, float out[2][TR512],
                           const int L2) {
    __m256 a[TR512], b[TR512];
    _Pragma("GCC unroll 8") for (int r = 0; r < RR; r++) a[r] = b[r] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 u = _mm256_loadu_ps(w0 + k), v = _mm256_loadu_ps(w1 + k);
        if ((k & 15) == 0) {   /* the thread's next row pair, a line at a time (prefetches never fault) */
            if (L2) {
                _mm_prefetch((const char *)(w0 + PF_ROWS * (long)K + k), _MM_HINT_T1);
                _mm_prefetch((const char *)(w1 + PF_ROWS * (long)K + k), _MM_HINT_T1);
            } else {
                _mm_prefetch((const char *)(w0 + 2L * K + k), _MM_HINT_T0);
                _mm_prefetch((const char *)(w1 + 2L * K + k), _MM_HINT_T0);
            }
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < RR; r++) {
            __m256 xv = _mm256_loadu_ps(x + (long)r * K + k);
            __asm__("" : "+x"(xv));   /* one load for both weight rows (see cols_band_avx2) */
            a[r] = _mm256_fmadd_ps(u, xv, a[r]);
            b[r] = _mm256_fmadd_ps(v, xv, b[r]);
        }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < RR; r++) {
        tile_sums(a[r], b[r], w0, w1, x + (long)r * K, k, K, out[0] + r, out[1] + r);
    }
}

#define TILE_ROWS(X) X(1) X(2) X(3) X(4)
#endif

#if HAVE_AVX512
#define UNROLL _Pragma("GCC unroll 8")
/* rows_f32_batch at the avx512 levels: tiles of 2 weight rows x up to TR512 token rows (16
   accumulators of 8 lanes, which AVX-512's 32 registers hold with the weight and token vectors),
   the token rows in ceil(M / TR512) tiles as even as can be (9 rows: 5 + 4, where avx2 takes
   4 + 4 + 1), and the next rows prefetched PF_ROWS ahead into L2. The same arithmetic per row
   as avx2's tile, so avx2's bits. On a Zen 4 EPYC (one thread, 9 token rows, SmolLM2-135M's
   qkv and o projections over its 30 layers, weights from DRAM; /tmp microbenchmark, CPU time,
   a shared machine) ~4.0 and ~2.4 ms against avx2's ~6.1 and ~3.4 ms; most of it the prefetch
   into L2: into L1 (prefetcht0, two rows ahead) the same tiles took ~5.6 and ~3.1 ms. A tile
   of 16-lane vectors (then a reduction per output) was slower (~6.5 and ~3.9 ms): the Zen 4's
   FMA units are 256 bits wide and a 512-bit FMA takes both (~115 GFLOP/s a core either way).
   The down projection (K = 1536) goes by blocks of k: rows_blocked_avx512. */
#define TILE_ROWS512(X) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8)

/* rows_tile_avx2 over k in [k0, k1) (k0 a multiple of ROWS_KB), its 8-lane sums taken from and
   left in part (2 RR vectors) between the blocks: the same arithmetic, so the same bits. */
#define ROWS_KB 512      /* k a block (a multiple of 8) */
#define ROWS_L1X 6144    /* a tile's token rows (floats) past which they go by blocks */
#define ROWS_GROUP 32    /* weight row pairs a pass over the blocks */
INLINE void rows_part_avx2(const int RR, const float *w0, const float *w1, const float *x, int K, int k0, int k1,
                           float *part, float out[2][TR512]) {
    __m256 a[TR512], b[TR512];
    UNROLL for (int r = 0; r < RR; r++) {
        a[r] = k0 ? _mm256_loadu_ps(part + 16 * r) : _mm256_setzero_ps();
        b[r] = k0 ? _mm256_loadu_ps(part + 16 * r + 8) : _mm256_setzero_ps();
    }
    int k = k0;
    for (; k + 8 <= k1; k += 8) {
        const __m256 u = _mm256_loadu_ps(w0 + k), v = _mm256_loadu_ps(w1 + k);
        if ((k & 15) == 0) {
            _mm_prefetch((const char *)(w0 + PF_ROWS * (long)K + k), _MM_HINT_T1);
            _mm_prefetch((const char *)(w1 + PF_ROWS * (long)K + k), _MM_HINT_T1);
        }
        UNROLL for (int r = 0; r < RR; r++) {
            __m256 xv = _mm256_loadu_ps(x + (long)r * K + k);
            __asm__("" : "+x"(xv));
            a[r] = _mm256_fmadd_ps(u, xv, a[r]);
            b[r] = _mm256_fmadd_ps(v, xv, b[r]);
        }
    }
    if (k1 < K) {
        UNROLL for (int r = 0; r < RR; r++) {
            _mm256_storeu_ps(part + 16 * r, a[r]);
            _mm256_storeu_ps(part + 16 * r + 8, b[r]);
        }
        return;
    }
    UNROLL for (int r = 0; r < RR; r++) {
        tile_sums(a[r], b[r], w0, w1, x + (long)r * K, k, K, out[0] + r, out[1] + r);
    }
}

/* Where a tile's token rows outgrow L1 (over ROWS_L1X floats: the down projection's K = 1536
   from 5 rows, 30 KiB) the loop waited on L2 for them; so each thread takes its weight row pairs
   ROWS_GROUP at a time through blocks of k, a block of x staying in L1. SmolLM2-135M's down
   projection at 9 rows (as above): ~6.5 ms against ~10-11 unblocked; at 2 and 4 rows, where
   the rows fit, the blocks were slower (~6.0 and ~5.8 ms against ~4.3 and ~4.7), as for K = 576
   (~3.7 against ~2.5 ms for qkv at 4 rows). part: the thread's own, at least 16 ROWS_GROUP M
   floats. */
static void rows_blocked_avx512(const float *w, const float *x, int M, int N, int K, float *y, const float *bias,
                                float *part) {
    const int tiles = (M + TR512 - 1) / TR512, pairs = (N + 1) / 2, nt = omp_get_num_threads(),
              t = omp_get_thread_num();
    const int p0 = (int)((long)pairs * t / nt), p1 = (int)((long)pairs * (t + 1) / nt);
    for (int g0 = p0; g0 < p1; g0 += ROWS_GROUP) {
        const int g1 = p1 - g0 < ROWS_GROUP ? p1 : g0 + ROWS_GROUP;
        for (int k0 = 0; k0 < K; k0 += ROWS_KB) {
            const int k1 = K - k0 < ROWS_KB ? K : k0 + ROWS_KB;
            for (int np = g0; np < g1; np++) {
                const int n0 = 2 * np, n1 = n0 + 1 < N ? n0 + 1 : n0;
                for (int tt = 0, r0 = 0; tt < tiles; tt++) {
                    const int rr = (M - r0 + tiles - tt - 1) / (tiles - tt);
                    float out[2][TR512];
                    const float *xr = x + (long)r0 * K;
                    float *pt = part + ((long)(np - g0) * M + r0) * 16;
                    switch (rr) {
#define ROWS_CASE(RR) case RR: rows_part_avx2(RR, w + (long)n0 * K, w + (long)n1 * K, xr, K, k0, k1, pt, out); break;
                        TILE_ROWS512(ROWS_CASE)
#undef ROWS_CASE
                    }
                    if (k1 == K)
                        for (int r = 0; r < rr; r++) {
                            y[(long)(r0 + r) * N + n0] = out[0][r] + (bias ? bias[n0] : 0.0f);
                            y[(long)(r0 + r) * N + n1] = out[1][r] + (bias ? bias[n1] : 0.0f);
                        }
                    r0 += rr;
                }
            }
        }
    }
#pragma omp barrier
}

static void rows_f32_batch_avx512(const float *w, const float *x, int M, int N, int K, float *y, const float *bias,
                                  float *part) {
    const int tiles = (M + TR512 - 1) / TR512;
    if (K > ROWS_KB && (M + tiles - 1) / tiles * K > ROWS_L1X) {
        rows_blocked_avx512(w, x, M, N, K, y, bias, part);
        return;
    }
#pragma omp for schedule(static)
    for (int np = 0; np < (N + 1) / 2; np++) {
        const int n0 = 2 * np, n1 = n0 + 1 < N ? n0 + 1 : n0;
        for (int t = 0, r0 = 0; t < tiles; t++) {
            const int rr = (M - r0 + tiles - t - 1) / (tiles - t);
            float out[2][TR512];
            const float *xr = x + (long)r0 * K;
            switch (rr) {
#define ROWS_CASE(RR) case RR: rows_tile_avx2(RR, w + (long)n0 * K, w + (long)n1 * K, xr, K, out, 1); break;
                TILE_ROWS512(ROWS_CASE)
#undef ROWS_CASE
            }
            for (int r = 0; r < rr; r++) {
                y[(long)(r0 + r) * N + n0] = out[0][r] + (bias ? bias[n0] : 0.0f);
                y[(long)(r0 + r) * N + n1] = out[1][r] + (bias ? bias[n1] : 0.0f);
            }
            r0 += rr;
        }
    }
}
#endif

/* fp32 [N, K] weights times M token rows (one: row_exact's), weight rows two at a time. */
static void rows_f32_batch(const float *w, const float *x, int M, int N, int K, float *y, const float *bias,
                           float *part) {
    (void)part;
#if HAVE_AVX512
    if (g_isa >= ISA_AVX512) {
        rows_f32_batch_avx512(w, x, M, N, K, y, bias, part);
        return;
    }
#endif
#pragma omp for schedule(static)
    for (int np = 0; np < (N + 1) / 2; np++) {
        const int n0 = 2 * np, n1 = n0 + 1 < N ? n0 + 1 : n0;
        for (int r0 = 0; r0 < M; r0 += TR) {
            const int rr = M - r0 < TR ? M - r0 : TR;
            float out[2][TR512];
            const float *xr = x + (long)r0 * K;
#if HAVE_AVX2
            if (g_isa >= ISA_AVX2)
                switch (rr) {
#define ROWS_CASE(RR) case RR: rows_tile_avx2(RR, w + (long)n0 * K, w + (long)n1 * K, xr, K, out, 0); break;
                    TILE_ROWS(ROWS_CASE)
#undef ROWS_CASE
                }
            else
#endif
                rows_tile_ref(rr, w + (long)n0 * K, w + (long)n1 * K, xr, K, out);
            for (int r = 0; r < rr; r++) {
                y[(long)(r0 + r) * N + n0] = out[0][r] + (bias ? bias[n0] : 0.0f);
                y[(long)(r0 + r) * N + n1] = out[1][r] + (bias ? bias[n1] : 0.0f);
            }
        }
    }
}

#if HAVE_AVX2
#ifndef ONE_RW
#define ONE_RW 8   /* weight rows a pass of rows_one_avx2 */
#endif
/* One token row of fp32 [N, K] weights summed as rows_tile_avx2 sums each row (row_exact): one
   8-lane accumulator a weight row, then tile_sum's fused tail, so a row alone gets the bits it
   gets in a batch. ONE_RW weight rows a pass give the loop that many independent chains. A
   SmolLM2 step at 512 tokens, one thread, Zen 4: 4% slower than with dot_f32 (the tile's one row
   pair: 10%; without the prefetch 12%; 4 rows a pass 13%, 16 as 8; decode-speed-log §24). */
static void rows_one_avx2(const float *w, const float *x, int N, int K, float *y, const float *bias) {
#pragma omp for schedule(static)
    for (int g = 0; g < (N + ONE_RW - 1) / ONE_RW; g++) {
        const int n0 = g * ONE_RW, nr = N - n0 < ONE_RW ? N - n0 : ONE_RW;
        const float *wr[ONE_RW];
        __m256 acc[ONE_RW];
        _Pragma("GCC unroll 16") for (int j = 0; j < ONE_RW; j++) {
            wr[j] = w + (long)(n0 + (j < nr ? j : 0)) * K;
            acc[j] = _mm256_setzero_ps();
        }
        /* the next pass's rows (one contiguous block) into L2, a line per 8 k and row: as fast as this
           pass reads its own (into L1, 18-48 KB ahead: 8% slower than dot_f32, not 4%) */
        const char *next = (const char *)(w + (long)(n0 + ONE_RW) * K);
        int k = 0;
        for (; k + 8 <= K; k += 8) {
            _Pragma("GCC unroll 8") for (int j = 0; j < ONE_RW / 2; j++)
                _mm_prefetch(next + (long)k * 4 * ONE_RW + 64 * j, _MM_HINT_T1);
            const __m256 xv = _mm256_loadu_ps(x + k);
            _Pragma("GCC unroll 16") for (int j = 0; j < ONE_RW; j++)
                acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(wr[j] + k), xv, acc[j]);
        }
        for (int j = 0; j < nr; j++) y[n0 + j] = tile_sum(acc[j], wr[j], x, k, K) + (bias ? bias[n0 + j] : 0.0f);
    }
}
#endif

/* One band of input-major columns: y[r, c] += sum over k of x[r, k] w[k, c] for c in [0, cw), four
   weight rows per pass, two token rows at a time (each weight load feeds both). Every column's sum
   runs in the same order (per four k: x0 w0, then three fused multiply-adds, with zeros past K;
   then one add into y) in the vector lanes and in the scalar tail alike, so its bits do not
   depend on the band. The reference: plain multiply-adds, column by column. */
static void cols_band_ref(const float *w, long ldw, const float *x, int M, int K, float *y, long ldy, int cw) {
    for (int k0 = 0; k0 < K; k0 += 4) {
        const int kn = K - k0 < 4 ? K - k0 : 4;
        const float *w0 = w + (long)k0 * ldw, *w1 = w0 + (kn > 1 ? ldw : 0), *w2 = w0 + (kn > 2 ? 2 * ldw : 0),
                    *w3 = w0 + (kn > 3 ? 3 * ldw : 0);
        for (int r = 0; r < M; r++) {
            const float *xa = x + (long)r * K + k0;
            const float a0 = xa[0], a1 = kn > 1 ? xa[1] : 0.0f, a2 = kn > 2 ? xa[2] : 0.0f, a3 = kn > 3 ? xa[3] : 0.0f;
            float *ya = y + (long)r * ldy;
            for (int c = 0; c < cw; c++) ya[c] += a0 * w0[c] + a1 * w1[c] + a2 * w2[c] + a3 * w3[c];
        }
    }
}

#if HAVE_AVX2
/* The partial sums of one token row over one quad of k, 8 columns (weights u0..u3): x0 w0, then
   three FMAs. */
#define QUAD_REG(V) _mm256_fmadd_ps(V##3, u3, _mm256_fmadd_ps(V##2, u2, _mm256_fmadd_ps(V##1, u1, _mm256_mul_ps(V##0, u0))))
/* the same for one column, in the scalar tail */
#define QUAD_F(X, C) fmaf(X##3, w3[C], fmaf(X##2, w2[C], fmaf(X##1, w1[C], X##0 * w0[C])))

static void cols_band_avx2(const float *w, long ldw, const float *x, int M, int K, float *y, long ldy, int cw) {
    for (int k0 = 0; k0 < K; k0 += 4) {
        const int kn = K - k0 < 4 ? K - k0 : 4;
        const float *restrict w0 = w + (long)k0 * ldw, *restrict w1 = w0 + (kn > 1 ? ldw : 0),
                    *restrict w2 = w0 + (kn > 2 ? 2 * ldw : 0), *restrict w3 = w0 + (kn > 3 ? 3 * ldw : 0);
        for (int r = 0; r < M; r += 2) {
            const int two = r + 1 < M;
            const float *xa = x + (long)r * K + k0, *xb = xa + (two ? K : 0);
            const float a0 = xa[0], a1 = kn > 1 ? xa[1] : 0.0f, a2 = kn > 2 ? xa[2] : 0.0f, a3 = kn > 3 ? xa[3] : 0.0f;
            const float b0 = xb[0], b1 = kn > 1 ? xb[1] : 0.0f, b2 = kn > 2 ? xb[2] : 0.0f, b3 = kn > 3 ? xb[3] : 0.0f;
            float *ya = y + (long)r * ldy, *yb = ya + ldy;
            int c = 0;
            const __m256 va0 = _mm256_set1_ps(a0), va1 = _mm256_set1_ps(a1), va2 = _mm256_set1_ps(a2), va3 = _mm256_set1_ps(a3);
            const __m256 vb0 = _mm256_set1_ps(b0), vb1 = _mm256_set1_ps(b1), vb2 = _mm256_set1_ps(b2), vb3 = _mm256_set1_ps(b3);
            /* the band's weight rows two quads on, a line at a time, while these stream: a band is a
               piece of each row, so the hardware prefetcher starts over at every row */
#define PREFETCH_AHEAD(C) if (r == 0 && ((C) & 15) == 0) {                                                   \
                _mm_prefetch((const char *)(w0 + 8 * ldw + (C)), _MM_HINT_T0);                          \
                _mm_prefetch((const char *)(w0 + 9 * ldw + (C)), _MM_HINT_T0);                          \
                _mm_prefetch((const char *)(w0 + 10 * ldw + (C)), _MM_HINT_T0);                          \
                _mm_prefetch((const char *)(w0 + 11 * ldw + (C)), _MM_HINT_T0);                          \
            }
#define LOAD_QUAD(C) __m256 u0 = _mm256_loadu_ps(w0 + (C)), u1 = _mm256_loadu_ps(w1 + (C)), \
                           u2 = _mm256_loadu_ps(w2 + (C)), u3 = _mm256_loadu_ps(w3 + (C));
            if (two)
                for (; c + 8 <= cw; c += 8) {
                    PREFETCH_AHEAD(c)
                    LOAD_QUAD(c)
                    /* the four weight vectors once, in registers, for both rows: gcc folds them into each
                       row's multiply-adds otherwise, loading them twice, and the loop was bound by its
                       loads (a batch-8 fp32 step ~4% faster; the same arithmetic) */
                    __asm__("" : "+x"(u0), "+x"(u1), "+x"(u2), "+x"(u3));
                    _mm256_storeu_ps(ya + c, _mm256_add_ps(_mm256_loadu_ps(ya + c), QUAD_REG(va)));
                    _mm256_storeu_ps(yb + c, _mm256_add_ps(_mm256_loadu_ps(yb + c), QUAD_REG(vb)));
                }
            else
                for (; c + 8 <= cw; c += 8) {
                    PREFETCH_AHEAD(c)
                    LOAD_QUAD(c)
                    _mm256_storeu_ps(ya + c, _mm256_add_ps(_mm256_loadu_ps(ya + c), QUAD_REG(va)));
                }
#undef LOAD_QUAD
#undef PREFETCH_AHEAD
            for (; c < cw; c++) {
                ya[c] += QUAD_F(a, c);
                if (two) yb[c] += QUAD_F(b, c);
            }
        }
    }
}
/* One token row (M = 1, the decode step's) over a band of input-major columns, summed straight
   into y: cols_band_avx2's arithmetic lane for lane (so the same bits), whole rows per thread and
   no software prefetch: whole rows stream well enough for the hardware prefetcher.
     W512 (the avx512 levels): 16 columns per vector, each load a whole line; on the Zen 5 EPYC
       the head and the gate|up projection went from ~29 to ~38 GB/s (one thread, /tmp
       microbenchmark).
     else (avx2, avxvnni): two 8-column vectors (a line) of each weight row per pass; a whole
       fp32 decode step at the avx2 level ran 1.08x (1 thread) and 1.10x (2) faster than with
       the prefetching band loop (Zen 5, three alternated runs each). */
INLINE void cols_row(const int W512, const float *w, long ldw, const float *x, int K, float *y, int cw) {
    for (int k0 = 0; k0 < K; k0 += 4) {
        const int kn = K - k0 < 4 ? K - k0 : 4;
        const float *restrict w0 = w + (long)k0 * ldw, *restrict w1 = w0 + (kn > 1 ? ldw : 0),
                    *restrict w2 = w0 + (kn > 2 ? 2 * ldw : 0), *restrict w3 = w0 + (kn > 3 ? 3 * ldw : 0);
        const float a0 = x[k0], a1 = kn > 1 ? x[k0 + 1] : 0.0f, a2 = kn > 2 ? x[k0 + 2] : 0.0f, a3 = kn > 3 ? x[k0 + 3] : 0.0f;
        const __m256 va0 = _mm256_set1_ps(a0), va1 = _mm256_set1_ps(a1), va2 = _mm256_set1_ps(a2), va3 = _mm256_set1_ps(a3);
        int c = 0;
#if HAVE_AVX512
        if (W512) {
            const __m512 wa0 = _mm512_set1_ps(a0), wa1 = _mm512_set1_ps(a1), wa2 = _mm512_set1_ps(a2), wa3 = _mm512_set1_ps(a3);
            for (; c + 16 <= cw; c += 16) {
                const __m512 q = _mm512_fmadd_ps(wa3, _mm512_loadu_ps(w3 + c),
                                 _mm512_fmadd_ps(wa2, _mm512_loadu_ps(w2 + c),
                                 _mm512_fmadd_ps(wa1, _mm512_loadu_ps(w1 + c), _mm512_mul_ps(wa0, _mm512_loadu_ps(w0 + c)))));
                _mm512_storeu_ps(y + c, _mm512_add_ps(_mm512_loadu_ps(y + c), q));
            }
        }
#endif
        for (; !W512 && c + 16 <= cw; c += 16) {
            __m256 u0 = _mm256_loadu_ps(w0 + c), u1 = _mm256_loadu_ps(w1 + c), u2 = _mm256_loadu_ps(w2 + c),
                   u3 = _mm256_loadu_ps(w3 + c);
            const __m256 q0 = QUAD_REG(va);
            u0 = _mm256_loadu_ps(w0 + c + 8), u1 = _mm256_loadu_ps(w1 + c + 8), u2 = _mm256_loadu_ps(w2 + c + 8),
            u3 = _mm256_loadu_ps(w3 + c + 8);
            const __m256 q1 = QUAD_REG(va);
            _mm256_storeu_ps(y + c, _mm256_add_ps(_mm256_loadu_ps(y + c), q0));
            _mm256_storeu_ps(y + c + 8, _mm256_add_ps(_mm256_loadu_ps(y + c + 8), q1));
        }
        for (; c + 8 <= cw; c += 8) {
            const __m256 u0 = _mm256_loadu_ps(w0 + c), u1 = _mm256_loadu_ps(w1 + c), u2 = _mm256_loadu_ps(w2 + c),
                         u3 = _mm256_loadu_ps(w3 + c);
            _mm256_storeu_ps(y + c, _mm256_add_ps(_mm256_loadu_ps(y + c), QUAD_REG(va)));
        }
        for (; c < cw; c++) y[c] += QUAD_F(a, c);
    }
}
#undef QUAD_REG
#undef QUAD_F
#endif

#if HAVE_AVX512
/* Several token rows at the avx512 levels: register tiles of RR token rows x CV vectors of 16
   columns, each column's sum held in registers over a block of COLS_KB k (cols_band_avx2 adds
   every quad's partial sum into memory: at 9 rows that loop was bound by its traffic with L2),
   then stored in y and taken up again for the next block. A column's arithmetic is
   cols_band_avx2's lane for lane (per four k: x0 w0, then three fused multiply-adds, with zeros
   past K, then one add into a sum started at zero; then the bias, or zero), so the same bits at
   every level above the scalar and for a row alone or in a batch. The last vector takes the
   columns left (mask). A thread walks COLS_CB columns (whole lines of each weight row) through
   every block of k; the first row tile prefetches the next block (of k, or after the last one
   the next columns' first), half a row (COLS_CB / 2 columns) a quad, into L2: the hardware
   prefetcher does not follow a tile's lines, which lie a whole weight row apart, and prefetches
   into L1 (prefetcht0) fill its miss buffers while the loop computes (the loads then wait: with
   them w13 took ~30 ms below). On a Zen 4 EPYC (one thread, 9 token rows, SmolLM2-135M's
   gate|up over its 30 layers and its head, weights from DRAM; /tmp microbenchmark, CPU time, a
   shared machine) ~14.8 and ~9.5 ms against avx2's band loop's ~23.5 and ~12.5 ms; blocks of 32
   or 128 k, 512 columns, or tiles of 6 x 2, 4 x 3 or 8 x 1 vectors were no faster. */
#define COLS_KB 64   /* k a block (a multiple of 4) */
#define COLS_CB 256  /* columns a pass over the blocks: 8 tiles of 16 COLS_CV (the prefetch's walk) */
#define COLS_RT 8    /* token rows a tile */
#define COLS_CV 2    /* column vectors a tile */
INLINE void cols_tile_avx512(const int RR, const int CV, const float *w, long ldw, const float *xt, int k0, int k1,
                             int K, float *y, long ldy, const float *bias, __mmask16 last, const float *pf,
                             int pfq) {
    __m512 acc[COLS_RT][COLS_CV];
    UNROLL for (int r = 0; r < RR; r++)
        UNROLL for (int j = 0; j < CV; j++) {
            const __mmask16 m = j == CV - 1 ? last : 0xffff;
            acc[r][j] = k0 ? _mm512_maskz_loadu_ps(m, y + (long)r * ldy + 16 * j) : _mm512_setzero_ps();
        }
    const float *restrict w0 = w + (long)k0 * ldw;
    for (int k = k0; k < k1; k += 4, w0 += 4 * ldw, xt += 4 * RR) {
        const int kn = k1 - k;   /* past K (the last quad): zeros in xt, and the rows of w0 again */
        const float *w1 = w0 + (kn > 1 ? ldw : 0), *w2 = w0 + (kn > 2 ? 2 * ldw : 0), *w3 = w0 + (kn > 3 ? 3 * ldw : 0);
        if (pf) {   /* half a row of the next block a quad, in memory order */
            const int h = pfq + (k - k0) / 4;
            const float *p = pf + (long)(h >> 1) * ldw + (h & 1) * (COLS_CB / 2);
            UNROLL for (int i = 0; i < COLS_CB / 32; i++) _mm_prefetch((const char *)(p + 16 * i), _MM_HINT_T1);
        }
        UNROLL for (int j = 0; j < CV; j++) {
            const __mmask16 m = j == CV - 1 ? last : 0xffff;
            const __m512 u0 = _mm512_maskz_loadu_ps(m, w0 + 16 * j), u1 = _mm512_maskz_loadu_ps(m, w1 + 16 * j),
                         u2 = _mm512_maskz_loadu_ps(m, w2 + 16 * j), u3 = _mm512_maskz_loadu_ps(m, w3 + 16 * j);
            UNROLL for (int r = 0; r < RR; r++) {
                const __m512 q = _mm512_fmadd_ps(_mm512_set1_ps(xt[3 * RR + r]), u3,
                                 _mm512_fmadd_ps(_mm512_set1_ps(xt[2 * RR + r]), u2,
                                 _mm512_fmadd_ps(_mm512_set1_ps(xt[RR + r]), u1, _mm512_mul_ps(_mm512_set1_ps(xt[r]), u0))));
                acc[r][j] = _mm512_add_ps(acc[r][j], q);
            }
        }
    }
    UNROLL for (int j = 0; j < CV; j++) {
        const __mmask16 m = j == CV - 1 ? last : 0xffff;
        const __m512 bv = k1 == K && bias ? _mm512_maskz_loadu_ps(m, bias + 16 * j) : _mm512_setzero_ps();
        UNROLL for (int r = 0; r < RR; r++)
            _mm512_mask_storeu_ps(y + (long)r * ldy + 16 * j, m, k1 < K ? acc[r][j] : _mm512_add_ps(acc[r][j], bv));
    }
}

#define TILE_COLS_ROWS(X) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8)

/* cols_f32_batch at the avx512 levels (M >= 2): COLS_CB columns at a time split between the
   threads, straight into y; the token rows in ceil(M / COLS_RT) tiles as even as can be, each
   tile's part of a block of x copied k-major (xt: its rr values of each k together, zeros past K
   to the quad), so that a quad's broadcasts come from one pointer. xt: the thread's own, at
   least M COLS_KB floats. */
static void cols_f32_batch_avx512(const float *w, const float *x, int M, int N, int K, float *y, const float *bias,
                                  float *xt) {
    const int tw = 16 * COLS_CV, blocks = (N + COLS_CB - 1) / COLS_CB, rtiles = (M + COLS_RT - 1) / COLS_RT;
#pragma omp for schedule(static)
    for (int b = 0; b < blocks; b++) {
        const int cb0 = b * COLS_CB, cb1 = N - cb0 < COLS_CB ? N : cb0 + COLS_CB;
        for (int k0 = 0; k0 < K; k0 += COLS_KB) {
            const int k1 = K - k0 < COLS_KB ? K : k0 + COLS_KB, kq = (k1 - k0 + 3) / 4 * 4;
            for (int rt = 0, r0 = 0; rt < rtiles; rt++) {   /* the tiles' parts of x, k-major */
                const int rr = (M - r0 + rtiles - rt - 1) / (rtiles - rt);
                float *t = xt + (long)r0 * kq;
                for (int k = 0; k < kq; k++)
                    for (int r = 0; r < rr; r++) t[k * rr + r] = k0 + k < K ? x[(long)(r0 + r) * K + k0 + k] : 0.0f;
                r0 += rr;
            }
            for (int c0 = cb0; c0 < cb1; c0 += tw) {
                const int cw = cb1 - c0 < tw ? cb1 - c0 : tw, cv = (cw + 15) / 16;
                const __mmask16 last = (__mmask16)(cw % 16 ? (1u << (cw % 16)) - 1 : 0xffff);
                const float *bb = bias ? bias + c0 : NULL;
                /* the next block, a row at a time (its rows pfq / 2 on in this tile): that of k, else
                   the next columns' first (past the weights: prefetches never fault) */
                const float *pf = k1 < K ? w + (long)k1 * N + cb0 : w + cb0 + COLS_CB;
                const int pfq = (c0 - cb0) / tw * (COLS_KB / 4);
                for (int rt = 0, r0 = 0; rt < rtiles; rt++) {
                    const int rr = (M - r0 + rtiles - rt - 1) / (rtiles - rt);
                    const float *t = xt + (long)r0 * kq, *p = rt == 0 ? pf : NULL;
                    float *yr = y + (long)r0 * N + c0;
                    if (cv == COLS_CV)
                        switch (rr) {
#define COLS_CASE(RR) case RR: cols_tile_avx512(RR, COLS_CV, w + c0, N, t, k0, k1, K, yr, N, bb, last, p, pfq); break;
                            TILE_COLS_ROWS(COLS_CASE)
#undef COLS_CASE
                        }
                    else
                        switch (rr) {
#define COLS_CASE(RR) case RR: cols_tile_avx512(RR, 1, w + c0, N, t, k0, k1, K, yr, N, bb, last, p, pfq); break;
                            TILE_COLS_ROWS(COLS_CASE)
#undef COLS_CASE
                        }
                    r0 += rr;
                }
            }
        }
    }
}
#endif

/* fp32 [K, N] (input-major) weights times M token rows. Each thread takes bands of whole columns
   and sums them over every k, streaming the band's part of each weight row (at most COLS_CHUNK
   columns), into its own [M, band] sums (L1/L2-resident, rows a band apart; summing in y itself,
   whose rows lie a vocabulary apart, took a batch-8 step from 39 to 55 ms), then copies them
   out. A column's sum never depends on the thread count; splitting k between the threads, as
   before, moved fp32 models' logits by ~4e-5 when ThreadChoice changed the count. cols: shared
   [threads, M, COLS_CHUNK] (at the avx512 levels each thread's part holds its k-major copies of
   x: cols_f32_batch_avx512). */
static void cols_f32_batch(const float *w, const float *x, int M, int N, int K, float *y, const float *bias,
                           float *cols) {
    const int nt = omp_get_num_threads();
#if HAVE_AVX2
    if (M == 1 && g_isa >= ISA_AVX2) {   /* one band per thread, its sums in y itself (one row) */
        const int cw = ((N + nt - 1) / nt + 15) / 16 * 16, bands = (N + cw - 1) / cw;
#pragma omp for schedule(static)
        for (int b = 0; b < bands; b++) {
            const int c0 = b * cw, w_ = N - c0 < cw ? N - c0 : cw;
            memset(y + c0, 0, sizeof(float) * (size_t)w_);
            if (g_isa >= ISA_AVX512) cols_row(1, w + c0, N, x, K, y + c0, w_);
            else cols_row(0, w + c0, N, x, K, y + c0, w_);
            for (int c = 0; c < w_; c++) y[c0 + c] += bias ? bias[c0 + c] : 0.0f;
        }
        return;
    }
#endif
#if HAVE_AVX512
    if (g_isa >= ISA_AVX512) {   /* M >= 2 */
        cols_f32_batch_avx512(w, x, M, N, K, y, bias, cols + (size_t)omp_get_thread_num() * M * COLS_CHUNK);
        return;
    }
#endif
    float *mine = cols + (size_t)omp_get_thread_num() * M * COLS_CHUNK;
    int cw = ((N + nt - 1) / nt + 15) / 16 * 16;    /* whole cache lines of a row of y */
    if (cw > COLS_CHUNK) cw = COLS_CHUNK;
    const int bands = (N + cw - 1) / cw;
#pragma omp for schedule(static)
    for (int b = 0; b < bands; b++) {
        const int c0 = b * cw, w_ = N - c0 < cw ? N - c0 : cw;
        memset(mine, 0, sizeof(float) * (size_t)M * w_);
#if HAVE_AVX2
        if (g_isa >= ISA_AVX2) cols_band_avx2(w + c0, N, x, M, K, mine, w_, w_);
        else
#endif
            cols_band_ref(w + c0, N, x, M, K, mine, w_, w_);
        for (int r = 0; r < M; r++)
            for (int c = 0; c < w_; c++) y[(long)r * N + c0 + c] = mine[(long)r * w_ + c] + (bias ? bias[c0 + c] : 0.0f);
    }
}

/* y [M, N] = x [M, K] W^T (+ bias), x private to the calling thread (every thread holds the same
   values), y shared. Called by every thread of the region; ends with a barrier. cols: shared
   [threads, M, COLS_CHUNK] sums for input-major weights. */
HIDDEN void linear(const Lin *L, const float *x, int M, float *y, int row_exact, const Act *a, float *cols) {
    const int N = (int)L->N, K = (int)L->K;
    if (L->fmt == F32_COLS) {
        cols_f32_batch((const float *)L->w, x, M, N, K, y, L->bias, cols);
        return;
    }
#if HAVE_AVX2
    if (L->fmt == F32_ROWS && M == 1 && row_exact && g_isa >= ISA_AVX2) {
        rows_one_avx2((const float *)L->w, x, N, K, y, L->bias);
        return;
    }
#endif
    if (L->fmt == F32_ROWS && (M > 1 || row_exact)) {
        rows_f32_batch((const float *)L->w, x, M, N, K, y, L->bias, cols + (size_t)omp_get_thread_num() * M * COLS_CHUNK);
        return;
    }
    if (L->fmt == F32_ROWS) {
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++) y[n] = dot_f32((const float *)L->w + (long)n * K, x, K) + (L->bias ? L->bias[n] : 0.0f);
        return;
    }
    prepare_activations((int)L->fmt, x, M, K, a->xq, a->xd, a->xs);
    /* guided: large contiguous chunks first (half the rows, then a quarter, ...), then smaller ones
       to whichever thread is free, so a thread slowed by the shared VM does not hold the other at
       each of a step's ~120 barriers (native steps 5-14% faster than static, alternated; dynamic
       chunks of 8 or 32 rows were 20-35% slower). A row's sum is the same on any thread. */
#pragma omp for schedule(guided)
    for (int c = 0; c < row_chunks(N); c++)
        quant_rows((int)L->fmt, L->w, L->d, L->m, c, N, K, x, a->xq, a->xd, a->xs, M, y, L->bias);
}

/* One projection of M rows of x, for tests: the products at the library's level (linear's fp32
   layouts have references too: CARAMBA_ISA=scalar, caramba.model.isa.use_isa). Each thread has
   its own activation codes, as in the step (the wide X16 formats rewrite theirs in place: shared,
   one thread's could be rewritten twice). Returns 1 when scratch could not be allocated. */
int step_linear(const Lin *L, const float *x, int M, float *y, int row_exact, int nthreads) {
    const size_t K = (size_t)L->K, codes = 4 * (size_t)M * K + 4, sums = (size_t)M * (K / QK + 1);
    float *cols = malloc(sizeof(float) * ((size_t)nthreads * M * COLS_CHUNK + 2 * (size_t)nthreads * sums));
    int8_t *xq = malloc(codes * (size_t)nthreads);
    int failed = !cols || !xq;
    if (!failed) {
#pragma omp parallel num_threads(nthreads)
        {
            const size_t t = (size_t)omp_get_thread_num();
            float *mine = cols + (size_t)nthreads * M * COLS_CHUNK + 2 * t * sums;
            const Act a = {xq + t * codes, mine, mine + sums};
            linear(L, x, M, y, row_exact, &a, cols);
        }
    }
    free(cols);
    free(xq);
    return failed;
}
