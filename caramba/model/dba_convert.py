"""Convert a standard (RoPE, GQA) checkpoint into decoupled attention (DBA), without training.

Per head, q . k is a sum over RoPE's dimension pairs: pair i (channels i and i + head_dim/2 in
HF's half-rotation layout) is rotated by (query position - key position) * w_i, with
w_i = theta^(-2i/head_dim) falling from 1 (pair 0) to ~1/theta. The conversion splits them:

- Geometric path (exact): the geo_dim/2 fastest pairs (0 .. geo_dim/2 - 1) keep their query/key
  rows and their exact RoPE rotation (DecoupledAttention rotates them at head_dim's frequencies).
- Semantic path (approximate): the other, slower pairs lose RoPE: their rotation is taken as the
  identity. That is exact where a pair barely turns over the context (d * w_i << 1) and an error
  bounded by |q_i| |k_i| min(2, d * w_i) at distance d otherwise. Their bilinear form is then
  compressed to sem_dim channels by a truncated SVD. For KV head g with query heads h in its
  group, M_h = Wq_h^T Wk_g over the semantic rows ([in, in]). Inputs are whitened first (x =
  L z with L L^T = E[x x^T], the attention input's second moment on calibration text; or
  L = diag(norm weight) without it), so the SVD minimises the error on actual inputs, not on
  weights: N_h = L^T M_h L, the right singular vectors V_r of the stacked [N_h1; ...; N_hG] give
  the one key per KV head k_sem = V_r^T L^-1 x and the query maps q_sem,h = V_r^T N_h^T L^-1 x,
  so q_sem,h . k_sem = z^T N_h V_r V_r^T z. With sem_dim equal to the remaining channels the SVD
  is exact and only the dropped rotation differs from the source model.

Values, the output projection, norms and MLPs are copied unchanged. DBA's score scale
1/sqrt(sem_dim + geo_dim) differs from the source's 1/sqrt(head_dim): query rows are multiplied
by sqrt((sem_dim + geo_dim) / head_dim) so every score keeps its value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from caramba.model.config import ModelConfig
from caramba.model.native import save_native

CALIBRATION_START = 2048   # default calibration: corpus tokens from here on (no eval window in the docs reaches them)
DAMPING = 1e-4                     # of the mean input energy, added to E[x x^T] before the Cholesky


@dataclass
class Conversion:
    config: ModelConfig                  # the decoupled model's
    state: dict[str, torch.Tensor]       # its parameters (Transformer names)
    sem_energy: float                    # mean share of the (whitened) semantic forms' energy the SVD keeps

    def summary(self) -> dict:
        return {"sem_dim": self.config.sem_dim, "geo_dim": self.config.geo_dim,
                "sem_svd_energy_kept": round(self.sem_energy, 6)}


def check_dims(cfg: ModelConfig, sem_dim: int, geo_dim: int) -> None:
    if cfg.attention != "standard":
        raise ValueError("the source model already uses decoupled attention; convert a standard one")
    if getattr(cfg, "positions", "rope") != "rope":
        raise ValueError("convert-dba needs a RoPE model (the geometric path keeps its rotations)")
    if geo_dim < 2 or geo_dim % 2 or geo_dim > cfg.head_dim - 2:
        raise ValueError(f"--geo-dim {geo_dim}: need an even number of channels in [2, head_dim - 2 = "
                         f"{cfg.head_dim - 2}] (at least one RoPE pair is left for the semantic path)")
    rest = cfg.head_dim - geo_dim
    if not 1 <= sem_dim <= rest:
        raise ValueError(f"--sem-dim {sem_dim}: need 1..{rest} (head_dim {cfg.head_dim} - geo_dim {geo_dim}: "
                         "the semantic path has no more channels to keep)")


def pair_rows(pairs: list[int], head_dim: int) -> list[int]:
    """Rows of a head (HF half-rotation layout) holding these pairs: first halves, then second."""
    return list(pairs) + [p + head_dim // 2 for p in pairs]


@torch.no_grad()
def input_moments(model, tokens: torch.Tensor) -> list[torch.Tensor]:
    """E[x x^T] of each layer's attention input (after its norm) over tokens [B, T], with a
    trailing 1 appended to x when the model has q/k biases: [in, in] per layer, float64."""
    moments: list[torch.Tensor] = []

    def hook(_module, args):
        x = args[0].reshape(-1, args[0].shape[-1]).double()
        if model.config.qkv_bias:
            x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)], dim=1)
        moments.append((x.T @ x / x.shape[0]).cpu())

    handles = [layer.attn.register_forward_pre_hook(hook) for layer in model.layers]
    try:
        model(tokens)
    finally:
        for h in handles:
            h.remove()
    return moments


def _whitener(moment: torch.Tensor | None, norm_weight: torch.Tensor, bias: bool) -> torch.Tensor:
    """L with L L^T = E[x x^T] (damped), or diag(norm weight) without calibration; [in, in]."""
    if moment is None:
        g = torch.where(norm_weight.abs() < 1e-12, torch.full_like(norm_weight, 1e-12), norm_weight)
        return torch.diag(torch.cat([g, torch.ones(1, dtype=g.dtype)]) if bias else g)
    damp = DAMPING * moment.diagonal().mean()
    return torch.linalg.cholesky(moment + damp * torch.eye(moment.shape[0], dtype=moment.dtype))


def _unwhiten(m: torch.Tensor, L: torch.Tensor, diagonal: bool) -> torch.Tensor:
    """Rows m [n, in] acting on whitened inputs z = L^-1 x -> rows acting on x: m L^-1."""
    if diagonal:
        return m / L.diagonal()
    return torch.linalg.solve_triangular(L, m, upper=False, left=False)   # X L = m


@torch.no_grad()
def convert_state(cfg: ModelConfig, state: dict[str, torch.Tensor], sem_dim: int, geo_dim: int,
                  moments: list[torch.Tensor] | None = None,
                  on_layer: Callable[[int, int], None] | None = None) -> Conversion:
    """The decoupled model (config + Transformer state dict) from a standard one's.
    moments: per layer E[x x^T] of the attention input (input_moments), or None.
    on_layer(done, total) is called after each layer (the SVDs take minutes on a big model)."""
    check_dims(cfg, sem_dim, geo_dim)
    H, KVH, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    G, half = H // KVH, D // 2
    geo_rows = pair_rows(list(range(geo_dim // 2)), D)
    sem_rows = pair_rows(list(range(geo_dim // 2, half)), D)
    q_gain = ((sem_dim + geo_dim) / D) ** 0.5   # DBA scales by 1/sqrt(sem+geo), the source by 1/sqrt(D)
    out = {k: v.clone() for k, v in state.items() if ".attn.wqkv." not in k}
    kept = []
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        dtype = state[p + "attn.wqkv.weight"].dtype
        w = state[p + "attn.wqkv.weight"].double()
        if cfg.qkv_bias:   # the bias is the weight of a constant input 1: [x; 1]
            w = torch.cat([w, state[p + "attn.wqkv.bias"].double()[:, None]], dim=1)
        q, k, v = w.split([H * D, KVH * D, KVH * D])
        q, k = q.view(H, D, -1), k.view(KVH, D, -1)                      # [H, D, in], [KVH, D, in]
        L = _whitener(None if moments is None else moments[i].double(), state[p + "attn_norm.weight"].double(),
                      cfg.qkv_bias)
        q_sem, k_sem = [], []
        for g in range(KVH):
            kz = k[g, sem_rows] @ L                                      # [2m, in] in whitened inputs
            qz = q[g * G : (g + 1) * G, sem_rows] @ L                    # [G, 2m, in]
            n = torch.einsum("gri,rj->gij", qz, kz)                      # [G, in, in]: N_h = L^T Wq_h^T Wk_g L
            _, s, vh = torch.linalg.svd(n.reshape(-1, n.shape[-1]), full_matrices=False)
            vr = vh[:sem_dim]                                            # [r, in]: the shared key subspace
            k_sem.append(vr)
            q_sem.append(torch.einsum("rj,gij->gri", vr, n))             # [G, r, in]: V_r^T N_h^T
            kept.append(float(s[:sem_dim].pow(2).sum() / s.pow(2).sum().clamp_min(1e-300)))
        q_sem = _unwhiten(torch.cat(q_sem).flatten(0, 1), L, moments is None).view(H, sem_dim, -1)
        k_sem = _unwhiten(torch.stack(k_sem).flatten(0, 1), L, moments is None).view(KVH, sem_dim, -1)
        q_new = torch.cat([q_sem, q[:, geo_rows]], dim=1) * q_gain      # [H, sem+geo, in]
        k_new = torch.cat([k_sem, k[:, geo_rows]], dim=1)                # [KVH, sem+geo, in]
        w = torch.cat([q_new.flatten(0, 1), k_new.flatten(0, 1), v])
        if cfg.qkv_bias:
            out[p + "attn.wqkv.bias"] = w[:, -1].to(dtype).contiguous()
            w = w[:, :-1]
        out[p + "attn.wqkv.weight"] = w.to(dtype).contiguous()
        if on_layer is not None:
            on_layer(i + 1, cfg.n_layers)
    new_cfg = dataclasses.replace(cfg, attention="decoupled", sem_dim=sem_dim, geo_dim=geo_dim, extra=dict(cfg.extra))
    return Conversion(new_cfg, out, sum(kept) / len(kept))


def convert_loaded(loaded, sem_dim: int, geo_dim: int, out, calibration: list[int] | None,
                   on_step: Callable[[str, int, int], None] | None = None) -> Conversion:
    """Convert a LoadedModel (caramba.model.zoo), whitening with the attention inputs over the
    `calibration` token ids (None: diagonal, from the norm weights), and write it as a caramba
    directory at `out` (atomically), loadable with load_model(out). on_step(phase, done, total)
    reports progress: "calibrate" (the forward pass), "layers" (the SVDs), "write"."""
    step = on_step or (lambda phase, done, total: None)
    model = loaded.model
    check_dims(model.config, sem_dim, geo_dim)
    moments = None
    if calibration:
        step("calibrate", 0, 1)
        moments = input_moments(model, torch.tensor([calibration], device=model.device))
        step("calibrate", 1, 1)
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    conv = convert_state(model.config, state, sem_dim, geo_dim, moments,
                         on_layer=lambda done, total: step("layers", done, total))
    conv.config.extra = {"converted_from": loaded.source, "source_sha256": loaded.content_hash,
                         "calibration_tokens": len(calibration or []), **conv.summary()}
    step("write", 0, 1)
    save_native(out, conv.config, conv.state, loaded.tokenizer)
    step("write", 1, 1)
    return conv
