"""The torch path's scaled dot-product attention: torch's SDPA, or a fresh causal prefill through
oneDNN's GEMM in blocks of queries.

torch's CPU SDPA (its flash-attention kernel) multiplies its tiles with the BLAS torch was built
with (MKL's sgemm), which on the AMD EPYC Zen 5 ran a causal 512-token prefill's attention of
SmolLM2-135M (9 query heads over 3 KV heads, 64 wide) at ~44 GFLOP/s on one core. A prompt's
causal self-attention (no cache before it, no mask but the causal one) is here computed per KV
head and block of BLOCK queries: the scores of the group's query heads stacked, [rep x n, end],
against the keys up to the block's end, the upper triangle of the block's diagonal masked, the
softmax, then the probabilities times those values, both products through caramba.gemm.dense
(oneDNN where it applies). Per layer, one thread, alternated: 3.5 against 6.7 ms at 512 tokens,
39 against 64 ms at 2048 (docs/decode-speed.md §12). The same arithmetic in another order:
outputs agree with SDPA's to rounding (tests/test_sdpa.py), not bit for bit.

Everything else (masks, a cache already holding tokens, other devices and dtypes, autograd,
`CARAMBA_ONEDNN=0`) goes to F.scaled_dot_product_attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from caramba import gemm

BLOCK = 128      # queries per block: 128 ran faster than 256 or 512 at 512 and 2048 tokens
MIN_TOKENS = 64  # below, one SDPA call costs less than the blocks' GEMM calls


def blocked_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> bool:
    """Whether attention(q, k, v, mask, causal) takes the blocked GEMM path."""
    return (causal and mask is None and q.shape[2] == k.shape[2] >= MIN_TOKENS and q.device.type == "cpu"
            and q.dtype == k.dtype == v.dtype == torch.float32 and q.shape[1] % k.shape[1] == 0
            and q.shape[-1] == k.shape[-1] and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                                                                or v.requires_grad))
            and gemm.available())


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
              causal: bool = False) -> torch.Tensor:
    """q [B, H, T, D] over k [B, KVH, S, D] and v [B, KVH, S, Dv] (H a multiple of KVH: grouped
    query heads) -> [B, H, T, Dv]; mask as SDPA's attn_mask, causal as its is_causal."""
    if not blocked_applies(q, k, v, mask, causal):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
    B, H, T, D = q.shape
    KVH, Dv = k.shape[1], v.shape[-1]
    rep = H // KVH
    q = (q * D ** -0.5).contiguous()
    out = torch.empty(B, H, T, Dv, dtype=q.dtype)
    above = torch.ones(BLOCK, BLOCK, dtype=torch.bool).triu(1)   # a block's queries never see later keys
    for b in range(B):
        for g in range(KVH):
            keys, values = k[b, g].contiguous(), v[b, g].contiguous()       # [T, D], [T, Dv]
            heads = q[b, g * rep:(g + 1) * rep]                             # [rep, T, D]
            for s0 in range(0, T, BLOCK):
                s1 = min(T, s0 + BLOCK)
                n = s1 - s0
                scores = gemm.dense(heads[:, s0:s1].reshape(rep * n, D), keys[:s1])   # [rep n, s1]
                scores.view(rep, n, s1)[:, :, s0:].masked_fill_(above[:n, :n], float("-inf"))
                probs = torch.softmax(scores, dim=-1)
                out[b, g * rep:(g + 1) * rep, s0:s1] = gemm.dense(probs, values[:s1].t()).view(rep, n, Dv)
    return out


__all__ = ["BLOCK", "attention", "blocked_applies"]
