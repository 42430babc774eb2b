"""Starting a group of ranks: R gloo processes forked on this machine, or this machine's ranks of a group that
``torchrun`` starts on one machine or several, chosen by a :class:`Placement`, through one function
(:func:`launch_ranks`) that names a failed rank in one line (:class:`RankFailedError`). Inside a rank,
:func:`rank_device` is its device and :func:`init_from_env` / :func:`torchrun_rank` join a torchrun group.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist


def rank_device() -> torch.device:
    """This rank's device in the initialised process group: its current CUDA device under nccl, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_from_env(backend: str | None = None) -> tuple[int, int]:
    """Join the process group that ``torchrun`` (or a caller setting ``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``) describes, with ``backend`` (default: nccl with CUDA, else gloo; with
    nccl the rank takes CUDA device ``LOCAL_RANK``, one device per rank of the machine); returns (rank, world
    size)."""
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ValueError(f"environment variables {missing} are unset; launch with torchrun --nproc-per-node R")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


class RankFailedError(RuntimeError):
    """A rank of a :func:`launch_ranks` group failed; the message is one line naming it and how."""


# How long, in seconds, a torchrun node waits at the c10d rendezvous for the other nodes (and for node 0's
# rendezvous store to accept connections).
RDZV_TIMEOUT_S = 1800
# Lines of torchrun's stderr kept to name a failed rank (its failure summary comes last).
TORCHRUN_TAIL_LINES = 2000


@dataclass(frozen=True)
class Torchrun:
    """A rank group that ``torchrun`` (``torch.distributed.run``) starts: ``nproc_per_node`` ranks on each of
    ``nnodes`` machines, this one being node ``node_rank``, ``nproc_per_node`` × ``nnodes`` ranks in all.

    One machine without ``endpoint``: ``--standalone`` (a c10d rendezvous on a free local port). Otherwise the
    machines meet at torchrun's c10d rendezvous at ``endpoint`` (HOST:PORT of node 0, which hosts the
    rendezvous store: ``is_host`` is set for node 0 and cleared for the others) under the id ``run_id``. The
    c10d rendezvous gives the machines their global ranks in its own order, so ``node_rank`` only says which
    machine hosts the store. The ranks join the group with ``backend``: gloo, or nccl (one CUDA device per
    local rank). ``--max-restarts 0``: a failed rank fails the group (a rerun resumes from the checkpoints).
    """

    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    endpoint: str | None = None
    run_id: str = "covgrad"
    backend: str = "gloo"

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise ValueError(
                f"torchrun needs at least 1 rank on at least 1 node; got {self.nproc_per_node} x {self.nnodes}"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node rank {self.node_rank} is not in [0, {self.nnodes}); pass 0 <= node_rank < nnodes")
        if self.nnodes > 1 and self.endpoint is None:
            raise ValueError(f"{self.nnodes} torchrun nodes need a rendezvous endpoint: node 0's HOST:PORT")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend {self.backend!r} is not gloo or nccl")

    @property
    def world(self) -> int:
        """The ranks of the group, every machine's."""
        return self.nproc_per_node * self.nnodes

    def argv(self) -> list[str]:
        """torchrun's options (what comes before the ranks' module)."""
        out = ["--nproc-per-node", str(self.nproc_per_node), "--nnodes", str(self.nnodes), "--max-restarts", "0"]
        if self.endpoint is None:
            return [*out, "--standalone"]
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.run_id]
        conf = f"is_host={int(self.node_rank == 0)},join_timeout={RDZV_TIMEOUT_S},read_timeout={RDZV_TIMEOUT_S}"
        return [*out, *rdzv, "--rdzv-conf", conf]

    def where(self) -> str:
        """How a failure message names the group after a rank: ``of 4 (torchrun)``, ``of 4 (torchrun node 1 of
        2)`` (several machines: this machine)."""
        node = f" node {self.node_rank} of {self.nnodes}" if self.nnodes > 1 else ""
        return f"of {self.world} (torchrun{node})"


