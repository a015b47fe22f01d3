"""Who runs the fused C step (caramba.model.backend): every decoder that relied on the old
hand-off inside Transformer.forward now chooses it, gives the torch path's output with it, and
says which path ran; contrastive search chooses the torch path; the model's forward never
takes the C step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from caramba.infer import GenerateConfig, Generator, beam_search, contrastive_search, generate_batched
from caramba.infer.speculative import SpeculativeConfig, SpeculativeGenerator
from caramba.infer.state import DecodeState
from caramba.model import backend, fast_decode
from conftest import make_model

PROMPTS = [[5, 9, 1, 44, 3], [7, 7, 2]]
GREEDY = dict(max_new_tokens=8, temperature=0.0, eos_token_id=[], max_seq_len=48)


@pytest.fixture(autouse=True)
def needs_kernels():
    if fast_decode.library() is None:
        pytest.skip(f"decode step kernel {fast_decode.status()}")


def run_generator(model):
    gen = Generator(model, GenerateConfig(**GREEDY))
    return gen.generate(PROMPTS), gen.backend.path


def run_beam(model):
    return beam_search(model, PROMPTS[:1], num_beams=3, **GREEDY).sequences, None


def run_speculative(model):
    draft = make_model(seed=2)
    draft.fast_decode = model.fast_decode   # the draft's own switch, set alike
    gen = SpeculativeGenerator(model, draft, SpeculativeConfig(draft="model", spec_k=3, **GREEDY))
    return gen.generate(PROMPTS[:1]), gen.rows.backend.path


def run_batched(model):
    return generate_batched(model, PROMPTS, 2, GenerateConfig(**GREEDY)).sequences, None


def run_evaluate(model):
    from caramba.evaluation.evaluate import evaluate_cache

    ids = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    return [r.ppl for r in evaluate_cache(model, ids, ["q8_0"], prompt_len=16)], None


def run_speed(model):
    from caramba.autotune.speed import measure_speed
    from caramba.cache import CachePolicy

    ids = torch.randint(0, 97, (64,), generator=torch.Generator().manual_seed(4)).tolist()
    rows = measure_speed(model, [CachePolicy.of("q8_0")], CachePolicy.of("fp32"), ids, 1, 24, steps=4, repeats=1)
    assert rows[0]["error"] is None
    return None, None


DECODERS = {"generator": run_generator, "beam": run_beam, "speculative": run_speculative, "batched": run_batched,
            "evaluate_cache": run_evaluate, "autotune speed": run_speed}


@pytest.mark.parametrize("name", DECODERS)
def test_every_decoder_chooses_the_c_step_and_gives_the_torch_paths_output(name, taken):
    model = make_model(seed=1)
    got, path = DECODERS[name](model)
    assert taken, f"{name} never took the C step"
    if path is not None:
        assert path == "c"
    n = len(taken)
    model.fast_decode = False              # the one switch: every backend chosen after it is the torch path
    want, path = DECODERS[name](model)
    assert len(taken) == n
    if path is not None:
        assert path == "torch"
    if isinstance(got, torch.Tensor):
        assert torch.equal(got, want)
    elif name == "evaluate_cache":         # perplexities: the two paths agree to fp32 rounding
        assert got == pytest.approx(want, rel=1e-5)
    elif got is not None:
        assert got == want


def test_contrastive_search_chooses_the_torch_path(taken):
    """It reads the final norm's output through a forward hook, which the C step would not call."""
    model = make_model(seed=1)
    got = contrastive_search(model, PROMPTS, penalty_alpha=0.6, top_k=3, max_new_tokens=6, eos_token_id=[])
    assert taken == []
    model.fast_decode = False
    want = contrastive_search(model, PROMPTS, penalty_alpha=0.6, top_k=3, max_new_tokens=6, eos_token_id=[])
    assert got.sequences == want.sequences


def test_the_models_forward_is_the_torch_path(taken):
    model = make_model(seed=1)
    with torch.inference_mode():
        cache = model.new_cache(1, 16)
        model(torch.tensor([[5, 9, 1]]), cache=cache)
        model(torch.tensor([[4]]), cache=cache)
    assert taken == []


def test_a_state_feeds_through_its_backend_and_using_scopes_another(taken):
    model = make_model(seed=1)
    state = DecodeState(model, model.new_cache(1, 16))
    assert isinstance(state.backend, backend.CStep)
    with state.using(backend.TorchStep(model)):
        state.prefill(torch.tensor([[5, 9, 1]]))
    assert taken == [] and isinstance(state.backend, backend.CStep)
    state.step(torch.tensor([4]))
    assert len(taken) == 1 and state.backend.path == "c"
    chosen = backend.TorchStep(model)
    assert DecodeState(model, model.new_cache(1, 16), backend=chosen).backend is chosen


def test_arithmetic_names_the_build_that_computes_a_paths_logits(monkeypatch):
    """The stores' keys name the decode path and what its bits depend on (backend.arithmetic):
    torch's CPU capability always; for the C step also the loaded decode_step library's bytes (their
    sha256) and its level, so another build (a wheel's, a checkout's) is another key, and the same
    bytes under another name (a build here after a comment was edited) the same key."""
    import hashlib

    from caramba import kernels
    from caramba.model import isa

    from caramba import fused

    torch_path = backend.arithmetic("torch")
    assert torch_path.startswith("torch, torch ") and torch.backends.cpu.get_cpu_capability() in torch_path
    if fused.library() is not None:    # a prefill's elementwise kernels: their build, on either path
        built = kernels.digests["decode_ops"]
        assert f"decode_ops {built}" in torch_path
        monkeypatch.setitem(kernels.digests, "decode_ops", "1" * 16)
        assert backend.arithmetic("torch") == torch_path.replace(built, "1" * 16)
        monkeypatch.setitem(kernels.digests, "decode_ops", built)
    if fast_decode.library() is None:
        assert backend.arithmetic("c") == "c, " + torch_path.split(", ", 1)[1]
        return
    here = backend.arithmetic("c")
    loaded = Path(fast_decode.library()._name)   # ctypes keeps the path it opened
    assert loaded.name == kernels.files["decode_step"]
    assert kernels.digests["decode_step"] == hashlib.sha256(loaded.read_bytes()).hexdigest()[:16]
    assert kernels.digests["decode_step"] in here and isa.kernel_isa() in here
    monkeypatch.setitem(kernels.files, "decode_step", "decode_step-avx512-0123456789abcdef.so")
    monkeypatch.setitem(kernels.origin, "decode_step", "prebuilt avx512")
    assert backend.arithmetic("c") == here
    monkeypatch.setitem(kernels.digests, "decode_step", "0" * 16)
    other = backend.arithmetic("c")
    assert other != here and "decode_step 0000000000000000" in other
