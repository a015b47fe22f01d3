/* A whole decode step of a Llama-family model in one C call (caramba.model.fast_decode).

   At batch 1 a decode step is ~30 layers x ~10 small ops. Through torch each op costs 5-30 us of
   dispatch, allocation and Python around ~1 us of arithmetic, which added ~8 ms to a ~10 ms step
   of weight reads (docs/decode-speed.md). Here the step runs as llama.cpp's does: one parallel
   region whose threads split each projection's output rows and the attention's cache slots.

   Per layer, for M token rows (one new token each):
     h = rms_norm(x); q|k|v = h W_qkv^T (+b); rope(q, k) at each row's position;
     K, V cache rows [r, g, slot] = k, v; a = softmax(q K^T / sqrt(D)) V over slots [0, slot];
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

   The attention splits the cache slots over the threads: each computes, for every head, the
   softmax statistics (max, sum) and the unnormalized p V of its own slots; the partials are then
   combined exactly (flash-decoding). The new token's own K and V are read from the projection's
   output, not the cache, so no thread waits for the cache write.

   Projections come in the layouts the model holds (no copies): fp32 [N, K] (nn.Linear), fp32
   [K, N] (InputMajorLinear) and the block formats of quant_gemv.c. */

#include "quant_gemv.c"
#include "decode_ops.c"

#include <omp.h>

enum { F32_ROWS = 0, F32_COLS = 1, Q8_0_Q8 = 2, Q8_0_F32 = 3, Q4_1_F32 = 4, Q4_1_Q8 = 5 };

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

#define COLS_CHUNK 4096     /* input-major products: partial sums [rows, 4096] per thread, L1/L2-resident */

static inline Lin lin_at(const int64_t *p) {
    Lin L = {p[0], p[1], p[2], (const void *)p[3], (const uint16_t *)p[4], (const uint16_t *)p[5],
             (const float *)p[6]};
    return L;
}

/* A thread's own activations in the q8 formats the integer dot products take. */
typedef struct {
    int8_t *xq;
    float *xd, *xs;
} Act;

/* Several token rows (a batch) make the fp32 products compute-bound rather than read-bound, so
   they go through register tiles: each weight element loaded once feeds up to TR rows' sums held
   in registers (8 accumulators: 2 weight rows x 4 token rows, or 16 columns x 4 token rows). */
#define TR 4
#define INLINE static inline __attribute__((always_inline))

#if HAVE_AVX2
/* y[r, n0 .. n0 + 1] for token rows [r0, r0 + RR) of [N, K] weights: rows n0 and n1 (n1 == n0
   when N is odd at the end). */
