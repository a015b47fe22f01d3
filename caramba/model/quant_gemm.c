/* Prefill-sized products of block-quantized weights with q8-rounded activations: an int8 GEMM.

   A prompt's prefill multiplies every weight by many activation rows at once, so unlike the
   decode GEMVs (quant_gemv.c) it is bound by arithmetic, not bytes. Dequantizing the weight to
   fp32 and calling an fp32 GEMM costs a pass over the weight plus the fp32 product; here the int8
   codes are multiplied as they are, where the CPU has int8 matrix instructions:

     amx         AMX tiles (TDPBSSD: 16x16 int32 += 16x32 int8 . 32x16 int8 in one instruction)
     avx512vnni  512-bit vpdpbusd dot products, register-blocked 4 weight rows x 32 activation rows
     avxvnni     256-bit vpdpbusd (AVX-VNNI, VEX: Alder Lake and later), avx2's blocking
     avx2        2 weight rows x 32 activation rows. q4_0: vpmaddubsw on the nibbles, a block's
                 pairs summed in int16. q8_0: both operands widened to int16, one vpmaddwd per
                 pair of codes (vpmaddubsw's pairs of q8 codes would each need a vpmaddwd after
                 it: no faster than fp32's FMAs)
     scalar      the portable reference (gemm_q8_ref), one element at a time: what the others are
                 tested against; the caller (caramba.model.quant_gemm) keeps torch's
                 dequantize-then-matmul rather than run it.

   Arithmetic (every level the same, so their outputs are bit-identical): activations come as q8
   codes xq [M, K] with one fp32 scale per 32-block xd [M, K/32] (quant_gemv.c's
   quantize_activations_q8, the codes a decode step multiplies); weights as q8_0 (int8 codes) or
   q4_0 (nibbles, value q - 8), fp16 scale per block. Per output (m, n) and block b in order:
       isum = sum over the block of xq * wq        (int32, exact: |isum| <= 32*127*127 < 2^24)
       acc  = fmaf(wd[n,b] * xd[m,b], (float)isum, acc)
   The torch path this replaces multiplies the same values (round_activations times the
   dequantized weight), summing the fp32 products in another order.

   fp32 activations (native's Q4_1 and Q8_0 head) take gemm_f32 below instead: AMX-BF16 on
   exact bf16 pieces of each activation, where the CPU and OS have AMX (else the caller keeps
   torch's path).

   Layouts as quant_gemv.c: q8_0 qs int8 [N, K]; q4_0 qs uint8 [N, K/2], byte j of a block holds
   element j (low nibble) and j + 16 (high nibble); q4_1 the same with fp16 minimums m [N, K/32]
   (w = d q + m). gemm_q8 also reads q8_0 and q4_0 weights held x16 (struct weight below). out is
   [M, N] fp32. Parallel over 32-row panels of the weight with OpenMP (torch's libgomp). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "cpu_isa.h"   /* fp16_to_fp32, isa_amx (cpu_isa.c, compiled into this library too) */
#include "quant_gemm.h"   /* the levels, shared with quant_gemm_i16.c */

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_AVX2G 1   /* the avx2 level and the packing every vector level shares */
#else
#define HAVE_AVX2G 0
#endif
#if HAVE_AVX2G && defined(__AVXVNNI__)
#define HAVE_AVXVNNIG 1   /* the avxvnni level */
#else
#define HAVE_AVXVNNIG 0
#endif
#if HAVE_AVX2G && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAVE_VNNI 1
#else
#define HAVE_VNNI 0
#endif
#if HAVE_VNNI && defined(__x86_64__) && defined(CARAMBA_AMX_EMULATE)
#define HAVE_AMX 1
#define AMX_EMULATED 1   /* a test build: the tile instructions in software (amx_emulate.h) */
#include "amx_emulate.h"
#elif HAVE_VNNI && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__x86_64__)
#define HAVE_AMX 1
#define AMX_EMULATED 0
#else
#define HAVE_AMX 0
#define AMX_EMULATED 0
#endif

#define QK 32
#define PANEL 32          /* weight rows per work item (two AMX tiles of 16) */
#define MTILE 32          /* activation rows per inner step (two tiles of 16 / two zmm of 16 lanes) */
/* where block b of the activation tile holding row m starts in the packed scales (times the units
   per block in the packed codes); nb in scope */
#define TILE_BLOCK(m, b) (((long)(m) / MTILE * nb + (b)) * MTILE)

enum { FMT_Q8_0 = 0, FMT_Q4_0 = 1 };

/* A weight as its layer holds it: codes qs and fp16 scales wd, row-major ([N, bytes] and [N, nb])
   or x16 (quant_gemv.h: 16 rows to a group, interleaved by 4-byte units, codes [ceil(N/16),
   bytes/4, 16, 4] and scales [ceil(N/16), nb, 16]). Read in place either way: an x16 layer's
   row-major copy per call cost 0.86 ms of a 2048-token gate|up product's 17 (q8_0, Zen 5). */
struct weight {
    const uint8_t *qs;
    const uint16_t *wd;
    int x16;
    long bytes;   /* code bytes per row: K for q8_0, K/2 for q4_0 */
    int nb;       /* blocks per row */
};

static struct weight weight_of(int fmt, const void *qs, const uint16_t *wd, int x16, int K) {
    const struct weight w = {qs, wd, x16, fmt == FMT_Q8_0 ? K : K / 2, K / QK};
    return w;
}

/* row n's 4-byte unit u (its code bytes 4u .. 4u+3) */
static inline const uint8_t *weight_unit(const struct weight *w, long n, long u) {
    return w->x16 ? w->qs + (n / 16) * w->bytes * 16 + u * 64 + (n % 16) * 4 : w->qs + n * w->bytes + 4 * u;
}

static inline float weight_scale(const struct weight *w, long n, int b) {
    return fp16_to_fp32(w->x16 ? w->wd[(n / 16) * w->nb * 16 + (long)b * 16 + n % 16] : w->wd[n * w->nb + b]);
}

