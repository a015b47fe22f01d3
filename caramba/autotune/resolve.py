"""`cache_kind="auto"` in the library: the resolver a Generator asks on first use (caramba.resolvers).

The seed guide writes `Generator(model, config=GenerateConfig(cache_kind="auto",
cache_budget_mb=1024, ...)).generate(ids)`. The choice is the autotune's (stored plan first,
else budget filter, quality gates on real text and the speed pick), keyed like `caramba autotune`'s
plans when the model came from caramba.model.zoo (which tags it with its file hash and tokenizer).
caramba's package root registers `resolve_cache` as the default resolver. The runners resolve
`auto` themselves, with progress bars, before they build a Generator.
"""

from __future__ import annotations

import hashlib
import sys
from types import SimpleNamespace
from typing import Any

import torch

from caramba.autotune.select import AutotuneSettings, autotune
from caramba.cache import CachePolicy
from caramba.infer.config import CacheConfig


def weights_sha256(model) -> str:
    """The model's own identity for plan keys: its source file's hash when the zoo loaded it, else a
    hash of its weights (a second or so for a 135M model)."""
    tagged = getattr(model, "content_hash", None)
    if tagged:
        return tagged
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def resolve_cache(model, tokenizer, cache: CacheConfig, batch_size: int,
                  say: bool = True) -> tuple[CachePolicy, dict[str, Any]]:
    """The autotune's policy for the auto `cache` at `batch_size` rows, and what was chosen
    (caramba.resolvers.CacheResolver): info["press"] is the plan's press when cache_auto_presses
    let it choose one (None: none); `say`: one line on stderr."""
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ValueError("cache_kind='auto' scores candidate caches on real text, which needs the tokenizer: "
                         "Generator(model, config, tokenizer=tok)")
    loaded = SimpleNamespace(model=model, tokenizer=tokenizer, content_hash=weights_sha256(model))
    result = autotune(loaded, AutotuneSettings.for_cache(cache, batch_size))
    policy = result.chosen_policy()
    info = {"resolved": result.chosen["name"], "policy": policy.to_dict(), "bytes": result.chosen["bytes"],
            "press": result.chosen_press(),   # the Generator puts it in place of the config's (cache_auto_presses)
            "plan_key_id": result.key_id, "plan_status": result.status, "plan_path": str(result.plan_path)}
    if say:
        print(f"caramba: cache_kind='auto' -> {info['resolved']} ({info['bytes'] / 2**20:.2f} MiB; plan "
              f"{info['plan_key_id']} {info['plan_status']}, {info['plan_path']})", file=sys.stderr)
    return policy, info
