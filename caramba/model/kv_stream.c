/* The KV cache streams a decode step reads and writes (caramba.cache.streams), for decode_step.c.

   A stream is one layer's K or V as caramba.cache stores it, passed as a Stream (kv_stream.h):
     KV_FP32: fp32 values [M, n_kv, S, D]; the step reads them as a "ring" of S slots.
     KV_FP16, KV_BF16 (FloatStream of those dtypes): 16-bit values in the same layout, in codes
       (read_row widens a row exactly; a new token is rounded to nearest even, as torch's copy).
     per-token quantized kinds (QuantStream: q8_0, q4_0, q4_0l, nf4, q4_1, q2_1): codes packed per head
       vector, k = 8 / bits per byte: element i + f D/k sits in bit field f of byte i (8-bit codes:
       one signed code per byte); keys-major [M, n_kv, Dc, S] for keys, [M, n_kv, S, Dc] for values;
       fp16 block parameters [M, n_kv, nb * p, S] (the scales, then zero-point kinds' minimums);
       with a residual window the newest R positions also in fp32, in a ring [M, n_kv, R, D] at p % R.
     per-channel kinds (ChannelQuantStream, keys only: q4_1c, q2_1c): codes as above, but a block is
       G tokens of one channel: parameters [M, n_kv, 2 D, S / G]; a ring [M, n_kv, 2 G + R, D] holds
       the group not yet complete and the residual window. A group is quantized when its last
       token arrives (complete_group, before the step's attention reads it).
   Positions below r0 are read from codes, the rest from the ring; fast_decode computes r0 with
   the stream's own fp_start.
   A ring cache's stream (wrap > 0: caramba.cache.ring, a hybrid model's sliding layers) holds slot s
   at storage slot s % wrap in any of these layouts; its kinds are per-token ones without a
   residual window, so every function here takes storage slots as they are.
   A packed store (a per-head press's layer, caramba.cache.packed) holds the same codes with every
   row and head's slots back to back: [Dc, store] / [store, Dc] / [nb p, store] (per-channel
   parameters [2 D, store / G]), head rg's slot i at store slot org[rg] + i. Every function here
   addresses codes through head_at (kv_stream.h), which gives the regular layout's (rg, S, 0) or
   the store's (0, store, org[rg]); rings are per head in either layout (KV_FP32's values, its
   "ring", are the store itself: ring_row).

   Code u stands for (u + off) s (q8_0: signed c + 1/2; q4_0: u - 15/2; q4_0l: u - 8, s signed),
   NF4[u] s (nf4: a 16-level codebook) or u s + m (the zero-point kinds). The quantizers are caramba.cache.quant's arithmetic step by
   step (the same fp32 operations in the same order, fp16 rounding to nearest even, the minimum
   rounded down), so the codes written here are the torch path's bit for bit, with F16C or
   without (tests compare both builds against caramba.cache.quant.quantize).

   The kinds (ids, bits, code ranges, offsets, nf4's codebook) are caramba.cache.kinds' table
   (caramba/cache/kinds.h); kv_stream.h declares what decode_step.c calls. */

#include "kv_stream.h"
#include "kv_codes.h"

#include <math.h>
#include <stdlib.h>

/* The nf4 tables for tests: levels [16], midpoints [15]. */
void kv_nf4_tables(float *levels, float *midpoints) {
    memcpy(levels, NF4_LEVELS, sizeof NF4_LEVELS);
    memcpy(midpoints, NF4_MIDPOINTS, sizeof NF4_MIDPOINTS);
}

/* f as fp16, rounded to nearest even: the portable reference, and the conversion instruction. */
static inline uint16_t fp32_to_fp16_ref(float f) {
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
}

static inline uint16_t fp32_to_fp16(float f) {
#if defined(__F16C__)
    if (g_isa >= ISA_AVX2) return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#endif
    return fp32_to_fp16_ref(f);
}

/* x as fp16 rounded toward -inf (quant._round_down_fp16: nearest, then one step down if above x). */
static inline uint16_t fp32_to_fp16_down(float x) {
    const uint16_t h = fp32_to_fp16(x);
    if (!(fp16_to_fp32(h) > x)) return h;
    return (h & 0x7fff) == 0 ? 0x8001 : (h & 0x8000) ? h + 1 : h - 1;   /* nextafter(h, -inf) */
}

/* n fp16 values as floats. */
static inline void fp16_row(const uint16_t *src, float *dst, int n) {
    int i = 0;
#if HAVE_AVX2 && defined(__F16C__)
    if (g_isa >= ISA_AVX2)
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++) dst[i] = fp16_to_fp32(src[i]);   /* the reference, and the vectors' tail */
}

/* n bf16 values as floats: the top half of each float's bits. */
static inline void bf16_row(const uint16_t *src, float *dst, int n) {
    int i = 0;
#if HAVE_AVX2
    if (g_isa >= ISA_AVX2)
        for (; i + 8 <= n; i += 8) {
            const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
            _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
        }
#endif
    for (; i < n; i++) {
        const uint32_t u = (uint32_t)src[i] << 16;
        memcpy(dst + i, &u, sizeof u);
    }
}

/* f as bf16, rounded to nearest even: torch's conversion (c10's round_to_nearest_even; a NaN
   becomes a quiet NaN). */
static inline uint16_t fp32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

HIDDEN void widen_row(int kind, const uint16_t *src, float *dst, int n) {
    if (kind == KV_FP16) fp16_row(src, dst, n);
    else bf16_row(src, dst, n);
}

/* x [D] as kind's 16-bit values. */
static void to_half(int kind, const float *x, int D, uint16_t *h) {
    if (kind == KV_FP16)
        for (int i = 0; i < D; i++) h[i] = fp32_to_fp16(x[i]);
    else
        for (int i = 0; i < D; i++) h[i] = fp32_to_bf16(x[i]);
}

HIDDEN void float_as_stored(int kind, const float *x, int D, float *out) {
    if (kind == KV_FP32) {
        memcpy(out, x, sizeof(float) * D);
        return;
    }
    uint16_t h[512];                 /* stream_ok: D <= 512 */
    to_half(kind, x, D, h);
    widen_row(kind, h, out, D);
}

/* What a block's parameters come from: its lowest and highest element (zero-point kinds), else its
   largest magnitude and the first element of that magnitude (mid-tread kinds: its sign kept). */
typedef struct { float lo, hi, amax, peak; } Extremes;

static Extremes extremes_ref(int kind, const float *x, int n) {
    Extremes e = {x[0], x[0], 0.0f, x[0]};   /* only what the kind's parameters read */
    if (kv_zero_point(kind))
        for (int i = 1; i < n; i++) {
            e.lo = x[i] < e.lo ? x[i] : e.lo;
            e.hi = x[i] > e.hi ? x[i] : e.hi;
        }
    else if (KV_MID_TREAD[kind])
        for (int i = 1; i < n; i++) e.peak = fabsf(x[i]) > fabsf(e.peak) ? x[i] : e.peak;
    else
        for (int i = 0; i < n; i++) e.amax = fmaxf(e.amax, fabsf(x[i]));
    return e;
}

