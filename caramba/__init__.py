"""caramba: a manifest-driven experiment runner for LLM inference research."""

from caramba.threads import bound_spinning as _bound_spinning

_bound_spinning()   # before anything imports torch, whose libgomp reads it once (caramba.threads)

from caramba import resolvers as _resolvers  # noqa: E402
from caramba.version import __version__  # noqa: E402,F401


def _autotune_cache(model, tokenizer, cache, batch_size):
    """cache_kind="auto" for a Generator given no resolver: caramba.autotune's choice. The package
    root wires it because the engine may not import the autotune (caramba.resolvers); imported on
    first use, as the autotune loads torch and the whole engine."""
    from caramba.autotune.resolve import resolve_cache  # lazy: the autotune loads torch and the engine

    return resolve_cache(model, tokenizer, cache, batch_size)


_resolvers.set_cache_resolver(_autotune_cache)
