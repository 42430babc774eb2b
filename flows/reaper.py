"""A watchdog for ``covgrad run``: when the run's process dies, even by SIGKILL, the processes it started
(the temporary Prefect server, dask workers) are stopped instead of living on, re-parented to init.

:func:`start_reaper` spawns a small child that holds the read end of a pipe whose write end only the run
holds. The child records the run's descendants every ``interval`` seconds; when the pipe reaches end of
file (the run is gone, however it ended) it terminates the recorded processes still alive, their own
descendants, and every process that inherited the run's token (:data:`TOKEN_ENV`, set in the run's
environment before it starts anything, so a child started after the last record and re-parented to init
is found too), SIGKILL after ``grace`` seconds, and exits.
"""

import os
import subprocess
import sys
import time

_WATCHDOG = r"""
import select, sys, psutil
parent, interval, grace, env, token = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), *sys.argv[4:6]
me = psutil.Process()
known = {}
while True:
    try:
        for p in psutil.Process(parent).children(recursive=True):
            if p.pid != me.pid:
                known.setdefault(p.pid, p)
    except psutil.NoSuchProcess:
        pass
    ready, _, _ = select.select([sys.stdin], [], [], interval)
    if ready and not sys.stdin.buffer.read1(1 << 16):
        break
for p in list(known.values()):
    try:
        for c in p.children(recursive=True):
            known.setdefault(c.pid, c)
    except psutil.NoSuchProcess:
        pass
for p in psutil.process_iter():
    try:
        if p.pid != me.pid and p.environ().get(env) == token:
            known.setdefault(p.pid, p)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        pass
alive = [p for p in known.values() if p.is_running() and p.pid != me.pid]
for p in alive:
    try:
        p.terminate()
    except psutil.NoSuchProcess:
        pass
_, left = psutil.wait_procs(alive, timeout=grace)
for p in left:
    try:
        p.kill()
    except psutil.NoSuchProcess:
        pass
"""

TOKEN_ENV = "COVGRAD_RUN_TOKEN"  # inherited by everything the run starts; the watchdog stops its holders
_PIPE: int | None = None  # the write end, held open by this process until it exits


def start_reaper(interval: float = 0.2, grace: float = 2.0) -> int:
    """Start the watchdog of this process (once per process); returns its PID."""
    global _PIPE
    token = f"{os.getpid()}-{time.time_ns()}"
    os.environ[TOKEN_ENV] = token
    read, write = os.pipe()  # both ends non-inheritable: no other child keeps the pipe open
    cmd = [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(interval), str(grace), TOKEN_ENV, token]
    child = subprocess.Popen(cmd, stdin=read, stdout=subprocess.DEVNULL, start_new_session=True)
    os.close(read)
    _PIPE = write
    return child.pid
