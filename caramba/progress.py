"""Progress that a reader sees wherever the output goes.

rich's bar draws on a terminal and nothing at all in a CI log or a pipe, where a long command
then looks hung. `Steps` keeps the bar and, where it cannot draw, prints a line at every tenth
of the work with the seconds so far.
"""

from __future__ import annotations

import time

from rich.progress import Progress


class Steps:
    """One task of a rich Progress: `update(done)` / `advance()`, `describe(text)`, `close()`."""

    def __init__(self, bar: Progress, label: str, total: int) -> None:
        self.bar, self.label, self.total = bar, label, max(total, 1)
        self.task = bar.add_task(label, total=self.total)
        self.done = self.shown = 0
        self.start = time.perf_counter()

    def update(self, done: int) -> None:
        self.done = done
        self.bar.update(self.task, completed=done)
        console = self.bar.console
        tenth = done * 10 // self.total
        if not console.is_terminal and not self.bar.disable and tenth > self.shown:
            self.shown = tenth
            console.print(f"{self.label}: {done}/{self.total} ({time.perf_counter() - self.start:.0f} s)",
                          highlight=False)

    def advance(self) -> None:
        self.update(self.done + 1)

    def describe(self, text: str) -> None:
        self.bar.update(self.task, description=text)

    def close(self) -> None:
        self.bar.remove_task(self.task)
