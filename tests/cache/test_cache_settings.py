"""One cache configuration (issue 30): the storage options are defined once, on
caramba.cache.CacheSettings; CacheConfig is a CacheSettings plus the cache's size, budget, autotune
and press; `spec()` is the one place the settings become the per-stream CachePolicy that
`model.new_cache` takes, and `of_policy` / `from_dict` read a built or stored policy back.

The expectations below are what the positional `CachePolicy.build(kind, policy, qblock,
residual_len, rotate_keys, fp16_prefix_layers, rotate_values)` built before the settings were one
object: per-stream kinds, qblock and residual window, key and value rotation, the fp16 prefix
layers, and on decoupled (DBA) models the k_sem / k_geo streams with k_geo's q8_0 floor."""

from __future__ import annotations

import dataclasses

import pytest

from caramba.autotune.candidates import MIXED, PRESSED_KINDS, canonical, policy_from_dict
from caramba.cache import CachePolicy, CacheSettings
from caramba.cache.policy import STORED_ALWAYS
from caramba.infer.config import CacheConfig, GenerateConfig
from caramba.manifest.schema import GenerateSettings
from caramba.options import OptionError, options_of
from conftest import make_model

SEM, GEO = 8, 8
STORAGE = ("cache_kind", "cache_policy", "qblock", "residual_len", "rotate_keys", "rotate_values",
           "cache_fp16_prefix_layers")


def streams(layer) -> dict[str, tuple[str, int, int]]:
    """(kind, qblock, residual_len) of each stream a built layer stores."""
    names = ("k_sem", "k_geo", "v") if hasattr(layer, "k_sem_stream") else ("k", "v")
    cfgs = {"k": layer.k_cfg, "v": layer.v_cfg} if names == ("k", "v") else \
        {"k_sem": layer.k_sem_cfg, "k_geo": layer.k_geo_cfg, "v": layer.v_cfg}
    return {n: (cfgs[n].kind.value, cfgs[n].qblock, cfgs[n].residual_len) for n in names}


def test_cache_config_takes_its_storage_options_from_cache_settings():
    """One definition: CacheConfig's storage options are CacheSettings' own fields (same objects,
    same order), and the manifest's generate: section and the flat keywords reach them."""
    assert issubclass(CacheConfig, CacheSettings)
    settings = options_of(CacheSettings)
    assert [o.name for o in settings[:len(STORAGE)]] == list(STORAGE)
    assert options_of(CacheConfig)[:len(settings)] == settings
    assert set(STORAGE) <= set(GenerateSettings.model_fields)
    cfg = GenerateConfig(cache_kind="q4", cache_policy="k=q8_0", qblock=16, rotate_keys=True)
    assert cfg.cache == CacheConfig(kind="q4_0", policy="k=q8_0", qblock=16, rotate_keys=True)


@pytest.mark.parametrize("settings, layer0, layer1, rotate_keys, rotate_values", [
    (dict(kind="q8_0"), None, {"k": ("q8_0", 32, 0), "v": ("q8_0", 32, 0)}, False, False),
    (dict(kind="q4_0", policy="k=q8_0", qblock=16, residual_len=4), None,
     {"k": ("q8_0", 16, 4), "v": ("q4_0", 16, 4)}, False, False),
    (dict(kind="q4_1", policy={"k": "q4_1c"}, qblock=8, rotate_keys=True), None,
     {"k": ("q4_1c", 8, 0), "v": ("q4_1", 8, 0)}, True, False),
    (dict(kind="q4_0l", rotate_keys=True, rotate_values=True, fp16_prefix_layers=1),
     {"k": ("fp16", 32, 0), "v": ("fp16", 32, 0)}, {"k": ("q4_0l", 32, 0), "v": ("q4_0l", 32, 0)}, True, True),
])
def test_each_setting_reaches_the_standard_cache(settings, layer0, layer1, rotate_keys, rotate_values):
    model = make_model()
    config = CacheConfig(**settings)
    assert config.spec() == CacheSettings(**settings).spec() == CachePolicy.build(**settings)
    first, second = model.new_cache(1, 8, config.spec()).layers
    assert streams(first) == (layer0 or layer1) and streams(second) == layer1
    prefix = bool(layer0)   # an fp16 prefix layer rotates nothing
    assert (first.rotation is not None, first.v_rotation is not None) == \
        ((rotate_keys and not prefix), (rotate_values and not prefix))
    assert (second.rotation is not None, second.v_rotation is not None) == (rotate_keys, rotate_values)


@pytest.mark.parametrize("settings, expected", [
    # an unnamed k_geo is kept at q8_0 under a 4-bit kind (positional geometry) ...
    (dict(kind="q4_0", qblock=8), {"k_sem": ("q4_0", 8, 0), "k_geo": ("q8_0", 8, 0), "v": ("q4_0", 8, 0)}),
    (dict(kind="nf4", qblock=8, residual_len=2),
     {"k_sem": ("nf4", 8, 2), "k_geo": ("q8_0", 8, 2), "v": ("nf4", 8, 2)}),
    # ... but not raised above a full-precision kind, and named explicitly it is what it says
    (dict(kind="fp16"), {"k_sem": ("fp16", 32, 0), "k_geo": ("fp16", 32, 0), "v": ("fp16", 32, 0)}),
    (dict(kind="q4_0", policy="k_geo=q4_0", qblock=8),
     {"k_sem": ("q4_0", 8, 0), "k_geo": ("q4_0", 8, 0), "v": ("q4_0", 8, 0)}),
    (dict(kind="fp16", policy={"k_sem": "q4_0", "v": "q8"}, qblock=8),
     {"k_sem": ("q4_0", 8, 0), "k_geo": ("fp16", 8, 0), "v": ("q8_0", 8, 0)}),
])
def test_each_setting_reaches_the_decoupled_cache(settings, expected):
    model = make_model(attention="decoupled", sem_dim=SEM, geo_dim=GEO)
    cache = model.new_cache(1, 8, CacheConfig(**settings).spec())
    assert all(streams(layer) == expected for layer in cache.layers)
    prefixed = model.new_cache(1, 8, CacheConfig(**settings, fp16_prefix_layers=1, rotate_keys=True).spec())
    assert set(streams(prefixed.layers[0]).values()) == {("fp16", 32, 0)} and prefixed.layers[0].rotations is None
    assert streams(prefixed.layers[1]) == expected and prefixed.layers[1].rotations is not None


