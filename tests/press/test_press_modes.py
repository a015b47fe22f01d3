"""Presses through every path that takes them: the library's Generator (torch path and C step),
speculative decoding, eval candidates (shared and own prefill), decode-bench's presses axis, and
the settings' errors (exit 2, naming the field)."""

from __future__ import annotations

import json

import pytest
import torch

from caramba.infer import GenerateConfig, Generator, SpeculativeConfig
from caramba.infer.speculative import SpeculativeGenerator
from caramba.infer.state import DecodeState
from caramba.evaluation.task_eval import Candidate, answer_tasks
from caramba.evaluation import tasks as task_suite
from caramba.cache import CachePolicy
from caramba.model import fast_decode
from caramba.options import OptionError
from caramba.infer.pressing import press_masks
from caramba.press import PressConfig
from conftest import make_model
from test_cli import invoke
from test_eval import LENGTH, eval_manifest, loaded, long_tiny  # noqa: F401 (fixtures)
from test_evict import decode, reference_state

PROMPT = 40
SNAP = dict(press="snapkv", press_ratio=0.5, press_window=8)


@pytest.fixture
def model():
    m = make_model(seed=5, n_layers=3, n_heads=4, n_kv_heads=2)
    m.fast_decode = False
    return m


def prompt(model, n=PROMPT, seed=0):
    return torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("press", [dict(SNAP), dict(press="pyramidkv", press_ratio=0.5, press_window=8),
                                   dict(SNAP, press_adaptive=True), dict(press="expected_attention", press_ratio=0.7),
                                   dict(press="streaming_llm", press_ratio=0.25)])
def test_generator_decodes_as_the_full_cache_with_the_pressed_slots_hidden(model, press):
    """The first token comes from the whole context, later ones see the survivors: exactly the
    full cache decoding with the press's dropped slots masked out."""
    ids = prompt(model)
    config = GenerateConfig(max_new_tokens=8, temperature=0.0, max_seq_len=64, **press)
    gen = Generator(model, config)
    got = gen.generate(ids)[0, PROMPT:]
    kept = press_masks(model, ids, config.cache.press)
    state = DecodeState(model, model.new_cache(1, 64, "fp32"))
    first = state.prefill(ids).argmax(-1)
    ref = reference_state(model, state, kept)
    _, want = decode(ref, first, 7)
    assert got.tolist() == [int(first)] + want[0].tolist()
    assert gen.state.kept_share == pytest.approx(sum(int(k.sum()) for k in kept) / (PROMPT * 3 * 2))


def test_generator_press_on_the_c_step_equals_the_torch_path(model):
    if fast_decode.library() is None:
        pytest.skip(f"decode step kernel {fast_decode.status()}")
    ids = torch.cat([prompt(model, seed=1), prompt(model, seed=2)])
    outs, steps = {}, {}
    for fast in (True, False):
        model.fast_decode = fast
        calls = []
        real = fast_decode.step
        fast_decode.step = lambda *a, **k: calls.append(1) or real(*a, **k)
        try:
            outs[fast] = Generator(model, GenerateConfig(max_new_tokens=12, temperature=0.0, max_seq_len=64,
                                                         cache_kind="q8_0", **SNAP)).generate(ids)
        finally:
            fast_decode.step = real
        steps[fast] = len(calls)
    assert steps[True] >= 11 and steps[False] == 0
    assert torch.equal(outs[True], outs[False])


@pytest.mark.parametrize("press", [SNAP, dict(SNAP, press_adaptive=True), dict(press="knorm", press_ratio=0.5)])
def test_speculative_decoding_with_a_press_is_lossless_against_pressed_greedy(model, press):
    """Rejected drafts roll back by tokens while the cache holds survivors: rows of different
    lengths, uniform and per-head budgets, the same tokens as pressed greedy decoding."""
    base = prompt(model, seed=3)[0, :20].tolist()
    rows = [base * 2, (base[:14] * 3)[:36]]                     # repeats: prompt lookup finds drafts
    config = dict(max_new_tokens=12, temperature=0.0, max_seq_len=128, **press)   # room for holes
    plain = Generator(model, GenerateConfig(**config)).run(rows).sequences
    spec = SpeculativeGenerator(model, None, SpeculativeConfig(draft="prompt_lookup", **config))
    result = spec.run(rows)
    assert result.sequences == plain
    assert result.stats.proposed > result.stats.accepted         # drafts were rejected: rollbacks ran


