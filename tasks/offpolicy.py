"""offpolicy stage: the off-policy comparison, one row per stats artifact of the run.

A sampler that is not the policy has scores under two centerings, ``policy`` (∇ log p) and ``sampler``
(centered by the sampler's own μ), and so two stats artifacts. Each row holds one stats artifact's
zero-mean statistics, max |ρ|, bound violations, cross-fit exceedances and overlap at q = 1% (copied
from its scalars), ``kl_per_token`` = mean KL(μ ‖ p) per response token (recorded by the sampler-centered
scores, so both rows of a sampler show it; 0 for a sampler with μ = p), ``finding`` (the degenerate
condition, or empty) and

    rel_diff_G = ‖G_sampler − G_policy‖₂ / ‖G_sampler‖₂

over the whole parameter axis for a sampler with both centerings (NaN for the policy itself), read in
blocks of ``block`` parameters with the sums of squares in float64, so memory holds two blocks, not P.

Store ``offpolicy.zarr`` (``storage.schema.OFFPOLICY_VARS``): one 1-D array per column along dim ``row``,
``sampler`` and ``centering`` as coordinates; the same rows as ``offpolicy.{json,csv,md}``.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from prefect import task

from covgrad.stats import BLOCK_CHUNKS, rel_diff
from covgrad.tables import to_csv, to_markdown
from storage.artifacts import ArtifactRef, ArtifactStore
from storage.schema import OFFPOLICY as STORE
from storage.schema import OFFPOLICY_TABLE, OFFPOLICY_VARS, STATS, param_chunk, write
from tasks.common import StageResult, run_stage
from tasks.specs import Instance, OffPolicySpec


def offpolicy_rows(
    store: ArtifactStore, spec: OffPolicySpec, upstream: dict[str, ArtifactRef], block: int
) -> list[dict[str, Any]]:
    """The off-policy table (columns: ``storage.schema.OFFPOLICY_VARS``) of the stats artifacts that
    ``spec`` lists, in its order (``upstream``: their refs by instance name); ``rel_diff_G`` reads ``block``
    parameters at a time."""
    groups: dict[tuple[str, str], Any] = {}
    rows: list[dict[str, Any]] = []
    for sampler, centering in spec.stats:
        g = store.open_group(upstream[str(Instance("stats", sampler, centering))], STATS, mode="r")
        groups[sampler, centering] = g
        s = g.attrs["scalars"]
        rows.append(
            {
                "sampler": sampler,
                "centering": centering,
                "zero_mean_trace": float(s["zero_mean_trace"]),
                "zero_mean_coord": float(s["zero_mean_coord"]),
                "rel_diff_G": float("nan"),
                "kl_per_token": float(s.get("kl_sampler_policy_per_token", float("nan"))),
                "max_abs_rho": float(s["max_abs_rho"]),
                "bound_violations": int(s["bound_violations"]),
                "crossfit_frac_exceed": float(s["crossfit_even_F_odd_G_frac_exceed"]),
                "overlap_1pct": float(s["overlap_1pct"]),
                "finding": g.attrs.get("degenerate") or "",
            }
        )
    kl = {r["sampler"]: r["kl_per_token"] for r in rows if r["centering"] == "sampler"}
    for r in rows:
        r["kl_per_token"] = kl.get(r["sampler"], 0.0)  # a property of the rollouts; 0 on-policy (μ = p)
        pair = (groups.get((r["sampler"], "sampler")), groups.get((r["sampler"], "policy")))
        if None not in pair:
            r["rel_diff_G"] = rel_diff_G(pair[0]["G"], pair[1]["G"], block)
    return rows


def rel_diff_G(G_sampler: Any, G_policy: Any, block: int) -> float:
    """‖G_sampler − G_policy‖ / ‖G_sampler‖ of two (P,) arrays (zarr or numpy), read ``block`` at a time."""
    P = G_sampler.shape[0]
    if G_policy.shape != (P,):
        raise ValueError(f"G arrays of one sampler differ in shape: {G_sampler.shape} and {G_policy.shape}")
    return rel_diff((G_sampler[j : j + block], G_policy[j : j + block]) for j in range(0, P, block))


def write_offpolicy(store: ArtifactStore, ref: ArtifactRef, rows: list[dict[str, Any]]) -> None:
    """The table ``rows`` as ``offpolicy.zarr`` (one array per column along ``row``) and as json, csv, md."""
    g = store.open_group(ref, STORE, mode="w")
    for name in OFFPOLICY_VARS:
        write(g, STORE, name, np.asarray([r[name] for r in rows]))  # (rows,)
    store.write_text(ref, f"{OFFPOLICY_TABLE}.json", json.dumps(rows, indent=1))  # columns in table order
    store.write_text(ref, f"{OFFPOLICY_TABLE}.csv", to_csv(rows))
    store.write_text(ref, f"{OFFPOLICY_TABLE}.md", to_markdown(rows))
    store.consolidate(ref, STORE)


@task(name="offpolicy")
def offpolicy_task(ref: ArtifactRef, spec: OffPolicySpec, upstream: dict[str, ArtifactRef]) -> StageResult:
    """The off-policy table of every stats artifact of the run (``upstream``: by instance name)."""

    def compute(store: ArtifactStore, r: ArtifactRef) -> dict[str, Any]:
        P = int(store.open_group(next(iter(upstream.values())), STATS, mode="r").attrs["scalars"]["P"])
        rows = offpolicy_rows(store, spec, upstream, BLOCK_CHUNKS * param_chunk(P))  # the stats stage's blocks
        write_offpolicy(store, r, rows)
        return {"rel_diff_G": {x["sampler"]: x["rel_diff_G"] for x in rows if x["centering"] == "sampler"}}

    return run_stage(ref, spec, compute)
