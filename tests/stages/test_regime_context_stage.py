"""The regime stage with context distillation (the policy as its own teacher, given the answer in its prompt)
and SFT on the samples of the demo's trained teacher, on the tiny pipeline: each fold's G against a naive
per-sequence float64 loop; the teacher stage; keys; preflight refusals in one line."""

import json
import shutil

import numpy as np
import pytest
import torch

from storage.artifacts import ArtifactStore
from storage.models import load_model_and_tokenizer, load_models
from storage.schema import ROLLOUTS, SCORES
from storage.stores.regimes import regime_gradient, teacher_prompt_texts
from tests.helpers.pipeline import NO_OPTIONAL, run_planned, tiny_config

TEMPLATE = "{answer}={prompt}"
CFG = {
    "ctx": {"kind": "distill_reverse_kl", "teacher": "policy", "teacher_prompt": TEMPLATE},
    "tsft": {
        "kind": "sft_drift",
        "teacher": "trained",
        "responses": "teacher",
        "trained_teacher": {"accuracy": 0.85, "lr": 0.01, "batch_size": 32, "eval_every": 10},
    },
}
POLICY = type("P", (), {"path": None, "dtype": "float32", "trust_remote_code": False})


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_run):
    root = tmp_path_factory.mktemp("ctx") / "root"
    shutil.copytree(tiny_run[0], root)
    cfg = tiny_config(str(root), **NO_OPTIONAL, regimes=CFG)
    return cfg, run_planned(cfg)


def _grad(J, params):
    grads = torch.autograd.grad(J, params, allow_unused=True)
    return torch.cat(
        [(g if g is not None else torch.zeros_like(p)).reshape(-1).double() for g, p in zip(grads, params, strict=True)]
    )


def _fold_G(store, ref):
    return regime_gradient(store.open_group(ref, SCORES, mode="r"), slice(None))[0][0]


def _naive(policy, teacher, tokenizer, rows, teacher_prompts, kind):
    """mean_n ∇θ J_n over (policy prompt ids, response ids, prompt index) rows, J from unpadded forwards."""
    params = [p for _, p in policy.named_parameters() if p.requires_grad]
    total = 0
    for prompt, response, i in rows:
        tp = prompt if teacher_prompts is None else teacher_prompts[i]
        with torch.no_grad():
            zq = teacher(input_ids=torch.tensor([tp + response])).logits[0, len(tp) - 1 : len(tp) - 1 + len(response)]
        z = policy(input_ids=torch.tensor([prompt + response])).logits[
            0, len(prompt) - 1 : len(prompt) - 1 + len(response)
        ]
        logp, logq = torch.log_softmax(z.double(), -1), torch.log_softmax(zq.double(), -1)
        J = -(logp.exp() * (logp - logq)).sum() if kind == "distill_reverse_kl" else (logq.exp() * logp).sum()
        total = total + _grad(J, params)
    return (total / len(rows)).numpy()


@pytest.mark.slow
def test_context_distillation_fold_is_the_naive_loop_with_the_prefixed_teacher(run):
    cfg, results = run
    store = ArtifactStore(cfg.root)
    policy, tokenizer = load_models(store, results["base_model"].ref, "policy", POLICY)
    prompts = [tokenizer(t)["input_ids"] for t in teacher_prompt_texts(TEMPLATE, cfg.task, "t")]
    ro = store.open_group(results["rollouts.policy"].ref, ROLLOUTS, mode="r")
    rows = []
    for n in range(ro["group"].shape[0]):
        pl, rl = int(ro["prompt_len"][n]), int(ro["response_len"][n])
        tok = ro["tokens"][n].tolist()
        rows.append((tok[:pl], tok[pl : pl + rl], int(ro["prompt_index"][n])))
    naive = _naive(policy, policy, tokenizer, rows, prompts, "distill_reverse_kl")
    G = _fold_G(store, results["regime.ctx"].ref)
    assert np.abs(naive).max() > 0
    assert np.abs(G - naive).max() <= 1e-5 * np.abs(naive).max()


@pytest.mark.slow
def test_sft_on_the_trained_teachers_samples_is_the_naive_loop(run):
    from tasks.jobs.regime_fold import RegimeJob

    cfg, results = run
    store = ArtifactStore(cfg.root)
    info = store.read_json(results["teacher"].ref, "teacher.json")
    assert info["teacher_accuracy"] >= 0.85
    with store.local_dir(results["teacher"].ref, "teacher", write=False) as d:
        teacher = load_model_and_tokenizer(d, "float32", False)[0]
    policy, tokenizer = load_models(store, results["base_model"].ref, "policy", POLICY)
    from tasks.specs import plan

    step = plan(cfg)["regime.tsft"]
    job = RegimeJob(store, step.ref, step.spec, step.upstream)
    s = job.samples
    ro = store.open_group(results["rollouts.policy"].ref, ROLLOUTS, mode="r")
    assert len(s["group"]) == ro["group"].shape[0]
    assert job.teacher_reward >= 0.5  # the teacher's samples are mostly right; the policy's rollouts less so
    rows = []
    for n in range(len(s["group"])):
        pl, rl = int(s["prompt_len"][n]), int(s["response_len"][n])
        tok = s["tokens"][n].tolist()
        assert tok[:pl] == ro["tokens"][n, :pl].tolist()  # the policy's prompt, then the teacher's response
        rows.append((tok[:pl], tok[pl : pl + rl], int(s["prompt_index"][n])))
    naive = _naive(policy, teacher, tokenizer, rows, None, "sft_drift")
    G = _fold_G(store, results["regime.tsft"].ref)
    assert np.abs(G - naive).max() <= 1e-5 * np.abs(naive).max()
    marker = store.read_json(results["regime.tsft"].ref, "_COMPLETE.json")
    assert marker["teacher_mean_reward"] == job.teacher_reward


