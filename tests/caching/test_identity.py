"""Model identity: per-tensor digests against an independent hashlib computation, the first differing tensor of a
planted checkpoint, the scores stage's record, and the refusals of ``covgrad diff --masks`` and of the trajectory's
external-run analysis when the statistics were computed on other weights (the same weights pass)."""

import hashlib
import json
import shutil

import numpy as np
import pytest
import torch

from covgrad.identity import ALGORITHM, first_difference, model_identity, same_weights, tensor_digest
from flows.cli import main
from storage.artifacts import ArtifactStore
from storage.checkpoints import load_state_dict
from storage.identity import IDENTITY_ATTR, SAMPLER_IDENTITY_ATTR, check_computed_on, recorded_identity, sampler_weights
from tests.helpers.models import tiny_llama

UP = "model.layers.0.mlp.up_proj.weight"


def reference_digest(t: torch.Tensor) -> str:
    """blake2b-128 of the tensor's row-major bytes, through numpy (bf16 through its int16 bit patterns)."""
    t = t.detach().contiguous()
    arr = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
    return hashlib.blake2b(np.ascontiguousarray(arr).tobytes(), digest_size=16).hexdigest()


def bump(t: torch.Tensor, index: int) -> None:
    """Move one entry of ``t`` (in place) to the next representable float32 above it: the smallest change."""
    flat = t.data.view(-1)
    flat[index] = torch.nextafter(flat[index], torch.tensor(float("inf")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_digest_equals_hashlib_on_the_bytes(dtype):
    g = torch.Generator().manual_seed(3)
    t = torch.randn(7, 5, generator=g).to(dtype)
    assert tensor_digest(t) == reference_digest(t)
    assert tensor_digest(t.T) == tensor_digest(t.T.contiguous())  # any layout: the row-major bytes
    assert tensor_digest(t) != tensor_digest(t.float() if dtype != torch.float32 else t.double())  # dtype counts
    u = t.clone()
    u.view(-1)[11] = -u.view(-1)[11]
    assert tensor_digest(u) != tensor_digest(t)


def test_a_model_matches_its_own_checkpoint_and_not_a_planted_one(tmp_path):
    model = tiny_llama(16, hidden=16, intermediate=32, heads=2, kv_heads=1, tied=True, seed=1)
    identity = model_identity(model.named_parameters())
    assert identity["algorithm"] == ALGORITHM
    names = [r["name"] for r in identity["tensors"]]
    assert names == [n for n, _ in model.named_parameters()] and "lm_head.weight" not in names  # tied: once
    for rec in identity["tensors"]:
        assert rec["digest"] == reference_digest(dict(model.named_parameters())[rec["name"]])
    model.save_pretrained(tmp_path / "same")
    assert first_difference(identity, load_state_dict(tmp_path / "same")) is None

    planted = tiny_llama(16, hidden=16, intermediate=32, heads=2, kv_heads=1, tied=True, seed=1)
    bump(planted.model.layers[1].self_attn.q_proj.weight, 5)
    bump(planted.get_parameter(UP), 0)  # layer 0 comes first: the one named
    planted.save_pretrained(tmp_path / "planted")
    assert first_difference(identity, load_state_dict(tmp_path / "planted")) == (
        f"tensor {UP!r} differs (its float32 bytes hash to another digest)"
    )
    state = load_state_dict(tmp_path / "same")
    del state[UP]
    assert "is not in the checkpoint" in first_difference(identity, state)
    state[UP] = torch.zeros(3, 3)
    assert "has shape [3, 3]" in first_difference(identity, state)


def test_a_bf16_identity_matches_the_fp32_checkpoint_it_was_cast_from(tmp_path):
    """Statistics computed in bf16 saw the bf16 rounding of the checkpoint: the checkpoint is cast before it is
    hashed, so a change below bf16's resolution is the same weights and a change above it is not."""
    model = tiny_llama(16, hidden=16, intermediate=32, heads=2, kv_heads=1, seed=2)
    model.save_pretrained(tmp_path / "fp32")
    identity = model_identity(model.to(torch.bfloat16).named_parameters())
    state = load_state_dict(tmp_path / "fp32")
    assert first_difference(identity, state) is None
    bump(state[UP], 0)  # one float32 ulp: rounds to the same bf16 value
    assert first_difference(identity, state) is None
    state[UP].view(-1)[0] += 1.0
    assert "bfloat16 bytes" in first_difference(identity, state)


@pytest.mark.slow
def test_scores_record_the_identity_and_diff_refuses_other_weights(tiny_run, capsys, tmp_path):
    root, p = tiny_run
    store = ArtifactStore(str(root))
    base = store.path(p["base_model"].ref)
    policy = load_state_dict(f"{base}/policy")
    for name in ("scores.policy.policy", "scores.stale.sampler"):
        identity = store.open_group(p[name].ref, "scores.zarr", mode="r").attrs[IDENTITY_ATTR]
        assert {r["name"]: r["digest"] for r in identity["tensors"]} == {
            n: reference_digest(t) for n, t in policy.items() if n in {r["name"] for r in identity["tensors"]}
        }
        assert len(identity["tensors"]) >= len(policy) - 1  # every tensor (a tied head once)

    masks = store.path(p["masks"].ref)
    found = recorded_identity(store, p["masks"].ref.key)
    assert found is not None and found[0].key == p["scores.policy.policy"].ref.key  # the masks' statistics
    capsys.readouterr()
    assert main(["diff", f"{base}/policy", f"{base}/stale", "--masks", masks, "--q", "0.1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["overlap"]
    assert main(["diff", f"{base}/stale", f"{base}/policy", "--masks", masks, "--q", "0.1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    stale = load_state_dict(f"{base}/stale")
    records = store.open_group(p["scores.policy.policy"].ref, "scores.zarr").attrs[IDENTITY_ATTR]
    first = next(r["name"] for r in records["tensors"] if reference_digest(stale[r["name"]]) != r["digest"])
    assert f"were not computed on BEFORE {base}/stale" in err[0] and f"tensor {first!r} differs" in err[0]
    assert "compute masks for BEFORE" in err[0]

    copied = tmp_path / "elsewhere" / "masks" / "k"  # a masks directory outside its store: nothing to check
    shutil.copytree(masks, copied)
    assert main(["diff", f"{base}/stale", f"{base}/policy", "--masks", str(copied), "--q", "0.1"]) == 0
    assert "records no model identity; BEFORE is not checked" in capsys.readouterr().err


def test_same_weights_needs_every_name_dtype_and_bit():
    model = tiny_llama(16, hidden=8, intermediate=16, heads=2, kv_heads=1, max_positions=16)
    ident = model_identity(model.named_parameters())
    assert same_weights(ident, model_identity(model.named_parameters()))
    assert not same_weights(ident, model_identity((n, t.to(torch.bfloat16)) for n, t in model.named_parameters()))
    bump(model.get_parameter(UP), 3)
    assert not same_weights(ident, model_identity(model.named_parameters()))
    with pytest.raises(ValueError, match="algorithm"):
        same_weights(ident, {**ident, "algorithm": "md5"})


def test_rollouts_record_the_sampler_and_offpolicy_says_whose_weights(tiny_run):
    """The policy's rollouts record the scored policy's weights bit for bit, the stale sampler's its own
    checkpoint's; the off-policy table's ``sampler_weights`` says ``policy`` and ``other``."""
    root, p = tiny_run
    store = ArtifactStore(str(root))
    base = store.path(p["base_model"].ref)
    recorded = {
        name: store.open_group(p[f"rollouts.{name}"].ref, "rollouts.zarr", mode="r").attrs[SAMPLER_IDENTITY_ATTR]
        for name in ("policy", "stale")
    }
    stale = load_state_dict(f"{base}/stale")
    assert first_difference(recorded["stale"], stale) is None
    assert {r["name"]: r["digest"] for r in recorded["stale"]["tensors"]} == {
        r["name"]: reference_digest(stale[r["name"]]) for r in recorded["stale"]["tensors"]
    }
    scored = store.open_group(p["scores.policy.policy"].ref, "scores.zarr", mode="r").attrs[IDENTITY_ATTR]
    assert recorded["policy"] == scored
    scores = p["scores.stale.sampler"].ref
    assert sampler_weights(store, p["rollouts.stale"].ref, scores) == "other"
    rows = json.loads(store.fs.cat_file(store.path(p.offpolicy.ref, "offpolicy.json")))
    assert {(r["sampler"], r["centering"]): r["sampler_weights"] for r in rows} == {
        ("policy", "policy"): "policy",
        ("stale", "policy"): "other",
        ("stale", "sampler"): "other",
    }


@pytest.mark.slow
def test_check_computed_on_follows_the_upstream_of_any_artifact(tiny_run):
    root, p = tiny_run
    store = ArtifactStore(str(root))
    base = store.path(p["base_model"].ref)
    stats = p["stats.stale.sampler"].ref
    scores = check_computed_on(store, stats.key, load_state_dict(f"{base}/policy"), "w", "f")
    assert scores is not None and scores.key == stats.upstream[0]
    with pytest.raises(ValueError, match=r"^w \(model identity of scores \w+\): tensor '.+' differs .*; f$"):
        check_computed_on(store, stats.key, load_state_dict(f"{base}/stale"), "w", "f")
    assert check_computed_on(store, "0" * 24, {}, "w", "f") is None  # not in the store


@pytest.mark.slow
def test_the_external_trajectory_refuses_statistics_of_other_weights(tmp_path):
    """An external run whose first checkpoint is model.path passes with its own step-0 statistics; given the
    statistics of a checkpoint that differs in one float32 ulp of one tensor, it is refused naming that tensor."""
    from covgrad.rollouts.problems import build_char_tokenizer
    from storage.models import load_model
    from tasks.specs import plan
    from tasks.trajectory import trajectory_task
    from tests.helpers.pipeline import run_planned
    from tests.helpers.user import user_config, write_checkpoint

    a = write_checkpoint(tmp_path / "a")
    model = load_model(a)
    bump(model.get_parameter(UP), 7)
    model.save_pretrained(tmp_path / "b")
    build_char_tokenizer().save_pretrained(tmp_path / "b")
    series = tmp_path / "series"
    shutil.copytree(a, series / "step_000000")
    shutil.copytree(tmp_path / "b", series / "step_000001")
    task = tmp_path / "task.jsonl"
    external = {"trajectory.enabled": True, "trajectory.checkpoints": str(series)}
    cfg_a = user_config(tmp_path / "runs", a, task, **external)
    cfg_b = user_config(tmp_path / "runs", tmp_path / "b", task)
    p_a, p_b = plan(cfg_a), plan(cfg_b)
    before = {n for n in p_a if n not in ("trajectory", "report")}
    run_planned(cfg_a, before)
    run_planned(cfg_b, {n for n in p_b if p_b[n].ref.stage in ("base_model", "rollouts", "scores", "stats")})
    step = p_a["trajectory"]
    other = {**step.upstream, "stats": p_b["stats.policy.policy"].ref}
    with pytest.raises(ValueError) as err:
        trajectory_task.fn(step.ref, step.spec, other)
    msg = str(err.value)
    assert "the step-0 statistics were not computed on the first checkpoint" in msg and "\n" not in msg
    assert f"tensor {UP!r} differs" in msg and "set model.path to it" in msg
    assert trajectory_task.fn(step.ref, step.spec, step.upstream).computed
