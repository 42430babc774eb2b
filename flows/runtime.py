"""Checks of the Prefect runtime a ``covgrad run`` is about to use, in about a second, before the flow starts:
an API server named by ``PREFECT_API_URL`` (from the environment or a Prefect profile) must answer, and
without one the database of the temporary server (Prefect's SQLite file) must be readable and its port
range (``COVGRAD_SERVER_PORTS``, default Prefect's 8000-8999 on 127.0.0.1) must hold a free port. Each
failure is one line naming the setting or the file and the way around it. ``check_root`` refuses, before
the server starts, a local artifact root that cannot be created or written and still has stages to
compute (a fully cached read-only root passes: it is only read)."""

import errno
import os
import socket
import sqlite3
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

PORTS_ENV = "COVGRAD_SERVER_PORTS"
DEFAULT_PORTS = range(8000, 9000)  # Prefect's own range for its temporary server
_BUSY = "Unable to find an available port"  # how Prefect's temporary server says its range is full


def check_prefect_runtime(timeout: float = 5.0) -> list[int] | None:
    """ValueError when the Prefect API this process would use cannot work (see the module docstring).
    Returns None with an API URL, else the free ports of the temporary server's range (for
    :func:`use_server_ports`)."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    url = settings.api.url
    if url:
        _check_api(str(url).rstrip("/"), api_url_source(), timeout)
        return None
    connection = settings.server.database.connection_url
    value = connection.get_secret_value() if connection is not None else ""
    if value.startswith("sqlite"):
        _check_sqlite(Path(value.split(":///", 1)[1]), timeout)
    return free_ports(server_ports())


def use_server_ports(free: list[int] | None) -> None:
    """Let Prefect's temporary server pick its port among ``free`` (nothing to do with an API URL: None)."""
    if free is None:
        return
    from prefect.server.api.server import SubprocessASGIServer  # a few seconds: fastapi, sqlalchemy

    SubprocessASGIServer._port_range = free


def start_server(free: list[int] | None) -> Callable[[], None]:
    """Start Prefect's temporary server (the one the flow's client starts on first use) on one of ``free`` in a
    thread, so that it boots (~4.6 s here) while this process imports the pipeline; returns ``wait``, which
    joins the thread and raises what starting raised (RuntimeError for :func:`server_start_error`). With an API
    URL (``free`` None) there is nothing to start."""
    if free is None:
        return lambda: None
    use_server_ports(free)
    from prefect.server.api.server import SubprocessASGIServer

    failed: list[BaseException] = []

    def boot() -> None:
        try:
            SubprocessASGIServer().start()
        except BaseException as exc:  # re-raised by wait() in the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=boot, name="covgrad-prefect-server", daemon=True)
    thread.start()

    def wait() -> None:
        thread.join()
        if failed:
            raise failed[0]

    return wait


def check_root(cfg: Any) -> None:
    """OSError naming the root (exit 2 in ``covgrad``) when the local root of ``cfg`` could not be created
    (its nearest existing ancestor is a file, not writable, or refuses a directory: ``os.access`` grants root
    every write, also on a read-only or pseudo filesystem such as /sys, so a missing root is probed by creating
    its first missing directory and removing it), or exists unwritable while some planned artifact is not
    complete yet. Leaves nothing behind."""
    from storage.artifacts import ArtifactStore

    store = ArtifactStore(cfg.root)
    if not store.local:
        return
    base = Path(store.base)
    existing = next(p for p in (base, *base.parents) if p.exists())
    if not existing.is_dir():
        raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(base))
    if os.access(existing, os.W_OK):
        if existing != base:
            _probe_mkdir(existing, base)
        return
    if existing == base:
        from tasks.specs import plan

        if all(store.is_complete(step.ref) for step in plan(cfg).values()):
            return
    code = errno.EROFS if os.statvfs(existing).f_flag & os.ST_RDONLY else errno.EACCES
    left = ", and stages are left to compute" if existing == base else ""
    raise OSError(code, f"{os.strerror(code)}{left}", str(base))


