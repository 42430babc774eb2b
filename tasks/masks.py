"""masks stage: exact top-q sets by F, |G| and |ρ|, overlap with honest baselines, bound masks.

Store ``masks.zarr``: ``{metric}_{scope}`` (q, param) bool masks for metric ∈ {F, absG, absrho} and
scope ∈ {global, per_tensor}; tables ``overlap.{csv,json,md}``, ``bound.{csv,json}``,
``tensors.{csv,md}`` (each tensor's share of the top sets) and ``summary.json`` (Spearman, q list).

When the statistics record a degenerate condition (N < 2, no scored tokens, std(A) = 0), the top set
by |G| (and by ρ, and the bound mask) is undefined, so the artifact holds only the ``q`` axis and the
condition (``degenerate`` in attrs and ``summary.json``): no masks, no overlap, bound or share tables.

Memory is bounded by blocks of the (param,) statistics, not P, except Spearman's sorted copy of one
metric (8 B × P; its ranks go to a temporary file in the artifact directory, 8 B × P, removed when
done): measured 1.69 GiB peak at P = 134.5M (``python -m benchmarks.masks``).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from prefect import task

from covgrad.layout import ParamLayout
from covgrad.moments import OVERLAP_Q, SCOPES, TopSets, Values, bound_mask_table, overlap_rows, spearman_blocked
from covgrad.tables import to_csv, to_markdown
from storage.artifacts import ArtifactRef, ArtifactStore
from storage.schema import MASKS as STORE
from storage.schema import STATS, annotate, create, write
from tasks.common import StageResult, log, run_stage
from tasks.specs import MasksSpec


def compute_masks(store: ArtifactStore, ref: ArtifactRef, spec: MasksSpec, up: ArtifactRef) -> dict[str, Any]:
    """Write the masks artifact ``ref`` from the stats artifact ``up``; return its provenance."""
    st = store.open_group(up, STATS, mode="r")
    finding = st.attrs.get("degenerate")
    if finding:
        return _no_masks(store, ref, st, spec.qs, finding)
    layout = ParamLayout.from_records(st.attrs["tensors"])
    scalars = st.attrs["scalars"]
    qs = spec.qs
    P = layout.P
    # (param,) statistics are read block by block, on every pass: memory holds a few blocks, the cuts
    # and, for Spearman, one sorted copy of F or |G| (8 B × P), not the arrays
    metrics = {
        "F": _blocks(st["F"]),
        "absG": _blocks(st["G"], absolute=True),
        "absrho": _blocks(st["rho"], absolute=True),
    }
    tops = {metric: TopSets(values, layout, qs) for metric, values in metrics.items()}
    g = store.open_group(ref, STORE, mode="w")
    write(g, STORE, "q", qs)
    arrays = {
        (metric, scope): create(g, STORE, f"{metric}_{scope}", (len(qs), P)) for metric in tops for scope in SCOPES
    }
    n_both = {scope: np.zeros(len(qs), dtype=np.int64) for scope in SCOPES}  # |topG ∩ topF|
    for swept in zip(*(t.sweep() for t in tops.values()), strict=True):
        masks = {}
        for metric, (start, by_scope) in zip(tops, swept, strict=True):
            for scope, mask in by_scope.items():  # (q, b) bool
                arrays[metric, scope][:, start : start + mask.shape[1]] = mask
            masks[metric] = by_scope
        for scope in SCOPES:
            n_both[scope] += np.count_nonzero(masks["F"][scope] & masks["absG"][scope], axis=1)
    overlap = overlap_rows(tops["absG"], tops["F"], n_both, layout)
    shares = _share_rows(tops, layout, qs)
    bound = bound_mask_table(scalars["std_A"], _blocks(st["Fvar"]), _blocks(st["Cov"], absolute=True), qs=qs)
    rho_s = spearman_blocked(metrics["F"], metrics["absG"], scratch=store.path(ref) if store.local else None)
    store.write_text(ref, "overlap.csv", to_csv(overlap))
    store.write_json(ref, "overlap.json", overlap)
    store.write_text(ref, "overlap.md", to_markdown(overlap))
    store.write_text(ref, "bound.csv", to_csv(bound))
    store.write_json(ref, "bound.json", bound)
    store.write_text(ref, "tensors.csv", to_csv(shares))
    store.write_text(ref, "tensors.md", to_markdown(shares))
    summary = {"spearman_F_absG": rho_s, "qs": qs, "P": P, "bound_recall_min": _min_recall(bound)}
    store.write_json(ref, "summary.json", summary)
    summary_attr = json.loads(json.dumps(summary, default=float))
    g.attrs.update({"summary": summary_attr, "tensors": st.attrs["tensors"], "degenerate": None})
    annotate(g, STORE, layout)
    store.consolidate(ref, STORE)
    return {"spearman_F_absG": rho_s}


def _blocks(arr: Any, absolute: bool = False) -> Values:
    """A (param,) zarr array of the stats store (or its absolute value), read in blocks."""
    read = (lambda a, b: np.abs(arr[a:b])) if absolute else (lambda a, b: arr[a:b])
    return Values(read, arr.shape[0])


def _share_rows(tops: dict[str, TopSets], layout: ParamLayout, qs: list[float]) -> list[dict[str, Any]]:
    """Each tensor's share of the global top sets by F and by |G| at the q nearest ``OVERLAP_Q`` (1%)."""
    i = int(np.argmin(np.abs(np.asarray(qs) - OVERLAP_Q)))
    rows = []
    for metric in ("F", "absG"):
        counts = tops[metric].counts["global"][i]  # (T,) int64
        total = max(int(counts.sum()), 1)
        for e, n in zip(layout.entries, counts.tolist(), strict=True):
            rows.append(
                {
                    "tensor": e.name,
                    "metric": metric,
                    "q": qs[i],
                    "count": n,
                    "share": n / total,
                    "numel_share": e.numel / layout.P,
                }
            )
    return rows


def _no_masks(store: ArtifactStore, ref: ArtifactRef, st: Any, qs: list[float], finding: str) -> dict[str, Any]:
    """The masks artifact of degenerate statistics: the ``q`` axis and the finding, nothing ranked."""
    g = store.open_group(ref, STORE, mode="w")
    write(g, STORE, "q", qs)
    summary = {"degenerate": finding, "qs": qs, "P": int(st.attrs["scalars"]["P"])}
    store.write_json(ref, "summary.json", summary)
    g.attrs.update({"summary": summary, "tensors": st.attrs["tensors"], "degenerate": finding})
    store.consolidate(ref, STORE)
    log.warning("masks %s: no masks: %s", ref.key, finding)
    return {"degenerate": finding}


def _min_recall(rows: list[dict[str, Any]]) -> float:
    recalls = [r["recall"] for r in rows if r["recall"] == r["recall"]]
    return float(min(recalls)) if recalls else float("nan")


@task(name="masks")
def masks_task(ref: ArtifactRef, spec: MasksSpec, upstream: dict[str, ArtifactRef]) -> StageResult:
    """Top-q masks and overlap tables from the main stats artifact ``upstream["stats"]``."""
    return run_stage(ref, spec, lambda store, r: compute_masks(store, r, spec, upstream["stats"]))
