"""Scoring a text through the KV cache: what a cache policy costs in quality. Two protocols.

`evaluate_cache` ("decode", the default of `caramba eval`): the text's first `prompt_len` tokens are prefilled; every later token is then fed one at a time
through the cache, exactly as generation does, and the logits predicting each next token are
scored: NLL/PPL of the text, and against the baseline cache (fp32 by default) the KL divergence
KL(baseline || candidate) and how often the top-1 token agrees (llama.cpp's perplexity tool
with --kl-divergence). The baseline and every candidate advance in lockstep, so no logits are
held beyond a chunk's. Where they run the same model through the fused C step, up to CHUNK
steps of all their caches are one joined C call (CStep.step_joined, stepwise: the weights read
once for every cache and token), or, where a cache takes one token a call (a ring, a residual
window, per-channel keys), each step of all of them is; with exact rows (CStep.exact_rows) each
token's logits are the bits its own one-token step gives alone, so the scores do not depend on
which candidates ran together or on the chunks. Every SPEED_EVERY-th step each cache steps alone
and is timed: its decode_tok_s.

`evaluate_chunks` ("chunks", comparable with llama.cpp's `llama-perplexity -c CTX`): the text is
split into non-overlapping windows of `ctx` tokens, each run as one forward through an empty
cache (so every token's attention reads the cache's stored, possibly quantized, K/V, as
llama.cpp's does), and scored on its second half: the logits at positions ctx/2 .. ctx-2
predict tokens ctx/2+1 .. ctx-1 (ctx/2 - 1 per window, as llama.cpp counts). When the model's
tokenizer adds BOS, the text is tokenized with it and the first token of every window is
replaced by BOS. PPL comes with llama.cpp's standard error: PPL * the standard error of the
mean NLL, sqrt((mean(nll^2) - mean(nll)^2) / (N - 1)).

Both take the baseline's logits from an earlier run instead of running it (`baseline_logits`: a
`BaselineLogits` that their `on_baseline` handed out): every scored position's row, in scoring
order. They are the run's own float values, so the candidates' scores against them are the ones
a lockstep run gives, bit for bit; a new candidate of a finished eval then costs its own steps
alone (caramba.runners.eval keeps them in the context store).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from importlib.resources import files
from pathlib import Path

import math
import time

import torch
import torch.nn.functional as F

from caramba.cache import CachePolicy
from caramba.infer.decoding_press import DecodingPress
from caramba.infer.pressing import prefill_pressed
from caramba.infer.state import DecodeState
from caramba.model.backend import Backend, CStep, choose
from caramba.press import PressConfig

CORPUS = "corpus.txt"
SPEED_EVERY = 32    # a joined lockstep times each cache alone on one step in this many
CHUNK = 16          # the most steps a lockstep feeds as one stepwise C call (fast_decode.MAX_ROWS)


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
    protocol: str = "decode"    # "decode" (evaluate_cache) or "chunks" (evaluate_chunks)
    ppl_stderr: float | None = None           # chunks: llama.cpp's standard error of the PPL
    baseline_ppl_stderr: float | None = None
    decode_tok_s: float | None = None         # decode: the candidate's scored steps per second, 1 row alone (module doc)
    baseline_decode_tok_s: float | None = None

    @property
    def dnll(self) -> float:
        return self.nll - self.baseline_nll

    @property
    def ppl_ratio(self) -> float:
        return self.ppl / self.baseline_ppl

    def to_dict(self) -> dict:
        return {**asdict(self), "dnll": self.dnll, "ppl_ratio": self.ppl_ratio}


@dataclass
class BaselineLogits:
    """The baseline's logits at every scored position, [N, V] in scoring order (decode: the
    prefill's last row, then each step's; chunks: each window's scored rows), and the speed of its
    scored decode steps when they ran."""
    logits: torch.Tensor
    decode_tok_s: float | None = None


class NonFiniteLogits(ValueError):
    """A model's logits hold NaN or inf (float16 overflow, broken weights): every figure scored
    from them would be meaningless (argmax of NaN agrees, a NaN KL vanishes in max), so the
    scoring stops instead of reporting them."""


def require_finite(logits: torch.Tensor, what: str) -> None:
    """NonFiniteLogits when logits [..., V] hold a NaN or an inf; `what` names whose they are."""
    finite = torch.isfinite(logits).all(-1)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        raise NonFiniteLogits(f"{what}: the model's logits are NaN or inf ({bad} of {finite.numel()} position(s)); "
                              f"no score is meaningful (a {logits.dtype} overflow? try dtype float32 or bfloat16)")


SUM_BLOCK = 1024


def row_sums(t: torch.Tensor) -> torch.Tensor:
    """Each row's sum of t [N, V] in an order that does not depend on torch's thread count: torch
    splits a long row's sum between its threads (a [1, 262144] row's differs at 1 and 2 threads), so
    a score computed alone on a busier machine would not be its lockstep run's bit for bit. Blocks of
    SUM_BLOCK (zero-padded) are each summed whole, then the blocks' sums."""
    pad = -t.shape[-1] % SUM_BLOCK
    return (F.pad(t, (0, pad)) if pad else t).reshape(*t.shape[:-1], -1, SUM_BLOCK).sum(-1).sum(-1)


