/* A whole decode step of a Llama-family model in one C call (caramba.model.fast_decode).

   At batch 1 a decode step is ~30 layers x ~10 small ops. Through torch each op costs 5-30 us of
   dispatch, allocation and Python around ~1 us of arithmetic, which added ~8 ms to a ~10 ms step
   of weight reads (docs/decode-speed.md). Here the step runs as llama.cpp's does: one parallel
   region whose threads split each projection's output rows and the attention's cache slots.

   Per layer, for M token rows: T new tokens for each of M / T cache rows (T = 1: a decode step;
   T > 1: a speculative verify or a short chunk, where new token t of a cache row attends the
   row's cached slots and its new tokens 0..t):
     h = rms_norm(x); q|k|v = h W_qkv^T (+b); rope(q, k) at each row's position;
     K, V cache rows [r, g, slot + t] = k, v (as the cache stores them: kv_stream.c);
     a = softmax(q K^T / sqrt(D)) V over slots [0, slot + t];
     x += a W_o^T (+b); h = rms_norm(x); x += (silu(g) * u) W_2^T where g|u = h W_13^T.
   Then logits = rms_norm(x) W_head^T. An optional mask over the slots (padding, a sliding
   window) leaves slots out of the softmax. The arithmetic follows the torch path (fp32, RoPE in
   the half-rotation layout, GQA head h reading KV head h / (H / KVH)); only summation orders
   differ.

   Barriers are what a busy 2-core machine makes expensive (a thread waiting at one for a
   descheduled peer waits a scheduler slice), so there are five per layer: after each projection
   (its output rows come from every thread) and after the attention's per-thread partials. The
   small vector work between them (norms, residual adds, RoPE, SwiGLU's gate, quantizing the
   activations) every thread does itself on private copies: ~1 us of arithmetic, where a
   barrier and a hand-off cost more.

   The attention cuts the cache slots into parts of ATT_PART slots, and each thread takes a run of
   whole parts: for every head it scores its slots in one pass, then gives each part's softmax
   statistics (max, sum) and unnormalized p V; the partials are combined exactly (flash-decoding),
   part by part in order. The parts, not the threads, fix the arithmetic. The step may run on one
   thread or two from one step to the next (fast_decode.ThreadChoice), and with activations rounded
   to q8 a summation-order difference can cross a rounding boundary and move a logit by ~1 (0.74
   measured on SmolLM2 q8_0 when the partials followed the threads). Every product splits its
   outputs between the threads (rows, or bands of an input-major weight's columns), never a sum,
   so a step's bits do not depend on the thread count.
   The new tokens' own K and V are read from the projection's output (as the cache will read them
   back), not the cache, so no thread waits for the cache write.

   Caches (kv_stream.c): each stream is read from its codes below r0 and in full precision above
   (fp32 values, or the ring of a residual window / incomplete per-channel group), keys-major
   codes block by block with the slots in the inner loop, values slot by slot. Rotated streams
   (rotate_keys / rotate_values) hold k R and v R: q is rotated by the key matrix before q.k and
   the attention output multiplied by the value matrix, as caramba.cache.layer does. The new
   token's codes are written after the attention (nobody reads them before the next step), except
   a per-channel key group the token completes: it is quantized into the cache first (one more
   barrier, every G steps), since the torch path reads that group from its codes at once.

   Projections come in the layouts the model holds (no copies): fp32 [N, K] (nn.Linear), fp32
   [K, N] (InputMajorLinear) and the block formats of quant_gemv.c. */

#include "quant_gemv.c"
#include "decode_ops.c"

#include <omp.h>

enum { F32_ROWS = 0, F32_COLS = 1 };   /* and quant_gemv.c's block formats, 2..8 */

/* A projection as the plan lays it out: 7 int64 slots. */
typedef struct {
    int64_t fmt, N, K;
    const void *w;       /* fp32 weights, or the codes */
    const uint16_t *d;   /* block scales (fp16) */
    const uint16_t *m;   /* block minimums (q4_1) */
    const float *bias;   /* or NULL */
} Lin;

/* Per layer: attn_norm, mlp_norm, wqkv, wo, w13, w2 (int64 slots). */
enum { L_ATTN_NORM = 0, L_MLP_NORM = 1, L_QKV = 2, L_O = 9, L_13 = 16, L_2 = 23, L_SLOTS = 30 };

