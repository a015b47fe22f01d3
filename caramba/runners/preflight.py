"""Preflight: every check that can fail a run of a manifest, run on all selected runs before any
record is written, so a bad run 5 exits 2 (naming the run and the field) instead of failing
mid-manifest with runs 1-4 half-done.

Cheap on purpose: model sources are resolved, not loaded; each source's config and tokenizer
are read once (a GGUF parsed once), whatever the number of runs; of the weights only their
headers are read, to know each file holds all the bytes they list (a truncated copy fails here).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from caramba.errors import UserError
from caramba.manifest import ResolvedRun
from caramba.model import gguf_loader, hf_loader, native, quant
from caramba.model.config import ModelConfig
from caramba.model.zoo import CACHE_FORMAT, cache_root, file_sha256, inspect_source, resolve_device, resolve_source
from caramba.prompting import encode_prompt
from caramba.runners import registry
from caramba.runners.resources import check_memory, check_runs_dir
from caramba.runs import LOCK, OLD, STAGING, runs_root
from caramba.tokenizer import Tokenizer

# Room left in a path for the longest name written inside a record directory
# (".result.json.<8 random>.tmp", cells.csv, the plots' PNGs).
_FILE_ROOM = 64


def preflight(manifest_name: str, runs: list[ResolvedRun], root: str | Path | None = None) -> None:
    """Raise UserError (exit 2) on the first run that cannot succeed. Linear in the runs: each
    model source is inspected (a GGUF parsed) once, each prompt list tokenized once per model."""
    check_runs_dir(manifest_name, runs, root)   # a writable directory with room for the records
    sources = Sources()
    devices: set[str] = set()
    limits = _limits(runs_root(root).absolute())
    for r in runs:
        where = f"run {r.target}/{r.run.id}"
        _check_path_lengths(manifest_name, r, where, root, limits)
        check_run(r, where, sources, devices)
    configs = {spec.source: sources.config(spec.source) for r in runs for spec in (r.model, r.draft) if spec is not None}
    check_memory(runs, configs)   # weights + KV cache + activations against MemAvailable


def check_run(r: ResolvedRun, where: str, sources: Sources | None = None, devices: set[str] | None = None) -> None:
    """Every check of one run that needs no runs directory: its models (path, config, whole
    weights, a tokenizer within the vocabulary), its mode's own checks and the text files it
    reads. `caramba run` calls it per run; the one-off commands (generate, eval, bench) for
    their one run, so a flag fails as its manifest field would, with exit 2 before any work."""
    sources = sources if sources is not None else Sources()
    devices = devices if devices is not None else set()
    for field, spec in (("model", r.model), ("draft", r.draft)):
        if spec is None:
            continue
        try:
            path = sources.path(spec.source)
            sources.config(spec.source)   # the config too, not only the path: one error up front
            sources.check_weights(spec.source)
            if spec.device not in devices:
                resolve_device(spec.device)
                devices.add(spec.device)
        except UserError as e:
            raise UserError(f"{where}: {field}: {e}") from None
        check_native_source(spec.weights, path, spec.source, where, field)
        _check_vocabulary(spec.source, sources, where, field)
    mode = registry.get(r.run.mode)
    text = getattr(r.run.settings, "text", None)
    if text is not None:   # before the mode's checks, which may read it
        check_text(text, f"{where}: {mode.section}.text")
    mode.preflight(r, where, sources)
    if r.draft is not None:
        target, draft = sources.tokenizer(r.model.source), sources.tokenizer(r.draft.source)
        if draft.vocab_size != target.vocab_size:
            raise UserError(f"{where}: draft.source {r.draft.source!r} has a vocabulary of {draft.vocab_size} "
                            f"tokens, the model {target.vocab_size}; speculative decoding needs a draft with "
                            "the same tokenizer")


def check_native_source(weights: str, path: Path, source: str, where: str, field: str) -> None:
    """weights native / native_i16 keep a GGUF's own blocks: UserError naming `field` when the source is not a file."""
    if weights in quant.NATIVE_ACT and not path.is_file():
        raise UserError(f"{where}: {field}.weights: '{weights}' keeps a GGUF file's own blocks, but "
                        f"{field}.source {source!r} is not a .gguf; use weights q8_0 or q4_0 (they "
                        "quantize any source) or fp32")


