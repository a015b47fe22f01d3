"""Long-context task generators and scoring (caramba.evaluation.tasks), on a byte-level tokenizer built
in memory (one token per byte, ChatML template): fast, and a real `tokenizers` pipeline."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from caramba.evaluation import tasks
from caramba.evaluation.tasks import (DEFAULT_TASKS, GENERATOR_VERSION, TaskSample, make_samples, samples_digest, score,
                                 string_match_all, string_match_part, task_names)
from caramba.tokenizer import Tokenizer

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LENGTH = 4000   # bytes = tokens here: long enough for every task's smallest prompt


def byte_tokenizer(chat_template: str | None = CHATML) -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>", *alphabet])}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return Tokenizer(backend, eos_token_id=2, chat_template=chat_template)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return byte_tokenizer()


@pytest.fixture(scope="module")
def samples(tok) -> dict[tuple[str, bool], list[TaskSample]]:
    """Two samples of every task at LENGTH, plain and chat, made once for the module."""
    return {(t, chat): make_samples(t, LENGTH, 2, 7, tok, chat=chat) for t in task_names() for chat in (False, True)}


def parts(tok, s: TaskSample) -> tuple[str, str]:
    return tok.decode(s.context_ids), tok.decode(s.question_ids)


# ---- the suite ---------------------------------------------------------------------------------


def test_suite_covers_rulers_generated_categories():
    assert isinstance(GENERATOR_VERSION, int)
    assert set(DEFAULT_TASKS) <= set(task_names())
    for name in ("niah_single", "niah_single_essay", "niah_multikey_essay", "niah_multivalue_essay",
                 "niah_multiquery_essay", "vt", "cwe", "fwe"):
        assert name in DEFAULT_TASKS
    # both haystacks of every retrieval kind
    for kind in ("single", "multikey", "multivalue", "multiquery"):
        assert tasks.TASKS[f"niah_{kind}"].haystack == "noise"
        assert tasks.TASKS[f"niah_{kind}_essay"].haystack == "essay"
    assert {tasks.TASKS[t].value_type for t in DEFAULT_TASKS if t.startswith("niah")} == {"numbers", "uuids"}


# ---- determinism -------------------------------------------------------------------------------


@pytest.mark.parametrize("task", task_names())
def test_samples_are_deterministic_and_seeded(tok, samples, task):
    again = make_samples(task, LENGTH, 2, 7, tok, chat=False)
    assert again == samples[(task, False)]
    assert samples_digest(again) == samples_digest(samples[(task, False)])
    other = make_samples(task, LENGTH, 2, 8, tok, chat=False)
    assert samples_digest(other) != samples_digest(again)
    assert other[0].text != again[0].text and other[0].answers != again[0].answers
    # the samples of one call differ from each other
    assert again[0].text != again[1].text


def test_sample_seed_is_a_stable_function_of_its_inputs():
    # sha256-derived: the same on every machine and Python (hash() would be salted per process)
    assert tasks._sample_seed("niah_single", 1024, 0, 0) == 0x2b7f5be01f3e6eb4
    assert len({tasks._sample_seed("vt", n, s, i) for n in (1024, 2048) for s in (0, 1) for i in (0, 1)}) == 8


def test_digest_sees_ids_and_answers(samples):
    s = samples[("niah_single", False)]
    base = samples_digest(s)
    changed_id = TaskSample(**{**s[0].__dict__, "question_ids": s[0].question_ids[:-1]})
    changed_answer = TaskSample(**{**s[0].__dict__, "answers": ["0000000"]})
    assert samples_digest([changed_id, s[1]]) != base
    assert samples_digest([changed_answer, s[1]]) != base
    assert samples_digest(s[::-1]) != base


# ---- samples made once a process ---------------------------------------------------------------


@pytest.fixture
def made(monkeypatch) -> list[tuple]:
    """(task, length, seed, index, chat) of every sample actually generated, in order."""
    calls, real = [], tasks._make_sample

    def counting(spec, length, seed, index, tokenizer, chat, essay):
        calls.append((spec.name, length, seed, index, chat))
        return real(spec, length, seed, index, tokenizer, chat, essay)

    monkeypatch.setattr(tasks, "_make_sample", counting)
    return calls


def saved_tokenizer(directory, chat_template: str | None = CHATML) -> Tokenizer:
    """The byte tokenizer written to `directory` and read back, as a model's tokenizer is."""
    byte_tokenizer(chat_template).save(directory)
    return Tokenizer.from_dir(directory)


