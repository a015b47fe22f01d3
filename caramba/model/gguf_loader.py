"""Read a Llama, Qwen2 or Gemma 3 GGUF file (llama.cpp's format) with ggml-org's `gguf` reader.

Quantized tensors are dequantized to float32. llama.cpp's converter permutes the rows of
attn_q/attn_k for Llama models (to its interleaved rotary layout); we undo that so the
weights match HF's half-rotation RoPE. For Gemma it stores every norm's weight as 1 + w; we
subtract 1 as HF's GGUF loader does (the state dict adds it back, caramba.model.state_dict), so
both compute the same floats. What a Gemma 3 file leaves out (its sliding-layer pattern, the
sliding layers' RoPE base, the query scale) takes transformers' Gemma3TextConfig defaults, as HF
and llama.cpp do.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from caramba.model.config import ModelConfig, _gemma_fields

SUPPORTED_ARCHS = ("llama", "qwen2", "gemma3")

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
# Gemma's norms: four per layer (ffn_norm is the MLP's pre-norm there) and QK-norm.
_GEMMA_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
                "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


# Parsed files by (path, device, inode, size, mtime): one process parses a file once (a first
# `caramba generate` read the same GGUF three times: preflight, config, conversion).
_READERS: dict[tuple, object] = {}
_KEEP_READERS = 4


def open_gguf(path: Path):
    """ggml-org's reader of `path`, parsed once per process while the file is unchanged."""
    try:
        st = Path(path).stat()
        key = (str(Path(path).resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    except OSError as e:
        raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None
    if key in _READERS:
        _READERS[key] = _READERS.pop(key)   # most recently used last
        return _READERS[key]
    try:
        reader = _reader_class()(str(path))
    except Exception as e:  # the reader raises bare ValueError/struct errors on bad files
        raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None
    _READERS[key] = reader
    while len(_READERS) > _KEEP_READERS:
        _READERS.pop(next(iter(_READERS)))
    return reader


@functools.cache
def _reader_class():
    """gguf.GGUFReader reading through a plain ndarray view of its np.memmap: the reader slices
    its data once per metadata value (two slices per vocabulary string), and a memmap slice pays
    numpy's memmap bookkeeping each time: SmolLM2's 49k-token vocabulary took 2.3 s to parse, 0.75 s
    this way. The same bytes (the view shares the mapping); tensors come back as plain arrays."""
    import gguf

    class FastReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._mapped

        @data.setter
        def data(self, value):
            self._mapped = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return FastReader


def field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def config_from_gguf(reader) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")

    def req(key: str):
        value = field(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"GGUF metadata lacks '{arch}.{key}'")
        return value

    def size(key: str, default=None) -> int:
        value = req(key) if default is None else field(reader, f"{arch}.{key}", default)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"GGUF metadata '{arch}.{key}' = {value!r} must be a positive integer")
        return int(value)

    n_heads, dim = size("attention.head_count"), size("embedding_length")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = field(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else None)
    if vocab is None:
        raise ValueError(f"GGUF metadata lacks '{arch}.vocab_size' and 'tokenizer.ggml.tokens'")
    names = {t.name for t in reader.tensors}
    if arch == "gemma3":
        return _gemma3_config(reader, size, req, int(vocab), names)
    scaling = None
    if field(reader, f"{arch}.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(field(reader, f"{arch}.rope.scaling.factor"))}
    if "rope_freqs.weight" in names:  # llama3-style scaling baked into per-frequency divisors
        freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        scaling = {"rope_type": "factors", "factors": [float(x) for x in np.asarray(freqs.data).reshape(-1)]}
    return ModelConfig(
        vocab_size=int(vocab),
        dim=dim,
        n_layers=size("block_count"),
        n_heads=n_heads,
        n_kv_heads=size("attention.head_count_kv", n_heads),
        head_dim=size("attention.key_length", max(1, dim // n_heads)),
        intermediate_size=size("feed_forward_length"),
        norm_eps=float(req("attention.layer_norm_rms_epsilon")),
        rope_theta=float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(field(reader, f"{arch}.context_length", 2048)),
        tie_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        name=arch,
    )


def _gemma3_config(reader, size, req, vocab: int, names: set[str]) -> ModelConfig:
    """Gemma 3 from its GGUF metadata, through the same fields as its config.json (ModelConfig.from_hf)."""
    hf = {"vocab_size": vocab, "hidden_size": size("embedding_length"), "num_hidden_layers": size("block_count"),
          "num_attention_heads": size("attention.head_count"), "intermediate_size": size("feed_forward_length"),
          "num_key_value_heads": size("attention.head_count_kv", size("attention.head_count")),
          "head_dim": size("attention.key_length"), "rms_norm_eps": float(req("attention.layer_norm_rms_epsilon")),
          "rope_theta": float(field(reader, "gemma3.rope.freq_base", 1e6)),
          "max_position_embeddings": int(field(reader, "gemma3.context_length", 32768)),
          "sliding_window": size("attention.sliding_window", 4096),
          "query_pre_attn_scalar": 256,   # Gemma3TextConfig's default: the file does not say
          "tie_word_embeddings": "output.weight" not in names}
    try:
        return ModelConfig(**_gemma_fields("gemma3", hf))
    except KeyError as e:
        raise ValueError(f"GGUF metadata lacks {e}") from None


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (None: not a model tensor)."""
    parts = gguf_name.split(".")
    layer_names = _GEMMA_NAMES if arch == "gemma3" else _LAYER_NAMES
    if parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    if parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    return None


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's `permute` (rows per head: interleaved pairs -> two halves)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def read_gguf_tensors(reader, cfg: ModelConfig, on_tensor: Callable[[str], None] | None = None) -> dict[str, torch.Tensor]:
    """Dequantize every model tensor to float32, keyed by HF names."""
    from gguf import quants

    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name, cfg.name)
        if name is None:
            continue
        try:
            array = quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ValueError(f"tensor {t.name} has GGUF type {t.tensor_type.name}, which the gguf reader cannot dequantize") from None
        w = torch.from_numpy(np.array(array, dtype=np.float32))  # a copy: F32 tensors come as read-only memmaps
        if cfg.name == "llama" and ".q_proj." in name:
            w = unpermute_rows(w, cfg.n_heads)
        elif cfg.name == "llama" and ".k_proj." in name:
            w = unpermute_rows(w, cfg.n_kv_heads)
        elif cfg.name == "gemma3" and name.endswith("norm.weight"):
            w = w - 1   # the file's 1 + w, back to HF's w
        out[name] = w
        if on_tensor is not None:
            on_tensor(t.name)
    return out
