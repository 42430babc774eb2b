"""update_check stage: real REINFORCE steps from the policy against the masks the statistics predict.

Every (optimizer, precision, lr) cell of ``update_check`` trains a fresh copy of the policy (float32
weights rounded to bf16, so every cell starts at the same bf16 point) for max(steps) steps on the loss
``-mean_n(A_n · log p(y_n))`` and compares the parameters that changed after each of ``steps`` with
the top sets by F, |G|, |ρ|, random and small |w| and with the bf16 absorption and bound rules
(``covgrad.updates.check.update_grid``). F, G and ρ come from the main stats artifact over the same flat
parameter axis. A minibatch is ``scores.groups_per_batch`` whole prompt groups of the analysed
rollouts (the scores stage's batches); the rl cells skip the minibatches whose advantages are all 0
(``covgrad.updates.check.rl_minibatches``: no rl gradient; a warning counts them); ``fresh_minibatches`` cycles
through the others, otherwise every step reuses the first. The statistics describe all N samples, so the
SGD bound rule is exact (recall 1 at one fp32 step) only when one minibatch holds every sample;
``summary.json`` records whether it does.
An empty ``update_check.sgd_lrs`` uses, for each Adam lr, the SGD lr whose absorption rule predicts as
many changed parameters.

Files: ``grid.{csv,json}`` (one row per optimizer, precision, lr, steps; every column of
``update_grid``, NaN where a rule does not apply), ``grid.md`` (the main columns), ``summary.json`` (per
cell at one step: changed fraction, the best ranked predictor's Jaccard against random, the rules'
recall), and ``update.zarr`` holding the grid as (cell,) arrays, one per column, with optimizer,
precision, lr and steps as coordinates along ``cell`` and the tensor table as coordinates along ``tensor``
(``storage/schema.py``). Deterministic on CPU.

When the statistics record a degenerate condition (N < 2, no scored tokens, std(A) = 0) the predictions
are undefined (the top sets by |G| and ρ, the bound rule; and with A ≡ 0 the loss has no gradient), so
the stage takes no steps: ``summary.json`` and the attrs record the condition (``degenerate``), with no
grid.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from prefect import task

from covgrad.layout import ParamLayout, check_layout, select_parameters
from covgrad.tables import to_csv, to_markdown
from covgrad.updates import GRID_MD_COLUMNS, StepLoss, rl_minibatches, summarize, update_grid
from storage.artifacts import ArtifactRef, ArtifactStore
from storage.models import load_models
from storage.schema import REGIMES, ROLLOUTS, STATS, annotate, write
from storage.schema import UPDATE as STORE
from storage.stores.trajectory import fixed_batches
from tasks.common import StageResult, log, progress_bar, run_stage
from tasks.jobs.trajectory import step_loss
from tasks.specs import UpdateCheckSpec


def _compute(
    store: ArtifactStore, ref: ArtifactRef, spec: UpdateCheckSpec, up: dict[str, ArtifactRef]
) -> dict[str, Any]:
    st = store.open_group(up["stats"], STATS, mode="r")
    finding = st.attrs.get("degenerate")
    if finding:
        summary = {"degenerate": finding, "cells_at_one_step": [], "P": int(st.attrs["scalars"]["P"])}
        store.write_json(ref, "summary.json", summary)
        g = store.open_group(ref, STORE, mode="w")
        g.attrs.update({"tensors": st.attrs["tensors"], "summary": summary})
        annotate(g, STORE, ParamLayout.from_records(st.attrs["tensors"]))
        store.consolidate(ref, STORE)
        log.warning("update_check %s: no steps: %s", ref.key, finding)
        return {"degenerate": finding}
    ro = store.open_group(up["rollouts"], ROLLOUTS, mode="r")

    def load_policy() -> torch.nn.Module:
        """A fresh float32 copy of the policy, read again for every cell: no copy is kept between cells."""
        return load_models(store, up["base_model"], "policy", spec.policy)[0].float().eval()

    layout = select_parameters(load_policy(), spec.params)
    check_layout(layout, ParamLayout.from_records(st.attrs["tensors"]), "update_check")
    # each (P,) float64 statistic is read when update_grid evaluates it and dropped after (8 bytes × P each)
    F, G, rho = (lambda name=name: torch.from_numpy(st[name][:]) for name in ("F", "G", "rho"))
    scalars = st.attrs["scalars"]
    adv_rms = float(scalars["adv_rms"])  # √mean(A²), covgrad.moments.stats.adv_rms
    batches, no_gradient = rl_minibatches(fixed_batches(ro, spec.groups_per_batch, None))
    if no_gradient:
        log.warning(
            "update_check %s: %d of %d minibatches have advantage 0 for every sample (no rl gradient: minibatches "
            "%s); the rl cells step the other %d",
            ref.key,
            len(no_gradient),
            len(no_gradient) + len(batches),
            no_gradient[:8],
            len(batches),
        )
    uc = spec.settings
    n_lrs = {"adam": len(uc.adam_lrs), "sgd": len(uc.sgd_lrs or uc.adam_lrs)}
    cells = sum(n_lrs.get(o, len(uc.adam_lrs)) for o in uc.optimizers) * len(uc.precisions)
    with progress_bar("update_check", cells * (1 + len(spec.regimes)), "cell") as bar:
        rows = _grid(load_policy, bar, layout, batches, F, G, rho, adv_rms, uc)
        if spec.regimes:
            rows = [{"regime": "rl", **r} for r in rows]
            rows += _regime_rows(store, spec, up, load_policy, bar, layout, F, st.attrs["centering"])
    columns = list(dict.fromkeys(col for r in rows for col in r))  # SGD rows add the bound rule's columns
    rows = [{col: r.get(col, float("nan")) for col in columns} for r in rows]
    summary = summarize(rows, len(batches) == 1 and not no_gradient)
    summary.update({"P": layout.P, "N": int(ro["tokens"].shape[0]), "minibatches": len(batches)})
    summary["minibatches_without_rl_gradient"] = len(no_gradient)
    summary.update({"centering": st.attrs["centering"], "adv_rms": adv_rms})
    store.write_text(ref, "grid.csv", to_csv(rows))
    store.write_json(ref, "grid.json", rows)
    md = (("regime",) if spec.regimes else ()) + GRID_MD_COLUMNS
    store.write_text(ref, "grid.md", to_markdown([{col: r[col] for col in md} for r in rows]))
    store.write_json(ref, "summary.json", summary)
    g = store.open_group(ref, STORE, mode="w")
    for col in rows[0]:
        write(g, STORE, col, [r[col] for r in rows])
    g.attrs.update({"tensors": layout.to_records(), "summary": summary})
    annotate(g, STORE, layout)
    store.consolidate(ref, STORE)
    return {"cells": len(rows), "one_minibatch_holds_all_samples": summary["one_minibatch_holds_all_samples"]}


def _regime_rows(
    store: ArtifactStore,
    spec: UpdateCheckSpec,
    up: dict[str, ArtifactRef],
    load_policy: Any,
    bar: Any,
    layout: ParamLayout,
    F: Any,
    centering: str,
) -> list[dict[str, Any]]:
    """The grid of every configured regime, each stepping its own loss (``tasks.trajectory.step_loss``) on
    minibatches of its sampler's rollouts, against its G and ρ (the ``regimes`` statistics), the policy's F
    and its bound scalar a = √a² (rl: the main √mean A²; no bound rule for sft_sampled)."""
    rg = store.open_group(up["regimes"], REGIMES, mode="r")
    table = {r["regime"]: r for r in store.read_json(up["regimes"], "regimes.json")}
    rows: list[dict[str, Any]] = []
    for name, r in spec.regimes.items():
        sampler = r.sampler or spec.analysed
        ro = store.open_group(up["rollouts" if sampler == spec.analysed else f"rollouts.{sampler}"], ROLLOUTS, mode="r")
        loss = step_loss(store, up["base_model"], spec.policy, name, r, up.get("teacher"))
        a2 = table[name].get("a2")
        a = float("nan") if a2 is None or a2 != a2 else math.sqrt(a2)
        G, rho = (lambda v=f"{stat}_{name}": torch.from_numpy(rg[v][:]) for stat in ("G", "rho"))
        batches = fixed_batches(ro, spec.groups_per_batch, r)
        cells = _grid(load_policy, bar, layout, batches, F, G, rho, a, spec.settings, loss)
        rows += [{"regime": name, **c} for c in cells]
        log.info("update_check: regime %s (%s, centering %s): %d cells", name, r.kind, centering, len(cells))
    return rows


def _grid(
    load_policy: Any,
    bar: Any,
    layout: ParamLayout,
    batches: Any,
    F: Any,
    G: Any,
    rho: Any,
    adv_rms: float,
    uc: Any,
    loss: StepLoss | None = None,
) -> list[dict[str, Any]]:
    """``update_grid`` of the settings ``uc``, counting a finished cell on ``bar`` each time the next cell
    loads its fresh policy (``update_grid`` loads one for the common start, then one per cell)."""
    loads = 0

    def counted() -> torch.nn.Module:
        nonlocal loads
        if loads >= 2:
            bar.update(1)
        loads += 1
        return load_policy()

    return update_grid(
        counted,
        layout,
        batches,
        F,
        G,
        rho,
        adv_rms,
        optimizers=uc.optimizers,
        precisions=uc.precisions,
        adam_lrs=uc.adam_lrs,
        sgd_lrs=uc.sgd_lrs or None,
        steps=uc.steps,
        fresh_minibatches=uc.fresh_minibatches,
        seed=uc.seed,
        loss=loss,
    )


@task(name="update_check")
def update_check_task(ref: ArtifactRef, spec: UpdateCheckSpec, upstream: dict[str, ArtifactRef]) -> StageResult:
    """Optimizer steps on the analysed rollouts against the masks predicted by the main statistics."""
    return run_stage(ref, spec, lambda store, r: _compute(store, r, spec, upstream))
