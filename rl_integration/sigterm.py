"""SIGTERM (`ray job stop`, a scheduler, `kill`) ends a run the way Ctrl-C does: as an exception in
the main thread, so the run's finally blocks (Ray workers, temporary policy folders) clean up.

Python runs a signal handler between any two bytecodes of the main thread, finalizers included.
An exception raised while a `__del__` or a weakref callback runs is printed and dropped
("Exception ignored in ..."), so a SystemExit raised there would be lost and the run would go on.
`sys.unraisablehook` sees every such drop: when the dropped exception is ours, the signal is sent
again from another thread a moment later (sent from the hook itself, its handler would run inside
the hook, whose exceptions are dropped too)."""
from __future__ import annotations

import os
import signal
import sys
import threading


class _Terminated(SystemExit):
    """The SystemExit this module raises, told apart from any other one a finalizer drops."""


def exit_on_sigterm() -> None:
    """Install the handler (only the main thread may) and the hook that re-sends a dropped exit."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, _raise_exit)
    previous = sys.unraisablehook
    if getattr(previous, "resends_sigterm", False):  # main() ran before in this process
        return

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, _Terminated):
            threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGTERM)).start()
            return
        previous(unraisable)

    hook.resends_sigterm = True
    sys.unraisablehook = hook


def _raise_exit(signum: int, frame) -> None:
    raise _Terminated(128 + signum)
