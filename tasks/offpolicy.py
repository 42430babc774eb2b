"""offpolicy stage: the off-policy comparison, one row per stats artifact of the run.

A sampler that is not the policy has scores under two centerings, ``policy`` (∇ log p) and ``sampler``
(centered by the sampler's own μ), and so two stats artifacts. Each row holds one stats artifact's
zero-mean statistics, max |ρ|, bound violations, cross-fit exceedances and overlap at q = 1% (copied
from its scalars), ``kl_per_token`` = mean KL(μ ‖ p) per response token (recorded by the sampler-centered
scores, so both rows of a sampler show it; 0 for a sampler with μ = p), ``sampler_weights`` (``policy`` when
the sampler generated with bitwise the scored policy's weights, by their model identities; ``other``;
``unknown`` without a recorded identity), ``finding`` (the degenerate condition, or empty) and

    rel_diff_G = ‖G_sampler − G_policy‖₂ / ‖G_sampler‖₂

over the whole parameter axis for a sampler with both centerings (NaN for the policy itself), read in
blocks of ``block`` parameters with the sums of squares in float64, so memory holds two blocks, not P;
``rel_diff_stats``, the largest such difference over m, F, Fvar, G and Cov (the null test's number: ≈ 0
when μ ≡ p),

and the sampler–policy mismatch in the names RL stacks log (``covgrad.rollouts.mismatch``, verl's definitions) from the
sampled tokens' log-probabilities under the sampler (the rollouts' ``sampler_logp``) and under the policy
(recomputed teacher-forced by this stage, temperature 1): :data:`MISMATCH_COLUMNS`, the same on both rows of
a sampler (a property of its rollouts; ≈ 0 for the policy itself, up to the float differences between
generation and a teacher-forced forward; NaN for a dataset of responses, whose μ is unknown).

Store ``offpolicy.zarr`` (``storage.schema.OFFPOLICY_VARS``): one 1-D array per column along dim ``row``,
``sampler`` and ``centering`` as coordinates; the same rows as ``offpolicy.{json,csv,md}``.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from prefect import task

from covgrad.moments import BLOCK_CHUNKS, rel_diff
from covgrad.rollouts import SamplerSpec, mismatch_metrics
from covgrad.scores import sampled_token_logp
from covgrad.tables import to_csv, to_markdown
from storage.artifacts import ArtifactRef, ArtifactStore
from storage.identity import sampler_weights
from storage.models import load_models
from storage.schema import OFFPOLICY as STORE
from storage.schema import OFFPOLICY_TABLE, OFFPOLICY_VARS, ROLLOUTS, STATS, param_chunk, write
from storage.stores.rollouts import mu_known, require_mu
from tasks.common import StageResult, run_stage
from tasks.specs import Instance, OffPolicySpec, PolicySpec


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
                "rel_diff_stats": float("nan"),
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
            diffs = {name: rel_diff_G(pair[0][name], pair[1][name], block) for name in COMPARED}
            r["rel_diff_G"], r["rel_diff_stats"] = diffs["G"], float(np.max(list(diffs.values())))
    return rows


COMPARED = ("m", "F", "Fvar", "G", "Cov")
"""The statistics whose largest relative difference between a sampler's two centerings is ``rel_diff_stats``
(≈ 0 in the null test, μ ≡ p)."""


MISMATCH_COLUMNS = {
    "rollout_probs_diff_mean": "training/rollout_probs_diff_mean",
    "rollout_probs_diff_max": "training/rollout_probs_diff_max",
    "probs_pearson_corr": "training/rollout_actor_probs_pearson_corr",
    "verl_kl": "rollout_corr/kl",
    "k3_kl": "rollout_corr/k3_kl",
    "chi2_token": "rollout_corr/chi2_token",
    "chi2_seq": "rollout_corr/chi2_seq",
    "ppl_ratio": "rollout_corr/ppl_ratio",
}
"""Off-policy table column -> the key of ``covgrad.rollouts.mismatch.mismatch_metrics`` (verl's logged name)."""


def _marker(store: ArtifactStore, stage: str, key: str) -> dict[str, Any]:
    mark = store.marker(store.ref(stage, key))
    if mark is None:
        raise ValueError(f"offpolicy: the {stage} artifact {key} is missing or incomplete under {store.root}")
    return mark


def sampler_rollouts(store: ArtifactStore, stats_ref: ArtifactRef) -> tuple[ArtifactRef, ArtifactRef, PolicySpec]:
    """The rollouts and base_model refs behind a stats artifact (through its scores artifact's completion
    marker, ``stats_ref.upstream[0]``) and the scores' policy spec."""
    scores = _marker(store, "scores", stats_ref.upstream[0])
    found = {}
    for key in scores["upstream"]:
        for stage in ("rollouts", "base_model"):
            if store.marker(store.ref(stage, key)) is not None:
                found[stage] = store.ref(stage, key)
    if set(found) != {"rollouts", "base_model"}:
        key = stats_ref.upstream[0]
        raise ValueError(f"offpolicy: the scores artifact {key} lists no complete rollouts and base_model artifact")
    return found["rollouts"], found["base_model"], PolicySpec(**scores["config"]["policy"])


def policy_logp_of(store: ArtifactStore, rollouts: ArtifactRef, model: Any):
    """(sampler_logp, policy_logp, mask) (N, T) of a rollouts artifact: the stored log μ of the sampled tokens,
    the policy ``model``'s log p of them (one teacher-forced forward per batch, temperature 1), the scored
    positions."""
    ro = store.open_group(rollouts, ROLLOUTS, mode="r")
    require_mu(ro, "offpolicy")
    tokens, pl, rl = (torch.from_numpy(ro[k][:]) for k in ("tokens", "prompt_len", "response_len"))
    policy_logp = sampled_token_logp(model, tokens, pl, rl, SamplerSpec()).numpy()
    sampler_logp = ro["sampler_logp"][:].astype(np.float64)[:, : policy_logp.shape[1]]
    mask = np.arange(policy_logp.shape[1])[None, :] < rl.numpy()[:, None]
    return sampler_logp, policy_logp, mask


def add_mismatch_columns(
    store: ArtifactStore, spec: OffPolicySpec, upstream: dict[str, ArtifactRef], rows: list[dict[str, Any]]
) -> None:
    """Set :data:`MISMATCH_COLUMNS` and ``sampler_weights`` (``storage.identity.sampler_weights``) of every row
    (in place), computed once per sampler; NaN mismatch, and NaN ``kl_per_token``, for a dataset of responses
    (μ unknown)."""
    per_sampler: dict[str, dict[str, Any]] = {}
    models: dict[tuple[str, PolicySpec], Any] = {}  # every sampler's scores share one policy: loaded once
    for sampler, centering in spec.stats:
        if sampler not in per_sampler:
            stats_ref = upstream[str(Instance("stats", sampler, centering))]
            rollouts, base, policy = sampler_rollouts(store, stats_ref)
            weights = {"sampler_weights": sampler_weights(store, rollouts, store.ref("scores", stats_ref.upstream[0]))}
            if not mu_known(store.open_group(rollouts, ROLLOUTS, mode="r")):  # a dataset: μ unknown, so no KL
                per_sampler[sampler] = {**weights, **dict.fromkeys([*MISMATCH_COLUMNS, "kl_per_token"], float("nan"))}
                continue
            if (base.key, policy) not in models:
                models[base.key, policy] = load_models(store, base, "policy", policy)[0]
            metrics = mismatch_metrics(*policy_logp_of(store, rollouts, models[base.key, policy]))
            per_sampler[sampler] = {**weights, **{col: metrics[key] for col, key in MISMATCH_COLUMNS.items()}}
    for r in rows:
        r.update(per_sampler[r["sampler"]])
        r["finding"] = r.pop("finding")  # the text column stays last


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
        add_mismatch_columns(store, spec, upstream, rows)
        write_offpolicy(store, r, rows)
        return {"rel_diff_G": {x["sampler"]: x["rel_diff_G"] for x in rows if x["centering"] == "sampler"}}

    return run_stage(ref, spec, compute)
