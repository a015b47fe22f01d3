"""The decoder's parts: norms, attention, projections and MLPs (caramba.model.transformer stacks
them into blocks). A module of their own so that code reading the model's layers (the fused decode
step, caramba.model.fast_decode; the drafts) needs not import the decoder that calls it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from caramba.cache import LayerKVCache
from caramba.cache.sdpa import attention, softcapped_attention
from caramba import fused
from caramba.gemm import dense, linear
from caramba.model.config import ModelConfig
from caramba.model.rope import apply_rope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as the reference does, then scale in the model's dtype.
        if fused.applies(x) and self.weight.dtype == torch.float32:
            return fused.rms_norm(x, self.weight, self.eps)   # one C pass, not five ops (threads over a prefill's rows)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # one fused kernel
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_width, self.kv_width = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, self.q_width + 2 * self.kv_width, bias=cfg.qkv_bias)
        self.wo = nn.Linear(self.q_width, cfg.dim, bias=cfg.out_bias)
        # QK-norm (Qwen3, Gemma 3: per head; OLMo 2: over the projection's width), before RoPE.
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm is not None:
            q_dim, k_dim = (cfg.head_dim, cfg.head_dim) if cfg.qk_norm == "head" else (self.q_width, self.kv_width)
            self.q_norm, self.k_norm = RMSNorm(q_dim, cfg.norm_eps), RMSNorm(k_dim, cfg.norm_eps)
        # Attention computes scores at head_dim ** -0.5; another scale (Gemma's query_pre_attn_scalar)
        # is folded into the queries: q . k * s == (q * s sqrt(D)) . k * D ** -0.5.
        factor = cfg.score_scale * cfg.head_dim ** 0.5
        self.q_factor = None if factor == 1.0 else factor
        self.softcap = cfg.attn_softcap

    def forward(self, x, cos, sin, cache: LayerKVCache | None, mask: torch.Tensor | None, causal: bool):
        B, T, _ = x.shape
        qkv = linear(self.wqkv, x)
        if self.qk_norm == "projection":
            q, k, v = qkv.split([self.q_width, self.kv_width, self.kv_width], dim=-1)
            qkv = torch.cat([self.q_norm(q.contiguous()), self.k_norm(k.contiguous()), v], dim=-1)
        rows = qkv                                                    # [B, T, width]
        qkv = qkv.view(B, T, self.n_heads + 2 * self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k, v = qkv.split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=1)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is not None:  # learned absolute positions (GPT-2) are already in x: nothing to rotate
            if self.qk_norm == "head":
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            else:   # q and k heads in one go
                rotate = self.n_heads + self.n_kv_heads
                qk = fused.rope_heads(rows, cos, sin, rotate) if fused.rope_applies(rows, cos) \
                    else apply_rope(qkv[:, :rotate], cos, sin)
                q, k = qk.split([self.n_heads, self.n_kv_heads], dim=1)             # [B, H, T, D], [B, KVH, T, D]
        if self.q_factor is not None:
            q = q * self.q_factor
        if cache is not None:
            if cache.observer is not None:   # a press watching the context prefill (caramba.press.observe)
                cache.observer(q, k, v, cos, sin, mask, causal)
            if self.softcap is not None:     # scores capped before the softmax: no fused kernel computes that
                y = cache.attend_softcapped(q, k, v, mask, causal, self.softcap)
            else:
                y = cache.attend(q, k, v, mask, causal)                    # appends k, v; reads [0, S)
        elif self.softcap is not None:
            y = softcapped_attention(q, k, v, mask, causal, self.softcap)
        else:
            y = attention(q, k, v, mask, causal)
        return linear(self.wo, y.transpose(1, 2).reshape(B, T, self.q_width))


class InputMajorLinear(nn.Module):
    """y = x @ weight_t, with weight_t [in, out] (the transpose of nn.Linear's weight).

    The loaders write the wide projections (the gate|up projection, GPT-2's fc, the vocabulary
    head) this way: torch's batch-1 GEMV streamed it markedly faster than nn.Linear's [out, in]
    (docs/benchmarks.md, the fp32 rows). Its memory may be held either way: as built, [in, out]
    contiguous; or, after hold_row_major(), [out, in] contiguous with weight_t its transposed view
    (`layout` "rows"). load_model holds a CPU model's MLP projections row-major: the fused C step
    reads them at least as fast (SmolLM2, 1 and 8 token rows, avx2 and avx512 levels,
    docs/decode-speed-log.md §28) and oneDNN's AVX2 GEMM, a prefill's, reads a transposed weight at
    ~0.6x or pays a copy of it on every call.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))

    @property
    def layout(self) -> str | None:
        """"rows" when the weight is held [out, in] (hold_row_major), else None: part of
        caramba.evaluation's model identity, since a product's summation order follows it."""
        w = self.weight_t
        return "rows" if w.dim() == 2 and not w.is_contiguous() and w.t().is_contiguous() else None

    def hold_row_major(self) -> None:
        """Hold the weight's memory [out, in]; weight_t (its values, state_dict) is unchanged."""
        if self.layout is None:
            self.weight_t = nn.Parameter(self.weight_t.detach().t().contiguous().t(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense(x, self.weight_t.t())   # x @ weight_t; prefill-sized fp32: oneDNN (caramba.gemm)


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (act = SiLU) or GeGLU (tanh GELU: Gemma)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.hidden = cfg.intermediate_size
        self.gelu = cfg.mlp == "geglu"
        self.w13 = InputMajorLinear(cfg.dim, 2 * cfg.intermediate_size)  # gate | up
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.dim, bias=False)       # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.w13(x)
        if fused.applies(gu):
            return linear(self.w2, (fused.gelu_mul if self.gelu else fused.silu_mul)(gu, self.hidden))
        gate, up = gu.split(self.hidden, dim=-1)
        return linear(self.w2, (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up)


class BiasedInputMajorLinear(InputMajorLinear):
    """InputMajorLinear plus a bias: GPT-2's c_fc, a Conv1D whose weight is already [in, out]."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features)
        self.bias = nn.Parameter(torch.empty(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense(x, self.weight_t.t(), self.bias)


class GeluMLP(nn.Module):
    """fc -> GELU -> proj (GPT-2). fc is wide, so it is input-major like gate|up."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = (BiasedInputMajorLinear if cfg.mlp_bias else InputMajorLinear)(cfg.dim, cfg.intermediate_size)
        self.proj = nn.Linear(cfg.intermediate_size, cfg.dim, bias=cfg.mlp_bias)
        self.approximate = "tanh" if cfg.mlp == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.proj, F.gelu(self.fc(x), approximate=self.approximate))


def make_norm(cfg: ModelConfig) -> nn.Module:
    return RMSNorm(cfg.dim, cfg.norm_eps) if cfg.norm == "rms" else nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
