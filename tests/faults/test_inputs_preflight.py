"""Every input a config names is checked by the preflight, before stage one: checkpoint series, delta traces, the
other model directories a run loads (a sampler's model, μ's checkpoint, a regime's teacher and reference: vocabulary
and tokenizer against the policy's), weights that need pickle, and the files read as JSONL (a FIFO, a device, a
gzip'd file). Each row runs ``covgrad run`` in-process on a bad input and sees exit 2, one stderr line naming the
file, and nothing written under the root (no stage directory, nothing complete); one subprocess run shows the
same within 2 s of starting, before torch or Prefect load."""

import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from covgrad.offline import OFFLINE_ENV
from tests.helpers.faults import error_line
from tests.helpers.pipeline import REPO
from tests.helpers.user import user_config, write_checkpoint


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A tiny Llama with the character tokenizer, saved once; rows copy it."""
    return write_checkpoint(tmp_path_factory.mktemp("inputs") / "policy")


def copy(saved: Path, to: Path) -> Path:
    """A copy of the saved checkpoint at ``to`` (parents made)."""
    shutil.copytree(saved, to)
    return to


def edit_json(path: Path, **changes: object) -> None:
    """Set ``changes`` in the JSON object at ``path``."""
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def swap_ids(model: Path, a: str, b: str) -> None:
    """Swap the ids of tokens ``a`` and ``b`` in ``model``'s tokenizer.json (the vocabulary size stays)."""
    data = json.loads((model / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (model / "tokenizer.json").write_text(json.dumps(data))


def pickled_weights(model: Path) -> Path:
    """Replace ``model``'s safetensors by a pytorch_model.bin that holds an argparse.Namespace beside its tensors:
    ``torch.load(weights_only=True)`` refuses it."""
    import argparse

    import torch
    from safetensors.torch import load_file

    state = load_file(str(model / "model.safetensors"))
    (model / "model.safetensors").unlink()
    torch.save({**state, "args": argparse.Namespace(lr=1.0)}, model / "pytorch_model.bin")
    return model / "pytorch_model.bin"


def series(saved: Path, folder: Path, *names: str) -> Path:
    """A folder of step folders, each a copy of the saved checkpoint."""
    for name in names:
        copy(saved, folder / name)
    return folder


def distill(teacher: Path) -> dict:
    """The overrides of one reverse-KL distillation regime with ``teacher``."""
    return {"regimes": {"d": {"kind": "distill_reverse_kl", "teacher": str(teacher)}}}


def importing(path: Path | str, **sampler: object) -> dict:
    """The overrides of a second sampler that imports ``path`` (on-policy rollouts)."""
    engine = {"import_path": str(path), "on_policy": True, **sampler}
    return {"rollouts.samplers": {"policy": {"group_size": 4, "max_new_tokens": 3}, "engine": engine}}


def trajectory(**external: str) -> dict:
    """The overrides of a trajectory stage that analyses an external run."""
    return {"trajectory.enabled": True, **{f"trajectory.{k}": v for k, v in external.items()}}


def manifest(folder: Path, *paths: str) -> Path:
    """A series folder with one real checkpoint (``a``) and a manifest.json listing ``paths`` at steps 0, 1, …"""
    (folder / "manifest.json").write_text(
        json.dumps({"checkpoints": [{"step": t, "path": p} for t, p in enumerate(paths)]})
    )
    return folder


RECORD = json.dumps({"prompt_ids": [1, 5], "response_ids": [6, 2], "reward": 1.0, "logprobs": [-1.0, -0.5]}) + "\n"
# row -> (overrides built from (saved checkpoint, a scratch folder), the texts its error line must hold)
Row = Callable[[Path, Path], tuple[dict, list[str]]]


def _no_folder(s: Path, d: Path) -> tuple[dict, list[str]]:
    return trajectory(checkpoints=str(d / "missing")), [f"'{d / 'missing'}' is neither a manifest nor a folder"]


def _no_config(s: Path, d: Path) -> tuple[dict, list[str]]:
    run = series(s, d / "run", "checkpoint-1", "checkpoint-2")
    (run / "checkpoint-2" / "config.json").unlink()
    return trajectory(checkpoints=str(run)), [f"{run / 'checkpoint-2' / 'config.json'} does not exist"]


def _no_weights(s: Path, d: Path) -> tuple[dict, list[str]]:
    run = series(s, d / "run", "step-0", "step-3")
    (run / "step-3" / "model.safetensors").unlink()
    return trajectory(checkpoints=str(run)), [f"{run / 'step-3'} (step 3) has no weights"]


def _two_of_a_step(s: Path, d: Path) -> tuple[dict, list[str]]:
    run = series(s, d / "run", "checkpoint-5", "checkpoint-05")
    return trajectory(checkpoints=str(run)), [str(run / "checkpoint-05"), str(run / "checkpoint-5"), "both step 5"]


def _manifest_up(s: Path, d: Path) -> tuple[dict, list[str]]:
    copy(s, d / "outside")
    run = manifest(series(s, d / "run", "a"), "a", "../outside")
    return trajectory(checkpoints=str(run)), [str(run / "manifest.json"), "'../outside' (step 1) is outside"]


def _manifest_absolute(s: Path, d: Path) -> tuple[dict, list[str]]:
    run = manifest(series(s, d / "run", "a"), "a", "/etc")
    return trajectory(checkpoints=str(run)), [str(run / "manifest.json"), "'/etc' (step 1) is outside"]


def _another_vocabulary(s: Path, d: Path) -> tuple[dict, list[str]]:
    run = series(s, d / "run", "global_step_1/actor/huggingface", "global_step_2/actor/huggingface")
    edit_json(run / "global_step_2" / "actor" / "huggingface" / "config.json", vocab_size=99)
    where = run / "global_step_2" / "actor" / "huggingface"
    return trajectory(checkpoints=str(run)), [f"trajectory.checkpoints step 2 '{where}'", "vocab_size 99"]


def _another_architecture(s: Path, d: Path) -> tuple[dict, list[str]]:
    run = series(s, d / "run", "checkpoint-1", "checkpoint-2")
    edit_json(run / "checkpoint-1" / "config.json", architectures=["MistralForCausalLM"], model_type="mistral")
    return trajectory(checkpoints=str(run)), [f"step 1 '{run / 'checkpoint-1'}'", "model_type 'mistral'"]


def _pickled_checkpoint(s: Path, d: Path) -> tuple[dict, list[str]]:
    run = series(s, d / "run", "checkpoint-1", "checkpoint-2")
    file = pickled_weights(run / "checkpoint-2")
    return trajectory(checkpoints=str(run)), [f"weights file {file} needs pickle", "argparse.Namespace", "safetensors"]


def _no_trace(s: Path, d: Path) -> tuple[dict, list[str]]:
    return trajectory(deltas=str(d / "trace")), [f"'{d / 'trace'}' is not a folder of grail delta files"]


def _no_start_weights(s: Path, d: Path) -> tuple[dict, list[str]]:
    (d / "trace").mkdir()
    (d / "trace" / "delta_000000.pt").write_bytes(b"")
    return trajectory(deltas=str(d / "trace")), [f"'{d / 'trace'}' has no start weights"]


def _no_teacher(s: Path, d: Path) -> tuple[dict, list[str]]:
    return distill(d / "teacher"), [f"regimes.d.teacher '{d / 'teacher'}' does not exist"]


def _teacher_without_config(s: Path, d: Path) -> tuple[dict, list[str]]:
    (copy(s, d / "teacher") / "config.json").unlink()
    return distill(d / "teacher"), [f"regimes.d.teacher '{d / 'teacher'}' has no config.json"]


def _mu_of_another_vocabulary(s: Path, d: Path) -> tuple[dict, list[str]]:
    edit_json(copy(s, d / "mu") / "config.json", vocab_size=7)
    (d / "r.jsonl").write_text(RECORD)
    overrides = importing(d / "r.jsonl", on_policy=False, mu_model=str(d / "mu"))
    return overrides, [f"rollouts.samplers.engine.mu_model '{d / 'mu'}' has vocabulary 7, the policy 16"]


def _teacher_with_swapped_ids(s: Path, d: Path) -> tuple[dict, list[str]]:
    swap_ids(copy(s, d / "teacher"), "1", "2")
    return distill(d / "teacher"), [f"regimes.d.teacher '{d / 'teacher'}'", "id 5 is '1'", "'1' at id 6"]


def _sampler_without_tokenizer(s: Path, d: Path) -> tuple[dict, list[str]]:
    model = copy(s, d / "other")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    sampler = {"policy": {"group_size": 4, "max_new_tokens": 3}, "other": {"model": str(model), "max_new_tokens": 3}}
    return {"rollouts.samplers": sampler}, [f"rollouts.samplers.other.model '{model}' has no tokenizer"]


def _pickled_reference(s: Path, d: Path) -> tuple[dict, list[str]]:
    file = pickled_weights(copy(s, d / "ref"))
    regime = {"kind": "rl_token", "kl_beta": 0.1, "reference": str(d / "ref")}
    return {"regimes": {"k": regime}}, ["regimes.k.reference", f"weights file {file} needs pickle"]


def _fifo_task(s: Path, d: Path) -> tuple[dict, list[str]]:
    os.mkfifo(d / "task.jsonl")
    return {"task.path": str(d / "task.jsonl")}, [f"task.path '{d / 'task.jsonl'}' is not a regular file (a FIFO)"]


def _device_import(s: Path, d: Path) -> tuple[dict, list[str]]:
    return importing("/dev/zero"), ["rollouts.samplers.engine.import_path '/dev/zero' is not a regular file"]


def _missing_import(s: Path, d: Path) -> tuple[dict, list[str]]:
    return importing(d / "r.jsonl"), [f"rollouts.samplers.engine.import_path '{d / 'r.jsonl'}' does not exist"]


def _gzip_task(s: Path, d: Path) -> tuple[dict, list[str]]:
    (d / "task.jsonl").write_bytes(gzip.compress(b'{"prompt": "1+2=", "answer": "3"}\n'))
    return {"task.path": str(d / "task.jsonl")}, [f"task.path '{d / 'task.jsonl'}' is gzip-compressed"]


def _gzip_import(s: Path, d: Path) -> tuple[dict, list[str]]:
    line = RECORD
    (d / "r.jsonl").write_bytes(gzip.compress(line.encode()))
    return importing(d / "r.jsonl"), [f"import_path '{d / 'r.jsonl'}' is gzip-compressed"]


def _pickled_policy(s: Path, d: Path) -> tuple[dict, list[str]]:
    file = pickled_weights(copy(s, d / "policy"))
    return {"model.path": str(d / "policy")}, ["model.path", f"weights file {file} needs pickle"]


ROWS: dict[str, Row] = {
    "series folder missing": _no_folder,
    "step folder without config.json": _no_config,
    "step folder without weights": _no_weights,
    "two folders of one step": _two_of_a_step,
    "manifest path ../": _manifest_up,
    "manifest path /etc": _manifest_absolute,
    "checkpoint of another vocabulary": _another_vocabulary,
    "checkpoint of another architecture": _another_architecture,
    "checkpoint weights need pickle": _pickled_checkpoint,
    "delta trace missing": _no_trace,
    "delta trace without start weights": _no_start_weights,
    "teacher missing": _no_teacher,
    "teacher without config.json": _teacher_without_config,
    "mu_model of another vocabulary": _mu_of_another_vocabulary,
    "teacher with two ids swapped": _teacher_with_swapped_ids,
    "sampler model without tokenizer": _sampler_without_tokenizer,
    "reference weights need pickle": _pickled_reference,
    "task file a FIFO": _fifo_task,
    "import file /dev/zero": _device_import,
    "import file missing": _missing_import,
    "task file gzip'd": _gzip_task,
    "import file gzip'd": _gzip_import,
    "policy weights need pickle": _pickled_policy,
}


@pytest.mark.parametrize("row", list(ROWS))
def test_a_bad_input_exits_2_in_one_line_naming_it_before_stage_one(row, saved, tmp_path, monkeypatch, capsys):
    """``covgrad run`` (in-process, its config built here) on the row's bad input: exit 2, one stderr line holding
    each of the row's texts, and the root never created: preflight refused before any stage or Prefect."""
    import flows.cli as cli

    scratch = tmp_path / "in"
    scratch.mkdir()
    overrides, texts = ROWS[row](saved, scratch)
    cfg = user_config(tmp_path / "root", copy(saved, tmp_path / "model"), tmp_path / "task.jsonl", **overrides)
    monkeypatch.setenv("COVGRAD_LOG_DIR", str(tmp_path / "logs"))
    monkeypatch.setattr(cli, "_LOG_PATH", None)
    monkeypatch.setattr(cli, "quiet_prefect", lambda: None)  # it sets process-wide Prefect settings
    monkeypatch.setattr(cli, "load_config", lambda path, overrides: cfg)
    assert cli.main(["run"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("covgrad: error: "), lines
    for text in texts:
        assert text in lines[0], (text, lines[0])
    assert not (tmp_path / "root").exists()


def test_every_input_of_a_good_config_passes_in_well_under_two_seconds(saved, tmp_path):
    """The same inputs, well formed (a Trainer series, a teacher, a reference and μ that share the policy's
    tokenizer, a delta trace's files, imported rollouts), pass; the preflight's own time is far below 2 s."""
    from flows.preflight import preflight

    model = copy(saved, tmp_path / "model")
    run = series(saved, tmp_path / "run", "checkpoint-2", "checkpoint-4")
    (tmp_path / "r.jsonl").write_text(RECORD)
    regimes = {
        "d": {"kind": "distill_reverse_kl", "teacher": str(copy(saved, tmp_path / "teacher"))},
        "k": {"kind": "rl_token", "kl_beta": 0.1, "reference": str(copy(saved, tmp_path / "ref"))},
    }
    overrides = {
        **importing(tmp_path / "r.jsonl", on_policy=False, mu_model=str(copy(saved, tmp_path / "mu"))),
        **trajectory(checkpoints=str(run)),
        "regimes": regimes,
    }
    cfg = user_config(tmp_path / "root", model, tmp_path / "task.jsonl", **overrides)
    t0 = time.perf_counter()
    preflight(cfg, architecture=False)
    assert time.perf_counter() - t0 < 1.0
    assert not (tmp_path / "root").exists()


def test_special_token_roles_and_chat_templates_are_warnings_not_refusals(saved, tmp_path, caplog):
    """A teacher with the policy's vocabulary but another eos token and a chat template (an instruct model of the
    policy's base) is loaded; each difference is one warning line naming it."""
    from storage.inputs import PolicyRef, check_companion

    teacher = copy(saved, tmp_path / "teacher")
    edit_json(teacher / "tokenizer_config.json", eos_token="<pad>", chat_template="{{ messages }}")
    policy = PolicyRef.of(str(saved), None)
    lines = check_companion(str(teacher), "regimes.d.teacher", policy)
    assert len(lines) == 2 and all(line.startswith(f"regimes.d.teacher '{teacher}': ") for line in lines)
    assert "eos_token is '<pad>', the policy's '<eos>'" in lines[0] and "chat template" in lines[1]
    assert [r.getMessage() for r in caplog.records if r.name == "covgrad"] == lines
    assert check_companion(str(saved), "regimes.d.teacher", policy) == []


def test_the_first_differing_token_ids_are_named():
    """Two swapped ids name the first and where its token went; a token one side lacks names its id."""
    from storage.inputs import tokenizer_difference

    policy = {"a": 0, "b": 1, "c": 2, "d": 3}
    assert tokenizer_difference(policy, dict(policy)) is None
    swapped = {**policy, "b": 3, "d": 1}
    assert tokenizer_difference(policy, swapped) == (
        "id 1 is 'b' in the policy's tokenizer and 'd' in this one, which has 'b' at id 3 (2 ids differ)"
    )
    assert tokenizer_difference(policy, {**policy, "e": 4}) == (
        "id 4 is absent in the policy's tokenizer and 'e' in this one (1 id differs)"
    )


def test_the_series_reader_needs_no_torch_and_names_the_weight_files_as_the_loader_does():
    """The preflight reads checkpoint series and delta traces without importing torch; its weight-file names are
    the loader's (``storage.checkpoints.WEIGHT_FILES``), in its order."""
    from storage.checkpoints import WEIGHT_FILES
    from storage.stores.external import WEIGHT_FILES as SERIES_WEIGHT_FILES

    assert SERIES_WEIGHT_FILES == WEIGHT_FILES
    code = "import sys, flows.preflight, storage.inputs; print(sorted(m for m in sys.modules if m == 'torch'))"
    env = {**os.environ, "PYTHONPATH": str(REPO), **OFFLINE_ENV}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr[-2000:]


@pytest.mark.slow
def test_covgrad_run_refuses_a_bad_checkpoint_within_two_seconds(saved, tmp_path):
    """``covgrad run`` as a user runs it, on a config naming every kind of input (imported rollouts with μ's
    checkpoint, a teacher, a checkpoint series, checked in that order): the series' last checkpoint has another
    vocabulary, so the run reads every input and ends in one line naming that checkpoint, exit 2, within 2 s of
    starting and with no root written."""
    model = copy(saved, tmp_path / "model")
    (tmp_path / "task.jsonl").write_text('{"prompt": "1+2=", "answer": "3"}\n{"prompt": "2+2=", "answer": "4"}\n')
    (tmp_path / "r.jsonl").write_text(RECORD)
    run = series(saved, tmp_path / "run", "checkpoint-1", "checkpoint-2")
    edit_json(run / "checkpoint-2" / "config.json", vocab_size=99)
    engine = {"import_path": str(tmp_path / "r.jsonl"), "mu_model": str(copy(saved, tmp_path / "mu"))}
    sets = {
        "model.path": str(model),
        "task.path": str(tmp_path / "task.jsonl"),
        "task.reward": "covgrad.rewards:mentions_answer",
        "rollouts.samplers.policy.max_new_tokens": "8",
        "rollouts.samplers.truncated.max_new_tokens": "8",
        "rollouts.samplers.engine": json.dumps(engine),
        "regimes": json.dumps({"d": {"kind": "distill_reverse_kl", "teacher": str(copy(saved, tmp_path / "t"))}}),
        "trajectory.enabled": "true",
        "trajectory.checkpoints": str(run),
    }
    cmd = [sys.executable, "-m", "flows.cli", "run", "--config", str(REPO / "configs" / "user.yaml")]
    cmd += ["--root", str(tmp_path / "root"), *(a for k, v in sets.items() for a in ("--set", f"{k}={v}"))]
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update({"PYTHONPATH": str(REPO), "COVGRAD_LOG_DIR": str(tmp_path / "logs"), **OFFLINE_ENV})
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - t0
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = error_line(proc.stderr)
    assert f"trajectory.checkpoints step 2 '{run / 'checkpoint-2'}': config.json has vocab_size 99" in line, line
    assert seconds < 2.0, f"covgrad run took {seconds:.2f} s to refuse"
    assert not (tmp_path / "root").exists()