def fresh(monkeypatch, *args, **kw) -> list[TaskSample]:
    """make_samples with nothing kept: what a new process makes."""
    monkeypatch.setattr(tasks, "_memo", tasks._Memo(0))
    return make_samples(*args, **kw)


def essay(path, word: str = "w"):
    path.write_text(" ".join(f"{word}{i:03d}" + ("." if i % 8 == 7 else "") for i in range(400)))
    return str(path)


def test_a_tokenizer_read_from_the_same_files_gets_the_samples_made_with_the_other(tmp_path, made, monkeypatch):
    """A preflight's tokenizer and the loaded model's are two objects read from one tokenizer.json:
    the run's first sample of a cell is the one the preflight made (sample i does not depend on n),
    its others are made, and all equal what a fresh process makes."""
    text = essay(tmp_path / "essay.txt")
    preflight = saved_tokenizer(tmp_path / "tok")
    run = Tokenizer.from_dir(tmp_path / "tok")
    assert preflight is not run and preflight.content_key == run.content_key is not None
    first = make_samples("niah_single_essay", LENGTH, 1, 0, preflight, text_path=text)
    got = make_samples("niah_single_essay", LENGTH, 3, 0, run, text_path=text)
    assert made == [("niah_single_essay", LENGTH, 0, i, True) for i in (0, 1, 2)]
    assert got[0] == first[0]
    want = fresh(monkeypatch, "niah_single_essay", LENGTH, 3, 0, run, text_path=text)
    assert got == want and samples_digest(got) == samples_digest(want)


def test_a_changed_setting_text_or_tokenizer_makes_its_samples_again(tmp_path, made, monkeypatch):
    path = tmp_path / "essay.txt"
    tok = saved_tokenizer(tmp_path / "tok")

    def make(task="niah_single_essay", length=LENGTH, seed=0, tokenizer=tok, chat=True):
        return make_samples(task, length, 1, seed, tokenizer, chat=chat, text_path=essay(path))

    before = make()
    assert make() == before and len(made) == 1   # the second from the memo
    make(seed=1), make(length=LENGTH - 100), make(chat=False), make(task="niah_multikey_essay")
    assert len(made) == 5
    other_template = saved_tokenizer(tmp_path / "other", CHATML.replace("assistant", "bot"))
    make(tokenizer=other_template)
    (tmp_path / "tok" / "tokenizer.json").write_text((tmp_path / "tok" / "tokenizer.json").read_text()
                                                     .replace('"<|endoftext|>"', '"<|end|>"'))
    reread = Tokenizer.from_dir(tmp_path / "tok")   # the same path, another tokenizer.json
    assert reread.content_key != tok.content_key
    make(tokenizer=reread)
    make(tokenizer=byte_tokenizer()), make(tokenizer=byte_tokenizer())   # built in memory: never kept
    assert len(made) == 9
    essay(path, word="v")   # the same text path, other words
    changed = make_samples("niah_single_essay", LENGTH, 1, 0, tok, text_path=str(path))
    assert len(made) == 10 and "v017" in changed[0].text and changed != before
    assert changed == fresh(monkeypatch, "niah_single_essay", LENGTH, 1, 0, tok, text_path=str(path))


