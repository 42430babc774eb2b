"""Imported rollouts: ``on_policy: true`` (policy centering only) completes without top-k log-probs,
preflight refuses a sampler-centred import with no μ source before anything runs, a bad record is
named by file and line, and a truncated weights file by its path."""

import json
from pathlib import Path

import pytest

from storage.artifacts import ArtifactStore
from tasks.specs import plan
from tests.helpers.pipeline import run_planned
from tests.helpers.user import user_config, write_checkpoint

G = 4


def _run(cfg, stages: tuple[str, ...] | None = None):
    """Every planned stage of ``cfg``, or those of the named ``stages``; instance -> ref."""
    names = None if stages is None else {n for n, s in plan(cfg).items() if s.ref.stage in stages}
    return {n: r.ref for n, r in run_planned(cfg, names).items()}


def _records(n: int = 2 * G, bad_line: int | None = None) -> str:
    lines = []
    for i in range(n):
        reward = float("nan") if bad_line == i + 1 else float(i % 2)
        rec = {"prompt_ids": [1, 5 + i // G], "response_ids": [6, 2], "reward": reward, "logprobs": [-1.0, -0.5]}
        lines.append(json.dumps(rec))
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("imports")
    return tmp, write_checkpoint(tmp / "ckpt")


def _cfg(tmp, ckpt, path, root: str, **sampler):
    samplers = {"engine": {"import_path": str(path), **sampler}}
    overrides = {"rollouts.samplers": samplers, "rollouts.analyse": "engine"}
    return user_config(tmp / root, ckpt, tmp / "task.jsonl", **overrides)


@pytest.mark.slow
def test_on_policy_import_without_top_k_completes_with_policy_centering(ckpt):
    tmp, path_ckpt = ckpt
    path = tmp / "onpolicy.jsonl"
    path.write_text(_records())
    cfg = _cfg(tmp, path_ckpt, path, "runs-on", on_policy=True)
    assert not any(n.endswith(".sampler") for n in plan(cfg))
    from flows.preflight import preflight

    preflight(cfg)
    refs = _run(cfg)
    store = ArtifactStore(cfg.root)
    assert all(store.is_complete(r) for r in refs.values())
    assert "scores.engine.policy" in refs


def test_sampler_centred_import_without_mu_source_is_refused_by_preflight(ckpt):
    from flows.preflight import preflight

    tmp, path_ckpt = ckpt
    path = tmp / "plain.jsonl"
    path.write_text(_records())
    cfg = _cfg(tmp, path_ckpt, path, "runs-plain")
    with pytest.raises(ValueError, match=r"rollouts\.samplers\.engine\.on_policy: true") as err:
        preflight(cfg)
    assert "\n" not in str(err.value)
    assert not (tmp / "runs-plain").exists()


def test_import_options_need_an_import_path():
    from covgrad.config import SamplerSection

    with pytest.raises(ValueError, match="describe imported rollouts"):
        SamplerSection(on_policy=True)
    with pytest.raises(ValueError, match="drop mu_model"):
        SamplerSection(import_path="x.jsonl", on_policy=True, mu_model="ckpt")


def test_nan_reward_is_named_by_file_and_line(ckpt):
    tmp, path_ckpt = ckpt
    path = tmp / "nan.jsonl"
    path.write_text(_records(bad_line=3))
    cfg = _cfg(tmp, path_ckpt, path, "runs-nan", on_policy=True)
    with pytest.raises(ValueError, match=rf"^{path}:3: 'reward' must be a finite number; got nan$"):
        _run(cfg)


def test_truncated_safetensors_is_named(tmp_path):
    from storage.models import check_model_dir

    ckpt = write_checkpoint(tmp_path / "ckpt")
    weights = ckpt / "model.safetensors"
    check_model_dir(str(ckpt), "model.path")
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"weights file {weights} is truncated or damaged"):
        check_model_dir(str(ckpt), "model.path")
    weights.write_bytes(b"\x00" * 4)
    with pytest.raises(ValueError, match=rf"weights file {weights} is truncated"):
        check_model_dir(str(ckpt), "model.path")


def test_deployment_parameters_merge_onto_the_defaults():
    from covgrad.config import PipelineConfig
    from flows.deployment import merge_config

    defaults = {"name": "user-model", "root": "/data/runs", "model": {"path": "/models/a", "dtype": "float32"}}
    defaults["rollouts"] = {"samplers": {"policy": {"group_size": 8}, "hot": {"temperature": 2.0}}}
    given = PipelineConfig.model_validate(
        {"name": "mine", "model": {"path": "/models/b"}, "rollouts": {"samplers": {"policy": {"group_size": 4}}}}
    )
    merged = merge_config(defaults, given)
    assert (merged.name, merged.root, merged.model.path) == ("mine", "/data/runs", "/models/b")
    assert list(merged.rollouts.samplers) == ["policy"] and merged.rollouts.samplers["policy"].group_size == 4
    full = PipelineConfig.model_validate(PipelineConfig().model_dump(mode="json"))
    assert merge_config(defaults, full) == full


def test_a_config_file_lies_under_the_keys_a_run_sets(tmp_path):
    import yaml

    from covgrad.config import PipelineConfig
    from flows.deployment import run_config

    file = Path(__file__).parents[2] / "configs" / "demo.yaml"
    demo = yaml.safe_load(file.read_text())
    given = PipelineConfig.model_validate({"root": str(tmp_path), "scores": {"groups_per_batch": 3}})
    merged = run_config(given, str(file))  # outside a deployment run: no deployment defaults
    expected = {**demo, "root": str(tmp_path), "scores": {**demo.get("scores", {}), "groups_per_batch": 3}}
    assert merged == PipelineConfig.model_validate(expected)
    assert run_config(given, None) == given
    with pytest.raises(FileNotFoundError, match=f"config file '{tmp_path}/nope.yaml' does not exist"):
        run_config(given, str(tmp_path / "nope.yaml"))


@pytest.mark.slow
def test_mu_model_recomputes_mu_for_an_import(ckpt):
    """Sampler centering of an import with μ recomputed from ``mu_model``: with the policy's own
    checkpoint at temperature 1, μ = p, so the sampler-centred scores equal the policy-centred ones."""
    import numpy as np

    tmp, path_ckpt = ckpt
    path = tmp / "mu.jsonl"
    path.write_text(_records())
    cfg = _cfg(tmp, path_ckpt, path, "runs-mu", mu_model=str(path_ckpt))
    from flows.preflight import preflight

    preflight(cfg)
    refs = _run(cfg, ("base_model", "rollouts", "scores", "stats"))
    store = ArtifactStore(cfg.root)
    st = {c: store.open_group(refs[f"stats.engine.{c}"], "stats.zarr") for c in ("policy", "sampler")}
    for name in ("F", "G", "m"):
        np.testing.assert_allclose(st["sampler"][name][:], st["policy"][name][:], rtol=1e-4, atol=1e-7)
    assert st["sampler"].attrs["scalars"]["kl_sampler_policy_per_token"] < 1e-6


def test_prompt_over_the_context_names_the_task_file_line(ckpt):
    import re

    tmp, path_ckpt = ckpt
    task = tmp / "long.jsonl"
    task.write_text(
        json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n\n" + json.dumps({"prompt": "1" * 70, "answer": "1"}) + "\n"
    )
    cfg = user_config(tmp / "runs-long", path_ckpt, task)
    from flows.preflight import preflight

    said = (
        rf"^{re.escape(str(task))}:3: the prompt is 71 tokens; with rollouts\.samplers\.policy\.max_new_tokens=3 "
        r"that is 74 > the model's context of 64 positions; shorten the prompt or lower max_new_tokens$"
    )
    with pytest.raises(ValueError, match=said):
        preflight(cfg)  # tokenizer.json and config.json, before anything loads
    assert not (tmp / "runs-long").exists()
    with pytest.raises(ValueError, match=said):
        _run(cfg)  # the rollouts stage's last check, with the loaded tokenizer: the same count


def test_demo_max_new_tokens_over_the_context_is_refused_by_preflight(tmp_path):
    """The demo model is not trained yet at preflight: its tokenizer and context are known without it."""
    from flows.preflight import preflight
    from tests.helpers.pipeline import tiny_config

    cfg = tiny_config(str(tmp_path / "runs"), **{"rollouts.samplers.stale.max_new_tokens": 60})
    said = r"^prompt 0: the prompt is 5 tokens; with rollouts\.samplers\.stale\.max_new_tokens=60 that is 65 > "
    with pytest.raises(ValueError, match=said + r"the model's context of 64 positions \(7 more prompt\(s\) too long\)"):
        preflight(cfg)
    assert not (tmp_path / "runs").exists()
