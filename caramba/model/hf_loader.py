"""Read an HF model directory: config.json plus one or sharded safetensors files."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from caramba.model.config import ModelConfig


# A config.json or shard index is a few KiB; reading more than this is a wrong or hostile file.
MAX_JSON_BYTES = 16 << 20


def read_json_file(file: Path) -> object:
    """A small JSON file, read bounded; ValueError naming the file when it is not one."""
    if not file.is_file():  # a FIFO would block, /dev/zero never ends
        raise ValueError(f"{file} is not a regular file")
    with open(file, "rb") as f:
        raw = f.read(MAX_JSON_BYTES + 1)
    if len(raw) > MAX_JSON_BYTES:
        raise ValueError(f"{file} is over {MAX_JSON_BYTES >> 20} MiB, which no model config is")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None


def config_from_dir(path: Path) -> ModelConfig:
    config_file = path / "config.json"
    if not config_file.exists():
        raise ValueError(f"{path} has no config.json (an HF model directory needs config.json + *.safetensors)")
    hf = read_json_file(config_file)
    try:
        return ModelConfig.from_hf(hf)
    except KeyError as e:
        raise ValueError(f"{config_file} lacks {e}") from None
    except ValueError as e:
        raise ValueError(f"{config_file}: {e}") from None
    except (TypeError, AttributeError) as e:  # a field of the wrong JSON type where a number or object belongs
        raise ValueError(f"{config_file} has a field of the wrong type ({e})") from None


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json_file(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(s, str) and "/" not in s for s in weight_map.values()):
            raise ValueError(f"{index} has no weight_map of tensor name -> shard file name")
        files = [path / s for s in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} holds no *.safetensors weights")
    absent = [f.name for f in files if not f.exists()]
    if absent:
        raise ValueError(f"{path} is missing shards listed in its index: {', '.join(absent)}")
    odd = [f.name for f in files if not f.is_file()]
    if odd:  # a FIFO or device would block or never end
        raise ValueError(f"{path}: {', '.join(odd)} is not a regular file")
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
