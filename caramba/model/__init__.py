"""The decoder, its config and the loaders (GGUF, HF directories, the embedded default)."""

from caramba.model.config import ModelConfig
from caramba.model.transformer import Transformer

__all__ = ["ModelConfig", "Transformer"]