static inline int weight_code(int fmt, const struct weight *w, long n, int k) {
    const long i = fmt == FMT_Q8_0 ? k : (k / QK) * (QK / 2) + (k % QK) % (QK / 2);   /* its byte */
    const uint8_t byte = weight_unit(w, n, i / 4)[i % 4];
    if (fmt == FMT_Q8_0) return (int8_t)byte;
    return ((k % QK) < QK / 2 ? byte & 15 : byte >> 4) - 8;
}

/* The reference: one output at a time, straight from the weight's own layout (no packing). */
void gemm_q8_ref(int fmt, const int8_t *xq, const float *xd, int M, int K, const void *qs, const uint16_t *wd,
                 int x16, int N, float *out) {
    const int nb = K / QK;
    const struct weight w = weight_of(fmt, qs, wd, x16, K);
    for (int m = 0; m < M; m++)
        for (long n = 0; n < N; n++) {
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                int32_t isum = 0;
                for (int k = b * QK; k < (b + 1) * QK; k++) isum += (int32_t)xq[(long)m * K + k] * weight_code(fmt, &w, n, k);
                const float s = weight_scale(&w, n, b) * xd[(long)m * nb + b];
                acc = fmaf(s, (float)isum, acc);
            }
            out[(long)m * N + n] = acc;
        }
}

/* --- run-time level ----------------------------------------------------------------------------- */

static const char *const LVL_NAMES[LVL_COUNT] = {"scalar", "avx2", "avxvnni", "avx512vnni", "amx"};

static int level_usable(int level) {
    switch (level) {
    case LVL_SCALAR: return 1;
#if HAVE_AVX2G
    case LVL_AVX2: return isa_available("avx2");
#endif
#if HAVE_AVXVNNIG
    case LVL_AVXVNNI: return isa_available("avxvnni");
#endif
#if HAVE_VNNI
    case LVL_VNNI:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
               && __builtin_cpu_supports("avx512vnni");
#endif
#if HAVE_AMX
    case LVL_AMX: {
        static int granted = -1;   /* ask the OS once */
        if (granted < 0) granted = level_usable(LVL_VNNI) && (AMX_EMULATED || isa_amx());
        return granted;
    }
#endif
    default: return 0;
    }
}

/* A wish (a level name, or cpu_isa.c's avx512, which runs avx2's GEMM: AVX-512 F/BW without
   VNNI) -> the level to run: the wished one where usable, else the best below it. -1: no level
   name. */
static int level_pick(const char *wish) {
    int top = LVL_COUNT - 1;
    if (wish && *wish) {
        for (top = 0; top < LVL_COUNT && strcmp(wish, LVL_NAMES[top]); top++) {}
        if (top == LVL_COUNT) {
            if (strcmp(wish, "avx512")) return -1;
            top = LVL_AVX2;
        }
    }
    while (top > 0 && !level_usable(top)) top--;
    return top;
}

static int g_level = LVL_SCALAR;

/* CARAMBA_ISA (model/isa.py) caps the level, as for the decode kernels; unset: the best. */
__attribute__((constructor)) static void gemm_level_init(void) {
    const int level = level_pick(getenv("CARAMBA_ISA"));
    g_level = level < 0 ? level_pick(NULL) : level;
}

const char *gemm_isa_name(void) { return LVL_NAMES[g_level]; }

HIDDEN int gemm_level(void) { return g_level; }

int gemm_isa_available(const char *name) {
    for (int level = 0; level < LVL_COUNT; level++)
        if (!strcmp(name, LVL_NAMES[level])) return level_usable(level);
    return 0;
}

/* Set the level (tests, A/B timings): the asked one or its fallback; -1 (unchanged) for no name. */
int gemm_isa_set(const char *name) {
    const int level = level_pick(name);
    if (level >= 0) g_level = level;
    return level;
}

/* Whether the level in force multiplies format fmt's codes (else the caller keeps torch's path). */
int gemm_q8_runs(int fmt) {
    return g_level >= LVL_AVX2 && (fmt == FMT_Q8_0 || fmt == FMT_Q4_0);
}

/* --- packing shared by the vector levels -------------------------------------------------------- */

#if HAVE_AVX2G
/* row n's code bytes, row-major, into dst [bytes]: x16's units 64 bytes apart, 8 per gather
   (one 4-byte copy at a time made reading x16 in place cost 11% of a 512-row q8_0 product) */
static void weight_row(const struct weight *w, long n, uint8_t *dst) {
    if (!w->x16) {
        memcpy(dst, weight_unit(w, n, 0), w->bytes);
        return;
    }
    const __m256i apart = _mm256_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112);   /* in 4-byte steps */
    const long units = w->bytes / 4;
    long u = 0;
    for (; u + 8 <= units; u += 8)
        _mm256_storeu_si256((__m256i *)(dst + 4 * u), _mm256_i32gather_epi32((const int *)weight_unit(w, n, u), apart, 4));
    for (; u < units; u++) memcpy(dst + 4 * u, weight_unit(w, n, u), 4);
}

/* Activations for a level's inner loop, a tile of MTILE rows at a time: xp [Mp/MTILE][nb][8][MTILE][4]
   int8, each 4-element group of a row next to the same group of the tile's other rows (AMX B
   tiles, or zmms of 16 rows), rows past M zero; xdp [Mp/MTILE][nb][MTILE] their scales (0 past
   M); csx (the same shape) c times each block's code sum (the offset vpdpbusd's unsigned operand
   adds, removed again; AMX needs none). wide (avx2's q8_0): the codes sign-extended to int16, xp
   [Mp/MTILE][nb][16][MTILE][2], pairs where the others have groups. Tile-major, so that a tile's
   bytes are one run: strided by Mp, the rows of 2048 tokens lay 8 KiB apart and thrashed L1's
   sets (2048 tokens took 6x the time of 512, at any level). */
