"""The eval's answers joined across candidates (caramba.evaluation.joined) and its context store
(caramba.evaluation.context_store): the same answers and scores as one candidate at a time and as a
fresh prefill; bad store entries recomputed, never trusted."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from safetensors import safe_open

from caramba.cache import CachePolicy
from caramba.evaluation import tasks as task_suite
from caramba.evaluation.context_store import DIRNAME, ContextStore, model_identity
from caramba.evaluation.task_eval import Candidate, answer_tasks
from caramba.model.zoo import load_model
from caramba.press import PressConfig
from test_eval import LENGTH, long_tiny  # noqa: F401 - the fixture

CANDIDATES = [
    Candidate("fp32", CachePolicy.build("fp32")),
    Candidate("q8", CachePolicy.build("q8_0", qblock=8)),
    Candidate("q4", CachePolicy.build("q4_0", qblock=8)),
    Candidate("q4r", CachePolicy.build("q4_0", qblock=8, rotate_keys=True)),
    Candidate("snap", CachePolicy.build("fp32"), press=PressConfig(method="snapkv", ratio=0.5, window_size=8)),
    Candidate("q8knorm", CachePolicy.build("q8_0", qblock=8), press=PressConfig(method="knorm", ratio=0.6)),
    Candidate("ada", CachePolicy.build("fp32"), press=PressConfig(method="snapkv", ratio=0.5, window_size=8,
                                                                  adaptive=True)),
    Candidate("decoding", CachePolicy.build("fp32"), press=PressConfig(method="knorm", ratio=0.0, interval=4,
                                                                       target=300)),
    Candidate("window", CachePolicy.build("q8_0", qblock=8), window=256),
    Candidate("kivi", CachePolicy.build(policy={"k": "q2_1c", "v": "q2_1"}, qblock=8, residual_len=16)),
    Candidate("q4c", CachePolicy.build(policy={"k": "q4_1c", "v": "q4_1"}, qblock=8)),
]
BASELINE = Candidate("base", CachePolicy.build("fp32"))


@pytest.fixture(scope="module")
def loaded(long_tiny):  # noqa: F811
    return load_model(str(long_tiny), progress=False)


def _samples(loaded):
    samples = task_suite.make_samples("niah_single", LENGTH, 3, 0, loaded.tokenizer, chat=True)
    return samples + task_suite.make_samples("niah_multivalue", 1100, 1, 1, loaded.tokenizer, chat=True)


def _eos(loaded) -> list[int]:
    return [int(loaded.tokenizer.eos_token_id)] if loaded.tokenizer.eos_token_id is not None else []


def _run(loaded, samples, candidates=CANDIDATES, **kw):
    results, _ = answer_tasks(loaded.model, loaded.tokenizer, samples, candidates, BASELINE, eos_ids=_eos(loaded), **kw)
    return results


def _answers(results) -> dict[str, list]:
    return {r.candidate.label: [(a.output_ids, a.text, a.score, a.steps) for a in r.answers] for r in results}


@pytest.mark.parametrize("batch_size", [1, 2])
def test_joined_answers_equal_one_candidate_at_a_time(loaded, batch_size):
    """Every candidate (plain, quantized, rotated, pressed, AdaKV, windowed; decoding-time
    compression steps alone) answers and scores exactly as it does alone."""
    samples = _samples(loaded)
    alone = _run(loaded, samples, batch_size=batch_size, join=False)
    joined = _run(loaded, samples, batch_size=batch_size, join=True)
    assert _answers(joined) == _answers(alone)
    assert all(r.answers and any(a.output_ids for a in r.answers) for r in joined)
    joins = {r.candidate.label: r.joined for r in joined}
    assert joins["decoding"] == 0 and all(joins[c.label] > 0 for c in CANDIDATES if c.label != "decoding")
    assert all(r.joined == 0 for r in alone)
    for a, j in zip(alone, joined):
        assert a.kept == j.kept   # the presses kept the same shares
        assert j.time()["decode_s"] > 0 and j.time()["question_s"] > 0


def _store(tmp_path, loaded, **kw) -> ContextStore:
    return ContextStore(tmp_path, model=model_identity(loaded.model, "tiny"), **kw)


def test_a_reused_context_answers_as_a_fresh_prefill(loaded, tmp_path):
    samples = _samples(loaded)
    fresh = _run(loaded, samples, batch_size=2, join=False)
    store = _store(tmp_path, loaded)
    first = _run(loaded, samples, batch_size=2, contexts=store)
    # one entry per batch of contexts: batches of 2, cut where question lengths differ (per-channel candidates)
    n = store.computed
    assert store.reused == 0 and n >= 2 and not store.bad
    assert len(list((tmp_path / DIRNAME).glob("*.safetensors"))) == n
    assert not any(a.context_reused for r in first for a in r.answers)
    again = _store(tmp_path, loaded)
    second = _run(loaded, samples, batch_size=2, contexts=again)
    assert again.reused == n and again.computed == 0 and not again.bad
    assert sorted(again.reused_keys) == sorted(store.computed_keys) == sorted(
        p.stem for p in (tmp_path / DIRNAME).glob("*.safetensors")) and not again.computed_keys
    assert all(a.context_reused for r in second for a in r.answers)
    assert _answers(second) == _answers(first) == _answers(fresh)
    # one more candidate, no new press: every context reused
    more = _store(tmp_path, loaded)
    extra = Candidate("q4_1", CachePolicy.build("q4_1", qblock=8))
    third = _run(loaded, samples, [*CANDIDATES, extra], batch_size=2, contexts=more)
    assert more.reused == n and more.computed == 0
    assert {k: v for k, v in _answers(third).items() if k != "q4_1"} == _answers(fresh)
    # a new press needs its observations: the context is prefilled again, the entry keeps both presses' masks
    knorm = Candidate("knorm", CachePolicy.build("fp32"), press=PressConfig(method="knorm", ratio=0.3))
    newpress = _store(tmp_path, loaded)
    _run(loaded, samples, [*CANDIDATES, knorm], batch_size=2, contexts=newpress)
    assert newpress.computed == n and newpress.reused == 0
    both = _store(tmp_path, loaded)
    _run(loaded, samples, [*CANDIDATES, knorm], batch_size=2, contexts=both)
    _run(loaded, samples, batch_size=2, contexts=both)
    assert both.reused == 2 * n and both.computed == 0


def _corrupt(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        data = data[: len(data) // 3]
    elif how == "flipped":       # a byte of the tensors: the checksum no longer matches
        data[-5] ^= 0xFF
    elif how == "garbage":
        data = bytearray(b"not a safetensors file")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "flipped", "garbage", "swapped"])
def test_a_bad_entry_is_recomputed_not_trusted(loaded, tmp_path, how):
    samples = _samples(loaded)[:2]
    candidates = CANDIDATES[:3] + CANDIDATES[4:5]
    store = _store(tmp_path, loaded)
    before = _run(loaded, samples, candidates, batch_size=1, contexts=store)
    files = sorted((tmp_path / DIRNAME).glob("*.safetensors"))
    assert len(files) == 2
    if how == "swapped":         # a valid entry under another key's name
        files[0].write_bytes(files[1].read_bytes())
    else:
        _corrupt(files[0], how)
    check = _store(tmp_path, loaded)
    after = _run(loaded, samples, candidates, batch_size=1, contexts=check)
    why = {"truncated": "corrupt", "garbage": "corrupt", "flipped": "checksum mismatch", "swapped": "key mismatch"}[how]
    assert check.reused == 1 and check.computed == 1
    assert len(check.bad) == 1 and why in check.bad[0] and files[0].name in check.bad[0]
    assert _answers(after) == _answers(before)
    reread = _store(tmp_path, loaded)      # the entry was rewritten whole
    _run(loaded, samples, candidates, batch_size=1, contexts=reread)
    assert reread.reused == 2 and not reread.bad


def test_the_store_is_bounded_least_recently_used_first(tmp_path):
    store = ContextStore(tmp_path, max_bytes=3 * 4096 + 2048)
    blob = {"x": torch.zeros(1024)}                      # 4 KiB of tensor each
    for i in range(3):
        assert store.save({"i": i}, blob)
        os.utime(store.path_of({"i": i}), (1000 + i, 1000 + i))
    assert store.load({"i": 0}) is not None               # touched: now the most recent
    assert store.save({"i": 3}, blob)
    kept = {i for i in range(4) if store.path_of({"i": i}).exists()}
    assert kept == {0, 2, 3}                               # 1 was the least recently used
    assert not store.save({"big": 1}, {"x": torch.zeros(8192)})   # larger than the bound: not kept
    assert not ContextStore(tmp_path, max_bytes=0).save({"i": 9}, blob)
    tensors, extra = store.load({"i": 3})
    assert torch.equal(tensors["x"], blob["x"]) and extra == {}


def _entries(directory) -> dict:
    """Each entry file's metadata and tensors' bytes (safetensors writes its metadata in any order)."""
    out = {}
    for path in directory.iterdir():
        with safe_open(path, "pt") as f:
            out[path.name] = (f.metadata(), {k: f.get_tensor(k).numpy().tobytes() for k in f.keys()})
    return out


def test_a_background_store_writes_the_entries_a_foreground_one_writes(loaded, tmp_path):
    """The eval's store writes in a thread while the eval goes on: after answer_tasks the same entries
    (metadata and tensors' bytes) and the same answers; the writer's time is counted apart and its thread is gone."""
    samples = _samples(loaded)[:2]
    candidates = CANDIDATES[:3]
    fore, back = _store(tmp_path / "fore", loaded), _store(tmp_path / "back", loaded, background=True)
    first = _run(loaded, samples, candidates, batch_size=1, contexts=fore)
    second = _run(loaded, samples, candidates, batch_size=1, contexts=back)
    files = _entries(tmp_path / "fore" / DIRNAME)
    assert len(files) == 2 and files == _entries(tmp_path / "back" / DIRNAME)
    assert _answers(second) == _answers(first)
    assert back.write_s > 0 and fore.write_s > 0 and back._writer is None and not back._writes
    assert not any(t.name.startswith("caramba-entry-writer") for t in threading.enumerate())
    again = _store(tmp_path / "back", loaded, background=True)
    assert _answers(_run(loaded, samples, candidates, batch_size=1, contexts=again)) == _answers(first)
    assert again.reused == 2 and not again.bad


def test_a_background_store_holds_at_most_its_pending_bytes_and_raises_a_failed_write(tmp_path, monkeypatch):
    from caramba.evaluation import context_store

    written, release = [], threading.Event()
    real = context_store.atomic_write_bytes

    def slow(path, data):
        release.wait(10)
        if b"full" in data[:4096]:   # the header holds the metadata
            raise OSError(28, "No space left on device", str(path))
        real(path, data)
        written.append(path)
    monkeypatch.setattr(context_store, "atomic_write_bytes", slow)
    blob = {"x": torch.zeros(1024)}
    monkeypatch.setattr(context_store, "PENDING_BYTES", 10_000)   # two of these entries (~4.3 kB), not three
    store = ContextStore(tmp_path, background=True)
    assert store.save({"i": 0}, blob) and store.save({"i": 1}, blob)
    assert len(store._writes) == 2 and not written   # both in the writer's hands
    threading.Timer(0.2, release.set).start()
    assert store.save({"i": 2}, blob)          # waited for the oldest before taking a third
    assert written[0] == store.path_of({"i": 0})
    got = store.load({"i": 2})                  # still queued or being written: read once written
    assert got is not None and torch.equal(got[0]["x"], blob["x"])
    assert store.save({"i": 3}, blob, {"note": "full"})   # queued; its write fails in the thread
    with pytest.raises(OSError, match="No space left") as failed:
        store.flush()
    assert failed.value.filename == str(store.path_of({"i": 3}))
    assert store._writer is None and {p.name for p in tmp_path.joinpath(DIRNAME).iterdir()} == {
        store.path_of({"i": i}).name for i in range(3)}


def test_a_bound_smaller_than_one_runs_contexts_is_said_with_a_size_that_fits(loaded, tmp_path):
    """A store that evicts entries of the run that wrote them (a 16-sample frontier writes ~40 GB of
    contexts against the default 4 GiB) says so, with the variable and a size that keeps them."""
    samples = _samples(loaded)[:3]
    small = _store(tmp_path, loaded, max_bytes=200_000, background=True)   # ~1 of these ~0.12-0.15 MB entries
    _run(loaded, samples, CANDIDATES[:2], batch_size=1, contexts=small)
    assert small.computed == 3 and len(small.evicted) == 2 and set(small.evicted) < set(small.computed_keys)
    note = small.bound_note()
    need = int(note.split("CARAMBA_CONTEXT_STORE_MB=")[1].split()[0])
    assert "evicted 2 of the 3 entries" in note and need * 2**20 >= small.written_bytes
    roomy = _store(tmp_path / "roomy", loaded, max_bytes=need * 2**20, background=True)
    _run(loaded, samples, CANDIDATES[:2], batch_size=1, contexts=roomy)
    assert not roomy.evicted and roomy.bound_note() is None
    assert len(list((tmp_path / "roomy" / DIRNAME).glob("*.safetensors"))) == 3


def test_an_entry_larger_than_the_whole_bound_is_said_and_sized(loaded, tmp_path):
    """An entry no bound of this size can keep (over 4 GiB at the default: a batch of long
    contexts) is not written, and the run says so with a size that keeps it."""
    samples = _samples(loaded)[:2]
    tiny = _store(tmp_path, loaded, max_bytes=50_000, background=True)   # below one ~0.12-0.15 MB entry
    _run(loaded, samples, CANDIDATES[:2], batch_size=1, contexts=tiny)
    assert tiny.computed == 2 and len(tiny.too_large) == 2 and not tiny.evicted and tiny.written_bytes == 0
    assert set(tiny.summary()["too_large"]) == set(tiny.computed_keys)
    note = tiny.bound_note()
    assert "did not keep 2 larger than its whole bound" in note and "evicted" not in note, note
    need = int(note.split("CARAMBA_CONTEXT_STORE_MB=")[1].split()[0])
    assert need * 2**20 >= sum(tiny.too_large.values())
    roomy = _store(tmp_path / "roomy", loaded, max_bytes=need * 2**20, background=True)
    _run(loaded, samples, CANDIDATES[:2], batch_size=1, contexts=roomy)
    assert not roomy.too_large and not roomy.evicted and roomy.bound_note() is None
    assert len(list((tmp_path / "roomy" / DIRNAME).glob("*.safetensors"))) == 2


def test_ctrl_c_in_a_writing_block_keeps_the_writes_under_way(tmp_path, monkeypatch):
    from caramba.evaluation import context_store

    real = context_store.atomic_write_bytes

    def slow(path, data):
        time.sleep(0.3)
        real(path, data)
    monkeypatch.setattr(context_store, "atomic_write_bytes", slow)
    store = ContextStore(tmp_path, background=True)
    with pytest.raises(KeyboardInterrupt), store.writing():
        store.save({"i": 0}, {"x": torch.zeros(8)})
        raise KeyboardInterrupt
    assert store.load({"i": 0}) is not None and store._writer is None and store.save_s >= 0.2


def test_a_loaded_entry_is_a_private_copy_and_a_directory_in_its_place_is_unreadable(tmp_path):
    """Entries are mapped, not read into memory: writing to the tensors a load handed out changes
    neither the file nor the next load (copy-on-write). A directory where an entry's file should be
    is an unreadable entry, reported with the OS's reason."""
    store = ContextStore(tmp_path)
    blob = {"x": torch.arange(1024, dtype=torch.float32)}
    assert store.save({"i": 0}, blob)
    path = store.path_of({"i": 0})
    on_disk = path.read_bytes()
    tensors, _ = store.load({"i": 0})
    tensors["x"].fill_(-1.0)
    assert path.read_bytes() == on_disk and torch.equal(store.load({"i": 0})[0]["x"], blob["x"])
    path.unlink()
    path.mkdir()
    assert store.load({"i": 0}) is None
    assert store.bad[-1].startswith(f"{path.name}: unreadable (") and "(None)" not in store.bad[-1]


def test_on_the_torch_path_two_candidates_join(loaded, monkeypatch):
    """Without the fused C step (a GPU, an fp16 model) every candidate steps through the torch
    forward anyway: two are joined, and answer as they do alone."""
    monkeypatch.setattr(loaded.model, "fast_decode", False)
    samples = _samples(loaded)[:3]
    two = [CANDIDATES[2], CANDIDATES[4]]
    alone = _run(loaded, samples, two, batch_size=2, join=False)
    joined = _run(loaded, samples, two, batch_size=2, join=True)
    assert _answers(joined) == _answers(alone)
    assert [r.joined for r in joined] == [2, 2, 2]


def test_few_candidates_step_alone_through_the_c_step(loaded, monkeypatch):
    from caramba.evaluation import task_eval
    from caramba.model import fast_decode
    from caramba.model.backend import choose

    if choose(loaded.model).name != "c":
        pytest.skip("no fused C step here")
    samples = _samples(loaded)[:3]
    # of 3 rows a cache (up to JOIN_MEAN_ROWS) the joined C step takes them: two candidates and the baseline join
    results = _run(loaded, samples, CANDIDATES[1:3], batch_size=3)
    assert [r.joined for r in results] == [1, 1, 1]
    # past JOIN_MEAN_ROWS the torch forward would join three caches, so each steps alone (JOIN_MIN_C)
    for module in (task_eval, fast_decode):
        monkeypatch.setattr(module, "JOIN_MEAN_ROWS", 2)
    results = _run(loaded, samples, CANDIDATES[1:3], batch_size=3)
    assert [r.joined for r in results] == [0, 0, 0]
    results = _run(loaded, samples[:2], CANDIDATES[1:3], batch_size=2)
    assert [r.joined for r in results] == [1, 1, 1]


@torch.inference_mode()
def test_the_c_step_takes_its_caches_of_a_join_and_the_torch_forward_the_rest(loaded, monkeypatch):
    """Two left-padded rows whose first tokens lie 3 slots apart: a per-channel cache (groups of 8)
    groups them from different slots, which the C step refuses (an eval's batches keep such rows
    apart: task_eval._batches; here they are joined on purpose). Only that cache steps through the
    torch forward, the q8_0 cache beside it in the C step, and each state's logits are its own step's."""
    from caramba.evaluation import joined
    from caramba.evaluation.joined import step_together
    from caramba.infer.state import DecodeState
    from caramba.model.backend import choose

    model = loaded.model
    if choose(model).name != "c":
        pytest.skip("no fused C step here")
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, :3] = False

    def states() -> list[DecodeState]:
        out = []
        for policy in (CachePolicy.build("q8_0", qblock=8), CachePolicy.build(policy={"k": "q4_1c", "v": "q4_1"},
                                                                               qblock=8)):
            state = DecodeState(model, model.new_cache(2, 64, policy), backend=choose(model))
            state.cache.set_origins(torch.tensor([0, 3]))     # as the eval's shared context sets them
            state.prefill(ids, mask)
            out.append(state)
        return out

    refused, real = [], joined._torch_join
    monkeypatch.setattr(joined, "_torch_join", lambda model, calls: refused.append(len(calls)) or real(model, calls))
    alone, together = states(), states()
    tokens = [torch.tensor([5, 7])] * 2
    for _ in range(3):
        want = [s.step(t) for s, t in zip(alone, tokens)]
        got = step_together(model, together, tokens, [None, None])
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
        tokens = [w.argmax(-1) for w in want]
    assert refused == [1, 1, 1]          # the per-channel cache each step, never both
    assert together[0].backend.steps["c"] >= 3


