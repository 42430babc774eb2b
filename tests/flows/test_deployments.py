"""Deployments end to end: a real Prefect server, the work pool, ``prefect deploy --all`` from
prefect.yaml, a process worker, deployment runs, server-side parameter validation, a schedule, and
the ``covgrad-watch`` flow. One server, pool and worker serve the whole module."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from covgrad.config import PipelineConfig
from tests.helpers.pipeline import REPO
from tests.helpers.ports import free_port
from tests.helpers.user import user_config, write_checkpoint

pytestmark = pytest.mark.integration

SCRIPTS = REPO / "scripts"


def assert_run_complete(cfg: PipelineConfig) -> None:
    """Every planned artifact has its completion marker and the run index names them."""
    from storage.artifacts import ArtifactStore
    from storage.runs import read_run_index
    from tasks.specs import plan

    store = ArtifactStore(cfg.root)
    nodes = plan(cfg)
    incomplete = [name for name, node in nodes.items() if not store.is_complete(node.ref)]
    assert not incomplete, f"artifacts without a completion marker: {incomplete}"
    index = read_run_index(store, cfg.name)
    assert {n: a["key"] for n, a in index["artifacts"].items()} == {n: node.ref.key for n, node in nodes.items()}


def stop(proc: subprocess.Popen, signals: int) -> None:
    """SIGTERM ``signals`` times (a worker needs two), then SIGKILL if it still runs."""
    for _ in range(signals):
        if proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            continue
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=15)


@dataclass
class Server:
    """The module's live server: its API URL, the environment for CLI calls, and temporary paths."""

    url: str
    env: dict[str, str]
    tmp: Path
    checkpoint: Path
    task_file: Path

    def prefect(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["prefect", *args], env=self.env, cwd=REPO, capture_output=True, text=True, timeout=timeout
        )

    def client(self) -> Any:
        """A synchronous Prefect client for this server (use inside ``with self.settings():``)."""
        from prefect.client.orchestration import get_client

        return get_client(sync_client=True)

    def settings(self) -> Any:
        from prefect.settings import PREFECT_API_URL, temporary_settings

        return temporary_settings(updates={PREFECT_API_URL: self.url})

    def why(self, run: subprocess.CompletedProcess) -> str:
        """What a failed ``deployment run --watch`` leaves to read: the CLI's tail, the flow run's own log
        lines from the server (the traceback of a failed run) and the worker's log tail."""
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

        text = run.stdout[-2000:] + run.stderr[-2000:]
        found = re.search(r"flow-run/([0-9a-f-]{36})", run.stdout)
        if found:
            with self.settings(), self.client() as client:
                lines = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[found.group(1)])))
            text += "\nflow run logs:\n" + "\n".join(log.message for log in lines)[-6000:]
        return text + "\nworker log:\n" + (self.tmp / "logs" / "worker.log").read_text()[-3000:]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("deployments")
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    (tmp / "watch-empty").mkdir()
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # the venv's prefect
        "PREFECT_HOME": str(tmp / "prefect-home"),
        "PREFECT_API_URL": url,
        "COVGRAD_PREFECT_PORT": str(port),
        "COVGRAD_HOME": str(REPO),
        "COVGRAD_ROOT": str(tmp / "default-root"),
        "COVGRAD_WATCH_DIR": str(tmp / "watch-empty"),
        "COVGRAD_MODEL_PATH": str(tmp / "ckpt"),
        "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(tmp / "prefect-results"),
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "1",
        "PREFECT_SERVER_SERVICES_SCHEDULER_MAX_RUNS": "3",
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "COLUMNS": "200",
    }
    env.pop("PREFECT_PROFILES_PATH", None)
    logs = tmp / "logs"
    logs.mkdir()
    with open(logs / "server.log", "w") as server_log, open(logs / "worker.log", "w") as worker_log:
        srv = subprocess.Popen([str(SCRIPTS / "server.sh")], env=env, stdout=server_log, stderr=subprocess.STDOUT)
        worker = None
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                        if r.read().strip() == b"true":
                            break
                except OSError:
                    pass
                if srv.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"Prefect server did not start:\n{(logs / 'server.log').read_text()[-3000:]}")
                time.sleep(0.5)
            deploy = subprocess.run(
                [str(SCRIPTS / "deploy.sh")], env=env, cwd=REPO, capture_output=True, text=True, timeout=180
            )
            assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
            worker = subprocess.Popen(
                [str(SCRIPTS / "worker.sh")], env=env, stdout=worker_log, stderr=subprocess.STDOUT
            )
            yield Server(url, env, tmp, write_checkpoint(tmp / "ckpt"), tmp / "task.jsonl")
        finally:
            if worker is not None:
                stop(worker, signals=2)
            stop(srv, signals=1)


def test_prefect_yaml_deployments_are_registered(server: Server):
    with server.settings(), server.client() as client:
        demo = client.read_deployment_by_name("covgrad-pipeline/demo")
        user = client.read_deployment_by_name("covgrad-pipeline/user-model")
        watch = client.read_deployment_by_name("covgrad-watch/checkpoints")
    assert demo.parameters == {"config_file": "configs/demo.yaml", "config": {"root": server.env["COVGRAD_ROOT"]}}
    assert PipelineConfig.model_validate(user.parameters["config"]).model.path == str(server.tmp / "ckpt")
    for d in (demo, user, watch):
        assert d.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}]
        assert d.work_pool_name == "covgrad-pool" and d.enforce_parameter_schema
    assert watch.parameters["directory"] == server.env["COVGRAD_WATCH_DIR"]
    assert watch.global_concurrency_limit is not None and watch.global_concurrency_limit.limit == 1
    assert [(s.schedule.interval.total_seconds(), s.active) for s in watch.schedules] == [(900.0, True)]


