"""The cache autotune on a tiny model: bytes equal allocations, the budget filter's edges,
fail-closed gates, plan reuse and probe expiry, concurrent plan writers, a corrupt plan file."""

from __future__ import annotations

import json
import multiprocessing
import time

import pytest

import caramba.autotune.gates as gates_module
import caramba.autotune.select as select_module
from caramba.autotune import (AutotuneSettings, GateSettings, NoCandidateError, PlanStore, autotune, cache_nbytes,
                              default_candidates, policy_from_dict)
from caramba.autotune.plans import is_stale
from caramba.errors import UserError
from caramba.model.zoo import load_model
from test_cli import write_tiny_model

MIB = 2**20
# Small enough to be fast, long enough to mean something on a byte-level tokenizer.
FAST_GATES = GateSettings(cache_quality_prompt_len=24, cache_quality_decode_steps=6, cache_quality_needle_len=192)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")))


def settings(budget_mb: float, **kw) -> AutotuneSettings:
    return AutotuneSettings(budget_mb=budget_mb, max_seq_len=kw.pop("max_seq_len", 48), gates=kw.pop("gates", FAST_GATES),
                            speed_steps=2, **kw)


def by_name(result) -> dict[str, dict]:
    return {c["name"]: c for c in result.candidates}


def test_candidate_bytes_equal_what_new_cache_allocates(loaded):
    model = loaded.model
    candidates = default_candidates(model)
    assert candidates[0].baseline and candidates[0].name == "fp32"
    names = [c.name for c in candidates]
    assert {"fp16", "q8_0", "q4_0", "nf4 rotate_keys", "k=q8_0,v=q4_0", "q4_0 residual_len=128 rotate_keys",
            "q4_0l", "k=q4_1c,v=q4_1", "k=q2_1c,v=q2_1 residual_len=128"} <= set(names)
    assert len(set(names)) == len(names)
    for c in candidates:
        for batch, length in ((1, 7), (3, 130)):
            assert cache_nbytes(model, batch, length, c.policy) == model.new_cache(batch, length, c.policy).nbytes, c.name


def test_policy_round_trips_through_its_dict(loaded):
    for c in default_candidates(loaded.model):
        assert policy_from_dict(c.policy.to_dict()) == c.policy


def test_exactly_at_budget_fits_and_one_byte_under_does_not(loaded, tmp_path):
    fp32 = cache_nbytes(loaded.model, 1, 48, default_candidates(loaded.model)[0].policy)
    at = autotune(loaded, settings(fp32 / MIB), plan_path=tmp_path / "p.json")
    assert by_name(at)["fp32"]["fits"] and by_name(at)["fp32"]["verdict"] in ("chosen", "passed")
    under = autotune(loaded, settings((fp32 - 1) / MIB), plan_path=tmp_path / "p.json")
    assert not by_name(under)["fp32"]["fits"] and by_name(under)["fp32"]["verdict"] == "over budget"
    assert by_name(under)["fp16"]["fits"]


def test_nothing_fits_names_the_smallest_size_and_what_to_change(loaded, tmp_path):
    smallest = min(cache_nbytes(loaded.model, 2, 48, c.policy) for c in default_candidates(loaded.model))
    with pytest.raises(NoCandidateError) as e:
        autotune(loaded, settings((smallest - 1) / MIB, batch_size=2), plan_path=tmp_path / "p.json")
    message = str(e.value)
    assert isinstance(e.value, UserError) and e.value.exit_code == 2
    assert f"needs {smallest} bytes" in message
    assert "max_seq_len to 47 or less" in message and "batch_size to 1 or less" in message and "--budget-mb" in message
    assert all(not c["fits"] for c in e.value.result.candidates)
    assert not (tmp_path / "p.json").exists()   # nothing stored


def test_impossible_thresholds_fail_every_candidate_closed(loaded, tmp_path):
    gates = GateSettings(**{**FAST_GATES.to_dict(), "cache_quality_max_mean_kl": 0.0})   # only exact caches pass
    fp32 = cache_nbytes(loaded.model, 1, 48, default_candidates(loaded.model)[0].policy)
    with pytest.raises(NoCandidateError, match="no candidate within the budget passes the quality gates"):
        autotune(loaded, settings((fp32 - 1) / MIB, gates=gates), plan_path=tmp_path / "p.json")
    result = autotune(loaded, settings(fp32 / MIB, gates=gates), plan_path=tmp_path / "p.json")
    assert result.chosen["name"] == "fp32"   # the reference is the only one left
    gated = [c for c in result.candidates[1:] if c["fits"]]
    assert len(gated) >= 6
    for c in gated:
        assert c["verdict"] == "failed gates" and any("mean KL" in why and "> 0" in why for why in c["why"]), c


