"""What a user of ``covgrad run`` sees when something goes wrong: one stderr line and exit 2 for an
expected failure (config typo in well under 2 s, NaN reward named by file:line), and SIGTERM/SIGINT
during scores leaving no child process behind, the rerun (on a loaded machine, with the temporary
Prefect server) resuming to byte-identical data.

Each ``covgrad run`` is a subprocess; those about the output, signals and children run without
PREFECT_API_URL, so they start their own temporary server; the NaN-reward and degenerate runs use the
session's test server (``cli_api``). The runs start from a copy of a finished tiny pipeline, so only the
stages under test compute.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.faults import OVERRIDES, digests
from tests.helpers.pipeline import REPO

pytestmark = pytest.mark.slow

SETS = [a for k, v in OVERRIDES.items() for a in ("--set", f"{k}={str(v).lower()}")]


def covgrad(root: Path, *extra: str, api: str | None = None, **popen: object) -> subprocess.Popen:
    """``covgrad run`` of the tiny config on ``root`` against the Prefect API ``api`` (None: its own temporary
    server)."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    if api is not None:
        env["PREFECT_API_URL"] = api
    env.update({"PYTHONPATH": str(REPO), "COVGRAD_LOG_DIR": str(root.parent / "logs")})
    cmd = [sys.executable, "-m", "flows.cli", "run", "--config", str(REPO / "configs" / "tiny.yaml")]
    return subprocess.Popen(
        [*cmd, "--root", str(root), *SETS, *extra],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


@pytest.fixture(scope="module")
def reference(tiny_run):
    """(root, plan) of the session's uninterrupted tiny pipeline; tests copy it before changing it."""
    return tiny_run


def test_config_typo_is_one_line_in_under_two_seconds(tmp_path):
    t0 = time.perf_counter()
    proc = covgrad(tmp_path / "root", "--set", "scores.groups_perbatch=3")
    _, err = proc.communicate(timeout=60)
    seconds = time.perf_counter() - t0
    assert proc.returncode == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "scores.groups_perbatch" in lines[0], err
    assert seconds < 2.0, f"config validation took {seconds:.2f} s"
    assert not (tmp_path / "root").exists()


def run_user_model(tmp_path: Path, model: Path, task: Path, *sets: str) -> tuple[subprocess.CompletedProcess, float]:
    """``covgrad run`` of configs/user.yaml on ``model`` and ``task`` (and ``--set`` each of ``sets``);
    the process and its wall time."""
    sets = (f"model.path={model}", f"task.path={task}", "task.reward=covgrad.rewards:mentions_answer", *sets)
    cmd = [sys.executable, "-m", "flows.cli", "run", "--config", str(REPO / "configs" / "user.yaml")]
    cmd += ["--root", str(tmp_path / "root"), *(a for x in sets for a in ("--set", x))]
    env = {**os.environ, "PYTHONPATH": str(REPO), "COVGRAD_LOG_DIR": str(tmp_path / "logs")}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    return proc, time.perf_counter() - t0


def test_truncated_weights_are_one_line_in_under_two_seconds(tmp_path):
    """Preflight reads the model directory (config and safetensors header) before torch or Prefect load."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    (model / "model.safetensors").write_bytes((1000).to_bytes(8, "little") + b'{"a": ')  # header cut short
    task = tmp_path / "task.jsonl"
    task.write_text('{"prompt": "1+2=", "answer": "3"}\n')
    proc, seconds = run_user_model(tmp_path, model, task)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.safetensors" in lines[0], proc.stderr
    assert seconds < 2.0, f"preflight took {seconds:.2f} s"
    assert not (tmp_path / "root").exists()


def test_prompt_over_the_context_is_one_line_in_under_two_seconds(tmp_path):
    """Preflight counts prompt tokens with tokenizer.json against config.json's context, before torch."""
    from tests.helpers.user import write_checkpoint

    model = write_checkpoint(tmp_path / "model")  # the character tokenizer: BOS + one token per character
    task = tmp_path / "task.jsonl"
    long = json.dumps({"prompt": "1" * 70, "answer": "1"})
    task.write_text(f'{{"prompt": "1+2=", "answer": "3"}}\n{{"prompt": "2+2=", "answer": "4"}}\n{long}\n')
    budget = [f"rollouts.samplers.{name}.max_new_tokens=8" for name in ("policy", "truncated")]
    proc, seconds = run_user_model(tmp_path, model, task, *budget)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    said = f"{task}:3: the prompt is 71 tokens; with rollouts.samplers.policy.max_new_tokens=8 that is 79 > the model's"
    assert said in lines[0] and "context of 64 positions" in lines[0], lines[0]
    assert seconds < 2.0, f"preflight took {seconds:.2f} s"
    assert not (tmp_path / "root").exists()


def test_nan_reward_is_one_line_naming_the_task_file_line(reference, cli_api, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(reference[0], root)
    task = tmp_path / "task.jsonl"
    task.write_text("".join(f'{{"prompt": "{a}+{b}=", "answer": "{a + b}"}}\n' for a, b in [(1, 2), (2, 2), (3, 4)]))
    reward = "task.reward=tests.helpers.user:nan_on_seven"
    jsonl = ["task.kind=jsonl", f"task.path={task}", reward, "task.trust_reward_code=true", "task.n_prompts=3"]
    proc = covgrad(root, *(a for s in jsonl for a in ("--set", s)), api=cli_api)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-3000:]
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("covgrad:")]
    assert errors == [err.strip().splitlines()[-1]], err[-3000:]
    assert f"{task}:3: reward function returned nan; rewards must be finite" in errors[0]
    log = Path(errors[0].rsplit("(traceback: ", 1)[1].rstrip(")"))
    assert "Traceback" in log.read_text()
    index = json.loads((root / "runs" / "tiny.json").read_text())  # written as stages complete
    assert list(index["artifacts"]) == ["base_model"]