/* The block's scale (and minimum) as quant._block_codes makes them -> the divisor its codes take
   (the scale, 1e-30 for a zero scale) and, zero-point kinds, the minimum as a float (*mf). An
   extreme of zero is taken as +0 (x + 0), whichever zero a reduction meets first: torch's order
   and the C loops' differ. */
static float block_params(int kind, Extremes e, uint16_t *scale, uint16_t *minimum, float *mf) {
    const double widen = 1.0 + 1.0 / 1024;   /* the scale rounded up: no element clips */
    float s;
    *mf = 0.0f;
    if (kv_zero_point(kind)) {
        const uint16_t m = fp32_to_fp16_down(e.lo + 0.0f);
        *mf = fp16_to_fp32(m);
        *minimum = m;
        s = (e.hi + 0.0f - *mf) * (float)(widen / KV_HALF_RANGE[kind]);   /* min + hi * scale >= max */
    } else if (KV_MID_TREAD[kind])   /* the largest-magnitude element lands on code lo */
        s = e.peak * (float)(-widen / KV_HALF_RANGE[kind]);
    else                             /* mid-rise (q8_0, q4_0) and nf4's codebook peak */
        s = e.amax * (float)(widen / KV_HALF_RANGE[kind]);
    *scale = fp32_to_fp16(s);
    const float safe = fp16_to_fp32(*scale);
    return safe == 0.0f ? 1e-30f : safe;
}

/* One block of n elements -> codes u (one per byte; 8-bit codes as int8 bits) and its scale
   (and minimum), as quant._block_codes computes them. */
static void quantize_block(int kind, const float *x, int n, uint8_t *u, uint16_t *scale, uint16_t *minimum) {
    float mf;
    const float safe = block_params(kind, extremes_ref(kind, x, n), scale, minimum, &mf);
    if (kv_zero_point(kind)) {
        const int hi = KV_HI[kind];
        for (int i = 0; i < n; i++) {
            const float c = floorf((x[i] - mf) / safe + 0.5f);
            u[i] = (uint8_t)(c < 0.0f ? 0.0f : (c > (float)hi ? (float)hi : c));
        }
        return;
    }
    if (kind == KV_NF4) {       /* the nearest level: torch.bucketize(y, midpoints), right=False */
        for (int i = 0; i < n; i++) {
            const float y = x[i] / safe;
            int c = 0;   /* the midpoints strictly below y: a y exactly on one takes the lower level */
            for (int k = 0; k < 15; k++) c += NF4_MIDPOINTS[k] < y;
            u[i] = (uint8_t)c;
        }
        return;
    }
    const float lo = (float)KV_LO[kind], hi = (float)KV_HI[kind], shift = KV_SHIFT[kind];
    for (int i = 0; i < n; i++) {
        const float y = x[i] / safe, c = floorf(shift != 0.0f ? y + shift : y);
        const float cl = c < lo ? lo : (c > hi ? hi : c);
        u[i] = lo < 0.0f ? (uint8_t)(int8_t)cl : (uint8_t)cl;
    }
}

#if HAVE_AVX2
/* extremes_ref 8 elements at a time (n % 8 == 0): min, max and the largest magnitude are exact in
   any order but for a zero's sign, which block_params takes away; the peak is the first element of
   the largest magnitude, found by a scan. */
static Extremes extremes_avx2(int kind, const float *x, int n) {
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 lo = _mm256_loadu_ps(x), hi = lo, am = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        lo = _mm256_min_ps(lo, v), hi = _mm256_max_ps(hi, v), am = _mm256_max_ps(am, _mm256_and_ps(v, abs));
    }
    float l[8], h[8], a[8];
    _mm256_storeu_ps(l, lo), _mm256_storeu_ps(h, hi), _mm256_storeu_ps(a, am);
    Extremes e = {l[0], h[0], 0.0f, x[0]};
    for (int k = 0; k < 8; k++) {
        e.lo = l[k] < e.lo ? l[k] : e.lo;
        e.hi = h[k] > e.hi ? h[k] : e.hi;
        e.amax = a[k] > e.amax ? a[k] : e.amax;
    }
    if (KV_MID_TREAD[kind])
        for (int i = 0; i < n; i++)
            if (fabsf(x[i]) == e.amax) { e.peak = x[i]; break; }
    return e;
}

/* quantize_block for the uniform kinds (not nf4) with n % 8 == 0, 8 elements at a time: the same
   IEEE operations per element (the division by the scale, the shift, floor and the clamp), so the
   same codes and parameters bit for bit; the scalar loops' ~3.5x of torch's time on a context's
   store was their one element at a time. */
static void quantize_block_avx2(int kind, const float *x, int n, uint8_t *u, uint16_t *scale, uint16_t *minimum) {
    float mf;
    const float safe = block_params(kind, extremes_avx2(kind, x, n), scale, minimum, &mf);
    const int zp = kv_zero_point(kind);
    const float add = zp ? 0.5f : KV_SHIFT[kind], lo = zp ? 0.0f : (float)KV_LO[kind], hi = (float)KV_HI[kind];
    const __m256 sv = _mm256_set1_ps(safe), mv = _mm256_set1_ps(mf), av = _mm256_set1_ps(add);
    const __m256 lv = _mm256_set1_ps(lo), hv = _mm256_set1_ps(hi);
    for (int i = 0; i < n; i += 8) {
        __m256 y = _mm256_loadu_ps(x + i);
        if (zp) y = _mm256_sub_ps(y, mv);
        y = _mm256_div_ps(y, sv);
        if (add != 0.0f) y = _mm256_add_ps(y, av);
        const __m256 c = _mm256_min_ps(_mm256_max_ps(_mm256_floor_ps(y), lv), hv);
        const __m256i q = _mm256_cvttps_epi32(c);
        const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        _mm_storel_epi64((__m128i *)(u + i), _mm_packs_epi16(w, w));   /* int8 bits; codes fit */
    }
}
#endif

/* A head vector of D elements in blocks of qb -> codes u [D] and parameters [D/qb * p] laid out
   as quant.quantize's (the scales, then the minimums). */
HIDDEN void quantize_vector(int kind, const float *x, int D, int qb, uint8_t *u, uint16_t *par) {
    const int nb = D / qb;
#if HAVE_AVX2
    if (g_isa >= ISA_AVX2 && kind != KV_NF4 && qb % 8 == 0) {
        for (int j = 0; j < nb; j++) quantize_block_avx2(kind, x + j * qb, qb, u + j * qb, par + j, par + nb + j);
        return;
    }
#endif
    for (int j = 0; j < nb; j++) quantize_block(kind, x + j * qb, qb, u + j * qb, par + j, par + nb + j);
}

