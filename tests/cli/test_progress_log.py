"""Under ``covgrad run > log 2>&1`` (stderr not a terminal) every long stage writes plain progress lines
with items done, rate and ETA."""

import os
import re
import subprocess
import sys

import pytest

from tests.helpers.pipeline import REPO


@pytest.mark.slow
def test_covgrad_run_into_a_file_writes_progress_lines_with_eta(tmp_path, cli_api):
    env = {k: v for k, v in os.environ.items() if k != "COVGRAD_PROGRESS"} | {"PREFECT_API_URL": cli_api}
    # a line at every unit: each stage's loop reports as it would every 30 s on a long run
    env.update({"PYTHONPATH": str(REPO), "COVGRAD_LOG_DIR": str(tmp_path / "logs"), "COVGRAD_PROGRESS_SECONDS": "0"})
    log = tmp_path / "log"
    cmd = [sys.executable, "-m", "flows.cli", "run", "--config", "configs/tiny.yaml", "--root", str(tmp_path / "r")]
    # the scores stage counts its batches at checkpoints: one per batch here
    cmd += ["--set", "model.demo.eval_every=5", "--set", "scores.checkpoint_batches=1", "--set", "tokens.enabled=false"]
    with log.open("w") as out:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=900)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith("covgrad progress: ")]
    pattern = r"covgrad progress: (.+?): (\d+)/(\d+) (\w+) \(\d+%\), \S+ \w+/s, ETA (\d+ s|unknown), \d+ s so far"
    stages = {re.match(pattern, line).group(1).split()[0] for line in lines if re.match(pattern, line)}
    assert {"base_model", "rollouts", "scores", "update_check"} <= stages, lines
    assert all(re.match(pattern, line) for line in lines), lines
