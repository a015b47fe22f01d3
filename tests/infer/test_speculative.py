"""Speculative decoding on tiny models: lossless against plain decoding, caches, stats, k rules."""

from __future__ import annotations

import itertools
import json
import re

import pytest
import torch

from caramba.cache import KVCacheKind
from caramba.infer import GenerateConfig, Generator
from caramba.infer.drafts import PromptLookupDraft, int8_self_draft, layer_skip_draft, lookup
from caramba.infer.sampling import SamplingParams, process_logits
from caramba.infer.speculative import SPEC_PROBE_INTERVAL, SpeculativeConfig, SpeculativeGenerator
import tolerance as tol
from conftest import make_model

N = 40


@pytest.fixture(scope="module")
def target():
    return make_model(seed=0, n_layers=4)


@pytest.fixture(scope="module")
def repetitive():
    """Small weights: greedy output settles into repeats, so prompt lookup gets accepted."""
    return make_model(seed=0, n_layers=4, std=0.08)


@pytest.fixture(scope="module")
def ragged():
    g = torch.Generator().manual_seed(1234)
    rows = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (5, 9, 2)]
    return [r + r for r in rows]  # repeated, so prompt lookup finds matches


def plain(model, prompts, **kw):
    return Generator(model, GenerateConfig(**{"max_new_tokens": N, "temperature": 0.0, **kw})).run(prompts)


def speculative(model, prompts, draft_model=None, **kw):
    kw = {"max_new_tokens": N, "temperature": 0.0, **kw}
    gen = SpeculativeGenerator(model, draft_model, SpeculativeConfig(**kw))
    return gen, gen.run(prompts)


DRAFTS = {
    "self_int8": lambda t: dict(draft="self_int8"),
    "layer_skip": lambda t: dict(draft="layer_skip", draft_layers=2),
    "prompt_lookup": lambda t: dict(draft="prompt_lookup"),
    "model_same": lambda t: dict(draft="model", draft_model=t),                    # accepts everything
    "model_other": lambda t: dict(draft="model", draft_model=make_model(seed=5, n_layers=1)),  # rejects most
}


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("kind", list(DRAFTS))
@pytest.mark.parametrize("which", ["target", "repetitive"])
def test_greedy_equals_plain_greedy(request, kind, batch, adaptive, which, ragged):
    model = request.getfixturevalue(which)
    prompts = ragged[:batch] if batch > 1 else [ragged[1]]
    expected = plain(model, prompts).sequences
    kw = DRAFTS[kind](model)
    gen, result = speculative(model, prompts, kw.pop("draft_model", None), spec_k_adaptive=adaptive, **kw)
    assert result.sequences == expected
    assert result.finish_reasons == ["length"] * batch
    assert gen.stats.target_forwards == result.decode_steps < N  # drafts were accepted somewhere


def test_accept_paths_are_exercised(target, repetitive, ragged):
    """The greedy-equality cases above see full accepts, partial accepts and full rejects."""
    _, same = speculative(target, ragged, target)
    assert same.stats.acceptance_rate == 1.0
    assert same.stats.tokens_per_target_forward > 4.5           # k + 1 = 5 per forward, less the budget tail
    gen, mixed = speculative(target, ragged, draft="self_int8")
    assert 0.3 < gen.acceptance_rate < 0.95
    _, other = speculative(target, ragged, make_model(seed=5, n_layers=1))
    assert other.stats.acceptance_rate < 0.2
    _, lk = speculative(repetitive, ragged, draft="prompt_lookup")
    assert lk.stats.acceptance_rate > 0.5 and lk.stats.tokens_per_target_forward > 2


def test_generate_matches_generator_generate(target, ragged):
    expected = Generator(target, GenerateConfig(max_new_tokens=N, temperature=0.0)).generate(ragged)
    got = SpeculativeGenerator(target, config=SpeculativeConfig(max_new_tokens=N, temperature=0.0, draft="self_int8")).generate(ragged)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("kind", ["self_int8", "model_same", "model_other", "layer_skip"])