/* The quantizers for tests: rows [rows, D] -> codes [rows, D] (unpacked), parameters [rows, D/qb * p].
   A per-channel kind quantizes each row as one block (a channel's group of D = G tokens). */
void quantize_kv(int kind, const float *x, int rows, int D, int qb, uint8_t *u, uint16_t *par) {
    const int np = (kv_zero_point(kind) ? 2 : 1) * (D / qb);
    for (int r = 0; r < rows; r++) quantize_vector(kind, x + (long)r * D, D, qb, u + (long)r * D, par + (long)r * np);
}

/* A float stream's rounding for tests: x [n] as a stream of kind stores and reads it back (out [n]). */
void kv_round_floats(int kind, const float *x, int n, float *out) {
    for (int i = 0; i < n; i += 512) float_as_stored(kind, x + i, n - i < 512 ? n - i : 512, out + i);
}

/* Code field f of byte b: 8-bit kinds' signed code, else the f-th `bits`-wide unsigned field. */
INLINE float code_field(const int bits, const int f, uint8_t b) {
    if (bits == 8) return (float)(int8_t)b;
    return (float)((b >> (bits * f)) & ((1 << bits) - 1));
}

/* What field f of byte b stands for before the scale: the code (nf == 0; the offset is added by
   the caller) or nf4's codebook level (nf == 1). */
INLINE float code_value(const int bits, const int f, const int nf, uint8_t b) {
    return nf ? NF4_LEVELS[(b >> (4 * f)) & 15] : code_field(bits, f, b);
}

/* Byte i of a head vector's packed codes u [D]. */
static inline uint8_t pack_byte(int bits, const uint8_t *u, int D, int i) {
    if (bits == 8) return u[i];
    const int fw = D * bits / 8;
    uint8_t b = 0;
    for (int f = 0; f < 8 / bits; f++) b |= (uint8_t)(u[i + f * fw] << (bits * f));
    return b;
}

/* Rows x [rows, D] -> packed codes [rows, D bits / 8] (pack_byte's layout) and parameters
   [rows, D/qb * p], laid out as caramba.cache.quant.quantize's: its fast path on the CPU (the
   cache's store of a whole context), the rows split between threads (their bits do not depend on
   it). Returns how many rows hold a non-finite element: their codes are left unwritten, and the
   caller quantizes the tensor on torch's path, whose NaN and inf go where torch's arithmetic puts them. */
long quantize_rows(int kind, const float *x, long rows, int D, int qb, uint8_t *codes, uint16_t *par, int nthreads) {
    const int np = (kv_zero_point(kind) ? 2 : 1) * (D / qb), bits = kv_bits(kind), fw = D * bits / 8;
    long bad = 0;
    if (D > 512) return rows;
#pragma omp parallel for num_threads(nthreads) schedule(static) reduction(+ : bad)
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * D;
        int finite = 1;
        for (int i = 0; i < D; i++) finite &= isfinite(xr[i]) != 0;
        if (!finite) {
            bad++;
            continue;
        }
        uint8_t u[512];
        quantize_vector(kind, xr, D, qb, u, par + r * np);
        for (int i = 0; i < fw; i++) codes[r * fw + i] = pack_byte(bits, u, D, i);
    }
    return bad;
}

/* The (bits, field) pairs a loop is specialized for: the shift and mask become constants. */
#define FIELD_CASES(X) X(8, 0) X(4, 0) X(4, 1) X(2, 0) X(2, 1) X(2, 2) X(2, 3)
#define NF4_CASES(X) X(4, 0) X(4, 1)     /* nf4's fields: codebook levels, cases 64 + bits * 4 + f */

/* Whether decode_step can read and write this stream for head size D (2: refused). */
HIDDEN int stream_ok(const Stream *s, int D, int keys) {
    if (s->kind < 0 || s->kind >= KV_KINDS || s->wrap < 0) return 0;
    if (s->kind == KV_FP32) return s->ring != NULL && s->r0 == 0 && (!s->wrap || s->ring_n == s->wrap);
    if (kv_float(s->kind))           /* fp16 / bf16: the values in codes, laid out as KV_FP32's ring */
        return s->codes != NULL && s->ring == NULL && s->ring_n > 0 && s->r0 == 0 && D <= 512
            && (!s->wrap || s->ring_n == s->wrap);
    if (s->wrap && (s->ring != NULL || kv_per_channel(s->kind))) return 0;   /* a ring: slot order is lost */
    if (s->block < 1 || (s->ring == NULL) != (s->ring_n == 0)) return 0;
    if (kv_per_channel(s->kind)) return keys && s->ring != NULL && D % 4 == 0;
    return D % s->block == 0 && D % 4 == 0;
}

#if HAVE_AVX2
/* Bytes ahead in each code row that key_field_slots16 asks the cache for: keys-major codes are
   read 16 slots at a time across a block's rows (32 rows, S bytes apart), more streams than the
   hardware prefetcher follows, and loads of q8_0's codes were two thirds of the key scores' time.
   SmolLM2, 8 rows of a q8_0 cache over 1024 tokens, 2 threads, Zen 4: a step 40 -> 37 ms. */
#define KEY_PREFETCH 256
/* t[jj, i..i + 16) for jn <= 4 heads (a constant in each instance, so the sums stay in registers:
   with a run-time count the compiler kept them on the stack): rows [a, b) of field f. */
INLINE void key_field_slots16(const int bits, const int f, const int nf, const int jn, const uint8_t *c0, long S,
                              const float *qj, int D, int a, int b, int i, float *t, int n) {
    __m256 acc[4][2];
    for (int jj = 0; jj < jn; jj++) acc[jj][0] = acc[jj][1] = _mm256_setzero_ps();
    const int ahead = (i & 63) == 0 && i + KEY_PREFETCH < n;   /* once a cache line of each row */
    for (int row = a; row < b; row++) {
        const uint8_t *cr = c0 + (long)(row - a) * S + i;
        if (ahead) _mm_prefetch((const char *)cr + KEY_PREFETCH, _MM_HINT_T0);
        const __m256 v0 = code_values8(bits, f, nf, cr), v1 = code_values8(bits, f, nf, cr + 8);
        for (int jj = 0; jj < jn; jj++) {
            const __m256 qv = _mm256_broadcast_ss(qj + (long)jj * D + row);
            acc[jj][0] = _mm256_fmadd_ps(qv, v0, acc[jj][0]);
            acc[jj][1] = _mm256_fmadd_ps(qv, v1, acc[jj][1]);
        }
    }
    for (int jj = 0; jj < jn; jj++) {
        _mm256_storeu_ps(t + (long)jj * n + i, acc[jj][0]);
        _mm256_storeu_ps(t + (long)jj * n + i + 8, acc[jj][1]);
    }
}
#endif