class _Score:
    def __init__(self, name: str = "") -> None:
        self.name = name            # the cache whose logits these are, for NonFiniteLogits
        self.nll = self.nll2 = self.kl = 0.0
        self.kl_max = 0.0
        self.agree = self.n = 0

    def add(self, lp: torch.Tensor, base: torch.Tensor, targets: torch.Tensor) -> None:
        """Score rows lp [N, V] (log-probabilities) against the baseline's base [N, V] at targets [N]."""
        require_finite(lp, f"the {self.name} cache" if self.name else "scoring")
        nll = -lp.gather(-1, targets[:, None])[:, 0].double()
        self.nll += float(nll.sum())
        self.nll2 += float((nll * nll).sum())
        kl = row_sums(base.exp() * (base - lp)).clamp(min=0)
        self.kl += float(kl.double().sum())
        self.kl_max = max(self.kl_max, float(kl.max()))
        self.agree += int((lp.argmax(-1) == base.argmax(-1)).sum())
        self.n += int(targets.numel())

    def ppl_stderr(self) -> float:
        """llama.cpp's: PPL * sqrt((mean(nll^2) - mean(nll)^2) / (N - 1))."""
        mean = self.nll / self.n
        var = self.nll2 / self.n - mean * mean
        return math.exp(mean) * math.sqrt(max(var, 0.0) / max(self.n - 1, 1))


