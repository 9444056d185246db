"""Progress of the long first steps (the kernel build, a GGUF file's first conversion, a model's load), drawn with
rich on stderr.

Shown where stderr is a terminal and quiet elsewhere (logs, pipes, tests), unless asked: QUICKDRAFT_PROGRESS=1
shows it anyway, =0 hides it; the command lines' --progress / --no-progress set it (set_shown). Steps nest (a
model load compiles the kernels, then converts the file): one display holds every running step, each a line with
its elapsed time, and a count where the step knows its total. A finished step may leave one line saying what it
did and how long it took (`done`); the rest of the display goes when the outermost step ends.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Callable, Iterator

_FORCED: dict[str, bool] = {}  # "shown": set_shown's setting, above the environment's
_lock = threading.Lock()
_display: dict[str, object] = {}  # "progress": the running rich Progress, "depth": the steps in it


def set_shown(shown: bool | None) -> None:
    """Show progress (True), hide it (False), or leave it to QUICKDRAFT_PROGRESS and the terminal (None)."""
    if shown is None:
        _FORCED.pop("shown", None)
    else:
        _FORCED["shown"] = shown


def _setting() -> bool | None:
    if "shown" in _FORCED:
        return _FORCED["shown"]
    value = os.environ.get("QUICKDRAFT_PROGRESS", "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    return None


def shown() -> bool:
    """Whether progress is drawn: as set (set_shown, QUICKDRAFT_PROGRESS), else where stderr is a terminal."""
    setting = _setting()
    if setting is not None:
        return setting
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False


def _nothing(amount: float = 1, absolute: bool = False) -> None:
    return None


@contextlib.contextmanager
def task(description: str, total: float | None = None, done: str | None = None) -> Iterator[Callable[..., None]]:
    """A line for one long step while it runs; yields advance(amount=1, absolute=False) (absolute: set the count
    to `amount`). With `total` the line counts to it; without, it shows a spinner and the time. `done`: a line
    left when the step ends well ("DONE in 12 s"). Where progress is not shown, advance does nothing."""
    if not shown():
        yield _nothing
        return
    progress = _enter()
    task_id = progress.add_task(description, total=total)
    start = time.perf_counter()

    def advance(amount: float = 1, absolute: bool = False) -> None:
        if absolute:
            progress.update(task_id, completed=amount)
        else:
            progress.advance(task_id, amount)

    ok = False
    try:
        yield advance
        ok = True
    finally:
        progress.remove_task(task_id)
        if ok and done:
            progress.console.print(f"[quickdraft] {done} in {_duration(time.perf_counter() - start)}",
                                   highlight=False, markup=False)
        _leave()


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 60 else f"{int(seconds // 60)} min {seconds % 60:.0f} s"


def _enter():
    from rich.console import Console
    from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.table import Column
    from rich.text import Text

    class Count(ProgressColumn):
        """done/total where the step has a total, nothing where it has none."""

        def render(self, task) -> Text:
            return Text(f"{task.completed:.0f}/{task.total:.0f}" if task.total else "")

    with _lock:
        progress = _display.get("progress")
        if progress is None:
            # Asked for where stderr is no terminal (QUICKDRAFT_PROGRESS=1, --progress): drawn there anyway.
            console = Console(stderr=True, force_terminal=True if _setting() else None)
            # a long description is shortened, not the count and the time
            description = TextColumn("{task.description}", table_column=Column(ratio=1, no_wrap=True,
                                                                               overflow="ellipsis"))
            progress = Progress(SpinnerColumn(), description, BarColumn(bar_width=20), Count(), TimeElapsedColumn(),
                                console=console, transient=True, expand=True)
            progress.start()
            _display.update(progress=progress, depth=0)
        _display["depth"] = int(_display["depth"]) + 1
        return progress


def _leave() -> None:
    with _lock:
        _display["depth"] = int(_display["depth"]) - 1
        if _display["depth"] == 0:
            _display.pop("progress").stop()
            _display.clear()
