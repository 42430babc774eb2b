"""The regime stages: each regime's fold (regime) and their statistics (regimes).

regime stage: one analysed post-training objective's per-sample gradients folded into moment state
(:class:`tasks.jobs.regime_fold.RegimeJob`: the regime's g_n through the scores machinery into a scores-layout
store, with its bound scalars). Their statistics: :mod:`tasks.regimes`.

The folds of one pass group (``tasks.specs.regime_pass_group``: the regimes over the same sampler's rollouts)
share one pass: the first of them to run also folds every other one whose artifact is incomplete and that no
other run is writing, and writes its completion marker (``pass_of`` names the fold that ran the pass). A
complete artifact is never recomputed, so a changed regime recomputes only its own fold.

regimes stage: per regime G, its bound, ρ, violations, cross-fit and overlap, and the cross-regime comparison.

Reads every ``regime.<name>`` fold (:mod:`tasks.regimes`) and the main scores' state: per regime G, se,
the bound a·√F with the policy's F, ρ, violations against a sampling allowance, the cross-fit, overlap
with top-q F (both random baselines), each tensor's share of the top sets, and the cross-regime comparison
(pairwise top-q overlap of |G|, cosines). Store ``regimes.zarr`` (storage/schema.py), tables
``regimes.{json,csv,md}``, ``overlap.{json,csv,md}``, ``pairs.{json,csv,md}``, ``tensors.{csv,md}``.
"""

from __future__ import annotations

import math
from contextlib import ExitStack
from typing import Any

import numpy as np
from prefect import task

from covgrad.layout import ParamLayout
from covgrad.moments import OVERLAP_Q, TopSets, Values, overlap_table
from covgrad.regimes import moment_mean_se, regime_block_stats
from covgrad.tables import to_csv, to_markdown
from storage.artifacts import ArtifactRef, ArtifactStore
from storage.schema import REGIMES, SCORES, annotate, create, param_chunk
from storage.stores.regimes import HEAD_FISHER, bound_a2, head_fisher, regime_gradient, state_rows
from tasks.common import StageResult, check_spec, progress_bar, run_stage
from tasks.jobs.regime_fold import RegimeJob
from tasks.specs import RegimeSpec, RegimeStatsSpec


def _fold_pass(store: ArtifactStore, ref: ArtifactRef, spec: RegimeSpec, upstream: dict[str, ArtifactRef]) -> Any:
    """Fold ``spec``'s regime and its incomplete pass members in one pass; mark the members complete."""
    lead = RegimeJob(store, ref, spec, upstream)
    with ExitStack() as stack:
        members, claims = [], []
        for m in spec.pass_with:
            if store.is_complete(m.ref) or store.busy(m.ref):  # cached, or another run is writing it
                continue
            stack.enter_context(store.lock(m.ref))
            if store.is_complete(m.ref):
                continue
            member = RegimeSpec.model_validate(m.spec)
            check_spec(m.ref, member)
            claims.append((m.ref, store.begin(m.ref, m.spec, resume=True)))
            members.append(RegimeJob(store, m.ref, member, m.upstream, lead=lead))
        infos = lead.run(progress_bar, members)
        for (r, claim), info in zip(claims, infos[1:], strict=True):
            store.complete(r, claim, {**(info or {}), "pass_of": spec.name})
    return infos[0]


@task(name="regime")
def regime_task(ref: ArtifactRef, spec: RegimeSpec, upstream: dict[str, ArtifactRef]) -> StageResult:
    """The per-sample gradients of regime ``spec.name`` folded into moment state, with its bound scalars (and
    those of its pass members, in the same pass)."""
    return run_stage(ref, spec, lambda store, r: _fold_pass(store, r, spec, upstream), resumable=True)


def _halves(count: np.ndarray, mean: np.ndarray, m2: np.ndarray, half: np.ndarray) -> list[tuple]:
    """(G, se, N) of all rows and of each half."""
    return [moment_mean_se(count, mean, m2)] + [
        moment_mean_se(count[half == h], mean[half == h], m2[half == h]) for h in (0, 1)
    ]


