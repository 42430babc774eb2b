"""``covgrad run`` killed by SIGKILL leaves no process behind: its temporary Prefect server is stopped by the
run's watchdog (flows/reaper.py) within seconds."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers.pipeline import REPO

pytestmark = pytest.mark.slow


def _server_children(proc: psutil.Process) -> list[psutil.Process]:
    """The run's descendants that are the temporary Prefect server (uvicorn serving prefect's API)."""
    out = []
    for p in proc.children(recursive=True):
        try:
            if "uvicorn" in " ".join(p.cmdline()) or "prefect" in " ".join(p.cmdline()[1:3]):
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


def test_sigkill_of_covgrad_run_leaves_no_server(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update({"PYTHONPATH": str(REPO), "COVGRAD_LOG_DIR": str(tmp_path / "logs")})
    cmd = [sys.executable, "-m", "flows.cli", "run", "--config", str(REPO / "configs" / "tiny.yaml")]
    run = subprocess.Popen(
        [*cmd, "--root", str(tmp_path / "root")], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    parent = psutil.Process(run.pid)
    servers: list[psutil.Process] = []
    deadline = time.monotonic() + 240
    while not servers and time.monotonic() < deadline and run.poll() is None:
        time.sleep(0.2)
        servers = _server_children(parent)
    assert servers, "the temporary Prefect server never started"
    descendants = [p for p in parent.children(recursive=True) if p.is_running()]
    os.kill(run.pid, signal.SIGKILL)
    run.wait(10)
    _, alive = psutil.wait_procs(descendants, timeout=5)
    assert not alive, f"still running 5 s after SIGKILL: {[(p.pid, p.cmdline()[:4]) for p in alive]}"
