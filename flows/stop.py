"""SIGINT and SIGTERM during ``covgrad run``: stop every child process and exit 128 + signum.

``covgrad run`` arms :func:`stop_children` for both signals before anything starts. Prefect's flow engine
then replaces the SIGTERM handler, for the flow run, with one that raises ``TerminationSignal``; Python
drops an exception raised while a finalizer (``__del__``) runs, so a SIGTERM landing there was lost and the
run went on to finish with status 0. :func:`rearm`, called first in the flow, puts the armed handler back:
it ends the process with ``os._exit``, which no finalizer can swallow. Under a deployment's worker nothing
is armed and Prefect's handler stays.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_armed = False


def stop_children(signum: int, frame: Any = None) -> None:
    """SIGINT/SIGTERM handler: terminate every child process (SIGKILL after 5 s), say so in one
    line and exit 128 + signum. Finished batches are kept, so a rerun resumes."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=5)
    for child in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    name = signal.Signals(signum).name
    line = f"covgrad: stopped by {name}; finished batches are kept, rerun to resume\n"
    os.write(2, line.encode())  # not print: inside a run, Prefect's log_prints captures it
    os._exit(128 + signum)


def arm() -> dict[int, Any]:
    """Install :func:`stop_children` for SIGINT and SIGTERM; the previous handlers, for :func:`disarm`."""
    global _armed
    previous = {signum: signal.signal(signum, stop_children) for signum in SIGNALS}
    _armed = True
    return previous


def disarm(previous: dict[int, Any]) -> None:
    """Restore the handlers :func:`arm` replaced."""
    global _armed
    _armed = False
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def rearm() -> None:
    """Inside a flow run started by ``covgrad run`` (armed, main thread): install :func:`stop_children` again
    over the handler Prefect's flow engine put in place; elsewhere nothing."""
    if _armed and threading.current_thread() is threading.main_thread():
        for signum in SIGNALS:
            signal.signal(signum, stop_children)