@pytest.mark.parametrize("hybrid", [False, True])
@torch.inference_mode()
def test_a_joined_step_is_each_states_own_step(hybrid):
    """step_together and prefill_together against each state fed alone through the torch path:
    left-padded rows, caches of different kinds (quantized, rotated, pressed), a hybrid model's
    rings; the same logits up to rounding, every state's bookkeeping the same."""
    from caramba.evaluation.joined import prefill_together, step_together
    from caramba.infer.pressing import prefill_pressed
    from caramba.infer.state import DecodeState
    from caramba.model.backend import TorchStep
    from caramba.model.transformer import Transformer
    from conftest import init_weights_, tiny_config

    extra = dict(n_layers=4, sliding_window=8, layer_types=["sliding", "sliding", "full", "sliding"],
                 rope_local_theta=100.0) if hybrid else {}
    model = init_weights_(Transformer(tiny_config(**extra)), seed=1).eval()
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 24, dtype=torch.bool)
    mask[1, :5] = False
    policies = [CachePolicy.build("fp32"), CachePolicy.build("q8_0", qblock=8),
                CachePolicy.build("q4_0", qblock=8, rotate_keys=True)]

    def states():
        out = []
        for i, policy in enumerate(policies + ([] if hybrid else [policies[0]])):
            s = DecodeState(model, model.new_cache(2, 40, policy), backend=TorchStep(model))
            if i == 3:   # a pressed cache (rows keep different counts: packed)
                prefill_pressed(s, ids[:, :20], mask[:, :20], PressConfig(method="knorm", ratio=0.5))
            else:
                s.prefill(ids[:, :20], mask[:, :20])
            out.append(s)
        return out

    alone, joined = states(), states()
    question = ids[:, 20:]
    want = [s.prefill(question) for s in alone]
    got = prefill_together(model, joined, question, None)
    for _ in range(3):
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
            assert torch.equal(g.argmax(-1), w.argmax(-1))
        tokens = [w.argmax(-1) for w in want]
        active = torch.tensor([True, False])
        want = [s.step(t, active) for s, t in zip(alone, tokens)]
        got = step_together(model, joined, tokens, [active] * len(joined))
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    for a, j in zip(alone, joined):
        assert a.cache.length == j.cache.length and torch.equal(a.next_pos, j.next_pos)
        assert (a.slot_mask is None) == (j.slot_mask is None)
        if a.slot_mask is not None:
            assert torch.equal(a.slot_mask, j.slot_mask)


