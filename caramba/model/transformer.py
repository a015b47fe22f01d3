"""A Llama-family decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU. The config swaps in
other families' parts where they need them: GPT-2's (LayerNorm, learned absolute positions, a GELU
MLP, biases), QK-norm and post-norms (Qwen3, OLMo 2), Gemma's (GeGLU, scaled embeddings, soft caps,
sliding and full layers side by side, each with its own mask and RoPE base).

One forward serves prefill, single-token decode and multi-token verify: token ids, their
positions and the cache go in, logits come out. Projections are fused (q|k|v and gate|up)
so a decode step runs two matmuls fewer per layer than the checkpoint's layout.
"""

from __future__ import annotations

import torch
from torch import nn

from caramba.cache import CachePolicy, KVCache, KVCacheKind, LayerKVCache
from caramba.cache import hybrid
from caramba.cache.mask import attention_mask, narrowest
from caramba import fused
from caramba.model.config import ModelConfig
from caramba.model.decoupled import DecoupledAttention, decoupled_cache
from caramba.model.layers import MLP, Attention, GeluMLP, InputMajorLinear, RMSNorm, make_norm
from caramba.model.rope import RotaryTable


class Block(nn.Module):
    """attn and MLP, each with its residual: x + post(f(pre(x))). Llama norms before each (pre), OLMo 2
    after each (post), Gemma both; a missing norm is nn.Identity."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = make_norm(cfg) if cfg.pre_norms else nn.Identity()
        self.attn = (DecoupledAttention if cfg.attention == "decoupled" else Attention)(cfg)
        self.mlp_norm = make_norm(cfg) if cfg.pre_norms else nn.Identity()
        self.mlp = MLP(cfg) if cfg.mlp in ("swiglu", "geglu") else GeluMLP(cfg)
        self.post_norms = cfg.post_norms
        if cfg.post_norms:
            self.post_attn_norm, self.post_mlp_norm = make_norm(cfg), make_norm(cfg)

    def forward(self, x, cos, sin, cache, mask, causal):
        h = self.attn(self.attn_norm(x), cos, sin, cache, mask, causal)
        if self.post_norms:
            h = self.post_attn_norm(h)
        norm = self.mlp_norm
        if isinstance(norm, RMSNorm) and fused.applies(x) and h.is_contiguous() and norm.weight.dtype == torch.float32:
            x, normed = fused.add_rms_norm(x, h, norm.weight, norm.eps)   # residual + norm in one pass
        else:
            x = x + h
            normed = norm(x)
        h = self.mlp(normed)
        return x + (self.post_mlp_norm(h) if self.post_norms else h)


class Transformer(nn.Module):
    # Whether decoders may run this model's steps through the fused C step. The forward below never
    # does: the C step is a backend a decoder chooses when it starts (caramba.model.backend.choose
    # reads this flag; False: the torch path).
    fast_decode: bool = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        # Tied models keep one matrix: the head's [dim, vocab], whose columns are the embeddings.
        self.embed = None if cfg.tie_embeddings else nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = make_norm(cfg)
        self.head = InputMajorLinear(cfg.dim, cfg.vocab_size)
        # GPT-2's learned absolute positions [max_position_embeddings, dim]; RoPE models have none.
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.dim) if cfg.positions == "learned" else None
        self._rope: RotaryTable | None = None
        self._rope_local: RotaryTable | None = None   # the sliding layers' (rope_local_theta), if their own

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        # The activations' dtype: the norms stay in it when the projections are quantized.
        return self.norm.weight.dtype

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.embed is None:
            if hasattr(self.head, "embedding"):   # a quantized head (caramba.model.quant) reads its rows
                return self.scale_embeddings(self.head.embedding(tokens).to(self.dtype))
            # Columns of the [dim, vocab] head: gathered along the rows (index_select) and transposed
            # once, 3x faster at a 4k-token prefill than F.embedding's strided rows of weight_t.t().
            x = self.head.weight_t.index_select(1, tokens.flatten()).t().contiguous().view(*tokens.shape, -1)
            return self.scale_embeddings(x)
        return self.scale_embeddings(self.embed(tokens))

    def scale_embeddings(self, x: torch.Tensor) -> torch.Tensor:
        """Embeddings times config.embed_scale (Gemma's sqrt(dim)), the scale rounded to their dtype as HF does."""
        scale = self.config.embed_scale
        return x if scale is None else x * torch.tensor(scale, dtype=x.dtype)

    def new_cache(
        self,
        batch_size: int,
        max_seq_len: int,
        kind: CachePolicy | KVCacheKind | str = KVCacheKind.FP32,
    ) -> KVCache:
        """A cache of one kind for every stream, or as a CachePolicy says (per stream, per layer)."""
        policy = CachePolicy.of(kind)
        if self.config.attention == "decoupled":   # k_sem, k_geo and v streams
            return decoupled_cache(self.config, batch_size, max_seq_len, policy, self.device, self.dtype)
        policy.check_streams(decoupled=False)
        cfg, width = self.config, self.config.n_kv_heads * self.config.head_dim
        # A hybrid model's sliding layers keep a ring of their window (caramba.cache.hybrid).
        ring = min(max_seq_len, cfg.sliding_window + hybrid.SLACK) if cfg.hybrid else max_seq_len
        sliding = [cfg.hybrid and cfg.is_sliding(i) for i in range(cfg.n_layers)]
        layers = [LayerKVCache(batch_size, ring if sliding[i] else max_seq_len, width, width, device=self.device,
                               n_kv_heads=cfg.n_kv_heads, dtype=self.dtype, **policy.for_layer(i, sliding[i]))
                  for i in range(cfg.n_layers)]
        return hybrid.HybridKVCache(layers, sliding, cfg.sliding_window) if cfg.hybrid else KVCache(layers)

    def rotary(self, positions: torch.Tensor, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of the positions; local: the sliding layers' table (rope_local_theta)."""
        name = "_rope_local" if local else "_rope"
        table, needed = getattr(self, name), int(positions.max()) + 1
        if table is None or table.cos.shape[0] < needed or table.cos.device != self.device:
            size = max(needed, self.config.max_position_embeddings)
            with torch.inference_mode(False):  # a plain tensor, usable by autograd callers too
                table = RotaryTable(self.config, size, self.device, local=local)
            setattr(self, name, table)
        return table(positions, self.dtype)

    def layer_rotary(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor] | tuple[None, None]]:
        """Each layer's cos, sin: one table, or the sliding layers' own where their RoPE base differs."""
        if self.wpe is not None:
            return [(None, None)] * self.config.n_layers
        cfg, full = self.config, self.rotary(positions)
        if cfg.rope_local_theta is None:
            return [full] * cfg.n_layers
        local = self.rotary(positions, local=True)
        return [local if cfg.is_sliding(i) else full for i in range(cfg.n_layers)]

    def layer_windows(self) -> list[int | None]:
        """Each layer's trained sliding window (None: full attention)."""
        return [self.config.layer_window(i) for i in range(self.config.n_layers)]

    def learned_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [B, T] -> rows of the learned table [B, T, dim], indexed exactly as RoPE's."""
        limit = self.wpe.num_embeddings
        if int(positions.max()) >= limit:
            raise ValueError(f"position {int(positions.max())} is past this model's learned position table "
                             f"(n_positions={limit}): prompt plus new tokens must fit in {limit} tokens")
        return self.wpe(positions)

    def forward(
        self,
        tokens: torch.Tensor,                       # [B, T] token ids
        positions: torch.Tensor | None = None,      # [B, T] RoPE / learned-table positions; default: cache slots
        cache: KVCache | None = None,
        slot_mask: torch.Tensor | None = None,      # [B, >= S] True where a cache slot is a real token
        last_only: bool = False,                    # logits for the last position only (prefill)
        window: int | None = None,                  # sliding-window span (slots); a cache may bring its own
    ) -> torch.Tensor:                              # [B, T or 1, vocab] logits
        B, T = tokens.shape
        start = cache.length if cache is not None else 0
        if cache is not None:
            cache.check_room(T)
            masks = self.layer_masks(B, T, cache, slot_mask, tokens.device, window)
        else:
            built = {w: self._attention_mask(B, T, slot_mask, tokens.device, narrowest(window, w))
                     for w in set(self.layer_windows())}
            masks = [built[w] for w in self.layer_windows()]
        if positions is None:
            positions = torch.arange(start, start + T, device=tokens.device).expand(B, T)
        rope = self.layer_rotary(positions)
        x = self.embed_tokens(tokens)
        if self.wpe is not None:
            x = x + self.learned_positions(positions)
        for i, layer in enumerate(self.layers):
            x = layer(x, *rope[i], cache.layers[i] if cache is not None else None, *masks[i])
        if last_only:
            x = x[:, -1:]
        return self.cap_logits(self.head(self.norm(x)))

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """cap * tanh(logits / cap) with config.final_softcap (Gemma 2); else the logits as they are."""
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def layer_masks(self, B: int, T: int, cache: KVCache, slot_mask: torch.Tensor | None, device: torch.device,
                    window: int | None = None) -> list[tuple[torch.Tensor | None, bool]]:
        """cache_mask per layer: a hybrid model's sliding and full layers differ (each built once)."""
        if not self.config.hybrid:
            return [self.cache_mask(B, T, cache, slot_mask, device, window)] * self.config.n_layers
        return cache.layer_masks(B, T, slot_mask, device, window, self.layer_windows())

    def cache_mask(self, B: int, T: int, cache: KVCache, slot_mask: torch.Tensor | None, device: torch.device,
                   window: int | None = None) -> tuple[torch.Tensor | None, bool]:
        """The attention mask of T new tokens per row over the cache (and whether it is causal).
        The cache knows where its keys lie (a ring buffer's are not in slot order) and its own
        window; the model's trained window binds too."""
        return cache.attention_mask(B, T, slot_mask, device, window, self.config.sliding_window)

    @staticmethod
    def _attention_mask(B, T, slot_mask, device, window=None) -> tuple[torch.Tensor | None, bool]:
        """The mask of a forward without a cache: causal over its T tokens, minus padding and
        out-of-window slots (a cache builds its own: KVCache.attention_mask)."""
        return attention_mask(B, T, 0, slot_mask, device, window)
