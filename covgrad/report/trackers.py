"""A run's scalars as experiment trackers take them: (tag, step, value) triples under ``covgrad/``, from the
report's numbers (``report.json``'s ``numbers``) and the trajectory stores; nothing recomputed.
``flows.trackers`` writes them.

Tags (docs/formats.md):

- headline, at step 0 (the policy the step-0 statistics describe): ``overlap_1pct`` (the global overlap of top
  |G| and top F at the q nearest 1%) with ``_lo`` / ``_hi`` (its 95% interval), ``_random`` and
  ``_per_tensor_random`` (its baselines); ``spearman_F_absG`` and ``max_abs_rho`` with ``_lo`` / ``_hi``;
  ``bound_violations``; ``zero_mean_trace`` and ``zero_mean_coord`` with ``_null_lo`` / ``_null_hi`` (the zero-mean
  test's 95% band) and ``_z`` (its cross-fit z); per regime ``regimes/<name>/{overlap_1pct,max_abs_rho,violations}``;
- per trajectory (``trajectory/`` or ``trajectory/<cell>/``), at each step of the run (the trainer's step for an
  external run): ``frac_changed_step``, ``frac_changed_cum``, ``jaccard_prev``, every predictor's and rule's
  precision ``{step,cum}_<predictor>_precision`` (and the rules' recall), the logged columns (``lr``, ``loss``,
  ``grad_norm``, ``reward``, ``kl``, ``mismatch_*``) where finite, and ``d_k/k<k>`` at the step each window starts.

A value that is absent or not finite is left out.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from covgrad.report.sections import RunSource
from covgrad.report.trajectory import STORE, instances

PREFIX = "covgrad"
ONE_PERCENT = 0.01
PER_STEP = ("lr", "loss", "grad_norm", "reward", "kl")  # the trajectory store's logged (step,) columns
RULE_RECALL = re.compile(r"(step|cum)_(absorb|bound|drift_rule)_recall")  # rules: precision ≠ recall
PRECISION = re.compile(r"(step|cum)_\w+_precision")


class Scalar(NamedTuple):
    """One tracker point: ``tag`` (``covgrad/...``), ``step`` (the x axis) and ``value``."""

    tag: str
    step: int
    value: float


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _nearest(rows: list[dict[str, Any]], q: float = ONE_PERCENT) -> dict[str, Any] | None:
    """The global-scope row of ``rows`` (each with ``q`` and ``scope``) at the q nearest ``q``, or None."""
    rows = [r for r in rows if r.get("scope") == "global"]
    return min(rows, key=lambda r: abs(math.log(r["q"] / q))) if rows else None


def headline_scalars(numbers: Mapping[str, Any], regime_overlap: list[dict[str, Any]] | None = None) -> list[Scalar]:
    """The headline scalars of ``numbers`` (the report's) at step 0, and per regime the overlap at q ≈ 1% of
    ``regime_overlap`` (the regimes artifact's ``overlap.json`` rows) beside its row of ``numbers["regimes"]``."""
    iv = numbers.get("intervals") or {}
    values: dict[str, Any] = {}
    row = _nearest(numbers.get("overlap") or [])
    if row is not None:
        by_q = {str(q): v for q, v in (iv.get("overlap") or {}).items()}  # JSON keys are text, the report's floats
        lo_hi = by_q.get(str(row["q"])) or (None, None)
        values |= {
            "overlap_1pct": row["overlap"],
            "overlap_1pct_lo": lo_hi[0],
            "overlap_1pct_hi": lo_hi[1],
            "overlap_1pct_random": row["random"],
            "overlap_1pct_per_tensor_random": row["per_tensor_random"],
        }
    for key in ("spearman_F_absG", "max_abs_rho"):
        lo_hi = iv.get(key) or (None, None)
        values |= {key: numbers.get(key), f"{key}_lo": lo_hi[0], f"{key}_hi": lo_hi[1]}
    values["bound_violations"] = numbers.get("bound_violations")
    for k in ("trace", "coord"):
        band = iv.get(f"null_band_{k}") or (None, None)
        values |= {f"zero_mean_{k}": numbers.get(f"zero_mean_{k}"), f"zero_mean_{k}_null_lo": band[0]}
        values |= {f"zero_mean_{k}_null_hi": band[1], f"zero_mean_{k}_z": iv.get(f"z_{k}")}
    for r in numbers.get("regimes") or []:
        at = f"regimes/{r['regime']}"
        values |= {f"{at}/max_abs_rho": r.get("max_abs_rho"), f"{at}/violations": r.get("violations")}
        own = _nearest([o for o in regime_overlap or [] if o.get("regime") == r["regime"]])
        values[f"{at}/overlap_1pct"] = None if own is None else own["overlap"]
    return [Scalar(f"{PREFIX}/{tag}", 0, float(v)) for tag, v in values.items() if _finite(v)]


def trajectory_scalars(run: RunSource, name: str) -> list[Scalar]:
    """The per-step scalars of trajectory instance ``name`` (module docstring), at the run's own steps."""
    g = run.group(name, STORE)
    at = f"{PREFIX}/{name.replace('.', '/')}"
    steps = np.asarray(g["step"][:], dtype=np.int64)
    P = int(g.attrs["summary"]["P"])
    series: dict[str, np.ndarray] = {
        "frac_changed_step": np.asarray(g["n_changed_step"][:]) / P,
        "frac_changed_cum": np.asarray(g["n_changed_cum"][:]) / P,
        "jaccard_prev": np.asarray(g["jaccard_prev"][:], dtype=np.float64),
    }
    names = sorted(g.array_keys())
    for key in names:
        if PRECISION.fullmatch(key) or RULE_RECALL.fullmatch(key) or key in PER_STEP or key.startswith("mismatch_"):
            series[key] = np.asarray(g[key][:], dtype=np.float64)
    out = [Scalar(f"{at}/{tag}", int(t), float(v)) for tag, y in series.items() for t, v in zip(steps, y, strict=True)]
    if "dk" in names:
        start = int(g.attrs["summary"].get("trainer_steps", [0])[0])
        rows = [start, *steps.tolist()]  # window t starts at row t (0: the start weights)
        windows = np.asarray(g["window"][:], dtype=np.int64)
        dk = np.asarray(g["dk"][:], dtype=np.float64)
        for i, k in enumerate(np.asarray(g["k"][:]).tolist()):
            out += [Scalar(f"{at}/d_k/k{k}", rows[w], float(v)) for w, v in zip(windows, dk[i], strict=True)]
    return [s for s in out if math.isfinite(s.value)]


def run_scalars(run: RunSource, numbers: Mapping[str, Any]) -> list[Scalar]:
    """Every scalar of a run: the headline from ``numbers`` (the report's) with the regimes' overlap, and each
    complete trajectory's per-step scalars."""
    overlap = run.json("regimes", "overlap.json") if run.has("regimes") else None
    out = headline_scalars(numbers, overlap)
    for name in instances(run):
        if run.has(name):
            out += trajectory_scalars(run, name)
    return out
