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


PARENT = r"""
import os, signal, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from flows.reaper import start_reaper
start_reaper(interval=60)  # one record of the run's descendants, now, before it has any
sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
spawn = f"import subprocess; print(subprocess.Popen({sleeper!r}, start_new_session=True).pid)"
# a child that starts a grandchild in its own session and exits at once: the grandchild is re-parented to init
with open(sys.argv[2], "w") as out:
    subprocess.run([sys.executable, "-c", spawn], stdout=out, check=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_re_parented_grandchild_of_a_killed_run_is_stopped(tmp_path):
    """The watchdog stops what the run started even when it left the run's tree between two records (a double
    fork, no record after it): it carries the run's token in its environment."""
    pid_file = tmp_path / "grandchild.pid"
    with open(tmp_path / "stderr", "w") as err:  # not a pipe: the grandchild would hold it open
        out = subprocess.run([sys.executable, "-c", PARENT, str(REPO), str(pid_file)], stderr=err, timeout=60)
    assert out.returncode == -signal.SIGKILL, (tmp_path / "stderr").read_text()[-2000:]
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        if time.monotonic() > deadline:
            psutil.Process(pid).kill()
            raise AssertionError(f"the re-parented grandchild {pid} outlived the killed run")
        time.sleep(0.1)
