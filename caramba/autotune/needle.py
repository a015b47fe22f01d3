"""A needle in a haystack: a fact planted deep in a long context and asked for at the end.

The context is real text (the corpus, repeated if short) with one sentence inserted at `depth`
(0 = start, 1 = end); the question follows the text. The baseline cache's greedy answer, as many
tokens as the code itself takes, is the reference: a candidate passes when, teacher-forced on that
answer, its argmax agrees at every answer token (then its own greedy decoding produces the same
answer) and the mean KL on the answer tokens is under the threshold. Whether the baseline found
the code is recorded too; the gate compares with the baseline either way.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from caramba.cache import CachePolicy
from caramba.evaluation.evaluate import evaluate_cache
from caramba.infer.config import CacheConfig, GenerateConfig
from caramba.infer.generate import Generator


@dataclass
class Haystack:
    ids: list[int]           # context + question
    code: str                # the planted fact's value
    answer_len: int          # tokens the code takes after the question (" 7319" -> 5 for SmolLM2)
    depth_tokens: int        # where the needle starts


def build_haystack(tokenizer, text_ids: list[int], length: int, depth: float = 0.25, seed: int = 0) -> Haystack:
    """A `length`-token context of text_ids with the needle at `depth`, ending in the question."""
    code = str(random.Random(seed).randrange(1000, 10000))
    needle = tokenizer.encode(f" The secret code is {code}. Remember it: the secret code is {code}. ",
                              add_special_tokens=False)
    question = tokenizer.encode("\n\nQuestion: what is the secret code?\nAnswer: the secret code is",
                                add_special_tokens=False)
    filler_len = length - len(needle) - len(question)
    if filler_len < 1:
        raise ValueError(f"needle_len={length} is too short for the needle and question "
                         f"({len(needle) + len(question)} tokens)")
    if not text_ids:
        raise ValueError("the gate text tokenized to nothing")
    filler = (text_ids * (filler_len // len(text_ids) + 1))[:filler_len]
    at = int(filler_len * depth)
    # >= 2: evaluate_cache scores at least two tokens (a tokenizer may make the code one token)
    answer_len = max(2, len(tokenizer.encode(f" {code}", add_special_tokens=False)))
    return Haystack(filler[:at] + needle + filler[at:] + question, code, answer_len, at)


def baseline_answer(model, prompt: list[int], baseline: CachePolicy, n_tokens: int) -> list[int]:
    """The baseline cache's greedy continuation of the haystack (n_tokens, no early stop)."""
    config = GenerateConfig(max_new_tokens=n_tokens, temperature=0.0, eos_token_id=None,
                            cache=CacheConfig.of_policy(baseline, max_seq_len=len(prompt) + n_tokens))
    return Generator(model, config).run([prompt]).sequences[0]


def needle_scores(model, haystack: Haystack, answer: list[int], candidates: list[CachePolicy],
                  baseline: CachePolicy, presses: list | None = None) -> list[dict]:
    """Per candidate: mean/max KL on the answer tokens and whether its greedy answer matches.
    presses: per candidate, a press (or None); the haystack and its question are its context."""
    results = evaluate_cache(model, haystack.ids + answer, candidates, baseline, prompt_len=len(haystack.ids),
                             presses=presses)
    return [{"kl_mean": r.kl_mean, "kl_max": r.kl_max, "match": r.top1_agreement == 1.0} for r in results]

