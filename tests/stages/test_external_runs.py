"""External runs where the stacks leave them: checkpoint series in the verl, Trainer/TRL, Hub and covgrad layouts
and their refusals, grail's delta traces and theirs (fast, on files built here), and, on the tiny pipeline's own
6-step trajectory: ``covgrad diff`` of its fp32 policy against its bf16 checkpoints, a Trainer-layout series of those
checkpoints starting at model.path with the trainer's logged lr and loss, and delta traces in grail's, TRL's and
slime's formats that give the very bytes of the equivalent checkpoint series."""

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr

from covgrad.layout import ParamLayout, parameters_flat
from flows.cli import main
from storage.models import load_model
from storage.schema import TRAJECTORY
from storage.stores.external import checkpoint_series, delta_trace, replay_deltas
from tasks.specs import plan
from tests.helpers.deltas import one_line_error, slime_trace, tiny_net, trl_trace
from tests.helpers.pipeline import run_planned, tiny_config
from tests.helpers.trajectory import OVERRIDES, STEPS, digests


def model_dir(path: Path, *, weights: bool = True, config: bool = True) -> Path:
    """A stand-in Hugging Face model folder (the series reader only looks at file names)."""
    path.mkdir(parents=True)
    if config:
        (path / "config.json").write_text("{}")
    if weights:
        (path / "model.safetensors").write_bytes(b"")
    return path


def test_series_layouts_are_detected_and_ordered_by_step(tmp_path):
    verl = tmp_path / "verl" / "checkpoints" / "proj" / "exp"
    for t in (10, 5):
        model_dir(verl / f"global_step_{t}" / "actor" / "huggingface")
    (verl / "latest_checkpointed_iteration.txt").write_text("10")
    series = checkpoint_series(str(verl))
    assert series.layout == "verl" and [t for t, _ in series.checkpoints] == [5, 10]
    assert series.checkpoints[0][1].endswith("global_step_5/actor/huggingface") and series.logged is None

    trainer = tmp_path / "trainer"
    for t in (10, 2):
        model_dir(trainer / f"checkpoint-{t}")
    (trainer / "runs").mkdir()  # TensorBoard's folder beside the checkpoints: not a step
    history = [
        {"step": 1, "loss": 0.5, "learning_rate": 1e-6, "grad_norm": 2.0},
        {"step": 2, "loss": 0.25, "learning_rate": 2e-6, "grad_norm": None},
        {"step": 2, "eval_loss": 9.0},
        {"step": 10, "train_loss": 0.3},
    ]
    (trainer / "checkpoint-10" / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    series = checkpoint_series(str(trainer))
    assert series.layout == "trainer" and [t for t, _ in series.checkpoints] == [2, 10]
    assert series.logged == {1: {"lr": 1e-6, "loss": 0.5, "grad_norm": 2.0}, 2: {"lr": 2e-6, "loss": 0.25}}

    hub = tmp_path / "hub"
    for name in ("step-0", "step-30", "stage1-step10-tokens42B"):
        model_dir(hub / name)
    assert checkpoint_series(str(hub)).layout == "hub"
    assert [t for t, _ in checkpoint_series(str(hub)).checkpoints] == [0, 10, 30]
    own = tmp_path / "own"
    for t in (2, 1):
        model_dir(own / f"step_{t:06d}")
    assert checkpoint_series(str(own)).layout == "covgrad"

    (own / "manifest.json").write_text(json.dumps({"checkpoints": [{"step": 0, "path": "step_000002"}]}))
    series = checkpoint_series(str(own))
    assert series.layout == "manifest" and series.checkpoints == ((0, str((own / "step_000002").resolve())),)


def test_malformed_series_are_refused_naming_the_file(tmp_path):
    actor = tmp_path / "verl" / "global_step_3" / "actor"
    model_dir(actor / "huggingface", weights=False)  # verl writes config and tokenizer there always
    (actor / "model_world_size_2_rank_0.pt").write_bytes(b"")
    msg = one_line_error(checkpoint_series, str(tmp_path / "verl"))
    want = f"python -m verl.model_merger merge --backend fsdp --local_dir {actor} --target_dir {actor / 'huggingface'}"
    assert "holds only FSDP shards" in msg and want in msg

    model_dir(tmp_path / "noweights" / "checkpoint-4", weights=False)
    msg = one_line_error(checkpoint_series, str(tmp_path / "noweights"))
    assert "checkpoint-4 (step 4) has no weights" in msg
    model_dir(tmp_path / "noconfig" / "step-4", config=False)
    assert str(tmp_path / "noconfig" / "step-4" / "config.json") in one_line_error(
        checkpoint_series, str(tmp_path / "noconfig")
    )
    for name in ("checkpoint-5", "checkpoint-05"):
        model_dir(tmp_path / "twice" / name)
    assert "are both step 5" in one_line_error(checkpoint_series, str(tmp_path / "twice"))
    for name in ("checkpoint-5", "step_000001"):
        model_dir(tmp_path / "mixed" / name)
    msg = one_line_error(checkpoint_series, str(tmp_path / "mixed"))
    assert "mixes checkpoint layouts: checkpoint-5 (trainer), step_000001 (covgrad)" in msg
    assert "no step folders" in one_line_error(checkpoint_series, str(tmp_path / "verl" / "global_step_3"))

    model_dir(tmp_path / "outside")
    series = tmp_path / "series"
    model_dir(series / "a")
    entries = [{"step": 0, "path": "a"}, {"step": 1, "path": "../outside"}]
    (series / "manifest.json").write_text(json.dumps({"checkpoints": entries}))
    msg = one_line_error(checkpoint_series, str(series))
    assert "'../outside' (step 1) is outside the series folder" in msg and str(series / "manifest.json") in msg
    (series / "manifest.json").write_text("{}")
    assert "not a checkpoint manifest" in one_line_error(checkpoint_series, str(series))
    assert "neither" in one_line_error(checkpoint_series, str(tmp_path / "missing"))


def grail_delta(step: int, layers: dict[str, tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]]) -> dict:
    """A delta file's dict as grail's DeltaCheckpointCallback writes it (research/trl/delta_checkpoint_callback.py
    at 54d6342): name -> (indices (ndim, nnz) int32, new values, shape)."""
    entries = {
        name: {"indices": idx, "values": values, "shape": shape, "nnz": int(values.numel())}
        for name, (idx, values, shape) in layers.items()
    }
    total = sum(int(v.numel()) for _, v, _ in layers.values())
    meta = {"total_changed": total, "num_changed_layers": len(entries), "dtype": "bfloat16"}
    return {"step": step, "timestamp": 0.0, "format": "values", "layers": entries, "metadata": meta}


