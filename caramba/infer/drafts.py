"""Drafts for speculative decoding: what proposes the tokens that the target then verifies.

A draft sees every row's context (prompt + generated ids) and a per-row draft length, and
returns the proposed ids per row plus the distribution q it drew them from ([B, K, V]), or
None when its proposals are deterministic (q is then one-hot on the proposed id).

- `ModelDraft`: any caramba Transformer sharing the target's vocabulary, with its own cache,
  rolled back (never recomputed) to the longest prefix of the context it has already seen.
- `PromptLookupDraft`: the continuation of the latest n-gram match in the context; no model.
- `int8_self_draft(target)`: the target with int8 dynamically quantized linear layers.
- `layer_skip_draft(target, n)`: the target's first n layers, its final norm and its head.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from caramba.infer.padding import left_pad
from caramba.infer.state import DecodeState
from caramba.model.backend import ThreadChoice, choose
from caramba.model.layers import InputMajorLinear
from caramba.model.quant import QK, QuantLinear
from caramba.model.transformer import Transformer

DRAFT_KINDS = ("model", "prompt_lookup", "self_int8", "layer_skip")

# pick(logits [B, V]) -> (tokens [B], q probabilities [B, V] or None, confidence [B]): the
# generator's sampling rule for draft steps (the same logits processors as the target's).
Picker = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]


class ModelDraft:
    """A draft model with its own KV cache."""

    def __init__(self, model: Transformer, name: str = "model") -> None:
        self.model, self.name = model, name
        self.rows: DecodeState | None = None
        self.fed: list[list[int]] = []  # per row: the tokens in the draft cache, in order
        self.forwards = 0
        self.decode_threads = ThreadChoice()   # its C step's thread choice, kept across runs

    def start(self, batch_size: int, max_seq_len: int, cache_spec) -> None:
        self.rows = DecodeState(self.model, self.model.new_cache(batch_size, max_seq_len, cache_spec),
                                backend=choose(self.model, self.decode_threads))
        self.fed = [[] for _ in range(batch_size)]
        self.forwards = 0

    def propose(self, contexts: list[list[int]], ks: list[int], pick: Picker, pad_id: int, confidence: float | None = None):
        rows, device = self.rows, self.model.device
        B = len(contexts)
        # Roll back to what still matches the context (rejected drafts go), then catch up.
        # (At least the last context token is fed again: its logits start the draft.)
        keep = [min(_common_prefix(self.fed[r], contexts[r]), len(contexts[r]) - 1) for r in range(B)]
        rows.rollback(torch.tensor(keep, device=device))
        self.fed = [self.fed[r][: keep[r]] for r in range(B)]
        missing = [contexts[r][keep[r]:] if ks[r] > 0 else [] for r in range(B)]
        width = max(len(m) for m in missing)
        # Room: the catch-up block plus K - 1 single-token steps must fit the draft cache.
        ks = [min(k, max(rows.room - width + 1, 0)) for k in ks]
        K = max(ks)
        if K == 0:
            return [[] for _ in range(B)], None
        tokens, mask = left_pad(missing, pad_id, width, device)
        logits = rows.prefill(tokens, mask)
        self.forwards += 1
        for r in range(B):
            self.fed[r] += missing[r]
        drafting = torch.tensor([k > 0 for k in ks], device=device)
        proposed = torch.zeros(B, K, dtype=torch.long, device=device)
        qs: list[torch.Tensor] = []
        n = torch.tensor(ks, device=device)
        for j in range(K):
            tok, q, conf = pick(logits)
            proposed[:, j] = tok
            if q is not None:
                qs.append(q)
            if confidence is not None:  # HF's rule: keep the unsure token, then stop drafting
                unsure = drafting & (conf < confidence) & (n > j + 1)
                n = torch.where(unsure, torch.full_like(n, j + 1), n)
            drafting = drafting & (n > j + 1)
            if not bool(drafting.any()):
                break
            logits = rows.step(tok, drafting)
            self.forwards += 1
            for r in drafting.nonzero().flatten().tolist():
                self.fed[r].append(int(tok[r]))
        out = [proposed[r, : int(n[r])].tolist() for r in range(B)]
        q = torch.stack(qs, dim=1) if qs else None  # [B, K', V]
        return out, q


class PromptLookupDraft:
    """Propose what followed the latest earlier occurrence of the context's last n-gram
    (n from max_ngram down to min_ngram). Costs no forward pass."""

    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram ({min_ngram}) <= max_ngram ({max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.forwards = 0

    def start(self, batch_size: int, max_seq_len: int, cache_spec) -> None:
        pass

    def propose(self, contexts: list[list[int]], ks: list[int], pick: Picker, pad_id: int, confidence: float | None = None):
        return [lookup(ctx, k, self.max_ngram, self.min_ngram) if k > 0 else [] for ctx, k in zip(contexts, ks)], None


def lookup(context: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to k ids that followed an earlier match of the context's trailing n-gram (longest n
    first): the latest match with k ids after it, else the match with the most ids after it.
    (The very latest match of a repeating run sits next to the tail and has only a few.)"""
    L = len(context)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        tail, best = context[L - n :], []
        for start in range(L - n - 1, -1, -1):  # latest first; the tail itself excluded
            if context[start : start + n] == tail:
                follow = context[start + n : start + n + k]
                if len(follow) > len(best):
                    best = follow
                if len(best) == k:
                    break
        if best:
            return best
    return []


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


