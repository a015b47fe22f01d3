"""When a row stops, and why: eos ids, token-id stop sequences and string stop sequences.

`StopChecker` keeps, per row, the finish reason ("eos" | "stop_sequence" | "length", the last
when nothing else stopped it) and the trailing tokens a stop sequence can span. String stops are
matched in the decoded text of those tokens, so a stop split across token boundaries is found.
Two ways in, the same rules: `update` for a step of one token per row (tensors; the Generator,
contrastive search), `check` for one token of one row (speculative decoding emits accepted
tokens row by row). Beam search reads `is_eos` for its candidates.

It also owns the ids the decoders derive from the config: the eos ids (the tokenizer's when the
config names none) and the pad id written where a row has stopped.
"""

from __future__ import annotations

import torch

EXTRA_TOKENS = 8   # trailing tokens kept beyond the longest stop sequence's length


def fill_eos_from_tokenizer(config, tokenizer) -> None:
    """config.eos_token_id None + a tokenizer: every end-of-reply id the model declares (eos,
    eot, ...), not only eos."""
    if config.eos_token_id is None and tokenizer is not None:
        stops = list(getattr(tokenizer, "stop_token_ids", ()) or [tokenizer.eos_token_id])
        config.eos_token_id = [i for i in stops if i is not None] or None


def pad_id_for(config) -> int:
    """config.pad_token_id, else the first eos id, else 0."""
    eos = config.eos_ids()
    return config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)


class StopChecker:
    def __init__(self, eos_ids, stop_sequences=(), tokenizer=None, device: torch.device | str = "cpu",
                 owner: str = "Generator") -> None:
        self.eos_ids = list(eos_ids)
        self.eos_set = set(self.eos_ids)
        self.eos = torch.tensor(self.eos_ids, dtype=torch.long, device=device)   # [n_eos]
        self.strings = [s for s in stop_sequences if isinstance(s, str)]
        self.ids = [list(s) for s in stop_sequences if not isinstance(s, str)]
        if self.strings and tokenizer is None:
            raise ValueError(f"string stop_sequences need a tokenizer: {owner}(..., tokenizer=tok)")
        self.tokenizer = tokenizer
        self.has_sequences = bool(self.strings or self.ids)
        self.keep = max([len(s) for s in self.strings] + [len(s) for s in self.ids] + [1]) + EXTRA_TOKENS
        self.start(0)

    @classmethod
    def for_config(cls, config, tokenizer=None, device: torch.device | str = "cpu", owner: str = "Generator") -> StopChecker:
        """The config's eos ids (the tokenizer's when it names none: set on the config too) and stop sequences."""
        fill_eos_from_tokenizer(config, tokenizer)
        return cls(config.eos_ids(), config.stop_sequences, tokenizer, device, owner)

    def start(self, batch_size: int) -> None:
        """A new set of rows: every reason "length", no trailing tokens."""
        self.reasons = ["length"] * batch_size
        self.recent: list[list[int]] = [[] for _ in range(batch_size)]

    def is_eos(self, tokens: torch.Tensor) -> torch.Tensor:
        """Bool tensor of tokens' shape: which are eos ids."""
        return torch.isin(tokens, self.eos) if len(self.eos_ids) else torch.zeros_like(tokens, dtype=torch.bool)

    def update(self, new: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """One new token per row (new [B]; active [B]: rows still running) -> active after it."""
        if self.eos_ids:
            hit = torch.isin(new, self.eos) & active
            for row in hit.nonzero().flatten().tolist():
                self.reasons[row] = "eos"
            active = active & ~hit
        if self.has_sequences:
            active = active.clone()
            for row in active.nonzero().flatten().tolist():
                if self._sequence_hit(row, int(new[row])):
                    active[row] = False
        return active

    def check(self, row: int, token: int) -> str | None:
        """One new token of one row -> "eos" | "stop_sequence" when it stops the row, else None."""
        if token in self.eos_set:
            self.reasons[row] = "eos"
            return "eos"
        if self.has_sequences and self._sequence_hit(row, token):
            return "stop_sequence"
        return None

    def _sequence_hit(self, row: int, token: int) -> bool:
        ids = self.recent[row]
        ids.append(token)
        del ids[: -self.keep]
        hit = any(len(ids) >= len(s) and ids[-len(s):] == s for s in self.ids)
        if not hit and self.strings:
            text = self.tokenizer.decode(ids)
            hit = any(s in text for s in self.strings)
        if hit:
            self.reasons[row] = "stop_sequence"
        return hit


__all__ = ["StopChecker", "fill_eos_from_tokenizer", "pad_id_for"]