def test_the_kept_samples_are_handed_out_as_copies_up_to_a_bound(tmp_path, made, monkeypatch):
    tok = saved_tokenizer(tmp_path / "tok")
    one = make_samples("niah_single", LENGTH, 1, 0, tok)[0]
    one.context_ids.clear(), one.answers.append("x")    # a caller changing what it got
    two = make_samples("niah_single", LENGTH, 1, 0, tok)[0]
    assert len(made) == 1 and two.context_ids and "x" not in two.answers
    two.question_ids.clear()
    assert make_samples("niah_single", LENGTH, 1, 0, tok)[0].question_ids
    monkeypatch.setattr(tasks, "_memo", tasks._Memo(LENGTH))   # room for one sample's prompt, not two
    make_samples("niah_single", LENGTH, 2, 5, tok), make_samples("niah_single", LENGTH, 2, 5, tok)
    assert [index for *_, index, _chat in made[1:]] == [0, 1, 1]   # the first kept, the second made again
    assert 0 < tasks._memo.held <= LENGTH


# ---- prompts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("task", task_names())
def test_answers_are_in_the_context_and_not_in_the_question(tok, samples, task, chat):
    for s in samples[(task, chat)]:
        context, question = parts(tok, s)
        assert s.answers
        for a in s.answers:
            assert a in context
            assert a.lower() not in question.lower()


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("task", task_names())
def test_context_plus_question_is_the_prompt(tok, samples, task, chat):
    for s in samples[(task, chat)]:
        assert s.context_ids + s.question_ids == tok.encode(s.text, add_special_tokens=not chat)
        assert s.prompt_ids == s.context_ids + s.question_ids
        context, question = parts(tok, s)
        assert context + question == s.text
        assert context.endswith("\n")   # the split falls just after the context's newline
        assert s.max_new_tokens == tasks.TASKS[task].max_new_tokens
        assert (s.task, s.length, s.metric) == (task, LENGTH, "all")
        if chat:
            assert context.startswith("<|im_start|>user\n")
            assert "<|im_end|>\n<|im_start|>assistant\n" in question
            assert not question.endswith(" ") and not question.split("assistant\n")[-1].startswith(" ")
        else:
            assert "<|im_start|>" not in s.text


@pytest.mark.parametrize("task", task_names())
@pytest.mark.parametrize("length", [2500, 4000, 7000])
def test_prompt_fills_the_length_and_leaves_the_answer_room(tok, task, length):
    for s in make_samples(task, length, 2, 3, tok, chat=True):
        total = len(s.prompt_ids) + s.max_new_tokens
        assert total <= length
        assert total >= 0.95 * length, (task, length, total)


def test_the_smallest_length_is_what_the_error_says(tok):
    with pytest.raises(ValueError, match=r"length=300 is too short for task vt.*give length >= (\d+)") as e:
        make_samples("vt", 300, 1, 0, tok, chat=False)
    minimum = int(re.search(r">= (\d+)", str(e.value)).group(1))
    s = make_samples("vt", minimum, 1, 0, tok, chat=False)[0]
    assert len(s.prompt_ids) + s.max_new_tokens <= minimum
    with pytest.raises(ValueError, match="too short"):
        make_samples("vt", minimum - 1, 1, 0, tok, chat=False)


# ---- what each task asks -----------------------------------------------------------------------

NEEDLE = re.compile(r"One of the special magic (\w+) for ([\w-]+) is: ([\w-]+)\.")


@pytest.mark.parametrize("task", [t for t in task_names() if t.startswith("niah")])
def test_niah_needles_answer_the_question(tok, samples, task):
    spec = tasks.TASKS[task]
    for s in samples[(task, False)]:
        context, question = parts(tok, s)
        needles = NEEDLE.findall(context)
        by_key: dict[str, list[str]] = {}
        for kind, key, value in needles:
            assert kind == spec.value_type
            by_key.setdefault(key, []).append(value)
        asked = [k for k in by_key if k in question]
        assert len(asked) == spec.num_queries
        assert sorted(v for k in asked for v in by_key[k]) == sorted(s.answers)
        assert all(len(by_key[k]) == spec.num_values for k in asked)
        if spec.haystack == "needles":
            assert len(by_key) > 20 and "The grass is green" not in context
        else:
            assert len(by_key) == spec.num_keys
        if spec.value_type == "numbers":
            assert all(re.fullmatch(r"[1-9]\d{6}", a) for a in s.answers)
        else:
            assert all(re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", a)
                       for a in s.answers)
        single = spec.num_queries * spec.num_values == 1
        assert ("What is the special magic" in question) == single
        assert (tasks.NOISE in context) == (spec.haystack == "noise")