#if HAVE_AVX512
/* key_field_slots16 in one 512-bit vector of slots: each lane's sum the same. Taken for nf4 keys:
   perf on SmolLM2's 8-row step at 2048 tokens (one thread, Zen 4) counted ~30% fewer samples in
   the key scores for nf4 (three runs), but 17-29% more for q4_0, q4_1 and q8_0, whose 8-code
   widening the permute and a 512-bit widen do not beat on a core with 256-bit units. */
INLINE void key_field_slots16_512(const int bits, const int f, const int jn, const uint8_t *c0, long S, const float *qj,
                                  int D, int a, int b, int i, float *t, int n, __m512 table) {
    __m512 acc[4];
    for (int jj = 0; jj < jn; jj++) acc[jj] = _mm512_setzero_ps();
    const int ahead = (i & 63) == 0 && i + KEY_PREFETCH < n;
    for (int row = a; row < b; row++) {
        const uint8_t *cr = c0 + (long)(row - a) * S + i;
        if (ahead) _mm_prefetch((const char *)cr + KEY_PREFETCH, _MM_HINT_T0);
        const __m512 v = code_values16(bits, f, cr, table);
        for (int jj = 0; jj < jn; jj++) acc[jj] = _mm512_fmadd_ps(_mm512_set1_ps(qj[(long)jj * D + row]), v, acc[jj]);
    }
    for (int jj = 0; jj < jn; jj++) _mm512_storeu_ps(t + (long)jj * n + i, acc[jj]);
}
#endif

/* The portable reference of key_field_slots16, for slots [i0, n): t[jj, i] for jn heads, row by row. */
INLINE void key_field_slots_ref(const int bits, const int f, const int nf, int jn, const uint8_t *c0, long S,
                                const float *qj, int D, int a, int b, int i0, float *t, int n) {
    for (int i = i0; i < n; i++)
        for (int jj = 0; jj < jn; jj++) {
            float acc = 0.0f;
            for (int row = a; row < b; row++) acc += qj[(long)jj * D + row] * code_value(bits, f, nf, c0[(long)(row - a) * S + i]);
            t[(long)jj * n + i] = acc;
        }
}

/* t[j, i] = q_j . the codes of field f, rows [a, b), positions [p0, p0 + n); qsum[j] = sum of those
   q_j elements. Slots in vectors of 8 with up to 4 heads' sums in registers, the block's rows in
   the inner loop: each code is loaded and widened once for every head, and no partial sum goes
   through memory (sums taken in row order, as a row-by-row loop would). */
INLINE void key_field_rows(const int bits, const int f, const int nf, const uint8_t *codes, long S, int p0, int n,
                           int fw, const float *q, int D, int rep, int a, int b, float *t, float *qsum) {
    for (int j = 0; j < rep; j++) {
        qsum[j] = 0.0f;
        for (int row = a; row < b; row++) qsum[j] += q[(long)j * D + row + f * fw];
    }
    const uint8_t *c0 = codes + (long)a * S + p0;
    for (int j0 = 0; j0 < rep; j0 += 4) {
        const int jn = rep - j0 < 4 ? rep - j0 : 4;
        const float *qj = q + (long)j0 * D + f * fw;
        float *tj = t + (long)j0 * n;
        int i = 0;
#if HAVE_AVX512   /* nf4 only: its lookup is code_values8's two permutes and a blend (see key_field_slots16_512) */
        if (nf && g_isa >= ISA_AVX512) {
            const __m512 table = code_table16(bits, nf, 0.0f);
            for (; i + 16 <= n; i += 16)
            switch (jn) {
                case 1: key_field_slots16_512(bits, f, 1, c0, S, qj, D, a, b, i, tj, n, table); break;
                case 2: key_field_slots16_512(bits, f, 2, c0, S, qj, D, a, b, i, tj, n, table); break;
                case 3: key_field_slots16_512(bits, f, 3, c0, S, qj, D, a, b, i, tj, n, table); break;
                default: key_field_slots16_512(bits, f, 4, c0, S, qj, D, a, b, i, tj, n, table); break;
            }
        }
#endif
#if HAVE_AVX2
        if (g_isa >= ISA_AVX2)
            for (; i + 16 <= n; i += 16)      /* two vectors of slots: each row read 16 codes at a time */
            switch (jn) {
                case 1: key_field_slots16(bits, f, nf, 1, c0, S, qj, D, a, b, i, tj, n); break;
                case 2: key_field_slots16(bits, f, nf, 2, c0, S, qj, D, a, b, i, tj, n); break;
                case 3: key_field_slots16(bits, f, nf, 3, c0, S, qj, D, a, b, i, tj, n); break;
                default: key_field_slots16(bits, f, nf, 4, c0, S, qj, D, a, b, i, tj, n); break;
            }
#endif
        key_field_slots_ref(bits, f, nf, jn, c0, S, qj, D, a, b, i, tj, n);
    }
}

/* sc[j, i] (row stride ld) = q_j . k(p0 + i) for the rep query heads q [rep, D] over positions
   [p0, p0 + n) of a per-token stream's codes, head rg: per block, s (q . u) + (s off or m) sum(q)
   (nf4: s (q . NF4[u])),
   block by block with the slots in the inner loop (keys-major: a code row's positions are
   contiguous). Scratch: t [rep, n], sf and bf [n]. */
HIDDEN void key_scores_tokens(const Stream *st, long rg, long S, int D, const float *q, int rep, int p0, int n,
                              float *sc, int ld, float *t, float *sf, float *bf) {
    const int bits = kv_bits(st->kind), fw = D * bits / 8, qb = st->block, nb = D / qb, zp = kv_zero_point(st->kind);
    const int nf = st->kind == KV_NF4;
    const float off = kv_offset(st->kind);
    const HeadAt h = head_at(st, rg, S);
    rg = h.rg, S = h.S, p0 += (int)h.at;
    const uint8_t *codes = (const uint8_t *)st->codes + rg * fw * S;
    const uint16_t *par = st->params + rg * (zp ? 2 : 1) * nb * S;
    for (int j = 0; j < rep; j++) memset(sc + (long)j * ld, 0, sizeof(float) * n);
    for (int f = 0; f < 8 / bits; f++)
        for (int a = 0; a < fw;) {     /* rows [a, b) of field f: one block */
            const int blk = (a + f * fw) / qb, b = (blk + 1) * qb - f * fw < fw ? (blk + 1) * qb - f * fw : fw;
            float qsum[64];
            switch (nf * 64 + bits * 4 + f) {
#define KEY_FIELD(B, F) case B * 4 + F: key_field_rows(B, F, 0, codes, S, p0, n, fw, q, D, rep, a, b, t, qsum); break;
                FIELD_CASES(KEY_FIELD)
#define KEY_FIELD_NF4(B, F) case 64 + B * 4 + F: key_field_rows(B, F, 1, codes, S, p0, n, fw, q, D, rep, a, b, t, qsum); break;
                NF4_CASES(KEY_FIELD_NF4)
            }
            fp16_row(par + (long)blk * S + p0, sf, n);
            if (zp) fp16_row(par + (long)(nb + blk) * S + p0, bf, n);
            for (int j = 0; j < rep; j++) {
                float *restrict sj = sc + (long)j * ld;
                const float *restrict tj = t + (long)j * n;
                const float qs = qsum[j], oq = off * qsum[j];
                if (zp) for (int i = 0; i < n; i++) sj[i] += sf[i] * tj[i] + bf[i] * qs;
                else for (int i = 0; i < n; i++) sj[i] += sf[i] * (tj[i] + oq);
            }
            a = b;
        }
}