@pytest.mark.parametrize("press", [dict(press="pyramidkv", press_ratio=0.5, press_window=8),
                                   dict(SNAP, press_adaptive=True), SNAP])
@pytest.mark.parametrize("kind", ["fp32", "q4_0"])
def test_ragged_presses_on_the_c_step_equal_the_torch_path(model, press, kind, taken):
    """Per-layer (PyramidKV) and per-head (AdaKV) budgets give each layer its own width, and a
    uniform press on rows of different lengths packs its rows (no holes in front of the shorter
    one): on the C step, greedy generation of a 2-row batch and speculative decoding (rollbacks
    after the press) give the torch path's tokens, and the C step ran."""
    if fast_decode.library() is None:
        pytest.skip(f"decode step kernel {fast_decode.status()}")
    calls = taken
    base = prompt(model, seed=3)[0, :20].tolist()
    rows = [base * 2, (base[:14] * 3)[:36]]                     # repeats: prompt lookup finds drafts
    config = dict(max_new_tokens=12, temperature=0.0, max_seq_len=128, cache_kind=kind, **press)
    out, steps = {}, {}
    for fast in (False, True):
        model.fast_decode = fast
        n = len(calls)
        gen = Generator(model, GenerateConfig(**config))
        plain = gen.run(rows).sequences
        assert type(gen.cache).__name__ == "PressedKVCache"
        spec = SpeculativeGenerator(model, None, SpeculativeConfig(draft="prompt_lookup", **config))
        result = spec.run(rows)
        assert result.stats.proposed > result.stats.accepted     # drafts were rejected: rollbacks ran
        out[fast], steps[fast] = (plain, result.sequences), len(calls) - n
    assert steps[False] == 0 and steps[True] >= 11 + 3           # every greedy step, and some verifies
    assert out[True] == out[False]
    assert out[True][0] == out[True][1]                          # speculative: lossless against greedy


def test_press_settings_are_checked_where_they_are_set():
    with pytest.raises(OptionError, match="press"):
        GenerateConfig(press="snap")
    with pytest.raises(OptionError, match="press_ratio"):
        GenerateConfig(press="knorm", press_ratio=1.0)
    with pytest.raises(OptionError, match="press_kernel"):
        GenerateConfig(press="snapkv", press_kernel=4)
    with pytest.raises(ValueError, match="beam"):
        GenerateConfig(press="knorm", num_beams=2)
    with pytest.raises(ValueError, match="decode_local_window"):
        GenerateConfig(press="knorm", decode_local_window=16)
    assert PressConfig.parse("ada_snapkv@0.25") == PressConfig(method="snapkv", ratio=0.25, adaptive=True)
    assert PressConfig.parse(PressConfig(method="tova", ratio=0.5).describe()).method == "tova"
    assert not PressConfig.parse("none").active
    with pytest.raises(ValueError, match="METHOD@RATIO"):
        PressConfig.parse("snapkv")


def test_eval_press_shared_equals_own_for_full_precision_candidates(loaded):
    """A fp32 candidate pressed from the shared context is the same cache as one that prefilled
    and pressed the context itself: the same answers, token for token."""
    model, tok = loaded.model, loaded.tokenizer
    samples = task_suite.make_samples("niah_single", LENGTH, 2, 0, tok, chat=False)
    press = PressConfig(method="snapkv", ratio=0.5, window_size=16)
    cand = [Candidate("snap", CachePolicy.build("fp32"), None, press)]
    runs = {}
    for prefill in ("shared", "own"):
        results, _ = answer_tasks(model, tok, samples, cand, Candidate("fp32", CachePolicy.build("fp32")),
                                  prefill=prefill, q_chunk=256, batch_size=2)
        runs[prefill] = results
    assert [a.output_ids for a in runs["shared"][0].answers] == [a.output_ids for a in runs["own"][0].answers]
    assert runs["shared"][0].kept_fraction() == pytest.approx(0.5, abs=0.01)