static void pack_activations(const int8_t *xq, const float *xd, int M, int Mp, int K, int c, int wide, int8_t *xp,
                             float *xdp, int32_t *csx) {
    const int nb = K / QK, units = wide ? QK / 2 : QK / 4;
    #pragma omp parallel for schedule(static)
    for (int b = 0; b < nb; b++) {
        for (int m = 0; m < Mp; m++) {
            const long at = TILE_BLOCK(m, b);   /* this tile's block b */
            int32_t *dst = (int32_t *)xp + at * units + m % MTILE;
            const int8_t *row = xq + (long)m * K + b * QK;
            int32_t sum = 0;
            for (int r = 0; r < units; r++) {
                int32_t unit = 0;
                if (m < M && wide) {
                    const int16_t pair[2] = {row[2 * r], row[2 * r + 1]};
                    memcpy(&unit, pair, 4);
                } else if (m < M) {
                    memcpy(&unit, row + 4 * r, 4);
                }
                dst[r * MTILE] = unit;
            }
            if (m < M)
                for (int k = 0; k < QK; k++) sum += row[k];
            xdp[at + m % MTILE] = m < M ? xd[(long)m * nb + b] : 0.0f;
            csx[at + m % MTILE] = c * sum;
        }
    }
}

/* Weight rows n0 .. n0+PANEL-1's fp32 scales [PANEL][nb] (0 past N); returns how many rows are
   live. */
static int pack_scales(const struct weight *wt, long n0, int N, int nb, float *wdp) {
    const int rows = N - n0 < PANEL ? (int)(N - n0) : PANEL;
    for (int i = 0; i < PANEL; i++)
        for (int b = 0; b < nb; b++) wdp[i * nb + b] = i < rows ? weight_scale(wt, n0 + i, b) : 0.0f;
    return rows;
}

/* Weight rows n0 .. n0+PANEL-1 as int8 codes [PANEL][K] (rows past N zero) and their fp32
   scales [PANEL][nb]. unsigned_codes: q8_0 codes + 128 and q4_0 nibbles as they are (vpdpbusd's
   u8 operand); else signed codes (q4_0: q - 8). A full row-major q8_0 panel with signed codes is
   read in place: the returned pointer. row: scratch for one row's code bytes. */
static const int8_t *pack_weights(int fmt, const struct weight *wt, long n0, int N, int K, int unsigned_codes,
                                  int8_t *panel, uint8_t *row, float *wdp) {
    const int nb = K / QK, rows = pack_scales(wt, n0, N, nb, wdp);
    if (fmt == FMT_Q8_0 && !unsigned_codes && rows == PANEL && !wt->x16) return (const int8_t *)weight_unit(wt, n0, 0);
    memset(panel, 0, (size_t)PANEL * K);
    const __m256i nib = _mm256_set1_epi8(15), flip = _mm256_set1_epi8(unsigned_codes ? (char)0x80 : 0);
    const __m256i off = _mm256_set1_epi8(unsigned_codes ? 0 : 8);
    for (int i = 0; i < rows; i++) {
        int8_t *dst = panel + (long)i * K;
        weight_row(wt, n0 + i, row);
        if (fmt == FMT_Q8_0) {
            const int8_t *src = (const int8_t *)row;
            for (int k = 0; k < K; k += QK)
                _mm256_storeu_si256((__m256i *)(dst + k), _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(src + k)), flip));
            continue;
        }
        for (int b = 0; b < nb; b++) {
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(row + b * QK / 2));
            const __m256i both = _mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes);   /* low nibbles, then high */
            _mm256_storeu_si256((__m256i *)(dst + b * QK), _mm256_sub_epi8(_mm256_and_si256(both, nib), off));
        }
    }
    return panel;
}

/* avx2's q8_0 panel: weight rows n0 .. n0+PANEL-1 as int16 codes [PANEL][K] (rows past N zero),
   scales and scratch row as pack_weights. */
static const int16_t *pack_weights_wide(const struct weight *wt, long n0, int N, int K, int16_t *panel, uint8_t *row,
                                        float *wdp) {
    const int nb = K / QK, rows = pack_scales(wt, n0, N, nb, wdp);
    memset(panel, 0, (size_t)PANEL * K * sizeof(int16_t));
    for (int i = 0; i < rows; i++) {
        weight_row(wt, n0 + i, row);
        for (int k = 0; k < K; k += 16)
            _mm256_storeu_si256((__m256i *)(panel + (long)i * K + k),
                                _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + k))));
    }
    return panel;
}

/* acc [PANEL][MTILE] fp32 (row = weight row) -> out [M, N]: transposed in L1 first, so that out
   is written a row at a time (strided single stores 4 KiB apart thrash one L1 set: N = 3072
   took 1.8x as long). */
static void store_transposed(const float *acc, long n0, int N, int m0, int M, float *out) {
    float t[MTILE * PANEL] __attribute__((aligned(64)));
    for (int i = 0; i < PANEL; i++)
        for (int j = 0; j < MTILE; j++) t[j * PANEL + i] = acc[i * MTILE + j];
    const int cols = N - n0 < PANEL ? (int)(N - n0) : PANEL;
    for (int j = 0; j < MTILE && m0 + j < M; j++) memcpy(out + (long)(m0 + j) * N + n0, t + j * PANEL, cols * sizeof(float));
}

/* One panel at the avx2 or avxvnni level: 2 weight rows x 32 activation rows. dot (a constant at
   each call, so each is its own loop) says how a lane's codes are multiplied:
   - DOT_VNNI (avxvnni): vpdpbusd sums a lane's four products into int32, as the VNNI panel at 256
     bits. w: the codes as unsigned bytes (pack_weights: q8_0 + 128, q4_0's nibbles); csx: the
     offset that adds, c sum(x) per block.
   - DOT_BYTES (avx2, q4_0): the same operands; vpmaddubsw's pairs q x <= 2 x 15 x 127 sum in
     int16, 8 words of them (30480) exactly, then one vpmaddwd to int32.
   - DOT_WIDE (avx2, q8_0): both operands int16 (pack_weights_wide, pack_activations' wide
     units), signed, no offset. One vpmaddwd multiplies a lane's pair of codes and adds the two
     (|sum| <= 2 x 127 x 127: exact), a vpaddd sums the block in int32: 16 MACs per multiply,
     where vpmaddubsw's pairs of q8 codes (up to 32512) would each need a vpmaddwd after it, 8
     per instruction as fp32's FMA.
   Then the VNNI panel's FMAs: the same bits. */
enum { DOT_BYTES, DOT_VNNI, DOT_WIDE };

