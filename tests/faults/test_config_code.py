"""No code a config names runs without asking: a ``task.reward`` outside ``covgrad.rewards`` is refused before
anything is imported unless ``task.trust_reward_code`` is on (the setting keys no artifact); ``covgrad plan``
imports no reward module even when it is trusted; a model directory naming custom code (``auto_map``) that
``model.trust_remote_code`` does not run is said so in one warning line."""

import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from covgrad.rollouts.problems import resolve_reward
from tests.helpers.faults import error_line
from tests.helpers.pipeline import REPO, tiny_config
from tests.helpers.user import user_config, write_checkpoint

PLANTED = (
    "import pathlib\npathlib.Path({marker!r}).write_text('ran')\n\n"
    "def reward(prompt, response, answer):\n    return 1.0\n"
)


@pytest.fixture
def planted(tmp_path, monkeypatch) -> Iterator[tuple[Path, Path]]:
    """A module ``planted_reward`` and a package ``planted_pkg`` (with submodule ``sub``) on ``sys.path``, each of
    whose code writes its own marker file when it runs; (directory, task file). Removed from ``sys.modules`` after."""
    for name in ("planted_reward", "planted_pkg", "planted_pkg.sub"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    (tmp_path / "planted_reward.py").write_text(PLANTED.format(marker=str(tmp_path / "module-ran")))
    (tmp_path / "planted_pkg").mkdir()
    (tmp_path / "planted_pkg" / "__init__.py").write_text(PLANTED.format(marker=str(tmp_path / "package-ran")))
    (tmp_path / "planted_pkg" / "sub.py").write_text(PLANTED.format(marker=str(tmp_path / "submodule-ran")))
    monkeypatch.syspath_prepend(str(tmp_path))
    task = tmp_path / "task.jsonl"
    task.write_text('{"prompt": "1+2=", "answer": "3"}\n{"prompt": "2+2=", "answer": "4"}\n')
    yield tmp_path, task
    for name in ("planted_reward", "planted_pkg", "planted_pkg.sub"):
        sys.modules.pop(name, None)


def ran(directory: Path) -> list[str]:
    """The planted modules whose code ran (their marker files)."""
    return sorted(p.name for p in directory.glob("*-ran"))


@pytest.mark.parametrize("spec", ["os:system", "planted_reward:reward", "covgrad.rollouts.problems:addition_reward"])
def test_a_reward_outside_covgrad_rewards_is_refused_before_it_is_imported(planted, spec):
    directory, _ = planted
    module = spec.partition(":")[0]
    with pytest.raises(ValueError) as err:
        resolve_reward(spec)
    said = str(err.value)
    assert said.startswith(f"task.reward {spec!r} would import and run module {module!r}"), said
    assert "set task.trust_reward_code: true" in said and "\n" not in said
    assert ran(directory) == [] and "planted_reward" not in sys.modules
    assert resolve_reward("covgrad.rewards:mentions_answer")("p", "it is 3", "3") == 1.0


def test_a_trusted_reward_is_imported(planted):
    directory, _ = planted
    assert resolve_reward("planted_reward:reward", trusted=True)("p", "r", "a") == 1.0
    assert ran(directory) == ["module-ran"]


def test_preflight_refuses_os_system_in_one_line(planted):
    from flows.preflight import preflight

    _, task = planted
    cfg = tiny_config(str(planted[0] / "root"), **{"task": {"kind": "jsonl", "path": str(task), "reward": "os:system"}})
    with pytest.raises(
        ValueError, match=r"^task.reward 'os:system' would import and run module 'os'.*trust_reward_code"
    ):
        preflight(cfg, architecture=False)
    assert not (planted[0] / "root").exists()


def test_the_permission_changes_no_key_but_the_reports(planted):
    """Off, a task serialises as before the setting existed; on, every stage key stays what it was and only the
    report (which renders the config) is keyed anew."""
    from tasks.specs import plan

    _, task = planted
    untrusted = {"kind": "jsonl", "path": str(task), "reward": "planted_reward:reward"}
    off = tiny_config(str(planted[0] / "root"), task=untrusted)
    on = tiny_config(str(planted[0] / "root"), task={**untrusted, "trust_reward_code": True})
    assert "trust_reward_code" not in off.model_dump()["task"] and on.model_dump()["task"]["trust_reward_code"]
    p0, p1 = plan(off), plan(on)
    assert [n for n in p0 if p0[n].ref.key != p1[n].ref.key] == ["report"]
    assert p1["rollouts.policy"].spec.task.trust_reward_code  # the stage reads it from its spec
    assert ran(planted[0]) == []


def test_covgrad_plan_imports_no_reward_module(planted, capsys):
    """``covgrad plan`` with the trusted reward ``this:s`` (importing ``this`` prints the Zen of Python) and with a
    reward in a planted package's submodule (``find_spec`` would run the package's ``__init__``): nothing runs."""
    from flows.cli import main
    from tasks.specs.inputs import task_inputs

    directory, task = planted
    sys.modules.pop("this", None)
    for reward in ("this:s", "planted_pkg.sub:reward"):
        sets = [f"task={{kind: jsonl, path: {task}, reward: '{reward}', trust_reward_code: true}}"]
        argv = ["plan", "--config", str(REPO / "configs" / "tiny.yaml"), "--device", "cpu", "--set", sets[0]]
        assert main(argv) in (0, 1)
        out = capsys.readouterr().out
        assert "prompt length:" in out and "Beautiful is better than ugly" not in out, out
    assert "this" not in sys.modules and ran(directory) == []
    jsonl = {"kind": "jsonl", "path": str(task), "reward": "planted_pkg.sub:reward"}
    digest = task_inputs(tiny_config(str(directory / "root"), task=jsonl).task)["reward"]
    assert digest != "absent" and ran(directory) == []  # the submodule's file was found, nothing imported


def test_a_config_naming_custom_code_is_warned_about_in_one_line(tmp_path, caplog):
    """``auto_map`` in config.json with ``model.trust_remote_code`` off: one warning line naming the directory and
    the setting, once per directory and process, from preflight and from the loader; none when it is on."""
    from flows.preflight import preflight
    from storage.models import load_model, warn_custom_code

    model = write_checkpoint(tmp_path / "custom")
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (model / "config.json").write_text(json.dumps(config))
    task = tmp_path / "task.jsonl"
    task.write_text('{"prompt": "1+2=", "answer": "3"}\n')
    jsonl = {"kind": "jsonl", "path": str(task), "reward": "covgrad.rewards:mentions_answer"}
    cfg = user_config(tmp_path / "root", model, task, task=jsonl)
    with caplog.at_level(logging.WARNING, logger="covgrad"):
        preflight(cfg, architecture=False)
        load_model(model)
    lines = [r.getMessage() for r in caplog.records if r.name == "covgrad"]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"model path {str(model)!r} names custom code (auto_map: ") and "\n" not in lines[0]
    assert "modeling_x.XForCausalLM" in lines[0] and "model.trust_remote_code is off" in lines[0]
    assert "built-in 'llama' class runs instead" in lines[0]
    assert warn_custom_code(str(model), True) is None
    assert warn_custom_code(str(write_checkpoint(tmp_path / "plain")), False) is None


def test_covgrad_run_with_os_system_exits_2_in_one_line(tmp_path):
    """Refused by the preflight before torch or Prefect load: well under a second."""
    import os
    import subprocess

    task = tmp_path / "task.jsonl"
    task.write_text('{"prompt": "1+2=", "answer": "3"}\n')
    sets = ["task.kind=jsonl", f"task.path={task}", "task.reward=os:system"]
    cmd = [sys.executable, "-m", "flows.cli", "run", "--config", str(REPO / "configs" / "tiny.yaml")]
    cmd += ["--root", str(tmp_path / "root"), *(a for s in sets for a in ("--set", s))]
    env = {**os.environ, "PYTHONPATH": str(REPO), "COVGRAD_LOG_DIR": str(tmp_path / "logs")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = error_line(proc.stderr)
    assert "task.reward 'os:system' would import and run module 'os'" in line and "trust_reward_code" in line
    assert not (tmp_path / "root").exists()
