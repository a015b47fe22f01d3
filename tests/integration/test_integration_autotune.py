"""The cache autotune on the real SmolLM2-135M with small settings: the chosen cache passes every
gate, plain q4_0 (mean KL ~0.1 on this model, docs/kv-cache.md) fails the KL gate, and q8_0 passes."""

from __future__ import annotations



from conftest import SMOLLM2

pytestmark = SMOLLM2


def test_autotune_chooses_a_cache_that_passes_the_gates(smollm2, tmp_path):
    from caramba.autotune import AutotuneSettings, GateSettings, autotune

    gates = GateSettings(cache_quality_prompt_len=128, cache_quality_decode_steps=24, cache_quality_needle_len=384)
    settings = AutotuneSettings(budget_mb=20, max_seq_len=512, gates=gates, speed_steps=2)
    result = autotune(smollm2, settings, plan_path=tmp_path / "plans.json")
    by_name = {c["name"]: c for c in result.candidates}
    chosen = result.chosen
    assert chosen["bytes"] <= 20 * 2**20
    if not chosen["baseline"]:
        g = chosen["gates"]
        assert g["passed"] and g["needle_match"]
        assert g["dnll"] <= gates.cache_quality_max_delta_nll and g["kl_mean"] <= gates.cache_quality_max_mean_kl
        assert g["needle_kl"] <= gates.cache_quality_needle_max_kl
    assert result.needle["baseline_found"], result.needle   # the model does retrieve the planted code
    assert by_name["q8_0"]["gates"]["passed"], by_name["q8_0"]
    assert by_name["q4_0"]["verdict"] == "failed gates" and any("mean KL" in w for w in by_name["q4_0"]["why"])
    assert autotune(smollm2, settings, plan_path=tmp_path / "plans.json").status == "reused"