#define ATT_PART 64         /* cache slots per attention part (a split that does not follow the threads) */
#define COLS_CHUNK 4096     /* input-major products: a thread's band of columns, its [rows, band] sums L1/L2-resident */

static inline Lin lin_at(const int64_t *p) {
    Lin L = {p[0], p[1], p[2], (const void *)p[3], (const uint16_t *)p[4], (const uint16_t *)p[5],
             (const float *)p[6]};
    return L;
}

/* A thread's own activations in the formats the integer dot products take. */
typedef struct {
    int8_t *xq;          /* q8 codes, or int16 codes (2 bytes each) */
    float *xd, *xs;
} Act;

/* Several token rows (a batch) make the fp32 products compute-bound rather than read-bound, so
   they go through register tiles: each weight element loaded once feeds up to TR rows' sums held
   in registers (8 accumulators: 2 weight rows x 4 token rows, or 16 columns x 4 token rows). */
#define TR 4

#if HAVE_AVX2
/* y[r, n0 .. n0 + 1] for token rows [r0, r0 + RR) of [N, K] weights: rows n0 and n1 (n1 == n0
   when N is odd at the end). With several token rows the loop computes long enough per byte that
   the hardware prefetcher falls behind: prefetching the next pair two rows ahead took a batch-8
   product over the head's shape from ~14 to ~8.4 ms (2 threads, quiet; /tmp microbenchmark). */
INLINE void rows_tile(const int RR, const float *w0, const float *w1, const float *x, int K, float out[2][TR]) {
    __m256 a[TR], b[TR];
    for (int r = 0; r < RR; r++) a[r] = b[r] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 u = _mm256_loadu_ps(w0 + k), v = _mm256_loadu_ps(w1 + k);
        if ((k & 15) == 0) {   /* the thread's next row pair, a line at a time (prefetches never fault) */
            _mm_prefetch((const char *)(w0 + 2L * K + k), _MM_HINT_T0);
            _mm_prefetch((const char *)(w1 + 2L * K + k), _MM_HINT_T0);
        }
        for (int r = 0; r < RR; r++) {
            __m256 xv = _mm256_loadu_ps(x + (long)r * K + k);
            __asm__("" : "+x"(xv));   /* one load for both weight rows (see cols_band) */
            a[r] = _mm256_fmadd_ps(u, xv, a[r]);
            b[r] = _mm256_fmadd_ps(v, xv, b[r]);
        }
    }
    for (int r = 0; r < RR; r++) {
        float s0 = hsum8(a[r]), s1 = hsum8(b[r]);
        for (int kk = k; kk < K; kk++) {
            s0 += w0[kk] * x[(long)r * K + kk];
            s1 += w1[kk] * x[(long)r * K + kk];
        }
        out[0][r] = s0;
        out[1][r] = s1;
    }
}

#define TILE_ROWS(X) X(1) X(2) X(3) X(4)
#endif

/* fp32 [N, K] weights times M >= 2 token rows. */
static void rows_f32_batch(const float *w, const float *x, int M, int N, int K, float *y, const float *bias) {
#pragma omp for schedule(static)
    for (int np = 0; np < (N + 1) / 2; np++) {
        const int n0 = 2 * np, n1 = n0 + 1 < N ? n0 + 1 : n0;
        for (int r0 = 0; r0 < M; r0 += TR) {
            const int rr = M - r0 < TR ? M - r0 : TR;
#if HAVE_AVX2
            float out[2][TR];
            const float *xr = x + (long)r0 * K;
            switch (rr) {
#define ROWS_CASE(RR) case RR: rows_tile(RR, w + (long)n0 * K, w + (long)n1 * K, xr, K, out); break;
                TILE_ROWS(ROWS_CASE)
            }
            for (int r = 0; r < rr; r++) {
                y[(long)(r0 + r) * N + n0] = out[0][r] + (bias ? bias[n0] : 0.0f);
                y[(long)(r0 + r) * N + n1] = out[1][r] + (bias ? bias[n1] : 0.0f);
            }
#else
            for (int r = r0; r < r0 + rr; r++) {
                y[(long)r * N + n0] = dot_f32(w + (long)n0 * K, x + (long)r * K, K) + (bias ? bias[n0] : 0.0f);
                y[(long)r * N + n1] = dot_f32(w + (long)n1 * K, x + (long)r * K, K) + (bias ? bias[n1] : 0.0f);
            }
#endif
        }
    }
}

