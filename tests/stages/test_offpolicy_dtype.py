"""Samplers that are bf16 / fp16 / fp32 copies of the policy (``rollouts.samplers.<name>.dtype``): the fp32 copy
is the policy bit for bit (the same draws, the same log-probs, sampler centering changes nothing); the bf16 and
fp16 copies draw from their own rounded logits, so their log-probs differ from the policy's, and the offpolicy
stage's mismatch columns equal a numpy computation from an independent forward of the policy and of its copy."""

import json

import numpy as np
import pytest
import torch

from covgrad.report.sections import null_line, null_tests
from covgrad.rollouts.mismatch import mismatch_metrics
from storage.artifacts import ArtifactStore
from storage.models import load_models
from tasks.specs import PolicySpec, centerings, plan
from tests.helpers.pipeline import NO_OPTIONAL, run_planned, tiny_config

pytestmark = pytest.mark.slow

SAMPLER = {"group_size": 4, "max_new_tokens": 3, "batch_size": 16}
SAMPLERS = {
    "policy": SAMPLER,
    "fp32": {**SAMPLER, "dtype": "float32"},
    "bf16": {**SAMPLER, "dtype": "bfloat16", "store_mu": "full"},
    "fp16": {**SAMPLER, "dtype": "float16"},
}


@pytest.fixture(scope="module")
def dtype_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("dtype")
    cfg = tiny_config(str(root), **NO_OPTIONAL, **{"rollouts.samplers": SAMPLERS})
    names = {
        n for n, s in plan(cfg).items() if s.ref.stage in ("base_model", "rollouts", "scores", "stats", "offpolicy")
    }
    refs = {n: r.ref for n, r in run_planned(cfg, names).items()}
    return cfg, ArtifactStore(cfg.root), refs


def _rollouts(store, refs, name):
    return store.open_group(refs[f"rollouts.{name}"], "rollouts.zarr", mode="r")


def _logp(model, ro) -> np.ndarray:
    """(N, T) float64 log-probabilities of the stored response tokens under ``model`` at temperature 1: a plain
    forward of each row and a float64 log-softmax (the reference)."""
    tokens, pl, rl = ro["tokens"][:], ro["prompt_len"][:], ro["response_len"][:]
    T = ro["sampler_logp"].shape[1]
    out = np.zeros((len(pl), T))
    with torch.no_grad():
        for n in range(len(pl)):
            row = torch.from_numpy(tokens[n : n + 1, : pl[n] + rl[n]].astype(np.int64))
            logits = model(input_ids=row).logits[0].double()
            logp = torch.log_softmax(logits, -1)
            for j in range(int(rl[n])):
                out[n, j] = float(logp[pl[n] + j - 1, row[0, pl[n] + j]])
    return out


def test_a_dtype_makes_a_sampler_off_policy_and_keys_the_rollouts(dtype_run):
    cfg, _, refs = dtype_run
    for name in ("fp32", "bf16", "fp16"):
        assert centerings(cfg.rollouts.samplers[name]) == ["policy", "sampler"]
        assert f"stats.{name}.sampler" in refs
    assert "dtype" not in cfg.rollouts.samplers["policy"].model_dump()  # unset: keys as before
    keys = {refs[f"rollouts.{n}"].key for n in SAMPLERS}
    assert len(keys) == len(SAMPLERS)


def test_the_fp32_copy_is_the_null(dtype_run):
    """Same weights, same uniforms: the fp32 copy draws the policy's tokens with the policy's log-probs, and its
    sampler-centred statistics equal the policy-centred ones."""
    _, store, refs = dtype_run
    a, b = _rollouts(store, refs, "policy"), _rollouts(store, refs, "fp32")
    for name in ("tokens", "response_len", "sampler_logp"):
        np.testing.assert_array_equal(a[name][:], b[name][:])
    s = store.open_group(refs["stats.fp32.sampler"], "stats.zarr", mode="r")
    p = store.open_group(refs["stats.fp32.policy"], "stats.zarr", mode="r")
    # μ recomputed by a second forward: float32 rounding, amplified in m (a mean that nearly cancels)
    for name, rel in (("m", 1e-5), ("F", 1e-6), ("G", 1e-6)):
        assert np.linalg.norm(s[name][:] - p[name][:]) <= rel * np.linalg.norm(p[name][:]), name
    rows = json.loads(store.fs.cat_file(store.path(refs["offpolicy"], "offpolicy.json")))
    for r in (r for r in rows if r["sampler"] == "fp32"):
        assert r["rel_diff_G"] < 1e-6 and r["k3_kl"] < 1e-9, r


