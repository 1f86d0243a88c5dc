"""A rich progress spinner that appears only when a step takes longer than a second, and only on a terminal."""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager


@contextmanager
def slow_step(description: str, delay: float = 1.0):
    done = threading.Event()

    def spin():
        if done.wait(delay) or not sys.stderr.isatty():
            return
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        with Progress(SpinnerColumn(), TextColumn(description), TimeElapsedColumn(), transient=True,
                      console=Console(stderr=True)) as bar:
            bar.add_task(description, total=None)
            done.wait()

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
