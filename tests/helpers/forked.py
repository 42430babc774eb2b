"""Child processes for the kill and pause tests: each is a real OS process forked from a forkserver that has
already imported the heavy modules (torch, transformers, prefect, zarr, dask and the stages), so it starts in
well under a second instead of re-importing them. ``start(target, *args)`` runs a module-level function of this
module in a fresh child with this process's environment, cwd and sys.path; the child can be SIGKILLed
(``Child.kill``, or by itself from a patched seam), its return value comes back through a pipe and its stdout
and stderr (a traceback included) are kept in a file for assertion messages.

Importing this module applies the test settings (``covgrad.offline.offline_env()`` before prefect loads, one torch
thread); it is the first module the forkserver preloads."""

from covgrad.offline import offline_env

offline_env()  # covgrad.offline imports only os, so this runs before prefect or transformers loads

import atexit  # noqa: E402
import contextlib  # noqa: E402
import multiprocessing  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

torch.set_num_threads(1)

# What the children import, preloaded once per forkserver (one per pytest process); this module first.
PRELOAD = [
    "tests.helpers.forked",
    "torch",
    "transformers",
    "zarr",
    "dask.array",
    "prefect",
    "distributed",
    "matplotlib.backends.backend_agg",
    "tests.helpers.pipeline",
    "tests.helpers.faults",
    "covgrad.config",
    "tasks.specs",
    "flows.pipeline",
    "storage.stores.scores",
    "tasks.rollouts",
    "tasks.trajectory",
    "covgrad.report.plots",
]

KILLED = -signal.SIGKILL  # a Process's exitcode after SIGKILL

_context = None
_children: list["Child"] = []


def _ctx():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


class Child:
    """One running child: its Process, the pipe its result comes back on, the file holding its output."""

    def __init__(self, target, args: tuple, kwargs: dict) -> None:
        ctx = _ctx()
        fd, log = tempfile.mkstemp(prefix="covgrad-child-", suffix=".log")
        os.close(fd)
        self.log = Path(log)
        self._results, sender = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_main, args=(sender, dict(os.environ), str(self.log), target, args, kwargs))
        self.process.start()
        sender.close()
        self._result: Any = None
        _children.append(self)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        """The exit code, None while it runs."""
        return self.process.exitcode

    def kill(self) -> None:
        """SIGKILL the child (if it still runs) and reap it."""
        if self.process.exitcode is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join()

    def wait(self, timeout: float = 300) -> int:
        """Wait for the child to end; past ``timeout`` seconds SIGKILL it and fail with its output."""
        self.process.join(timeout)
        if self.process.exitcode is None:
            self.kill()
            raise AssertionError(f"child still running after {timeout} s:\n{self.output()}")
        return self.process.exitcode

    def result(self, timeout: float = 300) -> Any:
        """The target's return value; fails with the child's output (its traceback) when it did not return."""
        code = self.wait(timeout)
        if self._result is None and self._results.poll():
            with contextlib.suppress(EOFError):  # it ended without sending one
                self._result = self._results.recv()
        assert code == 0 and self._result is not None, f"child exit {code}:\n{self.output()}"
        return self._result[0]

    def output(self, tail: int = 3000) -> str:
        """The last ``tail`` characters of the child's stdout and stderr."""
        try:
            return self.log.read_text(errors="replace")[-tail:]
        except FileNotFoundError:
            return ""

    def close(self) -> None:
        """Kill the child if it still runs and remove its output file."""
        self.kill()
        self._results.close()
        self.log.unlink(missing_ok=True)
        if self in _children:
            _children.remove(self)

    def __enter__(self) -> "Child":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start(target, *args, **kwargs) -> Child:
    """Run ``target(*args, **kwargs)`` (a module-level function of this module) in a new child process."""
    return Child(target, args, kwargs)


@atexit.register
def _kill_leftovers() -> None:  # a failed test must not leave the interpreter waiting on a paused child
    for child in list(_children):
        child.close()


def _main(sender, env: dict[str, str], log: str, target, args: tuple, kwargs: dict) -> None:
    """The child's entry: the parent's environment, output into ``log``, one torch thread, then the target;
    its return value is sent back (an exception propagates: multiprocessing prints its traceback)."""
    os.environ.update(env)
    for key in set(os.environ) - set(env):
        del os.environ[key]
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    torch.set_num_threads(1)
    value = target(*args, **kwargs)
    sys.stdout.flush()
    sys.stderr.flush()
    sender.send((value,))
    sender.close()


# ---- children --------------------------------------------------------------------------------------------


def chain(root: str) -> dict[str, str]:
    """The tiny chain (``tests.helpers.faults.OVERRIDES``) on ``root``, run index included; instance →
    computed/cached."""
    from tests.helpers.faults import OVERRIDES, run_chain
    from tests.helpers.pipeline import tiny_config

    return run_chain(tiny_config(root, **OVERRIDES))


def seamed_run(
    root: str,
    overrides: dict,
    names: set[str],
    module: str,
    *,
    kill_at_mark: int | None = None,
    kill_at_write: int | None = None,
    mark_delay: float = 0.0,
    sync: str | None = None,
) -> dict:
    """The planned instances ``names`` of the tiny config on ``root`` with ``overrides``, with ``module``'s
    ``mark_batch_done`` wrapped: SIGKILL this process at the mark call after ``kill_at_mark`` calls went
    through, or at the ``write_state`` call after ``kill_at_write`` went through; sleep ``mark_delay`` before
    each mark. With ``sync`` (a directory), touch ``ready-<pid>`` there and wait for ``go`` before running.
    Returns {instance: computed} and the number of marks ("batches")."""
    import importlib

    from tests.helpers.pipeline import run_planned, tiny_config

    cfg = tiny_config(root, **overrides)
    seam = importlib.import_module(module)
    real_mark, calls = seam.mark_batch_done, []

    def mark(group, b):
        if kill_at_mark is not None and len(calls) == kill_at_mark:
            os.kill(os.getpid(), signal.SIGKILL)
        if mark_delay:
            time.sleep(mark_delay)
        calls.append(b)
        real_mark(group, b)

    seam.mark_batch_done = mark
    if kill_at_write is not None:
        real_write, writes = seam.write_state, []

        def write(*args):
            if len(writes) == kill_at_write:
                os.kill(os.getpid(), signal.SIGKILL)
            writes.append(1)
            real_write(*args)

        seam.write_state = write
    if sync is not None:
        (Path(sync) / f"ready-{os.getpid()}").touch()
        while not (Path(sync) / "go").exists():
            time.sleep(0.02)
    results = run_planned(cfg, names)
    return {"computed": {n: r.computed for n, r in results.items()}, "batches": len(calls)}


def paused_chain(root: str, ready: str, go: str) -> dict[str, str]:
    """The tiny chain on ``root``, paused in its first scores state write: writes its pid to ``ready`` and
    waits (up to 300 s) for ``go`` to exist; instance → computed/cached."""
    import storage.stores.scores as scores

    real = scores.write_state

    def paused(*args, **kwargs):
        if not os.path.exists(ready):
            Path(ready).write_text(str(os.getpid()))
            deadline = time.monotonic() + 300
            while not os.path.exists(go) and time.monotonic() < deadline:
                time.sleep(0.05)
        return real(*args, **kwargs)

    scores.write_state = paused
    return chain(root)
