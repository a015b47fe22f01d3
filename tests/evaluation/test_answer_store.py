"""The eval's answer store (caramba.evaluation.answer_store): stored answers are a fresh run's, one
more candidate answers alone, a renamed candidate is reused, a changed setting is not, and a bad
entry is recomputed, never trusted."""

from __future__ import annotations

import dataclasses

import pytest

from caramba.cache import CachePolicy
from caramba.evaluation import task_eval
from caramba.evaluation.answer_store import SUBDIR, AnswerStore
from caramba.evaluation.context_store import DIRNAME, ContextStore, model_identity
from caramba.evaluation.task_eval import Candidate, answer_tasks
from caramba.press import PressConfig
from test_eval import long_tiny  # noqa: F401 - the fixture
from test_joined import BASELINE, CANDIDATES, _answers, _eos, _samples, loaded  # noqa: F401 - the fixture

# plain, quantized, pressed, decoding-time compression (answers alone) and per-channel (KIVI) caches:
# with the baseline, enough to answer joined on either backend
SOME = [c for c in CANDIDATES if c.label in ("q8", "q4r", "snap", "decoding", "kivi")]
EXTRA = Candidate("q4", CachePolicy.build("q4_0", qblock=8))


def _stores(tmp_path, loaded, **kw):   # noqa: F811
    identity = model_identity(loaded.model, "tiny")
    return ContextStore(tmp_path, model=identity, **kw), AnswerStore(tmp_path, model=identity, **kw)


def _run(loaded, samples, candidates=SOME, store=None, **kw):   # noqa: F811
    contexts, answers = store if store is not None else (None, None)
    results, context_s = answer_tasks(loaded.model, loaded.tokenizer, samples, candidates, BASELINE,
                                      eos_ids=_eos(loaded), batch_size=2, contexts=contexts, answers=answers, **kw)
    return results, context_s


def _entries(tmp_path) -> list:
    return sorted((tmp_path / DIRNAME / SUBDIR).glob("*.json"))


@pytest.fixture
def answering(monkeypatch):
    """The labels of the candidates that answered (alone or joined), one per batch they answered."""
    calls: list[str] = []
    one, joined = task_eval._answer_one, task_eval._questioned

    def answer_one(result, *args, **kw):
        calls.append(result.candidate.label)
        return one(result, *args, **kw)

    def answer_joined(model, results, *args, **kw):
        calls.extend(r.candidate.label for r in results)
        return joined(model, results, *args, **kw)

    monkeypatch.setattr(task_eval, "_answer_one", answer_one)
    monkeypatch.setattr(task_eval, "_questioned", answer_joined)
    return calls


def test_stored_answers_are_a_fresh_runs_and_one_more_candidate_answers_alone(loaded, tmp_path, answering,  # noqa: F811
                                                                              monkeypatch):
    samples = _samples(loaded)
    fresh, _ = _run(loaded, samples, [*SOME, EXTRA])
    store = _stores(tmp_path, loaded)
    first, _ = _run(loaded, samples, store=store)
    groups = store[1].computed // (len(SOME) + 1)
    assert groups >= 2 and store[1].reused == 0 and len(_entries(tmp_path)) == store[1].computed
    assert not any(a.answer_reused for r in first for a in r.answers)
    answering.clear()
    # one more candidate: only it answers; the others' answers come from the store, flagged, as a fresh run's
    again = _stores(tmp_path, loaded)
    second, context_s = _run(loaded, samples, [*SOME, EXTRA], store=again)
    assert answering == ["q4"] * groups
    assert again[1].computed == groups and again[1].reused == groups * (len(SOME) + 1) and not again[1].bad
    assert again[0].reused == groups and again[0].computed == 0     # its contexts from the context store
    assert _answers(second) == _answers(fresh)
    timings = {r.candidate.label: [(a.prefill_s, a.decode_s) for a in r.answers] for r in first}
    for r in second:
        reused = r.candidate is not EXTRA
        assert all(a.answer_reused == reused for a in r.answers)
        t = r.time()     # reused: nothing spent now, what they took when computed apart
        assert (t["answers_reused"], t["answers_computed"]) == ((len(samples), 0) if reused else (0, len(samples)))
        assert (t["total_s"] == 0 and t["reused_s"] > 0) if reused else (t["total_s"] > 0 and t["reused_s"] == 0)
        if reused:       # the first run's timings kept, and its presses' kept shares
            assert [(a.prefill_s, a.decode_s) for a in r.answers] == timings[r.candidate.label]
            assert r.kept == first[[x.candidate for x in first].index(r.candidate)].kept
    # every answer stored: no context is prefilled or read, nothing answers
    monkeypatch.setattr(task_eval, "_context", lambda *a, **k: pytest.fail("a context was needed"))
    answering.clear()
    third, context_s = _run(loaded, samples, [*SOME, EXTRA], store=_stores(tmp_path, loaded))
    assert answering == [] and context_s == 0 and _answers(third) == _answers(fresh)