def test_caches_equal_plain_decoding(target, ragged, kind):
    """After all the accepts and rejects, each row's cached K/V are plain decoding's, slot for slot."""
    ref = Generator(target, GenerateConfig(max_new_tokens=N, temperature=0.0))
    ref.run(ragged)
    kw = DRAFTS[kind](target)
    gen, _ = speculative(target, ragged, kw.pop("draft_model", None), **kw)
    assert gen.stats.proposed > 0
    for r in range(len(ragged)):
        ours = gen.rows.row_slots(r)
        theirs = ref.state.row_slots(r)
        assert len(ours) == len(theirs) == len(ragged[r]) + N - 1  # the last token is pending, as in plain decoding
        for mine, plain_layer in zip(gen.rows.cache.layers, ref.cache.layers):
            # batched vs one-token matmuls: the same K/V up to fp32 rounding through the layers below
            torch.testing.assert_close(mine.k[r][:, ours], plain_layer.k[r][:, theirs], **tol.forward(plain_layer.k[r], target.config))
            torch.testing.assert_close(mine.v[r][:, ours], plain_layer.v[r][:, theirs], **tol.forward(plain_layer.v[r], target.config))
    assert gen.rows.cache.length <= max(map(len, ragged)) + 3 * N  # holes are truncated, not accumulated


@pytest.mark.parametrize("kind", [k.value for k in KVCacheKind])
def test_every_cache_kind(target, ragged, kind):
    """Truncation on every cache kind: speculative equals plain decoding on the same kind. A
    per-channel kind quantizes groups of tokens, which a rollback cannot undo exactly: refused."""
    if KVCacheKind(kind).spec.per_channel:
        with pytest.raises(ValueError, match="per channel"):
            speculative(target, ragged, draft="self_int8", cache_kind=kind)
        return
    expected = plain(target, ragged, cache_kind=kind).sequences
    _, got = speculative(target, ragged, draft="self_int8", cache_kind=kind)
    assert got.sequences == expected and got.stats.proposed > got.stats.accepted > 0


def test_batch_of_one_keeps_a_dense_cache(target, ragged):
    gen, _ = speculative(target, [ragged[1]], draft="self_int8")
    assert not gen.rows.has_holes and gen.rows.cache.length == len(ragged[1]) + N - 1


@pytest.mark.parametrize("kind", ["model_same", "prompt_lookup"])
def test_nothing_after_eos_or_stop(repetitive, ragged, kind):
    prompts = ragged
    reference = plain(repetitive, prompts).sequences
    stop_at = reference[0][12]  # a token that occurs in row 0's output
    kw = DRAFTS[kind](repetitive)
    draft_model = kw.pop("draft_model", None)
    expected = plain(repetitive, prompts, eos_token_id=stop_at)
    _, got = speculative(repetitive, prompts, draft_model, eos_token_id=stop_at, spec_k=8, **kw)
    assert got.sequences == expected.sequences and got.finish_reasons == expected.finish_reasons
    assert got.sequences[0][-1] == stop_at and "eos" in got.finish_reasons
    stop = reference[1][20:22]
    expected = plain(repetitive, prompts, stop_sequences=[stop])
    _, got = speculative(repetitive, prompts, draft_model, stop_sequences=[stop], spec_k=8, **kw)
    assert got.sequences == expected.sequences and got.finish_reasons == expected.finish_reasons
    assert got.finish_reasons[1] == "stop_sequence" and got.sequences[1][-2:] == stop


