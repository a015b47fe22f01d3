"""caramba: a manifest-driven experiment runner for LLM inference research."""

__version__ = "0.1.0"
