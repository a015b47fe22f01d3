"""Many prompts through the Generator in batches: sorted by length so a batch pads little,
results returned in input order. `batch_size="auto"` sizes batches from free memory and the
per-row cost of the KV cache and the prefill's activations, and says what it chose.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from caramba.infer.config import GenerateConfig
from caramba.infer.generate import Generator
from caramba.model.backend import ThreadChoice

# Share of free memory "auto" plans to use: the rest is headroom for the allocator, the
# tokenizer, other processes and what the estimate leaves out.
MEMORY_FRACTION = 0.5
MAX_AUTO_BATCH = 64


@dataclass
class BatchedResult:
    sequences: list[list[int]]            # per prompt, in input order: new token ids
    finish_reasons: list[str]             # per prompt: "eos" | "stop_sequence" | "length"
    batch_size: int                       # the size used (chosen, when "auto")
    batches: list[list[int]]              # prompt indexes of each batch, in the order run
    elapsed_s: float
    sizing: dict[str, Any] | None = field(default=None)   # how "auto" chose (None when given)

    @property
    def n_generated(self) -> int:
        return sum(len(s) for s in self.sequences)

    @property
    def tok_s(self) -> float:
        """New tokens of every prompt per second of wall time (prefill included)."""
        return self.n_generated / self.elapsed_s if self.elapsed_s > 0 else 0.0


def free_memory_bytes(device: torch.device) -> int:
    """Free memory where the model lives: the GPU's free bytes, or the host's available RAM."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024


def row_cost_bytes(model, config: GenerateConfig, prompt_len: int) -> dict[str, int]:
    """Bytes one batch row needs: its KV cache (allocated for max_seq_len slots, as the
    Generator does) and the prefill's largest transient activations for a prompt_len prompt."""
    mc, policy = model.config, config.cache_spec()
    cache = 0
    decoupled = mc.attention == "decoupled"   # k_sem, k_geo, v streams of their own widths
    widths = (mc.sem_dim, mc.geo_dim, mc.head_dim) if decoupled else (mc.head_dim, mc.head_dim)
    for i in range(mc.n_layers):
        for cfg, width in zip(policy.stream_configs(i, decoupled), widths):
            cache += config.max_seq_len * cfg.bytes_per_token(mc.n_kv_heads, width)
            if cfg.quantized and cfg.residual_len:   # the full-precision residual window
                cache += cfg.residual_len * mc.n_kv_heads * width * model.dtype.itemsize
    # Prefill, per row: the residual stream and its norm (2 x dim), q|k|v, gate|up (2 x
    # intermediate) and their product, the attention scores of every head (n_heads x T) when
    # SDPA falls back to its math path, and the last position's logits.
    T, item = prompt_len, model.dtype.itemsize
    Tq = config.decode.resolve(T).q_chunk or T   # rows of one forward: a decode plan's chunk bounds them
    qkv = (mc.n_heads + 2 * mc.n_kv_heads) * mc.head_dim
    act = Tq * item * (2 * mc.dim + qkv + 3 * mc.intermediate_size + mc.n_heads * T) + mc.vocab_size * 4
    return {"cache_bytes": cache, "activation_bytes": act, "total": cache + act}


def auto_batch_size(model, config: GenerateConfig, prompt_len: int, n_prompts: int,
                    free_bytes: int | None = None) -> tuple[int, dict[str, Any]]:
    """The largest batch whose rows fit MEMORY_FRACTION of free memory (1..min(n_prompts, MAX_AUTO_BATCH))."""
    free = free_memory_bytes(model.device) if free_bytes is None else free_bytes
    cost = row_cost_bytes(model, config, prompt_len)
    fits = int(free * MEMORY_FRACTION // cost["total"])
    size = max(1, min(fits, n_prompts, MAX_AUTO_BATCH))
    why = ("memory" if fits < min(n_prompts, MAX_AUTO_BATCH) else
           "all prompts" if n_prompts <= MAX_AUTO_BATCH else f"cap {MAX_AUTO_BATCH}")
    return size, {"free_bytes": free, "memory_fraction": MEMORY_FRACTION, "row_bytes": cost,
                  "longest_prompt": prompt_len, "fits": fits, "chosen": size, "limited_by": why}


def generate_batched(model, prompts: list[list[int]] | list[str], batch_size: int | str = 4,
                     config: GenerateConfig | None = None, tokenizer=None, free_bytes: int | None = None,
                     **overrides) -> BatchedResult | list[str]:
    """Generate for every prompt; keyword overrides set GenerateConfig options. Prompts as lists of
    ids give a BatchedResult; prompts as text (the seed guide's form; needs the tokenizer, or a
    model loaded by caramba.model.zoo) give the completions as text, special tokens left out.
    free_bytes overrides the measured free memory for batch_size="auto" (tests, planning)."""
    if prompts and all(isinstance(p, str) for p in prompts):
        tok = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
        if tok is None:
            raise ValueError("text prompts need the tokenizer: generate_batched(model, prompts, tokenizer=tok)")
        result = generate_batched(model, [tok.encode(p) for p in prompts], batch_size, config, tok, free_bytes,
                                  **overrides)
        return [tok.decode(seq, skip_special_tokens=True) for seq in result.sequences]
    cfg = (config or GenerateConfig()).replace(**overrides)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate_batched needs at least one prompt, each with at least one token")
    t0 = time.perf_counter()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)
    sizing = None
    if batch_size == "auto":
        batch_size, sizing = auto_batch_size(model, cfg, len(prompts[order[0]]), len(prompts), free_bytes)
    elif not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be an integer >= 1 or 'auto'")
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    sequences: list[list[int]] = [[] for _ in prompts]
    reasons = ["length"] * len(prompts)
    decode_threads = ThreadChoice()   # the C step's thread choice, carried from batch to batch
    for b, rows in enumerate(batches):
        # Each batch is its own session; with a seed, batch b draws from seed + b so batches differ.
        batch_cfg = cfg if cfg.seed is None else cfg.replace(seed=cfg.seed + b)
        out = Generator(model, batch_cfg, tokenizer=tokenizer, decode_threads=decode_threads).run([prompts[i] for i in rows])
        for j, i in enumerate(rows):
            sequences[i], reasons[i] = out.sequences[j], out.finish_reasons[j]
    return BatchedResult(sequences, reasons, batch_size, batches, time.perf_counter() - t0, sizing)


__all__ = ["BatchedResult", "auto_batch_size", "generate_batched", "row_cost_bytes"]
