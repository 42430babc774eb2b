"""The error contract for bad ``--set`` YAML, unwritable roots and full disks: exit 2, one ``covgrad: error:``
line naming the cause and the key or path, nothing marked complete; and Prefect's lock files and results
of a root this process cannot write kept in a writable state directory.

The tests run as root, where ``chmod`` does not stop a write: an unwritable root is a path below a regular
file (ENOTDIR) or, where the machine has one, below read-only ``/sys`` (EPERM/EROFS); a read-only root for
``cache_options`` is simulated by ``os.access``; a full disk by a write raising ``OSError(ENOSPC)``.
"""

import errno
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from covgrad.offline import OFFLINE_ENV
from tests.helpers.faults import error_line, tree
from tests.helpers.pipeline import REPO


def covgrad_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m flows.cli run ARGS`` from the repository, without PREFECT_API_URL."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update({"PYTHONPATH": str(REPO), "COVGRAD_LOG_DIR": str(tmp_path / "logs"), **OFFLINE_ENV})
    cmd = [sys.executable, "-m", "flows.cli", "run", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_bad_yaml_in_set_is_a_value_error_naming_the_key():
    from covgrad.config import apply_overrides

    with pytest.raises(ValueError, match=r"--set masks\.qs: value '\[0\.1' is not valid YAML"):
        apply_overrides({}, ["masks.qs=[0.1"])


def test_write_errors_exit_2_in_one_line_naming_the_path(monkeypatch, capsys, tmp_path):
    """``main`` turns a full disk or a refused write into exit 2 and one line with the path; any other
    OSError stays an internal error (exit 1)."""
    import flows.cli as cli

    monkeypatch.setenv("COVGRAD_LOG_DIR", str(tmp_path / "logs"))
    monkeypatch.setattr(cli, "offline_env", lambda: None)
    monkeypatch.setattr(cli, "_LOG_PATH", None)
    target = "/data/root/scores/abc/state/c/0/0"
    cases = [
        (OSError(errno.ENOSPC, "No space left on device", target), 2, f"disk full writing {target}"),
        (PermissionError(errno.EACCES, "Permission denied", "/data/root"), 2, "cannot write /data/root"),
        (OSError(errno.EROFS, "Read-only file system", "/data/root"), 2, "pass --root to a writable directory"),
        (OSError(errno.EIO, "Input/output error", target), 1, "internal error (OSError)"),
    ]
    for exc, status, text in cases:

        def boom(args, exc=exc):
            raise exc

        monkeypatch.setattr(cli, "cmd_run", boom)
        assert cli.main(["run"]) == status
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and text in lines[0], lines


def test_full_disk_while_completing_names_the_file_and_marks_nothing(monkeypatch, tmp_path):
    """A write that fails with ENOSPC and no file name (as ``write`` does) is raised again naming the file
    ``write_atomic`` was writing; the artifact stays incomplete."""
    from storage.artifacts import MARKER, ArtifactStore

    store = ArtifactStore(str(tmp_path / "root"))
    ref = store.ref("stage", "k" * 24)
    claim = store.begin(ref, {"x": 1}, resume=False)
    (Path(store.path(ref)) / "data.txt").write_text("payload")

    def full(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OSError) as info:
        store.complete(ref, claim)
    assert info.value.errno == errno.ENOSPC and info.value.filename.endswith("_MANIFEST.json")
    monkeypatch.undo()
    assert not (Path(store.path(ref)) / MARKER).exists()
    assert not store.is_complete(ref)


def test_unwritable_root_keeps_prefect_state_in_the_state_dir(monkeypatch, tmp_path):
    """``cache_options`` on a root ``os.access`` calls unwritable puts Prefect's locks and results under
    ``$COVGRAD_STATE_DIR`` and writes nothing under the root; a writable root keeps them beside the
    artifacts. (Covers where the paths point, not a whole run on a read-only root.)"""
    from storage.artifacts import ArtifactStore
    from tasks.common import cache_options, prefect_state_dir

    root = tmp_path / "root"
    root.mkdir()
    store = ArtifactStore(str(root))
    ref = store.ref("stage", "k" * 24)
    assert cache_options(store, ref)["result_storage"] == root / ".prefect-results"
    state = tmp_path / "state"
    monkeypatch.setenv("COVGRAD_STATE_DIR", str(state))
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == root else real(p, mode))
    options = cache_options(store, ref)
    assert options["result_storage"] == state / ".prefect-results"
    assert options["cache_policy"].lock_manager.lock_files_directory == state / ".prefect-locks"
    assert list(root.iterdir()) == []
    monkeypatch.delenv("COVGRAD_STATE_DIR")
    default = prefect_state_dir(root)
    assert default.parent == Path.home() / ".cache" / "covgrad" and len(default.name) == 16


