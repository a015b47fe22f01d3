"""Generation: sampling, the stateful Generator and the stateless generate()."""

from caramba.infer.config import (AutoCacheConfig, BeamConfig, CacheConfig, ContrastiveConfig, DraftConfig, GateSettings,
                                   GenerateConfig, SpeculativeConfig, StopConfig)
from caramba.infer.generate import CacheOverflowError, GenerationResult, Generator, generate
from caramba.infer.batched import BatchedResult, generate_batched
from caramba.infer.beam import BeamResult, beam_search
from caramba.infer.contrastive import contrastive_search
from caramba.infer.sampling import SamplingParams, process_logits, select_tokens
from caramba.infer.plan import DecodePlan
from caramba.infer.speculative import SpeculativeGenerator, SpeculativeResult
from caramba.infer.state import DecodeState
from caramba.infer.stops import StopChecker

__all__ = [
    "AutoCacheConfig", "BeamConfig", "CacheConfig", "ContrastiveConfig", "DecodePlan", "DraftConfig", "GateSettings",
    "DecodeState", "StopChecker", "StopConfig", "BatchedResult", "BeamResult", "CacheOverflowError", "GenerateConfig", "GenerationResult", "Generator",
    "SamplingParams", "SpeculativeConfig", "SpeculativeGenerator", "SpeculativeResult", "beam_search", "contrastive_search", "generate", "generate_batched", "process_logits",
    "select_tokens",
]