def test_adaptive_k_follows_hf_heuristic(target, ragged):
    _, same = speculative(target, [ragged[1]], target, spec_k_adaptive=True, spec_k=4, spec_k_max=10)
    ks = same.stats.k_history[0]
    assert ks[:4] == [4, 6, 8, 10] and max(ks) == 10          # all accepted: +2, clamped at spec_k_max
    _, other = speculative(target, [ragged[1]], make_model(seed=5, n_layers=1), spec_k_adaptive=True, spec_k=4)
    ks = other.stats.k_history[0]
    assert ks[:5] == [4, 3, 2, 1, 1]                          # rejected: max(1, k - 1)


def test_fixed_k_without_adaptive(target, ragged):
    _, result = speculative(target, [ragged[1]], make_model(seed=5, n_layers=1), spec_k=3)
    assert result.stats.k_history[0][:30] == [3] * 30  # (the last rounds shrink to the token budget)


def test_fallback_below_acceptance_and_probe(target, ragged):
    draft = make_model(seed=5, n_layers=1)
    expected = plain(target, [ragged[1]], max_new_tokens=60).sequences
    _, result = speculative(target, [ragged[1]], draft, spec_disable_below_accept=0.5, max_new_tokens=60)
    assert result.sequences == expected
    ks = result.stats.k_history[0]
    # a rejected first round -> SPEC_PROBE_INTERVAL plain steps -> a probe round -> ...
    first_probe = ks.index(4, 1)
    assert ks[0] == 4 and ks[1:first_probe] == [0] * SPEC_PROBE_INTERVAL
    assert result.stats.draft_forwards <= 4 * ks.count(4)  # the draft sat out the plain stretches


def test_confidence_threshold_stops_drafting_early(target, ragged):
    draft = make_model(seed=0, n_layers=4, std=0.25)  # close to the target, not equal
    expected = plain(target, ragged).sequences
    _, result = speculative(target, ragged, draft, spec_k=8, spec_confidence=0.95)
    assert result.sequences == expected
    assert result.stats.proposed < sum(sum(k) for k in result.stats.k_history)


def test_no_extra_token(target, ragged):
    expected = plain(target, ragged).sequences
    _, result = speculative(target, ragged, target, spec_extra_token=False, spec_k=4)
    assert result.sequences == expected
    assert 3.5 < result.stats.tokens_per_target_forward <= 4.0  # k per forward, no bonus


def test_draft_must_share_the_vocabulary(target):
    with pytest.raises(ValueError, match="vocabulary"):
        SpeculativeGenerator(target, make_model(vocab_size=50), SpeculativeConfig(draft="model"))
    with pytest.raises(ValueError, match="needs a draft_model"):
        SpeculativeGenerator(target, None, SpeculativeConfig(draft="model"))
    with pytest.raises(ValueError, match="only used with draft='model'"):
        SpeculativeGenerator(target, target, SpeculativeConfig(draft="prompt_lookup"))


@pytest.mark.parametrize("field,value", [("spec_k", 0), ("spec_k_max", 2), ("spec_method", "typical"),
                                         ("spec_disable_below_accept", 1.5), ("draft", "medusa"), ("spec_confidence", 0.0),
                                         ("num_beams", 2), ("frequency_penalty", 0.5), ("no_repeat_ngram_size", 3)])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=f"SpeculativeConfig.{field}="):
        SpeculativeConfig(**{field: value})


def test_drafts_built_from_the_target(target):
    x = torch.tensor([[3, 5, 7, 11]])
    skip = layer_skip_draft(target, 4 - 1)
    assert skip.config.n_layers == 3 and skip.layers[0] is target.layers[0]
    assert len(skip.new_cache(1, 8).layers) == 3
    int8 = int8_self_draft(target)
    with torch.inference_mode():
        full, approx = target(x), int8(x)
    assert (approx - full).abs().mean() < 0.2 * full.abs().mean()  # close (int8 on a large-std model), not equal
    assert not torch.equal(approx, full)
    with pytest.raises(ValueError, match="draft_layers"):
        layer_skip_draft(target, 4)


