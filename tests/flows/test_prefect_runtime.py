"""A Prefect runtime that cannot work is named in one line within seconds: a corrupt database of the temporary
server, a PREFECT_API_URL that does not answer (saying where the setting came from: the environment or a
Prefect profile), and a temporary-server port range with every port busy (naming the range and
``COVGRAD_SERVER_PORTS``)."""

import functools
import os
import socket
import subprocess
import sys
import time
import types

import pytest

from tests.helpers.pipeline import REPO
from tests.helpers.ports import free_port

PREFECT_ENV = ("PREFECT_API_URL", "PREFECT_HOME", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH", "COVGRAD_SERVER_PORTS")


def _covgrad_run(tmp_path, env_extra: dict[str, str]) -> tuple[subprocess.CompletedProcess, float]:
    """``covgrad run`` of the tiny config under ``tmp_path``, without the caller's Prefect settings:
    (the process, seconds it took)."""
    env = {k: v for k, v in os.environ.items() if k not in PREFECT_ENV}
    env.update({"PYTHONPATH": str(REPO), "COVGRAD_LOG_DIR": str(tmp_path / "logs"), **env_extra})
    cmd = [sys.executable, "-m", "flows.cli", "run", "--config", str(REPO / "configs" / "tiny.yaml")]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [*cmd, "--root", str(tmp_path / "root")], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    return proc, time.perf_counter() - t0


@functools.cache
def budget() -> float:
    """10 s plus what starting Python and importing ``flows.cli`` and Prefect's settings takes here now (a
    loaded CI machine takes far longer than an idle one; the failure this guards against waits 300 s)."""
    t0 = time.perf_counter()
    code = "import flows.cli, prefect.settings"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
    return 10.0 + time.perf_counter() - t0


def _dead_url() -> str:
    """An API URL on a local port nobody listens on (below the ephemeral range: see tests.helpers.ports)."""
    return f"http://127.0.0.1:{free_port()}/api"


def _bound_ports(n: int) -> tuple[range, list[socket.socket]]:
    """``n`` consecutive local ports, each held bound by a returned socket (the caller closes them)."""
    for start in range(41000, 60000, 97):
        socks = []
        for port in range(start, start + n):
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                break
            socks.append(sock)
        if len(socks) == n:
            return range(start, start + n), socks
        for sock in socks:
            sock.close()
    raise RuntimeError("no run of free local ports")


@pytest.mark.slow
def test_a_corrupt_prefect_database_is_named_within_ten_seconds(tmp_path):
    home = tmp_path / "prefect-home"
    home.mkdir()
    (home / "prefect.db").write_bytes(b"this is not an sqlite database" * 100)
    proc, seconds = _covgrad_run(tmp_path, {"PREFECT_HOME": str(home)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"the Prefect database {home / 'prefect.db'} is unreadable" in lines[0], lines
    assert seconds < budget(), f"took {seconds:.1f} s (budget {budget():.1f} s)"
    assert not (tmp_path / "root").exists()


@pytest.mark.slow
def test_an_api_url_that_does_not_answer_names_its_source(tmp_path):
    url = _dead_url()
    proc, seconds = _covgrad_run(tmp_path, {"PREFECT_API_URL": url})
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"PREFECT_API_URL={url} (from the environment) does not answer" in lines[0], lines
    assert seconds < budget(), f"took {seconds:.1f} s (budget {budget():.1f} s)"


def test_a_readable_database_passes(tmp_path):
    import sqlite3

    from flows.runtime import _check_sqlite

    db = tmp_path / "prefect.db"
    sqlite3.connect(db).execute("CREATE TABLE t (x)").connection.commit()
    _check_sqlite(db, 1.0)
    _check_sqlite(tmp_path / "absent.db", 1.0)


@pytest.mark.slow
def test_a_stale_profile_api_url_names_the_profile_and_its_file(tmp_path):
    """PREFECT_API_URL set only in the active profile of ``$PREFECT_HOME/profiles.toml``, pointing at a dead
    server: exit 2 within seconds, one line naming the profile and the file, not the environment."""
    url = _dead_url()
    home = tmp_path / "prefect-home"
    home.mkdir()
    profiles = home / "profiles.toml"
    profiles.write_text(f'active = "stale"\n\n[profiles.stale]\nPREFECT_API_URL = "{url}"\n\n[profiles.local]\n')
    proc, seconds = _covgrad_run(tmp_path, {"PREFECT_HOME": str(home)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert f"PREFECT_API_URL={url} (from Prefect profile 'stale' in {profiles}) does not answer" in lines[0], lines
    assert "environment" not in lines[0] and "prefect config unset PREFECT_API_URL" in lines[0], lines
    assert seconds < budget(), f"took {seconds:.1f} s (budget {budget():.1f} s)"
    assert not (tmp_path / "root").exists()


@pytest.mark.slow
def test_every_temporary_server_port_busy_names_the_range_and_the_way_around(tmp_path):
    """Every port of a three-port ``COVGRAD_SERVER_PORTS`` range really bound by this test: exit 2 within
    seconds, one line naming the range, the setting and PREFECT_API_URL; no root created."""
    ports, socks = _bound_ports(3)
    try:
        spec = f"{ports.start}-{ports.stop - 1}"
        proc, seconds = _covgrad_run(tmp_path, {"COVGRAD_SERVER_PORTS": spec})
    finally:
        for sock in socks:
            sock.close()
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert f"range 127.0.0.1:{spec} (from COVGRAD_SERVER_PORTS) is busy" in lines[0], lines
    assert "set COVGRAD_SERVER_PORTS=LO-HI to another range, or PREFECT_API_URL to a running server" in lines[0]
    assert seconds < budget(), f"took {seconds:.1f} s (budget {budget():.1f} s)"
    assert not (tmp_path / "root").exists()


def test_server_ports_parse_and_refuse(monkeypatch):
    from flows.runtime import DEFAULT_PORTS, server_ports

    monkeypatch.delenv("COVGRAD_SERVER_PORTS", raising=False)
    assert server_ports() == DEFAULT_PORTS == range(8000, 9000)
    for text, ports in [("20000-20009", range(20000, 20010)), (" 30001 ", range(30001, 30002))]:
        monkeypatch.setenv("COVGRAD_SERVER_PORTS", text)
        assert server_ports() == ports
    for bad in ["abc", "9000-8000", "0-10", "65000-70000", "1-2-3"]:
        monkeypatch.setenv("COVGRAD_SERVER_PORTS", bad)
        with pytest.raises(ValueError, match=rf"COVGRAD_SERVER_PORTS='{bad}' is not a port range; give LO-HI"):
            server_ports()


def test_free_ports_skip_bound_ones_and_name_a_full_range(monkeypatch):
    from flows.runtime import free_ports

    monkeypatch.setenv("COVGRAD_SERVER_PORTS", "1")
    ports, socks = _bound_ports(3)
    try:
        socks[1].close()
        assert free_ports(ports) == [ports.start + 1]
        socks[1] = socket.socket()
        socks[1].bind(("127.0.0.1", ports.start + 1))
        with pytest.raises(ValueError, match=rf"127\.0\.0\.1:{ports.start}-{ports.stop - 1} \(from COVGRAD"):
            free_ports(ports)
    finally:
        for sock in socks:
            sock.close()


def test_ports_taken_after_the_check_exit_2_in_one_line(monkeypatch, capsys, tmp_path):
    """Prefect's own "Unable to find an available port" RuntimeError from the flow becomes the same line,
    exit 2; any other RuntimeError stays an internal error."""
    import flows.cli as cli
    import flows.preflight
    import flows.runtime

    monkeypatch.setenv("COVGRAD_LOG_DIR", str(tmp_path / "logs"))
    monkeypatch.setenv("COVGRAD_SERVER_PORTS", "41000-41009")
    monkeypatch.setattr(cli, "_LOG_PATH", None)
    monkeypatch.setattr(cli, "quiet_prefect", lambda: None)  # it sets process-wide Prefect settings
    monkeypatch.setattr(flows.preflight, "preflight", lambda cfg, architecture: None)
    monkeypatch.setattr(flows.runtime, "check_prefect_runtime", lambda: None)
    monkeypatch.setattr(flows.runtime, "check_root", lambda cfg: None)
    monkeypatch.setattr(cli, "route_errors_to_log", lambda: None)
    argv = ["run", "--config", str(REPO / "configs" / "tiny.yaml"), "--root", str(tmp_path / "root")]
    for message, status, text in [
        ("Unable to find an available port after multiple attempts", 2, "127.0.0.1:41000-41009 (from"),
        ("something else", 1, "internal error (RuntimeError): something else"),
    ]:

        def flow(cfg, message=message):
            raise RuntimeError(message)

        monkeypatch.setitem(sys.modules, "flows.pipeline", types.SimpleNamespace(covgrad_pipeline=flow))
        assert cli.main(argv) == status
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and text in lines[0], lines


def test_the_check_restricts_the_temporary_server_to_the_free_ports(monkeypatch, tmp_path):
    """Without an API URL, ``check_prefect_runtime`` finds the free ports of ``COVGRAD_SERVER_PORTS`` and
    ``use_server_ports`` leaves Prefect's temporary server only those to pick from."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_DATABASE_CONNECTION_URL, temporary_settings

    from flows.runtime import check_prefect_runtime, use_server_ports

    monkeypatch.setattr(SubprocessASGIServer, "_port_range", SubprocessASGIServer._port_range)
    ports, socks = _bound_ports(3)
    socks[2].close()
    monkeypatch.setenv("COVGRAD_SERVER_PORTS", f"{ports.start}-{ports.stop - 1}")
    db = f"sqlite+aiosqlite:///{tmp_path / 'prefect.db'}"
    try:
        with temporary_settings({PREFECT_SERVER_DATABASE_CONNECTION_URL: db}, restore_defaults={PREFECT_API_URL}):
            free = check_prefect_runtime()
    finally:
        for sock in socks[:2]:
            sock.close()
    assert free == [ports.start + 2]
    use_server_ports(free)
    assert SubprocessASGIServer._port_range == [ports.start + 2]


def test_a_temporary_server_that_cannot_start_early_exits_2_in_one_line(monkeypatch, capsys, tmp_path):
    """The temporary server starts while the pipeline imports (``flows.runtime.start_server``); when every port
    left to it is taken by then, the run ends with the ports line, exit 2, before the flow is called."""
    from prefect.server.api.server import SubprocessASGIServer

    import flows.cli as cli
    import flows.preflight
    import flows.runtime

    monkeypatch.setenv("COVGRAD_LOG_DIR", str(tmp_path / "logs"))
    monkeypatch.setattr(SubprocessASGIServer, "_port_range", SubprocessASGIServer._port_range)
    monkeypatch.setattr(SubprocessASGIServer, "_instances", {})  # not the server an earlier test left running
    monkeypatch.setattr(cli, "_LOG_PATH", None)
    monkeypatch.setattr(cli, "quiet_prefect", lambda: None)
    monkeypatch.setattr(flows.preflight, "preflight", lambda cfg, architecture: None)
    monkeypatch.setattr(flows.runtime, "check_root", lambda cfg: None)
    monkeypatch.setattr(cli, "route_errors_to_log", lambda: None)
    ports, socks = _bound_ports(1)  # free at the check, taken when the server starts
    monkeypatch.setenv("COVGRAD_SERVER_PORTS", f"{ports.start}-{ports.start}")
    monkeypatch.setattr(flows.runtime, "check_prefect_runtime", lambda: [ports.start])

    def flow(cfg):
        raise AssertionError("the flow ran without a server")

    monkeypatch.setitem(sys.modules, "flows.pipeline", types.SimpleNamespace(covgrad_pipeline=flow))
    argv = ["run", "--config", str(REPO / "configs" / "tiny.yaml"), "--root", str(tmp_path / "root")]
    try:
        assert cli.main(argv) == 2
    finally:
        socks[0].close()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"range 127.0.0.1:{ports.start} (from COVGRAD_SERVER_PORTS) is busy" in lines[0], lines