def test_vt_answers_are_the_chain_holding_the_asked_value(tok, samples):
    for s in samples[("vt", False)]:
        context, question = parts(tok, s)
        main = context[context.rindex("Memorize and track"):]
        value = re.search(r"assigned the value (\d+)", question).group(1)
        holds = {name: val for name, val in re.findall(r"^VAR ([A-Z]+) = (\d+)$", main, re.M)}
        links = re.findall(r"^VAR ([A-Z]+) = VAR ([A-Z]+)$", main, re.M)
        for _ in links:   # follow the chain to a fixed point
            for dst, src in links:
                if src in holds:
                    holds[dst] = holds[src]
        assert sorted(n for n, v in holds.items() if v == value) == sorted(s.answers)
        assert len(s.answers) == tasks.TASKS["vt"].num_hops + 1
        # the one-shot example before it carries its own answer
        hops = tasks.TASKS["vt"].num_hops
        assert re.search(rf"they are: [A-Z]{{3}}( [A-Z]{{3}}){{{hops}}}\n", context)


@pytest.mark.parametrize("length", [LENGTH, 8000])   # RULER's two frequency regimes (below / from 4096)
def test_cwe_answers_are_the_most_common_words(tok, length):
    for s in make_samples("cwe", length, 2, 1, tok, chat=False):
        context, _ = parts(tok, s)
        main = context[context.rindex("Below is a numbered list"):]
        counts = Counter(re.findall(r"\d+\. ([\w-]+)", main))
        top = sorted(counts.values(), reverse=True)
        assert sorted(s.answers) == sorted(w for w, c in counts.items() if c >= top[9])
        assert top[9] > top[10]
        assert top[0] == (6 if length < 4096 else 30)
        example = context[:context.rindex("Below is a numbered list")]
        assert not set(s.answers) & set(re.findall(r"\d+\. ([\w-]+)", example))


def test_fwe_answers_are_the_three_most_frequent_coded_words(tok, samples):
    for s in samples[("fwe", False)]:
        context, _ = parts(tok, s)
        coded = context.split("coded words. ", 1)[1].split()
        counts = Counter(w for w in coded if w != "...")
        ranked = counts.most_common()
        assert sorted(w for w, _ in ranked[:3]) == sorted(s.answers)
        assert ranked[2][1] > ranked[3][1]
        assert coded.count("...") > ranked[0][1]


def test_essay_haystack_reads_the_given_text_and_wraps_around(tok, tmp_path):
    words = [f"w{i:03d}" for i in range(80)]
    text = tmp_path / "essay.txt"
    text.write_text(" ".join(w + ("." if i % 8 == 7 else "") for i, w in enumerate(words)))
    s = make_samples("niah_single_essay", 3000, 1, 0, tok, chat=False, text_path=str(text))[0]
    context, _ = parts(tok, s)
    assert context.count("w017") >= 3            # 80 words, ~2900 bytes: wrapped several times
    default = make_samples("niah_single_essay", 3000, 1, 0, tok, chat=False)[0]
    assert "w017" not in default.text and "cache" in default.text   # caramba's corpus


# ---- bad settings ------------------------------------------------------------------------------