def test_prompt_lookup_takes_the_latest_match():
    assert lookup([1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2, 3], 2) == [8, 7]      # the latest 3-gram match
    assert lookup([5, 1, 6, 1], 3) == [6, 1]                             # falls back to a 1-gram
    assert lookup([1, 2, 3], 4) == []
    assert lookup([4, 4, 4, 4, 4, 4], 3) == [4, 4, 4]                    # a run: a match k back, not the adjacent one
    assert lookup([1, 2, 7, 1, 2, 5, 1, 2], 3) == [5, 1, 2]              # latest with k ids after it
    d = PromptLookupDraft(max_ngram=2)
    assert d.propose([[4, 5, 6, 4, 5]], [3], None, 0)[0] == [[6, 4, 5]]


# ---- sampling: the output distribution is the target's --------------------------------------

V = 8
PROMPT = [1, 2, 3, 1, 2]


def exact_joint(model, params: SamplingParams) -> torch.Tensor:
    """P(t2, t3) [V, V] under plain sampling from the model, summed over t1."""
    pairs = torch.tensor(list(itertools.product(range(V), repeat=2)))         # [V*V, 2] (t1, t2)
    seqs = torch.cat([torch.tensor(PROMPT).expand(len(pairs), -1), pairs], dim=1)
    with torch.inference_mode():
        logits = model(seqs)[:, len(PROMPT) - 1 :]                            # [V*V, 3, V]
    probs = []
    for i in range(3):
        seen = torch.zeros(len(pairs), V, dtype=torch.bool)
        for j in range(len(PROMPT) + i):
            seen[torch.arange(len(pairs)), seqs[:, j]] = True
        probs.append(process_logits(logits[:, i], params, seen).softmax(-1))
    t1, t2 = pairs[:, 0], pairs[:, 1]
    joint = probs[0][:, :][torch.arange(len(pairs)), t1] * probs[1][torch.arange(len(pairs)), t2]  # P(t1, t2)
    p3 = probs[2] * joint[:, None]                                            # [V*V, V]: P(t1, t2, t3)
    return p3.view(V, V, V).sum(dim=0)                                        # P(t2, t3)


def chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    counts, expected = counts.flatten().double(), expected.flatten().double()
    small = expected < 5                      # pool sparse cells
    c = torch.cat([counts[~small], counts[small].sum()[None]])
    e = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = e > 0
    stat = ((c[keep] - e[keep]) ** 2 / e[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.double), stat / 2))


SAMPLING_CASES = {
    "t1_other_model": dict(temperature=1.0, draft="model"),
    "t1_prompt_lookup": dict(temperature=1.0, draft="prompt_lookup"),
    "processors_other_model": dict(temperature=0.8, top_k=5, top_p=0.9, repetition_penalty=1.3, draft="model"),
    "processors_prompt_lookup": dict(temperature=0.8, top_k=5, repetition_penalty=1.3, draft="prompt_lookup"),
    "greedy_method": dict(temperature=1.0, draft="model", spec_method="greedy"),
    "no_extra_token": dict(temperature=1.0, draft="model", spec_extra_token=False),
}


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_sampled_tokens_follow_the_target_distribution(case):
    target = make_model(seed=3, vocab_size=V, std=0.15)
    draft = make_model(seed=11, vocab_size=V, n_layers=1, std=0.3)  # disagrees a lot with the target
    kw = dict(SAMPLING_CASES[case])
    config = SpeculativeConfig(max_new_tokens=4, spec_k=2, max_seq_len=16, **kw)
    expected = exact_joint(target, config.sampling)
    rows = 3000
    counts = torch.zeros(V, V)
    acceptance = []
    for seed in (0, 1):
        config.seed = seed
        gen = SpeculativeGenerator(target, draft if kw["draft"] == "model" else None, config)
        result = gen.run([PROMPT] * rows)
        for seq in result.sequences:
            counts[seq[1], seq[2]] += 1
        acceptance.append(gen.acceptance_rate)
    p = chi_square_p(counts, expected * counts.sum())
    assert p > 1e-3, f"{case}: chi-square p = {p:.2e}; acceptance {acceptance}"
    assert 0.05 < min(acceptance) and max(acceptance) < 0.95  # rejections and accepts both happen


