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
   The newer families' parts are the same loop with a part more or less (LayerPlan, StepArgs):
   QK-norm of q and k before RoPE, per head or over the whole projection (Qwen3, Gemma 3, OLMo 2);
   no norm before attention and MLP (OLMo 2: h = x) and norms of their outputs before each
   residual add (Gemma, OLMo 2: x += rms_norm(a W_o^T)); GeGLU's tanh GELU for SiLU; the queries
   times q_factor (folded into the scores' scale); and a hybrid model's sliding layers with their
   own mask and rotary tables (Gemma 3). Scaled embeddings and the logits' soft cap are the
   caller's (caramba.model.fast_decode), before and after the call.

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

   A ragged press (caramba.cache.evict: PyramidKV's per-layer budgets, AdaKV's per-head ones)
   gives each layer its own slots: its Streams carry their capacity and the model's slot of their
   slot 0 (offset), so the new token lands in the layer's own next slot while its RoPE position is
   the sequence's; and each cache row and head's first valid slot: a head's survivors lie right-
   aligned in one run, and the step neither reads nor scores the holes in front of them, so a
   head that keeps fewer tokens costs less to read. A per-head press's packed layer
   (caramba.cache.packed) keeps no holes at all: its Streams give each row and head's origin in
   one store (org), and kv_stream.h's head_at addresses that head's codes there instead of at
   rg * slots; the rings stay per head.

   A ring cache (caramba.cache.ring; a hybrid model's sliding layers, caramba.cache.hybrid) holds slot
   s at storage slot s % wrap (Stream.wrap): once it wraps, the step reads all of its storage
   slots [0, wrap) under the layer's mask (which is over storage order), finds its new tokens at
   (slot + t) % wrap (new_index) and writes them there; before, storage order is slot order and
   nothing differs.

   Projections come in the layouts the model holds (no copies): fp32 [N, K] (nn.Linear), fp32
   [K, N] (InputMajorLinear) and the block formats of quant_gemv.c (step_linear.c).

   The step is in named parts, each taking the thread's Step (its arguments, shapes, scratch and
   the layer in hand): attention_inputs (norm, q|k|v projection, RoPE, the new K and V as stored),
   attend (scores and softmax partials over this thread's cache slots), store_new_tokens,
   combine_partials, mlp (output projection, residual, norm, SwiGLU, down projection) and head.
   The softmax weights and the value sums of a part are attend_sums.c's. Arguments come as one
   StepArgs (decode_step.h, mirrored by caramba.model.step_abi). Each loop with SIMD code has a
   portable reference (*_ref) that the scalar instruction set level (cpu_isa.c: CARAMBA_ISA=scalar,
   or a build without AVX2) runs and tests compare against.

   A stepwise step (StepArgs.stepwise: a teacher-forced text's T tokens of one cache row, the
   perplexity protocol's) gives each new token t the attention its own one-token step would: every
   new token is stored first (one barrier more a layer), then row t is attended as that step's
   only row (row_as_step: slots below its own read as that step reads them, from codes where it
   would; its slots and parts cut at its end), and its partials combined over that step's parts.
   With row_exact the projections' rows are batch-independent too, so the logits are the T steps'
   bit for bit, the weights read once.

   A joined step (decode_step_joined: caramba.evaluation.joined's candidates, each answering from
   its own cache) takes several StepArgs, segments of one model: the projections, MLP and head run
   once over all their rows (the weights are read once, which is most of a step), and each layer's
   attention runs segment by segment, each a step of its own cache (its streams, slot, masks and
   rotary positions), every thread taking its run of every segment's parts. decode_step is the
   one-segment case: the same arithmetic, so a joined step's rows get the bits of one step over a
   single cache holding them all. */

#include "decode_step.h"
#include "attend_sums.h"
#include "decode_ops.h"
#include "step_linear.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>

#define ATT_PART 64         /* cache slots per attention part (a split that does not follow the threads) */

/* One thread's step: the arguments and their shapes, the shared buffers, this thread's cache
   parts and private scratch, and the layer in hand. Every part of the step takes it. */
typedef struct {
    const StepArgs *a;
    int M, T, dim, n_heads, n_kv, D, hidden, rep, q_w, qkv_w, kmax, gmax, tid, nt, stepwise;
    int slot0, partmax, nalloc;       /* the model's first new slot; the most parts of a layer; the most
                                         slots a thread takes in one */
    float scale, softcap;             /* softcap 0: scores as they are */
    size_t part_w, chan_n;
    /* shared: projection outputs, attention partials [parts, M, heads, D + 2], column sums */
    float *qkv, *proj, *gu, *part, *cols;
    /* a joined step's segments (decode_step_joined; one: decode_step) and where each one's partials
       start in part (floats; [nseg + 1]) */
    const StepArgs *segs;
    int nseg;
    const size_t *part_at;
    /* this thread's parts [p0, p1) and slots [s0, s1), n = s1 - s0 */
    int p0, p1, s0, s1, n;
    /* private: residual stream, normed input, roped q, new k and v as stored, attention output, MLP
       gate, the new k and v as read, scores and their scratch, a rotation's output, minimum sums, a
       group being quantized, decoded value rows and their block parameters, per-channel scratch, a
       row's QK-normed q|k, a post-normed output; the new k and v's codes and parameters, a group's
       codes */
    float *x, *h, *q, *k, *v, *att, *act, *kn, *vn, *sc, *t, *sf, *bf, *tmp, *bsum, *xg, *vbuf, *ppb, *qs, *qkn, *post;
    uint16_t *kpar, *vpar;
    uint8_t *ku, *vu, *ug;
    Act codes;
    /* the layer in hand: its weights, streams, mask and rotary tables; keys read from codes below kce,
       values below vce; its own slots (a ragged press gives each layer its own): the first new
       token's, the slots attended (L = slot + T; a ring's storage slots: at most wrap), the capacity
       S, the model's slot of its slot 0 (off), each cache row and head's first valid slot (first,
       NULL: 0) and its parts of ATT_PART slots; a ring's wrap (0: none) and where its first new token
       is stored (at0) */
    const LayerPlan *lp;
    const Stream *ks, *vs;
    const uint8_t *mask;
    const float *cos, *ssin;
    int kchan, kce, vce, kgroup;
    int slot, L, off, nparts, wrap, at0;
    long S;
    const int64_t *first;
} Step;

/* ---- attention ------------------------------------------------------------------------------- */

/* x*cos + roll(x, D/2)*ssin for one head (ssin: sin with its first half negated, RotaryTable's). */
static inline void rope_head(const float *v, float *out, const float *cos, const float *ssin, int D) {
    const int h = D / 2;
    for (int i = 0; i < h; i++) out[i] = v[i] * cos[i] + v[i + h] * ssin[i];
    for (int i = h; i < D; i++) out[i] = v[i] * cos[i] + v[i - h] * ssin[i];
}

/* v rotated in place by rot (x @ rot), through the scratch tmp [D]. */
static inline void rotate_in_place(float *v, const float *rot, int D, float *tmp) {
    rotate(v, rot, D, tmp);
    memcpy(v, tmp, sizeof(float) * D);
}

/* The new K or V head vector src of a per-token quantized stream: its codes and parameters, and
   what the torch path reads back for it (its codes' values below the stream's r0, else itself). */
static void new_token_as_read(const Stream *st, const float *src, int D, int at, uint8_t *u, uint16_t *par,
                              float *read) {
    if (kv_float((int)st->kind)) {       /* fp16 / bf16 values read back rounded */
        float_as_stored((int)st->kind, src, D, read);
        return;
    }
    if (!kv_per_channel((int)st->kind)) {
        quantize_vector((int)st->kind, src, D, (int)st->block, u, par);
        if (at < st->r0) {
            dequantize_vector((int)st->kind, u, par, D, (int)st->block, read);
            return;
        }
    }
    memcpy(read, src, sizeof(float) * D);
}

/* The end of the slots [0, end) a step whose new token is at `slot` reads from a stream's codes:
   none for float values, a per-channel stream's whole groups (below r0), else those below r0 and
   below the new token. */
static inline int codes_end(const Stream *st, int slot) {
    const int r0 = (int)st->r0;
    return kv_float((int)st->kind) ? 0 : kv_per_channel((int)st->kind) ? r0 : r0 < slot ? r0 : slot;
}

/* x normed by w into h, or x itself without a norm (OLMo 2 has none before attention and MLP). */
static const float *pre_norm(Step *s, const float *w) {
    if (!w) return s->x;
    rms_norm(s->x, w, s->h, s->M, s->dim, s->a->eps);
    return s->h;
}

/* A row's q|k (row: its q|k|v) QK-normed into the thread's qkn (the same layout), per head or over
   each whole projection; the row itself without QK-norm. */
static const float *qk_normed(Step *s, const float *row) {
    const LayerPlan *lp = s->lp;
    if (!lp->q_norm) return row;
    const int D = s->D, q_w = s->q_w, k_w = s->n_kv * D;
    const float eps = s->a->eps;
    if (lp->qk_whole) {
        rms_norm(row, lp->q_norm, s->qkn, 1, q_w, eps);
        rms_norm(row + q_w, lp->k_norm, s->qkn + q_w, 1, k_w, eps);
    } else {                    /* each head a row of D */
        rms_norm(row, lp->q_norm, s->qkn, s->n_heads, D, eps);
        rms_norm(row + q_w, lp->k_norm, s->qkn + q_w, s->n_kv, D, eps);
    }
    return s->qkn;
}

/* The attention's inputs from q|k|v = h W_qkv^T (a segment's rows: its own streams and positions):
   q and k QK-normed where the layer has it, roped (with the layer's tables), then rotated as the
   cache stores keys; v rotated as it stores values; the new k and v's codes, and the new k and v as
   the torch path reads them back (kn, vn). Then a per-channel key group the new token completes is
   quantized into the cache before anyone reads it (the loop's implicit barrier). */
static void attention_inputs(Step *s) {
    const StepArgs *a = s->a;
    const Stream *ks = s->ks, *vs = s->vs;
    const int M = s->M, D = s->D, q_w = s->q_w, n_kv = s->n_kv;
    for (int r = 0; r < M; r++) {
        const float *row = s->qkv + (long)r * s->qkv_w, *qk = qk_normed(s, row);
        const float *c = s->cos + a->positions[r] * D, *sn = s->ssin + a->positions[r] * D;
        const int at = s->slot + r % s->T;
        for (int hh = 0; hh < s->n_heads; hh++) {
            float *qh = s->q + (long)r * q_w + hh * D;
            rope_head(qk + hh * D, qh, c, sn, D);
            if (ks->rot) rotate_in_place(qh, ks->rot, D, s->tmp);
        }
        for (int g = 0; g < n_kv; g++) {
            const long rg = (long)r * n_kv + g;
            float *kr = s->k + rg * D, *vr = s->v + rg * D;
            rope_head(qk + q_w + g * D, kr, c, sn, D);
            if (ks->rot) rotate_in_place(kr, ks->rot, D, s->tmp);
            if (vs->rot) rotate(row + q_w + (n_kv + g) * D, vs->rot, D, vr);
            else memcpy(vr, row + q_w + (n_kv + g) * D, sizeof(float) * D);
            new_token_as_read(ks, kr, D, at, s->ku + rg * D, s->kpar + rg * D, s->kn + rg * D);
            new_token_as_read(vs, vr, D, at, s->vu + rg * D, s->vpar + rg * D, s->vn + rg * D);
        }
    }
    if (s->kgroup) {
#pragma omp for schedule(static)
        for (int rg = 0; rg < M * n_kv; rg++)
            complete_group(ks, rg, s->S, D, s->slot, s->k + (long)rg * D, s->xg, s->ug);
    }
}

/* Row r's new token u of its cache row (slot slot + u), KV head g, as the cache will read it back. */
static inline const float *new_row(const Step *s, const float *buf, int r, int u, int g) {
    const int first = r - r % s->T;
    return buf + ((long)(first + u) * s->n_kv + g) * s->D;
}

/* Which new token storage slot sl of the layer holds (its slot - slot), or -1: an older one. */
static inline int new_index(const Step *s, int sl) {
    int u = sl - s->at0;
    if (u < 0 && s->wrap) u += s->wrap;      /* a ring: the new tokens may wrap to storage slot 0 */
    return u >= 0 && u < s->T ? u : -1;
}

/* A ring's new keys among the slots [b0, c1) scored from codes, rescored from kn: once a ring wraps
   they sit where its codes still hold the slots they replace. */
static void ring_new_keys(Step *s, int r, int g, const float *qg, int b0, int c1) {
    for (int u = 0; u <= r % s->T; u++) {
        const int sl = (s->at0 + u) % s->wrap;
        if (sl < b0 || sl >= c1) continue;
        const float *kk = new_row(s, s->kn, r, u, g);
        for (int j = 0; j < s->rep; j++) s->sc[(long)j * s->n + sl - s->s0] = dot_f32(kk, qg + (long)j * s->D, s->D);
    }
}

/* sc[j, i] for this thread's slots [s0, s1) of row r, KV group g (its rep query heads qg): from
   codes below kce, else the ring or the new tokens; masked slots and later new tokens -inf;
   scaled by q_factor / sqrt(D), then soft-capped where the model caps them (Gemma 2). */
static void group_scores(Step *s, int r, int g, const float *qg) {
    const Stream *ks = s->ks;
    const int D = s->D, rep = s->rep, n = s->n, s0 = s->s0, s1 = s->s1, tt = r % s->T;
    const long rg = (long)(r / s->T) * s->n_kv + g;    /* the cache row's KV head */
    float *sc = s->sc;
    /* a ragged press's holes [0, lo) are neither read nor scored: the head reads its survivors only */
    const int lo = s->first ? (int)s->first[rg] : 0, b0 = s0 > lo ? s0 : lo;
    const int c1 = s1 < s->kce ? s1 : s->kce;
    if (c1 > b0) {
        if (s->kchan) key_scores_channels(ks, rg, s->S, D, qg, rep, b0, c1 - b0, sc + (b0 - s0), n, s->qs);
        else key_scores_tokens(ks, rg, s->S, D, qg, rep, b0, c1 - b0, sc + (b0 - s0), n, s->t, s->sf, s->bf);
    }
    for (int sl = c1 > b0 ? c1 : b0; sl < s1; sl++) {
        const int u = new_index(s, sl);
        if (u > tt) continue;                                  /* a later new token */
        const float *kk = u >= 0 ? new_row(s, s->kn, r, u, g) : read_row(ks, rg, sl, D, s->tmp);
        for (int j = 0; j < rep; j++) sc[(long)j * n + sl - s0] = dot_f32(kk, qg + (long)j * D, D);
    }
    if (s->wrap) ring_new_keys(s, r, g, qg, b0, c1);
    const uint8_t *mr = s->mask ? s->mask + (long)r * (s->L + s->off) + s->off : NULL;   /* in the layer's slots */
    /* which slots count (not a hole, masked or a later new token): once for the group's heads, then
       each head's scores scaled in a loop the compiler vectorizes (sf: key_scores_tokens' scratch) */
    float *restrict live = s->sf;
    const float scale = s->scale;
    for (int i = 0; i < n; i++) live[i] = !(s0 + i < lo || (mr && !mr[s0 + i]) || new_index(s, s0 + i) > tt);
    for (int j = 0; j < rep; j++) {
        float *restrict sj = sc + (long)j * n;
        for (int i = 0; i < n; i++) sj[i] = live[i] != 0.0f ? sj[i] * scale : -INFINITY;
        if (s->softcap > 0.0f)
            for (int i = 0; i < n; i++)
                if (sj[i] != -INFINITY) sj[i] = s->softcap * tanhf(sj[i] / s->softcap);
    }
}

/* The value rows of slots [c0, c0 + cn) that some head weighs: decoded codes (with their block
   parameters in ppb), ring rows or new tokens; NULL for the rest. Whether any is. */
static int value_rows(Step *s, int r, int g, int c0, int cn, const float **rows, int *coded) {
    const Stream *vs = s->vs;
    const int D = s->D, vnp = (kv_zero_point((int)vs->kind) ? 2 : 1) * (kv_float((int)vs->kind) ? 0 : D / (int)vs->block);
    const int vfw = D * kv_bits((int)vs->kind) / 8;
    const long rg = (long)(r / s->T) * s->n_kv + g;
    int live = 0;
    for (int k = 0; k < cn; k++) {
        const int sl = c0 + k, i = sl - s->s0, u = new_index(s, sl);
        int any = 0;
        for (int j = 0; j < s->rep; j++) any |= s->sc[(long)j * s->n + i] != 0.0f;
        coded[k] = u < 0 && sl < s->vce;
        rows[k] = NULL;
        if (!any) continue;
        live = 1;
        if (u >= 0) rows[k] = new_row(s, s->vn, r, u, g);
        else if (coded[k]) {
            float *dst = s->vbuf + (long)k * D, *pk = s->ppb + (long)k * vnp;
            const HeadAt h = head_at(vs, rg, s->S);
            decode_row((int)vs->kind, (const uint8_t *)vs->codes + (h.rg * h.S + h.at + sl) * vfw, D, dst);
            const uint16_t *ps = vs->params + h.rg * vnp * h.S + h.at + sl;
            for (int b = 0; b < vnp; b++) pk[b] = fp16_to_fp32(ps[(long)b * h.S]);
            rows[k] = dst;
        } else rows[k] = read_row(vs, rg, sl, D, s->vbuf + (long)k * D);
    }
    return live;
}

/* Whether value slots [c0, c0 + cn) are all read from codes (no new token, nothing above the codes):
   then value_codes takes them straight from the codes. */
static int coded_chunk(const Step *s, int c0, int cn) {
    if (kv_float((int)s->vs->kind) || kv_per_channel((int)s->vs->kind) || c0 + cn > s->vce) return 0;
    for (int sl = c0; sl < c0 + cn; sl++)
        if (new_index(s, sl) >= 0) return 0;
    return 1;
}

/* Part pi's partials for row r, KV group g: per head its max and sum of exp(score - max) and the
   unnormalized p V, at pg + j part_w. The scores become the softmax weights in place. */
static void part_partials(Step *s, int r, int g, int pi) {
    const Stream *vs = s->vs;
    const int D = s->D, rep = s->rep, n = s->n, s0 = s->s0;
    const int vzp = kv_zero_point((int)vs->kind), vqb = (int)vs->block, vnb = kv_float((int)vs->kind) ? 0 : D / vqb;
    const int a0 = pi * ATT_PART - s0, a1 = a0 + ATT_PART < n ? a0 + ATT_PART : n;   /* in sc */
    float *pg = s->part + (((size_t)pi * s->M + r) * s->n_heads + g * rep) * s->part_w, *sc = s->sc;
    float mx[64], sum[64];
    for (int j = 0; j < rep; j++) {
        float m = -INFINITY;
        for (int i = a0; i < a1; i++) m = sc[(long)j * n + i] > m ? sc[(long)j * n + i] : m;
        mx[j] = m;
        sum[j] = 0.0f;
        memset(pg + j * s->part_w, 0, sizeof(float) * D);
    }
    if (vzp) memset(s->bsum, 0, sizeof(float) * (size_t)rep * vnb);
    softmax_weights(sc, n, rep, a0, a1, mx, sum);
    /* p V, VCHUNK slots at a time: a chunk of coded slots straight from its codes into every head's
       sums (kv_stream.c's value_codes), else each slot's row decoded once, then every head's output
       held in registers across the chunk (value_chunk) */
    for (int c0 = s0 + a0; c0 < s0 + a1; c0 += VCHUNK) {
        const int cn = s0 + a1 - c0 < VCHUNK ? s0 + a1 - c0 : VCHUNK;
        if (coded_chunk(s, c0, cn)
            && value_codes(vs, (long)(r / s->T) * s->n_kv + g, s->S, D, c0, cn, sc + (c0 - s0), n, rep, pg, (int)s->part_w,
                           s->bsum, s->ppb))
            continue;
        const float *rows[VCHUNK];
        int coded[VCHUNK];
        if (!value_rows(s, r, g, c0, cn, rows, coded)) continue;
        for (int j = 0; j < rep; j++) {
            const ValueChunk vc = {rows, coded, s->ppb, sc + (long)j * n + (c0 - s0), cn, vnb,
                                   (vzp ? 2 : 1) * vnb, vqb, vzp, D};
            value_chunk(pg + j * s->part_w, &vc, s->bsum + (long)j * vnb);
        }
    }
    for (int j = 0; j < rep; j++) {
        float *o = pg + j * s->part_w;
        if (vzp)
            for (int c = 0; c < D; c++) o[c] += s->bsum[(long)j * vnb + c / vqb];
        o[D] = mx[j];
        o[D + 1] = sum[j];
    }
}

/* This thread's parts of row r, each KV group: the group's heads' scores over the thread's slots,
   then each part's softmax partials. */
static void attend_row(Step *s, int r) {
    for (int g = 0; g < s->n_kv; g++) {
        group_scores(s, r, g, s->q + (long)r * s->q_w + (long)g * s->rep * s->D);
        for (int pi = s->p0; pi < s->p1; pi++) part_partials(s, r, g, pi);
    }
}

static void attend(Step *s) {
    for (int r = 0; r < s->M; r++) attend_row(s, r);
}

static inline int parts_of(int slots) {
    return (slots + ATT_PART - 1) / ATT_PART;
}

/* A stepwise step's row r (StepArgs.stepwise: one cache row, its new tokens already stored) as the
   one-token step of its own slot: that slot new (read from kn / vn), the slots below it where that
   step reads them (codes below its kce and vce), this thread's slots and parts cut at its end, and
   r's buffers at row 0 of a one-token view (the cache row stays 0). 0: the thread has none of its
   slots. The cut matters for the bits, not only the work: softmax_weights takes whole 8-slot runs
   in SIMD and the rest in scalar code, and a chunk's later slots would move that boundary. */
static int row_as_step(const Step *s, int r, Step *w) {
    *w = *s;
    const int tt = r % s->T;
    w->T = 1, w->slot = s->slot + tt, w->at0 = w->slot, w->L = w->slot + 1, w->nparts = parts_of(w->L);
    w->kce = codes_end(s->ks, w->slot), w->vce = codes_end(s->vs, w->slot);
    w->s1 = s->s1 < w->L ? s->s1 : w->L, w->p1 = s->p1 < w->nparts ? s->p1 : w->nparts;
    w->n = w->s1 - w->s0;
    if (w->n <= 0) return 0;
    w->q += (long)r * s->q_w, w->kn += (long)r * s->n_kv * s->D, w->vn += (long)r * s->n_kv * s->D;
    w->part += (size_t)r * s->n_heads * s->part_w;
    if (w->mask) w->mask += (long)r * (s->L + s->off);
    return 1;
}

static void attend_stepwise(Step *s) {
    Step w;
    for (int r = 0; r < s->M; r++)
        if (row_as_step(s, r, &w)) attend_row(&w, 0);
}

/* The new tokens' K and V into the cache (a ring's at their storage slots), by the thread that owns
   the last part: nobody reads them before the next step. */
static void store_new_tokens(Step *s) {
    if (!(s->p0 < s->p1 && s->p1 == s->nparts)) return;
    const int D = s->D, n_kv = s->n_kv;
    for (long rg = 0; rg < (long)s->M * n_kv; rg++) {
        const long r = rg / n_kv, cg = r / s->T * n_kv + rg % n_kv;
        const int at = s->wrap ? (s->at0 + (int)(r % s->T)) % s->wrap : s->slot + (int)(r % s->T);
        write_new(s->ks, 1, cg, s->S, D, at, s->k + rg * D, s->ku + rg * D, s->kpar + rg * D);
        write_new(s->vs, 0, cg, s->S, D, at, s->v + rg * D, s->vu + rg * D, s->vpar + rg * D);
    }
}

/* The partials combined exactly, part by part in order (every thread, into its own att), then the
   value rotation undone. */
static void combine_partials(Step *s) {
    const int D = s->D;
    for (int r = 0; r < s->M; r++) {
        const int nparts = s->stepwise ? parts_of(s->slot + r % s->T + 1) : s->nparts;   /* row_as_step's */
        for (int hh = 0; hh < s->n_heads; hh++) {
            float mx = -INFINITY, sum = 0.0f;
            for (int pi = 0; pi < nparts; pi++) {
                const float m_t = s->part[(((size_t)pi * s->M + r) * s->n_heads + hh) * s->part_w + D];
                mx = m_t > mx ? m_t : mx;
            }
            float *o = s->att + (long)r * s->q_w + hh * D;
            memset(o, 0, sizeof(float) * D);
            for (int pi = 0; pi < nparts; pi++) {
                const float *pt = s->part + (((size_t)pi * s->M + r) * s->n_heads + hh) * s->part_w;
                if (pt[D] == -INFINITY) continue;
                const float w = expf(pt[D] - mx);
                sum += w * pt[D + 1];
                for (int i = 0; i < D; i++) o[i] += w * pt[i];
            }
            const float inv = 1.0f / sum;
            for (int i = 0; i < D; i++) o[i] *= inv;
            if (s->vs->rot) rotate_in_place(o, s->vs->rot, D, s->tmp);
        }
    }
}

/* ---- MLP and head ---------------------------------------------------------------------------- */

/* A projection's output, or (a post-norm: Gemma, OLMo 2) it normed by w into the thread's own post. */
static const float *post_norm(Step *s, const float *out, const float *w) {
    if (!w) return out;
    rms_norm(out, w, s->post, s->M, s->dim, s->a->eps);
    return s->post;
}

/* x += a W_o^T; h = rms_norm(x); x += (silu(g) * u) W_2^T where g|u = h W_13^T (GeGLU: gelu(g)), each
   output post-normed first where the layer has those norms, h = x where it has no pre-norm. The
   next layer's projections overwrite qkv and proj only after its first barrier, which every
   thread reaches after reading these. */
static void mlp(Step *s) {
    const LayerPlan *lp = s->lp;
    const int M = s->M, dim = s->dim;
    const long n = (long)M * dim;
    linear(&lp->o, s->att, M, s->proj, s->a->row_exact, &s->codes, s->cols);
    const float *ao = post_norm(s, s->proj, lp->post_attn_norm);
    if (lp->mlp_norm) add_rms_norm(s->x, ao, lp->mlp_norm, s->x, s->h, M, dim, s->a->eps);
    else for (long i = 0; i < n; i++) s->x[i] += ao[i];
    linear(&lp->w13, lp->mlp_norm ? s->h : s->x, M, s->gu, s->a->row_exact, &s->codes, s->cols);
    (s->a->gelu ? gelu_mul : silu_mul)(s->gu, s->act, M, s->hidden);
    linear(&lp->w2, s->act, M, s->proj, s->a->row_exact, &s->codes, s->cols);
    const float *mo = post_norm(s, s->proj, lp->post_mlp_norm);
    for (long i = 0; i < n; i++) s->x[i] += mo[i];
}

/* logits = rms_norm(x) W_head^T, of each cache row's last token with last_only. */
static void head(Step *s) {
    const StepArgs *a = s->a;
    const int dim = s->dim, T = s->T;
    int rows = s->M;
    if (a->last_only && T > 1) {     /* x is this thread's own */
        rows = s->M / T;
        for (int b = 0; b < rows; b++) memmove(s->x + (long)b * dim, s->x + ((long)b * T + T - 1) * dim, sizeof(float) * dim);
    }
    rms_norm(s->x, a->final_norm, s->h, rows, dim, a->eps);
    linear(a->head, s->h, rows, a->logits, a->row_exact, &s->codes, s->cols);
}

/* ---- the step -------------------------------------------------------------------------------- */

/* A layer's own slots (ks's: step_shapes checked that V's agree) and this thread's run of whole
   parts of them (a ring's: of its storage slots). (A ragged press's widest head has no holes, so
   every part has slots to read.) */
static void layer_slots(Step *s, const Stream *ks) {
    s->off = (int)ks->offset, s->slot = s->slot0 - s->off, s->L = s->slot + s->T, s->S = ks->slots;
    s->first = ks->first, s->wrap = (int)ks->wrap, s->at0 = s->slot;
    if (s->wrap) s->L = s->L < s->wrap ? s->L : s->wrap, s->at0 = s->slot % s->wrap;
    const int np = s->nparts = parts_of(s->L);
    s->p0 = (int)((long)s->tid * np / s->nt), s->p1 = (int)((long)(s->tid + 1) * np / s->nt);
    s->s0 = s->p0 * ATT_PART < s->L ? s->p0 * ATT_PART : s->L;
    s->s1 = s->p1 * ATT_PART < s->L ? s->p1 * ATT_PART : s->L;
    s->n = s->s1 - s->s0;
}

/* Layer l into the Step: its weights, streams, mask and rotary tables, and where each stream is read
   from codes (keys [0, kce), values [0, vce); the rest from the ring, the new tokens from kn / vn,
   except a new key a completed per-channel group holds: kce > slot). */
static void enter_layer(Step *s, int l) {
    const StepArgs *a = s->a;
    const LayerPlan *lp = s->lp = a->layers + l;
    s->ks = a->streams + 2L * l;
    s->vs = s->ks + 1;
    const int local = lp->sliding && a->cos_local;
    s->mask = lp->sliding ? a->mask_local : a->mask;
    s->cos = local ? a->cos_local : a->cos, s->ssin = local ? a->ssin_local : a->ssin;
    const Stream *ks = s->ks, *vs = s->vs;
    layer_slots(s, ks);
    s->kchan = kv_per_channel((int)ks->kind);
    s->kce = codes_end(ks, s->slot), s->vce = codes_end(vs, s->slot);   /* values are never per channel (stream_ok) */
    s->kgroup = s->kchan && s->L % ks->block == 0 && s->L / ks->block <= s->S / ks->block;
}

/* Segment i of the step (its rows from row0 on) as a step of its own: its arguments (streams, slot,
   masks, positions), its rows of the shared and private buffers, its partials. */
static Step segment(const Step *s, int i, int row0) {
    Step g = *s;
    const long kv = (long)row0 * s->n_kv * s->D;
    g.a = s->segs + i, g.M = (int)g.a->M, g.T = (int)g.a->T, g.slot0 = (int)g.a->slot;
    g.qkv += (long)row0 * s->qkv_w, g.q += (long)row0 * s->q_w, g.att += (long)row0 * s->q_w;
    g.k += kv, g.v += kv, g.kn += kv, g.vn += kv, g.ku += kv, g.vu += kv, g.kpar += kv, g.vpar += kv;
    g.part = s->part + s->part_at[i];
    return g;
}

/* The projections run once over every segment's rows (the weights read once); the attention per
   segment, each over its own cache. Every thread walks the segments in the same order, so the
   per-channel groups' worksharing loops and the barrier line up. A stepwise step stores its new
   tokens first (one barrier more), since its later rows read the earlier ones from the cache. */
static void layer(Step *s, int l) {
    const LayerPlan *lp = s->lp = s->a->layers + l;
    linear(&lp->qkv, pre_norm(s, lp->attn_norm), s->M, s->qkv, s->a->row_exact, &s->codes, s->cols);
    for (int i = 0, row0 = 0; i < s->nseg; row0 += (int)s->segs[i++].M) {
        Step g = segment(s, i, row0);
        enter_layer(&g, l);
        attention_inputs(&g);
        if (s->stepwise) store_new_tokens(&g);
        else attend(&g);
    }
#pragma omp barrier
    if (s->stepwise) {
        for (int i = 0, row0 = 0; i < s->nseg; row0 += (int)s->segs[i++].M) {
            Step g = segment(s, i, row0);
            enter_layer(&g, l);
            attend_stepwise(&g);
        }
#pragma omp barrier
    }
    for (int i = 0, row0 = 0; i < s->nseg; row0 += (int)s->segs[i++].M) {
        Step g = segment(s, i, row0);
        enter_layer(&g, l);
        if (!s->stepwise) store_new_tokens(&g);
        combine_partials(&g);
    }
    mlp(s);
}

/* Whether a stream's own slots fit the step: the layer's K and V agree on them (key: its K), the new
   tokens land inside its capacity (a ring's: it holds them all), and every first valid slot lies
   in [0, its first new slot]. */
static int layer_slots_ok(const StepArgs *a, const Stream *st, const Stream *key) {
    const long slot = a->slot - st->offset, rows = a->M / a->T * a->n_kv;
    if (st->slots != key->slots || st->offset != key->offset || st->first != key->first || st->org != key->org
        || st->store != key->store || st->wrap != key->wrap || st->offset < 0 || slot < 0)
        return 0;
    if (st->wrap ? st->wrap != st->slots || a->T > st->wrap || st->first || st->org : slot + a->T > st->slots)
        return 0;
    for (long i = 0; st->first && i < rows; i++)
        if (st->first[i] < 0 || st->first[i] > slot) return 0;
    return 1;
}

/* A segment's streams checked; the most parts its layers have (partmax), the largest per-channel
   group and its scratch into s (the largest over the segments). 2 for streams it does not take. */
static int segment_streams(const StepArgs *a, Step *s, int *partmax) {
    *partmax = 1;
    for (int i = 0; i < 2 * a->n_layers; i++) {
        const Stream *st = a->streams + i;
        if (!stream_ok(st, s->D, i % 2 == 0) || (a->T > 1 && kv_per_channel((int)st->kind))) return 2;   /* groups: one token a step */
        if (!layer_slots_ok(a, st, i % 2 ? st - 1 : st)) return 2;
        /* stepwise: a step's ring or residual window differs from one token to the next */
        if (a->stepwise && a->T > 1 && (st->wrap || (!kv_float((int)st->kind) && st->r0 < a->slot - st->offset + a->T))) return 2;
        const int L = (int)(st->wrap && a->slot + a->T > st->wrap ? st->wrap : a->slot - st->offset + a->T);
        const int np = parts_of(L);
        *partmax = np > *partmax ? np : *partmax;
        if (kv_per_channel((int)st->kind)) {
            s->gmax = st->block > s->gmax ? (int)st->block : s->gmax;
            s->chan_n = channel_scratch(s->rep, s->D);
        }
    }
    return 0;
}

/* Whether segment b shares segment a's model (weights, shapes, tables, settings) and, joined with
   others, is one token a row whose logits follow the rows before it (at a's plus `rows` rows). */
static int same_model(const StepArgs *a, const StepArgs *b, int joined, long rows) {
    if (b->n_layers != a->n_layers || b->layers != a->layers || b->head != a->head || b->final_norm != a->final_norm
        || b->dim != a->dim || b->n_heads != a->n_heads || b->n_kv != a->n_kv || b->head_dim != a->head_dim
        || b->hidden != a->hidden || b->cos != a->cos || b->ssin != a->ssin || b->cos_local != a->cos_local
        || b->ssin_local != a->ssin_local || b->eps != a->eps || b->q_factor != a->q_factor || b->gelu != a->gelu
        || b->softcap != a->softcap || b->row_exact != a->row_exact || b->stepwise != a->stepwise)
        return 0;
    if (b->stepwise && b->T > 1 && b->M != b->T) return 0;   /* one cache row */
    return !joined || ((b->T == 1 || (b->stepwise && b->T == a->T && !a->last_only && !b->last_only))
                       && b->logits == a->logits + rows * a->head->N);
}

/* The step's shapes from its segments' arguments (the model's: the first's) and where each
   segment's partials start (part_at [nseg + 1]); 2 for shapes or streams it does not take. */
static int step_shapes(const StepArgs *segs, int nseg, Step *s, size_t *part_at) {
    const StepArgs *a = segs;
    memset(s, 0, sizeof *s);
    s->a = a, s->segs = segs, s->nseg = nseg, s->part_at = part_at;
    s->T = (int)a->T, s->stepwise = a->T > 1 && a->stepwise, s->dim = (int)a->dim, s->n_heads = (int)a->n_heads, s->n_kv = (int)a->n_kv;
    s->D = (int)a->head_dim, s->hidden = (int)a->hidden, s->slot0 = (int)a->slot;
    if (s->D > 512 || s->n_kv < 1 || s->n_heads / s->n_kv > 64) return 2;
    s->rep = s->n_heads / s->n_kv, s->q_w = s->n_heads * s->D;
    s->qkv_w = (s->n_heads + 2 * s->n_kv) * s->D, s->kmax = s->dim > s->hidden ? s->dim : s->hidden;
    s->scale = 1.0f / sqrtf((float)s->D) * a->q_factor;   /* q_factor 1: the same bits */
    s->softcap = a->softcap;
    s->part_w = (size_t)s->D + 2, s->partmax = 1;
    s->gmax = 1;   /* the largest per-channel group: complete_group's scratch */
    part_at[0] = 0;
    long M = 0;
    for (int i = 0; i < nseg; i++) {
        const StepArgs *b = segs + i;
        int pm;
        if (!same_model(a, b, nseg > 1, M) || b->T < 1 || b->M < 0 || b->M % b->T || b->slot < 0
            || b->slot + b->T > b->max_seq || segment_streams(b, s, &pm))
            return 2;
        part_at[i + 1] = part_at[i] + (size_t)pm * b->M * s->n_heads * s->part_w;
        s->partmax = pm > s->partmax ? pm : s->partmax;
        M += b->M;
    }
    if (M > 1 << 20) return 2;
    s->M = (int)M;
    return 0;
}

/* This thread's parts and private scratch (one allocation: floats, then uint16, then bytes);
   NULL when it could not be had. */
static void *thread_scratch(Step *s) {
    const int M = s->M, D = s->D, rep = s->rep;
    s->tid = omp_get_thread_num(), s->nt = omp_get_num_threads();
    s->nalloc = (s->partmax + s->nt - 1) / s->nt * ATT_PART;   /* layer_slots gives a thread at most this many */
    const size_t kv_n = (size_t)M * s->n_kv * D, n = (size_t)s->nalloc, kq = (size_t)M * (s->kmax / QK);
    const size_t nf = (size_t)M * (2 * s->dim + s->kmax + 2 * s->q_w + s->hidden) + 4 * kv_n + 2 * kq + 2 * rep * n
                      + 2 * n + (size_t)D + (size_t)rep * D + (size_t)D * s->gmax + 3 * (size_t)VCHUNK * D + s->chan_n
                      + (size_t)s->qkv_w;
    const size_t nh = 2 * kv_n, nbytes = 4 * (size_t)M * s->kmax + 2 * kv_n + (size_t)D * s->gmax;
    float *pv = malloc(sizeof(float) * nf + sizeof(uint16_t) * nh + nbytes);
    if (!pv) return NULL;
    float *f = pv;
#define TAKE(P, N) (P) = f, f += (N)
    TAKE(s->x, (size_t)M * s->dim); TAKE(s->h, (size_t)M * s->kmax); TAKE(s->q, (size_t)M * s->q_w);
    TAKE(s->k, kv_n); TAKE(s->v, kv_n); TAKE(s->att, (size_t)M * s->q_w); TAKE(s->act, (size_t)M * s->hidden);
    TAKE(s->codes.xd, kq); TAKE(s->codes.xs, kq); TAKE(s->kn, kv_n); TAKE(s->vn, kv_n);
    TAKE(s->sc, rep * n); TAKE(s->t, rep * n); TAKE(s->sf, n); TAKE(s->bf, n); TAKE(s->tmp, (size_t)D);
    TAKE(s->bsum, (size_t)rep * D); TAKE(s->xg, (size_t)D * s->gmax);
    TAKE(s->vbuf, (size_t)VCHUNK * D); TAKE(s->ppb, 2 * (size_t)VCHUNK * D); TAKE(s->qs, s->chan_n);
    TAKE(s->qkn, (size_t)s->qkv_w); TAKE(s->post, (size_t)M * s->dim);
#undef TAKE
    s->kpar = (uint16_t *)f, s->vpar = s->kpar + kv_n;
    s->codes.xq = (int8_t *)(s->vpar + kv_n);   /* q8, int16 or split int16 activation codes: 2-byte aligned */
    s->ku = (uint8_t *)(s->codes.xq + 4 * (size_t)M * s->kmax), s->vu = s->ku + kv_n, s->ug = s->vu + kv_n;
    return pv;
}

/* The step over its shapes: shared buffers, then one parallel region. */
static int run_step(Step *shape) {
    const StepArgs *a = shape->a;
    const int M = shape->M, nthreads = a->nthreads > 0 ? a->nthreads : 1;
    /* shared: projection outputs, attention partials (each segment's [parts, M, heads, D + 2]),
       column sums */
    const size_t shared = (size_t)M * (shape->qkv_w + shape->dim + 2 * shape->hidden) + shape->part_at[shape->nseg]
                          + (size_t)nthreads * M * COLS_CHUNK;
    float *sh = malloc(sizeof(float) * shared);
    if (!sh) return 1;
    shape->qkv = sh, shape->proj = sh + (size_t)M * shape->qkv_w, shape->gu = shape->proj + (size_t)M * shape->dim;
    shape->part = shape->gu + (size_t)M * 2 * shape->hidden;
    shape->cols = shape->part + shape->part_at[shape->nseg];
    int failed = 0;

#pragma omp parallel num_threads(nthreads)
    {
        Step s = *shape;
        void *pv = thread_scratch(&s);
#pragma omp atomic
        failed += pv == NULL;
#pragma omp barrier
        if (!failed) {
            for (int i = 0, row0 = 0; i < s.nseg; row0 += (int)s.segs[i++].M)
                memcpy(s.x + (size_t)row0 * s.dim, s.segs[i].x, sizeof(float) * (size_t)s.segs[i].M * s.dim);
            for (int l = 0; l < a->n_layers; l++) layer(&s, l);
            head(&s);
        }
        free(pv);
    }
    free(sh);
    return failed ? 1 : 0;
}

int decode_step_joined(const StepArgs *segs, int nseg) {
    if (nseg < 1) return 2;
    size_t few[17], *part_at = nseg < 17 ? few : malloc(sizeof(size_t) * ((size_t)nseg + 1));
    if (!part_at) return 1;
    Step shape;
    int rc = step_shapes(segs, nseg, &shape, part_at);
    if (!rc) rc = run_step(&shape);
    if (part_at != few) free(part_at);
    return rc;
}

int decode_step(const StepArgs *a) {
    return decode_step_joined(a, 1);
}

/* The structs' layout, for caramba.model.step_abi's test: sizes of Lin, LayerPlan, Stream and
   StepArgs, then the offsets of StepArgs' fields in order, then LayerPlan's and Stream's named
   below. Returns how many it wrote (at most 64). */
int step_abi_layout(int64_t *out) {
    int i = 0;
    out[i++] = sizeof(Lin), out[i++] = sizeof(LayerPlan), out[i++] = sizeof(Stream), out[i++] = sizeof(StepArgs);
#define OFF(F) out[i++] = offsetof(StepArgs, F);
    OFF(n_layers) OFF(layers) OFF(head) OFF(final_norm) OFF(streams) OFF(x) OFF(logits) OFF(M) OFF(T) OFF(last_only)
    OFF(dim) OFF(n_heads) OFF(n_kv) OFF(head_dim) OFF(hidden) OFF(max_seq) OFF(slot) OFF(positions) OFF(mask)
    OFF(mask_local) OFF(cos) OFF(ssin) OFF(cos_local) OFF(ssin_local) OFF(eps) OFF(q_factor) OFF(nthreads) OFF(gelu)
    OFF(softcap) OFF(row_exact) OFF(stepwise)
#undef OFF
#define OFF(T, F) out[i++] = offsetof(T, F);
    OFF(LayerPlan, qkv) OFF(LayerPlan, o) OFF(LayerPlan, w13) OFF(LayerPlan, w2) OFF(LayerPlan, q_norm)
    OFF(LayerPlan, k_norm) OFF(LayerPlan, post_attn_norm) OFF(LayerPlan, post_mlp_norm) OFF(LayerPlan, qk_whole)
    OFF(LayerPlan, sliding)
    OFF(Stream, r0) OFF(Stream, rot) OFF(Stream, slots) OFF(Stream, offset) OFF(Stream, first) OFF(Stream, org)
    OFF(Stream, store) OFF(Stream, wrap)
#undef OFF
    return i;
}