@pytest.mark.parametrize(
    ("signum", "rerun"), [(signal.SIGTERM, True), (signal.SIGINT, False)], ids=["SIGTERM-rerun-under-load", "SIGINT"]
)
def test_signal_during_scores_leaves_no_child_and_rerun_resumes_identically(reference, tmp_path, signum, rerun):
    """The signal lands once scores has claimed its artifact (the temporary Prefect server is up): covgrad
    stops it and exits 128 + signum, no process it started is left (checked by PID) and the scores artifact
    is not marked complete. After SIGTERM a rerun under load (a burner spinning on one core, beside the
    other test worker, from before the rerun's server starts until its resumed scores stage is complete)
    resumes it to the uninterrupted run's bytes; the SIGINT case stops there (both signals take the same
    handler; the rerun after it is the SIGTERM case's)."""
    ref_root, nodes = reference
    root = tmp_path / "root"
    shutil.copytree(ref_root, root)
    ref = nodes["scores.policy.policy"].ref
    shutil.rmtree(root / ref.stage / ref.key)
    claim = root / ref.stage / ref.key / "_STARTED.json"
    proc = covgrad(root)
    deadline = time.monotonic() + 300
    while not claim.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.02)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children, "covgrad run started no temporary Prefect server"
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(f"covgrad: stopped by {signal.Signals(signum).name}")
    time.sleep(0.5)
    left = [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"child processes left running: {left}"
    assert not (root / ref.stage / ref.key / "_COMPLETE.json").exists()
    if not rerun:
        return

    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        rerun = covgrad(root)
        resumed = re.compile(rf" - {re.escape('scores.policy.policy')} +computed +{ref.key}\b")
        out_lines: list[str] = []
        err_lines: list[str] = []
        scored = threading.Event()

        def read(stream, lines: list[str]) -> None:
            for line in stream:
                lines.append(line)
                if resumed.search(line):
                    scored.set()

        readers = [
            threading.Thread(target=read, args=(rerun.stdout, out_lines)),
            threading.Thread(target=read, args=(rerun.stderr, err_lines)),
        ]
        for r in readers:
            r.start()
        deadline = time.monotonic() + 600
        while not scored.is_set() and rerun.poll() is None and time.monotonic() < deadline:
            scored.wait(0.1)
        assert burner.poll() is None, "the burner stopped before the resumed scores stage completed"
    finally:
        burner.kill()
        burner.wait()
    rerun.wait(timeout=max(1.0, deadline - time.monotonic()))
    for r in readers:
        r.join()
    out, err = "".join(out_lines), "".join(err_lines)
    assert scored.is_set(), err[-3000:]
    assert rerun.returncode == 0, err[-3000:]
    computed = re.search(r"(\d+) stage\(s\) computed", out)
    assert computed and int(computed.group(1)) >= 1, out  # scores resumed, and what reads it recomputed
    art = root / ref.stage / ref.key
    assert (art / "_COMPLETE.json").exists()
    assert digests(art) == digests(ref_root / ref.stage / ref.key)


def test_degenerate_run_exits_zero_and_says_so(tmp_path, cli_api):
    """``covgrad run`` with every reward equal (the analysed sampler) and a one-record import beside it:
    exit 0, the printed summary and the headline state both conditions in words and give no overlap, ρ
    or Spearman numbers."""
    import yaml

    from tests.helpers.user import user_config, write_checkpoint

    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"prompt_ids": [1, 5], "response_ids": [6, 2], "reward": 1.0, "logprobs": [-1.0, -0.5]}))
    samplers = {
        "policy": {"group_size": 4, "max_new_tokens": 3, "batch_size": 16},
        "one": {"import_path": str(one), "on_policy": True},
    }
    cfg = user_config(
        tmp_path / "root",
        write_checkpoint(tmp_path / "ckpt"),
        tmp_path / "task.jsonl",
        **{"task.reward": "tests.helpers.user:constant_reward", "rollouts.samplers": samplers},
    )
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    env = {**os.environ, "PREFECT_API_URL": cli_api}
    env.update({"PYTHONPATH": str(REPO), "COVGRAD_LOG_DIR": str(tmp_path / "logs")})
    cmd = [sys.executable, "-m", "flows.cli", "run", "--config", str(config)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "finding: no reward variance: G ≡ 0; overlap, ρ and the bound are undefined" in out, out
    assert "one/policy: too few samples: N = 1, the statistics need N ≥ 2;" in out, out
    assert not [w for w in ("overlap(", "max_abs_rho", "spearman") if w in out], out
    report = Path(re.search(r"^report:\s+(\S+)", out, flags=re.M).group(1))
    headline = (report.parent / "headline.md").read_text()
    assert "| finding | no reward variance: G ≡ 0; overlap, ρ and the bound are undefined |" in headline
    assert not [
        line for line in headline.splitlines() if line.startswith(("| overlap(", "| max_abs_rho", "| spearman"))
    ]
    assert not [line for line in proc.stderr.splitlines() if line.startswith("covgrad:")], proc.stderr[-3000:]


def test_cached_run_prints_one_line_per_stage(reference, tmp_path):
    """A rerun with every stage cached: one line per stage, no Prefect task-run lines, ≤ 30 lines in all."""
    ref_root, nodes = reference
    root = tmp_path / "root"
    shutil.copytree(ref_root, root)
    proc = covgrad(root)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    lines = (out + err).splitlines()
    assert len(lines) <= 30, "\n".join(lines)
    for name, node in nodes.items():
        stage_lines = [line for line in lines if re.search(rf" - {re.escape(name)} +cached +{node.ref.key}$", line)]
        assert len(stage_lines) == 1, (name, lines)
    assert not [line for line in lines if "Task run" in line], lines
    assert f"0 stage(s) computed, {len(nodes)} from cache" in out