@pytest.mark.parametrize("kind", ["softcap", "decoupled"])
def test_a_model_that_cannot_join_answers_one_candidate_at_a_time(loaded, tmp_path, kind):
    """Gemma 2's soft-capped scores and a decoupled (DBA) model's three streams cannot sit side by
    side in a joined step: every candidate answers alone, as with join=False; a decoupled model
    prefills its own contexts, so the context store keeps nothing."""
    import dataclasses

    from caramba.model.transformer import Transformer
    from conftest import init_weights_

    cfg = loaded.model.config
    head = cfg.head_dim if hasattr(cfg, "head_dim") else cfg.dim // cfg.n_heads
    change = dict(attn_softcap=30.0) if kind == "softcap" else dict(attention="decoupled", sem_dim=head // 2,
                                                                     geo_dim=head // 2)
    model = init_weights_(Transformer(dataclasses.replace(cfg, **change)), seed=3).eval().requires_grad_(False)
    samples = _samples(loaded)[:3]
    candidates = [c for c in CANDIDATES if c.label in ("fp32", "q8", "q4", "snap" if kind == "softcap" else "q4r")]
    kw = dict(eos_ids=_eos(loaded), batch_size=2)
    alone, _ = answer_tasks(model, loaded.tokenizer, samples, candidates, BASELINE, join=False, **kw)
    store = ContextStore(tmp_path, model=model_identity(model, "random"))
    joined, _ = answer_tasks(model, loaded.tokenizer, samples, candidates, BASELINE, join=True, contexts=store, **kw)
    assert _answers(joined) == _answers(alone) and all(r.joined == 0 for r in joined)
    stored = list((tmp_path / DIRNAME).glob("*.safetensors"))
    assert (len(stored), store.computed) == ((0, 0) if kind == "decoupled" else (2, 2))
