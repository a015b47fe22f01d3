"""Read an HF model directory: config.json plus one or sharded safetensors files."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from caramba.model.config import ModelConfig


def config_from_dir(path: Path) -> ModelConfig:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} has no config.json (an HF model directory needs config.json + *.safetensors)")
    try:
        hf = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file} is not valid JSON: {e}") from None
    try:
        return ModelConfig.from_hf(hf)
    except KeyError as e:
        raise ValueError(f"{config_file} lacks {e}") from None


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / s for s in shards]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} holds no *.safetensors weights")
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise ValueError(f"{path} is missing shards listed in its index: {', '.join(absent)}")
    return files


def read_hf_tensors(path: Path, cfg: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """Every tensor, named as transformers names them (`cfg` says which family's prefix)."""
    tensors: dict[str, torch.Tensor] = {}
    for f in safetensors_files(path):
        try:
            tensors.update(load_file(str(f)))
        except Exception as e:  # safetensors raises its own error types on corrupt headers
            raise ValueError(f"{f} is not a readable safetensors file ({e})") from None
    # Some checkpoints name the decoder without its prefix (`model.`; GPT-2's hub files: `transformer.`).
    prefix = "transformer." if cfg is not None and cfg.name == "gpt2" else "model."
    return {k if k.startswith((prefix, "lm_head.")) else prefix + k: v for k, v in tensors.items()}
