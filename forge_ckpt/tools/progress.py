"""Progress of a long command (export, verify, copy) in bytes, on stderr so stdout stays the
command's result (a table, or the `--json` object).

On a terminal: a rich progress bar that redraws in place. Otherwise (a pipe, a log file, CI):
plain lines, one each time another tenth is done, so a log shows the command moving without
a line per tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

Advance = Callable[[int, int], None]  # (bytes done, bytes in all)


@contextmanager
def progress(label: str, console: Console | None = None) -> Iterator[Advance]:
    """A callback `(done, total)` that shows `label`'s progress on `console` (stderr)."""
    console = console or Console(stderr=True)
    if console.is_terminal:
        with _bar(label, console) as advance:
            yield advance
    else:
        yield _lines(label, console)


@contextmanager
def _bar(label: str, console: Console) -> Iterator[Advance]:
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(label, total=None)

        def advance(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield advance


def _lines(label: str, console: Console) -> Advance:
    last = [-1]

    def advance(done: int, total: int) -> None:
        tenth = 10 if total <= 0 else min(10, done * 10 // total)
        if tenth > last[0]:
            last[0] = tenth
            console.print(
                f"{label}: {tenth * 10}% ({done / 1e6:,.1f} of {total / 1e6:,.1f} MB)",
                highlight=False,
            )

    return advance