def check_text(path: str | Path, field: str) -> None:
    """A text file a run reads: a regular file of UTF-8 text (what corpus_text decodes), else
    UserError naming the field, so a bad file is exit 2 up front and not a raw error mid-run."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{field}: {path}: " + ("not a regular file" if path.exists() else "no such file"))
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(f"{field}: cannot read {path}: {e.strerror or e}") from None
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise UserError(f"{field}: {path} is not UTF-8 text ({e.reason} at byte {e.start}, line {line}); "
                        "convert it (e.g. iconv -t utf-8) or give another file") from None


def safetensors_problem(file: Path) -> str | None:
    """Why a safetensors file cannot hold what its header lists (truncated, not safetensors),
    or None; reads the header only."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or n > size - 8:
            return f"{size} bytes: too short for the safetensors header it announces"
        try:
            header = json.loads(f.read(n))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "its header is not a safetensors header"
    need = 8 + n + max(ends, default=0)
    if size < need:
        return f"{size} bytes, but its header lists tensors up to byte {need}: the file is truncated"
    return None


class Sources:
    """What preflight knows of each model source, found once: its path, config and tokenizer
    (a GGUF's from the same parse as its config, or from the converted copy load_model keeps);
    `seen`: keys of the checks a sweep's runs share, done once (a mode's preflight adds them)."""

    def __init__(self) -> None:
        self._paths: dict[str, Path] = {}
        self._configs: dict[str, ModelConfig] = {}
        self._tokenizers: dict[str, Tokenizer] = {}
        self._readers: dict[str, object] = {}   # a GGUF's reader, until its tokenizer is built
        self._encoded: dict[tuple, list[int]] = {}
        self._largest: dict[str, int] = {}
        self._copies: dict[str, Path | None] = {}
        self._weighed: set[str] = set()
        self.seen: set[str] = set()

    def path(self, source: str) -> Path:
        if source not in self._paths:
            self._paths[source] = resolve_source(source)
        return self._paths[source]

    def config(self, source: str) -> ModelConfig:
        if source not in self._configs:
            path = self.path(source)
            converted = self._converted(source)
            if path.is_dir() or converted is not None:   # a GGUF's converted copy holds its config
                self._configs[source] = inspect_source(source if path.is_dir() else str(converted))
            else:
                try:
                    reader = gguf_loader.open_gguf(path)
                    self._configs[source] = gguf_loader.config_from_gguf(reader)
                except ValueError as e:
                    raise UserError(f"cannot load model {source!r}: {e}") from None
                self._readers[source] = reader
                _check_gguf_extent(reader, path, source)
        return self._configs[source]

    def check_weights(self, source: str) -> None:
        """The weights load_model will read are whole: each safetensors file (a directory's, or a
        GGUF's converted copy) holds every byte its header lists. A GGUF is measured when parsed."""
        if source in self._weighed:
            return
        path, copy = self.path(source), self._converted(source)
        if path.is_dir() and native.is_native_dir(path):   # caramba's own layout
            files = [path / "model.safetensors"]
        elif path.is_dir():
            try:
                files = hf_loader.safetensors_files(path)
            except ValueError as e:
                raise UserError(f"cannot load model {source!r}: {e}") from None
        else:   # a GGUF loads from its converted copy when there is one
            files = [copy / "model.safetensors"] if copy is not None else []
        for file in files:
            why = safetensors_problem(file) if file.is_file() else None
            if why:
                raise UserError(f"cannot load model {source!r}: {file}: {why}; copy or convert the weights again")
        self._weighed.add(source)

    def tokenizer(self, source: str) -> Tokenizer:
        """The tokenizer of a model source, without its weights."""
        if source not in self._tokenizers:
            path = self.path(source)
            try:
                if path.is_dir():
                    if not native.is_native_dir(path) and not (path / "tokenizer.json").is_file():
                        raise ValueError(f"{path} has no tokenizer.json; save the tokenizer next to the weights "
                                         "(transformers: tokenizer.save_pretrained(dir), for a fast tokenizer)")
                    self._tokenizers[source] = Tokenizer.from_dir(path)
                elif self._converted(source) is not None:
                    self._tokenizers[source] = Tokenizer.from_dir(self._converted(source))
                else:
                    self.config(source)   # the same parse gives the tokenizer
                    self._tokenizers[source] = Tokenizer.from_gguf(path, reader=self._readers[source])
            except ValueError as e:
                raise UserError(f"cannot load the tokenizer of model '{source}': {e}") from None
            self._readers.pop(source, None)
        return self._tokenizers[source]

    def largest_id(self, source: str) -> int:
        if source not in self._largest:
            vocab = self.tokenizer(source).backend.get_vocab(with_added_tokens=True)
            self._largest[source] = max(vocab.values(), default=-1)
        return self._largest[source]

    def _converted(self, source: str) -> Path | None:
        """A GGUF's converted copy (as load_model keeps it), when there is one."""
        if source not in self._copies:
            path = self.path(source)
            copy = None if path.is_dir() else cache_root() / f"{file_sha256(path)[:24]}-v{CACHE_FORMAT}"
            self._copies[source] = copy if copy is not None and (copy / "model.safetensors").is_file() else None
        return self._copies[source]

    def prompt_lengths(self, source: str, s) -> list[int]:
        """Token counts of a run's prompts as the engine will see them; a sweep's runs share them."""
        key = (source, tuple(s.prompts), s.chat, s.system_prompt)
        if key not in self._encoded:
            tok = self.tokenizer(source)
            self._encoded[key] = [len(encode_prompt(tok, p, s.chat, s.system_prompt)) for p in s.prompts]
        return self._encoded[key]