def test_a_gate_that_raises_fails_only_its_candidate_with_the_reason(loaded, tmp_path, monkeypatch):
    real = gates_module.evaluate_cache

    def broken(model, ids, candidates, *args, **kwargs):
        if any(p.describe() == "q8_0" for p in candidates):
            raise RuntimeError("kernel exploded")
        return real(model, ids, candidates, *args, **kwargs)

    monkeypatch.setattr(gates_module, "evaluate_cache", broken)
    result = by_name(autotune(loaded, settings(1.0), plan_path=tmp_path / "p.json"))
    assert result["q8_0"]["verdict"] == "failed gates"
    assert result["q8_0"]["why"] == ["text scoring gate error: RuntimeError: kernel exploded"]
    assert result["fp16"]["gates"]["dnll"] is not None and result["fp16"]["gates"]["kl_mean"] < 1e-3


def test_a_decode_that_raises_fails_only_its_candidate(loaded, tmp_path, monkeypatch):
    import caramba.autotune.speed as speed_module

    real = speed_module._filled

    def broken(model, policy, *args):
        if policy.describe() == "q8_0":
            raise RuntimeError("no decode today")
        return real(model, policy, *args)

    monkeypatch.setattr(speed_module, "_filled", broken)
    result = autotune(loaded, settings(1.0), plan_path=tmp_path / "p.json")
    q8 = by_name(result)["q8_0"]
    assert q8["verdict"] == "failed speed" and q8["why"] == ["speed error: RuntimeError: no decode today"]
    assert result.chosen["name"] != "q8_0" and result.chosen["speed"]["error"] is None


def test_speed_pick_is_the_fastest_passing_and_ties_go_to_fewer_bytes(loaded, tmp_path):
    result = autotune(loaded, settings(1.0), plan_path=tmp_path / "p.json")
    timed = [c for c in result.candidates if c["speed"] is not None]
    assert all(c["verdict"] in ("passed", "chosen") for c in timed)
    assert all(len(c["speed"]["samples"]) == 3 and c["speed"]["context"] == 46 for c in timed)
    fastest = max(c["speed"]["decode_tok_s"] for c in timed)
    tied = [c for c in timed if c["speed"]["decode_tok_s"] >= fastest * 0.97]
    assert result.chosen["bytes"] == min(c["bytes"] for c in tied)
    assert result.chosen_policy() == policy_from_dict(result.chosen["policy"])


def test_plan_is_reused_and_probed_when_stale(loaded, tmp_path, monkeypatch):
    path = tmp_path / "plans.json"
    first = autotune(loaded, settings(1.0), plan_path=path)
    assert first.status == "measured"
    monkeypatch.setattr(select_module, "_measure", lambda *a, **k: pytest.fail("a fresh plan must be reused"))
    again = autotune(loaded, settings(1.0), plan_path=path)
    assert again.status == "reused" and again.chosen == first.chosen and again.key_id == first.key_id
    # Age the plan past the probe interval: probing re-measures, probe off keeps it.
    data = json.loads(path.read_text())
    data["plans"][first.key_id]["created_unix"] -= 7200
    path.write_text(json.dumps(data))
    assert autotune(loaded, settings(1.0, cache_plan_probe=False), plan_path=path).status == "reused"
    monkeypatch.undo()
    probed = autotune(loaded, settings(1.0, cache_plan_probe_interval_sec=3600), plan_path=path)
    assert probed.status == "probed"
    assert time.time() - json.loads(path.read_text())["plans"][first.key_id]["created_unix"] < 60
    assert autotune(loaded, settings(1.0), plan_path=path, force=True).status == "forced"
    other = autotune(loaded, settings(2.0), plan_path=path)   # another budget: another key
    assert other.key_id != first.key_id and len(PlanStore(path).all()) == 2


def test_is_stale():
    entry = {"created_unix": 1000.0}
    assert is_stale(entry, True, 60, now=1061) and not is_stale(entry, True, 60, now=1059)
    assert not is_stale(entry, False, 60, now=10**9)


def _writer(path: str, tag: str, n: int) -> None:
    store = PlanStore(path)
    for i in range(n):
        store.put({"writer": tag, "i": i}, {"chosen": {"name": f"{tag}{i}"}, "candidates": []})


def test_two_processes_writing_at_once_keep_every_entry(tmp_path):
    path = str(tmp_path / "plans.json")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(path, tag, 15)) for tag in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    names = sorted(p["chosen"]["name"] for p in PlanStore(path).all().values())
    assert names == sorted([f"a{i}" for i in range(15)] + [f"b{i}" for i in range(15)])


