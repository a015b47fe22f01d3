"""DBA conversion of the real SmolLM2-135M: keeping the 24 fastest RoPE pairs geometric and the
slowest 8 uncompressed (they turn < 0.2 rad over 256 tokens) leaves the model's NLL unchanged;
the converted model decodes through its three-stream cache as through a full forward."""

from __future__ import annotations


import pytest
import torch

from conftest import SMOLLM2

pytestmark = SMOLLM2


@pytest.fixture(scope="module")
def pair(smollm2):
    from caramba.model.dba_convert import convert_state
    from caramba.model.zoo import build_model

    loaded = smollm2
    conv = convert_state(loaded.model.config, loaded.model.state_dict(), sem_dim=16, geo_dim=48)
    return loaded, build_model(conv.config, conv.state, torch.float32, torch.device("cpu"))


@torch.inference_mode()
def test_uncompressed_conversion_keeps_the_nll(pair):
    from caramba.evaluation.evaluate import corpus_ids

    loaded, dba = pair
    ids = torch.tensor([corpus_ids(loaded.tokenizer)[:256]])

    def nll(model):
        logp = torch.log_softmax(model(ids)[0, :-1], dim=-1)
        return float(-logp.gather(-1, ids[0, 1:, None]).mean())

    assert abs(nll(dba) - nll(loaded.model)) < 0.01


@torch.inference_mode()
def test_decoupled_cache_decode_equals_the_full_forward(pair):
    from caramba.cache import CachePolicy
    from caramba.evaluation.evaluate import corpus_ids

    loaded, dba = pair
    ids = torch.tensor([corpus_ids(loaded.tokenizer)[:80]])
    full = torch.log_softmax(dba(ids)[0, 64:], dim=-1)
    for policy, tol in ((CachePolicy.build("fp32"), 1e-5), (CachePolicy.build("q8_0", qblock=16), 2e-3)):
        cache = dba.new_cache(1, 80, policy)
        steps = [dba(ids[:, :65], cache=cache)[0, -1:]] + [dba(ids[:, t : t + 1], cache=cache)[0] for t in range(65, 80)]
        logp = torch.log_softmax(torch.cat(steps), dim=-1)
        kl = float((full.exp() * (full - logp)).sum(-1).mean())
        assert kl < tol, (policy.describe(decoupled=True), kl)
