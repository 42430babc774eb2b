"""An external run's in-run series as predictors (``trajectory.inrun``, tasks/jobs/external_run.py ``InRunRule``): a
hand-written training loop folds its own batches with ``InRunFolder`` every 2 steps and keeps bf16 checkpoints at
irregular steps; the external trajectory's in-run precision (latest folded step before each record and the first,
on the step's and on the cumulative-since-anchor changed sets) equals a brute-force recount with numpy's stable
argsort from the checkpoints and the npz files. A malformed or disagreeing folder is refused in one line naming the
file (exit 2 from ``covgrad run``); the setting enters the trajectory key only when set."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from covgrad.integrations import InRunFolder
from covgrad.layout import parameters_flat, select_parameters
from covgrad.updates import ChangeTracker, OptimizerSpec, StepZeroStats
from storage.stores.inrun import inrun_series
from tasks.jobs.external_run import ExternalRun, InRunRule, run_records
from tasks.specs import plan
from tests.helpers.deltas import one_line_error
from tests.helpers.pipeline import tiny_config
from tests.helpers.trajectory import rollouts, tiny_llama

REPO = Path(__file__).resolve().parents[2]
SAVED = (1, 3, 4, 6)  # the checkpoints after the start (step 0)
EVERY = 2  # folded steps 0, 2, 4 (and 6, after the last record's start)
ANALYSED = ["model.layers.1.*", "lm_head.weight"]  # a part of the folded layout, at other offsets
METRICS = {"F": "F", "absG": "G", "absrho": "rho"}


def train(out: Path) -> tuple[dict[int, torch.Tensor], torch.nn.Module]:
    """Six SGD steps of −Σ A·log p over the response tokens on fresh rows, the batch folded before its step when
    due; (step -> (P_all,) bf16 weights at 0 and SAVED, the model)."""
    model = tiny_llama().train()
    folder = InRunFolder(model, None, EVERY, out, q=0.1)
    layout = select_parameters(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    saved = {0: parameters_flat(model, layout).detach().to(torch.bfloat16)}
    for step in range(SAVED[-1]):
        b = rollouts(100 + step)
        folder.fold(step, b["input_ids"], b["attention_mask"], b["response_mask"], b["advantages"])
        logp = torch.log_softmax(model(b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1], -1)
        tok = logp.gather(-1, b["input_ids"][:, 1:, None])[..., 0] * b["response_mask"][:, 1:]
        loss = -(b["advantages"][:, None].float() * tok).sum() / b["response_mask"].sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step + 1 in SAVED:
            saved[step + 1] = parameters_flat(model, layout).detach().to(torch.bfloat16)
    return saved, model


def top_k(values: np.ndarray, k: int) -> np.ndarray:
    """(P,) bool: the k largest values, ties to the lowest index, NaN last (numpy's stable argsort)."""
    order = np.argsort(np.where(np.isnan(values), np.inf, -values), kind="stable")
    out = np.zeros(values.shape[0], dtype=bool)
    out[order[:k]] = True
    return out


def test_inrun_predictors_equal_a_brute_force_recount(tmp_path):
    saved, model = train(tmp_path / "inrun")
    series = inrun_series(str(tmp_path / "inrun"))
    assert series.steps == (0, 2, 4)  # step 6 is never folded: the loop ends before it
    full = select_parameters(model)
    layout = select_parameters(model, ANALYSED)
    columns = series.columns(layout)
    assert columns is not None and columns.shape == (layout.P,)
    cols = np.concatenate([np.arange(e.offset, e.offset + e.numel) for e in full.entries if e.name in layout.names])
    np.testing.assert_array_equal(columns, cols)
    flat = {t: w[torch.from_numpy(cols)] for t, w in saved.items()}  # the analysed columns, bf16

    rng = np.random.default_rng(0)
    stats = StepZeroStats(*(rng.standard_normal(layout.P) for _ in range(3)), seed=0, samples_per_step=6)
    tracker = ChangeTracker(layout, flat[0], OptimizerSpec("sgd", 0.02), stats, chunk=64)
    rule = InRunRule(series, columns, tracker)
    run = ExternalRun("manual", "start", 0, flat[0], list(SAVED), iter([(t, flat[t]) for t in SAVED]))
    records = list(run_records(run, tracker, None, None, rule))
    tracker.close()

    latest = {1: 0, 3: 0, 4: 2, 6: 4}  # the newest folded step at or before each record's earlier state
    anchor = {0: 0, 2: 3, 4: 4}  # the first saved state at or after each folded step
    summary = rule.summary(records)
    assert summary["latest"] == [latest[t] for t in SAVED] and summary["first"] == [0] * len(SAVED)
    before = dict(zip(SAVED, (0, *SAVED[:-1]), strict=True))
    partial = 0
    for rec, t in zip(records, SAVED, strict=True):
        for slot, u in (("latest", latest[t]), ("first", 0)):
            with np.load(tmp_path / "inrun" / f"step_{u:06d}.npz") as f:
                values = {m: np.asarray(f[v])[cols] for m, v in METRICS.items()}
            sets = {
                "step": (flat[t] != flat[before[t]]).numpy(),
                "cum": (flat[t] != flat[anchor[u]]).numpy(),
            }
            for scope, true in sets.items():
                k = int(true.sum())
                partial += 0 < k < layout.P
                for m, v in values.items():
                    both = int((top_k(np.abs(v), k) & true).sum())
                    key = f"{scope}_inrun_{slot}_{m}"
                    assert rec[f"{key}_size"] == k, key
                    assert rec[f"{key}_precision"] == rec[f"{key}_recall"] == both / k, (t, key)
        assert rec["step_inrun_first_F_precision"] != rec["step_F_precision"] or t == 1  # not the step-0 stats
    assert partial >= 8  # most sets are neither empty nor everything: the ranking decides
    means = summary["mean_precision"]
    assert means["step_latest_F"] == np.mean([r["step_inrun_latest_F_precision"] for r in records])
    assert means["cum_step0_absG"] == np.mean([r["cum_absG_precision"] for r in records])


def inrun_folder(path: Path, tensors: list[dict], steps=(0,)) -> Path:
    """An in-run folder written by hand: the index and per step F, G, rho of the layout's P, float64."""
    path.mkdir(parents=True)
    P = sum(t["numel"] for t in tensors)
    index = {"every_n": 1, "q": 0.5, "temperature": 1.0, "vectors": ["F", "G", "rho"], "steps": list(steps)}
    (path / "inrun.json").write_text(json.dumps({**index, "tensors": tensors}))
    for t in steps:
        np.savez(path / f"step_{t:06d}.npz", F=np.ones(P), G=np.ones(P), rho=np.ones(P))
    return path


TENSORS = [
    {"name": "a.weight", "offset": 0, "numel": 6, "shape": [2, 3], "dtype": "float32"},
    {"name": "b.bias", "offset": 6, "numel": 2, "shape": [2], "dtype": "float32"},
]


def test_malformed_inrun_folders_are_refused_naming_the_file(tmp_path):
    good = inrun_folder(tmp_path / "good", TENSORS, steps=(0, 3))
    assert inrun_series(str(good)).P == 8
    bad = inrun_folder(tmp_path / "bad", TENSORS, steps=(0, 3))
    (bad / "step_000003.npz").unlink()
    assert f"{bad / 'step_000003.npz'}: is missing" in one_line_error(inrun_series, str(bad))
    np.savez(bad / "step_000003.npz", F=np.ones(8), G=np.ones(8), rho=np.ones(8, dtype=np.float32))
    assert "its rho is float32 (8,), the index's layout needs float64 (8,)" in one_line_error(inrun_series, str(bad))
    np.savez(bad / "step_000003.npz", F=np.ones(8), G=np.ones(8))
    assert "step_000003.npz: holds no rho" in one_line_error(inrun_series, str(bad))
    (bad / "step_000003.npz").write_bytes(b"PK\x03\x04 cut short")
    assert "step_000003.npz: not a readable npz" in one_line_error(inrun_series, str(bad))
    index = json.loads((bad / "inrun.json").read_text())
    for edit, said in (
        ({"steps": [3, 0]}, "are not ascending distinct integers"),
        ({"vectors": ["F", "G"]}, "its vectors lack ['rho']"),
        ({"tensors": [TENSORS[1], TENSORS[0]]}, "does not follow the previous one"),
        ({"tensors": [{**TENSORS[0], "numel": 5}, TENSORS[1]]}, "does not follow the previous one"),
    ):
        (bad / "inrun.json").write_text(json.dumps({**index, **edit}))
        msg = one_line_error(inrun_series, str(bad))
        assert said in msg and f"{bad / 'inrun.json'}: " in msg, edit
    (bad / "inrun.json").write_text("{")
    assert "inrun.json: not valid JSON" in one_line_error(inrun_series, str(bad))
    (bad / "inrun.json").unlink()
    assert "holds no inrun.json" in one_line_error(inrun_series, str(bad))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        inrun_series(str(tmp_path / "missing"))


def demo_series(root: Path) -> Path:
    """A one-checkpoint series of the demo policy (``step-0``, the config's architecture) for the preflight."""
    from covgrad.models import build_demo_model
    from covgrad.rollouts import build_char_tokenizer

    model = build_demo_model(tiny_config(str(root)).model.demo, build_char_tokenizer())
    model.save_pretrained(root / "series" / "step-0")
    return root / "series"


def test_a_malformed_folder_fails_covgrad_run_and_a_disagreeing_layout_the_preflight(tmp_path):
    from flows.preflight import preflight

    series = demo_series(tmp_path)
    bad = inrun_folder(tmp_path / "bad", TENSORS)
    (bad / "step_000000.npz").write_bytes(b"")
    cmd = [sys.executable, "-m", "flows.cli", "run", "--config", str(REPO / "configs" / "tiny.yaml")]
    sets = {"trajectory.enabled": "true", "trajectory.checkpoints": series, "trajectory.inrun": bad}
    cmd += ["--root", str(tmp_path / "root"), *(a for k, v in sets.items() for a in ("--set", f"{k}={v}"))]
    env = {**os.environ, "PYTHONPATH": str(REPO), "COVGRAD_LOG_DIR": str(tmp_path / "logs")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{bad / 'step_000000.npz'}: not a readable npz" in lines[0], proc.stderr
    assert not (tmp_path / "root").exists()

    other = inrun_folder(tmp_path / "other", TENSORS)  # well formed, not the demo's tensors
    settings = {"trajectory.enabled": True, "trajectory.checkpoints": str(series), "trajectory.inrun": str(other)}
    cfg = tiny_config(str(tmp_path / "root"), **settings)
    preflight(cfg, architecture=False)  # the layout needs the policy's architecture
    msg = one_line_error(preflight, cfg)
    assert f"{other / 'inrun.json'} has no such tensor for the analysed tensor" in msg


def test_the_inrun_series_enters_the_trajectory_key_only_when_set(tmp_path):
    series = demo_series(tmp_path)
    folder = inrun_folder(tmp_path / "inrun", TENSORS)
    base = {"trajectory.enabled": True, "trajectory.checkpoints": str(series)}
    without = plan(tiny_config(str(tmp_path / "root"), **base))
    assert "inrun" not in without["trajectory"].spec.hashed()["settings"]
    assert "inrun" not in without["report"].spec.config["trajectory"]  # the report's key is the one it had
    step = plan(tiny_config(str(tmp_path / "root"), **base, **{"trajectory.inrun": str(folder)}))["trajectory"]
    assert step.spec.hashed()["settings"]["inrun"] == str(folder) and "inrun" in step.spec.inputs
    assert step.ref.key != without["trajectory"].ref.key
    np.savez(folder / "step_000000.npz", F=np.zeros(8), G=np.ones(8), rho=np.ones(8))
    edited = plan(tiny_config(str(tmp_path / "root"), **base, **{"trajectory.inrun": str(folder)}))["trajectory"]
    assert edited.ref.key != step.ref.key  # the files' content is in the key
    with pytest.raises(ValidationError, match="is the in-run series of an external run; set trajectory.checkpoints"):
        tiny_config(str(tmp_path / "root"), **{"trajectory.inrun": str(folder)})
