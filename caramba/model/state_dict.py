"""From HF-named checkpoint tensors to this model's fused parameter layout."""

from __future__ import annotations

import torch

from caramba.model.config import ModelConfig


def fuse_hf_state_dict(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Map `model.layers.N.self_attn.q_proj.weight`-style tensors onto Transformer's names.

    q|k|v and gate|up are concatenated so each runs as one matmul; gate|up and the head are
    stored transposed (see InputMajorLinear).
    """
    missing = []

    def take(name: str, optional: bool = False) -> torch.Tensor | None:
        if name in hf:
            return hf[name]
        if not optional:
            missing.append(name)
        return None

    embed = take("model.embed_tokens.weight")
    out: dict[str, torch.Tensor] = {"norm.weight": take("model.norm.weight")}
    if cfg.tie_embeddings:
        out["head.weight_t"] = _t(embed)
    else:
        out["embed.weight"] = embed
        out["head.weight_t"] = _t(take("lm_head.weight"))
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        qkv = [take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
        out[f"layers.{i}.attn.wqkv.weight"] = _cat(qkv)
        if cfg.qkv_bias:
            out[f"layers.{i}.attn.wqkv.bias"] = _cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        out[f"layers.{i}.attn.wo.weight"] = take(p + "self_attn.o_proj.weight")
        out[f"layers.{i}.mlp.w13.weight_t"] = _t(_cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]))
        out[f"layers.{i}.mlp.w2.weight"] = take(p + "mlp.down_proj.weight")
        out[f"layers.{i}.attn_norm.weight"] = take(p + "input_layernorm.weight")
        out[f"layers.{i}.mlp_norm.weight"] = take(p + "post_attention_layernorm.weight")
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing tensors: {shown}")
    return out


def _t(w: torch.Tensor | None) -> torch.Tensor | None:
    return None if w is None else w.t().contiguous()


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if any(p is None for p in parts) else torch.cat(parts, dim=0)