@torch.inference_mode()
def evaluate_cache(
    model,
    ids: Sequence[int],
    candidates: Sequence[CachePolicy | str],
    baseline: CachePolicy | str = "fp32",
    prompt_len: int = 256,
    on_step: Callable[[int, int], None] | None = None,   # (done, total) after each decode step
    presses: Sequence[PressConfig | None] | None = None,
    models: Sequence | None = None,
    baseline_logits: BaselineLogits | None = None,
    on_baseline: Callable[[BaselineLogits], None] | None = None,
) -> list[EvalResult]:
    """Score ids[prompt_len:] with each candidate cache and the baseline, in lockstep.
    presses: per candidate, a press (caramba.press) on its cache: the prompt is its context,
    pressed after its prefill; decoding-time compression runs through the scored steps.
    models: per candidate, the model it runs (other weights of `model`, the baseline's, with the
    same tokenizer: a weight-format study); default `model` for all.
    baseline_logits: the baseline's from an earlier run of the same ids and settings, read instead
    of running it; on_baseline: called with the baseline's logits once it has run (module doc)."""
    if len(ids) < prompt_len + 2:
        raise ValueError(f"the text has {len(ids)} tokens; prompt_len={prompt_len} needs at least {prompt_len + 2}")
    if prompt_len < 1:
        raise ValueError(f"prompt_len={prompt_len} must be >= 1")
    presses = list(presses) if presses is not None else [None] * len(candidates)
    if len(presses) != len(candidates):
        raise ValueError(f"presses has {len(presses)} entries for {len(candidates)} candidates")
    policies = [CachePolicy.of(baseline)] + [CachePolicy.of(c) for c in candidates]
    models = [model, *_per_candidate(models, model, len(candidates))]
    tokens = torch.tensor([list(ids)], device=model.device)
    n = tokens.shape[1]
    # decode steps through the fused C step where it applies, as a Generator's, with rows summed as a
    # join sums them (module doc); one backend per model
    forwards = {id(m): choose(m, exact_rows=True) for m in models}
    base = _Replay(baseline_logits, n - prompt_len, model) if baseline_logits is not None \
        else _Run(forwards[id(model)], model.new_cache(1, n, policies[0]), None)
    runs = [base, *(_Run(forwards[id(m)], m.new_cache(1, n, p), press)
                    for m, p, press in zip(models[1:], policies[1:], presses))]
    kept = [] if on_baseline is not None and baseline_logits is None else None
    scores = [_Score(p.describe()) for p in policies]
    try:
        logits = [r.prefill(tokens[:, :prompt_len]) for r in runs]
        total = n - prompt_len
        stepped = _Lockstep(runs, timed_at=min(SPEED_EVERY // 2, (total - 1) // 2)).rows(tokens[0, prompt_len : n - 1])
        for t in range(prompt_len, n):
            if kept is not None:
                kept.append(logits[0].clone())   # a backend may hand out its own buffer, rewritten next step
            logp = [torch.log_softmax(x.float(), dim=-1) for x in logits]  # [1, V] each
            for s, lp in zip(scores, logp):
                s.add(lp, logp[0], tokens[0, t : t + 1])
            if t + 1 < n:
                logits = next(stepped)
            if on_step is not None:
                on_step(t - prompt_len + 1, total)
    finally:
        for r in runs:
            r.close()
    results = _results(model, policies, [r.cache for r in runs], scores, "decode")
    speeds = [r.speed for r in runs]
    for result, speed in zip(results, speeds[1:]):
        result.decode_tok_s, result.baseline_decode_tok_s = speed, speeds[0]
    if kept is not None:
        on_baseline(BaselineLogits(torch.cat(kept), speeds[0]))
    return results


def _per_candidate(models: Sequence | None, model, n: int) -> list:
    if models is None:
        return [model] * n
    if len(models) != n:
        raise ValueError(f"models has {len(models)} entries for {n} candidates")
    for m in models:
        if m.config.vocab_size != model.config.vocab_size:
            raise ValueError(f"a candidate's model has a vocabulary of {m.config.vocab_size} tokens, the "
                             f"baseline's {model.config.vocab_size}: scoring needs the same tokenizer")
    return list(models)


class _Run:
    """One cache fed the text: plain (the model over the cache), or pressed (a decoding state
    whose context is pressed after its prefill, with decoding-time compression if the press has it)."""

    def __init__(self, forward: Backend, cache, press: PressConfig | None) -> None:
        self.forward, self.press = forward, press if press is not None and press.enabled else None
        self.state = DecodeState(forward.model, cache, backend=forward) if self.press is not None else None
        self.decoding = DecodingPress(self.state, self.press) if self.press is not None and self.press.decoding else None
        self._cache = cache
        self.steps, self.step_s = 0, 0.0   # scored decode steps and their seconds: the candidate's decode speed

    def timed_step(self, token: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        logits = self.step(token)
        self.step_s += time.perf_counter() - t0
        self.steps += 1
        return logits

    @property
    def speed(self) -> float | None:
        return self.steps / self.step_s if self.step_s > 0 else None

    @property
    def cache(self):
        return self.state.cache if self.state is not None else self._cache

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.state is None:
            return self.forward(tokens, cache=self._cache, last_only=True)[:, -1]
        if self.press.active:
            return prefill_pressed(self.state, tokens, None, self.press)
        return self.state.prefill(tokens)

    def step(self, token: torch.Tensor) -> torch.Tensor:
        if self.state is None:
            return self.forward(token, cache=self._cache)[:, -1]
        if self.decoding is not None:
            self.decoding.before_step()
        logits = self.state.step(token[:, 0])
        if self.decoding is not None:
            self.decoding.after_step()
        return logits

    def close(self) -> None:
        if self.decoding is not None:
            self.decoding.close()


class _Lockstep:
    """Every run's steps over a text: the plain runs of one model through its C step (CStep, exact
    rows) fed up to CHUNK tokens at a time, stepwise and joined into one C call where it takes them
    all (else token by token, joined where it takes them); on step i = timed_at mod SPEED_EVERY
    every run alone and timed. Runs that never join (pressed, the torch path, the
    replayed baseline) are timed at every step, as before."""

    def __init__(self, runs: list, timed_at: int) -> None:
        self.runs, self.timed_at = runs, timed_at
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(runs):
            if isinstance(r, _Run) and r.state is None and isinstance(r.forward, CStep):
                groups.setdefault(id(r.forward), []).append(i)
        self.groups = list(groups.values())
        self.joined = {i for g in self.groups for i in g}

    def rows(self, tokens: torch.Tensor) -> Iterator[list[torch.Tensor]]:
        """For each of tokens [n] in turn, every run's logits [1, vocab] after it."""
        i, n = 0, tokens.shape[0]
        while i < n:
            if not self.groups or i % SPEED_EVERY == self.timed_at:
                yield [r.timed_step(tokens[None, i : i + 1]) for r in self.runs]
                i += 1
                continue
            end = min(n, i + CHUNK, i + (self.timed_at - i) % SPEED_EVERY)   # up to the next timed step
            yield from zip(*self._chunk(tokens[None, i:end]))
            i = end

    def _chunk(self, chunk: torch.Tensor) -> list[list[torch.Tensor]]:
        """Each run's logits after each of the chunk's tokens [1, T]. A group's caches in one stepwise
        C call where it takes every one; else token by token, joined where the C step takes them
        (a ring, a residual window or per-channel keys take one token a call, and then the others
        cost less beside them than in chunks of their own: SmolLM2, Zen 4, ~2.2 against ~3 ms a
        token), the others alone; the rest alone (a backend may hand out a buffer it rewrites: copied)."""
        T = chunk.shape[1]
        rows: list[list] = [[None] * T for _ in self.runs]
        for group in self.groups:
            forward = self.runs[group[0]].forward
            got = forward.step_joined([(chunk, None, self.runs[j].cache, None) for j in group], stepwise=True)
            if got is not None:
                for j, logits in zip(group, got):
                    rows[j] = list(logits[0].split(1))
                continue
            for k in range(T):
                token = chunk[:, k : k + 1]
                got = forward.step_joined([(token, None, self.runs[j].cache, None) for j in group], partial=True) \
                    if len(group) > 1 else None
                for j, logits in zip(group, got or [None] * len(group)):
                    rows[j][k] = logits if logits is not None else self.runs[j].step(token).clone()
        for j, r in enumerate(self.runs):
            if j not in self.joined:
                rows[j] = [r.timed_step(chunk[:, k : k + 1]).clone() for k in range(T)]
        return rows


class _Replay:
    """The baseline's kept logits in its run's place: each call hands out the next scored row."""

    cache = None

    def __init__(self, kept: BaselineLogits, n_scored: int, model) -> None:
        _check_kept(kept, n_scored, model)
        self.rows, self.speed, self.at = kept.logits, kept.decode_tok_s, 0

    def _next(self) -> torch.Tensor:
        self.at += 1
        return self.rows[self.at - 1 : self.at]

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._next()

    def timed_step(self, token: torch.Tensor) -> torch.Tensor:
        return self._next()

    def close(self) -> None:
        pass


def _check_kept(kept: BaselineLogits, n_scored: int, model) -> None:
    want = (n_scored, model.config.vocab_size)
    if tuple(kept.logits.shape) != want:
        raise ValueError(f"the baseline's kept logits are {tuple(kept.logits.shape)}, the scoring needs {want}")


def _results(model, policies, caches, scores, protocol: str) -> list[EvalResult]:
    base = scores[0]
    base_nll = base.nll / base.n
    decoupled = model.config.attention == "decoupled"   # names k_sem/k_geo/v kinds
    chunks = protocol == "chunks"
    results = []
    for policy, cache, s in list(zip(policies, caches, scores))[1:]:
        nll = s.nll / s.n
        results.append(EvalResult(
            policy=policy.describe(decoupled), n_scored=s.n, nll=nll, ppl=math.exp(nll),
            baseline_nll=base_nll, baseline_ppl=math.exp(base_nll),
            kl_mean=s.kl / s.n, kl_max=s.kl_max, top1_agreement=s.agree / s.n,
            bytes_per_token=cache.bytes_per_token_at(cache.max_seq_len), protocol=protocol,
            ppl_stderr=s.ppl_stderr() if chunks else None, baseline_ppl_stderr=base.ppl_stderr() if chunks else None,
        ))
    return results


def adds_bos(tokenizer) -> bool:
    """Whether the tokenizer puts BOS in front of a text (llama.cpp's llama_vocab_get_add_bos)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    with_special = tokenizer.encode("a", add_special_tokens=True)
    return with_special[:1] == [bos] and tokenizer.encode("a", add_special_tokens=False)[:1] != [bos]


def chunk_windows(ids: Sequence[int], ctx: int, bos: int | None = None) -> list[list[int]]:
    """The non-overlapping ctx-token windows of ids (a tail shorter than ctx is dropped, as
    llama.cpp does); with `bos`, each window's first token is replaced by it."""
    windows = [list(ids[i : i + ctx]) for i in range(0, len(ids) - ctx + 1, ctx)]
    if bos is not None:
        for w in windows:
            w[0] = bos
    return windows


@torch.inference_mode()
def evaluate_chunks(
    model,
    ids: Sequence[int],
    candidates: Sequence[CachePolicy | str],
    baseline: CachePolicy | str = "fp32",
    ctx: int = 512,
    bos: int | None = None,
    max_chunks: int | None = None,
    on_step: Callable[[int, int], None] | None = None,   # (done, total) after each window
    models: Sequence | None = None,
    baseline_logits: BaselineLogits | None = None,
    on_baseline: Callable[[BaselineLogits], None] | None = None,
) -> list[EvalResult]:
    """llama-perplexity's protocol (module doc): ids are the whole text's tokens (with the BOS the
    tokenizer adds, if any; `bos` is then its id). Baseline and candidates see the same windows.
    models, baseline_logits, on_baseline: as evaluate_cache's."""
    if ctx < 4 or ctx % 2:
        raise ValueError(f"ctx={ctx} must be an even number >= 4 (windows are scored on their second half)")
    windows = chunk_windows(ids, ctx, bos)
    if max_chunks is not None:
        windows = windows[:max_chunks]
    if not windows:
        raise ValueError(f"the text has {len(ids)} tokens; ctx={ctx} needs at least {ctx} (one window)")
    policies = [CachePolicy.of(baseline)] + [CachePolicy.of(c) for c in candidates]
    models = [model, *_per_candidate(models, model, len(candidates))]
    device = model.device
    first = ctx // 2
    per = ctx - 1 - first                                            # scored rows per window
    if baseline_logits is not None:
        _check_kept(baseline_logits, per * len(windows), model)
    caches = [m.new_cache(1, ctx, p) for m, p in zip(models, policies)]
    scores = [_Score(p.describe()) for p in policies]
    kept = [] if on_baseline is not None and baseline_logits is None else None
    for i, window in enumerate(windows):
        tokens = torch.tensor([window], device=device)
        targets = tokens[0, first + 1 :]
        base = None
        for j, (m, cache, s) in enumerate(zip(models, caches, scores)):   # the baseline first; one candidate's rows held at a time
            if j == 0 and baseline_logits is not None:
                logits = baseline_logits.logits[i * per : (i + 1) * per]
            else:
                cache.reset()
                logits = m(tokens, cache=cache)[0, first : ctx - 1]          # [ctx/2 - 1, V]
            if j == 0 and kept is not None:
                kept.append(logits.clone())   # not a view holding the whole window's rows
            lp = torch.log_softmax(logits.float(), dim=-1)
            base = lp if base is None else base
            s.add(lp, base, targets)
        if on_step is not None:
            on_step(i + 1, len(windows))
    if kept is not None:
        on_baseline(BaselineLogits(torch.cat(kept)))
    return _results(model, policies, caches, scores, "chunks")


__all__ = ["BaselineLogits", "EvalResult", "NonFiniteLogits", "adds_bos", "chunk_windows", "corpus_ids", "corpus_text", "evaluate_cache", "evaluate_chunks", "require_finite"]
