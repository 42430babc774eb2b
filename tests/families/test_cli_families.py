"""``covgrad run`` (the CLI, as a subprocess) completes every stage on a saved tiny Qwen3.5 directory (hybrid
linear attention) with every parameter selected. GPT-OSS and DeepSeek-V3 run the same stages in process
(tests/scores/test_preflight.py): the CLI adds nothing per family."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from covgrad.offline import OFFLINE_ENV
from tests.helpers.arch_dirs import SMALL, arch_dir, family_config
from tests.helpers.pipeline import REPO

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family", ["qwen3.5"])
def test_cli_run_completes_every_stage(tmp_path, cli_api, family):
    from tasks.specs import plan

    cfg = family_config(tmp_path, arch_dir(tmp_path / family, family), **SMALL)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    env = {**os.environ, "PREFECT_API_URL": cli_api}
    env.update({"PYTHONPATH": str(REPO), "COVGRAD_LOG_DIR": str(tmp_path / "logs"), **OFFLINE_ENV})
    cmd = [sys.executable, "-m", "flows.cli", "run", "--config", str(config)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    nodes = plan(cfg)
    for name, node in nodes.items():  # one line per stage: "<instance> computed <key>  X s, peak Y GiB"
        line = rf"{re.escape(name)} +computed +{node.ref.key}  [\d.]+ s, peak [\d.]+ GiB$"
        assert re.search(line, out, flags=re.M), (name, out[-3000:])
    assert f"{len(nodes)} stage(s) computed, 0 from cache" in proc.stdout, proc.stdout[-3000:]
    report = Path(re.search(r"^report:\s+(\S+)", proc.stdout, flags=re.M).group(1))
    assert report.is_file() and (report.parent / "headline.md").is_file()