@pytest.mark.parametrize("name,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_half_precision_copies_differ_from_the_policy(dtype_run, name, dtype):
    """The copy's stored log-probs are its own: they differ from the policy's log-probs of the same tokens, and
    match a teacher-forced forward of the policy cast to that dtype more closely than the fp32 policy's; the
    offpolicy columns equal numpy's metrics from the policy's forward."""
    _, store, refs = dtype_run
    ro = _rollouts(store, refs, name)
    base = refs["base_model"]
    spec = PolicySpec(path=None, dtype="float32", trust_remote_code=False)
    policy = load_models(store, base, "policy", spec)[0]
    copy = load_models(store, base, "policy", spec)[0].to(dtype)
    stored, mask = ro["sampler_logp"][:].astype(np.float64), np.arange(3)[None, :] < ro["response_len"][:][:, None]
    fp32, own = _logp(policy, ro), _logp(copy, ro)
    gap_policy = np.abs(stored - fp32)[mask]
    gap_own = np.abs(stored - own)[mask]
    assert gap_policy.max() > 1e-4  # not the policy's numbers
    assert gap_own.mean() < gap_policy.mean()  # the copy's rounding, not noise around the policy
    rows = json.loads(store.fs.cat_file(store.path(refs["offpolicy"], "offpolicy.json")))
    want = mismatch_metrics(stored, fp32, mask)
    for r in (r for r in rows if r["sampler"] == name):
        assert r["k3_kl"] == pytest.approx(want["rollout_corr/k3_kl"], rel=1e-3, abs=1e-9)
        assert r["rollout_probs_diff_max"] == pytest.approx(want["training/rollout_probs_diff_max"], rel=1e-3)
        assert r["k3_kl"] > 1e-8


def test_the_report_states_the_null_test_of_the_fp32_copy(dtype_run):
    """The report's null-test line: only the fp32 copy is a null (μ ≡ p to float rounding); its numbers are the
    table's, and ``rel_diff_stats`` is numpy's largest relative difference over m, F, Fvar, G, Cov."""
    _, store, refs = dtype_run
    rows = json.loads(store.fs.cat_file(store.path(refs["offpolicy"], "offpolicy.json")))
    (null,) = null_tests(rows)
    assert null["sampler"] == "fp32" and null["k3_kl"] < 1e-9
    s = store.open_group(refs["stats.fp32.sampler"], "stats.zarr", mode="r")
    p = store.open_group(refs["stats.fp32.policy"], "stats.zarr", mode="r")
    worst = max(np.linalg.norm(s[n][:] - p[n][:]) / np.linalg.norm(s[n][:]) for n in ("m", "F", "Fvar", "G", "Cov"))
    assert null["rel_diff_stats"] == pytest.approx(worst, rel=1e-9) and worst < 1e-5
    assert null["zero_mean_trace_sampler"] == s.attrs["scalars"]["zero_mean_trace"]
    assert null["zero_mean_trace_policy"] == p.attrs["scalars"]["zero_mean_trace"]
    line = null_line(null)
    assert line.startswith("Null test, sampler fp32 (μ ≡ p: k3-KL") and f"{worst:.2g} relative" in line
    assert null["sampler_weights"] == "policy" and "bitwise the policy's weights" in line  # equal identities
    weights = {r["sampler"]: r["sampler_weights"] for r in rows}
    assert {w for name, w in weights.items() if name not in ("policy", "fp32")} == {"other"}, weights