@pytest.mark.slow
def test_bad_yaml_in_set_exits_2_naming_the_key(tmp_path):
    proc = covgrad_run(tmp_path, "--root", str(tmp_path / "root"), "--set", "masks.qs=[0.1")
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("covgrad: error: --set masks.qs: value '[0.1' is not valid YAML"), lines[0]
    assert not (tmp_path / "root").exists()


@pytest.mark.slow
def test_root_below_a_file_exits_2_naming_the_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    root = blocker / "root"
    proc = covgrad_run(tmp_path, "--root", str(root))
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = error_line(proc.stderr)
    assert f"cannot write {root}: Not a directory" in line and "--root" in line, line
    assert blocker.read_text() == "not a directory"


@pytest.mark.slow
def test_read_only_filesystem_root_exits_2_naming_the_path(tmp_path):
    root = Path("/sys/covgrad-error-contract")
    try:
        root.mkdir()
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EROFS, errno.EACCES):
            pytest.skip(f"/sys here fails with {exc}")
    else:
        root.rmdir()
        pytest.skip("/sys is writable here")
    proc = covgrad_run(tmp_path, "--root", str(root))
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = error_line(proc.stderr)
    assert f"cannot write {root}" in line and "make the root writable" in line, line


READ_ONLY_RUN = """
import os, sys
root = sys.argv[1]
real = os.access
def access(path, mode, *args, **kwargs):
    if mode & os.W_OK and os.path.abspath(path).startswith(root):
        return False
    return real(path, mode, *args, **kwargs)
os.access = access
sys.argv = ["covgrad", *sys.argv[2:]]
from flows.cli import main
sys.exit(main())
"""


