"""SFT on a plain dataset of responses (``format: responses``, μ unknown) through the tiny pipeline: the
sft_sampled regime's G read back from the regimes store against a float64 per-sequence autograd loop, the
dataset's rollouts (no rewards, no μ, no scores), the update check's regime rows and a trajectory on it; and
the preflight's one-line refusals of what a dataset without rewards cannot feed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from flows.preflight import preflight
from storage.artifacts import ArtifactStore
from storage.models import load_models
from storage.schema import REGIMES, ROLLOUTS
from storage.stores.prompts import load_task
from tasks.offpolicy import policy_logp_of
from tasks.specs import plan
from tests.helpers.pipeline import run_planned, tiny_config

RL_TOKEN = {"kind": "rl_token", "sampler": "data", "advantages": "none", "kl_beta": 0.1, "reference": "stale"}
POLICY = {"group_size": 4, "max_new_tokens": 3, "batch_size": 16}


def _dataset(path, cfg, reward: bool = False) -> str:
    """Two responses per task prompt, as text: the right answer followed by EOS, and a wrong one without."""
    problems, _ = load_task(cfg.task)
    lines = []
    for p in problems:
        wrong = str((int(p.answer) + 1) % 19)
        for response, eos in ((p.answer, True), (wrong, False)):
            rec = {"prompt": p.prompt, "response": response, "eos": eos}
            if reward:
                rec["reward"] = float(response == p.answer)
            lines.append(json.dumps(rec) + "\n")
    path.write_text("".join(lines))
    return str(path)


def _config(tmp_path, reward: bool = False, **overrides):
    root = str(tmp_path / "root")
    data = _dataset(tmp_path / "data.jsonl", tiny_config(root), reward)
    samplers = {"policy": POLICY, "data": {"import_path": data, "format": "responses"}}
    return tiny_config(root, **{"rollouts.samplers": samplers, "tokens.enabled": False, **overrides})


def _naive_G(store, base, tokenizer, path) -> np.ndarray:
    """mean over the file's records of ∇θ Σ_t log p(y_t | x, y_<t), the policy in float64, one unpadded
    sequence per forward, token ids straight from the tokenizer."""
    spec = type("P", (), {"path": None, "dtype": "float32", "trust_remote_code": False})
    policy = load_models(store, base, "policy", spec)[0].double().eval()
    params = [p for _, p in policy.named_parameters() if p.requires_grad]
    total, N = None, 0
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        prompt = tokenizer(rec["prompt"])["input_ids"]
        response = tokenizer.encode(rec["response"], add_special_tokens=False) + [tokenizer.eos_token_id] * rec["eos"]
        ids = torch.tensor([prompt + response])
        logp = torch.log_softmax(policy(input_ids=ids).logits[0, :-1].double(), -1)
        positions = torch.arange(len(prompt) - 1, ids.shape[1] - 1)
        J = logp[positions, ids[0, positions + 1]].sum()
        grads = torch.autograd.grad(J, params)
        g = torch.cat([x.reshape(-1) for x in grads]).double()
        total = g if total is None else total + g
        N += 1
    return (total / N).numpy()


@pytest.mark.slow
def test_sft_sampled_on_a_dataset_end_to_end(tmp_path):
    cfg = _config(
        tmp_path,
        regimes={"sft": {"kind": "sft_sampled", "sampler": "data"}},
        **{
            "update_check.optimizers": ["sgd"],
            "update_check.precisions": ["fp32"],
            "update_check.steps": [1],
            "trajectory.enabled": True,
            "trajectory.regime": "sft",
            "trajectory.optimizer": "sgd",
            "trajectory.lr": 1e-2,
            "trajectory.steps": 2,
            "trajectory.checkpoint_ratio": 0,
        },
    )
    p = plan(cfg)
    assert not any(n.startswith(("scores.data", "stats.data")) for n in p)  # no rewards: no rl analysis of it
    preflight(cfg, architecture=False)
    results = run_planned(cfg)
    assert all(r.computed for r in results.values())
    store = ArtifactStore(cfg.root)

    ro = store.open_group(results["rollouts.data"].ref, ROLLOUTS, mode="r")
    assert ro.attrs["mu_known"] is False and ro.attrs["rewards"] is False and ro.attrs["mean_reward"] is None
    assert np.isnan(ro["reward"][:]).all() and np.isnan(ro["advantage"][:]).all()
    assert np.isnan(ro["sampler_logp"][:]).all() and ro["group"].shape == (16,)

    base = results["base_model"].ref
    tokenizer = load_models(store, base, "policy", p["regime.sft"].spec.policy)[1]
    naive = _naive_G(store, base, tokenizer, cfg.rollouts.samplers["data"].import_path)
    G = store.open_group(results["regimes"].ref, REGIMES, mode="r")["G_sft"][:]
    assert np.abs(G - naive).max() <= 1e-5 * np.abs(naive).max(), np.abs(G - naive).max()

    row = {r["regime"]: r for r in store.read_json(results["regimes"].ref, "regimes.json")}["sft"]
    assert row["kind"] == "sft_sampled" and row["sampler"] == "data"
    assert row["a2"] is None or math.isnan(row["a2"])  # μ unknown: no bound

    rows = store.read_json(results["update_check"].ref, "grid.json")
    assert any(r.get("regime") == "sft" for r in rows)
    assert store.is_complete(results["trajectory"].ref)


def test_a_dataset_with_rewards_is_scored_with_policy_centering_only(tmp_path):
    p = plan(_config(tmp_path, reward=True))
    assert {n for n in p if n.startswith(("scores.data", "stats.data"))} == {"scores.data.policy", "stats.data.policy"}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"rollouts.analyse": "data"},
            r"rollouts\.analyse: sampler 'data' is a dataset of responses without rewards \(\S+data\.jsonl:1 has no",
        ),
        (
            {"regimes": {"r": RL_TOKEN}},
            r"regimes\.r\.sampler: sampler 'data' is a dataset of responses without rewards .* regime kind rl_token",
        ),
        (
            {"regimes": {"d": {"kind": "distill_reverse_kl", "sampler": "data", "teacher": "stale"}}},
            r"regimes\.d\.sampler: .* only sft_sampled and sft_drift fold over a dataset",
        ),
    ],
)
def test_preflight_refuses_what_a_dataset_without_rewards_cannot_feed(tmp_path, overrides, message):
    cfg = _config(tmp_path, **overrides)
    for check in (lambda: preflight(cfg, architecture=False), lambda: plan(cfg)):
        with pytest.raises(ValueError, match=message) as info:
            check()
        assert "\n" not in str(info.value)


def test_preflight_names_the_line_of_an_empty_response(tmp_path):
    cfg = _config(tmp_path, regimes={"sft": {"kind": "sft_sampled", "sampler": "data"}})
    path = cfg.rollouts.samplers["data"].import_path
    lines = Path(path).read_text().splitlines()
    lines[0] = json.dumps({**json.loads(lines[0]), "response": "", "eos": False})  # no token at all
    Path(path).write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"^{path}:1: 'response' is empty"):
        preflight(cfg, architecture=False)


@pytest.mark.slow
def test_a_rewarded_dataset_runs_the_rl_analysis_and_a_bad_line_completes_nothing(tmp_path):
    cfg = _config(tmp_path, reward=True, **{"update_check.enabled": False})
    results = run_planned(cfg)
    store = ArtifactStore(cfg.root)
    table = {(r["sampler"], r["centering"]): r for r in store.read_json(results["offpolicy"].ref, "offpolicy.json")}
    assert ("data", "sampler") not in table and math.isnan(table["data", "policy"]["k3_kl"])  # μ unknown
    assert math.isnan(table["data", "policy"]["kl_per_token"]) and table["policy", "policy"]["k3_kl"] >= 0
    ro = store.open_group(results["rollouts.data"].ref, ROLLOUTS, mode="r")
    assert ro.attrs["mu_known"] is False and "rewards" not in ro.attrs and ro.attrs["mean_reward"] == 0.5
    with pytest.raises(ValueError, match=r"^offpolicy: the rollouts of sampler 'data' are a dataset .* μ is unknown"):
        policy_logp_of(store, results["rollouts.data"].ref, None)  # a reader that needs μ refuses it

    path = cfg.rollouts.samplers["data"].import_path
    lines = Path(path).read_text().splitlines()
    lines[4] = json.dumps({**json.loads(lines[4]), "response": "7", "eos": False, "reward": None})
    Path(path).write_text("\n".join(lines) + "\n")
    bad = plan(cfg)["rollouts.data"]
    with pytest.raises(ValueError, match=rf"^{path}:5: 'reward' must be a finite number; got None$"):
        run_planned(cfg, names={"rollouts.data"})
    assert not store.is_complete(bad.ref)