def test_pipeline_deployment_run_completes(server: Server):
    cfg = user_config(server.tmp / "run-root", server.checkpoint, server.task_file)
    params = json.dumps({"config": cfg.model_dump(mode="json")})
    run = server.prefect(
        "deployment",
        "run",
        "covgrad-pipeline/user-model",
        "--params",
        params,
        "--watch",
        "--watch-interval",
        "1",
        "--watch-timeout",
        "240",
        timeout=270,
    )
    assert run.returncode == 0, server.why(run)
    assert "Completed" in run.stdout
    assert_run_complete(cfg)


def test_bad_parameter_is_rejected_before_a_run_exists(server: Server):
    with server.settings(), server.client() as client:
        before = len(client.read_flow_runs())
    cfg = user_config(server.tmp / "bad-root", server.checkpoint, server.task_file).model_dump(mode="json")
    cfg["scores"]["groups_per_batch"] = -1
    run = server.prefect(
        "deployment", "run", "covgrad-pipeline/user-model", "--params", json.dumps({"config": cfg}), timeout=60
    )
    out = " ".join((run.stdout + run.stderr).split())  # the CLI wraps lines at the terminal width
    assert run.returncode == 1, out[-3000:]
    assert "Validation failed for field 'config.scores.groups_per_batch'" in out, out[-3000:]
    with server.settings(), server.client() as client:
        assert len(client.read_flow_runs()) == before
    assert not (server.tmp / "bad-root").exists()


def test_bad_task_file_fails_in_preflight_with_the_cli_line(server: Server):
    """A deployment run whose task file has a malformed line fails in the flow's preflight, before any
    stage (no task run, nothing under its root), with the line ``covgrad run`` prints for the same config."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    task = server.tmp / "malformed.jsonl"
    task.write_text('{"prompt": "1+2=", "answer": "3"}\n{"prompt": "2+2=", "answer": \n')
    root = server.tmp / "malformed-root"
    cfg = user_config(root, server.checkpoint, task, **{"task.reward": "covgrad.rewards:mentions_answer"})
    config_file = server.tmp / "malformed.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    env = {**server.env, "PYTHONPATH": str(REPO), "COVGRAD_LOG_DIR": str(server.tmp / "logs")}
    cli = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", "--config", str(config_file)],
        cwd=REPO,
        env={k: v for k, v in env.items() if k != "PREFECT_API_URL"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 2, cli.stderr
    said = re.fullmatch(r"covgrad: error: (.*) \(traceback: .*\)", cli.stderr.strip())
    assert said and f"{task}:2: not valid JSON" in said[1], cli.stderr
    with server.settings(), server.client() as client:
        deployment = client.read_deployment_by_name("covgrad-pipeline/user-model")
        run = client.create_flow_run_from_deployment(deployment.id, parameters={"config": cfg.model_dump(mode="json")})
        deadline = time.monotonic() + 180
        while not (state := client.read_flow_run(run.id).state).is_final() and time.monotonic() < deadline:
            time.sleep(1)
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
    assert state.is_failed(), state
    assert state.message == f"Flow run encountered an exception: ValueError: {said[1]}", state.message
    assert tasks == []
    assert not root.exists()


def test_watch_analyses_each_checkpoint_once(prefect_server, server: Server):
    # In-process flows use the session's test API: flows run against the module server would leave
    # log and event workers trying to reach it after it stops.
    from flows.watch import checkpoint_config, covgrad_watch
    from storage.artifacts import ArtifactStore
    from storage.runs import read_watch_record

    directory = server.tmp / "checkpoints"
    shutil.copytree(server.checkpoint, directory / "step-100")
    (directory / "notes").mkdir()
    (directory / "notes" / "readme.txt").write_text("not a checkpoint")
    (directory / "other-5").mkdir()
    shutil.copy(server.checkpoint / "config.json", directory / "other-5")
    cfg = user_config(server.tmp / "watch-root", server.checkpoint, server.task_file, name="watch")
    first = covgrad_watch(str(directory), cfg, pattern="step-*")
    second = covgrad_watch(str(directory), cfg, pattern="step-*")
    assert first["analysed"] == ["step-100"] and first["skipped"] == []
    assert second["analysed"] == [] and second["skipped"] == ["step-100"]
    assert first["runs"] == second["runs"]
    record = read_watch_record(ArtifactStore(cfg.root), "watch")
    assert set(record) == {"step-100"} and record["step-100"]["run"] == first["runs"]["step-100"]
    assert_run_complete(checkpoint_config(cfg, directory / "step-100"))


def test_interval_schedule_fires(server: Server):
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    created = server.prefect("deployment", "schedule", "create", "covgrad-watch/checkpoints", "--interval", "2")
    assert created.returncode == 0, created.stdout + created.stderr
    with server.settings(), server.client() as client:
        deployment = client.read_deployment_by_name("covgrad-watch/checkpoints")
        flt = DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
        deadline = time.monotonic() + 120
        states: list[str] = []
        while time.monotonic() < deadline:
            runs = client.read_flow_runs(deployment_filter=flt)
            states = [r.state_name for r in runs if r.auto_scheduled]
            if "Completed" in states:
                break
            time.sleep(1)
    assert "Completed" in states, f"no scheduled run completed within 120 s; states {states}"