/* Field f of a per-channel group's rows: sc[j, i] += (q_j[e] s_e) u_e(a + i), cst[j] += q_j[e] m_e. */
INLINE void channel_field_rows(const int bits, const int f, const uint8_t *codes, long S, const uint16_t *par, int NG,
                               int g, int a, int w, int fw, const float *q, int D, int rep, float *sc, int ld,
                               float *cst) {
    for (int row = 0; row < fw; row++) {
        const int e = row + f * fw;
        const float s = fp16_to_fp32(par[(long)e * NG + g]), m = fp16_to_fp32(par[(long)(D + e) * NG + g]);
        const uint8_t *restrict c = codes + (long)row * S + a;
        for (int j = 0; j < rep; j++) {
            const float qe = q[(long)j * D + e], ws = qe * s;
            float *restrict sj = sc + (long)j * ld;
            cst[j] += qe * m;
            for (int i = 0; i < w; i++) sj[i] += ws * code_field(bits, f, c[i]);
        }
    }
}

/* The reference for one group's w slots from a: sc[j, i] = q_j . (s u + m) over the channels, field
   by field, one slot at a time. */
static void channel_group_ref(int bits, const uint8_t *codes, long S, const uint16_t *par, int NG, int g, int a, int w,
                              int fw, const float *q, int D, int rep, float *sc, int ld) {
    float cst[64] = {0};
    for (int f = 0; f < 8 / bits; f++)
        switch (bits * 4 + f) {
#define CHANNEL_FIELD(B, F) case B * 4 + F: channel_field_rows(B, F, codes, S, par, NG, g, a, w, fw, q, D, rep, sc, ld, cst); break;
            FIELD_CASES(CHANNEL_FIELD)
#undef CHANNEL_FIELD
        }
    for (int j = 0; j < rep; j++)
        for (int i = 0; i < w; i++) sc[(long)j * ld + i] += cst[j];
}

/* key_scores_tokens for a per-channel stream: per group, q times the group's channel scales
   (qs) against the codes, plus one constant per group and head, q . the group's minimums (as
   quant_attend.c's key_item_channel). */
#if HAVE_AVX2
/* The q-side factors of groups [g0, g0 + ng), ng <= 8: qs8[(j D + e) 8 + gi] = q_j[e] s_e(g0 + gi)
   and cst8[j 8 + gi] = sum_e q_j[e] m_e(g0 + gi). The parameters lie [2 D, NG], contiguous over
   groups, so 8 groups take one vector per channel; one group at a time took D strided scalar
   conversions and D x rep scalar products, ~30% of a 32-slot group's scoring. Scratch: sm [2 D, 8]. */
static void channel_group_factors8(const uint16_t *par, int NG, int D, const float *q, int rep, int g0, int ng,
                                   float *qs8, float *cst8, float *sm) {
    for (int e = 0; e < 2 * D; e++) {   /* the scales, then the minimums, of channel e % D */
        const uint16_t *src = par + (long)e * NG + g0;
#if defined(__F16C__)
        if (ng == 8) {
            _mm256_storeu_ps(sm + (long)e * 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)src)));
            continue;
        }
#endif
        for (int gi = 0; gi < 8; gi++) sm[(long)e * 8 + gi] = gi < ng ? fp16_to_fp32(src[gi]) : 0.0f;
    }
    for (int j = 0; j < rep; j++) {
        __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps();   /* even and odd channels: two chains */
        for (int e = 0; e < D; e += 2) {
            const __m256 q0 = _mm256_set1_ps(q[(long)j * D + e]), q1 = _mm256_set1_ps(q[(long)j * D + e + 1]);
            _mm256_storeu_ps(qs8 + ((long)j * D + e) * 8, _mm256_mul_ps(q0, _mm256_loadu_ps(sm + (long)e * 8)));
            _mm256_storeu_ps(qs8 + ((long)j * D + e + 1) * 8, _mm256_mul_ps(q1, _mm256_loadu_ps(sm + (long)(e + 1) * 8)));
            c0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(sm + (long)(D + e) * 8), c0);
            c1 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(sm + (long)(D + e + 1) * 8), c1);
        }
        _mm256_storeu_ps(cst8 + (long)j * 8, _mm256_add_ps(c0, c1));
    }
}

/* sc[jj, i..i + 8 W) = cst[jj] + sum over channels e of qs[jj][e] code_e(p), for W (1 or 2)
   vectors of slots and jn <= 4 heads, qs[jj][e] at qs[(jj D + e) 8], cst[jj] at cst[jj 8]. Each
   code byte is loaded and widened once for all its fields, every field once for every head; the
   sums stay in registers (bits, W and jn are constants in each instance: with a run-time head
   count the compiler kept them on the stack, a load and a store around every multiply-add). */
INLINE void channel_scores(const int bits, const int W, const int jn, const uint8_t *codes, long S, const float *qs,
                           const float *cst, int i, int fw, int D, float *sc, int ld) {
    __m256 acc[4][2];
    for (int jj = 0; jj < jn; jj++) acc[jj][0] = acc[jj][1] = _mm256_set1_ps(cst[(long)jj * 8]);
    const __m256i mask = _mm256_set1_epi32((1 << bits) - 1);
    for (int row = 0; row < fw; row++) {
        const uint8_t *c = codes + (long)row * S + i;
        const __m256i u0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c));
        const __m256i u1 = W == 2 ? _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + 8))) : u0;
        for (int f = 0; f < 8 / bits; f++) {
            const __m256 v0 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(u0, bits * f), mask));
            const __m256 v1 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(u1, bits * f), mask));
            const float *qe = qs + (long)(row + f * fw) * 8;
            for (int jj = 0; jj < jn; jj++) {
                const __m256 qv = _mm256_broadcast_ss(qe + (long)jj * D * 8);
                acc[jj][0] = _mm256_fmadd_ps(qv, v0, acc[jj][0]);
                if (W == 2) acc[jj][1] = _mm256_fmadd_ps(qv, v1, acc[jj][1]);
            }
        }
    }
    for (int jj = 0; jj < jn; jj++) {
        _mm256_storeu_ps(sc + (long)jj * ld, acc[jj][0]);
        if (W == 2) _mm256_storeu_ps(sc + (long)jj * ld + 8, acc[jj][1]);
    }
}