static inline __attribute__((always_inline)) void panel_256(int dot, const void *weights, const float *wdp,
                                                            const int8_t *xp, const float *xdp, const int32_t *csx,
                                                            int Mp, int K, long n0, int N, int M, float *out) {
    const int nb = K / QK, units = dot == DOT_WIDE ? QK / 2 : QK / 4, size = dot == DOT_WIDE ? 2 : 1;   /* 4-byte units per block; bytes per code */
    const uint8_t *w = weights;
    const __m256i ones = _mm256_set1_epi16(1);
    float acc[PANEL * MTILE] __attribute__((aligned(64)));
    for (int m0 = 0; m0 < Mp; m0 += MTILE) {
        for (int i0 = 0; i0 < PANEL && n0 + i0 < N; i0 += 2) {
            __m256 f[2][4];
            for (int i = 0; i < 2; i++)
                for (int v = 0; v < 4; v++) f[i][v] = _mm256_setzero_ps();
            for (int b = 0; b < nb; b++) {
                __m256i t[2][4];
                for (int i = 0; i < 2; i++)
                    for (int v = 0; v < 4; v++) t[i][v] = _mm256_setzero_si256();
                const int8_t *xb = xp + TILE_BLOCK(m0, b) * units * 4;
                for (int r = 0; r < units; r++) {
                    __m256i x[4];
                    for (int v = 0; v < 4; v++) x[v] = _mm256_load_si256((const __m256i *)(xb + r * MTILE * 4 + 32 * v));
                    /* kept in registers: GCC folds each into the products as a memory operand, a load
                       per weight row; one load each ran bytes and vnni 1.13-1.19x faster. Not wide:
                       its 16 units a block ran 1.25x slower so (AVX2's 16 registers) */
                    if (dot != DOT_WIDE) __asm__("" : "+x"(x[0]), "+x"(x[1]), "+x"(x[2]), "+x"(x[3]));
                    for (int i = 0; i < 2; i++) {
                        int32_t g;
                        memcpy(&g, w + ((long)(i0 + i) * K + b * QK) * size + 4 * r, 4);
                        const __m256i wb = _mm256_set1_epi32(g);
                        for (int v = 0; v < 4; v++) {
#if HAVE_AVXVNNIG
                            if (dot == DOT_VNNI) {
                                t[i][v] = _mm256_dpbusd_avx_epi32(t[i][v], wb, x[v]);
                                continue;
                            }
#endif
                            t[i][v] = dot == DOT_WIDE ? _mm256_add_epi32(t[i][v], _mm256_madd_epi16(wb, x[v]))
                                                      : _mm256_add_epi16(t[i][v], _mm256_maddubs_epi16(wb, x[v]));
                        }
                    }
                }
                for (int v = 0; v < 4; v++) {
                    const __m256 d = _mm256_load_ps(xdp + TILE_BLOCK(m0, b) + 8 * v);
                    for (int i = 0; i < 2; i++) {
                        const __m256 s = _mm256_set1_ps(wdp[(i0 + i) * nb + b]);
                        __m256i isum = t[i][v];
                        if (dot != DOT_WIDE) {
                            const __m256i c = _mm256_load_si256((const __m256i *)(csx + TILE_BLOCK(m0, b) + 8 * v));
                            isum = _mm256_sub_epi32(dot == DOT_VNNI ? isum : _mm256_madd_epi16(isum, ones), c);
                        }
                        f[i][v] = _mm256_fmadd_ps(_mm256_mul_ps(s, d), _mm256_cvtepi32_ps(isum), f[i][v]);
                    }
                }
            }
            for (int i = 0; i < 2; i++)
                for (int v = 0; v < 4; v++) _mm256_store_ps(acc + (i0 + i) * MTILE + 8 * v, f[i][v]);
        }
        store_transposed(acc, n0, N, m0, M, out);
    }
}

static void panel_avx2(const int8_t *w, const float *wdp, const int8_t *xp, const float *xdp, const int32_t *csx,
                       int Mp, int K, long n0, int N, int M, float *out) {
    panel_256(DOT_BYTES, w, wdp, xp, xdp, csx, Mp, K, n0, N, M, out);
}

static void panel_avx2_wide(const int16_t *w, const float *wdp, const int8_t *xp, const float *xdp, int Mp, int K,
                            long n0, int N, int M, float *out) {
    panel_256(DOT_WIDE, w, wdp, xp, xdp, NULL, Mp, K, n0, N, M, out);
}

#if HAVE_AVXVNNIG
static void panel_avxvnni(const int8_t *w, const float *wdp, const int8_t *xp, const float *xdp, const int32_t *csx,
                          int Mp, int K, long n0, int N, int M, float *out) {
    panel_256(DOT_VNNI, w, wdp, xp, xdp, csx, Mp, K, n0, N, M, out);
}
#endif
#endif

#if HAVE_VNNI
/* One panel at the VNNI level: 4 weight rows x 32 activation rows in registers, each block's int32
   sums in two chains (even and odd units). One chain each, 8 chains of 8 dependent vpdpbusd, is
   bound by their latency: a register-only loop of 8 chains ran 6.4 G vpdpbusd/s here, of 12 chains
   8.4 (Zen 5); 16 chains made the panel 2-5% faster. */