/* One band of input-major columns: y[r, c] += sum over k of x[r, k] w[k, c] for c in [0, cw), four
   weight rows per pass, two token rows at a time (each weight load feeds both). Every column's sum
   runs in the same order (per four k: x0 w0, then three fused multiply-adds, with zeros past K;
   then one add into y) in the vector lanes and in the scalar tail alike, so its bits do not
   depend on the band. */
#if HAVE_AVX2
/* The partial sums of one token row over one quad of k, 8 columns (weights u0..u3): x0 w0, then
   three FMAs. */
#define QUAD_REG(V) _mm256_fmadd_ps(V##3, u3, _mm256_fmadd_ps(V##2, u2, _mm256_fmadd_ps(V##1, u1, _mm256_mul_ps(V##0, u0))))
/* the same for one column, in the scalar tail */
#define QUAD_F(X, C) fmaf(X##3, w3[C], fmaf(X##2, w2[C], fmaf(X##1, w1[C], X##0 * w0[C])))
#endif

static void cols_band(const float *w, long ldw, const float *x, int M, int K, float *y, long ldy, int cw) {
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
#if HAVE_AVX2
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
#else
            for (; c < cw; c++) {
                ya[c] += a0 * w0[c] + a1 * w1[c] + a2 * w2[c] + a3 * w3[c];
                if (two) yb[c] += b0 * w0[c] + b1 * w1[c] + b2 * w2[c] + b3 * w3[c];
            }
#endif
        }
    }
}
#if HAVE_AVX2
#undef QUAD_REG
#undef QUAD_F
#endif

/* fp32 [K, N] (input-major) weights times M token rows. Each thread takes bands of whole columns
   and sums them over every k, streaming the band's part of each weight row (at most COLS_CHUNK
   columns), into its own [M, band] sums (L1/L2-resident, rows a band apart; summing in y itself,
   whose rows lie a vocabulary apart, took a batch-8 step from 39 to 55 ms), then copies them
   out. A column's sum never depends on the thread count; splitting k between the threads, as
   before, moved fp32 models' logits by ~4e-5 when ThreadChoice changed the count. cols: shared
   [threads, M, COLS_CHUNK]. */
static void cols_f32_batch(const float *w, const float *x, int M, int N, int K, float *y, const float *bias,
                           float *cols) {
    const int nt = omp_get_num_threads();
    float *mine = cols + (size_t)omp_get_thread_num() * M * COLS_CHUNK;
    int cw = ((N + nt - 1) / nt + 15) / 16 * 16;    /* whole cache lines of a row of y */
    if (cw > COLS_CHUNK) cw = COLS_CHUNK;
    const int bands = (N + cw - 1) / cw;
#pragma omp for schedule(static)
    for (int b = 0; b < bands; b++) {
        const int c0 = b * cw, w_ = N - c0 < cw ? N - c0 : cw;
        memset(mine, 0, sizeof(float) * (size_t)M * w_);
        cols_band(w + c0, N, x, M, K, mine, w_, w_);
        for (int r = 0; r < M; r++)
            for (int c = 0; c < w_; c++) y[(long)r * N + c0 + c] = mine[(long)r * w_ + c] + (bias ? bias[c0 + c] : 0.0f);
    }
}

/* y [M, N] = x [M, K] W^T (+ bias), x private to the calling thread (every thread holds the same
   values), y shared. Called by every thread of the region; ends with a barrier. cols: shared
   [threads, M, COLS_CHUNK] sums for input-major weights. */
