"""Generation: sampling, the stateful Generator and the stateless generate()."""

from caramba.infer.generate import CacheOverflowError, GenerateConfig, GenerationResult, Generator, generate
from caramba.infer.sampling import SamplingParams, process_logits, select_tokens

__all__ = [
    "CacheOverflowError", "GenerateConfig", "GenerationResult", "Generator", "SamplingParams",
    "generate", "process_logits", "select_tokens",
]
