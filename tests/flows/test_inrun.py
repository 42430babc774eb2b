"""In-run statistics (covgrad.integrations.inrun): the folded statistics of a batch equal the float64 per-sample
reference (one unpadded backward per sequence), the trainer's gradients, flags, hooks and RNG are untouched, steps
are folded every ``every_n`` with their overlaps, and a real TRL GRPOTrainer run with ``CovgradInRun`` writes per-step
files that match the reference of the batch ``CovgradRecorder`` recorded."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from covgrad.integrations import InRunFolder
from covgrad.layout import ParamLayout
from covgrad.moments import count_for_fraction, topk_indices
from tests.helpers.persample import llama, make_batch, naive_scores

METRICS = {"F": "F", "absG": "G", "absrho": "rho"}


def reference(S: np.ndarray, A: np.ndarray) -> dict[str, np.ndarray]:
    """The stats stage's estimators (every one divides by N) of scores S (N, P) and advantages A (N,), float64."""
    dA, dS = A - A.mean(), S - S.mean(0)
    std_A, Fvar, Cov = np.sqrt((dA**2).mean()), (dS**2).mean(0), (dA[:, None] * dS).mean(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        rho = Cov / (std_A * np.sqrt(Fvar))
    return {"N": len(A), "std_A": std_A, "F": (S**2).mean(0), "G": (A[:, None] * S).mean(0), "Cov": Cov, "rho": rho}


def batch_of(seed: int, B: int = 6) -> tuple[dict, np.ndarray]:
    """A left-padded batch of B rows and its advantages (B,)."""
    gen = np.random.default_rng(seed)
    batch = make_batch(seed, gen.integers(2, 6, B).tolist(), gen.integers(2, 7, B).tolist())
    return batch, gen.standard_normal(B)


def test_inrun_statistics_equal_the_float64_reference(tmp_path: Path):
    model = llama(tied=True).double()
    batch, A = batch_of(0)
    folder = InRunFolder(model, every_n=1, out_dir=tmp_path, check=True)
    got = folder.fold(0, batch["input_ids"], batch["attention_mask"], batch["target_mask"], A, group=np.arange(6) // 2)
    ref = reference(naive_scores(model, folder.layout, batch).double().numpy(), A)
    assert got is not None and got.stats["N"] == ref["N"] == 6
    assert math.isclose(got.stats["std_A"], ref["std_A"], rel_tol=1e-12)
    for name in ("F", "G", "Cov", "rho"):  # the engine's logit cotangent is float32: ~1e-6 relative
        np.testing.assert_allclose(got.stats[name], ref[name], rtol=1e-5, atol=1e-6 * np.abs(ref[name]).max())
    k = count_for_fraction(0.01, folder.layout.P)
    for metric, src in METRICS.items():
        np.testing.assert_array_equal(got.top[metric], topk_indices(np.abs(ref[src]), k))
    saved = np.load(tmp_path / "step_000000.npz")
    assert sorted(saved.files) == ["F", "G", "rho", "top_F", "top_absG", "top_absrho"]
    np.testing.assert_array_equal(saved["G"], got.stats["G"])
    summary = json.loads((tmp_path / "step_000000.json").read_text())
    assert summary["N"] == 6 and summary["k"] == k and summary["overlap_first"] == dict.fromkeys(METRICS, 1.0)
    assert summary["prev_step"] is None and all(math.isnan(v) for v in summary["overlap_prev"].values())
    index = json.loads((tmp_path / "inrun.json").read_text())
    assert index["steps"] == [0] and ParamLayout.from_records(index["tensors"]) == folder.layout

    f32 = InRunFolder(llama(tied=True), every_n=1).fold(
        0, batch["input_ids"], batch["attention_mask"], batch["target_mask"], A
    )  # the float32 model, one accumulator row
    for name in ("F", "G", "rho"):
        np.testing.assert_allclose(f32.stats[name], ref[name], atol=2e-4 * np.nanmax(np.abs(ref[name])))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _trainer_backward(model: torch.nn.Module, batch: dict, A: np.ndarray) -> None:
    """A trainer's loss: −Σ_n A_n Σ_t log p(y_t) of the padded batch, backward into .grad."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    (-(torch.as_tensor(A, dtype=lp.dtype)[:, None] * batch["target_mask"][:, 1:] * lp).sum()).backward()


def _hooks(model: torch.nn.Module) -> list[int]:
    return [len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules()]


def test_a_fold_leaves_the_trainers_gradients_and_state_as_they_were():
    model = llama(tied=False)
    model.gradient_checkpointing_enable()  # as TRL's default: also makes the embedding's output require grad
    model.train()
    model.model.layers[0].self_attn.eval()  # a module the trainer keeps in eval
    model.model.norm.weight.requires_grad_(False)  # a parameter the trainer keeps frozen
    batch, A = batch_of(1)
    folder = InRunFolder(model, every_n=1)
    _trainer_backward(model, batch, A)
    want = _grads(model)
    flags = [(p.requires_grad, m.training) for m in model.modules() for p in m.parameters(recurse=False)]
    hooks, rng = _hooks(model), torch.get_rng_state()
    got = folder.fold(0, batch["input_ids"], batch["attention_mask"], batch["target_mask"], A)
    plain = InRunFolder(llama(tied=False), params=folder.layout.names).fold(
        0, batch["input_ids"], batch["attention_mask"], batch["target_mask"], A
    )  # the same weights without the trainer's state
    assert got is not None and np.array_equal(got.stats["F"], plain.stats["F"]) and got.stats["F"].max() > 0
    after = _grads(model)
    assert all((want[n] is None and after[n] is None) or torch.equal(want[n], after[n]) for n in want)
    assert flags == [(p.requires_grad, m.training) for m in model.modules() for p in m.parameters(recurse=False)]
    assert _hooks(model) == hooks and torch.equal(torch.get_rng_state(), rng)
    assert model.training and not model.model.layers[0].self_attn.training and model.model.layers[1].training

    model.zero_grad(set_to_none=True)  # the fold before the trainer's backward: the same gradient, bit for bit
    folder.fold(1, batch["input_ids"], batch["attention_mask"], batch["target_mask"], A)
    _trainer_backward(model, batch, A)
    again = _grads(model)
    assert all((want[n] is None and again[n] is None) or torch.equal(want[n], again[n]) for n in want)


def test_every_n_folds_and_overlaps(tmp_path: Path):
    model = llama(tied=False)
    folder = InRunFolder(model, params=["model.layers.*.mlp.*"], every_n=2, out_dir=tmp_path, vectors=())
    done = {}
    for step in range(5):
        batch, A = batch_of(10 + step)
        with torch.no_grad():  # the weights move between steps
            model.model.layers[0].mlp.up_proj.weight.mul_(1.1)
        got = folder.fold(step, batch["input_ids"], batch["attention_mask"], batch["target_mask"], A)
        assert (got is None) == (step % 2 == 1)
        if got is not None:
            done[step] = got
    assert folder.steps == [0, 2, 4] and json.loads((tmp_path / "inrun.json").read_text())["steps"] == [0, 2, 4]
    assert not (tmp_path / "step_000001.json").exists()
    assert sorted(np.load(tmp_path / "step_000004.npz").files) == ["top_F", "top_absG", "top_absrho"]
    s4 = json.loads((tmp_path / "step_000004.json").read_text())
    assert s4["prev_step"] == 2 and s4["first_step"] == 0
    for metric in METRICS:
        top = done[4].top[metric]
        assert s4["overlap_prev"][metric] == len(set(top) & set(done[2].top[metric])) / len(top)
        assert s4["overlap_first"][metric] == len(set(top) & set(done[0].top[metric])) / len(top)
    assert 0 < s4["overlap_first"]["F"] < 1  # the sets moved, and the overlap counts them


def test_inrun_refuses_bad_arguments():
    model = llama(tied=False)
    with pytest.raises(ValueError, match="every_n"):
        InRunFolder(model, every_n=0)
    with pytest.raises(ValueError, match="fraction"):
        InRunFolder(model, q=0.0)
    batch, A = batch_of(2)
    with pytest.raises(ValueError, match="advantages"):
        InRunFolder(model).fold(0, batch["input_ids"], batch["attention_mask"], batch["target_mask"], A[:3])


def _varied(prompts, completions, **kwargs):
    """A reward that varies on a random model's completions: the count of '1' and '+' characters."""
    return [float(c.count("1") + c.count("+")) for c in completions]


def test_a_trl_run_writes_inrun_statistics_of_its_batches(tmp_path: Path):
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from covgrad.integrations.trl import CovgradInRun, CovgradRecorder
    from covgrad.rollouts.problems import addition_problems
    from tests.helpers.trainers import cpu_grpo_args
    from tests.helpers.user import write_checkpoint

    G, prompts = 4, 2
    model_dir = write_checkpoint(tmp_path / "model")
    data = Dataset.from_list([{"prompt": p.prompt} for p in addition_problems(8, 2, seed=0)])
    args = cpu_grpo_args(tmp_path / "trl", G * prompts, G)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    recorder, inrun = CovgradRecorder(tmp_path / "rec", checkpoint_steps=[0]), CovgradInRun(tmp_path / "inrun", 1)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=_varied,
        args=args,
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=[recorder, inrun],
    )
    recorder.attach(trainer)
    inrun.attach(trainer)
    trainer.train()

    assert json.loads((tmp_path / "inrun" / "inrun.json").read_text())["steps"] == [0, 1]
    assert json.loads((tmp_path / "inrun" / "step_000001.json").read_text())["prev_step"] == 0
    records = [json.loads(x) for x in (tmp_path / "rec" / "rollouts.jsonl").read_text().splitlines()]
    step0 = [r for r in records if r["policy_version"] == 0]
    start = AutoModelForCausalLM.from_pretrained(tmp_path / "rec" / "checkpoints" / "step_000000").double()
    layout = ParamLayout.from_records(json.loads((tmp_path / "inrun" / "inrun.json").read_text())["tensors"])
    seqs = [torch.tensor(r["prompt_ids"] + r["response_ids"]) for r in step0]
    weights = [torch.cat([torch.zeros(len(r["prompt_ids"])), torch.ones(len(r["response_ids"]))]) for r in step0]
    S = naive_scores(start, layout, {"seqs": seqs, "weights": weights, "input_ids": torch.zeros(1, 1)})
    ref = reference(S.double().numpy(), np.array([r["advantage"] for r in step0]))
    assert ref["std_A"] > 0
    saved = np.load(tmp_path / "inrun" / "step_000000.npz")
    summary = json.loads((tmp_path / "inrun" / "step_000000.json").read_text())
    assert summary["N"] == G * prompts and math.isclose(summary["std_A"], ref["std_A"], rel_tol=1e-6)
    for name in ("F", "G", "rho"):
        np.testing.assert_allclose(saved[name], ref[name], atol=2e-4 * np.nanmax(np.abs(ref[name])))
    k = count_for_fraction(0.01, layout.P)
    assert len(np.intersect1d(saved["top_F"], topk_indices(ref["F"], k))) >= 0.9 * k
    _opens_by_step_and_reports(tmp_path / "inrun", layout)


def test_the_plain_hook_folds_a_verl_style_batch_as_the_folder_does():
    """verl's layout: responses end ``input_ids``, ``response_mask`` and token-level GRPO advantages cover the last
    T positions, prompt groups are uid strings; the hook's statistics are the folder's bytes on the same batch."""
    from covgrad.integrations.torch import InRunHook

    batch, A = batch_of(3)
    L, T = batch["input_ids"].shape[1], 6
    assert batch["target_mask"][:, : L - T].sum() == 0  # every response within the last T positions
    response = batch["target_mask"][:, L - T :]  # (B, T)
    uids = ["a", "a", "b", "b", "c", "c"]
    verl = {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "response_mask": response,
        "advantages": torch.as_tensor(A, dtype=torch.float32)[:, None] * response,  # verl's token-level GRPO
    }
    got = InRunHook(llama(tied=False), every_n=2)(0, verl, group=uids)
    A32 = torch.as_tensor(A, dtype=torch.float32).double()
    want = InRunFolder(llama(tied=False)).fold(
        0, batch["input_ids"], batch["attention_mask"], batch["target_mask"], A32, group=[0, 0, 1, 1, 2, 2]
    )
    assert got is not None and want is not None and got.stats["N"] == 6
    for name in ("F", "G", "rho"):
        assert got.stats[name].tobytes() == want.stats[name].tobytes(), name
    hook = InRunHook(llama(tied=False), every_n=2)
    varying = dict(verl, advantages=verl["advantages"] * torch.linspace(1, 2, T))  # GAE-like: varies in a row
    with pytest.raises(ValueError, match="vary within a row"):
        hook(0, varying)
    with pytest.raises(KeyError, match="response_mask"):
        hook(0, {k: v for k, v in verl.items() if k != "response_mask"})
    assert hook(0, verl) is not None and hook(1, verl) is None and hook.due(2)


def _opens_by_step_and_reports(path: Path, layout: ParamLayout) -> None:
    """The series opens by step with every file's numbers, per tensor, and its report shows them against step."""
    from covgrad.report.inrun import inrun_report
    from storage.notebook import open_inrun

    ds = open_inrun(path)
    assert ds.step.values.tolist() == [0, 1] and ds.attrs["every_n"] == 1
    for t in (0, 1):
        saved, summary = np.load(path / f"step_{t:06d}.npz"), json.loads((path / f"step_{t:06d}.json").read_text())
        for name in ("F", "G", "rho"):
            assert ds[name].sel(step=t).values.tobytes() == saved[name].tobytes()
        for metric in METRICS:
            top = ds.top.sel(step=t, metric=metric).values
            np.testing.assert_array_equal(top[top >= 0], saved[f"top_{metric}"])
            np.testing.assert_equal(float(ds.overlap_prev.sel(step=t, metric=metric)), summary["overlap_prev"][metric])
        assert int(ds.N.sel(step=t)) == summary["N"] and float(ds.std_A.sel(step=t)) == summary["std_A"]
    e = layout.entries[-1]
    G = ds.covgrad.tensor(e.name)["G"]
    assert G.shape == (2, *e.shape)
    np.testing.assert_array_equal(G.sel(step=1).values.reshape(-1), ds.G.sel(step=1).values[e.offset :])
    report = inrun_report(ds)
    rows = report.numbers["inrun"]
    assert [r["step"] for r in rows] == [0, 1] and rows[1]["overlap_prev_absG"] == ds.overlap_prev.values[1, 1]
    assert math.isclose(rows[1]["mean_absG"], float(np.abs(ds.G.sel(step=1).values).mean()), rel_tol=1e-12)
    assert "inrun.png" in report.plots and "overlap_first_absG" in report.markdown() and "<img" in report.html()
