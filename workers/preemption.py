"""Stopping on request without Ray: a signal handler that asks for a checkpoint at the next step boundary, and
the exception and exit status that report such a stop. Used by the driver (workers/driver.py, which forwards
the request to the trainers through workers/run_control.py) and by the single-process trainer.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: stopped on request with a checkpoint saved; run the same command to resume

log = logging.getLogger(__name__)


class Notice(NamedTuple):
    """What a rank's poll said at a step boundary (workers/trainer/loop.fit sums the votes over ranks)."""

    stop: bool = False  # checkpoint after this step, then return (the job exits PREEMPTED_EXIT)
    checkpoint: bool = False  # checkpoint after this step and train on (a node is about to go)
    gone: str = ""  # why this rank's driver is gone (workers/lease.py): every rank stops at once, writing nothing


class StoppedEarly(Exception):
    """The run stopped on request after checkpointing step `step` (the launch script exits PREEMPTED_EXIT)."""

    def __init__(self, step: int, max_steps: int) -> None:
        super().__init__(f"stopped on request at step {step} of {max_steps} with its checkpoint saved: re-run the "
                         "same command to resume")
        self.step = step


@contextmanager
def stop_on_signal(on_stop: Callable[[str], Any],
                   signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)) -> Iterator[threading.Event]:
    """While inside: one of `signals` on this process (the driver, the single-process trainer, a Ray Train rank)
    sets the yielded event and calls `on_stop(signal name)` once; a second signal exits at once (the default
    handling). The previous handlers come back on exit. Off the main thread (where Python cannot install
    handlers) the event is only set by whoever else holds it."""
    requested = threading.Event()

    def handler(signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if requested.is_set():  # asked twice: the user means it
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        requested.set()
        log.warning("%s: checkpointing at the next step boundary, then exiting with status %d (send it again to "
                    "stop at once, losing the steps since the last checkpoint)", name, PREEMPTED_EXIT)
        on_stop(name)

    if threading.current_thread() is not threading.main_thread():
        yield requested
        return
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield requested
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
