"""Synthetic long-context tasks in RULER's generated categories, and their scoring.

RULER (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?", github.com/NVIDIA/RULER) generates tasks whose answer is hidden somewhere in a context
of a chosen length. We build its generated categories with its templates, needle format, noise
text and scoring, in our own code:

- retrieval (needle in a haystack): `niah_single`, `niah_multikey` (the asked-for needle among
  needles with other keys), `niah_multivalue` (one key, every value asked for), `niah_multiquery`
  (several keys asked at once); a bare name hides the needles in RULER's repeated noise
  sentences, `_essay` in real text (caramba's corpus, or the caller's file, wrapped around for
  long contexts); `niah_single_uuid_essay` asks for a uuid, `niah_multikey_needles` hides the
  needle among needles only (RULER's niah_multikey_2);
- multi-hop tracing: `vt` (chains of `VAR X = VAR Y` in noise: which variables hold value N?);
- aggregation: `cwe` (the 10 most common words of a numbered list) and `fwe` (the 3 most frequent
  coded words of a Zipf-distributed text).

Every sample is deterministic from (task, length, seed, index) and the tokenizer: its random draws
come from `random.Random(sha256-derived int)`, never global state or hash(). Its context is fitted
to `length` as RULER fits it: prompt tokens + the task's answer budget <= length, with the
haystack as large as fits (a bisection on the number of haystack units, per sample). A process
makes each sample once for a tokenizer read from a file (`_Memo`): a manifest's preflight makes
every cell's first sample, and its run asks for the same again.

A prompt is split where a cache policy needs it: `context_ids` (chat template prefix, instruction,
haystack, up to and including the newline after it) are what a caller prefills and compresses;
`question_ids` (the question, the template's close, the answer prefix) come after. The split falls
just after a newline, where byte-level BPE tokenizers (GPT-2, SmolLM2, Llama 3) never merge, so
`context_ids + question_ids` equals encoding `text` in one go for them (tests check SmolLM2's).

Scoring is RULER's: `string_match_all` (the fraction of expected strings found in the
prediction, case-insensitive) for every task here; `string_match_part` (1 if any is found) is
there for completeness. Scores are fractions in [0, 1] (RULER prints percent).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from caramba.evaluation.task_words import ADJECTIVES, NOUNS, VERBS

GENERATOR_VERSION = 1   # bump when generated text would change

# ---- RULER's text ------------------------------------------------------------------------------

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."

# Each template: head (instruction + {context}; the split falls after its last newline), question,
# answer prefix. RULER writes the head and question as one template; the texts are its own.
NIAH = (
    "Some special magic {type_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_v} afterwards.\n{context}\n",
    "What are all the special magic {type_v} for {query} mentioned in the provided text?",
    " The special magic {type_v} for {query} mentioned in the provided text are",
)
VT = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n",
    "Question: Find all variables that are assigned the value {query} in the text above.",
    # RULER's prefix ends in "they are: " (trailing space); a BPE model writes the space in front
    # of its next word, so the prefix stops at the colon here.
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
    "are assigned the value {query}, they are:",
)
CWE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\n",
    "Question: What are the {num_cw} most common words in the above list?",
    " Answer: The top {num_cw} words that appear most often in the list are:",
)
FWE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most "
    "frequently appeared coded words. {context}\n",
    "Question: Do not provide any explanation. Please ignore the dots '....'. What are the three "
    "most frequently appeared words in the above coded text?",
    " Answer: According to the coded text above, the three most frequently appeared words are:",
)
_TEMPLATE_TEXT = " ".join(" ".join(t) for t in (NIAH, VT, CWE, FWE)).lower()

# Needle depths: RULER's 40 evenly spaced percentages of the haystack's sentences.
DEPTHS = tuple(round(100 * i / 39) for i in range(40))


def _word_pool() -> tuple[str, ...]:
    """Single words for cwe: 4+ letters, none inside another or inside the templates, so that a
    substring match (RULER's scoring) of one word never credits another."""
    words = sorted({w for w in (*NOUNS, *ADJECTIVES, *VERBS) if len(w) >= 4})
    joined = "\n".join(words)
    return tuple(w for w in words if joined.count(w) == 1 and w not in _TEMPLATE_TEXT)


WORDS = _word_pool()


def _key_words() -> tuple[str, ...]:
    """RULER's adjective-noun keys, from adjectives that end no other adjective and nouns that
    start no other noun ("rusty-owl" is not inside "trusty-owl", nor "cabin-x" in "cabinet-x")."""
    nouns = [n for n in dict.fromkeys(NOUNS) if n not in _prefixes(NOUNS)]
    adjectives = [a for a in dict.fromkeys(ADJECTIVES) if a[::-1] not in _prefixes([b[::-1] for b in ADJECTIVES])]
    return tuple(f"{a}-{n}" for a in adjectives for n in nouns)


def _prefixes(words) -> set[str]:
    """The words that begin another word (in sorted order, such a word's successor starts with it)."""
    ordered = sorted(set(words))
    return {a for a, b in zip(ordered, ordered[1:]) if b.startswith(a)}


KEY_WORDS = _key_words()


# ---- the task table ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskSpec:
    """One task's settings (module doc). Fields a kind does not use keep their defaults."""

    name: str
    kind: str                      # "niah" | "vt" | "cwe" | "fwe"
    max_new_tokens: int            # the answer budget
    haystack: str = "noise"        # niah, vt: "noise" | "essay" | "needles"
    key_type: str = "words"        # niah: "words" | "numbers" | "uuids"
    value_type: str = "numbers"
    num_keys: int = 1              # niah: needles' keys (>= num_queries; the rest are distractors)
    num_values: int = 1            # niah: values per key
    num_queries: int = 1           # niah: keys asked for
    num_chains: int = 1            # vt: chains (the first is asked for, the rest distract)
    num_hops: int = 4              # vt: assignments after the first in a chain
    num_common: int = 10           # cwe: words asked for
    freq_common: int = 0           # cwe: times each common word appears (0: RULER's, 6 below 4096 tokens, else 30)
    freq_rare: int = 0             # cwe: times each other word appears (0: RULER's, 1 below 4096 tokens, else 3)
    alpha: float = 2.0             # fwe: Zipf exponent
    examples: int = 1              # vt: solved examples before the task; cwe: 0 or 1 (RULER: 1)
    metric: str = "all"            # RULER's string_match_all


def _niah(name: str, budget: int, **kw) -> TaskSpec:
    return TaskSpec(name, "niah", budget, **kw)


_SPECS = (
    _niah("niah_single", 32),
    _niah("niah_single_essay", 32, haystack="essay"),
    _niah("niah_single_uuid_essay", 64, haystack="essay", value_type="uuids"),
    _niah("niah_multikey", 32, num_keys=4),
    _niah("niah_multikey_essay", 32, haystack="essay", num_keys=4),
    _niah("niah_multikey_needles", 32, haystack="needles"),
    _niah("niah_multivalue", 64, num_values=4),
    _niah("niah_multivalue_essay", 64, haystack="essay", num_values=4),
    _niah("niah_multiquery", 64, num_keys=4, num_queries=4),
    _niah("niah_multiquery_essay", 64, haystack="essay", num_keys=4, num_queries=4),
    TaskSpec("vt", "vt", 30, num_hops=2),   # RULER: 4 hops; SmolLM2-135M finds 2 (docs/eval.md)
    TaskSpec("cwe", "cwe", 120),
    TaskSpec("fwe", "fwe", 50),
)
TASKS: dict[str, TaskSpec] = {s.name: s for s in _SPECS}
# RULER's suite of generated tasks: single needles in both haystacks (and a uuid), the multi-needle
# tasks in real text as RULER has them; the noise and needles-only variants are there by name.
DEFAULT_TASKS: tuple[str, ...] = (
    "niah_single", "niah_single_essay", "niah_single_uuid_essay", "niah_multikey_essay", "niah_multivalue_essay",
    "niah_multiquery_essay", "vt", "cwe", "fwe",
)


def task_names() -> tuple[str, ...]:
    return tuple(TASKS)


def task_spec(task: str) -> TaskSpec:
    if task not in TASKS:
        raise ValueError(f"task={task!r} is not a known task; choose one of: {', '.join(TASKS)}")
    return TASKS[task]


# ---- samples -----------------------------------------------------------------------------------


EXCERPT_CHARS = 200   # the context's head and tail kept beside an answer (answers.json)


@dataclass(frozen=True)
class TaskSample:
    task: str
    length: int
    index: int
    context_ids: list[int]    # everything up to and including the context (chat prefix + instruction + haystack)
    question_ids: list[int]   # the rest of the prompt: the question, the template's close, the answer prefix
    answers: list[str]        # expected strings
    max_new_tokens: int       # the answer budget for this task
    text: str                 # the whole prompt as text
    metric: str = "all"       # how `score` grades it

    @property
    def prompt_ids(self) -> list[int]:
        return self.context_ids + self.question_ids

    def describe(self, tokenizer, excerpt: int = EXCERPT_CHARS) -> dict:
        """What a reader needs to check a score by eye: the references, the scoring rule, the
        question, and the context by its sha256 (of its text) with its head and tail."""
        context = tokenizer.decode(self.context_ids)
        return {"references": list(self.answers), "metric": self.metric, "question": tokenizer.decode(self.question_ids),
                "context": {"sha256": hashlib.sha256(context.encode()).hexdigest(), "tokens": len(self.context_ids),
                            "head": context[:excerpt], "tail": context[-excerpt:] if len(context) > excerpt else ""}}


@dataclass(frozen=True)
class _Parts:
    """A task's prompt before the chat template: head + question + prefix, and the answers."""

    head: str       # instruction + context, ending in "\n"
    question: str
    prefix: str     # the answer prefix, with RULER's leading space
    answers: list[str]


# SmolLM2-135M-Instruct answered better (never worse) through its chat template than with RULER's
# plain prompts, and stops at its end-of-turn token instead of rambling to the budget (docs/eval.md).
DEFAULT_CHAT = True


def make_samples(task: str, length: int, n: int, seed: int, tokenizer, *, chat: bool = DEFAULT_CHAT,
                 text_path: str | None = None) -> list[TaskSample]:
    """n samples of `task` fitted to `length` tokens (prompt + answer budget), module doc.

    tokenizer: anything with encode(text, add_special_tokens=...) -> ids (caramba's or HF's), and
    apply_chat_template(messages, add_generation_prompt=True) -> str when chat is True.
    text_path: the essay haystack's text file (default: caramba's corpus)."""
    spec = task_spec(task)
    for name, value, low in (("length", length, 1), ("n", n, 1), ("seed", seed, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r} must be an integer >= {low}")
    essay, text_sha = _essay_words(text_path) if spec.haystack == "essay" else ((), None)
    key = getattr(tokenizer, "content_key", None)   # caramba's Tokenizer read from a file; else no memo
    if not isinstance(key, tuple):
        return [_make_sample(spec, length, seed, i, tokenizer, chat, essay) for i in range(n)]
    samples = []
    for i in range(n):   # sample i does not depend on n: a preflight's first sample is a run's first
        cell = (key, spec.name, length, seed, i, bool(chat), text_sha)
        sample = _memo.get(cell)
        if sample is None:
            sample = _make_sample(spec, length, seed, i, tokenizer, chat, essay)
            _memo.put(cell, sample)
        samples.append(sample)
    return samples


class _Memo:
    """Samples made in this process, by everything one is a function of (the tokenizer's content,
    task, length, seed, index, chat, the essay text's sha256): a manifest's preflight makes each
    (task, length)'s first sample and its run asks for it again (0.3 s of 9 tasks at 2048 tokens).
    Bounded: once `limit` prompt tokens are held it adds no more, keeping the first ones (a
    preflight's, which the runs ask for next) rather than evicting them for a run's later ones.
    It hands out copies: a caller changing a sample's lists cannot change another's."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held, self.samples = limit, 0, {}

    def get(self, cell: tuple) -> TaskSample | None:
        sample = self.samples.get(cell)
        return _copy(sample) if sample is not None else None

    def put(self, cell: tuple, sample: TaskSample) -> None:
        size = len(sample.context_ids) + len(sample.question_ids)
        if self.held + size <= self.limit:
            self.samples[cell] = _copy(sample)
            self.held += size


def _copy(s: TaskSample) -> TaskSample:
    return replace(s, context_ids=list(s.context_ids), question_ids=list(s.question_ids), answers=list(s.answers))


_memo = _Memo(1 << 18)   # ~10 MB of ids and text at most


def _sample_seed(task: str, length: int, seed: int, index: int) -> int:
    digest = hashlib.sha256(f"caramba.tasks|{task}|{length}|{seed}|{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def _make_sample(spec: TaskSpec, length: int, seed: int, index: int, tokenizer, chat: bool,
                 essay: Sequence[str]) -> TaskSample:
    sample_seed = _sample_seed(spec.name, length, seed, index)
    build = _BUILDERS[spec.kind]
    target = length - spec.max_new_tokens

    def measure(units: int) -> tuple[int, TaskSample]:
        parts = build(spec, random.Random(sample_seed), units, length=length, essay=essay)
        context, question = _render(tokenizer, parts, chat)
        ctx_ids = list(tokenizer.encode(context, add_special_tokens=not chat))
        q_ids = list(tokenizer.encode(question, add_special_tokens=False))
        sample = TaskSample(spec.name, length, index, ctx_ids, q_ids, list(parts.answers), spec.max_new_tokens,
                            context + question, spec.metric)
        return len(ctx_ids) + len(q_ids), sample

    memo: dict[int, tuple[int, TaskSample]] = {}
    cap = _max_units(spec, length)

    def tokens(units: int) -> int:
        if units > cap:   # more units than the task can draw: never fits
            return target + 1
        if units not in memo:
            memo[units] = measure(units)
        return memo[units][0]

    lo = _min_units(spec)
    if tokens(lo) > target:
        least = tokens(lo) + spec.max_new_tokens
        raise ValueError(f"length={length} is too short for task {spec.name}: its smallest prompt takes {tokens(lo)} "
                         f"tokens and the answer {spec.max_new_tokens}; give length >= {least}")
    return memo[_largest_fitting(tokens, lo, target)][1]


def _largest_fitting(tokens: Callable[[int], int], lo: int, target: int) -> int:
    """The most haystack units whose prompt fits `target` tokens (lo fits): a guess from the
    tokens per unit, a bracket around it, then bisection. Token counts grow with units, though
    not strictly (draws move), so only a measured fit is ever returned."""
    good, bad = lo, None

    def probe(units: int) -> bool:
        nonlocal good, bad
        if units > 64 * target + lo:
            raise RuntimeError(f"the prompt stopped growing with its haystack ({units} units, {tokens(units)} tokens)")
        if tokens(units) <= target:
            good = max(good, units)
            return True
        bad = units if bad is None else min(bad, units)
        return False

    step = max(lo, 16)
    if probe(lo + step):
        rate = max((tokens(lo + step) - tokens(lo)) / step, 1e-3)
        guess = good + max(1, int((target - tokens(good)) / rate))
        delta = max(1, guess // 50)
        if probe(guess):
            while probe(good + delta):
                delta *= 2
        else:
            while bad - delta > good and not probe(bad - delta):
                delta *= 2
    while bad is not None and bad - good > 1:
        probe((good + bad) // 2)
    return good


def _render(tokenizer, parts: _Parts, chat: bool) -> tuple[str, str]:
    """(context text, question text): the prompt split after the head."""
    if not chat:
        return parts.head, parts.question + parts.prefix
    user = parts.head + parts.question
    try:
        # tokenize=False: HF tokenizers return ids without it (caramba's ignores it)
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                                 tokenize=False)
    except Exception as e:   # no template, or one that refuses the message
        raise ValueError(f"chat=True needs the tokenizer's chat template: {e}") from None
    if not isinstance(rendered, str):
        raise ValueError(f"chat=True: the tokenizer's apply_chat_template gave {type(rendered).__name__}, not text")
    at = rendered.find(user)
    if at < 0:
        raise ValueError("chat=True: the tokenizer's chat template rewrites the user message, so the context "
                         "cannot be split from the question; use chat=False")
    cut = at + len(parts.head)
    # The assistant's turn starts on a fresh line: RULER's leading space belongs to plain prompts.
    return rendered[:cut], rendered[cut:] + parts.prefix.lstrip()


# ---- haystacks and draws -----------------------------------------------------------------------


def _essay_words(text_path: str | None) -> tuple[tuple[str, ...], str]:
    """The text's words, and the sha256 of the text they were read from (the memo's key)."""
    from caramba.evaluation.evaluate import corpus_text

    text = corpus_text(text_path)
    words = tuple(text.split())
    if len(words) < 50:
        raise ValueError(f"text_path={text_path!r} holds {len(words)} words; the essay haystack needs at least 50")
    return words, hashlib.sha256(text.encode()).hexdigest()


def _essay_sentences(rng: random.Random, essay: Sequence[str], n_words: int) -> list[str]:
    """n_words of the text from a random start, wrapping around, cut into sentences."""
    start = rng.randrange(len(essay))
    words = [essay[(start + i) % len(essay)] for i in range(n_words)]
    return re.split(r"(?<=[.!?])\s+", " ".join(words))


def _insert_at_depths(rng: random.Random, sentences: list[str], inserts: list[str]) -> str:
    """RULER's essay insertion: each insert at a distinct depth (percent of the sentences)."""
    depths = sorted(rng.sample(DEPTHS, len(inserts)))
    cuts = [0] + [int(len(sentences) * d / 100) for d in depths] + [len(sentences)]
    pieces = []
    for i in range(1, len(cuts)):
        pieces.append(" ".join(sentences[cuts[i - 1]:cuts[i]]))
        if i - 1 < len(inserts):
            pieces.append(inserts[i - 1])
    return " ".join(p for p in pieces if p)


def _insert_in_noise(rng: random.Random, lines: list[str], inserts: list[str]) -> str:
    """RULER's noise insertion: inserts at distinct random line positions, in order."""
    for at, line in zip(sorted(rng.sample(range(len(lines)), len(inserts)), reverse=True), reversed(inserts)):
        lines.insert(at, line)
    return "\n".join(lines)


def _draw(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return rng.choice(KEY_WORDS)
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _draw_distinct(rng: random.Random, kind: str, count: int, taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < count:
        x = _draw(rng, kind)
        if x not in taken and x.lower() not in _TEMPLATE_TEXT:
            taken.add(x)
            out.append(x)
    return out


# ---- builders: (spec, rng, units, length, essay) -> _Parts -----------------------------------------


def _min_units(spec: TaskSpec) -> int:
    if spec.kind == "niah":
        return spec.num_keys * spec.num_values if spec.haystack != "essay" else 1
    if spec.kind == "vt":
        return spec.num_chains * (spec.num_hops + 1)
    if spec.kind == "cwe":
        return spec.num_common + 1
    return 64   # fwe: enough words that the top three counts differ from the fourth


def _max_units(spec: TaskSpec, length: int) -> int:
    if spec.kind == "cwe":   # distinct words: the list's, less the example's
        return len(_cwe_pool(length)) - (20 if length < 4096 else 40)
    return 1 << 40


def _cwe_pool(length: int) -> tuple[str, ...]:
    """cwe's words: single words up to CWE_SINGLE_WORDS_MAX tokens (their ~1200 fill about 20k
    tokens at RULER's frequencies), adjective-noun pairs beyond (RULER too moves to a larger list).
    Chosen by length, not by the count drawn, so the prompt grows smoothly while it is fitted."""
    return WORDS if length <= CWE_SINGLE_WORDS_MAX else KEY_WORDS


CWE_SINGLE_WORDS_MAX = 16384


def _build_niah(spec: TaskSpec, rng: random.Random, units: int, *, length: int, essay: Sequence[str]) -> _Parts:
    taken: set[str] = set()
    keys = _draw_distinct(rng, spec.key_type, spec.num_keys, taken)
    values = [_draw_distinct(rng, spec.value_type, spec.num_values, taken) for _ in keys]
    needles = [NEEDLE.format(type_v=spec.value_type, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    if spec.haystack == "essay":
        context = _insert_at_depths(rng, _essay_sentences(rng, essay, units), needles)
    elif spec.haystack == "noise":
        context = _insert_in_noise(rng, [NOISE] * units, needles)
    else:   # needles: every haystack line is a needle with another key
        others = _draw_distinct(rng, spec.key_type, units, taken)
        lines = [NEEDLE.format(type_v=spec.value_type, key=k, value=_draw(rng, spec.value_type)) for k in others]
        context = _insert_in_noise(rng, lines, needles)
    asked = rng.sample(range(spec.num_keys), spec.num_queries)
    queries = [keys[i] for i in asked]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    head, question, prefix = NIAH
    type_v = spec.value_type
    if spec.num_queries * spec.num_values == 1:   # RULER's singular wording
        head, question, prefix = (t.replace("Some", "A").replace("are all", "is").replace("are", "is")
                                  for t in (head, question, prefix))
        type_v = type_v[:-1]
    fill = dict(type_v=type_v, query=query, context=context)
    return _Parts(head.format(**fill), question.format(**fill), prefix.format(**fill),
                  [v for i in asked for v in values[i]])


def _vt_chains(rng: random.Random, spec: TaskSpec, letters: int) -> tuple[list[list[str]], list[list[str]], list[str]]:
    """RULER's chains: VAR A = value, VAR B = VAR A, ... (vars of `letters` capitals, distinct)."""
    n_vars = spec.num_chains * (spec.num_hops + 1)
    names: list[str] = []
    while len(names) < n_vars:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in names and name.lower() not in _TEMPLATE_TEXT:
            names.append(name)
    values = [str(v) for v in rng.sample(range(10000, 100000), spec.num_chains)]
    groups = [names[i:i + spec.num_hops + 1] for i in range(0, n_vars, spec.num_hops + 1)]
    chains = [[f"VAR {g[0]} = {v}"] + [f"VAR {g[j + 1]} = VAR {g[j]}" for j in range(spec.num_hops)]
              for g, v in zip(groups, values)]
    return groups, chains, values


def _vt_text(rng: random.Random, spec: TaskSpec, units: int, letters: int) -> tuple[str, list[str], str]:
    groups, chains, values = _vt_chains(rng, spec, letters)
    lines = [NOISE] * units
    for chain in chains:   # each chain's lines in order, at random positions
        positions = sorted(rng.sample(range(len(lines)), len(chain)))
        for j, (at, line) in enumerate(zip(positions, chain)):
            lines.insert(at + j, line)
    return "\n".join(lines), groups[0], values[0]


def _build_vt(spec: TaskSpec, rng: random.Random, units: int, *, length: int, essay: Sequence[str]) -> _Parts:
    head, question, prefix = VT
    example = ""
    for _ in range(spec.examples):   # RULER's one-shot example: a short chain task (3-letter variables), solved
        ex_context, ex_vars, ex_value = _vt_text(rng, spec, VT_EXAMPLE_NOISE, 3)
        ex_fill = dict(context=ex_context, query=ex_value, num_v=spec.num_hops + 1)
        example += (head.format(**ex_fill) + question.format(**ex_fill) + prefix.format(**ex_fill)
                    + " " + " ".join(ex_vars) + "\n")
    context, variables, value = _vt_text(rng, spec, units, 5)
    fill = dict(context=context, query=value, num_v=spec.num_hops + 1)
    return _Parts(example + head.format(**fill), question.format(**fill), prefix.format(**fill), variables)


VT_EXAMPLE_NOISE = 12   # noise lines in vt's example (RULER fits its example to 500 tokens)


def _cwe_list(rng: random.Random, words: list[str], num_common: int, freq_common: int, freq_rare: int) -> str:
    entries = words[:num_common] * freq_common + words[num_common:] * freq_rare
    rng.shuffle(entries)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(entries))


def _build_cwe(spec: TaskSpec, rng: random.Random, units: int, *, length: int, essay: Sequence[str]) -> _Parts:
    # RULER's settings: below 4096 tokens the common words appear 6 times and the rest once (its
    # example: 20 words, 3 and 1); from 4096 on, 30 and 3 (example: 40 words, 10 and 3).
    (ex_words, ex_c, ex_r), (freq_c, freq_r) = ((20, 3, 1), (6, 1)) if length < 4096 else ((40, 10, 3), (30, 3))
    freq_c, freq_r = spec.freq_common or freq_c, spec.freq_rare or freq_r
    pool = _cwe_pool(length)
    drawn = rng.sample(pool, units + ex_words)
    words, example_words = drawn[:units], drawn[units:]   # disjoint: copying the example earns nothing
    head, question, prefix = CWE
    fill = dict(num_cw=spec.num_common)
    ex_answer = " ".join(f"{i + 1}. {w}" for i, w in enumerate(example_words[:spec.num_common]))
    example = (head.format(context=_cwe_list(rng, example_words, spec.num_common, ex_c, ex_r), **fill)
               + question.format(**fill) + prefix.format(**fill) + " " + ex_answer + "\n") if spec.examples else ""
    context = _cwe_list(rng, words, spec.num_common, freq_c, freq_r)
    return _Parts(example + head.format(context=context, **fill), question.format(**fill), prefix.format(**fill),
                  words[:spec.num_common])


def _zeta(alpha: float) -> float:
    """Riemann zeta(alpha), alpha > 1: a partial sum plus its Euler-Maclaurin tail."""
    n = 1000
    return sum(k ** -alpha for k in range(1, n)) + n ** (1 - alpha) / (alpha - 1) + 0.5 * n ** -alpha


def _build_fwe(spec: TaskSpec, rng: random.Random, units: int, *, length: int, essay: Sequence[str]) -> _Parts:
    # RULER: a vocabulary of (length // 50) random 6-letter words; word k (1-based) appears
    # int(units * k^-alpha / zeta(alpha)) times; the most frequent is replaced by '...' (noise),
    # and the answer is ranks 2-4.
    size = max(length // 50, 8)
    vocab: list[str] = []
    while len(vocab) < size:
        w = "".join(rng.choices(string.ascii_lowercase, k=6))
        if w not in vocab and w not in _TEMPLATE_TEXT:
            vocab.append(w)
    vocab[0] = "..."
    z = _zeta(spec.alpha)
    counts = [int(units * k ** -spec.alpha / z) for k in range(1, size + 1)]
    text = [w for w, c in zip(vocab, counts) for _ in range(c)]
    rng.shuffle(text)
    head, question, prefix = FWE
    return _Parts(head.format(context=" ".join(text)), question, prefix, vocab[1:4])


_BUILDERS = {"niah": _build_niah, "vt": _build_vt, "cwe": _build_cwe, "fwe": _build_fwe}


# ---- scoring -----------------------------------------------------------------------------------


def score(prediction: str, answers: list[str], metric: str = "all") -> float:
    """RULER's scores for one prediction, as a fraction: "all" (string_match_all) is the share of
    answers found in the prediction, "part" (string_match_part) 1 if any is; case-insensitive."""
    if metric not in ("all", "part"):
        raise ValueError(f"metric={metric!r} must be 'all' (string_match_all) or 'part' (string_match_part)")
    if not answers:
        raise ValueError("answers is empty: a sample has at least one expected string")
    text = prediction.lower()
    found = [a.lower() in text for a in answers]
    return sum(found) / len(found) if metric == "all" else float(any(found))


def string_match_all(predictions: Sequence[str], references: Sequence[list[str]]) -> float:
    """RULER's batch form, in percent: the mean over predictions of score(..., "all")."""
    return _mean_percent(predictions, references, "all")


def string_match_part(predictions: Sequence[str], references: Sequence[list[str]]) -> float:
    return _mean_percent(predictions, references, "part")


def _mean_percent(predictions, references, metric: str) -> float:
    if len(predictions) != len(references) or not predictions:
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references: give one per sample")
    return 100 * sum(score(p, r, metric) for p, r in zip(predictions, references)) / len(predictions)


def samples_digest(samples: Sequence[TaskSample]) -> str:
    """sha256 over every sample's ids, answers and budget: two runs saw the same prompts iff equal."""
    h = hashlib.sha256()
    for s in samples:
        h.update(json.dumps([s.task, s.length, s.index, s.context_ids, s.question_ids, s.answers,
                             s.max_new_tokens]).encode())
        h.update(b"\n")
    return h.hexdigest()