@pytest.mark.slow
def test_fully_cached_read_only_root_serves_its_results(tiny_run, tmp_path):
    """``covgrad run`` on a copy of a finished tiny pipeline that ``os.access`` calls unwritable (chmod does
    not stop root): exit 0, the cached summary printed, and not one file or directory under the root
    created or touched (Prefect's state goes to ``$COVGRAD_STATE_DIR``). Covers the writes covgrad
    decides by ``os.access``, not a kernel refusing a write."""
    import shutil

    from tests.helpers.faults import OVERRIDES

    root = tmp_path / "root"
    shutil.copytree(tiny_run[0], root)
    before = tree(root)
    sets = [a for k, v in OVERRIDES.items() for a in ("--set", f"{k}={str(v).lower()}")]
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    state = tmp_path / "state"
    env.update({"PYTHONPATH": str(REPO), "COVGRAD_LOG_DIR": str(tmp_path / "logs"), "COVGRAD_STATE_DIR": str(state)})
    cmd = [sys.executable, "-c", READ_ONLY_RUN, str(root), "run", "--config", str(REPO / "configs" / "tiny.yaml")]
    proc = subprocess.run(
        [*cmd, "--root", str(root), *sets], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [line for line in proc.stderr.splitlines() if line.startswith("covgrad:")], proc.stderr[-3000:]
    assert " 0 stage(s) computed" in proc.stdout, proc.stdout
    assert "(read-only root;" in proc.stdout, proc.stdout
    assert tree(root) == before
    assert (state / ".prefect-locks").exists() or (state / ".prefect-results").exists()


def test_full_disk_writing_scores_state_names_the_array(monkeypatch, tmp_path):
    """ENOSPC with no file name from a zarr write of the scores state is raised again naming the array."""
    import zarr
    from zarr.storage import LocalStore

    from storage.stores.scores import write_state

    group = zarr.open_group(LocalStore(str(tmp_path / "scores.zarr")), mode="w")
    array = group.create_array("mean_s", shape=(2, 4), dtype="f4")

    def full(self, selection, value):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(zarr.Array, "__setitem__", full)
    with pytest.raises(OSError) as info:
        write_state(array, slice(0, 2), slice(0, 4), np.zeros((2, 4), dtype="f4"))
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == f"file://{tmp_path / 'scores.zarr'}/mean_s"


def test_full_disk_in_the_row_writer_thread_names_the_array(monkeypatch, tmp_path):
    """ENOSPC with no file name in the per-sample row writer's thread is raised in the caller as an OSError
    naming the rows array (an expected failure, exit 2), not a RuntimeError (exit 1)."""
    import torch
    import zarr
    from zarr.storage import LocalStore

    from storage.stores.scores import RowWriter

    group = zarr.open_group(LocalStore(str(tmp_path / "scores.zarr")), mode="w")
    array = group.create_array("scores", shape=(4, 3), dtype="f4")

    def full(self, selection, value):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(zarr.Array, "__setitem__", full)
    writer = RowWriter(array, 4, 3, torch.device("cpu"))
    writer.submit(0, 4, torch.zeros(4, 3))
    with pytest.raises(OSError) as info:
        writer.close()
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == f"file://{tmp_path / 'scores.zarr'}/scores"
    assert not writer.thread.is_alive()


def test_a_full_disk_naming_no_file_is_named_by_the_artifact():
    """``name_full_disk`` gives a nameless ENOSPC/EDQUOT the artifact's path and leaves every other error as
    it was."""
    from storage.integrity import name_full_disk

    with pytest.raises(OSError) as info, name_full_disk("/root/stats/abc"):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert (info.value.errno, info.value.filename) == (errno.ENOSPC, "/root/stats/abc")
    for exc in (
        OSError(errno.ENOSPC, "No space left on device", "/root/stats/abc/x.json"),
        OSError(errno.EIO, "Input/output error"),
        ValueError("bad"),
    ):
        with pytest.raises(type(exc)) as info, name_full_disk("/elsewhere"):
            raise exc
        assert info.value is exc


def test_check_root_refuses_what_cannot_be_written_and_creates_nothing(monkeypatch, tmp_path):
    """``check_root``: a root below a file is ENOTDIR naming it; a missing root below a directory it cannot
    write or whose directory cannot be made (probed: ``os.access`` says yes to root) and an existing unwritable
    root with stages left are refused naming the root; a writable or missing-but-creatable root passes; nothing
    is left behind."""
    from flows.runtime import check_root
    from tests.helpers.pipeline import tiny_config

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError) as info:
        check_root(tiny_config(str(blocker / "root")))
    assert (info.value.errno, info.value.filename) == (errno.ENOTDIR, str(blocker / "root"))
    check_root(tiny_config(str(tmp_path / "new" / "root")))
    assert not (tmp_path / "new").exists()
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == locked else real(p, mode))
    for root, said in ((locked / "root", "Permission denied"), (locked, "and stages are left to compute")):
        with pytest.raises(OSError, match=said) as info:
            check_root(tiny_config(str(root)))
        assert info.value.errno == errno.EACCES and info.value.filename == str(root)
    assert list(locked.iterdir()) == []
    refusing = tmp_path / "refusing"
    refusing.mkdir()
    made = Path.mkdir

    def mkdir(self: Path, *args: object, **kwargs: object) -> None:
        if self.parent == refusing:
            raise OSError(errno.EPERM, os.strerror(errno.EPERM), str(self))
        made(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(OSError, match="Operation not permitted") as info:
        check_root(tiny_config(str(refusing / "a" / "root")))
    assert info.value.errno == errno.EPERM and info.value.filename == str(refusing / "a" / "root")
    assert list(refusing.iterdir()) == []


def test_weights_that_need_pickle_exit_2_naming_the_file(monkeypatch, capsys, tmp_path):
    """A pytorch_model.bin that ``torch.load(weights_only=True)`` refuses, met by a stage or ``covgrad diff``
    (``storage.checkpoints.load_state_dict``) rather than the preflight: exit 2, one line naming the file, the global
    it holds, and to convert it to safetensors."""
    import argparse

    import torch

    import flows.cli as cli
    from storage.checkpoints import load_state_dict

    monkeypatch.setenv("COVGRAD_LOG_DIR", str(tmp_path / "logs"))
    monkeypatch.setattr(cli, "_LOG_PATH", None)
    torch.save({"w": torch.zeros(2), "args": argparse.Namespace(lr=1.0)}, tmp_path / "pytorch_model.bin")
    monkeypatch.setattr(cli, "cmd_run", lambda args: load_state_dict(tmp_path))
    assert cli.main(["run"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    said = f"covgrad: error: weights file {tmp_path / 'pytorch_model.bin'} needs pickle to load"
    assert lines[0].startswith(said) and "argparse.Namespace" in lines[0] and "convert it to safetensors" in lines[0]


@pytest.mark.parametrize(
    ("line", "status", "said"),
    [
        ("rank 1 of 2 was killed by SIGKILL; rerun to resume from the checkpoints", 2, "error: rank 1 of 2 was killed"),
        (
            "rank 3 of 4 (torchrun node 1 of 2) exited with code 137; rerun to resume from the checkpoints",
            2,
            "code 137",
        ),
        ("torchrun (4 ranks, node 1 of 2) exited with code -9: ", 2, "a rank or node of the group was lost: rerun"),
        (
            "rank 0 of 4 (torchrun node 0 of 2) failed: RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection "
            "closed by peer [10.0.0.2]:36077",
            2,
            "closed by peer [10.0.0.2]:36077; a rank or node of the group was lost: rerun",
        ),
        ("rank 1 of 2 failed: ValueError: bad input on this rank", 2, "error: rank 1 of 2 failed: ValueError: bad"),
        ("rank 1 of 2 failed: IndexError: list index out of range", 1, "internal error (RankFailedError): rank 1"),
    ],
    ids=["rank killed", "node's rank ended", "torchrun killed", "peer lost", "bad input in a rank", "bug in a rank"],
)
def test_a_killed_rank_or_torchrun_node_exits_2_in_one_line(monkeypatch, capsys, tmp_path, line, status, said):
    """A rank group's failure (``covgrad.distributed.launch.RankFailedError``, one line naming the rank) is expected,
    exit 2, when a rank was killed or ended, torchrun or a node of it died, or a rank lost its peers or raised on
    bad input; a rank that raised anything else is a bug, exit 1."""
    import flows.cli as cli
    from covgrad.distributed.launch import RankFailedError

    monkeypatch.setenv("COVGRAD_LOG_DIR", str(tmp_path / "logs"))
    monkeypatch.setattr(cli, "_LOG_PATH", None)

    def boom(args):
        raise RankFailedError(line)

    monkeypatch.setattr(cli, "cmd_run", boom)
    assert cli.main(["run"]) == status
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], lines


def test_a_killed_fork_server_exits_2_in_one_line(monkeypatch, capsys, tmp_path):
    """The EOFError ``multiprocessing``'s fork server connection raises when the server died before it forked a
    rank (``popen_forkserver.Popen._launch`` reading the child's pid): exit 2, one line saying to rerun. An EOFError
    raised anywhere else stays an internal error."""
    import pickle
    import socket
    from multiprocessing import forkserver

    import flows.cli as cli

    monkeypatch.setenv("COVGRAD_LOG_DIR", str(tmp_path / "logs"))
    monkeypatch.setattr(cli, "_LOG_PATH", None)

    def killed_server(args):
        ours, server = socket.socketpair()
        server.close()  # the fork server's end of the connection, closed as its death closes it
        with ours:
            forkserver.read_signed(ours.fileno())

    def elsewhere(args):
        pickle.loads(b"")

    for fn, status, said in (
        (killed_server, 2, "error: a worker process's fork server (multiprocessing) ended under the run (EOFError"),
        (elsewhere, 1, "internal error (EOFError)"),
    ):
        monkeypatch.setattr(cli, "cmd_run", fn)
        assert cli.main(["run"]) == status
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and said in lines[0], lines