def _fisher(g: np.ndarray, se: np.ndarray, n: float) -> np.ndarray:
    """The uncentred mean(s²) from the mean and its standard error: Σ(s − m)²/N + m²."""
    return se * se * (n - 1) + g * g


def _bound_fisher(fold: Any, cols: slice, F: np.ndarray, F_h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The F of a regime's bound on the block ``cols``: the policy's F (and per half F_h), but on an LM head
    whose token Fisher the fold holds (a full-distribution regime, ``storage.stores.regimes.head_fisher``) that token
    Fisher at the fold's own rows, with which the bound holds in-sample exactly."""
    found = head_fisher(fold, cols)
    if found is None:
        return F, F_h
    at, tok, tok_h = found
    F, F_h = F.copy(), F_h.copy()
    F[at], F_h[:, at] = tok, tok_h
    return F, F_h


def _abs(arr: Any) -> Values:
    return Values(lambda a, b: np.abs(arr[a:b]), arr.shape[0])


def _stats(store: ArtifactStore, ref: ArtifactRef, spec: RegimeStatsSpec, up: dict[str, ArtifactRef]) -> dict[str, Any]:
    """Write the regimes store and tables: per regime, block by block of parameters, the statistics of
    :func:`covgrad.regimes.objectives.regime_block_stats`; then the overlap, tensor-share and pairwise tables."""
    sc = store.open_group(up["scores"], SCORES, mode="r")
    layout = ParamLayout.from_records(sc.attrs["tensors"])
    P, step = layout.P, param_chunk(layout.P) * 16
    folds = {name: store.open_group(up[f"regime.{name}"], SCORES, mode="r") for name in spec.names}
    g = store.open_group(ref, REGIMES, mode="w")
    F_arr = create(g, REGIMES, "F", (P,))
    arrays = {
        (stat, name): create(g, REGIMES, f"{stat}_{name}", (P,))
        for name in spec.names
        for stat in ("G", "se", "bound", "rho", "crossfit_ratio")
    }
    a2 = {name: bound_a2(f) for name, f in folds.items()}
    totals: dict[str, dict[str, Any]] = {
        n: {"violations": 0, "violations_beyond": 0, **{k: np.zeros(2) for k in ("ex", "exb", "def")}}
        for n in spec.names
    }
    max_rho = {n: math.nan for n in spec.names}
    N: dict[str, float] = {}
    C: dict[str, list[float]] = {}  # prompt groups: all, per half (fewer than 2: no standard error, no allowance)
    for a in range(0, P, step):
        cols = slice(a, min(P, a + step))
        main = _halves(*state_rows(sc, cols))
        F, F_h = _fisher(*main[0]), np.stack([_fisher(*main[1 + h]) for h in (0, 1)])
        F_arr[cols] = F
        for name, fold in folds.items():
            (G, se, n, c), *halves = regime_gradient(fold, cols)
            N[name], C[name] = n, [c, *(h[3] for h in halves)]
            G_h, se_h = np.stack([h[0] for h in halves]), np.stack([h[1] for h in halves])
            F_r, F_rh = _bound_fisher(fold, cols, F, F_h)
            a2_h = np.asarray(a2[name][1])
            out = regime_block_stats(G, se, F_r, a2[name][0], G_h, se_h, F_rh, a2_h, spec.allowance_z)
            for stat, values in (("G", G), ("se", se), ("bound", out["bound"]), ("rho", out["rho"])):
                arrays[stat, name][cols] = values
            arrays["crossfit_ratio", name][cols] = out["crossfit_ratio"]
            t = totals[name]
            t["violations"] += out["violations"]
            t["violations_beyond"] += out["violations_beyond"]
            t["ex"] += out["crossfit_exceed"]
            t["exb"] += out["crossfit_exceed_beyond"]
            t["def"] += out["crossfit_defined"]
            max_rho[name] = float(np.fmax(max_rho[name], out["max_abs_rho"]))  # NaN: undefined in every block
    rows, overlap, tensors = [], [], []
    qs = spec.qs
    i1 = int(np.argmin(np.abs(np.asarray(qs) - OVERLAP_Q)))
    top_F = TopSets(Values(lambda a, b: F_arr[a:b], P), layout, [qs[i1]])
    for _ in top_F.sweep():
        pass
    for name, fold in folds.items():
        t, rho = totals[name], np.abs(g[f"rho_{name}"][:])
        rho = rho[rho == rho]
        q50, q90, q99 = (float(np.quantile(rho, q)) if rho.size else math.nan for q in (0.5, 0.9, 0.99))
        G_norm = float(np.sqrt(np.sum(g[f"G_{name}"][:] ** 2)))
        rows.append(
            {
                "regime": name,
                "kind": fold.attrs["kind"],
                "sampler": fold.attrs["sampler"],
                "N": int(N[name]),
                "groups": int(C[name][0]),
                "a2": a2[name][0],
                "norm_G": G_norm,
                "violations": t["violations"],
                "violations_beyond_allowance": t["violations_beyond"] if C[name][0] >= 2 else None,
                "crossfit_frac_exceed_G_even": float(t["ex"][0] / max(t["def"][0], 1)),
                "crossfit_frac_exceed_G_odd": float(t["ex"][1] / max(t["def"][1], 1)),
                "crossfit_beyond_allowance": int(t["exb"].sum()) if min(C[name][1:]) >= 2 else None,
                "max_abs_rho": max_rho[name],
                "abs_rho_median": q50,
                "abs_rho_q90": q90,
                "abs_rho_q99": q99,
                "responses_mean_reward": fold.attrs.get("teacher_mean_reward"),
                "bound_token_fisher": (fold.attrs.get(HEAD_FISHER) or {}).get("tensor"),
            }
        )
        for row in overlap_table(Values(lambda a, b: F_arr[a:b], P), _abs(g[f"G_{name}"]), layout, qs):
            overlap.append({"regime": name, **row})
        top = TopSets(_abs(g[f"G_{name}"]), layout, [qs[i1]])
        for _ in top.sweep():
            pass
        total, total_F = max(int(top.counts["global"][0].sum()), 1), max(int(top_F.counts["global"][0].sum()), 1)
        for e, n, nf in zip(
            layout.entries, top.counts["global"][0].tolist(), top_F.counts["global"][0].tolist(), strict=True
        ):
            tensors.append(
                {
                    "regime": name,
                    "tensor": e.name,
                    "q": qs[i1],
                    "share_topG": n / total,
                    "share_topF": nf / total_F,
                    "numel_share": e.numel / P,
                }
            )
    pairs = []
    for i, a in enumerate(spec.names):
        for b in spec.names[i + 1 :]:
            Ga, Gb = g[f"G_{a}"][:], g[f"G_{b}"][:]
            den = float(np.linalg.norm(Ga) * np.linalg.norm(Gb))
            cosine = float(Ga @ Gb / den) if den > 0 else math.nan
            for row in overlap_table(_abs(g[f"G_{b}"]), _abs(g[f"G_{a}"]), layout, qs):
                pairs.append({"a": a, "b": b, "cosine": cosine, **row})
    for stem, table in (("regimes", rows), ("overlap", overlap), ("pairs", pairs)):
        store.write_json(ref, f"{stem}.json", table)
        if table:  # one regime has no pairs
            store.write_text(ref, f"{stem}.csv", to_csv(table))
            store.write_text(ref, f"{stem}.md", to_markdown(table))
    store.write_text(ref, "tensors.csv", to_csv(tensors))
    store.write_text(ref, "tensors.md", to_markdown(tensors))
    g.attrs.update({"tensors": sc.attrs["tensors"], "regimes": spec.names, "allowance_z": spec.allowance_z})
    annotate(g, REGIMES, layout)
    store.consolidate(ref, REGIMES)
    return {"regimes": spec.names}


@task(name="regimes")
def regimes_task(ref: ArtifactRef, spec: RegimeStatsSpec, upstream: dict[str, ArtifactRef]) -> StageResult:
    """Per-regime statistics and the cross-regime comparison (``upstream``: ``scores`` and ``regime.<name>``)."""
    return run_stage(ref, spec, lambda store, r: _stats(store, r, spec, upstream))
