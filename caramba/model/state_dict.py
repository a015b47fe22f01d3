"""From HF-named checkpoint tensors to this model's fused parameter layout."""

from __future__ import annotations

import torch

from caramba.model.config import ModelConfig


def fuse_hf_state_dict(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Map a transformers state dict (`model.layers.N.self_attn.q_proj.weight`, or GPT-2's
    `transformer.h.N.attn.c_attn.weight`) onto Transformer's names.

    q|k|v and gate|up are concatenated so each runs as one matmul; gate|up, GPT-2's fc and the
    head are stored transposed (see InputMajorLinear).
    """
    take = _Taker(hf)
    out = (_gpt2 if cfg.name == "gpt2" else _llama)(take, cfg)
    if take.missing:
        shown = ", ".join(take.missing[:5]) + (f" (+{len(take.missing) - 5} more)" if len(take.missing) > 5 else "")
        raise ValueError(f"checkpoint is missing tensors: {shown}")
    return out


class _Taker:
    """hf[name], noting every absent name so one error can list them all."""

    def __init__(self, hf: dict[str, torch.Tensor]) -> None:
        self.hf, self.missing = hf, []

    def __call__(self, name: str) -> torch.Tensor | None:
        if name not in self.hf:
            self.missing.append(name)
        return self.hf.get(name)


# HF's per-layer norm names -> this model's, by which norms a family has (ModelConfig.pre_norms,
# post_norms): Llama's second norm is the MLP's pre-norm; Gemma's and OLMo 2's is the attention's post-norm.
_NORMS = {
    (True, False): {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"},
    (True, True): {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attn_norm",
                   "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "post_mlp_norm"},
    (False, True): {"post_attention_layernorm": "post_attn_norm", "post_feedforward_layernorm": "post_mlp_norm"},
}


def _llama(take: _Taker, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Llama and the families named like it (Mistral, Qwen2/3, Phi-3's fused projections, OLMo 2, Gemma)."""
    embed = take("model.embed_tokens.weight")
    norm = _gemma_norm if cfg.name in GEMMA else (lambda w: w)
    out: dict[str, torch.Tensor] = {"norm.weight": norm(take("model.norm.weight"))}
    _embeddings(out, take, cfg, embed)
    fused_qkv = cfg.name == "phi3"
    for i in range(cfg.n_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        if fused_qkv:
            out[o + "attn.wqkv.weight"] = take(p + "self_attn.qkv_proj.weight")
            out[o + "mlp.w13.weight_t"] = _t(take(p + "mlp.gate_up_proj.weight"))   # gate | up, as w13
        else:
            out[o + "attn.wqkv.weight"] = _cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            out[o + "mlp.w13.weight_t"] = _t(_cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]))
        if cfg.qkv_bias:
            out[o + "attn.wqkv.bias"] = _cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        out[o + "attn.wo.weight"] = take(p + "self_attn.o_proj.weight")
        if cfg.out_bias:
            out[o + "attn.wo.bias"] = take(p + "self_attn.o_proj.bias")
        out[o + "mlp.w2.weight"] = take(p + "mlp.down_proj.weight")
        for hf_norm, name in _NORMS[(cfg.pre_norms, cfg.post_norms)].items():
            out[f"{o}{name}.weight"] = norm(take(f"{p}{hf_norm}.weight"))
        if cfg.qk_norm is not None:
            for n in "qk":
                out[f"{o}attn.{n}_norm.weight"] = norm(take(f"{p}self_attn.{n}_norm.weight"))
    return out


GEMMA = ("gemma2", "gemma3")


def _gemma_norm(w: torch.Tensor | None) -> torch.Tensor | None:
    """Gemma's RMSNorm scales by (1 + w): folded here, so the model's RMSNorm is Llama's. In float32,
    as HF's Gemma RMSNorm computes 1 + w, whatever the weights' dtype."""
    return None if w is None else 1.0 + w.float()


def _gpt2(take: _Taker, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """GPT-2's Conv1D weights are [in, out]: transposed for nn.Linear slots, as-is for fc."""
    p = "transformer."
    out: dict[str, torch.Tensor] = {"wpe.weight": take(p + "wpe.weight")}
    _embeddings(out, take, cfg, take(p + "wte.weight"))
    out.update(_layer_norm(take, p + "ln_f", "norm"))
    for i in range(cfg.n_layers):
        h, o = f"{p}h.{i}.", f"layers.{i}."
        out.update(_layer_norm(take, h + "ln_1", o + "attn_norm"))
        out.update(_layer_norm(take, h + "ln_2", o + "mlp_norm"))
        out[o + "attn.wqkv.weight"] = _t(take(h + "attn.c_attn.weight"))   # q | k | v along out
        out[o + "attn.wqkv.bias"] = take(h + "attn.c_attn.bias")
        out[o + "attn.wo.weight"] = _t(take(h + "attn.c_proj.weight"))
        out[o + "attn.wo.bias"] = take(h + "attn.c_proj.bias")
        out[o + "mlp.fc.weight_t"] = take(h + "mlp.c_fc.weight")
        out[o + "mlp.fc.bias"] = take(h + "mlp.c_fc.bias")
        out[o + "mlp.proj.weight"] = _t(take(h + "mlp.c_proj.weight"))
        out[o + "mlp.proj.bias"] = take(h + "mlp.c_proj.bias")
    return out


def _embeddings(out: dict, take: _Taker, cfg: ModelConfig, embed: torch.Tensor | None) -> None:
    if cfg.tie_embeddings:
        out["head.weight_t"] = _t(embed)
    else:
        out["embed.weight"] = embed
        out["head.weight_t"] = _t(take("lm_head.weight"))


def _layer_norm(take: _Taker, hf_name: str, name: str) -> dict[str, torch.Tensor]:
    return {f"{name}.weight": take(f"{hf_name}.weight"), f"{name}.bias": take(f"{hf_name}.bias")}


def _t(w: torch.Tensor | None) -> torch.Tensor | None:
    return None if w is None else w.t().contiguous()


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if any(p is None for p in parts) else torch.cat(parts, dim=0)
