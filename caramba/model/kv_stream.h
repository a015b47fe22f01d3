/* The KV cache streams a decode step reads and writes (kv_stream.c), for decode_step.c. */

#ifndef CARAMBA_KV_STREAM_H
#define CARAMBA_KV_STREAM_H

#include <stddef.h>

#include "../cache/kinds.h"
#include "cpu_isa.h"

/* One layer's K or V as caramba.cache stores it (kv_stream.c's comment has the layouts); mirrored
   by caramba.model.step_abi.Stream. */
typedef struct {
    int64_t kind;       /* a KV_* id (kinds.h) */
    void *codes;        /* KV_FP32: the fp32 values; KV_FP16 / KV_BF16: the 16-bit values; else the codes */
    uint16_t *params;   /* fp16 block parameters, or NULL */
    int64_t block;      /* elements per block; per-channel kinds: tokens per group G */
    float *ring;        /* fp32 copies [M, n_kv, ring_n, D] at slot p % ring_n (KV_FP32: the values), or NULL
                           (KV_FP16 / KV_BF16: their values, codes, are laid out as this ring would be) */
    int64_t ring_n;
    int64_t r0;         /* positions < r0 are read from codes, the rest from the ring */
    const float *rot;   /* [D, D]: the stream holds x @ rot; NULL: x */
    /* A layer's own slots (a ragged press: caramba.cache.evict's PressedLayerKVCache). K and V of
       a layer agree on these three. */
    int64_t slots;          /* the stream's capacity S: its codes and parameters are [rows, n_kv, S, ...] */
    int64_t offset;         /* the model's slot of this stream's slot i is i + offset */
    const int64_t *first;   /* [cache rows, n_kv]: each row and head's first valid slot (its survivors
                               lie in [first, the survivors' end)); NULL: 0 */
    /* A packed store (caramba.cache.packed: a per-head press, each row and head's slots back to back):
       codes [Dc, store] (keys) or [store, Dc] (values; KV_FP32: [store, D]), parameters
       [nb * p, store] (per-channel: [2 D, store / G]); a row and head's slot i at store slot org + i
       (org: a multiple of G for per-channel kinds). The rings stay per head: [rows, n_kv, ring_n, D]. */
    const int64_t *org;     /* [cache rows, n_kv]; NULL: the regular [rows, n_kv, slots] layout */
    int64_t store;          /* the store's slots (org != NULL) */
    /* A ring (caramba.cache.ring, a hybrid model's sliding layers: caramba.cache.hybrid): its slot s is
       stored at s % wrap, and a step reads its storage slots [0, min(slot + T, wrap)) under the
       layer's mask; wrap == slots, per-token kinds without a residual window. 0: no ring. */
    int64_t wrap;
} Stream;

/* Where head rg's codes lie: (the head index, its slot count and the store slot of its slot 0) to
   address codes and parameters with, as the regular layout's [rows, n_kv, S] would be. */
typedef struct { long rg, S, at; } HeadAt;
static inline HeadAt head_at(const Stream *s, long rg, long S) {
    if (s->org) return (HeadAt){0, (long)s->store, (long)s->org[rg]};
    return (HeadAt){rg, S, 0};
}

static inline int kv_bits(int kind) { return KV_BITS[kind]; }
static inline int kv_float(int kind) { return KV_FLOAT[kind]; }   /* fp32, fp16, bf16 values: no codes */
static inline int kv_zero_point(int kind) { return KV_ZERO_POINT[kind]; }
static inline int kv_per_channel(int kind) { return KV_PER_CHANNEL[kind]; }
static inline float kv_offset(int kind) { return KV_OFFSET[kind]; }

/* The row of position p, head rg, in the ring (a float stream's values: the ring's layout). */
static inline long ring_index(const Stream *s, long rg, int p) {
    if (s->org && kv_float((int)s->kind)) return s->org[rg] + p;   /* a packed store's values */
    return rg * s->ring_n + p % s->ring_n;
}

/* Position p's fp32 copy in the ring, head rg. */
static inline float *ring_row(const Stream *s, long rg, int p, int D) { return s->ring + ring_index(s, rg, p) * D; }

/* n values of a KV_FP16 or KV_BF16 stream as floats (exact). */
HIDDEN void widen_row(int kind, const uint16_t *src, float *dst, int n);

/* Position p of head rg as floats from the ring (a quantized stream's fp32 copies, KV_FP32's
   values) in place, or an fp16 / bf16 stream's row widened into buf [D]. Inline: the attention
   reads every slot above the codes through it. */
static inline const float *read_row(const Stream *s, long rg, int p, int D, float *buf) {
    if (!kv_float((int)s->kind) || s->kind == KV_FP32) return ring_row(s, rg, p, D);
    widen_row((int)s->kind, (const uint16_t *)s->codes + ring_index(s, rg, p) * D, buf, D);
    return buf;
}

/* x [D] as a float stream of this kind reads it back: itself (KV_FP32), or rounded to fp16 / bf16
   to nearest even (torch's conversions) and widened again. */
HIDDEN void float_as_stored(int kind, const float *x, int D, float *out);

/* Floats of key_scores_channels' scratch. */
static inline size_t channel_scratch(int rep, int D) { return (size_t)8 * rep * D + 16 * (size_t)D + 8 * (size_t)rep; }

/* Whether decode_step can read and write this stream for head size D. */
HIDDEN int stream_ok(const Stream *s, int D, int keys);

/* Scores sc[j, i] (row stride ld) = q_j . k(p0 + i), j < rep, over positions [p0, p0 + n) of the
   stream's codes for head rg: per-token kinds (scratch t [rep, n], sf, bf [n]) and per-channel
   ones (scratch: channel_scratch floats). */
HIDDEN void key_scores_tokens(const Stream *st, long rg, long S, int D, const float *q, int rep, int p0, int n,
                              float *sc, int ld, float *t, float *sf, float *bf);
HIDDEN void key_scores_channels(const Stream *st, long rg, long S, int D, const float *q, int rep, int p0, int n,
                                float *sc, int ld, float *scratch);

/* p V of up to 16 coded value slots straight from a per-token stream's codes (kv_stream.c); 0: not
   taken (the caller decodes rows). Scratch: 5 nb 16 floats, nb = D / block. */
HIDDEN int value_codes(const Stream *st, long rg, long S, int D, int p0, int cn, const float *e, int ld, int rep,
                       float *o, int ow, float *bsum, float *scratch);

/* A per-token value row's codes as floats (before the block scales): u + off, NF4[u] or u. */
HIDDEN void decode_row(int kind, const uint8_t *row, int D, float *out);

/* A head vector's codes u [D] and parameters (quantize_vector), and the values they stand for. */
HIDDEN void quantize_vector(int kind, const float *x, int D, int qb, uint8_t *u, uint16_t *par);
HIDDEN void dequantize_vector(int kind, const uint8_t *u, const uint16_t *par, int D, int qb, float *out);

/* out = x [D] @ rot [D, D]. */
HIDDEN void rotate(const float *x, const float *rot, int D, float *out);

/* The new token's K or V x (as stored) at position slot of head rg: codes, parameters and ring (a
   float stream: its values). */
HIDDEN void write_new(const Stream *st, int keys, long rg, long S, int D, int slot, const float *x, const uint8_t *u,
                      const uint16_t *par);

/* A per-channel group completed by the new token x at slot: quantized into the codes. Scratch: xg
   [D, G] floats, ug [D, G] bytes. */
HIDDEN void complete_group(const Stream *st, long rg, long S, int D, int slot, const float *x, float *xg, uint8_t *ug);

#endif