INLINE void rows_tile(const int RR, const float *w0, const float *w1, const float *x, int K, float out[2][TR]) {
    __m256 a[TR], b[TR];
    for (int r = 0; r < RR; r++) a[r] = b[r] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 u = _mm256_loadu_ps(w0 + k), v = _mm256_loadu_ps(w1 + k);
        for (int r = 0; r < RR; r++) {
            const __m256 xv = _mm256_loadu_ps(x + (long)r * K + k);
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

/* fp32 [K, N] (input-major) weights times M token rows. Column tiles would read 64 bytes of every
   weight row at a stride of N floats (a page apart for the head: a TLB miss per load; measured 4x
   slower for a batch than the [N, K] products), so each thread streams whole rows of its band of
   k, in chunks of COLS_CHUNK columns whose [M, chunk] partial sums stay in L1/L2, four weight rows
   per pass (one load and store of a partial per four products); then the partials are added. */
static void cols_f32_batch(const float *w, const float *x, int M, int N, int K, float *y, const float *bias,
                           float *cols) {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    float *mine = cols + (size_t)tid * M * COLS_CHUNK;
    for (int c0 = 0; c0 < N; c0 += COLS_CHUNK) {
        const int cw = N - c0 < COLS_CHUNK ? N - c0 : COLS_CHUNK;
        memset(mine, 0, sizeof(float) * (size_t)M * COLS_CHUNK);
        const int quads = (K + 3) / 4;
#pragma omp for schedule(static)
        for (int kq = 0; kq < quads; kq++) {
            const int k0 = 4 * kq, kn = K - k0 < 4 ? K - k0 : 4;
            const float *restrict w0 = w + (long)k0 * N + c0, *restrict w1 = w0 + (kn > 1 ? N : 0),
                        *restrict w2 = w0 + (kn > 2 ? 2L * N : 0), *restrict w3 = w0 + (kn > 3 ? 3L * N : 0);
            int r = 0;
            for (; r + 1 < M; r += 2) {   /* two token rows per pass: each weight load feeds both */
                const float *xa = x + (long)r * K + k0, *xb = xa + K;
                const float a0 = xa[0], a1 = kn > 1 ? xa[1] : 0.0f, a2 = kn > 2 ? xa[2] : 0.0f, a3 = kn > 3 ? xa[3] : 0.0f;
                const float b0 = xb[0], b1 = kn > 1 ? xb[1] : 0.0f, b2 = kn > 2 ? xb[2] : 0.0f, b3 = kn > 3 ? xb[3] : 0.0f;
                float *restrict pa = mine + (long)r * COLS_CHUNK, *restrict pb = pa + COLS_CHUNK;
                for (int n = 0; n < cw; n++) {
                    const float u0 = w0[n], u1 = w1[n], u2 = w2[n], u3 = w3[n];
                    pa[n] += a0 * u0 + a1 * u1 + a2 * u2 + a3 * u3;
                    pb[n] += b0 * u0 + b1 * u1 + b2 * u2 + b3 * u3;
                }
            }
            for (; r < M; r++) {
                const float *xr = x + (long)r * K + k0;
                const float x0 = xr[0], x1 = kn > 1 ? xr[1] : 0.0f, x2 = kn > 2 ? xr[2] : 0.0f, x3 = kn > 3 ? xr[3] : 0.0f;
                float *pr = mine + (long)r * COLS_CHUNK;
                for (int n = 0; n < cw; n++) pr[n] += x0 * w0[n] + x1 * w1[n] + x2 * w2[n] + x3 * w3[n];
            }
        }
#pragma omp for schedule(static)
        for (long i = 0; i < (long)M * cw; i++) {
            const int r = (int)(i / cw), n = (int)(i % cw);
            float v = bias ? bias[c0 + n] : 0.0f;
            for (int t = 0; t < nt; t++) v += cols[(size_t)t * M * COLS_CHUNK + (long)r * COLS_CHUNK + n];
            y[(long)r * N + c0 + n] = v;
        }
    }
}

/* y [M, N] = x [M, K] W^T (+ bias), x private to the calling thread (every thread holds the same
   values), y shared. Called by every thread of the region; ends with a barrier. cols: shared
   [threads, M, COLS_CHUNK] partial sums for input-major weights. */
static void linear(const Lin *L, const float *x, int M, float *y, Act *a, float *cols) {
    const int N = (int)L->N, K = (int)L->K, nb = K / QK;
    if (L->fmt == Q8_0_Q8 || L->fmt == Q4_1_Q8) {
        quantize_rows_q8(x, M, K, a->xq, a->xd);
        if (L->fmt == Q4_1_Q8)   /* d_x * sum(a_i) per block: the weight minimum multiplies it */
            for (int r = 0; r < M; r++)
                for (int b = 0; b < nb; b++) {
                    int32_t s = 0;
                    for (int i = 0; i < QK; i++) s += a->xq[(long)r * K + b * QK + i];
                    a->xs[r * nb + b] = a->xd[r * nb + b] * (float)s;
                }
    } else if (L->fmt == Q4_1_F32)
        block_sums(x, M, K, a->xs);
    if (L->fmt == F32_COLS) {
        const float *w = (const float *)L->w;
        cols_f32_batch(w, x, M, N, K, y, L->bias, cols);
        return;
    }
    if (L->fmt == F32_ROWS && M > 1) {
        rows_f32_batch((const float *)L->w, x, M, N, K, y, L->bias);
        return;
    }
#pragma omp for schedule(static)
    for (int n = 0; n < N; n++) {
        const float b = L->bias ? L->bias[n] : 0.0f;
        for (int r = 0; r < M; r++) {
            float v;
            switch (L->fmt) {
            case F32_ROWS: v = dot_f32((const float *)L->w + (long)n * K, x + (long)r * K, K); break;
            case Q8_0_Q8:
                v = dot_q8_0_q8((const int8_t *)L->w + (long)n * K, L->d + (long)n * nb, a->xq + (long)r * K,
                                a->xd + r * nb, nb);
                break;
            case Q8_0_F32: v = dot_q8_0_f32((const int8_t *)L->w + (long)n * K, L->d + (long)n * nb, x + (long)r * K, nb); break;
            case Q4_1_F32:
                v = dot_q4_1_f32((const uint8_t *)L->w + (long)n * (K / 2), L->d + (long)n * nb, L->m + (long)n * nb,
                                 x + (long)r * K, a->xs + r * nb, nb);
                break;
            default:
                v = dot_q4_1_q8((const uint8_t *)L->w + (long)n * (K / 2), L->d + (long)n * nb, L->m + (long)n * nb,
                                a->xq + (long)r * K, a->xd + r * nb, a->xs + r * nb, nb);
            }
            y[(long)r * N + n] = v + b;
        }
    }
}

/* x*cos + roll(x, D/2)*ssin for one head (ssin: sin with its first half negated, RotaryTable's). */
static inline void rope_head(const float *v, float *out, const float *cos, const float *ssin, int D) {
    const int h = D / 2;
    for (int i = 0; i < h; i++) out[i] = v[i] * cos[i] + v[i + h] * ssin[i];
    for (int i = h; i < D; i++) out[i] = v[i] * cos[i] + v[i - h] * ssin[i];
}

/* Returns 0; 1 when scratch could not be allocated, 2 for a head_dim over 512 (nothing written then). */
int decode_step(int n_layers, const int64_t *plan, const int64_t *head, const float *final_norm,
                float *const *kv,         /* [n_layers, 2]: each layer's K and V cache, [M, n_kv, max_seq, D] fp32 */
                const float *x_in,        /* [M, dim] embedded tokens */
                float *logits,            /* [M, vocab] */
                int M, int dim, int n_heads, int n_kv, int D, int hidden, int max_seq, int slot,
                const int64_t *positions, /* [M] rotary positions */
                const uint8_t *mask,      /* [M, slot + 1]: nonzero where row r attends slot s; NULL: every slot */
                const float *cos, const float *ssin,   /* [P, D] tables */
                float eps, int nthreads) {
    const int qkv_w = (n_heads + 2 * n_kv) * D, q_w = n_heads * D, rep = n_heads / n_kv, L = slot + 1;
    const int kmax = dim > hidden ? dim : hidden;
    const float scale = 1.0f / sqrtf((float)D);
    if (D > 512) return 2;
    const Lin wh = lin_at(head);
    /* shared: projection outputs, attention partials [threads, M, heads, D + 2], column partials */
    const size_t part_w = (size_t)D + 2;
    const size_t shared = (size_t)M * (qkv_w + dim + 2 * hidden) + (size_t)nthreads * M * n_heads * part_w +
                          (size_t)nthreads * M * COLS_CHUNK;
    float *sh = malloc(sizeof(float) * shared);
    if (!sh) return 1;
    float *qkv = sh, *proj = qkv + (size_t)M * qkv_w, *gu = proj + (size_t)M * dim, *part = gu + (size_t)M * 2 * hidden,
          *cols = part + (size_t)nthreads * M * n_heads * part_w;
    int failed = 0;

#pragma omp parallel num_threads(nthreads)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        /* private: residual stream, normed input, roped q and k, attention output, MLP gate,
           scores of this thread's slots, q8 activations */
        const int my_slots = (L + nt - 1) / nt;
        const size_t priv = (size_t)M * (dim + kmax + q_w + n_kv * D + q_w + hidden) + (size_t)n_heads * my_slots +
                            2 * (size_t)M * (kmax / QK);
        float *pv = malloc(sizeof(float) * priv + (size_t)M * kmax);
        int ok = pv != NULL;
#pragma omp atomic
        failed += !ok;
#pragma omp barrier
        if (!failed) {
            float *x = pv, *h = x + (size_t)M * dim, *q = h + (size_t)M * kmax, *k = q + (size_t)M * q_w,
                  *att = k + (size_t)M * n_kv * D, *act = att + (size_t)M * q_w, *sc = act + (size_t)M * hidden,
                  *xd = sc + (size_t)n_heads * my_slots, *xs = xd + (size_t)M * (kmax / QK);
            Act a = {(int8_t *)(xs + (size_t)M * (kmax / QK)), xd, xs};
            const int s0 = tid * my_slots < L ? tid * my_slots : L, s1 = s0 + my_slots < L ? s0 + my_slots : L;
            memcpy(x, x_in, sizeof(float) * (size_t)M * dim);
            for (int l = 0; l < n_layers; l++) {
                const int64_t *p = plan + (long)l * L_SLOTS;
                const Lin wqkv = lin_at(p + L_QKV), wo = lin_at(p + L_O), w13 = lin_at(p + L_13), w2 = lin_at(p + L_2);
                float *kc = kv[2 * l], *vc = kv[2 * l + 1];
                rms_norm(x, (const float *)p[L_ATTN_NORM], h, M, dim, eps);
                linear(&wqkv, h, M, qkv, &a, cols);
                for (int r = 0; r < M; r++) {
                    const float *row = qkv + (long)r * qkv_w;
                    const float *c = cos + positions[r] * D, *s = ssin + positions[r] * D;
                    for (int hh = 0; hh < n_heads; hh++) rope_head(row + hh * D, q + (long)r * q_w + hh * D, c, s, D);
                    for (int g = 0; g < n_kv; g++) rope_head(row + q_w + g * D, k + ((long)r * n_kv + g) * D, c, s, D);
                }
                /* this thread's slots: scores, their max, then exp and sum and p V, per head */
                for (int r = 0; r < M; r++) {
                    const float *qr = q + (long)r * q_w, *vnew = qkv + (long)r * qkv_w + q_w + n_kv * D;
                    const uint8_t *mr = mask ? mask + (long)r * L : NULL;
                    for (int g = 0; g < n_kv; g++) {
                        const float *kg = kc + ((long)r * n_kv + g) * max_seq * D, *vg = vc + ((long)r * n_kv + g) * max_seq * D;
                        const float *knew = k + ((long)r * n_kv + g) * D;
                        for (int j = 0; j < rep; j++) {
                            const int hh = g * rep + j;
                            float *out = part + (((size_t)tid * M + r) * n_heads + hh) * part_w;
                            float mx = -INFINITY, sum = 0.0f;
                            for (int sl = s0; sl < s1; sl++) {
                                float v = -INFINITY;
                                if (!mr || mr[sl])
                                    v = dot_f32(sl == slot ? knew : kg + (long)sl * D, qr + hh * D, D) * scale;
                                sc[sl - s0] = v;
                                mx = v > mx ? v : mx;
                            }
                            memset(out, 0, sizeof(float) * D);
                            if (mx > -INFINITY)
                                for (int sl = s0; sl < s1; sl++) {
                                    if (sc[sl - s0] == -INFINITY) continue;
                                    const float e = expf(sc[sl - s0] - mx);
                                    const float *vrow = sl == slot ? vnew + g * D : vg + (long)sl * D;
                                    sum += e;
                                    for (int i = 0; i < D; i++) out[i] += e * vrow[i];
                                }
                            out[D] = mx;
                            out[D + 1] = sum;
                        }
                    }
                }
#pragma omp barrier
                /* the new token's K and V into the cache, by the thread that owns the last slot:
                   nobody reads them before the next step */
                if (s0 < L && s1 == L)
                    for (int r = 0; r < M; r++)
                        for (int g = 0; g < n_kv; g++) {
                            const long at = (((long)r * n_kv + g) * max_seq + slot) * D;
                            memcpy(kc + at, k + ((long)r * n_kv + g) * D, sizeof(float) * D);
                            memcpy(vc + at, qkv + (long)r * qkv_w + q_w + (n_kv + g) * D, sizeof(float) * D);
                        }
                /* combine the partials (every thread, into its own att) */
                for (int r = 0; r < M; r++)
                    for (int hh = 0; hh < n_heads; hh++) {
                        float mx = -INFINITY, sum = 0.0f;
                        for (int t = 0; t < nt; t++) {
                            const float m_t = part[(((size_t)t * M + r) * n_heads + hh) * part_w + D];
                            mx = m_t > mx ? m_t : mx;
                        }
                        float *o = att + (long)r * q_w + hh * D;
                        memset(o, 0, sizeof(float) * D);
                        for (int t = 0; t < nt; t++) {
                            const float *pt = part + (((size_t)t * M + r) * n_heads + hh) * part_w;
                            if (pt[D] == -INFINITY) continue;
                            const float w = expf(pt[D] - mx);
                            sum += w * pt[D + 1];
                            for (int i = 0; i < D; i++) o[i] += w * pt[i];
                        }
                        const float inv = 1.0f / sum;
                        for (int i = 0; i < D; i++) o[i] *= inv;
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
            rms_norm(x, final_norm, h, M, dim, eps);
            linear(&wh, h, M, logits, &a, cols);
        }
        free(pv);
    }
    free(sh);
    return failed ? 1 : 0;
}