def _check_gguf_extent(reader, path: Path, source: str) -> None:
    """A GGUF holds every tensor its header lists (the reader maps the file and checks nothing)."""
    size = path.stat().st_size
    end = max((int(t.data_offset) + int(t.n_bytes) for t in getattr(reader, "tensors", [])), default=0)
    if end > size:
        raise UserError(f"cannot load model {source!r}: {path} has {size} bytes, but its tensors reach byte {end}: "
                        "the file is truncated; download it again")


def _check_vocabulary(source: str, sources: Sources, where: str, field: str) -> None:
    """Every id the tokenizer can produce must have an embedding row: a tokenizer from other
    weights would fail mid-run with an IndexError on the first id past the model's vocabulary."""
    rows = sources.config(source).vocab_size
    largest = sources.largest_id(source)
    if largest >= rows:
        raise UserError(f"{where}: {field}.source {source!r}: its tokenizer has ids up to {largest}, but the model "
                        f"has {rows} embedding rows (vocab_size {rows}); the tokenizer belongs to other weights: "
                        "use the tokenizer saved with this model")


def _check_path_lengths(manifest_name: str, r: ResolvedRun, where: str, root, limits: tuple[int, int]) -> None:
    """Names the filesystem would refuse (over NAME_MAX bytes, or a path over PATH_MAX)."""
    base = runs_root(root).absolute()
    name_max, path_max = limits
    longest = f".{r.run.id}{max(STAGING, OLD, LOCK, key=len)}"   # the longest name a run puts on disk
    for field, name, on_disk in (("name", manifest_name, manifest_name), ("targets[].name", r.target, r.target),
                                 ("id", r.run.id, longest)):
        size = len(os.fsencode(on_disk))
        if size > name_max:
            raise UserError(f"{where}: {field} {name[:40]!r}... is too long for a directory name here: the record "
                            f"needs {size} bytes, the filesystem allows {name_max}; use a shorter {field}")
    path = base / manifest_name / r.target / longest
    size = len(os.fsencode(str(path))) + _FILE_ROOM
    if size > path_max:
        raise UserError(f"{where}: the record path {path} is too long ({size} bytes with its files, the limit is "
                        f"{path_max}); use shorter names or a shorter runs directory (CARAMBA_RUNS_DIR)")


def _limits(path: Path) -> tuple[int, int]:
    """(NAME_MAX, PATH_MAX) of the filesystem holding `path` (its nearest existing parent)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return os.pathconf(probe, "PC_NAME_MAX"), os.pathconf(probe, "PC_PATH_MAX")
    except (OSError, ValueError, AttributeError):   # no pathconf (Windows): the common limits
        return 255, 4096


_Sources = Sources   # its old name
