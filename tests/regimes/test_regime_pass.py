"""The regime folds of one pass group (the same sampler's rollouts) run in one pass: each artifact byte-identical
to its fold run alone, the pass's members marked with the fold that ran it, a changed regime recomputing only
its own fold, a fold over the teacher's own samples in a pass of its own."""

import hashlib
import json
from pathlib import Path

from storage.artifacts import ArtifactStore
from tasks.specs import plan, regime_pass_group
from tests.helpers.pipeline import NO_OPTIONAL, run_planned, tiny_config

PAIR = {
    "rl": {"kind": "rl"},
    "distill": {"kind": "distill_reverse_kl", "teacher": "stale"},
    "klpen": {"kind": "rl_token", "kl_beta": 0.5, "reference": "stale", "advantages": "none"},
}
ON = {**NO_OPTIONAL, "scores.groups_per_batch": 1}


def _digests(store: Path) -> dict[str, str]:
    return {
        str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(store.rglob("*"))
        if p.is_file() and p.name != "zarr.json"
    }


def _attrs(store: Path) -> dict:
    return json.loads((store / "zarr.json").read_text())["attributes"]


def _upstream(cfg) -> set[str]:
    return {n for n in plan(cfg) if n.startswith(("base_model", "rollouts"))}


def test_one_pass_folds_every_regime_byte_identical_to_separate_folds(tmp_path):
    cfg = tiny_config(str(tmp_path / "pass"), **ON, regimes=PAIR)
    p = plan(cfg)
    assert {regime_pass_group(p[f"regime.{n}"].spec) for n in PAIR} == {("sampler", "policy")}
    assert [m.name for m in p["regime.rl"].spec.pass_with] == ["distill", "klpen"]
    run_planned(cfg, _upstream(cfg))
    res = run_planned(cfg, {f"regime.{n}" for n in PAIR})
    lead = next(n.removeprefix("regime.") for n in p if n.startswith("regime."))  # the first to run
    assert {n: r.computed for n, r in res.items()} == {f"regime.{n}": n == lead for n in PAIR}
    store = ArtifactStore(cfg.root)
    for name in PAIR:
        ref = p[f"regime.{name}"].ref
        assert store.is_complete(ref)
        alone_cfg = tiny_config(str(tmp_path / name), **ON, regimes={name: PAIR[name]})
        alone = plan(alone_cfg)[f"regime.{name}"]
        assert alone.ref.key == ref.key  # the pass is placement: the same artifact
        assert alone.spec.pass_with == []
        run_planned(alone_cfg, _upstream(alone_cfg) | {f"regime.{name}"})
        mine = Path(cfg.root) / ref.stage / ref.key / "scores.zarr"
        theirs = Path(alone_cfg.root) / alone.ref.stage / alone.ref.key / "scores.zarr"
        assert _digests(mine) == _digests(theirs), name
        assert _attrs(mine) == _attrs(theirs), name
        mark = store.marker(ref)
        assert mark.get("pass_of") == (None if name == lead else lead), name
    # a changed regime recomputes only its own fold; the others stay cached
    changed = tiny_config(
        str(tmp_path / "pass"), **ON, regimes={**PAIR, "distill": {**PAIR["distill"], "teacher_temperature": 0.7}}
    )
    res = run_planned(changed, {f"regime.{n}" for n in PAIR})
    assert {n: r.computed for n, r in res.items()} == {
        "regime.rl": False,
        "regime.distill": True,
        "regime.klpen": False,
    }


def test_teacher_samples_fold_alone():
    cfg = tiny_config(
        "/nonexistent",
        **ON,
        regimes={
            **PAIR,
            "sft": {"kind": "sft_drift", "teacher": "policy", "teacher_temperature": 0.5, "responses": "teacher"},
        },
    )
    p = plan(cfg)
    assert p["regime.sft"].spec.pass_with == []
    assert "sft" not in [m.name for m in p["regime.rl"].spec.pass_with]