@dataclass(frozen=True)
class Placement:
    """Where a rank group runs, as a stage's spec places it.

    ``launcher`` local: ``ranks`` gloo processes forked on this machine (the torchrun fields are not used).
    ``launcher`` torchrun: this machine's ranks of a group that ``torchrun`` starts, ``ranks`` // ``nnodes`` on
    each of ``nnodes`` machines, this one node ``node_rank``, node 0's c10d rendezvous at ``rdzv_endpoint``
    (None on one machine: ``--standalone``), meeting under ``run_id`` and joining with ``backend``
    (:attr:`torchrun`, built and checked when the placement is).

    Raises:
        ValueError: a launcher other than local and torchrun, or torchrun settings that :class:`Torchrun`
            refuses.
    """

    launcher: Literal["local", "torchrun"]
    ranks: int
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    run_id: str = "covgrad"
    backend: str = "gloo"
    torchrun: Torchrun | None = field(init=False, default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.launcher not in ("local", "torchrun"):
            raise ValueError(f"launcher {self.launcher!r} starts no rank group; pass local or torchrun")
        if self.launcher == "torchrun":
            group = Torchrun(
                self.ranks // self.nnodes, self.nnodes, self.node_rank, self.rdzv_endpoint, self.run_id, self.backend
            )
            object.__setattr__(self, "torchrun", group)


def launch_ranks(
    placement: Placement,
    fn: Callable[..., None],
    args: tuple,
    workdir: str | os.PathLike,
    entry: str | None = None,
) -> None:
    """Run ``fn(*args)`` in this machine's ranks of ``placement`` and wait until every one returns.

    Local ranks (:func:`_launch_local`) meet at the file ``workdir/rendezvous``. A torchrun group
    (:func:`_launch_torchrun`) runs module ``entry`` in each rank, which calls :func:`torchrun_rank` on the
    payload this writes into ``workdir`` (a folder of this machine, also holding the ranks' error records).

    Raises:
        RankFailedError: one line naming a failed rank and how it failed (see the two launchers).
        ValueError: a torchrun placement without ``entry``, or fewer than 1 local rank.
    """
    if placement.torchrun is None:
        _launch_local(placement.ranks, fn, args, Path(workdir) / "rendezvous")
        return
    if entry is None:
        raise ValueError("a torchrun group needs the module its ranks run; pass entry")
    _launch_torchrun(placement.torchrun, entry, fn, args, workdir)


# What the fork server imports once, so that each launched rank starts without importing it again (torch
# and transformers: seconds per rank); it does not touch CUDA, so a rank may still initialise it.
RANK_PRELOAD = ["torch", "torch.distributed", "transformers", "zarr", "numpy"]


def _launch_local(ranks: int, fn: Callable[..., None], args: tuple, rendezvous: str | os.PathLike) -> None:
    """Run ``fn(*args)`` in ``ranks`` processes on this machine that form a gloo process group (each reads
    its rank from ``torch.distributed``), meeting at the file ``rendezvous`` (absent or stale: removed
    first); wait until every rank returns. The ranks are forked from this process's fork server
    (``multiprocessing`` "forkserver", started at the first launch with :data:`RANK_PRELOAD` imported): each
    is a fork of that server, with this process's ``sys.path`` and ``os.environ`` as they are at the launch
    (settings the preloaded modules read at import are the ones of the server's start).

    Raises:
        RankFailedError: one line naming the first rank that died or raised, with its signal, exit code or error
            (the other ranks are terminated).
    """
    import torch.multiprocessing as mp

    if ranks < 1:
        raise ValueError(f"ranks must be at least 1; got {ranks}")
    path = os.fspath(rendezvous)
    if os.path.exists(path):
        os.remove(path)
    mp.set_forkserver_preload(RANK_PRELOAD)  # no effect once this process's fork server runs
    try:
        mp.start_processes(
            _launched,
            args=(ranks, f"file://{path}", dict(os.environ), fn, args),
            nprocs=ranks,
            join=True,
            start_method="forkserver",
        )
    except mp.ProcessExitedException as exc:
        how = f"was killed by {exc.signal_name}" if exc.signal_name else f"exited with code {exc.exit_code}"
        raise RankFailedError(
            f"rank {exc.error_index} of {ranks} {how}; rerun to resume from the checkpoints"
        ) from None
    except mp.ProcessRaisedException as exc:
        last = [line for line in str(exc).strip().splitlines() if line.strip()][-1]
        raise RankFailedError(f"rank {exc.error_index} of {ranks} failed: {last}") from None


def _launched(rank: int, ranks: int, init: str, env: dict[str, str], fn: Callable[..., None], args: tuple) -> None:
    os.environ.clear()
    os.environ.update(env)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ranks)
    fn(*args)
    # Not on failure: the group's connections close when the process exits, after its error is recorded, so a
    # peer that fails on the closed connection cannot be reported before the rank that failed first.
    dist.destroy_process_group()