static void panel_vnni(const int8_t *w, const float *wdp, const int8_t *xp, const float *xdp, const int32_t *csx,
                       int Mp, int K, long n0, int N, int M, float *out) {
    const int nb = K / QK;
    float acc[PANEL * MTILE] __attribute__((aligned(64)));
    for (int m0 = 0; m0 < Mp; m0 += MTILE) {
        for (int i0 = 0; i0 < PANEL && n0 + i0 < N; i0 += 4) {
            __m512 f[4][2];
            for (int i = 0; i < 4; i++) f[i][0] = f[i][1] = _mm512_setzero_ps();
            for (int b = 0; b < nb; b++) {
                __m512i a[4][2], e[4][2];   /* even and odd units' sums */
                for (int i = 0; i < 4; i++) a[i][0] = a[i][1] = e[i][0] = e[i][1] = _mm512_setzero_si512();
                const int8_t *xb = xp + TILE_BLOCK(m0, b) * 8 * 4;
                for (int r = 0; r < 8; r += 2) {
                    __m512i x0 = _mm512_load_si512(xb + r * MTILE * 4), x1 = _mm512_load_si512(xb + r * MTILE * 4 + 64);
                    __m512i y0 = _mm512_load_si512(xb + (r + 1) * MTILE * 4), y1 = _mm512_load_si512(xb + (r + 1) * MTILE * 4 + 64);
                    /* kept in registers: folded into each vpdpbusd as a memory operand, as GCC does, a
                       unit's two loads were eight, 1.5 loads a product with the broadcasts, and the
                       loads bound the panel (1.26-1.30x slower, Zen 5) */
                    __asm__("" : "+v"(x0), "+v"(x1), "+v"(y0), "+v"(y1));
                    for (int i = 0; i < 4; i++) {
                        int32_t g, h;
                        memcpy(&g, w + (long)(i0 + i) * K + b * QK + 4 * r, 4);
                        memcpy(&h, w + (long)(i0 + i) * K + b * QK + 4 * r + 4, 4);
                        const __m512i wb = _mm512_set1_epi32(g), wc = _mm512_set1_epi32(h);
                        a[i][0] = _mm512_dpbusd_epi32(a[i][0], wb, x0);
                        a[i][1] = _mm512_dpbusd_epi32(a[i][1], wb, x1);
                        e[i][0] = _mm512_dpbusd_epi32(e[i][0], wc, y0);
                        e[i][1] = _mm512_dpbusd_epi32(e[i][1], wc, y1);
                    }
                }
                for (int i = 0; i < 4; i++) a[i][0] = _mm512_add_epi32(a[i][0], e[i][0]), a[i][1] = _mm512_add_epi32(a[i][1], e[i][1]);
                const __m512i c0 = _mm512_load_si512(csx + TILE_BLOCK(m0, b)), c1 = _mm512_load_si512(csx + TILE_BLOCK(m0, b) + 16);
                const __m512 d0 = _mm512_load_ps(xdp + TILE_BLOCK(m0, b)), d1 = _mm512_load_ps(xdp + TILE_BLOCK(m0, b) + 16);
                for (int i = 0; i < 4; i++) {
                    const __m512 s = _mm512_set1_ps(wdp[(i0 + i) * nb + b]);
                    f[i][0] = _mm512_fmadd_ps(_mm512_mul_ps(s, d0), _mm512_cvtepi32_ps(_mm512_sub_epi32(a[i][0], c0)), f[i][0]);
                    f[i][1] = _mm512_fmadd_ps(_mm512_mul_ps(s, d1), _mm512_cvtepi32_ps(_mm512_sub_epi32(a[i][1], c1)), f[i][1]);
                }
            }
            for (int i = 0; i < 4; i++) {
                _mm512_store_ps(acc + (i0 + i) * MTILE, f[i][0]);
                _mm512_store_ps(acc + (i0 + i) * MTILE + 16, f[i][1]);
            }
        }
        store_transposed(acc, n0, N, m0, M, out);
    }
}
#endif

#if HAVE_AMX
struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* tmm0-3: C (16 weight rows x 16 activation rows, int32); tmm4-5: A (16 weight rows x one 32-block);
   tmm6-7: B (one block of 16 activation rows, 8 groups of 4). */
static void amx_configure(void) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    for (int t = 4; t < 6; t++) cfg.rows[t] = 16, cfg.colsb[t] = QK;
    for (int t = 6; t < 8; t++) cfg.rows[t] = QK / 4, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

/* Block b's scales applied to its int32 tile results c (four 16x16 tiles) into acc. */
static inline void amx_epilogue(const int32_t (*c)[256], const float *wdp, const float *xdp, int nb, int b, int m0,
                                float *acc) {
    const __m512 d0 = _mm512_load_ps(xdp + TILE_BLOCK(m0, b)), d1 = _mm512_load_ps(xdp + TILE_BLOCK(m0, b) + 16);
    for (int i = 0; i < PANEL; i++) {
        const __m512 s = _mm512_set1_ps(wdp[i * nb + b]);
        const int32_t *c0 = c[(i / 16) * 2] + (i % 16) * 16, *c1 = c[(i / 16) * 2 + 1] + (i % 16) * 16;
        float *a = acc + i * MTILE;
        _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_mul_ps(s, d0), _mm512_cvtepi32_ps(_mm512_load_si512(c0)), _mm512_load_ps(a)));
        _mm512_store_ps(a + 16, _mm512_fmadd_ps(_mm512_mul_ps(s, d1), _mm512_cvtepi32_ps(_mm512_load_si512(c1)), _mm512_load_ps(a + 16)));
    }
}

/* One panel with AMX: per block four tile products, stored, and the previous block's scales
   applied meanwhile (two result buffers: the vector epilogue of block b-1 does not wait for the
   tiles of block b, so the two units overlap; in turn that took 2x as long). */
static void panel_amx(const int8_t *w, const float *wdp, const int8_t *xp, const float *xdp, int Mp, int K,
                      long n0, int N, int M, float *out) {
    const int nb = K / QK;
    float acc[PANEL * MTILE] __attribute__((aligned(64)));
    int32_t c[2][4][16 * 16] __attribute__((aligned(64)));
    for (int m0 = 0; m0 < Mp; m0 += MTILE) {
        memset(acc, 0, sizeof acc);
        for (int b = 0; b < nb; b++) {
            const int8_t *xb = xp + TILE_BLOCK(m0, b) * 8 * 4;
            int32_t (*cb)[256] = c[b & 1];
            _tile_loadd(4, w + b * QK, K);
            _tile_loadd(5, w + 16L * K + b * QK, K);
            _tile_loadd(6, xb, MTILE * 4);
            _tile_loadd(7, xb + 64, MTILE * 4);
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            _tile_dpbssd(0, 4, 6);
            _tile_dpbssd(1, 4, 7);
            _tile_dpbssd(2, 5, 6);
            _tile_dpbssd(3, 5, 7);
            _tile_stored(0, cb[0], 64); _tile_stored(1, cb[1], 64);
            _tile_stored(2, cb[2], 64); _tile_stored(3, cb[3], 64);
            if (b) amx_epilogue((const int32_t (*)[256])c[(b - 1) & 1], wdp, xdp, nb, b - 1, m0, acc);
        }
        amx_epilogue((const int32_t (*)[256])c[(nb - 1) & 1], wdp, xdp, nb, nb - 1, m0, acc);
        store_transposed(acc, n0, N, m0, M, out);
    }
}
#endif

