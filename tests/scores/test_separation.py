"""Sample separation proved for the whole model: a module that mixes the samples of a batch (after the gate and up
projections of a Llama MLP, in a Mixtral router that views its logits over the flattened batch, right after the
input embeddings) gives every tensor upstream of it rows that take other samples' objectives, while their sums still
match the batched gradient. The checked pass (library and preflight) refuses exactly those tensors in one line, with
a selection that runs and is exact against the one-backward-per-sample loop through the batched float64 forward (a
sequence alone is another function of a model that mixes); a model that keeps the samples apart passes the probe.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

import covgrad.scores.engine as engine
from covgrad.layout import ParamLayout, select_parameters
from covgrad.scores.preflight import check_model
from covgrad.scores.tracing import RefusalError
from tests.helpers.persample import (
    BATCH,
    MIXING_CLASSES,
    MIXING_MODELING,
    hook_scores,
    llama,
    make_batch,
    mixing_model,
    naive_scores,
    right_padded,
)


def upstream(plant: str, layout: ParamLayout) -> set[str]:
    """The selected tensors whose gradient flows through the ``plant``'s mixing (used before it in the forward)."""
    if plant == "embedding":
        return {"model.embed_tokens.embed.weight"}
    after = ("model.layers.1.mlp.down_proj.", "model.layers.1.mlp.experts.", "model.norm.", "lm_head.")
    return {n for n in layout.names if not n.startswith(after)}


def proposal(msg: str) -> list[str]:
    """The ``model.params`` selection a one-line refusal proposes."""
    assert "\n" not in msg and "model.params = " in msg, msg
    return ast.literal_eval(msg.split("model.params = ")[1])


def worst(layout: ParamLayout, got: torch.Tensor, ref: torch.Tensor) -> tuple[float, str]:
    """Largest per-tensor ‖got − ref‖ / ‖ref‖."""
    return max(
        (
            float((got[:, e.offset : e.offset + e.numel].double() - ref[:, e.offset : e.offset + e.numel]).norm())
            / float(ref[:, e.offset : e.offset + e.numel].norm()),
            e.name,
        )
        for e in layout.entries
    )


@pytest.mark.parametrize(("plant", "tied"), [("mlp", False), ("router", False), ("embedding", True)])
def test_mixing_refused_by_the_checked_pass_with_an_exact_proposal(plant, tied):
    model = mixing_model(plant, tied)
    layout = select_parameters(model)
    batch = make_batch(60, **BATCH)
    with pytest.raises(RefusalError, match=r"mixes the samples") as info:
        hook_scores(model, layout, batch)
    msg = str(info.value)
    assert set(info.value.reasons) == upstream(plant, layout), sorted(info.value.reasons)
    assert all(msg.count(f"'{name}'") == 1 for name in info.value.reasons), msg
    kept = select_parameters(model, proposal(msg))
    assert set(kept.names) == set(layout.names) - upstream(plant, layout)
    got = hook_scores(model, kept, batch)
    err, where = worst(kept, got, naive_scores(mixing_model(plant, tied).double(), kept, batch, batched=True))
    assert err < 1e-5, (err, where)


def mixing_dir(path: Path, plant: str) -> Path:
    """The ``plant`` model saved as a 2-layer model directory with its remote code."""
    mixing_model(plant).save_pretrained(path)
    (path / "modeling_mix.py").write_text(MIXING_MODELING)
    config = json.loads((path / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": f"modeling_mix.{MIXING_CLASSES[plant]}"}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("plant", ["mlp", "router", "embedding"])
def test_mixing_refused_in_preflight_with_a_proposal_that_runs(tmp_path, plant):
    path = str(mixing_dir(tmp_path, plant))
    with pytest.raises(ValueError, match=r"^preflight .*mixes the samples") as info:
        check_model(path, None, trust_remote_code=True)
    msg = str(info.value)
    layout = select_parameters(mixing_model(plant))
    named = {n for n in layout.names if f"'{n}'" in msg.split("model.params = ")[0]}
    assert named == upstream(plant, layout), sorted(named)
    assert all(msg.count(f"'{n}'") == 1 for n in named), msg
    selection = proposal(msg)
    assert set(select_parameters(mixing_model(plant), selection).names) == set(layout.names) - named
    check_model(path, selection, trust_remote_code=True)


@pytest.mark.parametrize(("tied", "padding"), [(False, "left"), (True, "left"), (False, "right"), (True, "right")])
def test_samples_kept_apart_pass_the_probe(monkeypatch, tied, padding):
    found = []
    probe = engine.separation
    monkeypatch.setattr(engine, "separation", lambda *args: found.append(probe(*args)) or found[-1])
    model = llama(tied)
    layout = select_parameters(model)
    batch = make_batch(61, **BATCH)
    batch = right_padded(batch) if padding == "right" else batch
    got = hook_scores(model, layout, batch)
    assert found == [None]
    err, where = worst(layout, got, naive_scores(llama(tied).double(), layout, batch).double())
    assert err < 1e-5, (err, where)


def test_self_check_fails_on_mixing_rows_when_nothing_locates_it(monkeypatch):
    """With the location turned off, the self-check's own comparison of a sample's rows fails the pass: the sums
    alone match."""
    monkeypatch.setattr(engine, "locate_mixing", lambda *args: [])
    model = mixing_model("mlp")
    with pytest.raises(ValueError, match=r"self-check failed .*sample \d's per-sample row differs"):
        hook_scores(model, select_parameters(model), make_batch(62, **BATCH))