/* channel_scores with constant bits, W and jn. */
static void channel_scores_any(int bits, int W, int jn, const uint8_t *codes, long S, const float *qs, const float *cst,
                               int i, int fw, int D, float *sc, int ld) {
    switch ((bits == 4) * 8 + (W == 2) * 4 + jn - 1) {
#define CHANNEL_SCORES(B, W_, J) \
        case (B == 4) * 8 + (W_ == 2) * 4 + J - 1: channel_scores(B, W_, J, codes, S, qs, cst, i, fw, D, sc, ld); break;
#define CHANNEL_SCORES_J(B, W_) CHANNEL_SCORES(B, W_, 1) CHANNEL_SCORES(B, W_, 2) CHANNEL_SCORES(B, W_, 3) CHANNEL_SCORES(B, W_, 4)
        CHANNEL_SCORES_J(2, 1) CHANNEL_SCORES_J(2, 2) CHANNEL_SCORES_J(4, 1) CHANNEL_SCORES_J(4, 2)
    }
}
#endif

HIDDEN void key_scores_channels(const Stream *st, long rg, long S, int D, const float *q, int rep, int p0, int n,
                                float *sc, int ld, float *scratch) {
    const HeadAt h = head_at(st, rg, S);
    rg = h.rg, S = h.S, p0 += (int)h.at;
    const int bits = kv_bits(st->kind), fw = D * bits / 8, G = st->block, NG = (int)(S / G);
    const uint8_t *codes = (const uint8_t *)st->codes + rg * fw * S;
    const uint16_t *par = st->params + rg * 2 * D * NG;
    const int gend = (p0 + n + G - 1) / G;
#if HAVE_AVX2
    const int vec = G % 8 == 0 && g_isa >= ISA_AVX2;   /* groups of whole slot vectors: else every group takes the reference */
    float *qs8 = scratch, *sm = qs8 + (size_t)8 * rep * D, *cst8 = sm + 16 * (size_t)D;
#else
    (void)scratch;
#endif
    for (int j = 0; j < rep; j++) memset(sc + (long)j * ld, 0, sizeof(float) * n);
    for (int g0 = p0 / G; g0 < gend; g0 += 8) {
        const int ng = gend - g0 < 8 ? gend - g0 : 8;
#if HAVE_AVX2
        if (vec) channel_group_factors8(par, NG, D, q, rep, g0, ng, qs8, cst8, sm);
#endif
        for (int g = g0; g < g0 + ng; g++) {
            const int a = g * G > p0 ? g * G : p0, b = (g + 1) * G < p0 + n ? (g + 1) * G : p0 + n;
#if HAVE_AVX2
            if (vec && (b - a) % 8 == 0) {      /* whole vectors of slots (a full group of 8, 16, 32 ...) */
                for (int j0 = 0; j0 < rep; j0 += 4) {
                    const int jn = rep - j0 < 4 ? rep - j0 : 4;
                    const float *qs = qs8 + (long)j0 * D * 8 + (g - g0), *cst = cst8 + (long)j0 * 8 + (g - g0);
                    float *out = sc + (long)j0 * ld - p0;
                    int i = a;
                    for (; i + 16 <= b; i += 16) channel_scores_any(bits, 2, jn, codes, S, qs, cst, i, fw, D, out + i, ld);
                    if (i < b) channel_scores_any(bits, 1, jn, codes, S, qs, cst, i, fw, D, out + i, ld);
                }
                continue;
            }
#endif
            channel_group_ref(bits, codes, S, par, NG, g, a, b - a, fw, q, D, rep, sc + (a - p0), ld);
        }
    }
}

/* Field f of a value row's codes as floats from element i0 on: the reference, one at a time. */
INLINE void decode_field_ref(const int bits, const int f, const int nf, const uint8_t *row, int fw, float off, int i0,
                             float *out) {
    for (int i = i0; i < fw; i++) out[f * fw + i] = nf ? code_value(bits, f, 1, row[i]) : code_field(bits, f, row[i]) + off;
}

INLINE void decode_field(const int bits, const int f, const int nf, const uint8_t *row, int fw, float off, float *out) {
    int i = 0;
#if HAVE_AVX2   /* explicit: the compiler's own vectorization of this loop took 4 floats at a time */
    if (g_isa >= ISA_AVX2)
        for (; i + 8 <= fw; i += 8)
            _mm256_storeu_ps(out + f * fw + i, nf ? code_values8(bits, f, 1, row + i)
                                                  : _mm256_add_ps(code_fields8(bits, f, row + i), _mm256_set1_ps(off)));
#endif
    decode_field_ref(bits, f, nf, row, fw, off, i, out);
}

#if HAVE_AVX2
/* o_j [col, col + 8 NV) += sum over the slots k of w_j[k] x_k, x_k the columns' decoded codes (field f
   at byte cb of each fw-byte row, + off), for jn <= 3 heads: their sums in registers across the
   slots, each row's codes decoded once for every head. Slots with no live weight (live[k] == 0)
   are skipped, as value rows no head weighs are. */
INLINE void value_code_cols(const int bits, const int f, const int nf, const int jn, const int NV, const uint8_t *rows,
                            int fw, int cb, int cn, const uint8_t *live, const float *w, int wl, float off, float *o,
                            int ow, int col) {
    __m256 acc[3][4];
    for (int jj = 0; jj < jn; jj++)
        for (int v = 0; v < NV; v++) acc[jj][v] = _mm256_loadu_ps(o + (long)jj * ow + col + 8 * v);
    const __m256 offv = _mm256_set1_ps(off);
    for (int k = 0; k < cn; k++) {
        if (!live[k]) continue;
        const uint8_t *c = rows + (long)k * fw + cb;
        __m256 x[4];
        for (int v = 0; v < NV; v++) {
            x[v] = code_values8(bits, f, nf, c + 8 * v);
            if (off != 0.0f) x[v] = _mm256_add_ps(x[v], offv);
        }
        for (int jj = 0; jj < jn; jj++) {
            const __m256 wv = _mm256_broadcast_ss(w + (long)jj * wl + k);
            for (int v = 0; v < NV; v++) acc[jj][v] = _mm256_fmadd_ps(wv, x[v], acc[jj][v]);
        }
    }
    for (int jj = 0; jj < jn; jj++)
        for (int v = 0; v < NV; v++) _mm256_storeu_ps(o + (long)jj * ow + col + 8 * v, acc[jj][v]);
}