def test_a_delta_trace_replays_and_malformed_ones_are_refused(tmp_path):
    net, layout = tiny_net()
    start = parameters_flat(net, layout).detach().to(torch.bfloat16)
    shapes = {n: tuple(p.shape) for n, p in net.named_parameters()}
    trace_dir = tmp_path / "trace"
    trace_dir.mkdir()
    torch.save({n: p.detach().clone() for n, p in net.named_parameters()}, trace_dir / "base_weights.pt")
    new = torch.tensor([7.0, -3.0], dtype=torch.bfloat16)
    step0 = {"0.weight": (torch.tensor([[1, 3], [2, 0]], dtype=torch.int32), new, (4, 3))}
    step1 = {"1.bias": (torch.tensor([[1]], dtype=torch.int32), new[:1], (2,))}
    torch.save(grail_delta(0, step0), trace_dir / "delta_000000.pt")
    torch.save(grail_delta(1, step1), trace_dir / "delta_000001.pt")
    trace = delta_trace(str(trace_dir))
    assert trace.dtype == torch.bfloat16 and [t for t, _ in trace.files] == [0, 1]
    assert trace.start.endswith("base_weights.pt")
    out = [(t, w.clone()) for t, w in replay_deltas(trace, shapes, layout, start)]
    want = start.clone()
    want[[1 * 3 + 2, 3 * 3 + 0]] = new  # 0.weight at (1, 2) and (3, 0), row-major at offset 0
    assert out[0][0] == 1 and torch.equal(out[0][1], want)
    want[layout.entries[3].offset + 1] = new[0]
    assert out[1][0] == 2 and torch.equal(out[1][1], want)

    def refused(layers: dict, **fields) -> str:
        torch.save({**grail_delta(1, layers), **fields}, trace_dir / "delta_000001.pt")
        return one_line_error(lambda: list(replay_deltas(delta_trace(str(trace_dir)), shapes, layout, start)))

    file = str(trace_dir / "delta_000001.pt")
    msg = refused({"0.weight": (torch.tensor([[4], [0]], dtype=torch.int32), new[:1], (4, 3))})
    assert file in msg and "index [4, 0] is out of range for its shape (4, 3)" in msg
    msg = refused({"0.weight": (torch.tensor([[0], [0]], dtype=torch.int32), new[:1], (3, 4))})
    assert file in msg and "has shape (3, 4) in the delta, (4, 3) in the start model" in msg
    assert "is not a parameter of the start model" in refused(
        {"2.weight": (torch.zeros(2, 0, dtype=torch.int32), new[:0], (2,))}
    )
    assert "values must be torch.bfloat16" in refused({"1.bias": (torch.tensor([[1]]), torch.ones(1), (2,))})
    assert "format None" in refused(step1, format=None)
    assert "its step field is 5" in refused(step1, step=5)
    (trace_dir / "delta_000001.pt").rename(trace_dir / "delta_000002.pt")
    assert "delta_000001.pt is missing" in one_line_error(delta_trace, str(trace_dir))
    (trace_dir / "delta_000002.pt").unlink()
    (trace_dir / "base_weights.pt").unlink()
    assert "has no start weights" in one_line_error(delta_trace, str(trace_dir))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The tiny pipeline with its 6-step bf16 trajectory (checkpoints at steps 1, 2, 4, 6)."""
    root = tmp_path_factory.mktemp("external")
    cfg = tiny_config(str(root), **OVERRIDES)
    assert run_planned(cfg)["trajectory"].computed
    p = plan(cfg)
    return root, p["trajectory"].ref, root / "base_model" / p["base_model"].ref.key / "policy"


def external(root: Path, **settings: str):
    """Run the tiny pipeline's trajectory stage on an external run; its dataset and artifact folder."""
    cfg = tiny_config(str(root), **OVERRIDES, **{f"trajectory.{k}": v for k, v in settings.items()})
    result = run_planned(cfg, {"trajectory"})["trajectory"]
    artifact = root / result.ref.stage / result.ref.key
    return xr.open_zarr(artifact / TRAJECTORY), artifact