@pytest.mark.parametrize("bound", ["rows", "bytes", "free memory"])
def test_one_new_candidate_decodes_its_batches_side_by_side(loaded, tmp_path, monkeypatch, bound):   # noqa: F811
    """The one candidate left answering (every other's answers stored) decodes the batches of a wave
    together: its rows of different batches step in one forward, and answer as in a fresh run. A
    wave holds at most WAVE_BYTES of caches (or a share of the free memory): with none to spare each
    batch decodes alone."""
    if bound == "bytes":
        monkeypatch.setattr(task_eval, "WAVE_BYTES", 1)
    elif bound == "free memory":
        monkeypatch.setattr(task_eval, "free_memory_bytes", lambda device: task_eval.WAVE_SHARE)
    samples = _samples(loaded)
    fresh, _ = _run(loaded, samples, [*SOME, EXTRA])
    _run(loaded, samples, store=_stores(tmp_path, loaded))
    widths: list[int] = []
    step = task_eval.step_together

    def counting(model, states, *args):
        widths.append(len(states))
        return step(model, states, *args)

    monkeypatch.setattr(task_eval, "step_together", counting)
    again, _ = _run(loaded, samples, [*SOME, EXTRA], store=_stores(tmp_path, loaded))
    if bound == "rows":
        assert widths and max(widths) >= 2      # states of different batches, all the new candidate's
    else:
        assert not widths                       # one batch a wave: the new candidate's steps alone
    assert _answers(again) == _answers(fresh)
    assert all(a.answer_reused == (r.candidate is not EXTRA) for r in again for a in r.answers)


def test_a_wave_of_several_batches_steps_in_forwards_of_the_joins_rows(loaded, monkeypatch):   # noqa: F811
    """A wave holds up to WAVE_FORWARDS forwards' rows of several batches; each step cuts the entries
    still answering, in order, into forwards of at most the join's rows (here 4: two candidates of
    two rows), and the answers are those of one batch a wave."""
    monkeypatch.setattr(task_eval, "_join_rows", lambda backend, rows: 4)
    samples = _samples(loaded)
    monkeypatch.setattr(task_eval, "WAVE_FORWARDS", 1)
    one, _ = _run(loaded, samples)
    widths: list[int] = []
    step = task_eval.step_together

    def counting(model, states, *args):
        widths.append(sum(s.cache.batch_size for s in states))
        return step(model, states, *args)

    monkeypatch.setattr(task_eval, "step_together", counting)
    monkeypatch.setattr(task_eval, "WAVE_FORWARDS", 4)
    several, _ = _run(loaded, samples)
    assert widths and max(widths) <= 4
    assert _answers(several) == _answers(one)
    assert task_eval._forwards([0, 1, 2, 3], [2, 9, 1, 3], 4) == [[0], [1], [2, 3]]   # 9 > 4: alone
    assert task_eval._forwards([1, 3, 4], [2, 1, 3, 2, 2], 4) == [[1, 3], [4]]


def test_with_own_prefills_only_the_new_candidate_prefills(loaded, tmp_path, answering, monkeypatch):   # noqa: F811
    samples = _samples(loaded)[:2]
    fresh, _ = _run(loaded, samples, [*SOME[:3], EXTRA], prefill="own")
    _run(loaded, samples, SOME[:3], store=_stores(tmp_path, loaded), prefill="own")
    # the baseline's answers are stored: its context is not prefilled (each candidate prefills its own)
    monkeypatch.setattr(task_eval, "_context", lambda *a, **k: pytest.fail("the baseline's context was prefilled"))
    answering.clear()
    again, context_s = _run(loaded, samples, [*SOME[:3], EXTRA], store=_stores(tmp_path, loaded), prefill="own")
    assert answering == ["q4"] and context_s == 0 and _answers(again) == _answers(fresh)