def test_context_distillation_and_the_teacher_only_add_stages():
    from tasks.specs import plan

    plain = plan(tiny_config("runs", regimes={"rl": {"kind": "rl"}}))
    more = plan(tiny_config("runs", regimes={"rl": {"kind": "rl"}, **CFG}))
    # the update check steps each regime's loss: it reads the regimes statistics, so its key moves with them
    readers = ("regimes", "update_check", "report")
    assert {n: plain[n].ref.key for n in plain if n not in readers} == {
        n: more[n].ref.key for n in plain if n not in readers
    }
    assert set(more) - set(plain) == {"teacher", "regime.ctx", "regime.tsft"}
    other = plan(tiny_config("runs", regimes={"ctx": {**CFG["ctx"], "teacher_prompt": "{prompt}{answer}"}}))
    assert other["regime.ctx"].ref.key != plan(tiny_config("runs", regimes={"ctx": CFG["ctx"]}))["regime.ctx"].ref.key


def test_preflight_refuses_unfillable_and_too_long_teacher_prompts(tmp_path):
    from flows.preflight import preflight

    task = tmp_path / "task.jsonl"
    task.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(4)))
    jsonl = {"task.kind": "jsonl", "task.path": str(task), "task.reward": "covgrad.rewards:addition_reward"}
    bad = tiny_config("runs", **jsonl, regimes={"d": {**CFG["ctx"], "teacher_prompt": "{hint} {prompt}"}})
    with pytest.raises(ValueError) as err:
        preflight(bad, architecture=False)
    msg = str(err.value)
    assert "\n" not in msg and "regimes.d.teacher_prompt" in msg and f"{task}:1" in msg and "{hint}" in msg
    long = tiny_config("runs", regimes={"d": {**CFG["ctx"], "teacher_prompt": "1+1=" * 20 + "{prompt}"}})
    with pytest.raises(ValueError) as err:
        preflight(long, architecture=False)
    msg = str(err.value)
    assert "\n" not in msg and "regimes.d.teacher_prompt" in msg and "context of 64" in msg
    with pytest.raises(ValueError, match="teacher prompt template field"):
        tiny_config("runs", regimes={"d": {**CFG["ctx"], "teacher_prompt": "{0}"}})
    with pytest.raises(ValueError, match="trained_teacher.accuracy 0.5 must exceed"):
        tiny_config("runs", regimes={"t": {**CFG["tsft"], "trained_teacher": {"accuracy": 0.5}}})


def test_the_demo_config_adds_only_its_regime_stages():
    """configs/demo.yaml's regimes leave every other artifact key of the demo as it was, except the two stages
    that read the regimes statistics: the update check (it steps each regime's loss), the trajectory (its
    regime ``rl`` is then the regimes entry ``rl``, whose G and ρ are its predictors) and the report; its
    distill and sft regimes add the trained teacher's stage."""
    import yaml

    from covgrad.config import PipelineConfig
    from tasks.specs import plan
    from tests.helpers.pipeline import REPO

    demo = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    assert set(demo["regimes"]) == {"rl", "distill", "sft"}
    without = {k: v for k, v in demo.items() if k != "regimes"}
    p0, p1 = plan(PipelineConfig.model_validate(without)), plan(PipelineConfig.model_validate(demo))
    readers = ("update_check", "trajectory", "report")
    assert {n: p0[n].ref.key for n in p0 if n not in readers} == {n: p1[n].ref.key for n in p0 if n not in readers}
    assert set(p1) - set(p0) == {"regime.rl", "regime.distill", "regime.sft", "regimes", "teacher"}


def test_each_new_regime_setting_changes_exactly_the_keys_that_read_it():
    from tasks.specs import plan

    p0 = plan(tiny_config("runs", regimes=CFG))
    changes = [
        ("ctx", "teacher_prompt", "{prompt}{answer}", {"regime.ctx"}),
        ("ctx", "responses", "teacher", {"regime.ctx"}),
        ("tsft", "responses", "sampler", {"regime.tsft"}),
        ("tsft", "trained_teacher", {**CFG["tsft"]["trained_teacher"], "lr": 0.02}, {"teacher", "regime.tsft"}),
    ]
    for name, field, value, expected in changes:
        cfg = {**CFG, name: {**CFG[name], field: value}}
        if field == "responses" and value == "sampler":
            cfg[name]["sampler"] = "policy"
        p1 = plan(tiny_config("runs", regimes=cfg))
        readers = {"regimes", "update_check", "report"}  # the update check steps each regime's loss
        assert {n for n in p0 if p0[n].ref.key != p1[n].ref.key} == expected | readers, field


@pytest.mark.slow
def test_update_check_and_trajectory_step_towards_the_trained_teacher(run):
    """A regime with ``teacher: trained`` is stepped by the update check and a trajectory: both read the teacher
    stage's artifact (upstream ``teacher``), not a model directory named "trained"."""
    from tasks.specs import plan

    cfg, _ = run
    trajectory = {"enabled": True, "steps": 2, "regime": "tsft", "state_every": 1, "checkpoint_ratio": 0}
    cfg2 = tiny_config(cfg.root, **{"tokens.enabled": False}, regimes=CFG, trajectory=trajectory)
    steps = plan(cfg2)
    for name in ("update_check", "trajectory"):
        assert steps[name].upstream["teacher"].key == steps["teacher"].ref.key, name
    results = run_planned(cfg2)
    store = ArtifactStore(cfg.root)
    rows = store.read_json(results["update_check"].ref, "grid.json")
    assert {r["regime"] for r in rows} == {"rl", "ctx", "tsft"}
    assert store.read_json(results["trajectory"].ref, "summary.json")["regime"] == "tsft"
