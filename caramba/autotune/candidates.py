"""The cache policies the autotune chooses from, and what each costs in bytes.

Bytes come from the code that allocates: the model's own `new_cache` builds the cache on the
`meta` device (shapes and dtypes, no storage) and `KVCache.nbytes` sums its tensors, so the
figure is what `new_cache` allocates for the same (batch, max_seq_len, policy) on a real device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from caramba.cache import CachePolicy, CacheSettings
from caramba.press import PressConfig, n_kept

# The model dtype's own full-precision cache kind: the baseline every gate compares with.
FULL_PRECISION = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

# The candidates after the baseline. Keys hurt more than values when quantized, and a Hadamard
# rotation and a full-precision window of the newest tokens repair most of 4-bit keys' damage
# (docs/kv-cache.md has the measurements).
RESIDUAL_LEN = 128
MIXED = [
    CacheSettings("fp16"),
    CacheSettings("q8_0"),
    CacheSettings("q4_0", "k=q8_0"),
    CacheSettings("q4_0", "k=q8_0", rotate_keys=True),
    CacheSettings("q4_0", rotate_keys=True, residual_len=RESIDUAL_LEN),
    CacheSettings("q4_0", rotate_keys=True, fp16_prefix_layers=2),
    CacheSettings("q4_0", rotate_keys=True),
    CacheSettings("nf4", rotate_keys=True),
    CacheSettings("q4_0"),
    # llama.cpp's q4_0 (an exact zero level) and KIVI's (Liu et al. 2024): keys per channel over
    # groups of qblock tokens, values per token, zero-point; KIVI-2 with its full-precision window
    CacheSettings("q4_0l"),
    CacheSettings("q4_0l", rotate_keys=True),
    CacheSettings("q4_0l", rotate_keys=True, rotate_values=True),   # llama.cpp's q4_0 cache as it runs by default
    CacheSettings("q4_1", "k=q4_1c"),
    CacheSettings("q4_1", "k=q4_1c", qblock=16),                     # within +1% PPL on two texts (docs/kv-cache.md)
    CacheSettings("q2_1", "k=q2_1c", residual_len=RESIDUAL_LEN),
    # Hybrid models (Gemma): the full layers, which grow with the context, quantized; the sliding
    # layers' rings (a fixed window) kept finer, or in a per-token kind where a ring cannot hold
    # per-channel keys or a residual window. Left out for models without sliding layers.
    CacheSettings("q4_0", sliding_kind="fp16"),
    CacheSettings("q4_0", rotate_keys=True, sliding_kind="q8_0"),
    CacheSettings("q4_1", "k=q4_1c", sliding_kind="q4_1"),
    CacheSettings("q2_1", "k=q2_1c", residual_len=RESIDUAL_LEN, sliding_kind="q8_0"),
]


# The kinds each press of `cache_auto_presses` is tried with, besides the baseline's: evict, then
# keep the survivors quantized (a press composes with every kind; these are the usual winners).
PRESSED_KINDS = [
    CacheSettings("q8_0"),
    CacheSettings("q4_0", "k=q8_0", rotate_keys=True),
]


@dataclass(frozen=True)
class Candidate:
    name: str              # CachePolicy.describe(), then "+" and the press's PressConfig.describe()
    policy: CachePolicy
    baseline: bool = False  # the full-precision reference itself
    press: PressConfig | None = None   # KV eviction on top of the policy (caramba.press)


def baseline_policy(model) -> CachePolicy:
    return canonical(CacheSettings(FULL_PRECISION[model.dtype]).spec())


def default_candidates(model, presses: Sequence[PressConfig] = ()) -> list[Candidate]:
    """The baseline (the model dtype's full-precision cache) first, then the cheaper policies,
    then each press on the baseline's kind and on PRESSED_KINDS. A policy whose settings the model
    cannot use (rotate_keys needs a power-of-two head_dim, a block must divide head_dim) is left
    out, as is one that duplicates another."""
    base = baseline_policy(model)
    out = [Candidate(base.describe(), base, baseline=True)]
    for settings in MIXED:
        p = canonical(settings.spec())
        redundant = p.fp16_prefix_layers >= model.config.n_layers \
            or p.sliding_kind is not None and not model.config.hybrid    # fp16 everywhere; no rings to address
        if p == base or redundant or any(c.policy == p for c in out) or not usable(model, p):
            continue
        out.append(Candidate(p.describe(), p))
    kinds = [base] + [canonical(settings.spec()) for settings in PRESSED_KINDS]
    for press in presses:
        for p in dict.fromkeys(kinds):
            if usable(model, p):
                out.append(Candidate(f"{p.describe()}+{press.describe()}", p, press=press))
    return out


def kept_slots(press: PressConfig | None, max_seq_len: int) -> int:
    """Slots a cache of max_seq_len holds after its press, with a max_seq_len-token context: the
    prefill press's kept share; decoding-time compression's target plus one interval at most."""
    if press is None:
        return max_seq_len
    kept = n_kept(max_seq_len, press.ratio) if press.active else max_seq_len
    return min(kept, press.target + press.interval) if press.decoding else kept


def usable(model, policy: CachePolicy) -> bool:
    try:
        cache_nbytes(model, 1, 1, policy)
    except ValueError:
        return False
    return True


_SHADOWS: dict[int, torch.nn.Module] = {}


def _shadow(model) -> torch.nn.Module:
    """A storage-free copy of the model's architecture (meta device, same dtype)."""
    key = id(model)
    shadow = _SHADOWS.get(key)
    if shadow is None or shadow.config is not model.config:
        with torch.device("meta"):
            shadow = type(model)(model.config).to(model.dtype)
        _SHADOWS.clear()  # one model at a time
        _SHADOWS[key] = shadow
    return shadow


def cache_nbytes(model, batch_size: int, max_seq_len: int, policy: CachePolicy) -> int:
    """Bytes `model.new_cache(batch_size, max_seq_len, policy)` allocates, without allocating."""
    return _shadow(model).new_cache(batch_size, max_seq_len, policy).nbytes


def policy_from_dict(d: dict) -> CachePolicy:
    """Inverse of CachePolicy.to_dict (how plans store a policy): CacheSettings.from_dict's policy."""
    return CacheSettings.from_dict(d).spec()


def canonical(policy: CachePolicy) -> CachePolicy:
    """The policy as a plan stores and restores it (equal to policy_from_dict of its dict)."""
    return policy_from_dict(policy.to_dict())