/* --- fp32 activations (native's Q4_1, and any format under act='f32'): AMX-BF16 on exact pieces ---

   Every fp32 x is the exact sum of three bf16 pieces (x1 = x truncated to bf16, x2 = the rest
   truncated, x3 = what remains: 8 + 8 + 8 significant bits), and every weight code (q8_0's
   int8, q4_0's q - 8, q4_1's q in 0..15) is exact in bf16, so TDPBF16PS multiplies exactly the
   values the fp32 path does; only its fp32 accumulation rounds. Per output (m, n), block b:
       c   = sum over the block and the three pieces of code * piece      (fp32, the tile's order)
       acc = fmaf(d[n,b], c, acc);  q4_1: acc = fmaf(min[n,b], sx[m,b], acc)
   with sx the block's fp32 sum of x (any order). The same bound as any fp32 dot product of
   3K + 2K/32 terms (tests/model/test_quant_prefill.py); gemm_f32_ref is that arithmetic in C order.
   Values below bf16's normal range (2^-126) in a piece count as zero (AMX's DAZ): an error below
   2^-126 per element. */

enum { FMT_Q4_1 = 2 };

static inline float weight_value_code(int fmt, const void *qs, long n, int k, int K) {
    if (fmt != FMT_Q4_1) {
        const struct weight w = weight_of(fmt, qs, NULL, 0, K);
        return (float)weight_code(fmt, &w, n, k);
    }
    const uint8_t byte = ((const uint8_t *)qs)[n * (K / 2) + (k / QK) * (QK / 2) + (k % QK) % (QK / 2)];
    return (float)((k % QK) < QK / 2 ? byte & 15 : byte >> 4);
}

static inline float bf16_trunc(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    bits &= 0xffff0000u;
    float y;
    memcpy(&y, &bits, 4);
    return y;
}

static inline float block_sum(const float *x) {
    float s = 0.0f;
    for (int k = 0; k < QK; k++) s += x[k];
    return s;
}

void gemm_f32_ref(int fmt, const float *x, int M, int K, const void *qs, const uint16_t *wd, const uint16_t *wm,
                  int N, float *out) {
    const int nb = K / QK;
    for (int m = 0; m < M; m++)
        for (long n = 0; n < N; n++) {
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                const float *xb = x + (long)m * K + b * QK;
                float c = 0.0f;
                for (int k = 0; k < QK; k++) {
                    const float x1 = bf16_trunc(xb[k]), x2 = bf16_trunc(xb[k] - x1), x3 = xb[k] - x1 - x2;
                    const float q = weight_value_code(fmt, qs, n, b * QK + k, K);
                    c += q * x1 + q * x2 + q * x3;
                }
                acc = fmaf(fp16_to_fp32(wd[n * nb + b]), c, acc);
                if (fmt == FMT_Q4_1) acc = fmaf(fp16_to_fp32(wm[n * nb + b]), block_sum(xb), acc);
            }
            out[(long)m * N + n] = acc;
        }
}

#if HAVE_AMX && (defined(__AMX_BF16__) || AMX_EMULATED)
#define HAVE_AMX_BF16 1
#define BF_MTILE 16        /* activation rows per tile */

static int amx_bf16_cpu(void) {
    if (AMX_EMULATED) return 1;
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    return (d >> 22) & 1;
}

/* Rows m0 .. m0+rows-1 of x as three bf16 piece matrices xpc [3][rows16][K] (the A tiles, rows
   as they are; rows past M zero) and their blocks' fp32 sums sx [rows16][nb] (q4_1's minimums). */
static void split_pieces(const float *x, int m0, int rows, int M, int K, uint16_t *xpc, float *sx) {
    const int nb = K / QK, rows16 = (rows + BF_MTILE - 1) / BF_MTILE * BF_MTILE;
    const long plane = (long)rows16 * K;
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
    #pragma omp for schedule(static) nowait
    for (int j = 0; j < rows16; j++) {
        const int m = m0 + j;
        if (j >= rows || m >= M) {
            for (int p = 0; p < 3; p++) memset(xpc + p * plane + (long)j * K, 0, (size_t)K * 2);
            for (int b = 0; b < nb; b++) sx[(long)j * nb + b] = 0.0f;
            continue;
        }
        const float *xr = x + (long)m * K;
        for (int k = 0; k < K; k += 16) {
            const __m512 xv = _mm512_loadu_ps(xr + k);
            const __m512 x1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(xv), top));
            const __m512 r = _mm512_sub_ps(xv, x1);                 /* exact */
            const __m512 x2 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(r), top));
            const __m512 x3 = _mm512_sub_ps(r, x2);                 /* exact, <= 8 significant bits */
            const __m512 piece[3] = {x1, x2, x3};
            for (int p = 0; p < 3; p++)
                _mm256_storeu_si256((__m256i *)(xpc + p * plane + (long)j * K + k),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(piece[p]), 16)));
        }
        for (int b = 0; b < nb; b++)
            sx[(long)j * nb + b] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(xr + b * QK), _mm512_loadu_ps(xr + b * QK + 16)));
    }
}

/* The weight as B tiles of exact bf16 codes: wpk [N16/16 groups][nb][16 pairs][16 rows][2] (one
   contiguous KiB per tile, rows past N zero), and per PANEL of rows their scales and minimums
   [Np/PANEL][nb][PANEL] fp32 (a vector per block). */
