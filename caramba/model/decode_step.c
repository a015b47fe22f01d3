/* A whole decode step of a Llama-family model in one C call (caramba.model.fast_decode).

   At batch 1 a decode step is ~30 layers x ~10 small ops. Through torch each op costs 5-30 us of
   dispatch, allocation and Python around ~1 us of arithmetic, which added ~8 ms to a ~10 ms step
   of weight reads (docs/decode-speed.md). Here the step runs as llama.cpp's does: one parallel
   region whose threads split each projection's output rows and the attention's cache slots.

   Per layer, for M token rows (one new token each):
     h = rms_norm(x); q|k|v = h W_qkv^T (+b); rope(q, k) at each row's position;
     K, V cache rows [r, g, slot] = k, v (fp32, or q8_0 codes); a = softmax(q K^T / sqrt(D)) V over slots [0, slot];
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

enum { F32_ROWS = 0, F32_COLS = 1, Q8_0_Q8 = 2, Q8_0_F32 = 3, Q4_1_F32 = 4, Q4_1_Q8 = 5, Q4_0_Q8 = 6 };

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
    if (L->fmt == Q8_0_Q8 || L->fmt == Q4_1_Q8 || L->fmt == Q4_0_Q8) {
        quantize_rows_q8(x, M, K, a->xq, a->xd);
        if (L->fmt != Q8_0_Q8)   /* d_x * sum(a_i) per block: the weight minimum multiplies it */
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
            default:    /* Q4_1_Q8, and Q4_0_Q8 without minimums */
                v = dot_q4_1_q8((const uint8_t *)L->w + (long)n * (K / 2), L->d + (long)n * nb, L->m ? L->m + (long)n * nb : NULL,
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

/* ---- q8_0 KV caches (caramba.cache: KVCacheKind.Q8_0, no residual window) ----
   Code c of a block stands for (c + 1/2) s, c in [-128, 127], s = fp16(absmax (1 + 2^-10) / 127.5)
   rounded to nearest, c = floor(x / s) clamped: the same arithmetic as caramba.cache.quant, so
   the codes this step writes are the torch path's, bit for bit (tests compare them). Keys are
   stored keys-major (codes [rows, heads, D, S]), values position-major ([rows, heads, S, D]);
   scales [rows, heads, D / qblock, S] fp16 either way. */
enum { KV_F32 = 0, KV_Q8_0 = 1 };

static inline uint16_t fp32_to_fp16(float f) {
#if defined(__F16C__)
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else   /* round to nearest even, as the conversion instruction does */
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000;
    x &= 0x7fffffff;
    if (x >= 0x7f800000) return (uint16_t)(sign | (x > 0x7f800000 ? 0x7e00 : 0x7c00));   /* nan, inf */
    if (x >= 0x477ff000) return (uint16_t)(sign | 0x7c00);                                /* rounds to inf */
    uint32_t out, rest, half;
    if (x < 0x38800000) {                      /* below 2^-14: a subnormal half (or zero) */
        const int shift = 126 - (int)(x >> 23);
        if (shift > 24) return (uint16_t)sign;
        const uint32_t m = (x & 0x7fffff) | 0x800000;
        out = m >> shift;
        rest = m & ((1u << shift) - 1);
        half = 1u << (shift - 1);
    } else {
        out = (x >> 13) - (112u << 10);
        rest = x & 0x1fff;
        half = 0x1000;
    }
    if (rest > half || (rest == half && (out & 1))) out++;
    return (uint16_t)(sign | out);
#endif
}

static void quantize_q8_0(const float *x, int D, int qblock, int8_t *codes, uint16_t *scales) {
    const float k = (float)((1.0 + 1.0 / 1024) / 127.5);
    for (int j = 0; j < D / qblock; j++) {
        const float *xb = x + j * qblock;
        float amax = 0.0f;
        for (int i = 0; i < qblock; i++) amax = fmaxf(amax, fabsf(xb[i]));
        scales[j] = fp32_to_fp16(amax * k);
        float safe = fp16_to_fp32(scales[j]);
        if (safe == 0.0f) safe = 1e-30f;
        for (int i = 0; i < qblock; i++) {
            float c = floorf(xb[i] / safe);
            codes[j * qblock + i] = (int8_t)(c < -128.0f ? -128.0f : (c > 127.0f ? 127.0f : c));
        }
    }
}

static void dequantize_q8_0(const int8_t *codes, const uint16_t *scales, int D, int qblock, float *x) {
    for (int i = 0; i < D; i++) x[i] = ((float)codes[i] + 0.5f) * fp16_to_fp32(scales[i / qblock]);
}

/* Returns 0; 1 when scratch could not be allocated; 2 for shapes it does not take (head_dim over 512,
   over 64 query heads per KV head, a qblock that does not divide head_dim). Nothing is written then. */
int decode_step(int n_layers, const int64_t *plan, const int64_t *head, const float *final_norm,
                void *const *kv,          /* [n_layers, 2]: each layer's K and V storage: fp32 [M, n_kv, max_seq, D],
                                             or q8_0 codes (keys [M, n_kv, D, max_seq], values [M, n_kv, max_seq, D]) */
                uint16_t *const *kv_scales, /* [n_layers, 2]: q8_0 block scales [M, n_kv, D / qblock, max_seq], or NULL */
                const int *kv_kinds,      /* [n_layers, 2]: KV_F32 or KV_Q8_0 */
                int qblock,
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
    if (D > 512 || rep > 64 || qblock < 1 || D % qblock) return 2;
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
                            2 * (size_t)M * (kmax / QK) + 2 * (size_t)M * n_kv * D + 2 * (size_t)rep * my_slots;
        const size_t kvq = 2 * (size_t)M * n_kv * D + 2 * sizeof(uint16_t) * (size_t)M * n_kv * (D / qblock);
        float *pv = malloc(sizeof(float) * priv + (size_t)M * kmax + kvq);
        int ok = pv != NULL;
#pragma omp atomic
        failed += !ok;
#pragma omp barrier
        if (!failed) {
            float *x = pv, *h = x + (size_t)M * dim, *q = h + (size_t)M * kmax, *k = q + (size_t)M * q_w,
                  *att = k + (size_t)M * n_kv * D, *act = att + (size_t)M * q_w, *sc = act + (size_t)M * hidden,
                  *xd = sc + (size_t)n_heads * my_slots, *xs = xd + (size_t)M * (kmax / QK);
            float *kn = xs + (size_t)M * (kmax / QK), *vn = kn + (size_t)M * n_kv * D,   /* new K, V as cached */
                  *qsc = vn + (size_t)M * n_kv * D, *qtmp = qsc + (size_t)rep * my_slots;   /* q8_0 key scores */
            Act a = {(int8_t *)(qtmp + (size_t)rep * my_slots), xd, xs};
            int8_t *kqc = a.xq + (size_t)M * kmax, *vqc = kqc + (size_t)M * n_kv * D;      /* new K, V codes */
            uint16_t *kqs = (uint16_t *)(vqc + (size_t)M * n_kv * D), *vqs = kqs + (size_t)M * n_kv * (D / qblock);
            const int s0 = tid * my_slots < L ? tid * my_slots : L, s1 = s0 + my_slots < L ? s0 + my_slots : L;
            memcpy(x, x_in, sizeof(float) * (size_t)M * dim);
            for (int l = 0; l < n_layers; l++) {
                const int64_t *p = plan + (long)l * L_SLOTS;
                const Lin wqkv = lin_at(p + L_QKV), wo = lin_at(p + L_O), w13 = lin_at(p + L_13), w2 = lin_at(p + L_2);
                const int k_q8 = kv_kinds[2 * l] == KV_Q8_0, v_q8 = kv_kinds[2 * l + 1] == KV_Q8_0, nbq = D / qblock;
                const long S = max_seq;
                rms_norm(x, (const float *)p[L_ATTN_NORM], h, M, dim, eps);
                linear(&wqkv, h, M, qkv, &a, cols);
                /* q and k roped; the new k and v as the cache will hold them (quantized and read back
                   for q8_0, as the torch path's new token reads its own K and V from the cache) */
                for (int r = 0; r < M; r++) {
                    const float *row = qkv + (long)r * qkv_w;
                    const float *c = cos + positions[r] * D, *s = ssin + positions[r] * D;
                    for (int hh = 0; hh < n_heads; hh++) rope_head(row + hh * D, q + (long)r * q_w + hh * D, c, s, D);
                    for (int g = 0; g < n_kv; g++) {
                        const long rg = (long)r * n_kv + g;
                        rope_head(row + q_w + g * D, k + rg * D, c, s, D);
                        if (k_q8) {
                            quantize_q8_0(k + rg * D, D, qblock, kqc + rg * D, kqs + rg * nbq);
                            dequantize_q8_0(kqc + rg * D, kqs + rg * nbq, D, qblock, kn + rg * D);
                        } else
                            memcpy(kn + rg * D, k + rg * D, sizeof(float) * D);
                        if (v_q8) {
                            quantize_q8_0(row + q_w + (n_kv + g) * D, D, qblock, vqc + rg * D, vqs + rg * nbq);
                            dequantize_q8_0(vqc + rg * D, vqs + rg * nbq, D, qblock, vn + rg * D);
                        } else
                            memcpy(vn + rg * D, row + q_w + (n_kv + g) * D, sizeof(float) * D);
                    }
                }
                /* this thread's slots: scores, their max, then exp and sum and p V, per head */
                const int s1old = s1 < slot ? s1 : slot;     /* [s0, s1old): slots read from the cache */
                for (int r = 0; r < M; r++) {
                    const float *qr = q + (long)r * q_w;
                    const uint8_t *mr = mask ? mask + (long)r * L : NULL;
                    for (int g = 0; g < n_kv; g++) {
                        const long rg = (long)r * n_kv + g;
                        const float *knew = kn + rg * D, *vnew = vn + rg * D;
                        if (k_q8 && s1old > s0) {
                            /* every head of the group at once, block by block, slots in the inner loop
                               (keys-major codes: a block element's slots are contiguous) */
                            const int8_t *kcode = (const int8_t *)kv[2 * l] + rg * D * S;
                            const uint16_t *ksc = kv_scales[2 * l] + rg * nbq * S;
                            const int n = s1old - s0;
                            memset(qsc, 0, sizeof(float) * (size_t)rep * n);
                            for (int jb = 0; jb < nbq; jb++) {
                                memset(qtmp, 0, sizeof(float) * (size_t)rep * n);
                                float qsum[64];
                                for (int j = 0; j < rep; j++) {
                                    qsum[j] = 0.0f;
                                    for (int e = jb * qblock; e < (jb + 1) * qblock; e++) qsum[j] += qr[(g * rep + j) * D + e];
                                }
                                for (int e = jb * qblock; e < (jb + 1) * qblock; e++) {
                                    const int8_t *ce = kcode + (long)e * S + s0;
                                    for (int j = 0; j < rep; j++) {
                                        const float qe = qr[(g * rep + j) * D + e];
                                        float *t = qtmp + (long)j * n;
                                        for (int i = 0; i < n; i++) t[i] += qe * (float)ce[i];
                                    }
                                }
                                const uint16_t *sj = ksc + (long)jb * S + s0;
                                for (int j = 0; j < rep; j++)
                                    for (int i = 0; i < n; i++)
                                        qsc[(long)j * n + i] += fp16_to_fp32(sj[i]) * (qtmp[(long)j * n + i] + 0.5f * qsum[j]);
                            }
                        }
                        const float *kg = (const float *)kv[2 * l] + rg * S * D;
                        const int8_t *vcode = (const int8_t *)kv[2 * l + 1] + rg * S * D;
                        const float *vg = (const float *)kv[2 * l + 1] + rg * S * D;
                        const uint16_t *vsc = v_q8 ? kv_scales[2 * l + 1] + rg * nbq * S : NULL;
                        for (int j = 0; j < rep; j++) {
                            const int hh = g * rep + j;
                            float *out = part + (((size_t)tid * M + r) * n_heads + hh) * part_w;
                            float mx = -INFINITY, sum = 0.0f;
                            for (int sl = s0; sl < s1; sl++) {
                                float v = -INFINITY;
                                if (!mr || mr[sl]) {
                                    if (sl == slot) v = dot_f32(knew, qr + hh * D, D) * scale;
                                    else if (k_q8) v = qsc[(long)j * (s1old - s0) + (sl - s0)] * scale;
                                    else v = dot_f32(kg + (long)sl * D, qr + hh * D, D) * scale;
                                }
                                sc[sl - s0] = v;
                                mx = v > mx ? v : mx;
                            }
                            memset(out, 0, sizeof(float) * D);
                            if (mx > -INFINITY)
                                for (int sl = s0; sl < s1; sl++) {
                                    if (sc[sl - s0] == -INFINITY) continue;
                                    const float e = expf(sc[sl - s0] - mx);
                                    sum += e;
                                    if (v_q8 && sl != slot) {
                                        const int8_t *cr = vcode + (long)sl * D;
                                        for (int jb = 0; jb < nbq; jb++) {
                                            const float w = e * fp16_to_fp32(vsc[(long)jb * S + sl]);
                                            for (int i = jb * qblock; i < (jb + 1) * qblock; i++) out[i] += w * ((float)cr[i] + 0.5f);
                                        }
                                    } else {
                                        const float *vrow = sl == slot ? vnew : vg + (long)sl * D;
                                        for (int i = 0; i < D; i++) out[i] += e * vrow[i];
                                    }
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
                            const long rg = (long)r * n_kv + g;
                            if (k_q8) {
                                int8_t *kcode = (int8_t *)kv[2 * l] + rg * D * S;
                                for (int e = 0; e < D; e++) kcode[(long)e * S + slot] = kqc[rg * D + e];
                                for (int jb = 0; jb < nbq; jb++) kv_scales[2 * l][(rg * nbq + jb) * S + slot] = kqs[rg * nbq + jb];
                            } else
                                memcpy((float *)kv[2 * l] + (rg * S + slot) * D, k + rg * D, sizeof(float) * D);
                            if (v_q8) {
                                memcpy((int8_t *)kv[2 * l + 1] + (rg * S + slot) * D, vqc + rg * D, (size_t)D);
                                for (int jb = 0; jb < nbq; jb++) kv_scales[2 * l + 1][(rg * nbq + jb) * S + slot] = vqs[rg * nbq + jb];
                            } else
                                memcpy((float *)kv[2 * l + 1] + (rg * S + slot) * D, vn + rg * D, sizeof(float) * D);
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