PRESSED = f"""\
          candidates: [{{cache_kind: q8_0, qblock: 8, press: snapkv, press_ratio: 0.5, press_window: 16}},
                       {{cache_kind: fp32, press: streaming_llm, press_ratio: 0.75, name: stream}}]
          tasks: {{names: [niah_single], lengths: [{LENGTH}], samples: 2}}
"""


def test_eval_run_with_pressed_candidates_records_what_they_kept(tmp_path, monkeypatch, long_tiny):  # noqa: F811
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    r = invoke("run", eval_manifest(tmp_path, long_tiny, PRESSED))
    assert r.exit_code == 0, r.output
    result = json.loads((tmp_path / "runs" / "ev" / "t" / "kv" / "result.json").read_text())
    by = {c["label"]: c for c in result["candidates"]}
    assert set(by) == {"q8_0_qblock_8_snapkv_0_5", "stream", "fp32"}
    snap, stream, fp32 = by["q8_0_qblock_8_snapkv_0_5"], by["stream"], by["fp32"]
    assert snap["press"] == "snapkv@0.5" and snap["kept_fraction"] == pytest.approx(0.5, abs=0.01)
    assert stream["kept_fraction"] == pytest.approx(0.25, abs=0.01)
    assert stream["bytes_per_token"] == pytest.approx(fp32["bytes_per_token"] * stream["kept_fraction"], rel=0.01)
    assert fp32["press"] is None and "kept_fraction" not in fp32


@pytest.mark.parametrize("section, message", [
    ("          candidates: [{cache_kind: q8_0, press: snap}]\n          tasks: {}\n", "press"),
    ("          candidates: [{cache_kind: q8_0, press: knorm}]\n          perplexity: {}\n", "tasks only"),
    ("          candidates: [{cache_kind: q8_0}]\n          baseline: {press: knorm}\n          tasks: {}\n",
     "takes no press"),
    ("          candidates: [{cache_kind: q8_0, press: snapkv, press_window: 4000}]\n"
     f"          tasks: {{names: [niah_single], lengths: [{LENGTH}]}}\n", "press_window"),
])
def test_bad_press_settings_exit_2_before_anything_runs(tmp_path, monkeypatch, long_tiny, section, message):  # noqa: F811
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    r = invoke("run", eval_manifest(tmp_path, long_tiny, section))
    assert r.exit_code == 2 and message in r.output, r.output
    assert "Traceback" not in r.output and not (tmp_path / "runs" / "ev").exists()


def test_decode_bench_presses_axis_measures_the_pressed_cache(tmp_path, monkeypatch, long_tiny):  # noqa: F811
    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    r = invoke("bench", "--model", long_tiny, "--prompt-lens", "64", "--cache-kinds", "fp32",
               "--presses", "none,knorm@0.5", "--new-tokens", "3", "--warmup", "0", "--repeats", "1", "--json")
    assert r.exit_code == 0, r.output
    cells = {c["press"]: c for c in json.loads(r.stdout[r.stdout.index("["):])}
    assert set(cells) == {"none", "knorm@0.5"}
    # 64 prompt + 3 new slots whole, against 32 survivors + 3
    assert cells["knorm@0.5"]["cache_bytes"] * 67 == cells["none"]["cache_bytes"] * 35
    bad = invoke("bench", "--model", long_tiny, "--presses", "knorm", "--prompt-lens", "64")
    assert bad.exit_code == 2 and "METHOD@RATIO" in bad.output and "Traceback" not in bad.output
