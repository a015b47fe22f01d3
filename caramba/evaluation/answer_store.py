"""Answers kept between eval runs: per batch of samples and candidate, that candidate's answers.

The context store (caramba.evaluation.context_store) spares a rerun its shared prefills; every
candidate would still store, question and decode again. `AnswerStore` keeps what a candidate
answered to one batch of samples (each answer's ids, text, score and timings, and the batch's
seconds and kept share) as one small JSON file beside the contexts:

    runs/.context-cache/answers/<sha256 of the key>.json

so adding a candidate to a finished eval costs only that candidate (and the baseline's context,
read from the context store, if the batch has one to answer). The key (built by
caramba.evaluation.task_eval) is everything the answers depend on: the model's identity, caramba's
and torch's versions, the batch's samples (their context and question ids by sha256, task, rule,
budget), the padding and end-of-reply ids, the candidate's computation (policy, window, press with
all its settings; not its label, so a renamed candidate is reused), the baseline's policy and
window and the path of the shared prefill it reads, the prefill mode, q_chunk, the decode
backend and whether it answers joined.

The entries share the context store's machinery (context_store.EntryStore): named by the sha256
of their key, written atomically, their key and a sha256 of their body checked on every read (a
bad entry is removed and recomputed, never trusted), bounded by CARAMBA_CONTEXT_STORE_MB (0
turns both stores off) with the least recently used out first.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from caramba.evaluation.context_store import DIRNAME, EntryStore, canonical, ids_sha256
from caramba.version import __version__

SUBDIR = "answers"
PERPLEXITY_SUBDIR = "perplexity"   # per candidate, its perplexity scores (perplexity_key)
SUFFIX = ".json"
FORMAT = 1


def body_digest(body: dict) -> str:
    return hashlib.sha256(canonical(body).encode()).hexdigest()


class AnswerStore(EntryStore):
    """The answers under a runs directory (see the module doc); entries are JSON bodies."""

    suffix = SUFFIX

    def __init__(self, root: str | Path, max_bytes: int | None = None, model: dict | None = None,
                 subdir: str = SUBDIR) -> None:
        super().__init__(Path(root) / DIRNAME / subdir, max_bytes, model)

    @classmethod
    def beside(cls, contexts: EntryStore, subdir: str = SUBDIR) -> AnswerStore:
        """The answer store next to a context store: its runs directory, bound and model (subdir
        PERPLEXITY_SUBDIR: the perplexity scores')."""
        return cls(contexts.dir.parent, contexts.max_bytes, contexts.model, subdir)

    def _parse(self, data: bytes) -> tuple[dict, object, str]:
        entry = json.loads(data)
        return entry, entry["body"], body_digest(entry["body"])

    def _read(self, path: Path) -> tuple[dict, object, str]:
        return self._parse(path.read_bytes())

    def load(self, key: dict) -> dict | None:
        """The body of the entry for `key`, verified; None when there is none or it was bad (then removed)."""
        return self._load(key)

    def save(self, key: dict, body: dict) -> bool:
        """Write the entry for `key` (atomically). False when it was not kept (store off, or larger than the bound)."""
        if not self.enabled:
            return False
        entry = {"format": FORMAT, "key": canonical(key), "sha256": body_digest(body), "body": body}
        return self._save(key, canonical(entry).encode())

    def discard(self, key: dict, why: str) -> None:
        """Remove the entry for `key`, found unfit for what asked for it (its answers do not fit the batch)."""
        self._discard(self.path_of(key), why)


def baseline_logits_key(baseline_model: dict, ids: list[int], bos: int | None, setup: dict, baseline_policy,
                        backend: str) -> dict:
    """What the baseline's logits over a perplexity text depend on: its model (identity,
    context_store.model_identity), the versions, the scored ids, the protocol's settings (`setup`:
    protocol, prompt_len or ctx), its cache's policy and its decode path. The logits themselves are
    kept in the context store (tensors, caramba.evaluation.evaluate.BaselineLogits): a new
    candidate is scored against them without running the baseline again."""
    return {"kind": "perplexity-baseline", "format": FORMAT, "model": baseline_model,
            "caramba": __version__, "torch": torch.__version__,
            "ids": ids_sha256(ids), "bos": bos, "setup": setup, "baseline": repr(baseline_policy), "backend": backend}


def perplexity_key(model: dict, baseline: dict, policy, backend: str) -> dict:
    """What one candidate's perplexity scores depend on: its model's identity, the baseline's logits
    (their key, baseline_logits_key), its cache's policy and its decode path. Kept in the answer
    store: a rerun with one more candidate scores only it."""
    return {"kind": "perplexity", "format": FORMAT, "model": model, "baseline": baseline,
            "candidate": repr(policy), "backend": backend}


__all__ = ["AnswerStore", "FORMAT", "PERPLEXITY_SUBDIR", "SUBDIR", "baseline_logits_key", "perplexity_key"]
