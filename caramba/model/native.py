"""caramba's own model directory: config.json (a ModelConfig), model.safetensors (the fused
parameter names of caramba.model.transformer) and the tokenizer files.

It is what a GGUF is converted to once (caramba.model.zoo's cache) and what `caramba convert-dba`
writes; `load_model(DIR)` tells it from an HF directory by its config.json: a ModelConfig has
`n_layers` and no `model_type`. It holds models transformers has no class for (decoupled attention).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from caramba.model.config import ModelConfig
from caramba.tokenizer import Tokenizer


def is_native_dir(path: Path) -> bool:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(cfg, dict) and "n_layers" in cfg and "model_type" not in cfg


def save_native(target: Path, cfg: ModelConfig, state: dict[str, torch.Tensor], tokenizer: Tokenizer) -> None:
    """Write the directory atomically: a crash leaves no half-written `target`, and an existing
    one is replaced only once the new one is complete."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)   # mkdtemp's 0700 would outlive the rename
    try:
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(cfg.to_json())
        tokenizer.save(tmp)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_native(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    try:
        cfg = ModelConfig.from_dict(json.loads((path / "config.json").read_text()))
    except TypeError as e:   # a field this version does not know
        raise ValueError(f"{path / 'config.json'} is not a config this caramba can read: {e}") from None
    if not (path / "model.safetensors").is_file():
        raise ValueError(f"{path} has a caramba config.json but no model.safetensors")
    return cfg, load_file(str(path / "model.safetensors")), Tokenizer.from_dir(path)