def test_a_renamed_candidate_is_reused_a_changed_one_is_not(loaded, tmp_path, answering):   # noqa: F811
    samples = _samples(loaded)[:2]
    _run(loaded, samples, store=_stores(tmp_path, loaded))
    renamed = [dataclasses.replace(c, label=c.label + "-renamed") for c in SOME]
    answering.clear()
    _run(loaded, samples, renamed, store=_stores(tmp_path, loaded))
    assert answering == []
    # another policy, another press ratio: those two answer again; the rest are reused
    snap = next(c for c in SOME if c.label == "snap")
    changed = [c if c.label != "snap" else dataclasses.replace(snap, press=PressConfig(method="snapkv", ratio=0.4,
                                                                                       window_size=8)) for c in SOME]
    changed[0] = dataclasses.replace(changed[0], policy=CachePolicy.build("q8_0", qblock=16))
    _run(loaded, samples, changed, store=_stores(tmp_path, loaded))
    assert set(answering) == {"q8", "snap"}
    # another q_chunk: every candidate answers again
    answering.clear()
    store = _stores(tmp_path, loaded)
    _run(loaded, samples, store=store, q_chunk=256)
    assert set(answering) == {c.label for c in [*SOME, BASELINE]} and store[1].reused == 0


@pytest.mark.parametrize("how", ["truncated", "flipped", "garbage", "swapped", "unfit"])
def test_a_bad_entry_is_recomputed_not_trusted(loaded, tmp_path, answering, how):   # noqa: F811
    samples = _samples(loaded)[:2]
    candidates = SOME[:2]
    before, _ = _run(loaded, samples, candidates, store=_stores(tmp_path, loaded))
    files = _entries(tmp_path)
    assert len(files) == 3
    data = files[0].read_text()
    if how == "truncated":
        files[0].write_text(data[: len(data) // 2])
    elif how == "flipped":        # an answer's text changed: the body's checksum no longer matches
        files[0].write_text(data.replace('"text":"', '"text":"x', 1))
    elif how == "garbage":
        files[0].write_bytes(b"\xff not json")
    elif how == "swapped":        # a valid entry under another key's name
        files[0].write_text(files[1].read_text())
    else:                         # a valid entry whose answers are not the batch's (written by other code)
        key = _key_of(files[0])
        store = AnswerStore(tmp_path, model=model_identity(loaded.model, "tiny"))
        body = store._parse(files[0].read_bytes())[1]
        store.save(key, {**body, "answers": body["answers"][:1]})
    answering.clear()
    check = _stores(tmp_path, loaded)
    after, _ = _run(loaded, samples, candidates, store=check)
    why = {"truncated": "corrupt", "garbage": "corrupt", "flipped": "checksum mismatch", "swapped": "key mismatch",
           "unfit": "do not fit"}[how]
    assert check[1].reused == 2 and check[1].computed == 1 and len(answering) == 1
    assert len(check[1].bad) == 1 and why in check[1].bad[0] and files[0].name in check[1].bad[0]
    assert _answers(after) == _answers(before)
    reread = _stores(tmp_path, loaded)        # the entry was rewritten whole
    _run(loaded, samples, candidates, store=reread)
    assert reread[1].reused == 3 and not reread[1].bad


def _key_of(path) -> dict:
    import json

    return json.loads(json.loads(path.read_text())["key"])


def test_the_store_is_off_with_the_context_stores_bound_at_zero(loaded, tmp_path, monkeypatch, answering):  # noqa: F811
    monkeypatch.setenv("CARAMBA_CONTEXT_STORE_MB", "0")
    samples = _samples(loaded)[:2]
    for _ in range(2):
        answering.clear()
        store = _stores(tmp_path, loaded)
        results, _ = _run(loaded, samples, SOME[:2], store=store)
        assert not store[1].enabled and store[1].computed == 0 and len(answering) == 3
        assert not any(a.answer_reused for r in results for a in r.answers)
    assert not (tmp_path / DIRNAME).exists()
