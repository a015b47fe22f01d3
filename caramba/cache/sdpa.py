"""The torch path's scaled dot-product attention: torch's SDPA, or a causal prefill through
oneDNN's GEMM in blocks of queries.

torch's CPU SDPA (its flash-attention kernel) multiplies its tiles with the BLAS torch was built
with (MKL's sgemm), which on the AMD EPYC Zen 5 ran a causal 512-token prefill's attention of
SmolLM2-135M (9 query heads over 3 KV heads, 64 wide) at ~44 GFLOP/s on one core. A prompt's
causal attention (T queries at the end of S keys: a prompt, or a chunk of one after the chunks
the cache already holds, left-padded rows and windows included: any mask that hides nothing
causal attention would show) is here computed per KV head and block of BLOCK queries: the
scores of the group's query heads side by side, [n x rep, end], against the keys up to the block's
last query, masked (the upper triangle of the block's diagonal, or the mask's own rows), the
softmax (one threaded C pass where caramba.fused runs: at 512 tokens torch's masked_fill and
softmax were ~4% of a prefill), then the probabilities times those values, both products through
caramba.gemm.dense (oneDNN where it applies). Per layer, one thread, alternated: 3.5 against 6.7 ms at 512 tokens,
39 against 64 ms at 2048 (docs/decode-speed-log.md §12). The same arithmetic in another order:
outputs agree with SDPA's to rounding (tests/cache/test_sdpa.py), not bit for bit.

Everything else (ring buffers' storage order, a query that sees nothing, fewer queries than
MIN_TOKENS, or than MIN_CHUNK after cached keys, other devices and dtypes, autograd,
`CARAMBA_ONEDNN=0`) goes to F.scaled_dot_product_attention.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from caramba import fused, gemm

BLOCK = 128       # queries per block: 128 ran faster than 256 or 512 at 512 and 2048 tokens
# Where the blocks start to win (Zen 5, one layer, alternated): a prompt from 192 tokens (SDPA is
# as fast at ~160 on one thread, ~224 on two); queries after cached ones from 512 (256 queries
# after 1024-4096 cached keys took 15-30% longer than SDPA; 512 after 1024-16384 were 1.1-2.1x
# faster).
MIN_TOKENS = 192
MIN_CHUNK = 512


_seen: tuple[weakref.ref, tuple[int, bool] | None] | None = None   # the last mask checked, and what it was


def causal_offset(mask: torch.Tensor | None, causal: bool, T: int, S: int) -> tuple[int, bool] | None:
    """(P, padded) when T queries at slots [P, P + T) attend over S = P + T keys at most
    causally: a prompt, or a chunk of one after the chunks the cache holds; padded when the mask
    hides more than the later slots (left padding: a padding query sees only itself), so the
    blocks must apply it. None for anything else (a key after its query, a window's mask is
    fine, a query that sees nothing is not). A forward passes one mask to every layer: it is
    checked once."""
    global _seen
    if mask is None:
        return (0, False) if causal and T == S else None
    if causal or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (T, S):
        return None
    if _seen is not None and _seen[0]() is mask:
        return _seen[1]
    below = torch.ones(T, S, dtype=torch.bool, device=mask.device).tril(S - T)
    if bool((mask & ~below).any()) or not bool(mask.any(-1).all()):
        found = None
    else:
        found = (S - T, not bool((mask == below).all()))
    _seen = (weakref.ref(mask), found)
    return found


def blocked_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> bool:
    """Whether attention(q, k, v, mask, causal) takes the blocked GEMM path."""
    if not (q.shape[2] >= MIN_TOKENS and q.device.type == "cpu"
            and q.dtype == k.dtype == v.dtype == torch.float32 and q.shape[1] % k.shape[1] == 0
            and q.shape[-1] == k.shape[-1] and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                                                                or v.requires_grad))
            and gemm.available()):
        return False
    found = causal_offset(mask, causal, q.shape[2], k.shape[2])
    return found is not None and (found[0] == 0 or q.shape[2] >= MIN_CHUNK)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x with its last dim contiguous. torch's fused CPU kernel (flash attention) takes only such
    keys and values; q8_0's keys read back transposed (QuantStream.read of keys-major codes that
    are converted, not unpacked), which sent their attention to SDPA's math path: the KV heads
    expanded, the scores materialized. A 40-token question over ~1k cached slots (SmolLM2-135M,
    8 rows) took ~0.93 s through q8_0 that way, ~0.77 s now; the answers are the same."""
    return x if x.stride(-1) == 1 else x.contiguous()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
              causal: bool = False) -> torch.Tensor:
    """q [B, H, T, D] over k [B, KVH, S, D] and v [B, KVH, S, Dv] (H a multiple of KVH: grouped
    query heads) -> [B, H, T, Dv]; mask as SDPA's attn_mask, causal as its is_causal."""
    if not blocked_applies(q, k, v, mask, causal):
        return F.scaled_dot_product_attention(q, _rows(k), _rows(v), attn_mask=mask, is_causal=causal,
                                              enable_gqa=True)
    B, H, T, D = q.shape
    KVH, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    (P, padded), rep = causal_offset(mask, causal, T, S), H // KVH
    # each query's group of heads side by side, [B, KVH, T, rep, D], scaled: a block's queries are
    # then one [n * rep, D] matrix, and its output rows land in out [B, T, H, Dv] as they come
    grouped = torch.empty(B, KVH, T, rep, D, dtype=q.dtype)
    torch.mul(q.view(B, KVH, rep, T, D).transpose(2, 3), D ** -0.5, out=grouped)
    out = torch.empty(B, T, H, Dv, dtype=q.dtype)
    fast = fused.available()
    if not fast:   # torch's masked_fill: a block's queries never see later keys
        above = torch.ones(BLOCK, BLOCK, dtype=torch.bool).triu(1)[:, None]
    for b in range(B):
        for g in range(KVH):
            keys, values = k[b, g].contiguous(), v[b, g].contiguous()       # [S, D], [S, Dv]
            for s0 in range(0, T, BLOCK):
                s1 = min(T, s0 + BLOCK)
                n, end = s1 - s0, P + s1                                    # the block sees keys [0, end)
                scores = gemm.dense(grouped[b, g, s0:s1].view(n * rep, D), keys[:end], projection=False)
                rows = mask[b % mask.shape[0], 0, s0:s1, :end] if padded else None   # they hide later slots too
                if fast:     # mask and softmax in one threaded pass
                    probs = fused.causal_softmax(scores, rep, P + s0, rows)
                else:
                    if padded:
                        scores.view(n, rep, end).masked_fill_(~rows[:, None], float("-inf"))
                    else:
                        scores.view(n, rep, end)[:, :, P + s0:].masked_fill_(above[:n, :, :n], float("-inf"))
                    probs = torch.softmax(scores, dim=-1)
                out[b, s0:s1, g * rep:(g + 1) * rep] = gemm.dense(probs, values[:end].t(),
                                                                  projection=False).view(n, rep, Dv)
    return out.transpose(1, 2)


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         causal: bool, cap: float) -> torch.Tensor:
    """attention() with the scores soft-capped before the softmax, cap * tanh(scores / cap)
    (Gemma 2), which no fused SDPA kernel computes: the scores are materialized, as in HF's eager
    attention, and the softmax runs in float32."""
    B, H, T, D = q.shape
    rep = H // k.shape[1]
    keys, values = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ keys.transpose(-1, -2)) * D ** -0.5
    scores = torch.tanh(scores / cap) * cap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif causal:
        S = k.shape[2]
        scores = scores.masked_fill(torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T).logical_not(),
                                    float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ values


__all__ = ["BLOCK", "MIN_CHUNK", "MIN_TOKENS", "attention", "blocked_applies", "causal_offset", "softcapped_attention"]
