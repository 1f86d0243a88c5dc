"""A rich progress spinner that appears only when a step takes longer than a second, and only on a terminal.

Steps nest (the CLI's "compiling" around the plan search's "searching"): one spinner shows the innermost running
step's description, so two rich live displays never run at once. Piped or captured stderr shows nothing.
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager

_lock = threading.Lock()
_steps: list[str] = []  # descriptions of the running steps, outermost first


@contextmanager
def slow_step(description: str, delay: float = 1.0):
    with _lock:
        outer = not _steps
        _steps.append(description)
    if not outer:  # the outer step's spinner shows this description while it runs
        try:
            yield
        finally:
            with _lock:
                _steps.remove(description)
        return
    done = threading.Event()

    def current() -> str:
        with _lock:
            return _steps[-1] if _steps else description

    def spin():
        if done.wait(delay) or not _is_terminal():
            return
        from rich.console import Console
        from rich.markup import escape
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), transient=True,
                      console=Console(stderr=True)) as bar:
            task = bar.add_task(escape(current()), total=None)
            while not done.wait(0.2):
                bar.update(task, description=escape(current()))

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        with _lock:
            _steps.remove(description)


def _is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False