@pytest.mark.slow
def test_the_policy_diffs_against_its_own_bf16_trajectory_checkpoints(reference, capsys):
    """The fp32 demo policy against the bf16 checkpoints of its own trajectory (refused before: no tensor agreed
    in dtype): changed means bf16(policy) != checkpoint, the trajectory's cumulative changed count."""
    root, ref, policy = reference
    ds = xr.open_zarr(root / ref.stage / ref.key / TRAJECTORY)
    for t in (1, 6):
        capsys.readouterr()
        assert (
            main(["diff", str(policy), str(root / ref.stage / ref.key / "checkpoints" / f"step_{t:06d}"), "--json"])
            == 0
        )
        result = json.loads(capsys.readouterr().out)
        assert result["mismatched"] == [] and {r["before_dtype"] for r in result["tensors"]} == {"float32"}
        assert result["changed_exact"] == int(ds.n_changed_cum.values[t - 1])


@pytest.mark.slow
def test_a_trainer_layout_series_starts_at_model_path_with_the_logged_lr(reference, tmp_path, caplog):
    """The trajectory's bf16 checkpoints as a Trainer's checkpoint-N folders (no step 0: the fp32 policy is the
    start, rounded to bf16) give its cumulative changed sets; lr, loss and grad_norm are the trainer_state.json's."""
    root, ref, _ = reference
    stepped = xr.open_zarr(root / ref.stage / ref.key / TRAJECTORY)
    run = tmp_path / "trl-output"
    steps = [1, 2, 4, 6]
    for t in steps:
        shutil.copytree(root / ref.stage / ref.key / "checkpoints" / f"step_{t:06d}", run / f"checkpoint-{t}")
    history = [{"step": t, "loss": 0.1 * t, "learning_rate": 1e-5 * t, "grad_norm": float(t)} for t in range(1, 7)]
    (run / "checkpoint-6" / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    with caplog.at_level(logging.INFO, logger="covgrad"):
        ds, _ = external(root, checkpoints=str(run))
    assert "external run (trainer layout, 4 steps from model.path" in caplog.text
    assert ds.step.values.tolist() == steps and ds.attrs["summary"]["trainer_steps"] == [0, *steps]
    assert ds.lr.values.tolist() == [1e-5 * t for t in steps] and ds.loss.values.tolist() == [0.1 * t for t in steps]
    assert ds.grad_norm.values.tolist() == [float(t) for t in steps]
    assert ds.n_changed_cum.values.tolist() == [int(stepped.n_changed_cum.values[t - 1]) for t in steps]
    assert np.array_equal(ds.changed.values[0], stepped.changed.values[0])


@pytest.mark.slow
def test_delta_traces_in_every_format_give_the_bytes_of_their_checkpoint_series(reference, tmp_path, caplog):
    """From the stepped trajectory's own trace: a Hub series step-0..step-6 of bf16 checkpoints and the same run as
    grail's delta files beside the fp32 start weights, as TRL's anchors and deltas (raw and gap-encoded indices, an
    anchor at version 4) and as slime's versions (one per encoding: xor, overwrite, indices, deltas, deltas_zstd, a
    whole checkpoint). Every analysis writes the series' bytes (changed sets, records, trace, d_k), names its layout
    in the stage's log line, and their changed sets and d_k are the stepped run's."""
    root, ref, policy = reference
    artifact = root / ref.stage / ref.key
    stepped = xr.open_zarr(artifact / TRAJECTORY)
    layout = ParamLayout.from_records(json.loads(json.dumps(stepped.attrs["tensors"])))
    bits = [np.load(artifact / "deltas" / "start.npy")]
    for t in range(1, STEPS + 1):
        w = bits[-1].copy()
        w[np.flatnonzero(np.unpackbits(stepped.changed.values[t - 1], count=layout.P))] = np.load(
            artifact / "deltas" / f"step_{t:06d}.npy"
        )
        bits.append(w)
    weights = [torch.from_numpy(b.view(np.int16)).view(torch.bfloat16) for b in bits]  # (P,) after each step

    model = load_model(policy)
    trace = tmp_path / "deltas"
    trace.mkdir()
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, trace / "base_weights.pt")
    hub = tmp_path / "hub"
    params = dict(model.named_parameters())
    states = []  # every parameter after each step, bf16
    for t, w in enumerate(weights):
        with torch.no_grad():
            for e in layout.entries:
                params[e.name].copy_(w[e.offset : e.offset + e.numel].reshape(e.shape))
        states.append({n: x.detach().to(torch.bfloat16) for n, x in params.items()})
        model.to(torch.bfloat16).save_pretrained(hub / f"step-{t}")
        model.float()
        if t:
            layers = {}
            for e in layout.entries:
                before, after = (x[e.offset : e.offset + e.numel].reshape(e.shape) for x in (weights[t - 1], w))
                mask = after != before
                if mask.any():
                    layers[e.name] = (mask.nonzero().t().to(torch.int32), after[mask], e.shape)
            torch.save(grail_delta(t - 1, layers), trace / f"delta_{t - 1:06d}.pt")

    trl_trace(tmp_path / "trl", states, ["raw", "gap_delta", "anchor", "gap_delta", "raw", "gap_delta"])
    slime_trace(tmp_path / "slime", states, ["xor", "overwrite", "indices", "deltas", "deltas_zstd", "full"])

    a, a_dir = external(root, checkpoints=str(hub))
    assert a.attrs["summary"]["external_layout"] == "hub"
    series = {k: v for k, v in digests(a_dir).items() if k != "summary.json"}
    for folder, name in (
        (trace, "grail deltas"),
        (tmp_path / "trl", "trl deltas (raw)"),
        (tmp_path / "slime", "slime deltas (xor)"),
    ):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="covgrad"):
            b, b_dir = external(root, deltas=str(folder))
        assert f"external run ({name} layout, {STEPS} steps from " in caplog.text
        assert b.attrs["summary"]["external_layout"] == name
        assert a.step.values.tolist() == b.step.values.tolist() == list(range(1, STEPS + 1))
        assert set(a.variables) == set(b.variables)
        for var in a.variables:
            np.testing.assert_array_equal(a[var].values, b[var].values, err_msg=f"{name}: {var}")
        assert {k: v for k, v in digests(b_dir).items() if k != "summary.json"} == series, name
    for name in ("changed", "n_changed_step", "n_changed_cum", "dk", "dk_tensor", "jaccard_prev", "persist_hist"):
        np.testing.assert_array_equal(a[name].values, stepped[name].values, err_msg=name)

    torch.save({n: p.detach() + 1 for n, p in load_model(policy).named_parameters()}, trace / "base_weights.pt")
    with pytest.raises(ValueError, match="the start weights .*base_weights.pt are not model.path's"):
        external(root, deltas=str(trace))