static void convert_weights(int fmt, const void *qs, const uint16_t *wd, const uint16_t *wm, int N, int Np, int K,
                            uint16_t *wpk, float *wdf, float *wmf) {
    const int nb = K / QK;
    const __m512i pair = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(16));
    #pragma omp for schedule(static) nowait
    for (long n = 0; n < Np; n++) {
        const long panel = n / PANEL;
        for (int b = 0; b < nb; b++) {
            wdf[(panel * nb + b) * PANEL + n % PANEL] = n < N ? fp16_to_fp32(wd[n * nb + b]) : 0.0f;
            wmf[(panel * nb + b) * PANEL + n % PANEL] = n < N && fmt == FMT_Q4_1 ? fp16_to_fp32(wm[n * nb + b]) : 0.0f;
            int32_t *dst = (int32_t *)(wpk + ((n / 16) * nb + b) * 512) + n % 16;
            if (n >= N) {
                _mm512_i32scatter_epi32(dst, pair, _mm512_setzero_si512(), 4);
                continue;
            }
            __m128i codes[2];   /* the block's 32 codes as int8 */
            if (fmt == FMT_Q8_0) {
                codes[0] = _mm_loadu_si128((const __m128i *)((const int8_t *)qs + n * K + b * QK));
                codes[1] = _mm_loadu_si128((const __m128i *)((const int8_t *)qs + n * K + b * QK + 16));
            } else {
                const __m128i bytes = _mm_loadu_si128((const __m128i *)((const uint8_t *)qs + n * (K / 2) + b * (QK / 2)));
                codes[0] = _mm_and_si128(bytes, _mm_set1_epi8(15));
                codes[1] = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(15));
                if (fmt == FMT_Q4_0) codes[0] = _mm_sub_epi8(codes[0], _mm_set1_epi8(8)), codes[1] = _mm_sub_epi8(codes[1], _mm_set1_epi8(8));
            }
            __m256i half[2];
            for (int h = 0; h < 2; h++) {   /* exact: |code| <= 127 */
                const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes[h]));
                half[h] = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(f), 16));
            }
            _mm512_i32scatter_epi32(dst, pair, _mm512_inserti64x4(_mm512_castsi256_si512(half[0]), half[1], 1), 4);
        }
    }
}

/* tmm0-1: C (16 activation rows x 16 weight rows, fp32); tmm2-4: A (the three pieces of 16
   activation rows, one block); tmm5-6: B (two groups of 16 weight rows, one block). */
static void amx_configure_bf16(void) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 7; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

/* Block b's scales (and q4_1's minimums times the blocks' sums) applied to its two fp32 tiles. */
static inline void bf16_epilogue(int fmt, const float (*c)[256], const float *wdv, const float *wmv, const float *sx,
                                 int nb, int b, float *acc) {
    const __m512 d0 = _mm512_load_ps(wdv), d1 = _mm512_load_ps(wdv + 16);
    const __m512 n0 = _mm512_load_ps(wmv), n1 = _mm512_load_ps(wmv + 16);
    for (int i = 0; i < BF_MTILE; i++) {
        __m512 a0 = _mm512_fmadd_ps(d0, _mm512_load_ps(c[0] + i * 16), _mm512_load_ps(acc + i * PANEL));
        __m512 a1 = _mm512_fmadd_ps(d1, _mm512_load_ps(c[1] + i * 16), _mm512_load_ps(acc + i * PANEL + 16));
        if (fmt == FMT_Q4_1) {
            const __m512 s = _mm512_set1_ps(sx[(long)i * nb + b]);
            a0 = _mm512_fmadd_ps(n0, s, a0);
            a1 = _mm512_fmadd_ps(n1, s, a1);
        }
        _mm512_store_ps(acc + i * PANEL, a0);
        _mm512_store_ps(acc + i * PANEL + 16, a1);
    }
}

/* One panel of PANEL weight rows against a chunk of activation rows: per block six tile
   products (three pieces x two weight tiles), stored, and the previous block's epilogue
   meanwhile (as panel_amx). */
static void panel_bf16(int fmt, const uint16_t *wpk, const float *wdf, const float *wmf, const uint16_t *xpc,
                       const float *sx, long plane, int rows16, int K, long p, int N, int m0, int M, float *out) {
    const int nb = K / QK;
    xpc += (long)m0 * K;
    sx += (long)m0 * nb;
    const uint16_t *w0 = wpk + (2 * p) * nb * 512L, *w1 = w0 + nb * 512L;
    const float *wdp = wdf + p * nb * PANEL, *wmp = wmf + p * nb * PANEL;
    float acc[BF_MTILE * PANEL] __attribute__((aligned(64)));
    float c[2][2][16 * 16] __attribute__((aligned(64)));
    const long n0 = p * PANEL;
    const int cols = N - n0 < PANEL ? (int)(N - n0) : PANEL;
    for (int t = 0; t < rows16 / BF_MTILE; t++) {
        const uint16_t *xa = xpc + (long)t * BF_MTILE * K;
        const float *sxt = sx + (long)t * BF_MTILE * nb;
        memset(acc, 0, sizeof acc);
        for (int b = 0; b < nb; b++) {
            _tile_loadd(2, xa + b * QK, K * 2);
            _tile_loadd(3, xa + plane + b * QK, K * 2);
            _tile_loadd(4, xa + 2 * plane + b * QK, K * 2);
            _tile_loadd(5, w0 + b * 512L, 64);
            _tile_loadd(6, w1 + b * 512L, 64);
            _tile_zero(0); _tile_zero(1);
            _tile_dpbf16ps(0, 2, 5); _tile_dpbf16ps(1, 2, 6);
            _tile_dpbf16ps(0, 3, 5); _tile_dpbf16ps(1, 3, 6);
            _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 4, 6);
            _tile_stored(0, c[b & 1][0], 64); _tile_stored(1, c[b & 1][1], 64);
            if (b) bf16_epilogue(fmt, (const float (*)[256])c[(b - 1) & 1], wdp + (b - 1) * PANEL, wmp + (b - 1) * PANEL, sxt, nb, b - 1, acc);
        }
        bf16_epilogue(fmt, (const float (*)[256])c[(nb - 1) & 1], wdp + (nb - 1) * PANEL, wmp + (nb - 1) * PANEL, sxt, nb, nb - 1, acc);
        for (int i = 0; i < BF_MTILE && m0 + t * BF_MTILE + i < M; i++)
            memcpy(out + (long)(m0 + t * BF_MTILE + i) * N + n0, acc + i * PANEL, cols * sizeof(float));
    }
}
#else
#define HAVE_AMX_BF16 0
#endif

/* 1 where gemm_f32 runs on AMX-BF16 here (the CPU, the OS's leave for AMX, the build; the level
   not capped below amx), else 0: the caller keeps its own path (the reference is slow). */