#if HAVE_AVX512
/* value_code_cols in 512-bit vectors (NV of them: 2 or 1) for 2- and 4-bit codes, decoded through
   code_values16 (table: the codes' values + off: no mask, no offset to add, nf4's lookup in one
   permute): each lane's sum the same. Taken for nf4 and 2-bit codes, where perf (as for
   key_field_slots16_512, three alternated runs) counted 12-14% fewer samples in value_codes; q4_0's
   were the same, q4_1's 5% and q8_0's 7% more, so those keep the 256-bit loop. */
INLINE void value_code_cols512(const int bits, const int f, const int jn, const int NV, const uint8_t *rows, int fw,
                               int cb, int cn, const uint8_t *live, const float *w, int wl, __m512 table, float *o,
                               int ow, int col) {
    __m512 acc[3][2];
    for (int jj = 0; jj < jn; jj++)
        for (int v = 0; v < NV; v++) acc[jj][v] = _mm512_loadu_ps(o + (long)jj * ow + col + 16 * v);
    for (int k = 0; k < cn; k++) {
        if (!live[k]) continue;
        const uint8_t *c = rows + (long)k * fw + cb;
        __m512 x[2];
        for (int v = 0; v < NV; v++) x[v] = code_values16(bits, f, c + 16 * v, table);
        for (int jj = 0; jj < jn; jj++) {
            const __m512 wv = _mm512_set1_ps(w[(long)jj * wl + k]);
            for (int v = 0; v < NV; v++) acc[jj][v] = _mm512_fmadd_ps(wv, x[v], acc[jj][v]);
        }
    }
    for (int jj = 0; jj < jn; jj++)
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(o + (long)jj * ow + col + 16 * v, acc[jj][v]);
}
#endif

/* value_code_cols for field f of every column group of 8 NV in the block of width vqb (NV 4 or 2). */
INLINE void value_code_field(const int bits, const int f, const int nf, const int jn, const uint8_t *rows, int fw,
                             int cn, const uint8_t *live, const float *w, int vqb, int cnl, float off, float *o,
                             int ow) {
    const int NV = fw % 32 == 0 && vqb % 32 == 0 ? 4 : 2;
#if HAVE_AVX512
    const int wide = g_isa >= ISA_AVX512 && (bits == 2 || nf);   /* where it measured faster (value_code_cols512) */
    const __m512 table = wide ? code_table16(bits, nf, off) : _mm512_setzero_ps();
#endif
    for (int cb = 0; cb < fw; cb += 8 * NV) {
        const int col = f * fw + cb;
        const float *wb = w + (long)(col / vqb) * 3 * cnl;   /* the block's weights, [3 heads, cnl] */
#if HAVE_AVX512
        if (wide) {
            if (NV == 4) value_code_cols512(bits, f, jn, 2, rows, fw, cb, cn, live, wb, cnl, table, o, ow, col);
            else value_code_cols512(bits, f, jn, 1, rows, fw, cb, cn, live, wb, cnl, table, o, ow, col);
            continue;
        }
#endif
        if (NV == 4) value_code_cols(bits, f, nf, jn, 4, rows, fw, cb, cn, live, wb, cnl, off, o, ow, col);
        else value_code_cols(bits, f, nf, jn, 2, rows, fw, cb, cn, live, wb, cnl, off, o, ow, col);
    }
}
#endif

/* p V of a chunk of cn <= 16 coded value slots [p0, p0 + cn) of a per-token stream, head rg, straight
   from their codes: o_j [D] (o + j ow) += sum_k e_j[k] s_kb x_k for the rep heads (e_j at e + j ld),
   and for zero-point kinds bsum_j [nb] += sum_k e_j[k] m_kb, each head's sums in slot order as
   value_rows' decoded rows give them (the same products: the same bits). Where the step decoded
   each slot's row into a buffer and read it back per head, the codes now go from one load to every
   head's multiply-add. Scratch: 5 nb 16 floats. -> 0 (nothing done) where the level or the shapes
   do not allow it (no AVX2; a block or a field not whole vectors): the caller decodes rows. */
HIDDEN int value_codes(const Stream *st, long rg, long S, int D, int p0, int cn, const float *e, int ld, int rep,
                       float *o, int ow, float *bsum, float *scratch) {
#if HAVE_AVX2
    const int bits = kv_bits(st->kind), fw = D * bits / 8, vqb = (int)st->block, nb = D / vqb;
    const int zp = kv_zero_point(st->kind), nf = st->kind == KV_NF4;
    if (g_isa < ISA_AVX2 || cn > 16 || fw % 16 != 0 || vqb % 16 != 0) return 0;
    const HeadAt h = head_at(st, rg, S);
    const uint8_t *rows = (const uint8_t *)st->codes + (h.rg * h.S + h.at + p0) * fw;
    const uint16_t *par = st->params + h.rg * (zp ? 2 : 1) * nb * h.S + h.at + p0;
    float *sb = scratch, *mb = sb + (long)nb * 16, *w = mb + (long)nb * 16;   /* scales, minimums [nb, 16]; w [nb, 3, 16] */
    for (int b = 0; b < nb; b++) {
        fp16_row(par + (long)b * h.S, sb + (long)b * 16, cn);
        if (zp) fp16_row(par + (long)(nb + b) * h.S, mb + (long)b * 16, cn);
    }
    uint8_t live[16];
    for (int k = 0; k < cn; k++) {
        int any = 0;
        for (int j = 0; j < rep; j++) any |= e[(long)j * ld + k] != 0.0f;
        live[k] = (uint8_t)any;
    }
    const float off = zp || nf ? 0.0f : kv_offset(st->kind);
    for (int j0 = 0; j0 < rep; j0 += 3) {
        const int jn = rep - j0 < 3 ? rep - j0 : 3;
        for (int b = 0; b < nb; b++)
            for (int jj = 0; jj < jn; jj++)
                for (int k = 0; k < cn; k++)
                    w[((long)b * 3 + jj) * 16 + k] = e[(long)(j0 + jj) * ld + k] * sb[(long)b * 16 + k];
        float *oj = o + (long)j0 * ow;
        for (int f = 0; f < 8 / bits; f++)
            switch (jn * 256 + nf * 64 + bits * 4 + f) {
#define VALUE_FIELD(B, F) \
                case 256 + B * 4 + F: value_code_field(B, F, 0, 1, rows, fw, cn, live, w, vqb, 16, off, oj, ow); break; \
                case 512 + B * 4 + F: value_code_field(B, F, 0, 2, rows, fw, cn, live, w, vqb, 16, off, oj, ow); break; \
                case 768 + B * 4 + F: value_code_field(B, F, 0, 3, rows, fw, cn, live, w, vqb, 16, off, oj, ow); break;
                FIELD_CASES(VALUE_FIELD)
#undef VALUE_FIELD
#define VALUE_FIELD_NF4(B, F) \
                case 256 + 64 + B * 4 + F: value_code_field(B, F, 1, 1, rows, fw, cn, live, w, vqb, 16, 0.0f, oj, ow); break; \
                case 512 + 64 + B * 4 + F: value_code_field(B, F, 1, 2, rows, fw, cn, live, w, vqb, 16, 0.0f, oj, ow); break; \
                case 768 + 64 + B * 4 + F: value_code_field(B, F, 1, 3, rows, fw, cn, live, w, vqb, 16, 0.0f, oj, ow); break;
                NF4_CASES(VALUE_FIELD_NF4)
#undef VALUE_FIELD_NF4
            }
    }
    if (zp)
        for (int j = 0; j < rep; j++)
            for (int b = 0; b < nb; b++) {
                float acc = bsum[(long)j * nb + b];
                for (int k = 0; k < cn; k++)
                    if (e[(long)j * ld + k] != 0.0f) acc += e[(long)j * ld + k] * mb[(long)b * 16 + k];
                bsum[(long)j * nb + b] = acc;
            }
    return 1;
#else
    (void)st, (void)rg, (void)S, (void)D, (void)p0, (void)cn, (void)e, (void)ld, (void)rep, (void)o, (void)ow;
    (void)bsum, (void)scratch;
    return 0;
#endif
}