def _launch_torchrun(
    torchrun: Torchrun, entry: str, fn: Callable[..., None], args: tuple, workdir: str | os.PathLike
) -> None:
    """Run ``fn(*args)`` in this machine's ranks of a ``torchrun`` group (``torchrun``) and wait until torchrun
    exits: ``python -m torch.distributed.run <options> -m <entry> <payload>``, where module ``entry`` calls
    :func:`torchrun_rank` on the payload (``fn``, ``args``, this process's ``sys.path``, the backend), which
    is pickled into ``workdir`` (a folder of this machine, also holding the ranks' error records). The ranks
    inherit this process's ``os.environ``; torchrun's stderr (the ranks' too) is copied to this process's.

    Raises:
        RankFailedError: when torchrun exits nonzero, one line naming a failed rank of this machine: one that
            a signal killed (``rank 1 of 2 (torchrun) was killed by SIGKILL; rerun to resume from the
            checkpoints``; a rank killed from outside comes before ranks that raised because a peer vanished),
            else the one that raised first (``rank 1 of 2 (torchrun) failed: ValueError: ...``), else torchrun's
            own failure (a rendezvous that timed out) with the last line it wrote.
    """
    work = Path(workdir)
    errors = work / "errors"
    errors.mkdir(parents=True, exist_ok=True)
    payload = work / "rank.pkl"
    with payload.open("wb") as f:
        pickle.dump((list(sys.path), torchrun.backend, str(errors)), f)  # read before fn and args unpickle
        pickle.dump((fn, args), f)
    cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun.argv(), "-m", entry, str(payload)]
    tail: deque[str] = deque(maxlen=TORCHRUN_TAIL_LINES)
    with subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, errors="replace") as proc:
        assert proc.stderr is not None
        for line in proc.stderr:
            sys.stderr.write(line)
            tail.append(line)
    if proc.returncode != 0:
        raise RankFailedError(_torchrun_failure(torchrun, proc.returncode, "".join(tail), errors))


# A failed rank in torchrun's failure summary (torch.distributed.elastic's ChildFailedError).
_FAILED_RANK = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def _torchrun_failure(torchrun: Torchrun, code: int, stderr: str, errors: Path) -> str:
    """The one line of a failed torchrun run (exit code ``code``, the end of its ``stderr``, the ranks' error
    records in ``errors``)."""
    where = torchrun.where()
    dead = [(int(r), int(c)) for r, c in _FAILED_RANK.findall(stderr)]
    killed = sorted(dead, key=lambda d: (d[1] == -signal.SIGTERM, d[0]))  # SIGTERM: perhaps torchrun's own
    records = sorted((json.loads(p.read_text()) for p in errors.glob("rank*.json")), key=lambda r: r["time"])
    if killed and killed[0][1] < 0 and (killed[0][1] != -signal.SIGTERM or not records):
        r, c = killed[0]
        try:
            name = signal.Signals(-c).name
        except ValueError:
            name = f"signal {-c}"
        return f"rank {r} {where} was killed by {name}; rerun to resume from the checkpoints"
    if records:
        return f"rank {records[0]['rank']} {where} failed: {records[0]['error']}"
    if dead:
        r, c = dead[0]
        return f"rank {r} {where} exited with code {c}; rerun to resume from the checkpoints"
    last = next((line.strip() for line in reversed(stderr.splitlines()) if line.strip()), "")
    node = f", node {torchrun.node_rank} of {torchrun.nnodes}" if torchrun.nnodes > 1 else ""
    return f"torchrun ({torchrun.world} ranks{node}) exited with code {code}: {last}"


def torchrun_rank(payload: str | os.PathLike) -> None:
    """One rank of a torchrun group that :func:`launch_ranks` started (the body of its entry module): load the
    payload, join the group (:func:`init_from_env`, the payload's backend), run ``fn(*args)`` and leave the
    group. An exception is recorded (rank, time, its last line) in the payload's error folder before the group
    is left (so before the errors it causes in the peers) and propagates."""
    with open(payload, "rb") as f:
        path, backend, errors = pickle.load(f)
        sys.path[:0] = [p for p in path if p not in sys.path]
        fn, args = pickle.load(f)
    rank = int(os.environ.get("RANK", "-1"))
    try:
        init_from_env(backend)
        fn(*args)
    except Exception as exc:  # recorded before the group is left: the peers' errors come after it
        lines = [line for line in "".join(traceback.format_exception_only(exc)).splitlines() if line.strip()]
        record = {"rank": rank, "time": time.time(), "error": lines[-1] if lines else type(exc).__name__}
        tmp = Path(errors) / f".rank{rank}.json"
        tmp.write_text(json.dumps(record))
        tmp.replace(Path(errors) / f"rank{rank}.json")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
