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

#define COLS_SPLIT_ROWS 2   /* input-major products of up to this many rows split k over the threads */
#define COLS_CHUNK 256      /* else output columns per task: its [M, 256] sums stay in L1 */

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

/* y [M, N] = x [M, K] W^T (+ bias), x private to the calling thread (every thread holds the same
   values), y shared. Called by every thread of the region; ends with a barrier. cols: shared
   [threads, M, N] partial sums for input-major weights. */
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
        if (M <= COLS_SPLIT_ROWS) {
            /* Each thread streams whole weight rows of its band of k into its own partial sums
               (L2-resident), which are then added: whole rows stream near bandwidth, column
               chunks of every row do not (~27 against ~18 GB/s for the head on this AMD EPYC). */
            const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
            float *mine = cols + (size_t)tid * M * N;
            memset(mine, 0, sizeof(float) * (size_t)M * N);
#pragma omp for schedule(static)
            for (int k = 0; k < K; k++) {
                const float *wk = w + (long)k * N;
                for (int r = 0; r < M; r++) {
                    const float xk = x[(long)r * K + k];
                    float *pr = mine + (long)r * N;
                    for (int n = 0; n < N; n++) pr[n] += xk * wk[n];
                }
            }
#pragma omp for schedule(static)
            for (long i = 0; i < (long)M * N; i++) {
                float v = L->bias ? L->bias[i % N] : 0.0f;
                for (int t = 0; t < nt; t++) v += cols[(size_t)t * M * N + i];
                y[i] = v;
            }
            return;
        }
        const int chunks = (N + COLS_CHUNK - 1) / COLS_CHUNK;
#pragma omp for schedule(static)
        for (int c = 0; c < chunks; c++) {
            const int n0 = c * COLS_CHUNK, n1 = n0 + COLS_CHUNK < N ? n0 + COLS_CHUNK : N;
            for (int r = 0; r < M; r++) {
                float *yr = y + (long)r * N;
                for (int n = n0; n < n1; n++) yr[n] = L->bias ? L->bias[n] : 0.0f;
            }
            for (int k = 0; k < K; k++) {
                const float *wk = w + (long)k * N;
                for (int r = 0; r < M; r++) {
                    const float xk = x[(long)r * K + k];
                    float *yr = y + (long)r * N;
                    for (int n = n0; n < n1; n++) yr[n] += xk * wk[n];
                }
            }
        }
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
    size_t widest = wh.fmt == F32_COLS ? (size_t)wh.N : 0;
    for (int l = 0; l < n_layers; l++)
        for (int j = L_QKV; j <= L_2; j += 7)
            if (plan[(long)l * L_SLOTS + j] == F32_COLS && (size_t)plan[(long)l * L_SLOTS + j + 1] > widest)
                widest = (size_t)plan[(long)l * L_SLOTS + j + 1];
    /* shared: projection outputs, attention partials [threads, M, heads, D + 2], column partials */
    const size_t part_w = (size_t)D + 2;
    const size_t shared = (size_t)M * (qkv_w + dim + 2 * hidden) + (size_t)nthreads * M * n_heads * part_w +
                          (M <= COLS_SPLIT_ROWS ? (size_t)nthreads * M * widest : 0);
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