def test_chi_square_detects_the_draft_distribution():
    """The test above has power: the draft's own distribution fails it."""
    target = make_model(seed=3, vocab_size=V, std=0.15)
    draft = make_model(seed=11, vocab_size=V, n_layers=1, std=0.3)
    params = SamplingParams(temperature=1.0)
    g = torch.Generator().manual_seed(0)
    sample = torch.multinomial(exact_joint(draft, params).flatten(), 6000, replacement=True, generator=g)
    counts = torch.bincount(sample, minlength=V * V).float()
    assert chi_square_p(counts, exact_joint(target, params) * 6000) < 1e-6


# ---- manifest mode, records and CLI (a tiny HF-directory model) ------------------------------

SPEC_MANIFEST = """\
version: 1
name: tiny
vars: {{model: "{model}"}}
defaults:
  model: {{source: "${{model}}"}}
targets:
  - type: experiment
    name: t
    runs:
      - id: spec
        mode: speculative
        seed: 0
        speculative:
          prompts: ["abcabcabcabc", "hello hello hello"]
          max_new_tokens: 12
          temperature: 0.0
          batch_size: 2
          draft: {draft}
          spec_k: 3
          spec_k_adaptive: true
{extra}"""


def spec_manifest(tmp_path, model, draft="prompt_lookup", extra="", name="spec.yaml"):
    path = tmp_path / name
    path.write_text(SPEC_MANIFEST.format(model=model, draft=draft, extra=extra))
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from test_cli import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_manifest_speculative_run_records_stats_and_speedup(tmp_path, monkeypatch, tiny_dir):
    from test_cli import invoke

    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    extra = "        draft:\n          dtype: float32\n"
    r = invoke("run", spec_manifest(tmp_path, tiny_dir, "model", extra.replace("        draft:", "        draft_:")))
    assert r.exit_code == 2 and "draft_" in r.output                       # unknown field, as everywhere
    path = tmp_path / "m.yaml"
    path.write_text(spec_manifest(tmp_path, tiny_dir, "model").read_text() + extra)
    r = invoke("run", path)
    assert r.exit_code == 0, r.output
    result = json.loads((tmp_path / "runs" / "tiny" / "t" / "spec" / "result.json").read_text())
    summary = result["summary"]
    assert summary["same_as_plain"] is True and summary["acceptance_rate"] == 1.0   # the draft is the target itself
    for key in ("tokens_per_target_forward", "speedup", "plain_s", "speculative_s", "proposed", "accepted"):
        assert key in summary
    row = result["prompts"][0]
    assert row["k_history"][:2] == [3, 5] and row["plain"]["output_ids"] == row["output_ids"]
    assert result["draft_model"]["sha256"] == result["model"]["sha256"]


def test_manifest_speculative_rejects_unsupported_settings(tmp_path, monkeypatch, tiny_dir):
    from test_cli import invoke

    monkeypatch.setenv("CARAMBA_RUNS_DIR", str(tmp_path / "runs"))
    r = invoke("run", spec_manifest(tmp_path, tiny_dir, extra="          num_beams: 2\n"))
    assert r.exit_code == 2 and "num_beams=2 is not supported with speculative decoding" in r.output, r.output
    assert not (tmp_path / "runs" / "tiny" / "t" / "spec").exists()