def test_stored_policies_keep_their_keys_and_read_back():
    """CachePolicy.to_dict is what plans (runs/cache_plans.json) and records store: its keys are
    unchanged, a setting beyond STORED_ALWAYS is written only off its default, and
    CacheSettings.from_dict / of_policy build the same policy back."""
    assert STORED_ALWAYS == ("qblock", "residual_len", "rotate_keys", "cache_fp16_prefix_layers")
    plain = CacheConfig(kind="q4_0", policy="k=q8_0", qblock=16, residual_len=4, rotate_keys=True,
                        fp16_prefix_layers=1).spec()
    assert plain.to_dict() == {"k": "q8_0", "v": "q4_0", "qblock": 16, "residual_len": 4, "rotate_keys": True,
                               "cache_fp16_prefix_layers": 1}
    rotated = CacheConfig(kind="q4_0l", rotate_values=True).spec()
    assert list(rotated.to_dict()) == ["k", "v", "qblock", "residual_len", "rotate_keys",
                                       "cache_fp16_prefix_layers", "rotate_values"]
    dba = CacheConfig(kind="fp16", policy={"k_sem": "q4_0"}).spec()
    assert dba.to_dict() == {"k": "fp16", "v": "fp16", "k_sem": "q4_0", "k_geo": "fp16", "qblock": 32,
                             "residual_len": 0, "rotate_keys": False, "cache_fp16_prefix_layers": 0}
    for policy in (plain, rotated, dba):
        assert CacheSettings.from_dict(policy.to_dict()).spec() == canonical(policy) == policy_from_dict(policy.to_dict())
        kept = CacheConfig.of_policy(policy, max_seq_len=64)
        assert isinstance(kept, CacheConfig) and kept.max_seq_len == 64 and kept.spec().to_dict() == policy.to_dict()


def test_autotune_candidates_are_settings():
    """The autotune's candidate rows are CacheSettings (no positional builds); each is canonical."""
    for row in (*MIXED, *PRESSED_KINDS):
        assert type(row) is CacheSettings and not row.is_auto
        assert canonical(row.spec()) == CacheSettings.from_dict(row.spec().to_dict()).spec()
    assert [row.spec().describe() for row in PRESSED_KINDS] == ["q8_0", "k=q8_0,v=q4_0 rotate_keys"]


def test_auto_refuses_every_storage_setting_by_name():
    """cache_kind='auto' chooses the storage itself: each other storage option, set, is named."""
    values = {"policy": "k=q8_0", "qblock": 16, "residual_len": 2, "rotate_keys": True, "rotate_values": True,
              "fp16_prefix_layers": 1}
    assert [o.attr for o in options_of(CacheSettings)[1:len(STORAGE)]] == list(values)
    for opt in options_of(CacheSettings)[1:len(STORAGE)]:
        with pytest.raises(OptionError, match=rf"cache_kind='auto' chooses {opt.name} itself"):
            CacheConfig(kind="auto", **{opt.attr: values[opt.attr]})
    assert CacheConfig(kind="auto").is_auto
    with pytest.raises(ValueError, match="resolved when the cache is built"):
        CacheConfig(kind="auto").spec()


@pytest.mark.parametrize("settings, message", [
    (dict(qblock=3), r"qblock=3 must be a multiple of 2"),
    (dict(residual_len=-1), r"residual_len=-1 must be >= 0"),
    (dict(fp16_prefix_layers=-1), r"cache_fp16_prefix_layers=-1 must be >= 0"),
    (dict(kind="q3"), r"unknown KV cache kind 'q3'"),
    (dict(policy="q=q8_0"), r"cache_policy names unknown stream"),
    (dict(policy="k=q8_0,k_sem=q4_0"), r"cache_policy names both k"),
])
def test_bad_settings_name_their_field(settings, message):
    for build in (CacheConfig, CacheSettings, lambda **kw: CachePolicy.build(**kw)):
        with pytest.raises(ValueError, match=message):
            build(**settings)


def test_a_policy_names_streams_of_the_model_it_is_built_for():
    with pytest.raises(ValueError, match="k_sem"):
        make_model().new_cache(1, 4, CacheConfig(policy="k_sem=q8_0").spec())
    with pytest.raises(ValueError, match="rotate_values"):
        make_model(attention="decoupled", sem_dim=SEM, geo_dim=GEO).new_cache(
            1, 4, CacheConfig(kind="q8_0", rotate_values=True).spec())


def test_settings_are_frozen_and_replace_is_checked():
    settings = CacheSettings("q8_0")
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.qblock = 16
    with pytest.raises(OptionError, match="qblock=5"):
        dataclasses.replace(settings, qblock=5)
