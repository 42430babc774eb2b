"""Fault-test helpers: the overrides of the fault runs, a run of a whole stage chain, digests of every array of a
root, the one error line of a ``covgrad`` stderr, and real mounts (a size-limited tmpfs, a read-only bind mount)
that skip the test, naming the refusal, where this process may not mount."""

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.pipeline import NO_OPTIONAL, run_planned, status_of

OVERRIDES = NO_OPTIONAL


def run_chain(cfg) -> dict[str, str]:
    """Every planned stage through its task function, in order, then the run index; instance →
    computed/cached."""
    from storage.artifacts import ArtifactStore
    from storage.runs import write_run_index
    from tasks.specs import plan

    results = run_planned(cfg)
    write_run_index(ArtifactStore(cfg.root), cfg, plan(cfg).run_key, {n: r.ref for n, r in results.items()})
    return status_of(results)


def digests(directory: Path) -> dict[str, bytes]:
    """Every data file of an artifact (not the bookkeeping files, not zarr.json with its timestamps)."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and not p.name.startswith("_") and p.name != "zarr.json" and p.suffix != ".html"
    }


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and directory under ``root``: relative path → (mtime in ns, size)."""
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(root.rglob("*"))}


def error_line(stderr: str) -> str:
    """The one ``covgrad:`` line of ``stderr``, asserted to be its last line (progress lines may precede it)."""
    errors = [line for line in stderr.splitlines() if line.startswith("covgrad:")]
    assert errors == [stderr.strip().splitlines()[-1]], stderr[-3000:]
    assert errors[0].startswith("covgrad: error: "), errors[0]
    assert "Traceback" not in stderr
    return errors[0]


def _mount(*args: str) -> str | None:
    """``mount ARGS``; None when it worked, else why not (its stderr or the missing command)."""
    try:
        proc = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=60)
    except FileNotFoundError as exc:
        return str(exc)
    return None if proc.returncode == 0 else proc.stderr.strip() or f"exit {proc.returncode}"


def _unmount(target: Path) -> None:
    """Unmount ``target``, lazily when it is still busy."""
    if subprocess.run(["umount", str(target)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(target)], capture_output=True, check=True)


@contextlib.contextmanager
def tmpfs(target: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's syntax: 512k, 64m) mounted on the directory ``target``, unmounted at the
    end even on failure; skips the test when mounting is refused here."""
    why = _mount("-t", "tmpfs", "-o", f"size={size}", "covgrad-test", str(target))
    if why is not None:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {why}")
    try:
        yield target
    finally:
        _unmount(target)


def resize_tmpfs(target: Path, size: str) -> None:
    """Grow (or shrink) the tmpfs on ``target`` in place; its files stay."""
    why = _mount("-o", f"remount,size={size}", str(target))
    assert why is None, why


@contextlib.contextmanager
def read_only_bind(source: Path, target: Path) -> Iterator[Path]:
    """``source`` bind-mounted read-only on the directory ``target`` (writes there fail with EROFS),
    unmounted at the end even on failure; skips the test when mounting is refused here."""
    why = _mount("--bind", str(source), str(target))
    if why is not None:
        pytest.skip(f"cannot bind-mount here (needs root): {why}")
    try:
        why = _mount("-o", "remount,ro,bind", str(target))
        if why is not None:
            pytest.skip(f"cannot remount a bind mount read-only here: {why}")
        yield target
    finally:
        _unmount(target)