def test_manifest_speculative_validation(tmp_path, tiny_dir):
    from caramba.errors import UserError
    from caramba.manifest import load_manifest

    resolved = list(load_manifest(spec_manifest(tmp_path, tiny_dir)).iter_runs())
    assert resolved[0].run.speculative.draft == "prompt_lookup" and resolved[0].draft is None
    cases = [
        (spec_manifest(tmp_path, tiny_dir, "model", name="a.yaml"), "needs a 'draft:' model spec"),
        (spec_manifest(tmp_path, tiny_dir, "medusa", name="b.yaml"), "speculative.draft"),
        (spec_manifest(tmp_path, tiny_dir, extra="          spec_k_max: 2\n", name="c.yaml"), "spec_k_max=2 must be >= spec_k (3)"),
        (spec_manifest(tmp_path, tiny_dir, extra="          spec_kk: 2\n", name="d.yaml"), "did you mean 'spec_k'"),
    ]
    for path, message in cases:
        with pytest.raises(UserError, match=re.escape(message)) as caught:
            load_manifest(path)
        assert f"{path}:" in str(caught.value)  # file:line
    path = spec_manifest(tmp_path, tiny_dir)
    path.write_text(path.read_text() + "        draft: {dtype: float32}\n")
    with pytest.raises(UserError, match="only used by mode: speculative with speculative.draft: model"):
        load_manifest(path)


def test_cli_generate_speculative_json(tiny_dir):
    from test_cli import invoke

    plain = json.loads(invoke("generate", "abcabcabc", "--model", tiny_dir, "--max-new-tokens", "10", "--json").output)
    for kind in ("prompt_lookup", "self_int8", "layer_skip"):
        r = invoke("generate", "abcabcabc", "--model", tiny_dir, "--max-new-tokens", "10", "--json",
                   "--speculative", kind, "--spec-k", "3")
        assert r.exit_code == 0, r.output
        data = json.loads(r.output)
        assert data["output_ids"] == plain["output_ids"] and data["speculative"] == kind
        for key in ("acceptance_rate", "tokens_per_target_forward", "target_forwards", "proposed", "accepted", "k_history"):
            assert key in data
    r = invoke("generate", "abc", "--model", tiny_dir, "--json", "--speculative", "model", "--draft", tiny_dir)
    assert r.exit_code == 0 and json.loads(r.output)["acceptance_rate"] == 1.0
    for args, message in [(["--speculative", "model"], "needs --draft"), (["--spec-k", "3"], "need --speculative"),
                          (["--speculative", "medusa"], "choose one of")]:
        r = invoke("generate", "abc", "--model", tiny_dir, *args)
        assert r.exit_code == 2 and message in r.output, r.output


# ---- the real model (integration; the `smollm2` fixture is conftest's) ---------------------

SMOLLM2_PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    "The history of the printing press begins in the fifteenth century, when",
]


@pytest.fixture(scope="module")
def smollm2_plain(smollm2):
    """Plain greedy decoding of batch 1 (the first prompt) and the ragged batch of both."""
    tok = smollm2.tokenizer
    prompts = [tok.encode(p) for p in SMOLLM2_PROMPTS]
    config = GenerateConfig(max_new_tokens=32, temperature=0.0)
    return [(batch, Generator(smollm2.model, config, tokenizer=tok).run(batch)) for batch in ([prompts[0]], prompts)]


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["prompt_lookup", "self_int8", "layer_skip", "model"])
def test_smollm2_greedy_equals_plain(smollm2, smollm2_plain, kind):
    """Batch 1 and a ragged batch of 2, every draft kind (model: a layer-skip Transformer
    passed as a separate draft model), token for token against plain decoding."""
    draft_model = layer_skip_draft(smollm2.model, 8) if kind == "model" else None
    spec_config = SpeculativeConfig(max_new_tokens=32, temperature=0.0, draft=kind, spec_k_adaptive=True)
    gen = SpeculativeGenerator(smollm2.model, draft_model, spec_config, tokenizer=smollm2.tokenizer)
    for batch, expected in smollm2_plain:
        got = gen.run(batch)
        assert got.sequences == expected.sequences, f"{kind}, batch {len(batch)}"
        assert got.finish_reasons == expected.finish_reasons
        assert gen.stats.accepted > 0
