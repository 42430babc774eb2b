"""Faults on real mounts, as a user meets them: the scores stage writing to a full tmpfs, and a fully cached root
bind-mounted read-only. They need root (``mount``); elsewhere they skip, naming the refusal. Every mount is
undone at the end of its test, also on failure."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from covgrad.offline import OFFLINE_ENV
from tests.helpers.faults import OVERRIDES, digests, error_line, read_only_bind, resize_tmpfs, tmpfs, tree
from tests.helpers.pipeline import REPO
from tests.helpers.ports import free_ports

pytestmark = pytest.mark.slow


def covgrad_run(tmp_path: Path, root: Path, api: str | None = None, **env_extra: str) -> subprocess.CompletedProcess:
    """``python -m flows.cli run`` of the tiny config (the fault overrides) on ``root``, against the Prefect
    API ``api`` (None: its own temporary server)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "COVGRAD_SERVER_PORTS")}
    if api is not None:
        env["PREFECT_API_URL"] = api
    env.update({"PYTHONPATH": str(REPO), "COVGRAD_LOG_DIR": str(tmp_path / "logs"), **OFFLINE_ENV})
    env.update(env_extra)
    sets = [a for k, v in OVERRIDES.items() for a in ("--set", f"{k}={str(v).lower()}")]
    cmd = [sys.executable, "-m", "flows.cli", "run", "--config", str(REPO / "configs" / "tiny.yaml")]
    return subprocess.run(
        [*cmd, "--root", str(root), *sets], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )


def stages_above(plan, stage: str) -> set[str]:
    """The stages of ``plan`` with no instance of ``stage`` or below one."""
    below = set().union(*(plan.downstream(n) for n in plan if plan[n].ref.stage == stage))
    return {plan[n].ref.stage for n in plan} - {plan[n].ref.stage for n in below}


def artifacts(root: Path) -> dict[str, dict[str, bytes]]:
    """Every artifact directory under ``root`` (stage/key) → its data files (``digests``)."""
    return {
        f"{d.parent.name}/{d.name}": digests(d)
        for d in sorted(root.glob("*/*"))
        if d.is_dir() and not d.parent.name.startswith((".", "_")) and d.parent.name != "runs"
    }


def test_full_disk_in_the_scores_stage_exits_2_and_a_roomy_rerun_is_identical(tiny_run, cli_api, tmp_path):
    """The finished tiny run's stages above scores copied to a new root whose ``scores/`` is a 512 KiB tmpfs
    (one scores artifact is ~1.7 MB): ``covgrad run`` exits 2 with one line naming the scores array it was
    writing, and nothing is marked complete (no stage at or below scores, none in the run index). Grown to 64 MiB in
    place, the rerun resumes, exits 0, and every artifact is byte-identical to the uninterrupted run."""
    source, plan = tiny_run
    root = tmp_path / "root"
    above = stages_above(plan, "scores")
    assert "scores" not in above and "rollouts" in above
    for stage in above:
        shutil.copytree(source / stage, root / stage)
    scores = root / "scores"
    scores.mkdir()
    with tmpfs(scores, "512k"):
        proc = covgrad_run(tmp_path, root, cli_api)
        assert proc.returncode == 2, proc.stderr[-3000:]
        line = error_line(proc.stderr)
        assert re.search(rf"disk full writing (file://)?{re.escape(str(scores))}/[0-9a-f]{{24}}/", line), line
        assert "free space there or pass --root on another disk" in line, line
        assert not [p for p in root.rglob("_COMPLETE.json") if p.parent.parent.name not in above]
        listed = json.loads((root / "runs" / "tiny.json").read_text())["artifacts"].values()
        assert {a["stage"] for a in listed} <= above, listed
        resize_tmpfs(scores, "64m")
        proc = covgrad_run(tmp_path, root, cli_api)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "report:  " in proc.stdout, proc.stdout
        assert artifacts(root) == artifacts(source)


def test_full_disk_in_the_stats_stage_names_the_artifact(tiny_run, cli_api, tmp_path):
    """The finished tiny run's stages above stats copied to a new root whose ``stats/`` is a 256 KiB tmpfs
    (one stats artifact is ~750 KB, written by dask threads that name no file): exit 2, one line naming
    the stats artifact directory being written; no stats artifact marked complete."""
    source, plan = tiny_run
    root = tmp_path / "root"
    above = stages_above(plan, "stats")
    assert {"scores", "rollouts"} <= above and "stats" not in above
    for stage in above:
        shutil.copytree(source / stage, root / stage)
    stats = root / "stats"
    stats.mkdir()
    with tmpfs(stats, "256k"):
        proc = covgrad_run(tmp_path, root, cli_api)
        assert proc.returncode == 2, proc.stderr[-3000:]
        line = error_line(proc.stderr)
        assert re.search(rf"disk full writing {re.escape(str(stats))}/[0-9a-f]{{24}}: No space left", line), line
        assert not list(stats.rglob("_COMPLETE.json"))


def _port_range(n: int) -> str:
    """``LO-HI`` of ``n`` consecutive free local ports."""
    ports = free_ports(n)
    return f"{ports.start}-{ports.stop - 1}"


def test_fully_cached_root_on_a_read_only_mount_serves_its_results(tiny_run, tmp_path):
    """A copy of the finished tiny run bind-mounted read-only (the kernel refuses every write with EROFS):
    ``covgrad run`` exits 0 with the temporary server on a ``COVGRAD_SERVER_PORTS`` range, every stage
    from cache, the report path inside the root printed, and not one file under the root created or
    touched; Prefect's locks and results go to ``$COVGRAD_STATE_DIR``."""
    source = tmp_path / "copy"
    shutil.copytree(tiny_run[0], source)
    root = tmp_path / "read-only"
    root.mkdir()
    state = tmp_path / "state"
    with read_only_bind(source, root):
        with pytest.raises(OSError, match="Read-only file system"):
            (root / "probe").write_text("")
        before = tree(root)
        proc = covgrad_run(tmp_path, root, COVGRAD_STATE_DIR=str(state), COVGRAD_SERVER_PORTS=_port_range(5))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert not [line for line in proc.stderr.splitlines() if line.startswith("covgrad:")], proc.stderr[-3000:]
        assert " 0 stage(s) computed" in proc.stdout, proc.stdout
        report = re.search(r"^report:  (\S+) \(read-only root;", proc.stdout, re.M)
        assert report and report[1].startswith(f"{root}/report/") and Path(report[1]).is_file(), proc.stdout
        assert tree(root) == before
    assert (state / ".prefect-locks").exists() or (state / ".prefect-results").exists()


def test_an_empty_root_on_a_read_only_mount_exits_2_naming_it(tmp_path):
    """A root with nothing cached on a read-only bind mount: exit 2, one line naming the path the run could
    not write and the way around it (a writable root)."""
    source, root = tmp_path / "empty", tmp_path / "read-only"
    source.mkdir()
    root.mkdir()
    with read_only_bind(source, root):
        proc = covgrad_run(tmp_path, root)
        assert proc.returncode == 2, proc.stderr[-3000:]
        line = error_line(proc.stderr)
        assert re.search(rf"cannot write {re.escape(str(root))}\S*: Read-only file system", line), line
        assert "pass --root to a writable directory" in line, line
        assert list(root.iterdir()) == []