def test_bad_settings_raise_naming_the_setting(tok, tmp_path):
    with pytest.raises(ValueError, match=r"task='niah' is not a known task.*niah_single"):
        make_samples("niah", 1024, 1, 0, tok, chat=False)
    for name, kw in (("n", dict(n=0)), ("length", dict(length=0)), ("seed", dict(seed=-1)), ("n", dict(n=True))):
        args = dict(task="niah_single", length=LENGTH, n=1, seed=0) | kw
        with pytest.raises(ValueError, match=rf"^{name}="):
            make_samples(args["task"], args["length"], args["n"], args["seed"], tok, chat=False)
    with pytest.raises(ValueError, match=r"length=100 is too short for task niah_single.*give length >= \d+"):
        make_samples("niah_single", 100, 1, 0, tok, chat=False)
    with pytest.raises(ValueError, match="chat=True needs the tokenizer's chat template"):
        make_samples("niah_single", LENGTH, 1, 0, byte_tokenizer(None), chat=True)
    short = tmp_path / "short.txt"
    short.write_text("too few words here.")
    with pytest.raises(ValueError, match="text_path=.*holds 4 words"):
        make_samples("niah_single_essay", LENGTH, 1, 0, tok, chat=False, text_path=str(short))


# ---- scoring -----------------------------------------------------------------------------------


def test_score_is_rulers_string_match():
    answers = ["1234567", "ALPHA-cat", "uuid-x"]
    assert score("1234567, alpha-CAT and UUID-X", answers) == 1.0                 # case-insensitive
    assert score("The numbers are 1234567 and alpha-cat.", answers) == pytest.approx(2 / 3)
    assert score("nothing here", answers) == 0.0
    assert score("", answers) == 0.0
    assert score("x1234567x", ["1234567"]) == 1.0                                  # a substring counts
    assert score("123456", ["1234567"]) == 0.0
    assert score("only alpha-cat", answers, "part") == 1.0
    assert score("none", answers, "part") == 0.0
    assert string_match_all(["1234567", "x"], [["1234567"], ["y", "x"]]) == pytest.approx(75.0)
    assert string_match_part(["1234567", "x"], [["1234567"], ["y", "x"]]) == pytest.approx(100.0)
    with pytest.raises(ValueError, match="metric='any'"):
        score("a", ["a"], "any")
    with pytest.raises(ValueError, match="answers is empty"):
        score("a", [])
    with pytest.raises(ValueError, match="2 predictions for 1 references"):
        string_match_all(["a", "b"], [["a"]])


@pytest.mark.parametrize("task", task_names())
def test_the_answers_themselves_score_one_and_the_prompt_alone_less(tok, samples, task):
    for s in samples[(task, True)]:
        assert score(" ".join(s.answers), s.answers) == 1.0
        _, question = parts(tok, s)
        assert score(question, s.answers) == 0.0


# ---- settings ----------------------------------------------------------------------------------


def test_task_settings_shape_the_prompt(tok, monkeypatch):
    """Other TaskSpec settings (as benchmarks/tasks_calibrate.py --variant makes them) take effect."""
    for name, base, changes in (("vt_bare", "vt", dict(examples=0, num_hops=2, num_chains=2)),
                                ("cwe_few", "cwe", dict(examples=0, num_common=3, freq_common=20, freq_rare=2))):
        monkeypatch.setitem(tasks.TASKS, name, dataclasses.replace(tasks.TASKS[base], name=name, **changes))
    for s in make_samples("vt_bare", LENGTH, 2, 0, tok, chat=False):
        context, question = parts(tok, s)
        assert context.count("Memorize and track") == 1 and len(s.answers) == 3
        assert len(re.findall(r"^VAR [A-Z]{5} = \d+$", context, re.M)) == 2   # the asked chain and a distractor
        assert "3 variables are assigned the value" in question
    for s in make_samples("cwe_few", LENGTH, 2, 0, tok, chat=False):
        context, question = parts(tok, s)
        counts = Counter(re.findall(r"\d+\. ([\w-]+)", context))
        assert context.count("Below is a numbered list") == 1 and len(s.answers) == 3
        assert {counts[a] for a in s.answers} == {20} and set(counts.values()) == {20, 2}
        assert "the 3 most common words" in question
