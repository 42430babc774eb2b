"""The rollouts stage imports each stack's sample dump (``format:``) to the rollouts store of the equivalent
covgrad JSONL, records the dump's policy versions and sampling parameters, and the preflight names a malformed
first record by file:line and the stack's field."""

from pathlib import Path

import numpy as np
import pytest
import zarr

from covgrad.config import DemoModel
from storage.artifacts import ArtifactStore
from storage.schema import ROLLOUTS
from tasks.specs import plan
from tests.helpers.pipeline import run_planned
from tests.helpers.user import user_config

DATA = Path(__file__).parents[1] / "data" / "formats"
EXTRA_CHARS = "abcdefghijklmnop"  # 16 more characters: the sample files' token ids need a vocabulary of 32


def write_checkpoint32(path: Path) -> Path:
    """A random tiny Llama whose character tokenizer has 32 ids (the sample files' vocabulary)."""
    from covgrad.models import build_demo_model
    from covgrad.rollouts.problems import ADDITION_CHARS, build_char_tokenizer

    tok = build_char_tokenizer(ADDITION_CHARS + EXTRA_CHARS)
    assert len(tok) == 32
    model = build_demo_model(DemoModel(hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64), tok)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("formats")
    return tmp, write_checkpoint32(tmp / "ckpt")


def cfg_for(tmp: Path, ckpt: Path, fmt: str, path: Path | None = None, **sampler):
    path = path or DATA / f"{fmt}.jsonl"
    options = {"reward_fields": ["accuracy_reward"]} if fmt == "trl" else {}
    samplers = {"engine": {"import_path": str(path), "format": fmt, "on_policy": True, **options, **sampler}}
    return user_config(
        tmp / f"runs-{fmt}", ckpt, tmp / "task.jsonl", **{"rollouts.samplers": samplers, "rollouts.analyse": "engine"}
    )


def import_store(cfg) -> zarr.Group:
    names = {n for n, s in plan(cfg).items() if s.ref.stage in ("base_model", "rollouts")}
    refs = {n: r.ref for n, r in run_planned(cfg, names).items()}
    return ArtifactStore(cfg.root).open_group(refs["rollouts.engine"], ROLLOUTS, mode="r")


@pytest.fixture(scope="module")
def reference(ckpt):
    tmp, path = ckpt
    return import_store(cfg_for(tmp, path, "covgrad"))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["open_instruct", "trl", "verl"])
def test_each_format_imports_to_the_covgrad_store(ckpt, reference, fmt):
    tmp, path = ckpt
    g = import_store(cfg_for(tmp, path, fmt))
    ref = {name: a for name, a in reference.arrays()}
    got = {name: a for name, a in g.arrays()}
    # what each dump holds beyond the common arrays: open-instruct a sequence advantage, TRL one it also stores per
    # token (advantages: imported), verl per-token advantages, TRL μ on its logprob_token_ids support
    only_ref = {
        "open_instruct": {"token_advantage", "mu_topk_ids", "mu_topk_logp", "mu_tail"},
        "trl": set(),
        "verl": {"stack_advantage", "mu_topk_ids", "mu_topk_logp", "mu_tail"},
    }[fmt]
    assert set(ref) - set(got) == only_ref and set(got) <= set(ref)
    for name, arr in got.items():
        assert arr.dtype == ref[name].dtype and arr.shape == ref[name].shape, name
        np.testing.assert_array_equal(arr[...], ref[name][...], err_msg=name)
    assert g["policy_version"][:].tolist() == [3, 3, 3, 3, 4, 4]
    info = g.attrs["import"]
    assert info["format"] == fmt and info["policy_versions"] == {"3": 4, "4": 2} and info["mixed_versions"]
    assert "2 policy versions in 6 records (3: 4, 4: 2)" in info["message"]
    assert info["sampling_params"] == [{"temperature": 1.0, "top_p": 1.0, "top_k": 0}]
    assert g.attrs["sampler_spec"]["format"] == fmt


@pytest.mark.slow
def test_covgrad_jsonl_store_holds_the_dump_extras(reference):
    assert reference["stack_advantage"][:].tolist() == [0.0, 0.0, 0.5, -0.5, 0.5, -0.5]
    adv, pl, rl = reference["token_advantage"][:], reference["prompt_len"][:], reference["response_len"][:]
    for n in range(len(pl)):
        assert (adv[n, pl[n] : pl[n] + rl[n]] == reference["stack_advantage"][n]).all()
        assert (adv[n, : pl[n]] == 0).all() and (adv[n, pl[n] + rl[n] :] == 0).all()
    assert "sampling_params_index" not in reference  # one sampling parameter set


def test_preflight_names_a_malformed_first_record(ckpt, tmp_path):
    from flows.preflight import preflight

    _, path = ckpt
    lines = (DATA / "verl.jsonl").read_text().splitlines()
    bad = tmp_path / "verl.jsonl"
    bad.write_text(lines[0].replace('"rollout_log_probs": [-2.24', '"rollout_log_probs": [2.24') + "\n")
    cfg = cfg_for(tmp_path, path, "verl", bad)
    with pytest.raises(ValueError) as err:
        preflight(cfg, architecture=False)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{bad}:1: 'rollout_log_probs' has log-probability 2.24")
    assert not (tmp_path / "runs-verl").exists()


def test_format_needs_an_import_path():
    from covgrad.config import SamplerSection

    with pytest.raises(ValueError, match="format describes imported rollouts"):
        SamplerSection(format="verl")
    with pytest.raises(ValueError, match="reward_fields entry 'acc:x'"):
        SamplerSection(import_path="x.jsonl", format="verl", reward_fields=["acc:x"])
    assert SamplerSection(import_path="x.jsonl", reward_fields=["acc", "fmt:0.5"]).reward_fields == ["acc", "fmt:0.5"]
    assert "format" not in SamplerSection(import_path="x.jsonl").model_dump()
