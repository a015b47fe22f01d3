"""KV-cache presses: token eviction after prefill (caramba.press.config, docs/kv-cache.md#presses)."""

from caramba.press.config import METHODS, PressConfig

__all__ = ["METHODS", "PressConfig"]
