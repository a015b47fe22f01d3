"""cache_kind="auto" through a resolver (caramba.resolvers): the engine asks the one a Generator is
given, else the default the package root registers (caramba.autotune's), and never imports the
autotune itself."""

from __future__ import annotations

import subprocess
import sys

import pytest

import caramba
from caramba import resolvers
from caramba.cache import CachePolicy
from caramba.infer import GenerateConfig, Generator, generate
from conftest import make_model


class Recording:
    """A resolver that picks a fixed policy and remembers what it was asked."""

    def __init__(self, kind: str = "q8_0") -> None:
        self.policy = CachePolicy.of(kind)
        self.calls: list[tuple] = []

    def __call__(self, model, tokenizer, cache, batch_size):
        self.calls.append((model, tokenizer, cache, batch_size))
        return self.policy, {"resolved": self.policy.describe(), "by": "test"}


def auto(**kw) -> GenerateConfig:
    return GenerateConfig(**{"temperature": 0.0, "max_new_tokens": 4, "max_seq_len": 32, "cache_kind": "auto",
                             "cache_budget_mb": 8, **kw})


def test_the_resolver_given_picks_the_cache_on_first_use():
    model, resolve = make_model(), Recording("q8_0")
    config = auto()
    session = Generator(model, config, cache_resolver=resolve)
    out = session.generate([[1, 2, 3], [4, 5]])
    assert len(resolve.calls) == 1
    asked_model, tokenizer, cache, batch = resolve.calls[0]
    assert asked_model is model and tokenizer is None and cache is config.cache and batch == 2
    assert session.cache_auto == {"resolved": resolve.policy.describe(), "by": "test"}
    assert session.config.cache_kind == "q8_0" and session.config.cache == config.cache.with_policy(resolve.policy)
    assert session.config.max_seq_len == 32 and session.config.cache_budget_mb == 8   # kept
    # the same tokens as naming the kind the resolver chose
    named = Generator(model, auto(cache_kind="q8_0")).generate([[1, 2, 3], [4, 5]])
    assert out.tolist() == named.tolist()
    session.generate([[6], [7]])   # a later turn reuses the cache: no second resolution
    assert len(resolve.calls) == 1


def test_stateless_generate_takes_a_resolver():
    resolve = Recording("fp16")
    out = generate(make_model(), [[1, 2, 3]], cache_resolver=resolve, temperature=0.0, max_new_tokens=4, max_seq_len=32,
                   cache_kind="auto")
    assert len(resolve.calls) == 1 and resolve.calls[0][2].is_auto and out.shape == (1, 7)


def test_a_named_kind_never_asks_the_resolver():
    resolve = Recording()
    session = Generator(make_model(), auto(cache_kind="fp32"), cache_resolver=resolve)
    session.generate([[1, 2, 3]])
    assert resolve.calls == [] and session.cache_auto is None


def test_the_registered_default_is_used_without_one(monkeypatch):
    resolve = Recording("q4_0")
    monkeypatch.setattr(resolvers, "_cache_resolver", None)
    assert resolvers.set_cache_resolver(resolve) is None
    session = Generator(make_model(), auto())
    session.generate([[1, 2, 3]])
    assert len(resolve.calls) == 1 and session.config.cache_kind == "q4_0"


def test_no_resolver_anywhere_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(resolvers, "_cache_resolver", None)
    with pytest.raises(ValueError, match="cache_resolver"):
        Generator(make_model(), auto()).generate([[1, 2, 3]])


def test_the_package_root_registers_the_autotune():
    """The library's `cache_kind="auto"` still runs caramba.autotune (test_seed_api runs it end to end)."""
    from caramba.autotune.resolve import resolve_cache

    assert resolvers.cache_resolver() is caramba._autotune_cache
    assert resolve_cache.__module__ == "caramba.autotune.resolve"


def test_importing_the_engine_loads_nothing_above_it():
    """At run time too: using the engine (auto cache included, until it is resolved) loads no module
    of the layers above it."""
    code = ("import sys\nfrom caramba.infer import GenerateConfig, Generator\nimport caramba.model.zoo, caramba.press\n"
            "GenerateConfig(cache_kind='auto', cache_budget_mb=1)\n"
            "above = ('caramba.autotune', 'caramba.runners', 'caramba.manifest', 'caramba.cli', 'caramba.bench', "
            "'caramba.executors')\n"
            "print(sorted(m for m in sys.modules if m.startswith(above)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
