"""Teacher-forced scoring of a text through the KV cache: what a cache policy costs in quality.

The text's first `prompt_len` tokens are prefilled; every later token is then fed one at a time
through the cache, exactly as generation does, and the logits predicting each next token are
scored: NLL/PPL of the text, and against the baseline cache (fp32 by default) the KL divergence
KL(baseline || candidate) and how often the top-1 token agrees (llama.cpp's perplexity tool
with --kl-divergence). The baseline and every candidate advance in lockstep, so no logits are
stored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from importlib.resources import files
from pathlib import Path

import torch

from caramba.cache import CachePolicy

CORPUS = "corpus.txt"


def corpus_text(path: str | Path | None = None) -> str:
    """The given text file, or caramba's own corpus (prose and code, shipped with the package)."""
    if path is None:
        return files("caramba").joinpath("data", CORPUS).read_text(encoding="utf-8")
    return Path(path).read_text(encoding="utf-8")


def corpus_ids(tokenizer, path: str | Path | None = None) -> list[int]:
    return tokenizer.encode(corpus_text(path), add_special_tokens=False)


@dataclass
class EvalResult:
    policy: str                 # CachePolicy.describe()
    n_scored: int               # tokens scored (after the prompt)
    nll: float                  # mean negative log-likelihood, nats/token
    ppl: float
    baseline_nll: float
    baseline_ppl: float
    kl_mean: float              # mean over scored positions of KL(baseline || candidate), nats
    kl_max: float
    top1_agreement: float       # fraction of positions where both caches' argmax agree
    bytes_per_token: int        # the candidate cache's, batch 1, all layers

    @property
    def dnll(self) -> float:
        return self.nll - self.baseline_nll

    @property
    def ppl_ratio(self) -> float:
        return self.ppl / self.baseline_ppl

    def to_dict(self) -> dict:
        return {**asdict(self), "dnll": self.dnll, "ppl_ratio": self.ppl_ratio}


class _Score:
    def __init__(self) -> None:
        self.nll = self.kl = 0.0
        self.kl_max = 0.0
        self.agree = self.n = 0


@torch.inference_mode()
def evaluate_cache(
    model,
    ids: Sequence[int],
    candidates: Sequence[CachePolicy | str],
    baseline: CachePolicy | str = "fp32",
    prompt_len: int = 256,
    on_step: Callable[[int, int], None] | None = None,   # (done, total) after each decode step
) -> list[EvalResult]:
    """Score ids[prompt_len:] with each candidate cache and the baseline, in lockstep."""
    if len(ids) < prompt_len + 2:
        raise ValueError(f"the text has {len(ids)} tokens; prompt_len={prompt_len} needs at least {prompt_len + 2}")
    if prompt_len < 1:
        raise ValueError(f"prompt_len={prompt_len} must be >= 1")
    policies = [CachePolicy.of(baseline)] + [CachePolicy.of(c) for c in candidates]
    device = model.device
    tokens = torch.tensor([list(ids)], device=device)
    n = tokens.shape[1]
    caches = [model.new_cache(1, n, p) for p in policies]
    scores = [_Score() for _ in policies]
    logits = [model(tokens[:, :prompt_len], cache=c, last_only=True)[:, -1] for c in caches]
    total = n - prompt_len
    for t in range(prompt_len, n):
        target = tokens[0, t]
        logp = [torch.log_softmax(x.float(), dim=-1)[0] for x in logits]  # [V] each
        base = logp[0]
        base_top = int(base.argmax())
        p_base = base.exp()
        for i, lp in enumerate(logp):
            s = scores[i]
            s.nll -= float(lp[target])
            kl = float((p_base * (base - lp)).sum().clamp(min=0))
            s.kl += kl
            s.kl_max = max(s.kl_max, kl)
            s.agree += int(int(lp.argmax()) == base_top)
            s.n += 1
        if t + 1 < n:
            logits = [model(tokens[:, t : t + 1], cache=c)[:, -1] for c in caches]
        if on_step is not None:
            on_step(t - prompt_len + 1, total)
    base_nll = scores[0].nll / scores[0].n
    results = []
    decoupled = model.config.attention == "decoupled"   # names k_sem/k_geo/v kinds
    for policy, cache, s in list(zip(policies, caches, scores))[1:]:
        nll = s.nll / s.n
        results.append(EvalResult(
            policy=policy.describe(decoupled), n_scored=s.n, nll=nll, ppl=float(torch.tensor(nll).exp()),
            baseline_nll=base_nll, baseline_ppl=float(torch.tensor(base_nll).exp()),
            kl_mean=s.kl / s.n, kl_max=s.kl_max, top1_agreement=s.agree / s.n,
            bytes_per_token=cache.bytes_per_token(),
        ))
    return results


__all__ = ["EvalResult", "corpus_ids", "corpus_text", "evaluate_cache"]
