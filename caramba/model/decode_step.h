/* The fused decode step's arguments (decode_step.c), mirrored field for field by the ctypes
   Structures of caramba.model.step_abi (tests/model/test_step_parts.py compares sizes and offsets
   through step_abi_layout). Every field is 8 bytes but eps, q_factor, nthreads, gelu, softcap and
   row_exact, three pairs of 4-byte fields, so the layout has no padding a mirror could get wrong. */

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

/* One layer's weights, and which attention it is. A norm's NULL: the layer has none. */
typedef struct {
    const float *attn_norm, *mlp_norm;   /* RMSNorm weights [dim] before attention and MLP (NULL: OLMo 2) */
    Lin qkv, o, w13, w2;                 /* [q | k | v], attention output, [gate | up], down */
    const float *q_norm, *k_norm;        /* QK-norm before RoPE (Qwen3, Gemma 3, OLMo 2): [head_dim] per head,
                                            or with qk_whole [n_heads head_dim] and [n_kv head_dim] */
    const float *post_attn_norm, *post_mlp_norm;   /* [dim]: the attention's and MLP's outputs normed
                                                      before their residual add (Gemma, OLMo 2) */
    int64_t qk_whole;                    /* QK-norm over the whole q and k projections (OLMo 2), not per head */
    int64_t sliding;                     /* a hybrid model's sliding layer: StepArgs' mask_local and the local
                                            rotary tables (where given) */
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
    int64_t max_seq, slot;        /* the cache's length in slots (a ring cache's, unbounded: slot + T); the
                                     first new token's slot (the model's numbers: a ragged press's layers
                                     have their own, Stream.slots and Stream.offset) */
    const int64_t *positions;     /* [M] rotary positions */
    const uint8_t *mask;          /* [M, slot + T]: nonzero where row r attends slot s; NULL: every cached
                                     slot, and the row's new tokens up to its own; a layer reads its
                                     slot i at i + its offset, and below each head's first valid slot
                                     nothing. A ring's layer (Stream.wrap): [M, min(slot + T, wrap)]
                                     over its storage slots */
    const uint8_t *mask_local;    /* the same for the sliding layers (LayerPlan.sliding) */
    const float *cos, *ssin;      /* [P, head_dim] rotary tables (ssin: sin, first half negated) */
    const float *cos_local, *ssin_local;   /* the sliding layers' own (Gemma 3's RoPE base); NULL: cos, ssin */
    float eps;                    /* RMSNorm's */
    float q_factor;               /* queries times this after RoPE (Gemma's query scale; 1: none) */
    int32_t nthreads;
    int32_t gelu;                 /* the MLP's gate: tanh GELU (GeGLU: Gemma), else SiLU (SwiGLU) */
    float softcap;                /* scores -> softcap * tanh(scores / softcap) before the softmax (Gemma 2); 0: none */
    int32_t row_exact;            /* nonzero: one token row's fp32 [N, K] products summed as a batch's tiles sum
                                     each row (one accumulator a row, not dot_f32's four), so a row's logits
                                     are the bits it gets among other rows, joined or not (a scoring
                                     protocol's); 0: dot_f32, ~3-4% faster at one row */
    int64_t stepwise;             /* T > 1 new tokens of one cache row (M == T) fed as T one-token steps would
                                     be: every new token is stored before any attends, and new token t reads
                                     slots [0, slot + t) as step t reads them (codes where it would) and
                                     itself as read back, over step t's parts. With row_exact, a teacher-
                                     forced text's logits in chunks, bit for bit its steps' (the perplexity
                                     protocol's). Streams without a ring, residual window or per-channel
                                     group only (2 otherwise) */
} StepArgs;

/* Returns 0; 1 when scratch could not be allocated; 2 for shapes or streams it does not take
   (head_dim over 512, over 64 query heads per KV head, a stream stream_ok refuses). Nothing is
   written then. */
int decode_step(const StepArgs *args);

/* One decode step for the rows of several caches of one model (caramba.evaluation.joined): segs[i]
   is a step of its own cache (streams, max_seq, slot, positions, masks, x, M rows), and the model's
   fields (layers, head, final_norm, shapes, rotary tables, eps, q_factor, gelu, softcap) agree
   between them; nthreads and last_only are the first's. The projections, MLP and head run once
   over every segment's rows, one after another; each layer's attention runs per segment over its
   own cache. With more than one segment every T is 1 (or every segment is stepwise with one T, and
   none last_only) and the logits lie one after another (segs[i].logits follows segs[i - 1]'s M
   rows: one [sum M, vocab] array). One segment: decode_step. Returns
   decode_step's codes (2 also for segments that disagree on the model). */
int decode_step_joined(const StepArgs *segs, int nseg);

#endif