@pytest.mark.parametrize("content", ["{not json", "[]", '{"version": 1, "plans": {"x": {"no": "chosen"}}}'])
def test_a_corrupt_plan_file_is_moved_aside_and_reported(tmp_path, content, monkeypatch):
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path))   # caramba's own territory: a damaged store is set aside
    path = tmp_path / "plans.json"
    path.write_text(content)
    notices: list[str] = []
    store = PlanStore(path, notice=notices.append)
    store.put({"k": 1}, {"chosen": {"name": "q8_0"}, "candidates": []})
    aside = list(tmp_path.glob("plans.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_text() == content
    assert len(notices) == 1 and "corrupt" in notices[0] and str(aside[0]) in notices[0]
    assert [p["chosen"]["name"] for p in store.all().values()] == ["q8_0"]


def test_remove_plans(tmp_path):
    store = PlanStore(tmp_path / "plans.json")
    a = store.put({"k": 1}, {"chosen": {"name": "a"}, "candidates": []})
    store.put({"k": 2}, {"chosen": {"name": "b"}, "candidates": []})
    from caramba.autotune.plans import key_id

    assert store.remove([key_id(a["key"])[:6]]) == [key_id(a["key"])]
    assert len(store.all()) == 1 and store.remove() and store.all() == {}


def test_gate_text_too_short_is_a_user_error(loaded, tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("only a few words")
    with pytest.raises(UserError, match="quality gates: the gate text has"):
        autotune(loaded, settings(1.0), text_path=text, plan_path=tmp_path / "p.json")


def test_schema_defaults_match_the_engine():
    from caramba.manifest.schema import CacheAutotuneSettings

    section = CacheAutotuneSettings(budget_mb=1)
    for name, value in GateSettings().to_dict().items():
        assert getattr(section, name) == value, name
    engine = AutotuneSettings(budget_mb=1)
    assert (section.max_seq_len, section.batch_size, section.speed_steps, section.speed_repeats, section.cache_plan_probe,
            section.cache_plan_probe_interval_sec) == (engine.max_seq_len, engine.batch_size, engine.speed_steps,
                                                       engine.speed_repeats, engine.cache_plan_probe,
                                                       engine.cache_plan_probe_interval_sec)


def test_haystack_plants_the_needle_at_its_depth_and_ends_with_the_question(loaded):
    from caramba.autotune.needle import build_haystack

    tok = loaded.tokenizer
    text_ids = tok.encode("Plain filler text about nothing in particular. " * 20, add_special_tokens=False)
    h = build_haystack(tok, text_ids, 400, depth=0.5)
    assert len(h.ids) == 400 and h.answer_len == len(f" {h.code}")   # byte-level: one token per byte
    text = tok.decode(h.ids)
    needle = f" The secret code is {h.code}. Remember it: the secret code is {h.code}. "
    question = "\n\nQuestion: what is the secret code?\nAnswer: the secret code is"
    assert text.index(needle) == h.depth_tokens == (400 - len(needle) - len(question)) // 2   # the middle of the filler
    assert text.endswith("Answer: the secret code is")
    with pytest.raises(ValueError, match="too short"):
        build_haystack(tok, text_ids, 50)


# ---- presses as candidates (cache_auto_presses) -------------------------------------------------

PRESSES = ("knorm@0.5", "streaming_llm@0/4:16")


def test_press_candidates_are_gated_timed_and_sized_by_what_they_keep(loaded, tmp_path):
    from caramba.autotune.candidates import PRESSED_KINDS, kept_slots
    from caramba.press import PressConfig

    plain = autotune(loaded, settings(1.0), plan_path=tmp_path / "p.json")
    result = autotune(loaded, settings(1.0, presses=PRESSES), plan_path=tmp_path / "p.json")
    assert result.key_id != plain.key_id   # the candidates are part of the key: plans without presses stay
    assert [c["name"] for c in result.candidates[:len(plain.candidates)]] == [c["name"] for c in plain.candidates]
    pressed = [c for c in result.candidates if c.get("press")]
    assert len(pressed) == len(PRESSES) * (1 + len(PRESSED_KINDS))
    assert {c["name"] for c in pressed} >= {"fp32+knorm@0.5", "q8_0+knorm@0.5", "fp32+streaming_llm@0/4:16"}
    for c in pressed:
        press, policy = PressConfig.parse(c["press"]), policy_from_dict(c["policy"])
        assert c["name"] == f"{policy.describe()}+{c['press']}"
        assert c["bytes"] == cache_nbytes(loaded.model, 1, 48, policy)   # allocated before the press: the budget
        assert c["kept_bytes"] == cache_nbytes(loaded.model, 1, kept_slots(press, 48), policy) < c["bytes"]
        assert c["gates"] is not None and c["gates"]["dnll"] is not None, c   # the gates ran on the pressed cache
        if c["verdict"] in ("passed", "chosen"):
            assert c["speed"]["decode_tok_s"] > 0 and c["speed"]["error"] is None
    assert kept_slots(PressConfig.parse("knorm@0.5"), 48) == 24
    assert kept_slots(PressConfig.parse("streaming_llm@0/4:16"), 48) == 20


def test_the_pressed_text_gate_scores_the_masked_full_cache(loaded):
    """evaluate_cache with a press against a reference: the whole fp32 cache, the first scored
    token from the whole prompt, then the press's dropped slots hidden (knorm from the keys)."""
    import torch
    import torch.nn.functional as F

    from caramba.evaluation.evaluate import corpus_ids, evaluate_cache
    from caramba.infer.state import DecodeState
    from caramba.press import PressConfig
    from test_evict import MaskedLayer

    model = loaded.model
    ids = corpus_ids(loaded.tokenizer)[:40]
    P = 30
    [got] = evaluate_cache(model, ids, ["fp32"], "fp32", prompt_len=P, presses=[PressConfig(method="knorm", ratio=0.5)])
    tokens = torch.tensor([ids])
    state = DecodeState(model, model.new_cache(1, len(ids), "fp32"))
    base = DecodeState(model, model.new_cache(1, len(ids), "fp32"))
    logits, want = [state.prefill(tokens[:, :P])], [base.prefill(tokens[:, :P])]
    for layer in state.cache.layers:
        norms = layer.contents(P)[0].norm(dim=-1)                    # [1, KVH, P]
        kept = torch.zeros_like(norms, dtype=torch.bool).scatter_(-1, (-norms).topk(P // 2, dim=-1).indices, True)
        layer.__class__, layer.hidden = MaskedLayer, ~kept
    for t in range(P, len(ids) - 1):
        logits.append(state.step(tokens[:, t]))
        want.append(base.step(tokens[:, t]))
    lp = [F.log_softmax(x.float(), -1) for x in logits]
    bp = [F.log_softmax(x.float(), -1) for x in want]
    targets = tokens[0, P:]
    nll = -torch.stack([p[0, t] for p, t in zip(lp, targets)]).double().mean()
    kl = torch.stack([(b.exp() * (b - p)).sum() for p, b in zip(lp, bp)]).double()
    assert got.n_scored == len(ids) - P
    assert got.nll == pytest.approx(float(nll), rel=1e-5)
    assert got.kl_mean == pytest.approx(float(kl.mean()), rel=1e-4, abs=1e-7)   # fp32 sums in another order
    assert got.kl_mean > 0                                                      # the press changed the logits


def test_a_press_the_plan_chose_reaches_cache_kind_auto(loaded, tmp_path, monkeypatch):
    """With every gate passed and no timing, the fewest kept bytes win (a press on 4-bit values);
    the plan names the press and a Generator with cache_kind auto decodes with it."""
    import torch

    from caramba.autotune.gates import GateResult
    from caramba.infer import GenerateConfig, Generator

    def all_pass(model, tokenizer, ids, candidates, *args, **kwargs):
        return {c.name: GateResult(dnll=0.0, passed=True) for c in candidates}, {}

    monkeypatch.setattr(select_module, "run_gates", all_pass)
    plans = tmp_path / "p.json"
    config = GenerateConfig(cache_kind="auto", cache_budget_mb=1.0, max_seq_len=48, cache_auto_presses=["knorm@0.75"],
                            cache_auto_benchmark=False, cache_plan_path=str(plans), max_new_tokens=4, temperature=0.0)
    gen = Generator(loaded.model, config, tokenizer=loaded.tokenizer)
    ids = torch.arange(1, 33)[None]
    gen.generate(ids)
    plan = json.loads(plans.read_text())["plans"][gen.cache_auto["plan_key_id"]]
    assert plan["chosen"]["press"] == "knorm@0.75" == gen.cache_auto["press"]
    assert plan["chosen"]["name"] == gen.cache_auto["resolved"] == "k=q8_0,v=q4_0 rotate_keys+knorm@0.75"
    assert gen.config.cache.press.describe() == "knorm@0.75" and not gen.config.cache.is_auto
    assert gen.state.kept_share == pytest.approx(8 / 32)                # n_kept(32, 0.75) of the 32-token prompt
    with pytest.raises(ValueError, match="cache_auto_presses"):
        GenerateConfig(cache_kind="auto", cache_auto_presses=["knorm@0.5"], press="snapkv")
    with pytest.raises(ValueError, match="cache_auto_presses"):
        GenerateConfig(cache_kind="auto", cache_auto_presses=["snap"])
