/* The fused decode step's arguments (decode_step.c), mirrored field for field by the ctypes
   Structures of caramba.model.step_abi (tests/test_fast_decode.py compares sizes and offsets
   through step_abi_layout). Every field is 8 bytes but the last two, so the layout has no padding
   a mirror could get wrong. */

#ifndef CARAMBA_DECODE_STEP_H
#define CARAMBA_DECODE_STEP_H

#include "kv_stream.h"
#include "quant_gemv.h"

/* A projection y = x W^T (+ bias) in the layout the model holds it. */
typedef struct {
    int64_t fmt, N, K;   /* a format of quant_gemv.h; N outputs, K inputs */
    const void *w;       /* fp32 weights ([N, K], or [K, N] for F32_COLS), or the block codes */
    const uint16_t *d;   /* block scales (fp16) */
    const uint16_t *m;   /* block minimums (q4_1) */
    const float *bias;   /* or NULL */
} Lin;

/* One layer's weights. */
typedef struct {
    const float *attn_norm, *mlp_norm;   /* RMSNorm weights [dim] */
    Lin qkv, o, w13, w2;                 /* [q | k | v], attention output, [gate | up], down */
} LayerPlan;

/* One step: T new tokens for each of M / T cache rows. */
typedef struct {
    int64_t n_layers;
    const LayerPlan *layers;      /* [n_layers] */
    const Lin *head;              /* the LM head */
    const float *final_norm;      /* [dim] */
    Stream *streams;              /* [n_layers, 2]: each layer's K and V stream */
    const float *x;               /* [M, dim] embedded tokens */
    float *logits;                /* [M, vocab], or [M / T, vocab] with last_only */
    int64_t M, T;                 /* M token rows: T consecutive new tokens per cache row */
    int64_t last_only;            /* logits of each cache row's last new token only */
    int64_t dim, n_heads, n_kv, head_dim, hidden;
    int64_t max_seq, slot;        /* the cache's length in slots; the first new token's slot (the model's
                                     numbers: a ragged press's layers have their own, Stream.slots and
                                     Stream.offset) */
    const int64_t *positions;     /* [M] rotary positions */
    const uint8_t *mask;          /* [M, slot + T]: nonzero where row r attends slot s; NULL: every cached
                                     slot, and the row's new tokens up to its own; a layer reads its
                                     slot i at i + its offset, and below each head's first valid slot
                                     nothing */
    const float *cos, *ssin;      /* [P, head_dim] rotary tables (ssin: sin, first half negated) */
    float eps;                    /* RMSNorm's */
    int32_t nthreads;
} StepArgs;

/* Returns 0; 1 when scratch could not be allocated; 2 for shapes or streams it does not take
   (head_dim over 512, over 64 query heads per KV head, a stream stream_ok refuses). Nothing is
   written then. */
int decode_step(const StepArgs *args);

#endif
