"""Checks of the Prefect runtime a ``covgrad run`` is about to use, in about a second, before the flow starts:
an API server named by ``PREFECT_API_URL`` must answer, and without one the database of the temporary
server (Prefect's SQLite file) must be readable. Each failure is one line naming the setting or the file."""

import os
import sqlite3
import urllib.error
import urllib.request
from pathlib import Path


def check_prefect_runtime(timeout: float = 5.0) -> None:
    """ValueError when the Prefect API this process would use cannot work (see the module docstring)."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    url = settings.api.url
    if url:
        _check_api(str(url).rstrip("/"), _api_url_source(), timeout)
        return
    connection = settings.server.database.connection_url
    value = connection.get_secret_value() if connection is not None else ""
    if value.startswith("sqlite"):
        _check_sqlite(Path(value.split(":///", 1)[1]), timeout)


def _api_url_source() -> str:
    """Where PREFECT_API_URL came from: the environment or the active Prefect profile."""
    if os.environ.get("PREFECT_API_URL"):
        return "the environment"
    from prefect.settings import get_current_settings

    profile = os.environ.get("PREFECT_PROFILE") or "the active profile"
    return f"{profile} in {get_current_settings().profiles_path}"


def _check_api(url: str, source: str, timeout: float) -> None:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as response:
            if response.status == 200:
                return
            why = f"HTTP {response.status}"
    except (urllib.error.URLError, OSError, ValueError) as err:
        why = str(getattr(err, "reason", err))
    raise ValueError(
        f"PREFECT_API_URL={url} (from {source}) does not answer ({why}); start that server "
        "(`make server`) or unset PREFECT_API_URL to run on a temporary one"
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
