"""The report's regimes section: per regime G, bound, ρ and violations, overlap with top F, and the
cross-regime comparison, read from the ``regimes`` artifact's tables (tasks/regimes.py); nothing recomputed."""

from __future__ import annotations

from typing import Any

from covgrad.report.document import Report

SUMMARY = (
    "regime",
    "kind",
    "sampler",
    "N",
    "groups",
    "a2",
    "norm_G",
    "violations",
    "violations_beyond_allowance",
    "crossfit_frac_exceed_G_even",
    "crossfit_beyond_allowance",
    "max_abs_rho",
    "abs_rho_median",
    "abs_rho_q99",
    "bound_token_fisher",
)


def _at(rows: list[dict[str, Any]], q: float) -> list[dict[str, Any]]:
    """The global-scope rows at the table's q nearest ``q``."""
    qs = sorted({r["q"] for r in rows})
    if not qs:
        return []
    near = min(qs, key=lambda x: abs(x - q))
    return [r for r in rows if r["q"] == near and r["scope"] == "global"]


def regimes(report: Report, run: Any) -> None:
    """Per-regime statistics and the cross-regime overlap at q ≈ 1% (only when the run has regimes)."""
    if "regimes" not in run.refs:
        return
    report.blocks.append(("h2", "Regimes"))
    if not run.has("regimes"):
        report.blocks.append(("p", "Regimes: skipped, regimes is missing or incomplete in this run."))
        return
    rows = run.json("regimes", "regimes.json")
    report.numbers["regimes"] = rows
    report.blocks.append(
        (
            "p",
            "Each regime's G = mean g_n, its bound a·√F (F the policy's Fisher; on the tensor named in "
            "bound_token_fisher, its token Fisher at the regime's rows, with which the bound holds in-sample), "
            "ρ = G / bound, and the coordinates over the bound, in-sample and beyond a sampling allowance of 3 "
            "standard errors clustered by prompt (the samples of one prompt are not independent). The cross-fit "
            "takes G from one half of the prompt groups and F from the other.",
        )
    )
    report.blocks.append(("table", [{k: r.get(k) for k in SUMMARY} for r in rows]))
    overlap = _at(run.json("regimes", "overlap.json"), 0.01)
    if overlap:
        keep = ("regime", "q", "overlap", "random", "per_tensor_random")
        report.blocks.append(("p", "Overlap of each regime's top-q |G| with top-q F:"))
        report.blocks.append(("table", [{k: r[k] for k in keep} for r in overlap]))
    pairs = _at(run.json("regimes", "pairs.json"), 0.01)
    if pairs:
        keep = ("a", "b", "cosine", "q", "overlap", "random", "per_tensor_random")
        report.blocks.append(("p", "Cross-regime: overlap of the top-q |G| sets of each pair of regimes:"))
        report.blocks.append(("table", [{k: r[k] for k in keep} for r in pairs]))
