"""A Prefect runtime that cannot work is named in one line within seconds: a corrupt database of the temporary
server, and a PREFECT_API_URL that does not answer (saying where the setting came from)."""

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.helpers.pipeline import REPO


def _covgrad_run(tmp_path, env_extra: dict[str, str]) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    env.update({"PYTHONPATH": str(REPO), "COVGRAD_LOG_DIR": str(tmp_path / "logs"), **env_extra})
    cmd = [sys.executable, "-m", "flows.cli", "run", "--config", str(REPO / "configs" / "tiny.yaml")]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [*cmd, "--root", str(tmp_path / "root")], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    return proc, time.perf_counter() - t0


@pytest.mark.slow
def test_a_corrupt_prefect_database_is_named_within_ten_seconds(tmp_path):
    home = tmp_path / "prefect-home"
    home.mkdir()
    (home / "prefect.db").write_bytes(b"this is not an sqlite database" * 100)
    proc, seconds = _covgrad_run(tmp_path, {"PREFECT_HOME": str(home)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"the Prefect database {home / 'prefect.db'} is unreadable" in lines[0], lines
    assert seconds < 10, f"took {seconds:.1f} s"
    assert not (tmp_path / "root").exists()


@pytest.mark.slow
def test_an_api_url_that_does_not_answer_names_its_source(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/api"
    proc, seconds = _covgrad_run(tmp_path, {"PREFECT_API_URL": url})
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"PREFECT_API_URL={url} (from the environment) does not answer" in lines[0], lines
    assert seconds < 10, f"took {seconds:.1f} s"


@pytest.mark.parametrize("good", [True])
def test_a_readable_database_passes(tmp_path, good):
    import sqlite3

    from flows.runtime import _check_sqlite

    db = tmp_path / "prefect.db"
    sqlite3.connect(db).execute("CREATE TABLE t (x)").connection.commit()
    _check_sqlite(db, 1.0)
    _check_sqlite(tmp_path / "absent.db", 1.0)