static void linear(const Lin *L, const float *x, int M, float *y, Act *a, float *cols) {
    const int N = (int)L->N, K = (int)L->K;
    if (L->fmt == F32_COLS) {
        cols_f32_batch((const float *)L->w, x, M, N, K, y, L->bias, cols);
        return;
    }
    if (L->fmt == F32_ROWS && M > 1) {
        rows_f32_batch((const float *)L->w, x, M, N, K, y, L->bias);
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

/* x*cos + roll(x, D/2)*ssin for one head (ssin: sin with its first half negated, RotaryTable's). */
static inline void rope_head(const float *v, float *out, const float *cos, const float *ssin, int D) {
    const int h = D / 2;
    for (int i = 0; i < h; i++) out[i] = v[i] * cos[i] + v[i + h] * ssin[i];
    for (int i = h; i < D; i++) out[i] = v[i] * cos[i] + v[i - h] * ssin[i];
}

#include "kv_stream.c"

#define VCHUNK 16    /* value rows decoded per pass of every head over them */

/* o [D] += sum over the chunk's slots k of e[k] v_k, v_k a decoded row of codes (coded[k]: per
   block scale pp[k][b], a zero point's minimum in bsum) or an fp32 row; rows[k] NULL: skipped.
   Slot by slot in order, each block's product fused as o += (e s) code: the arithmetic of a
   slot-at-a-time loop, with o in registers 64 floats at a time where the blocks allow it. */
static void value_chunk(float *restrict o, const float *const *rows, const int *coded, const float *ppb, int vnb,
                        int vnp, int vqb, int vzp, const float *e, int cn, int D, float *bsum) {
    int c = 0;
#if HAVE_AVX2
    if (vqb % 8 == 0 || vnb == 0)
        for (; c + 64 <= D; c += 64) {
            int blk[8];                     /* each vector's block (a block holds whole vectors) */
            for (int v = 0; v < 8; v++) blk[v] = vnb ? (c + 8 * v) / vqb : 0;
            __m256 acc[8];
            for (int v = 0; v < 8; v++) acc[v] = _mm256_loadu_ps(o + c + 8 * v);
            for (int k = 0; k < cn; k++) {
                if (!rows[k] || e[k] == 0.0f) continue;
                const float *restrict rk = rows[k] + c;
                if (coded[k]) {
                    const float *pk = ppb + (long)k * vnp;
                    for (int v = 0; v < 8; v++)
                        acc[v] = _mm256_fmadd_ps(_mm256_set1_ps(e[k] * pk[blk[v]]), _mm256_loadu_ps(rk + 8 * v), acc[v]);
                } else {
                    const __m256 w = _mm256_set1_ps(e[k]);
                    for (int v = 0; v < 8; v++) acc[v] = _mm256_fmadd_ps(w, _mm256_loadu_ps(rk + 8 * v), acc[v]);
                }
            }
            for (int v = 0; v < 8; v++) _mm256_storeu_ps(o + c + 8 * v, acc[v]);
        }
#endif
    for (int k = 0; k < cn; k++) {
        if (!rows[k] || e[k] == 0.0f) continue;
        for (int cc = c; cc < D; cc++) o[cc] += (coded[k] ? e[k] * ppb[(long)k * vnp + cc / vqb] : e[k]) * rows[k][cc];
    }
    if (vzp) {  /* block b's minimums times the weights: the coded rows listed once, then each sum in a
                   register (perf: the three tests per slot and block were ~15% of a KIVI step) */
        int act[VCHUNK], na = 0;
        for (int k = 0; k < cn; k++)
            if (rows[k] && e[k] != 0.0f && coded[k]) act[na++] = k;
        for (int b = 0; b < vnb; b++) {
            float acc = bsum[b];
            for (int i = 0; i < na; i++) acc += e[act[i]] * ppb[(long)act[i] * vnp + vnb + b];
            bsum[b] = acc;
        }
    }
}

/* Returns 0; 1 when scratch could not be allocated; 2 for shapes or streams it does not take (head_dim
   over 512, over 64 query heads per KV head, a stream kv_stream.c's stream_ok refuses). Nothing is
   written then. */
int decode_step(int n_layers, const int64_t *plan, const int64_t *head, const float *final_norm,
                const int64_t *streams,   /* [n_layers, 2, ST_SLOTS]: each layer's K and V stream (kv_stream.c) */
                const float *x_in,        /* [M, dim] embedded tokens */
                float *logits,            /* [M, vocab], or [M / T, vocab] with last_only */
                int M, int T,             /* M token rows: T consecutive new tokens per cache row */
                int last_only,            /* logits of each cache row's last new token only */
                int dim, int n_heads, int n_kv, int D, int hidden, int max_seq, int slot,
                const int64_t *positions, /* [M] rotary positions */
                const uint8_t *mask,      /* [M, slot + T]: nonzero where row r attends slot s; NULL: every
                                             cached slot, and the row's new tokens up to its own */
                const float *cos, const float *ssin,   /* [P, D] tables */
                float eps, int nthreads) {
    const int qkv_w = (n_heads + 2 * n_kv) * D, q_w = n_heads * D, rep = n_heads / n_kv, L = slot + T;
    const int kmax = dim > hidden ? dim : hidden;
    const float scale = 1.0f / sqrtf((float)D);
    if (D > 512 || rep > 64 || T < 1 || M % T) return 2;
    int gmax = 1;   /* the largest per-channel group: complete_group's scratch */
    size_t chan_n = 0;   /* key_scores_channels' scratch, when a stream has per-channel keys */
    for (int i = 0; i < 2 * n_layers; i++) {
        const Stream st = stream_at(streams + (long)i * ST_SLOTS);
        if (!stream_ok(&st, D, i % 2 == 0) || (T > 1 && kv_per_channel(st.kind))) return 2;   /* groups: one token a step */
        if (kv_per_channel(st.kind)) {
            gmax = st.block > gmax ? st.block : gmax;
            chan_n = channel_scratch(rep, D);
        }
    }
    const Lin wh = lin_at(head);
    /* shared: projection outputs, attention partials [parts, M, heads, D + 2], column sums */
    const size_t part_w = (size_t)D + 2;
    const int nparts = (L + ATT_PART - 1) / ATT_PART;
    const size_t shared = (size_t)M * (qkv_w + dim + 2 * hidden) + (size_t)nparts * M * n_heads * part_w +
                          (size_t)nthreads * M * COLS_CHUNK;
    float *sh = malloc(sizeof(float) * shared);
    if (!sh) return 1;
    float *qkv = sh, *proj = qkv + (size_t)M * qkv_w, *gu = proj + (size_t)M * dim, *part = gu + (size_t)M * 2 * hidden,
          *cols = part + (size_t)nparts * M * n_heads * part_w;
    int failed = 0;

#pragma omp parallel num_threads(nthreads)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        const int p0 = (int)((long)tid * nparts / nt), p1 = (int)((long)(tid + 1) * nparts / nt);   /* my parts */
        const int s0 = p0 * ATT_PART < L ? p0 * ATT_PART : L, s1 = p1 * ATT_PART < L ? p1 * ATT_PART : L;
        const int n = s1 - s0;   /* my slots */
        const size_t kv_n = (size_t)M * n_kv * D;
        /* private floats: residual stream, normed input, roped q, the new k and v as stored, attention
           output, MLP gate, q8 activation scales and sums, the new k and v as read, scores and their
           scratch, a rotation's output, minimum sums, a group being quantized, a chunk of decoded value
           rows and their block parameters, per-channel key groups' q-side factors; then the new k and v codes'
           uint16 parameters, the activation codes (int8, int16 or split int16) and the new k and v codes (bytes) */
        const size_t nf = (size_t)M * (dim + kmax + 2 * q_w + hidden) + 4 * kv_n + 2 * (size_t)M * (kmax / QK) +
                          2 * (size_t)rep * n + 2 * (size_t)n + (size_t)D + (size_t)rep * D +
                          (size_t)D * gmax + 3 * (size_t)VCHUNK * D + chan_n;
        const size_t nh = 2 * kv_n, nbytes = 4 * (size_t)M * kmax + 2 * kv_n + (size_t)D * gmax;
        float *pv = malloc(sizeof(float) * nf + sizeof(uint16_t) * nh + nbytes);
        int ok = pv != NULL;
#pragma omp atomic
        failed += !ok;
#pragma omp barrier
        if (!failed) {
            float *x = pv, *h = x + (size_t)M * dim, *q = h + (size_t)M * kmax, *k = q + (size_t)M * q_w,
                  *vv = k + kv_n, *att = vv + kv_n, *act = att + (size_t)M * q_w, *xd = act + (size_t)M * hidden,
                  *xs = xd + (size_t)M * (kmax / QK), *kn = xs + (size_t)M * (kmax / QK), *vn = kn + kv_n,
                  *sc = vn + kv_n, *t = sc + (size_t)rep * n, *sf = t + (size_t)rep * n,
                  *bf = sf + n, *tmp = bf + n, *bsum = tmp + D,
                  *xg = bsum + (size_t)rep * D;
            /* decoded value rows [VCHUNK, D], their block parameters [VCHUNK, <= 2 D] */
            float *vbuf = xg + (size_t)D * gmax, *ppb = vbuf + (size_t)VCHUNK * D;
            float *qs = ppb + 2 * (size_t)VCHUNK * D;     /* key_scores_channels' scratch */
            uint16_t *kpar = (uint16_t *)(qs + chan_n), *vpar = kpar + kv_n;
            int8_t *codes = (int8_t *)(vpar + kv_n);   /* q8, int16 or split int16 activation codes: 2-byte aligned */
            uint8_t *ku = (uint8_t *)(codes + 4 * (size_t)M * kmax), *vu = ku + kv_n, *ug = vu + kv_n;
            Act a = {codes, xd, xs};
            memcpy(x, x_in, sizeof(float) * (size_t)M * dim);
            for (int l = 0; l < n_layers; l++) {
                const int64_t *p = plan + (long)l * L_SLOTS;
                const Lin wqkv = lin_at(p + L_QKV), wo = lin_at(p + L_O), w13 = lin_at(p + L_13), w2 = lin_at(p + L_2);
                const Stream ks = stream_at(streams + 2L * l * ST_SLOTS), vs = stream_at(streams + (2L * l + 1) * ST_SLOTS);
                const long S = max_seq;
                /* read from codes: keys [0, kce), values [0, vce); the rest from the ring, the new token
                   from kn / vn, except a new key a completed per-channel group holds (kce > slot) */
                const int kchan = kv_per_channel(ks.kind);
                const int kce = ks.kind == KV_FP32 ? 0 : kchan ? ks.r0 : (ks.r0 < slot ? ks.r0 : slot);
                const int vce = vs.kind == KV_FP32 ? 0 : (vs.r0 < slot ? vs.r0 : slot);
                const int kgroup = kchan && L % ks.block == 0 && L / ks.block <= S / ks.block;
                rms_norm(x, (const float *)p[L_ATTN_NORM], h, M, dim, eps);
                linear(&wqkv, h, M, qkv, &a, cols);
                /* q and k roped, then rotated as the cache stores keys; v rotated as it stores values; the
                   new k and v's codes, and the new k and v as the torch path reads them back (its codes
                   read back where it reads the new token from codes, a per-token kind without a window) */
                for (int r = 0; r < M; r++) {
                    const float *row = qkv + (long)r * qkv_w;
                    const float *c = cos + positions[r] * D, *s = ssin + positions[r] * D;
                    for (int hh = 0; hh < n_heads; hh++) {
                        float *qh = q + (long)r * q_w + hh * D;
                        rope_head(row + hh * D, qh, c, s, D);
                        if (ks.rot) {
                            rotate(qh, ks.rot, D, tmp);
                            memcpy(qh, tmp, sizeof(float) * D);
                        }
                    }
                    for (int g = 0; g < n_kv; g++) {
                        const long rg = (long)r * n_kv + g;
                        float *kr = k + rg * D, *vr = vv + rg * D;
                        rope_head(row + q_w + g * D, kr, c, s, D);
                        if (ks.rot) {
                            rotate(kr, ks.rot, D, tmp);
                            memcpy(kr, tmp, sizeof(float) * D);
                        }
                        if (vs.rot) rotate(row + q_w + (n_kv + g) * D, vs.rot, D, vr);
                        else memcpy(vr, row + q_w + (n_kv + g) * D, sizeof(float) * D);
                        const Stream *st2[2] = {&ks, &vs};
                        float *src[2] = {kr, vr}, *read[2] = {kn + rg * D, vn + rg * D};
                        uint8_t *u[2] = {ku + rg * D, vu + rg * D};
                        uint16_t *par[2] = {kpar + rg * D, vpar + rg * D};
                        for (int i = 0; i < 2; i++) {
                            const Stream *st = st2[i];
                            if (st->kind != KV_FP32 && !kv_per_channel(st->kind)) {
                                quantize_vector(st->kind, src[i], D, st->block, u[i], par[i]);
                                if (slot + r % T < st->r0) {
                                    dequantize_vector(st->kind, u[i], par[i], D, st->block, read[i]);
                                    continue;
                                }
                            }
                            memcpy(read[i], src[i], sizeof(float) * D);
                        }
                    }
                }
                /* a per-channel key group completed by the new token: quantized into the cache before
                   anyone reads it (the loop's implicit barrier) */
                if (kgroup) {
#pragma omp for schedule(static)
                    for (int rg = 0; rg < M * n_kv; rg++) complete_group(&ks, rg, S, D, slot, k + (long)rg * D, xg, ug);
                }
                /* this thread's parts: every head of a KV group's scores; per part their max, exp and sum, p V */
                const int vbits = kv_bits(vs.kind), vfw = D * vbits / 8, vzp = kv_zero_point(vs.kind);
                const int vqb = vs.block, vnb = vs.kind == KV_FP32 ? 0 : D / vqb, vnp = (vzp ? 2 : 1) * vnb;
                for (int r = 0; r < M; r++) {
                    const uint8_t *mr = mask ? mask + (long)r * L : NULL;
                    const int tt = r % T, first = r - tt;    /* this row's new token; its cache row's first row */
                    for (int g = 0; g < n_kv; g++) {
                        const long rg = (long)(r / T) * n_kv + g;                  /* the cache row's KV head */
                        const float *qg = q + (long)r * q_w + (long)g * rep * D;   /* the group's rep heads */
                        /* new token u of the cache row (slot slot + u) as the cache will read it back */
#define NEW(buf, u) ((buf) + ((long)(first + (u)) * n_kv + g) * D)
                        float mx[64], sum[64];
                        /* scores sc[j, p - s0] */
                        const int c1 = s1 < kce ? s1 : kce;
                        if (c1 > s0) {
                            if (kchan) key_scores_channels(&ks, rg, S, D, qg, rep, s0, c1 - s0, sc, n, qs);
                            else key_scores_tokens(&ks, rg, S, D, qg, rep, s0, c1 - s0, sc, n, t, sf, bf);
                        }
                        for (int sl = c1 > s0 ? c1 : s0; sl < s1; sl++) {
                            if (sl - slot > tt) break;                             /* a later new token */
                            const float *kk = sl >= slot ? NEW(kn, sl - slot) : ring_row(&ks, rg, sl, D);
                            for (int j = 0; j < rep; j++) sc[(long)j * n + sl - s0] = dot_f32(kk, qg + (long)j * D, D);
                        }
                        for (int j = 0; j < rep; j++) {
                            float *sj = sc + (long)j * n;
                            for (int i = 0; i < n; i++)
                                sj[i] = (mr && !mr[s0 + i]) || s0 + i - slot > tt ? -INFINITY : sj[i] * scale;
                        }
                        for (int pi = p0; pi < p1; pi++) {
                            const int a0 = pi * ATT_PART - s0, a1 = a0 + ATT_PART < n ? a0 + ATT_PART : n;   /* in sc */
                            /* this part's partials of the group's heads: head j at pg + j part_w */
                            float *pg = part + (((size_t)pi * M + r) * n_heads + g * rep) * part_w;
                            for (int j = 0; j < rep; j++) {
                                float m = -INFINITY;
                                for (int i = a0; i < a1; i++) m = sc[(long)j * n + i] > m ? sc[(long)j * n + i] : m;
                                mx[j] = m;
                                sum[j] = 0.0f;
                                memset(pg + j * part_w, 0, sizeof(float) * D);
                            }
                            if (vzp) memset(bsum, 0, sizeof(float) * (size_t)rep * vnb);
                            /* the softmax weights e = exp(score - max) in place (0: masked), their sums */
                            for (int j = 0; j < rep; j++) {
                                float *sj = sc + (long)j * n;
                                for (int i = a0; i < a1; i++) {
                                    if (sj[i] == -INFINITY) { sj[i] = 0.0f; continue; }
                                    sj[i] = expf(sj[i] - mx[j]);
                                    sum[j] += sj[i];
                                }
                            }
                            /* p V, VCHUNK slots at a time: each slot's row decoded once, then every head's
                               output held in registers across the chunk (value_chunk) */
                            for (int c0 = s0 + a0; c0 < s0 + a1; c0 += VCHUNK) {
                                const int cn = s0 + a1 - c0 < VCHUNK ? s0 + a1 - c0 : VCHUNK;
                                const float *rows[VCHUNK];
                                int coded[VCHUNK], live = 0;
                                for (int k = 0; k < cn; k++) {
                                    const int sl = c0 + k, i = sl - s0;
                                    int any = 0;
                                    for (int j = 0; j < rep; j++) any |= sc[(long)j * n + i] != 0.0f;
                                    coded[k] = sl < slot && sl < vce;
                                    rows[k] = NULL;
                                    if (!any) continue;
                                    live = 1;
                                    if (sl >= slot) rows[k] = NEW(vn, sl - slot);
                                    else if (coded[k]) {
                                        float *dst = vbuf + (long)k * D, *pk = ppb + (long)k * vnp;
                                        decode_row(vs.kind, (const uint8_t *)vs.codes + (rg * S + sl) * vfw, D, dst);
                                        const uint16_t *ps = vs.params + rg * vnp * S + sl;
                                        for (int b = 0; b < vnp; b++) pk[b] = fp16_to_fp32(ps[(long)b * S]);
                                        rows[k] = dst;
                                    } else rows[k] = ring_row(&vs, rg, sl, D);
                                }
                                if (!live) continue;
                                for (int j = 0; j < rep; j++) {
                                    float *restrict o = pg + j * part_w;
                                    value_chunk(o, rows, coded, ppb, vnb, vnp, vqb, vzp, sc + (long)j * n + (c0 - s0), cn, D,
                                                bsum + (long)j * vnb);
                                }
                            }
                            for (int j = 0; j < rep; j++) {
                                float *o = pg + j * part_w;
                                if (vzp)
                                    for (int c = 0; c < D; c++) o[c] += bsum[(long)j * vnb + c / vqb];
                                o[D] = mx[j];
                                o[D + 1] = sum[j];
                            }
                        }
#undef NEW
                    }
                }
#pragma omp barrier
                /* the new tokens' K and V into the cache, by the thread that owns the last part:
                   nobody reads them before the next step */
                if (p0 < p1 && p1 == nparts)
                    for (long rg = 0; rg < (long)M * n_kv; rg++) {
                        const long r = rg / n_kv, cg = r / T * n_kv + rg % n_kv;
                        const int at = slot + (int)(r % T);
                        write_new(&ks, 1, cg, S, D, at, k + rg * D, ku + rg * D, kpar + rg * D);
                        write_new(&vs, 0, cg, S, D, at, vv + rg * D, vu + rg * D, vpar + rg * D);
                    }
                /* combine the partials (every thread, into its own att), then undo the value rotation */
                for (int r = 0; r < M; r++)
                    for (int hh = 0; hh < n_heads; hh++) {
                        float mx = -INFINITY, sum = 0.0f;
                        for (int pi = 0; pi < nparts; pi++) {
                            const float m_t = part[(((size_t)pi * M + r) * n_heads + hh) * part_w + D];
                            mx = m_t > mx ? m_t : mx;
                        }
                        float *o = att + (long)r * q_w + hh * D;
                        memset(o, 0, sizeof(float) * D);
                        for (int pi = 0; pi < nparts; pi++) {
                            const float *pt = part + (((size_t)pi * M + r) * n_heads + hh) * part_w;
                            if (pt[D] == -INFINITY) continue;
                            const float w = expf(pt[D] - mx);
                            sum += w * pt[D + 1];
                            for (int i = 0; i < D; i++) o[i] += w * pt[i];
                        }
                        const float inv = 1.0f / sum;
                        for (int i = 0; i < D; i++) o[i] *= inv;
                        if (vs.rot) {
                            rotate(o, vs.rot, D, tmp);
                            memcpy(o, tmp, sizeof(float) * D);
                        }
                    }
                linear(&wo, att, M, proj, &a, cols);
                add_rms_norm(x, proj, (const float *)p[L_MLP_NORM], x, h, M, dim, eps);
                linear(&w13, h, M, gu, &a, cols);
                silu_mul(gu, act, M, hidden);
                linear(&w2, act, M, proj, &a, cols);
                for (long i = 0; i < (long)M * dim; i++) x[i] += proj[i];
                /* the next layer's projections overwrite qkv and proj only after its first
                   barrier, which every thread reaches after reading these */
            }
            int rows = M;
            if (last_only && T > 1) {     /* each cache row's last token (x is this thread's own) */
                rows = M / T;
                for (int b = 0; b < rows; b++) memmove(x + (long)b * dim, x + ((long)b * T + T - 1) * dim, sizeof(float) * dim);
            }
            rms_norm(x, final_norm, h, rows, dim, eps);
            linear(&wh, h, rows, logits, &a, cols);
        }
        free(pv);
    }
    free(sh);
    return failed ? 1 : 0;
}