# ---- drafts built from the target ----------------------------------------------------------


class _AssembledTransformer(Transformer):
    """A Transformer made of given modules (shared, not copied). Device, dtype and the input
    embeddings do not go through the head, so the head may be any module (an int8 one)."""

    def __init__(self, cfg, embed_weight: torch.Tensor, layers: list[nn.Module], norm: nn.Module, head: nn.Module,
                 wpe: nn.Module | None) -> None:
        with torch.device("meta"):  # the parent allocates every weight; all of them are replaced
            super().__init__(cfg)
        self.embed = None
        self.layers = nn.ModuleList(layers)
        self.norm, self.head, self.wpe = norm, head, wpe  # wpe: learned positions (GPT-2) or None
        self._embed_weight = embed_weight  # [V, dim]; a plain attribute, owned by the target

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.scale_embeddings(F.embedding(tokens, self._embed_weight))


def _embedding_matrix(target: Transformer) -> torch.Tensor:
    return target.head.weight_t.t() if target.embed is None else target.embed.weight  # [V, dim]


def layer_skip_draft(target: Transformer, n_layers: int | None = None) -> Transformer:
    """The target's first n_layers (default: half) + final norm + head, sharing its weights.
    The draft gets its own (shallower) cache from new_cache."""
    total = target.config.n_layers
    n = total // 2 if n_layers is None else n_layers
    if not 1 <= n < total:
        raise ValueError(f"layer_skip draft_layers={n} must be in [1, {total - 1}] for a {total}-layer target")
    layer_types = target.config.layer_types
    cfg = dataclasses.replace(target.config, n_layers=n, layer_types=None if layer_types is None else layer_types[:n])
    if cfg.layer_types is not None and len(set(cfg.layer_types)) == 1 and cfg.layer_types[0] == "full":
        cfg = dataclasses.replace(cfg, layer_types=None, sliding_window=None, rope_local_theta=None)
    return _AssembledTransformer(cfg, _embedding_matrix(target), list(target.layers[:n]), target.norm, target.head,
                                 target.wpe).eval()


def int8_self_draft(target: Transformer) -> Transformer:
    """A copy of the target whose linear layers (q|k|v, o, the MLP's and the vocabulary head)
    hold q8_0 weights (llama.cpp's 32-element blocks) multiplied with int8 activations by
    caramba's C kernels (caramba.model.quant). CPU only; runs in float32 whatever the target's dtype."""
    if target.device.type != "cpu":
        raise ValueError(f"the self_int8 draft needs a CPU target (caramba's q8_0 CPU kernels); got {target.device}")
    layers = []
    for block in target.layers:
        block = copy.deepcopy(block).float()
        for module in list(block.modules()):  # every family's projections, whatever their names
            for name, child in module.named_children():
                if isinstance(child, InputMajorLinear):
                    setattr(module, name, _int8_input_major(child))
                elif isinstance(child, nn.Linear):
                    setattr(module, name, _int8(child.weight, child.bias))
                # a QuantLinear (a target loaded with weights q8_0/native) is already quantized: kept
        layers.append(block)
    norm = copy.deepcopy(target.norm).float()
    head = _int8_input_major(target.head)
    wpe = None if target.wpe is None else copy.deepcopy(target.wpe).float()
    return _AssembledTransformer(target.config, _embedding_matrix(target).float(), layers, norm, head, wpe).eval()


def _int8_input_major(layer: InputMajorLinear) -> nn.Module:
    # InputMajorLinear stores [in, out]; the quantized Linear wants nn.Linear's [out, in].
    return _int8(layer.weight_t.t(), getattr(layer, "bias", None))


def _int8(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """weight [out, in] -> llama.cpp's q8_0 blocks multiplied with int8 activations by caramba's C
    kernel (caramba.model.quant.QuantLinear); a width that is not a multiple of 32 keeps fp32."""
    w = weight.detach().float()
    b = None if bias is None else bias.detach().float()
    if w.shape[1] % QK:
        layer = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
        layer.weight.data, layer.bias = w, None if b is None else nn.Parameter(b, requires_grad=False)
        return layer.requires_grad_(False)
    return QuantLinear.from_float(w, b, act="q8")


def check_vocab(target: Transformer, draft: Transformer) -> None:
    """A draft model must speak the target's vocabulary: same size, same ids."""
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise ValueError(f"the draft model's vocabulary ({dv} tokens) differs from the target's ({tv}); "
                         "speculative decoding needs a draft with the same tokenizer")
