"""caramba: a manifest-driven experiment runner for LLM inference research."""

__version__ = "0.1.0"

from caramba.threads import bound_spinning as _bound_spinning

_bound_spinning()   # before anything imports torch, whose libgomp reads it once (caramba.threads)
