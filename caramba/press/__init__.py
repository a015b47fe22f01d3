"""KV-cache presses: token eviction after prefill (caramba.press.config, docs/kv-cache.md#presses).

observing(model, cache, press) -> Observations: collect what the method scores with during a
context prefill; kept_masks(cache, observations, press, valid) -> per layer [B, KVH, S] bool (None: a
hybrid cache's sliding layer, kept whole: only the full layers are pressed).
caramba.infer.pressing runs them in a decoding state (press_masks: both on a fresh fp32 cache).
A method is one MethodSpec in caramba.press.spec.SPECS."""

from caramba.press.budget import n_kept, pyramid_budget
from caramba.press.config import PressConfig
from caramba.press.methods import Row
from caramba.press.observe import Observations, observing
from caramba.press.select import kept_masks
from caramba.press.spec import METHODS, SPECS, MethodSpec, score, spec_of

__all__ = ["METHODS", "MethodSpec", "Observations", "PressConfig", "Row", "SPECS", "kept_masks", "n_kept", "observing",
           "pyramid_budget", "score", "spec_of"]