int gemm_f32_available(void) {
#if HAVE_AMX_BF16
    return g_level == LVL_AMX && amx_bf16_cpu();
#else
    return 0;
#endif
}

/* out [M, N] = fp32 x times the weight (fmt, qs, wd, wm)^T: AMX-BF16 where gemm_f32_available,
   else the reference. Returns 0, or 1 where a buffer could not be allocated. */
int gemm_f32(int fmt, const float *x, int M, int K, const void *qs, const uint16_t *wd, const uint16_t *wm, int N,
             float *out, int nthreads) {
#if HAVE_AMX_BF16
    if (gemm_f32_available()) {
        const int nb = K / QK, Np = (N + PANEL - 1) / PANEL * PANEL;
        uint16_t *wpk = aligned_alloc(64, (size_t)Np * K * 2);
        float *wdf = aligned_alloc(64, (size_t)Np * nb * sizeof(float)), *wmf = aligned_alloc(64, (size_t)Np * nb * sizeof(float));
        const int M16 = (M + BF_MTILE - 1) / BF_MTILE * BF_MTILE;
        uint16_t *xpc = aligned_alloc(64, (size_t)3 * M16 * K * 2);
        float *sx = aligned_alloc(64, (size_t)M16 * nb * sizeof(float));
        const int failed = !wpk || !wdf || !wmf || !xpc || !sx;
        if (!failed) {
            /* Two barriers a call: on a shared machine each one waits for a descheduled thread
               (one per 128-row chunk of pieces made 2 threads 2x slower than 1 at load 8). */
            #pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1)
            {
                convert_weights(fmt, qs, wd, wm, N, Np, K, wpk, wdf, wmf);
                split_pieces(x, 0, M, M, K, xpc, sx);
                amx_configure_bf16();
                #pragma omp barrier
                /* 128 activation rows at a time (their pieces stay in L2 across the panels: 1.3x
                   over whole-M sweeps at K = 1536); the same panels per thread each time, no wait */
                for (int m0 = 0; m0 < M16; m0 += 128) {
                    const int rows16 = M16 - m0 < 128 ? M16 - m0 : 128;
                    #pragma omp for schedule(static) nowait
                    for (long p = 0; p < Np / PANEL; p++)
                        panel_bf16(fmt, wpk, wdf, wmf, xpc, sx, (long)M16 * K, rows16, K, p, N, m0, M, out);
                }
                _tile_release();
            }
        }
        free(wpk); free(wdf); free(wmf); free(xpc); free(sx);
        return failed;
    }
#endif
    (void)nthreads;   /* the reference runs on the calling thread */
    gemm_f32_ref(fmt, x, M, K, qs, wd, wm, N, out);
    return 0;
}

/* out [M, N] = q8 activations (xq, xd) times the weight (fmt, qs, wd)^T at the library's level.
   Returns 0, or 1 where a buffer could not be allocated (out then incomplete). */
int gemm_q8(int fmt, const int8_t *xq, const float *xd, int M, int K, const void *qs, const uint16_t *wd, int x16,
            int N, float *out, int nthreads) {
#if HAVE_AVX2G
    if (gemm_q8_runs(fmt)) {
        const int amx = g_level == LVL_AMX, wide = g_level == LVL_AVX2 && fmt == FMT_Q8_0, nb = K / QK, Mp = (M + MTILE - 1) / MTILE * MTILE;
        int8_t *xp = aligned_alloc(64, (size_t)Mp * K * (wide ? 2 : 1));
        float *xdp = aligned_alloc(64, (size_t)Mp * nb * sizeof(float));
        int32_t *csx = aligned_alloc(64, (size_t)Mp * nb * sizeof(int32_t));
        int failed = !xp || !xdp || !csx;
        const struct weight wt = weight_of(fmt, qs, wd, x16, K);
        if (!failed) {
            pack_activations(xq, xd, M, Mp, K, fmt == FMT_Q8_0 ? 128 : 8, wide, xp, xdp, csx);
            const long panels = (N + PANEL - 1) / PANEL;
            #pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1) reduction(|:failed)
            {
                int8_t *panel = aligned_alloc(64, (size_t)PANEL * K * (wide ? 2 : 1));
                float *wdp = aligned_alloc(64, (size_t)PANEL * nb * sizeof(float));
                uint8_t *row = malloc((size_t)K);
                if (!panel || !wdp || !row) failed = 1;
#if HAVE_AMX
                if (amx && !failed) amx_configure();
#endif
                #pragma omp for schedule(dynamic)
                for (long p = 0; p < panels; p++) {
                    if (failed) continue;
                    if (wide) {
                        const int16_t *w16 = pack_weights_wide(&wt, p * PANEL, N, K, (int16_t *)panel, row, wdp);
                        panel_avx2_wide(w16, wdp, xp, xdp, Mp, K, p * PANEL, N, M, out);
                        continue;
                    }
                    const int8_t *w = pack_weights(fmt, &wt, p * PANEL, N, K, !amx, panel, row, wdp);
#if HAVE_AMX
                    if (amx) {
                        panel_amx(w, wdp, xp, xdp, Mp, K, p * PANEL, N, M, out);
                        continue;
                    }
#endif
#if HAVE_VNNI
                    if (g_level == LVL_VNNI) {
                        panel_vnni(w, wdp, xp, xdp, csx, Mp, K, p * PANEL, N, M, out);
                        continue;
                    }
#endif
#if HAVE_AVXVNNIG
                    if (g_level == LVL_AVXVNNI) {
                        panel_avxvnni(w, wdp, xp, xdp, csx, Mp, K, p * PANEL, N, M, out);
                        continue;
                    }
#endif
                    panel_avx2(w, wdp, xp, xdp, csx, Mp, K, p * PANEL, N, M, out);
                }
#if HAVE_AMX
                if (amx) _tile_release();
#endif
                free(panel);
                free(wdp);
                free(row);
            }
        }
        free(xp);
        free(xdp);
        free(csx);
        return failed;
    }
#endif
    (void)nthreads;   /* the reference runs on the calling thread */
    gemm_q8_ref(fmt, xq, xd, M, K, qs, wd, x16, N, out);
    return 0;
}
