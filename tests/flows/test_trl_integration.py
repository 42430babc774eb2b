"""A real TRL GRPOTrainer run on CPU recorded by covgrad.integrations.trl.CovgradRecorder, then analysed by
covgrad end to end: its step-0 rollouts imported, scores and statistics of the step-0 checkpoint, and the
trajectory over the run's checkpoints (trajectory.checkpoints). Skipped without the ``trl`` extra (the series
layouts: tests/stages/test_external_runs.py)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr
from transformers import AutoModelForCausalLM, AutoTokenizer

from covgrad.layout import ParamLayout
from covgrad.rollouts.problems import addition_reward
from covgrad.updates.diff import diff_state_dicts
from storage.checkpoints import load_state_dict
from storage.schema import ROLLOUTS, TRAJECTORY
from storage.stores.external import checkpoint_series
from storage.stores.prompts import load_task
from tasks.specs import plan
from tests.helpers.pipeline import run_planned, tiny_config

G, PROMPTS_PER_STEP, STEPS = 4, 2, 2


def policy_dir(root: Path) -> Path:
    """The tiny pipeline's trained demo policy (a Hugging Face directory with its tokenizer)."""
    cfg = tiny_config(str(root))
    run_planned(cfg, {"base_model"})
    ref = plan(cfg)["base_model"].ref
    return root / ref.stage / ref.key / "policy"


def trl_run(model_dir: Path, out: Path) -> None:
    """TRL's GRPOTrainer for STEPS steps on the tiny addition task, recorded into ``out``."""
    from datasets import Dataset
    from trl import GRPOTrainer

    from covgrad.integrations.trl import CovgradRecorder
    from tests.helpers.trainers import cpu_grpo_args

    problems, _ = load_task(tiny_config("unused").task)
    data = Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in problems])

    def correct(prompts, completions, answer, **kwargs):
        return [addition_reward(p, c, a) for p, c, a in zip(prompts, completions, answer, strict=True)]

    short = {"max_completion_length": 3, "max_steps": STEPS, "learning_rate": 1e-3, "logging_steps": 1}
    args = cpu_grpo_args(out / "trl", G * PROMPTS_PER_STEP, G, **short)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    recorder = CovgradRecorder(out / "covgrad")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=correct,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[recorder],
    )
    recorder.attach(trainer)
    trainer.train()


@pytest.mark.slow
def test_a_trl_run_analysed_end_to_end(tmp_path):
    pytest.importorskip("trl")
    out = tmp_path / "run"
    trl_run(policy_dir(tmp_path / "base"), out)
    rec_dir = out / "covgrad"
    manifest = json.loads((rec_dir / "manifest.json").read_text())
    assert [c["step"] for c in manifest["checkpoints"]] == list(range(STEPS + 1))
    records = [json.loads(line) for line in (rec_dir / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) == STEPS * G * PROMPTS_PER_STEP
    assert sorted({r["policy_version"] for r in records}) == list(range(STEPS))
    step0 = [r for r in records if r["policy_version"] == 0]
    imported = tmp_path / "step0.jsonl"
    imported.write_text("".join(json.dumps(r) + "\n" for r in step0))

    series = checkpoint_series(str(rec_dir)).checkpoints
    cfg = tiny_config(
        str(tmp_path / "root"),
        **{
            "name": "trl",
            "model.path": series[0][1],
            "rollouts.analyse": "trl",
            "rollouts.samplers": {"trl": {"import_path": str(imported), "on_policy": True}},
            "scores.groups_per_batch": 1,
            "tokens.enabled": False,
            "update_check.enabled": False,
            "trajectory.enabled": True,
            "trajectory.checkpoints": str(rec_dir),
        },
    )
    p = plan(cfg)
    results = run_planned(cfg)
    assert results["trajectory"].computed

    ro = xr.open_zarr(tmp_path / "root" / "rollouts" / p["rollouts.trl"].ref.key / ROLLOUTS)
    assert ro.sizes["sample"] == G * PROMPTS_PER_STEP
    tokenizer = AutoTokenizer.from_pretrained(series[0][1])
    model = AutoModelForCausalLM.from_pretrained(series[0][1], dtype=torch.float32)
    problems = load_task(cfg.task)[0]
    by_prompt = {tokenizer.decode(tokenizer(q.prompt)["input_ids"], skip_special_tokens=True): q for q in problems}
    for r in step0:  # the recorded sampler log-probs are the step-0 policy's at temperature 1
        ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        n = len(r["prompt_ids"])
        want = logp[n - 1 : -1].gather(-1, ids[0, n:, None]).squeeze(-1)
        assert np.allclose(r["logprobs"], want.numpy(), atol=1e-5)
        problem = by_prompt[tokenizer.decode(r["prompt_ids"], skip_special_tokens=True)]
        text = tokenizer.decode(r["response_ids"], skip_special_tokens=True)
        assert r["reward"] == addition_reward(problem.prompt, text, problem.answer)
        assert r["advantages"] == [r["advantage"]] * len(r["response_ids"])

    st = xr.open_zarr(tmp_path / "root" / "stats" / p["stats.trl.policy"].ref.key / "stats.zarr")
    assert np.isfinite(st.F.values).all() and (st.F.values > 0).any()

    ref = p["trajectory"].ref
    ds = xr.open_zarr(tmp_path / "root" / ref.stage / ref.key / TRAJECTORY)
    assert ds.step.values.tolist() == list(range(1, STEPS + 1))  # the trainer's steps
    layout = ParamLayout.from_records(json.loads(json.dumps(ds.attrs["tensors"])))
    weights = [load_state_dict(d) for _, d in series]
    for i in range(1, STEPS + 1):
        packed = np.unpackbits(ds.changed.values[i - 1], count=layout.P).astype(bool)
        d = diff_state_dicts(weights[i - 1], weights[i], masks={"set": packed}, layout=layout)
        assert d["changed_exact"] > 0
        assert d["overlap"]["set"]["exact"]["precision"] == d["overlap"]["set"]["exact"]["recall"] == 1.0
        assert int(ds.n_changed_cum.values[i - 1]) == diff_state_dicts(weights[0], weights[i])["changed_exact"]
    assert np.isfinite(ds.cum_F_precision.values).all()