/* A per-token value row's codes as floats: u + off (symmetric kinds), NF4[u] (nf4) or u (zero-point
   kinds). */
HIDDEN void decode_row(int kind, const uint8_t *row, int D, float *out) {
    const int bits = kv_bits(kind), fw = D * bits / 8, nf = kind == KV_NF4;
    const float off = kv_zero_point(kind) ? 0.0f : kv_offset(kind);
    for (int f = 0; f < 8 / bits; f++)
        switch (nf * 64 + bits * 4 + f) {
#define DECODE_FIELD(B, F) case B * 4 + F: decode_field(B, F, 0, row, fw, off, out); break;
            FIELD_CASES(DECODE_FIELD)
#define DECODE_FIELD_NF4(B, F) case 64 + B * 4 + F: decode_field(B, F, 1, row, fw, 0.0f, out); break;
            NF4_CASES(DECODE_FIELD_NF4)
        }
}

/* The value a head vector's own codes u and parameters stand for (the new token read back). */
HIDDEN void dequantize_vector(int kind, const uint8_t *u, const uint16_t *par, int D, int qb, float *out) {
    const int nb = D / qb, zp = kv_zero_point(kind), bits = kv_bits(kind);
    const float off = kv_offset(kind);
    for (int i = 0; i < D; i++) {
        const float s = fp16_to_fp32(par[i / qb]), c = bits == 8 ? (float)(int8_t)u[i] : (float)u[i];
        out[i] = zp ? c * s + fp16_to_fp32(par[nb + i / qb]) : kind == KV_NF4 ? NF4_LEVELS[u[i]] * s : (c + off) * s;
    }
}

/* x [D] @ rot [D, D] (a row vector times the matrix, as torch's x @ rot). */
HIDDEN void rotate(const float *x, const float *rot, int D, float *out) {
    for (int i = 0; i < D; i++) out[i] = 0.0f;
    for (int k = 0; k < D; k++) {
        const float xk = x[k];
        const float *restrict r = rot + (long)k * D;
        for (int i = 0; i < D; i++) out[i] += xk * r[i];
    }
}

/* The new token's K or V x (as stored: rotated) at position `slot` of head rg: its codes u and
   parameters par (per-token kinds, quantized beforehand) and its ring copy (KV_FP32: the values). */
HIDDEN void write_new(const Stream *st, int keys, long rg, long S, int D, int slot, const float *x, const uint8_t *u,
                      const uint16_t *par) {
    if (st->ring) memcpy(ring_row(st, rg, slot, D), x, sizeof(float) * D);
    if (kv_float(st->kind) && st->kind != KV_FP32)
        to_half(st->kind, x, D, (uint16_t *)st->codes + ring_index(st, rg, slot) * D);
    if (kv_float(st->kind) || kv_per_channel(st->kind)) return;
    const HeadAt h = head_at(st, rg, S);
    rg = h.rg, S = h.S, slot += (int)h.at;
    const int bits = kv_bits(st->kind), fw = D * bits / 8, np = (kv_zero_point(st->kind) ? 2 : 1) * (D / st->block);
    uint8_t *codes = st->codes;
    for (int i = 0; i < fw; i++) {
        const uint8_t b = pack_byte(bits, u, D, i);
        if (keys) codes[(rg * fw + i) * S + slot] = b;
        else codes[(rg * S + slot) * fw + i] = b;
    }
    for (int i = 0; i < np; i++) st->params[(rg * np + i) * S + slot] = par[i];
}

/* A per-channel stream's group ending at `slot`, complete with the new token x: its positions from
   the ring and x quantized channel by channel into the codes and the group's parameters
   (ChannelQuantStream.write). Scratch: xg [D, G] floats, ug [D, G] bytes. */
HIDDEN void complete_group(const Stream *st, long rg, long S, int D, int slot, const float *x, float *xg, uint8_t *ug) {
    int g0 = slot + 1 - (int)st->block, NG;
    const int G = st->block, bits = kv_bits(st->kind), fw = D * bits / 8;
    for (int t = 0; t < G - 1; t++) {
        const float *src = ring_row(st, rg, g0 + t, D);
        for (int e = 0; e < D; e++) xg[(long)e * G + t] = src[e];
    }
    for (int e = 0; e < D; e++) xg[(long)e * G + G - 1] = x[e];
    const HeadAt h = head_at(st, rg, S);     /* the ring above is the head's own; the codes may be packed */
    rg = h.rg, S = h.S, NG = (int)(S / G), g0 += (int)h.at;
    uint16_t *par = st->params + rg * 2 * D * NG;
    for (int e = 0; e < D; e++)
        quantize_block(st->kind, xg + (long)e * G, G, ug + (long)e * G, par + (long)e * NG + g0 / G,
                       par + (long)(D + e) * NG + g0 / G);
    uint8_t *codes = (uint8_t *)st->codes + rg * fw * S;
    for (int i = 0; i < fw; i++)
        for (int t = 0; t < G; t++) {
            uint8_t b = 0;
            for (int f = 0; f < 8 / bits; f++) b |= (uint8_t)(ug[(long)(i + f * fw) * G + t] << (bits * f));
            codes[(long)i * S + g0 + t] = b;
        }
}
