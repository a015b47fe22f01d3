"""Prefilled contexts kept between eval runs: a content-addressed store of the baseline's context KV.

An eval's most expensive shareable work is the shared prefill: every batch of samples has its
context prefilled once through the baseline's cache, then stored in each candidate's kinds
(caramba.evaluation.task_eval). A rerun, or the same samples with one more candidate, prefills the
same tokens through the same model again. `ContextStore` keeps each prefill's result, the
baseline cache's keys and values with the rows' positions and padding (and the kept masks of
the presses that watched it), as one safetensors file under the runs directory:

    runs/.context-cache/<sha256 of the key>.safetensors

The key (`key_of`) is everything the prefill's result depends on: the model (its weights'
sha256, dtype, device type, module types and formats, config), caramba's and torch's versions,
the batch's context ids and padding id, the baseline's cache policy and window, the prefill's
chunking and the path its forwards take (torch or the fused C step). Not the thread count.

Entries are written atomically (caramba.runs.atomic_write_bytes) and hold their key and a
sha256 of their tensors in the file's metadata; a read recomputes both. A file that does not
parse, whose key is not the one asked for, or whose checksum does not match is a bad entry:
it is removed and the prefill recomputed, never trusted. The store is bounded (`max_bytes`,
default CARAMBA_CONTEXT_STORE_MB or 4096 MiB; 0 turns it off): after each write the least
recently used entries (a hit touches its file) go until the rest fit.

An eval's context store writes in the background (`background=True`): an entry is made (copied,
digested, serialized) in the caller's thread, and one writer thread writes and fsyncs it while
the eval goes on, holding at most `PENDING_BYTES` of entries not yet written (any one entry,
however large); `flush()`, or leaving a `writing()` block, waits for them and raises a write that
failed. Of a 2k-token context's ~0.47 s to save, ~0.27 s was the write and its fsync (Zen 4, a
`/tmp` benchmark, median of 5).

`EntryStore` is that machinery for any entry (keyed file names, verified reads, atomic writes,
the bound); the answer store (caramba.evaluation.answer_store) keeps its JSON entries with it.
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as st_save

from caramba.runs import atomic_write_bytes

DIRNAME = ".context-cache"
SUFFIX = ".safetensors"
FORMAT = 1
DEFAULT_MB = 4096
ENV = "CARAMBA_CONTEXT_STORE_MB"
# what a background store holds in memory while it is written, beyond the entry being made: two of
# SmolLM2's 2k-token entries (94 MB each); a larger entry waits for the writes before it
PENDING_BYTES = 256 * 2**20


def default_max_bytes() -> int:
    """CARAMBA_CONTEXT_STORE_MB (0: no store) in bytes, or DEFAULT_MB."""
    text = os.environ.get(ENV, "").strip()
    try:
        mb = float(text) if text else DEFAULT_MB
    except ValueError:
        raise ValueError(f"{ENV}={text!r}: give a size in MiB (0 turns the context store off)") from None
    return max(0, int(mb * 2**20))


def canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def ids_sha256(ids) -> str:
    """A token id sequence's sha256, as the stores' keys name ids."""
    return hashlib.sha256(str(list(ids)).encode()).hexdigest()


def model_identity(model, content_hash: str) -> dict:
    """What a model's prefill depends on besides its input: its weights' sha256 and how they are
    held (dtype, device, each module's type and quantized format), and its config."""
    modules = [(name, type(m).__name__, getattr(m, "fmt", None), getattr(m, "act", None), getattr(m, "layout", None))
               for name, m in model.named_modules()]
    config = asdict(model.config) if is_dataclass(model.config) else vars(model.config)
    return {"sha256": content_hash, "dtype": str(model.dtype), "device": model.device.type,
            "modules": hashlib.sha256(canonical(modules).encode()).hexdigest(),
            "config": hashlib.sha256(canonical(config).encode()).hexdigest()}


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(canonical([name, str(t.dtype), list(t.shape)]).encode())
        if t.numel():   # the tensor's own bytes (a copy of a 2k-token context's ~90 MB took ~30 ms)
            h.update(memoryview(t.view(torch.uint8).numpy()).cast("B"))
    return h.hexdigest()


class EntryStore(abc.ABC):
    """Entries named by the sha256 of their key in one directory (see the module doc): read
    verified, written atomically, bounded with the least recently used out first. A subclass
    says what an entry's file holds (`_read`); `model` is the model's part of every key
    (model_identity). `reused`, `computed`, `bad`, the keys (entry names, the sha256 of each key)
    reused and computed, and the seconds count what this store's lookups found and cost, for the
    record. background: entries are written by a writer thread (see the module doc); `write_s` is
    its time, which the caller's `save_s` no longer pays."""

    suffix = SUFFIX

    def __init__(self, directory: Path, max_bytes: int | None = None, model: dict | None = None,
                 background: bool = False) -> None:
        self.dir = directory
        self.max_bytes = default_max_bytes() if max_bytes is None else max_bytes
        self.model = model
        self.background = background
        self._writer: ThreadPoolExecutor | None = None
        self._writes: dict[Path, tuple[Future, int]] = {}   # entries being written (and their bytes), oldest first
        self.reused = self.computed = 0
        self.load_s = self.save_s = 0.0   # reading and verifying the entries reused; writing new ones
        self.write_s = 0.0                # the writer thread's writes (background)
        self.written_bytes = 0            # the entries this store wrote
        self.evicted: list[str] = []      # entries this store wrote and then evicted to stay in its bound
        self.too_large: dict[str, int] = {}   # entries not kept, each larger than the whole bound: their bytes
        self.bad: list[str] = []          # entries found bad and removed: "<file>: why"
        self.reused_keys: list[str] = []      # the entries reused / (re)computed: their files' sha256 names
        self.computed_keys: list[str] = []

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def path_of(self, key: dict) -> Path:
        return self.dir / (hashlib.sha256(canonical(key).encode()).hexdigest() + self.suffix)

    @abc.abstractmethod
    def _read(self, path: Path) -> tuple[dict, object, str]:
        """(the entry's metadata: its key and sha256, its payload, the payload's sha256 computed
        now) of the entry file at path; OSError where it cannot be read, anything else where it
        does not parse. Each store says what its entries are."""

    def _load(self, key: dict):
        """The payload of the entry for `key`, verified; None when there is none or it was bad
        (then removed)."""
        if not self.enabled:
            return None
        path = self.path_of(key)
        if path in self._writes:   # being written: read it once written (a failed write raises here)
            self._writes.pop(path)[0].result()
        try:
            meta, payload, digest = self._read(path)
        except FileNotFoundError:
            return None
        except OSError as e:
            self._discard(path, f"unreadable ({e.strerror or e})")   # safetensors' own OSErrors carry no strerror
            return None
        except Exception as e:   # noqa: BLE001 - any parse failure is a corrupt entry
            self._discard(path, f"corrupt ({type(e).__name__})")
            return None
        if meta.get("key") != canonical(key):
            self._discard(path, "key mismatch")
            return None
        if meta.get("sha256") != digest:
            self._discard(path, "checksum mismatch")
            return None
        try:
            os.utime(path)       # recently used: the last to go
        except OSError:
            pass
        return payload

    def _save(self, key: dict, data: bytes) -> bool:
        """Write `data` as the entry for `key` (atomically), then evict the least recently used
        entries beyond max_bytes. False when it was not kept (larger than the bound). background:
        queued for the writer; a write that fails raises at the next save, a load of its entry or
        flush()."""
        path = self.path_of(key)
        if len(data) > self.max_bytes:
            self.too_large[path.stem] = len(data)
            return False
        self.dir.mkdir(parents=True, exist_ok=True)
        if not self.background:
            self._write(path, data)
            return True
        for done in [p for p, (f, _) in self._writes.items() if f.done()]:
            self._writes.pop(done)[0].result()
        while self._writes and sum(n for _, n in self._writes.values()) + len(data) > PENDING_BYTES:
            self._writes.pop(next(iter(self._writes)))[0].result()   # bounded memory: wait for the oldest
        if path in self._writes:   # the same entry again: after the write before it
            self._writes.pop(path)[0].result()
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="caramba-entry-writer")
        self._writes[path] = (self._writer.submit(self._write, path, data), len(data))
        return True

    def _write(self, path: Path, data: bytes) -> None:
        t0 = time.perf_counter()
        atomic_write_bytes(path, data)
        self.written_bytes += len(data)
        self._evict(keep=path)
        self.write_s += time.perf_counter() - t0

    def flush(self) -> None:
        """Wait for every background write and stop the writer; raise the first that failed (the
        rest are still waited for). The wait counts as saving (save_s)."""
        t0 = time.perf_counter()
        failed: BaseException | None = None
        while self._writes:
            try:
                self._writes.pop(next(iter(self._writes)))[0].result()
            except Exception as e:   # noqa: BLE001 - raised below, once every write is done
                failed = failed or e
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        self.save_s += time.perf_counter() - t0
        if failed is not None:
            raise failed

    @contextmanager
    def writing(self) -> Iterator[None]:
        """A block that saves entries: on leaving it every write is done (flush). Left by an error or
        Ctrl-C, the writes under way still finish (complete entries are kept), and that error is
        the one raised."""
        try:
            yield
        except BaseException:
            try:
                self.flush()
            except Exception:   # noqa: BLE001, S110 - the block's own error is the one to report
                pass
            raise
        self.flush()

    def _evict(self, keep: Path) -> None:
        entries = []
        for p in self.dir.glob(f"*{self.suffix}"):
            try:
                st = p.stat()
            except OSError:
                continue
            entries.append((st.st_mtime, p != keep, st.st_size, p))
        total = sum(e[2] for e in entries)
        for _, _, size, p in sorted(entries):    # oldest first; the entry just written last
            if total <= self.max_bytes:
                break
            if p == keep:
                continue
            p.unlink(missing_ok=True)
            total -= size
            if p.stem in self.computed_keys:   # this run's own: a rerun computes it again
                self.evicted.append(p.stem)

    def _discard(self, path: Path, why: str) -> None:
        self.bad.append(f"{path.name}: {why}")
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass

    def summary(self) -> dict:
        return {"dir": str(self.dir), "reused": self.reused, "computed": self.computed, "bad": list(self.bad),
                "reused_keys": list(self.reused_keys), "computed_keys": list(self.computed_keys),
                "load_s": self.load_s, "save_s": self.save_s, "write_s": self.write_s,
                "written_bytes": self.written_bytes, "evicted": list(self.evicted),
                "too_large": sorted(self.too_large)}

    def bound_note(self) -> str | None:
        """What to tell the researcher when this store could not keep entries of its own run (the
        bound is smaller than the run's entries, or than one entry, so a rerun recomputes them): the
        variable and a size that would have kept them; None when it kept them all."""
        if not (self.evicted or self.too_large):
            return None
        lost = []
        if self.evicted:
            written = len(self.computed_keys) - len(self.too_large)   # a too-large entry was made, not written
            lost.append(f"evicted {len(self.evicted)} of the {written} entries this run wrote")
        if self.too_large:
            lost.append(f"did not keep {len(self.too_large)} larger than its whole bound (the largest "
                        f"{-(-max(self.too_large.values()) // 2**20)} MiB)")
        # this run's entries and a quarter more, in MiB
        need = -(-(self.written_bytes + sum(self.too_large.values())) * 5 // 4 // 2**20)
        return (f"the context store ({self.max_bytes // 2**20} MiB) {' and '.join(lost)}, so a rerun or a new "
                f"candidate prefills those again; set {ENV}={need} (or more) to keep them")


class ContextStore(EntryStore):
    """The prefilled contexts under a runs directory: safetensors files whose metadata holds the
    key and the tensors' sha256."""

    def __init__(self, root: str | Path, max_bytes: int | None = None, model: dict | None = None,
                 background: bool = False) -> None:
        super().__init__(Path(root) / DIRNAME, max_bytes, model, background)

    def _read(self, path: Path) -> tuple[dict, object, str]:
        """The file mapped, not read into memory and copied out of it: a 2k-token context's ~90 MB
        took ~105 ms that way (of a tenth candidate's rerun, ~1 s for nine contexts). The mapping
        is copy-on-write: nothing written to the tensors reaches the file. The checksum still
        reads every byte."""
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        return meta, (tensors, meta), tensors_digest(tensors)

    def load(self, key: dict) -> tuple[dict[str, torch.Tensor], dict] | None:
        """(tensors, extra metadata) of the entry for `key`, verified; None when there is none or
        it was bad (then removed)."""
        got = self._load(key)
        if got is None:
            return None
        tensors, meta = got
        return tensors, json.loads(meta.get("extra", "{}"))

    def save(self, key: dict, tensors: dict[str, torch.Tensor], extra: dict | None = None) -> bool:
        """Write the entry for `key` (atomically), then evict the least recently used entries
        beyond max_bytes. False when it was not kept (store off, or larger than the bound)."""
        if not self.enabled:
            return False
        tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        meta = {"key": canonical(key), "sha256": tensors_digest(tensors), "format": str(FORMAT),
                "extra": canonical(extra or {})}
        return self._save(key, st_save(tensors, metadata=meta))


__all__ = ["ContextStore", "DIRNAME", "EntryStore", "canonical", "default_max_bytes", "ids_sha256", "model_identity", "tensors_digest"]
