"""One scorer per press method: how much each cached token of one row matters, per KV head
(caramba.press.spec names each method's scorer and traits).

Each scorer sees one batch row's real tokens in order (`Row`: its keys and values as the cache
holds them, post-RoPE, plus what the layer's observer collected for that row) and returns
scores [KVH, L]: higher is kept first; +inf marks a token the method always keeps (SnapKV's
window, TOVA's last token, ExpectedAttention's sinks), where kvpress pads with max + 1.

The formulas are kvpress 0.5.5's (kvpress/presses/*_press.py), which follow the papers:
- streaming_llm (arXiv 2309.17453): the first n_sink tokens and the most recent ones; the
  pruned span is [n_sink, n_sink + L - int(L * (1 - ratio))).
- knorm (arXiv 2406.11430): -||k||_2, in fp32.
- snapkv (arXiv 2404.14469): the softmax attention (fp32, causal) of the last window_size
  queries over the keys before the window, averaged over the window, average-pooled (kernel
  kernel_size, zero padding kernel_size // 2, counted in the mean), averaged over each GQA group.
- pyramidkv (arXiv 2406.02069): snapkv's scores; the per-layer budget is caramba.press.budget's.
- tova (arXiv 2401.06104): the last query's attention over the earlier keys, averaged over all
  query heads (every KV head gets the same scores).
- observed_attention (H2O, arXiv 2306.14048): the attention each key received summed over the
  context's queries, divided by how many queries see it (L - i), averaged over each GQA group.
- expected_attention (kvpress): the pre-RoPE query mean mu and covariance C from token n_sink on,
  rotated by the RoPE matrix averaged over the next n_future_positions positions (R mu, R C R^T);
  softmax over the keys after the sinks of k.mu / sqrt(d) + k^T C k / (2 d), averaged over each
  GQA group, times ||v||_2; the sinks are kept.
- keydiff (arXiv 2504.15364): -cos(k, mean of the normalized keys).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

INF = float("inf")


@dataclass
class Row:
    """One row's real tokens of one layer, and that layer's observation of them."""

    keys: torch.Tensor                       # [KVH, L, D] fp32, post-RoPE
    values: torch.Tensor                     # [KVH, L, Dv]
    n_heads: int                             # query heads
    window_q: torch.Tensor | None = None     # [H, W, D] post-RoPE queries of the last W tokens
    attn_sum: torch.Tensor | None = None     # [H, L] attention received, summed over the queries
    q_mean: torch.Tensor | None = None       # [H, D] pre-RoPE query mean (tokens n_sink..)
    q_cov: torch.Tensor | None = None        # [H, D, D] their covariance (population)
    inv_freq: torch.Tensor | None = None     # [D/2] RoPE frequencies; None: no RoPE
    budget: int | None = None                # tokens this row keeps per head (set by caramba.press.select)

    @property
    def length(self) -> int:
        return self.keys.shape[1]

    @property
    def groups(self) -> int:
        return self.n_heads // self.keys.shape[0]


def streaming_llm(row: Row, press) -> torch.Tensor:
    L = row.length
    # The row's budget where selection set one (decoding-time compression keeps a target count).
    n_pruned = L - (int(L * (1 - press.ratio)) if row.budget is None else row.budget)
    scores = torch.ones(row.keys.shape[:2], device=row.keys.device)
    scores[:, press.n_sink: press.n_sink + n_pruned] = 0
    return scores


def knorm(row: Row, press) -> torch.Tensor:
    return -torch.linalg.vector_norm(row.keys, dim=-1, dtype=torch.float32)


def window_attention(row: Row, window: int) -> torch.Tensor:
    """[H, W, L - W]: the softmax (fp32, causal) of the last `window` queries over all L keys,
    restricted to the keys before the window."""
    L, D = row.length, row.keys.shape[-1]
    keys = row.keys.repeat_interleave(row.groups, dim=0)                      # [H, L, D]
    logits = row.window_q @ keys.transpose(1, 2) / math.sqrt(D)               # [H, W, L]
    # Window query i sits at position L - W + i and sees keys 0..L - W + i.
    future = torch.ones(window, L, dtype=torch.bool, device=logits.device).triu(L - window + 1)
    attn = logits.masked_fill(future, -INF).softmax(dim=-1, dtype=torch.float32)
    return attn[..., : L - window]


def snapkv(row: Row, press) -> torch.Tensor:
    W, k = press.window_size, press.kernel_size
    scores = window_attention(row, W).mean(dim=-2)                            # [H, L - W]
    scores = F.avg_pool1d(scores, kernel_size=k, padding=k // 2, stride=1)
    scores = scores.view(row.keys.shape[0], row.groups, -1).mean(dim=1)       # [KVH, L - W]
    return F.pad(scores, (0, W), value=INF)


pyramidkv = snapkv   # its per-layer budgets: caramba.press.budget


def tova(row: Row, press) -> torch.Tensor:
    scores = window_attention(row, 1).mean(dim=0)                             # [1, L - 1] over all heads
    scores = scores.expand(row.keys.shape[0], -1)
    return F.pad(scores, (0, 1), value=INF)


def observed_attention(row: Row, press) -> torch.Tensor:
    L = row.length
    n_queries = torch.arange(L, 0, -1, device=row.attn_sum.device, dtype=row.attn_sum.dtype)
    scores = row.attn_sum / n_queries                                         # [H, L]
    return scores.view(row.keys.shape[0], row.groups, L).mean(dim=1)


def average_rope(inv_freq: torch.Tensor | None, start: int, n: int, dim: int) -> torch.Tensor:
    """[D, D] the RoPE rotation (HF's half-split layout) averaged over positions [start, start + n)."""
    if inv_freq is None:
        return torch.eye(dim)
    positions = torch.arange(start, start + n, device=inv_freq.device, dtype=torch.float32)
    angles = positions[:, None] * inv_freq.float()[None, :]
    emb = torch.cat([angles, angles], dim=-1)                                  # [n, D]
    half = dim // 2
    # R = diag(cos) + sin * P with P the rotate_half matrix ([-x2, x1] = P x), averaged over positions.
    P = torch.zeros(dim, dim, device=inv_freq.device)
    P[half:, :half], P[:half, half:] = torch.eye(half), -torch.eye(half)
    return torch.diag(emb.cos().mean(dim=0)) + emb.sin().mean(dim=0)[None, :] * P


def expected_attention(row: Row, press) -> torch.Tensor:
    n_sink, L = press.n_sink, row.length
    keys, values = row.keys[:, n_sink:], row.values[:, n_sink:]               # [KVH, L - n_sink, D]
    D = keys.shape[-1]
    R = average_rope(row.inv_freq, L, press.n_future_positions, D).to(keys.device)
    mu = row.q_mean.float() @ R.T                                             # [H, D]
    cov = R @ row.q_cov.float() @ R.T                                         # [H, D, D]
    k = keys.repeat_interleave(row.groups, dim=0)                              # [H, n, D]
    scores = (k @ mu[:, :, None]).squeeze(-1) / math.sqrt(D)
    scores = scores + torch.einsum("hnd,hde,hne->hn", k, cov, k) / D / 2
    scores = scores.softmax(dim=-1)
    scores = scores.view(keys.shape[0], row.groups, -1).mean(dim=1)           # [KVH, n]
    scores = scores * values.norm(dim=-1)
    return F.pad(scores, (n_sink, 0), value=INF)


def keydiff(row: Row, press) -> torch.Tensor:
    anchor = F.normalize(row.keys, p=2, dim=-1).mean(dim=1, keepdim=True)     # [KVH, 1, D]
    return -F.cosine_similarity(row.keys, anchor, dim=-1)


__all__ = ["Row", "average_rope", "expected_attention", "keydiff", "knorm", "observed_attention", "pyramidkv", "snapkv",
           "streaming_llm", "tova", "window_attention"]
