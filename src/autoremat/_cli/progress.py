"""The status line of a long command: what it is doing, which stage, and for how long.

NOTE [ Progress on stderr ]
    A profile takes from seconds to minutes, a doctor on a 7B model a minute or two:
    without a word the command looks hung. The library reports stage boundaries to an
    optional ``progress`` callback (``profile``, ``estimate``, ``doctor``); the command
    shows the latest stage beside a spinner and the time since the command started,
    redrawn ten times a second, e.g. ``profiling mlp: memory runs 3/6 · 12.4 s``. It is
    drawn on stderr and only when stderr is a terminal, so that stdout holds the results
    alone (``doctor --json`` stays valid JSON) and a log file gets no spinner frames.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.text import Text

__all__ = ["Stage", "stages"]


class Stage:
    """The callback the library calls at each stage (``stage("memory runs 3/6")``), and
    the renderable the status line redraws: ``what: stage · 12.4 s``."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.stage = "starting"
        self.started = time.perf_counter()

    def __call__(self, stage: str) -> None:
        self.stage = stage

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def __str__(self) -> str:
        return f"{self.what}: {self.stage} · {self.elapsed_s:.1f} s"

    def __rich__(self) -> Text:
        return Text(str(self))


@contextmanager
def stages(what: str, console: Console | None = None) -> Iterator[Stage]:
    """A status line on stderr for the block (NOTE [ Progress on stderr ]); yields the
    :class:`Stage` to pass as ``progress=`` and to name stages of the command's own."""
    stage = Stage(what)
    err = console or Console(stderr=True)
    if not err.is_terminal:
        yield stage
        return
    with err.status(stage, spinner="dots", refresh_per_second=10):
        yield stage