def _probe_mkdir(existing: Path, root: Path) -> None:
    """Create and remove the first directory of the missing ``root`` below its ancestor ``existing``; OSError
    naming ``root`` with the refusal's errno."""
    probe = existing / root.relative_to(existing).parts[0]
    try:
        probe.mkdir()
    except OSError as exc:
        code = exc.errno or errno.EACCES
        raise OSError(code, os.strerror(code), str(root)) from exc
    probe.rmdir()


def server_ports() -> range:
    """The ports the temporary server may listen on: ``$COVGRAD_SERVER_PORTS`` as ``LO-HI`` (inclusive)
    or one port, else Prefect's 8000-8999."""
    text = os.environ.get(PORTS_ENV, "").strip()
    if not text:
        return DEFAULT_PORTS
    lo, _, hi = text.partition("-")
    try:
        ports = range(int(lo), int(hi or lo) + 1)
    except ValueError:
        ports = range(0)
    if not ports or ports.start < 1 or ports.stop > 65536:
        raise ValueError(f"{PORTS_ENV}={text!r} is not a port range; give LO-HI with 1 <= LO <= HI <= 65535")
    return ports


def free_ports(ports: range) -> list[int]:
    """The ports of ``ports`` that can be bound on 127.0.0.1 now; ValueError naming the range and the way
    around it when there is none."""
    free = []
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        free.append(port)
    if not free:
        raise ValueError(busy_ports_message(ports))
    return free


def busy_ports_message(ports: range) -> str:
    """The line for a temporary-server port range with no free port."""
    where = f"{ports.start}-{ports.stop - 1}" if len(ports) > 1 else str(ports.start)
    source = f"from {PORTS_ENV}" if os.environ.get(PORTS_ENV, "").strip() else "Prefect's default"
    return (
        f"every port of the temporary Prefect server's range 127.0.0.1:{where} ({source}) is busy; "
        f"set {PORTS_ENV}=LO-HI to another range, or PREFECT_API_URL to a running server"
    )


def server_start_error(exc: BaseException) -> ValueError | None:
    """The one-line error for Prefect's temporary server finding no free port after the check passed
    (the ports were taken in between); None for any other exception."""
    if isinstance(exc, RuntimeError) and str(exc).startswith(_BUSY):
        return ValueError(busy_ports_message(server_ports()))
    return None


def api_url_source() -> str:
    """Where PREFECT_API_URL came from: the environment, the active Prefect profile (named, with its
    file), or a settings file of the working directory."""
    if os.environ.get("PREFECT_API_URL"):
        return "the environment"
    from prefect.context import get_settings_context

    profile = get_settings_context().profile
    if any(getattr(s, "name", s) == "PREFECT_API_URL" for s in profile.settings):
        return f"Prefect profile {profile.name!r} in {profile.source}"
    return f"a prefect.toml, pyproject.toml [tool.prefect] or .env in {Path.cwd()}"


def _check_api(url: str, source: str, timeout: float) -> None:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as response:
            if response.status == 200:
                return
            why = f"HTTP {response.status}"
    except (urllib.error.URLError, OSError, ValueError) as err:
        why = str(getattr(err, "reason", err))
    if source == "the environment":
        fix = "unset PREFECT_API_URL"
    elif source.startswith("Prefect profile"):
        fix = "drop it from that profile (`prefect config unset PREFECT_API_URL`)"
    else:
        fix = "remove PREFECT_API_URL there"
    raise ValueError(
        f"PREFECT_API_URL={url} (from {source}) does not answer ({why}); start that server "
        f"(`make server`) or {fix} to run on a temporary one"
    )


def _check_sqlite(path: Path, timeout: float) -> None:
    if not path.exists():
        return
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=timeout) as db:
            db.execute("PRAGMA schema_version").fetchone()
            db.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.DatabaseError as err:
        raise ValueError(
            f"the Prefect database {path} is unreadable ({err}); move it away (Prefect creates a new one) "
            "or set PREFECT_HOME to another directory"
        ) from None
