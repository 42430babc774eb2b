"""masks stage: exact top-q sets by F, |G| and |ρ|, overlap with honest baselines, bound masks.

Store ``masks.zarr``: ``{metric}_{scope}`` (q, param) bool masks for metric ∈ {F, absG, absrho} and
scope ∈ {global, per_tensor}; tables ``overlap.{csv,json,md}``, ``bound.{csv,json}``,
``tensors.{csv,md}`` (each tensor's share of the top sets) and ``summary.json`` (Spearman, q list).

When the statistics record a degenerate condition (N < 2, no scored tokens, std(A) = 0), the top set
by |G| (and by ρ, and the bound mask) is undefined, so the artifact holds only the ``q`` axis and the
condition (``degenerate`` in attrs and ``summary.json``): no masks, no overlap, bound or share tables.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from prefect import task

from covgrad.layout import ParamLayout
from covgrad.topk import bound_mask_table, overlap_table, spearman, topk_global, topk_per_tensor
from storage.artifacts import ArtifactRef, ArtifactStore
from storage.schema import MASKS as STORE
from storage.schema import STATS, annotate, write
from storage.tables import to_csv, to_markdown
from tasks.common import StageResult, log, run_stage
from tasks.specs import MasksSpec


def _compute(store: ArtifactStore, ref: ArtifactRef, spec: MasksSpec, up: ArtifactRef) -> dict[str, Any]:
    st = store.open_group(up, STATS, mode="r")
    finding = st.attrs.get("degenerate")
    if finding:
        return _no_masks(store, ref, st, spec.qs, finding)
    layout = ParamLayout.from_records(st.attrs["tensors"])
    scalars = st.attrs["scalars"]
    # (param,) arrays are read when needed and released after: memory holds a few of them, not all seven
    metrics = {"F": lambda: st["F"][:], "absG": lambda: np.abs(st["G"][:]), "absrho": lambda: np.abs(st["rho"][:])}
    qs = spec.qs
    P = layout.P
    g = store.open_group(ref, STORE, mode="w")
    write(g, STORE, "q", qs)
    share_rows = []
    for metric, read in metrics.items():
        values = read()
        for scope in ("global", "per_tensor"):
            mask = np.zeros((len(qs), P), dtype=bool)
            for i, q in enumerate(qs):
                idx = topk_global(values, q) if scope == "global" else topk_per_tensor(values, layout, q)
                mask[i, idx] = True
            write(g, STORE, f"{metric}_{scope}", mask)
            if scope == "global" and metric in ("F", "absG"):
                i = int(np.argmin(np.abs(np.asarray(qs) - 0.01)))
                total = max(int(mask[i].sum()), 1)
                for e in layout.entries:
                    n = int(mask[i, e.offset : e.offset + e.numel].sum())
                    share_rows.append(
                        {
                            "tensor": e.name,
                            "metric": metric,
                            "q": qs[i],
                            "count": n,
                            "share": n / total,
                            "numel_share": e.numel / P,
                        }
                    )
        del values
    F, absG = st["F"][:], np.abs(st["G"][:])
    overlap = overlap_table(F, absG, layout, qs)
    rho_s = spearman(F, absG)
    del F, absG
    bound = bound_mask_table(scalars["std_A"], st["Fvar"][:], np.abs(st["Cov"][:]), qs=qs)
    store.write_text(ref, "overlap.csv", to_csv(overlap))
    store.write_json(ref, "overlap.json", overlap)
    store.write_text(ref, "overlap.md", to_markdown(overlap))
    store.write_text(ref, "bound.csv", to_csv(bound))
    store.write_json(ref, "bound.json", bound)
    store.write_text(ref, "tensors.csv", to_csv(share_rows))
    store.write_text(ref, "tensors.md", to_markdown(share_rows))
    summary = {"spearman_F_absG": rho_s, "qs": qs, "P": P, "bound_recall_min": _min_recall(bound)}
    store.write_json(ref, "summary.json", summary)
    summary_attr = json.loads(json.dumps(summary, default=float))
    g.attrs.update({"summary": summary_attr, "tensors": st.attrs["tensors"], "degenerate": None})
    annotate(g, STORE, layout)
    store.consolidate(ref, STORE)
    return {"spearman_F_absG": rho_s}


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
    return run_stage(ref, spec, lambda store, r: _compute(store, r, spec, upstream["stats"]))
