"""The report's sections, each read from the stores of one run: headline, off-policy, token Fisher,
update check.

Every number shown was computed and stored by the stage that owns it (stats, masks, offpolicy, tokens,
update_check); a section only selects, labels and plots.

Instances whose artifact is absent or incomplete are listed in ``Report.missing`` and their
sections are replaced by a note; everything else still renders. Optional stages (tokens,
update_check) are read only when the run has them.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

import numpy as np

from covgrad.config import PipelineConfig
from covgrad.report.document import Report, cell, finite
from covgrad.report.plots import (
    plot_fisher_vs_grad,
    plot_overlap,
    plot_tensor_shares,
    plot_token_trace,
    plot_update_check,
    plot_zero_mean,
)
from covgrad.report.regimes import regimes as regimes_section

STATS = "stats.zarr"
TOKENS = "tokens.zarr"
HEADLINE_NOTES = {
    "N": "samples",
    "P": "parameters analysed",
    "std_A": "advantage std (1/N)",
    "max_abs_rho": "max |Cov| / (std(A)·√Fvar)",
    "bound_violations": "in-sample, |Cov| > std(A)·√Fvar",
    "crossfit_frac_exceed_even_F_odd_G": "fraction with ratio > 1, F even groups, G odd",
    "crossfit_frac_exceed_odd_F_even_G": "fraction with ratio > 1, F odd groups, G even",
    "zero_mean_trace": "N·‖m‖² / tr Var(s), ≈ 1 if E[s] = 0",
    "zero_mean_coord": "mean_i N·m_i² / Var_i, ≈ 1 if E[s] = 0",
}


class RunSource(Protocol):
    """Read access to the complete artifacts of one run, by instance name (``storage.reports.RunArtifacts``)."""

    refs: dict[str, Any]
    missing: list[str]

    def has(self, instance: str) -> bool:
        """True when the run has ``instance`` and its artifact is complete."""
        ...

    def group(self, instance: str, name: str) -> Any:
        """The zarr group ``name`` of ``instance``, read-only."""
        ...

    def json(self, instance: str, name: str) -> Any:
        """The JSON file ``name`` of ``instance``."""
        ...

    def csv(self, instance: str, name: str) -> list[dict[str, str]]:
        """The rows of the CSV file ``name`` of ``instance``."""
        ...


def model_label(config: dict[str, Any]) -> str:
    """The analysed model in words: its directory, or the demo Llama's size."""
    model = config.get("model", {})
    if model.get("path"):
        return str(model["path"])
    demo = model.get("demo", {})
    return f"demo Llama (hidden {demo.get('hidden_size')}, {demo.get('num_layers')} layer(s))"


def render_report(run: RunSource, config: dict[str, Any], name: str, main: str) -> Report:
    """Build the report of one run from its stores alone.

    Args:
        run: the run's artifacts by instance name.
        config: the pipeline config as JSON (as recorded in the run index).
        name: the run's name, for the title.
        main: the instance of the main statistics (``stats.<analyse>.<centering>``).

    Returns:
        The rendered :class:`Report`; instances that are absent or incomplete are in ``missing`` and
        their sections hold a note instead of numbers.
    """
    cfg = PipelineConfig.model_validate(config)
    report = Report(title=f"covgrad report: {name}", missing=list(run.missing))
    report.numbers["main_stats"] = main
    report.blocks.append(("p", f"Model: {model_label(config)}. Main statistics: {main}."))
    if report.missing:
        report.blocks.append(("p", f"Missing or incomplete artifacts: {', '.join(report.missing)}."))
    headline(report, run, cfg, main)
    off_policy(report, run)
    tokens(report, run)
    update_check(report, run)
    regimes_section(report, run)
    return report


def _skip(report: Report, what: str, instance: str) -> None:
    report.blocks.append(("p", f"{what}: skipped, {instance} is missing or incomplete in this run."))


def headline(report: Report, run: RunSource, cfg: PipelineConfig, main: str) -> None:
    """The headline table (main statistics and masks), the overlap table and the three main plots."""
    report.blocks.append(("h2", "Headline"))
    rows: list[dict[str, Any]] = [
        {"quantity": "model", "value": model_label(cfg.model_dump(mode="json")), "note": cfg.name}
    ]
    finding = None
    if run.has(main):
        st = run.group(main, STATS)
        s = st.attrs["scalars"]
        finding = st.attrs.get("degenerate")
        cross = [s["crossfit_even_F_odd_G_frac_exceed"], s["crossfit_odd_F_even_G_frac_exceed"]]
        numbers = {"N": int(s["N"]), "P": int(s["P"]), "std_A": float(s["std_A"])}
        if finding:
            rows.append({"quantity": "finding", "value": finding, "note": main})
            report.numbers["degenerate"] = finding
            report.blocks.append(("p", f"Finding: {finding}."))
        else:
            numbers |= {
                "max_abs_rho": float(s["max_abs_rho"]),
                "bound_violations": int(s["bound_violations"]),
                "crossfit_frac_exceed_even_F_odd_G": float(cross[0]),
                "crossfit_frac_exceed_odd_F_even_G": float(cross[1]),
            }
        numbers |= {"zero_mean_trace": float(s["zero_mean_trace"]), "zero_mean_coord": float(s["zero_mean_coord"])}
        report.numbers.update(numbers)
        gap = None if finding else st.attrs.get("crossfit_undefined")
        notes = {**HEADLINE_NOTES, **{k: gap for k in numbers if gap and k.startswith("crossfit_")}}
        if gap:
            report.numbers["crossfit_undefined"] = gap
        rows += [{"quantity": k, "value": v, "note": notes.get(k, "")} for k, v in numbers.items()]
        png = plot_fisher_vs_grad(st["F"], st["G"], float(s["adv_rms"]))
        if png is not None:
            report.plots["fisher_vs_grad.png"] = png
    else:
        _skip(report, "Statistics", main)
    overlap: list[dict[str, Any]] = []
    if finding:
        report.blocks.append(("p", "No overlap or tensor shares: the top set by |G| is undefined."))
    elif run.has("masks"):
        summary = run.json("masks", "summary.json")
        overlap = run.json("masks", "overlap.json")
        report.numbers["spearman_F_absG"] = float(summary["spearman_F_absG"])
        report.numbers["overlap"] = overlap
        rows.append({"quantity": "spearman_F_absG", "value": float(summary["spearman_F_absG"]), "note": "rank corr."})
        for r in overlap:
            if r["scope"] == "global":
                note = f"random {cell(r['random'])}, per-tensor random {cell(r['per_tensor_random'])}"
                rows.append({"quantity": f"overlap(q={r['q']:g})", "value": r["overlap"], "note": note})
        report.plots["overlap.png"] = plot_overlap(overlap)
        shares = run.csv("masks", "tensors.csv")
        if shares:
            report.plots["tensor_shares.png"] = plot_tensor_shares(shares)
    else:
        _skip(report, "Overlap and tensor shares", "masks")
    report.headline = rows
    report.blocks.append(("table", rows))
    if overlap:
        report.blocks.append(("h2", "Overlap of the top sets by |G| and by F"))
        cols = ("q", "scope", "n_G", "n_both", "overlap", "random", "per_tensor_random")
        report.blocks.append(("table", [{c: r[c] for c in cols} for r in overlap]))
    for file, caption in (
        ("fisher_vs_grad.png", "F against |G| per parameter, with the bound line"),
        ("overlap.png", "Overlap against q with the random and per-tensor baselines"),
        ("tensor_shares.png", "Each tensor's share of the top set by F and by |G|"),
    ):
        if file in report.plots:
            report.blocks.append(("img", file, caption))


def off_policy(report: Report, run: RunSource) -> None:
    """The off-policy table (one row per stats instance: zero-mean tests, rel_diff_G, KL, ρ, bound, cross-fit
    and overlap at q = 1%) as the offpolicy stage stored it, and the zero-mean plot."""
    report.blocks.append(("h2", "Off-policy: policy vs sampler centering"))
    if not run.has("offpolicy"):
        _skip(report, "Off-policy table", "offpolicy")
        return
    rows: list[dict[str, Any]] = run.json("offpolicy", "offpolicy.json")
    report.numbers["off_policy"] = [{k: finite(v) for k, v in r.items()} for r in rows]
    report.blocks.append(
        (
            "p",
            "rel_diff_G = ‖G_sampler − G_policy‖ / ‖G_sampler‖ between the two centerings of one sampler "
            "(NaN when the sampler is the policy); kl_per_token = mean over response tokens of KL(μ ‖ p) in "
            "nats (recorded by sampler-centered scores; 0 when μ = p); overlap_1pct is the global overlap at q = 1%; "
            "crossfit_frac_exceed uses F from even prompt groups and G from odd ones.",
        )
    )
    report.blocks.append(("table", rows))
    report.plots["zero_mean.png"] = plot_zero_mean(rows)
    report.blocks.append(("img", "zero_mean.png", "Zero-mean statistics under policy and sampler centering"))


def tokens(report: Report, run: RunSource) -> None:
    """The token Fisher against F per mode, its remaining scalars, the error table and the trace plot.

    Each number appears once: the per-mode table holds the errors against F, the error table the
    errors at three N, and the scalars table everything else.
    """
    if "tokens" not in run.refs:
        return
    report.blocks.append(("h2", "Token Fisher"))
    if not run.has("tokens"):
        _skip(report, "Token Fisher", "tokens")
        return
    g = run.group("tokens", TOKENS)
    scalars = g.attrs.get("scalars", {})
    modes = list(g.attrs.get("modes", []))
    per_mode = {"rel_L2_vs_F": "relerr_{}_vs_seq", "spearman_vs_F": "spearman_{}_vs_seq"}
    per_mode["expected_relerr"] = "{}_expected_relerr"
    vs_f = [
        {"mode": m, "N": scalars.get("N"), **{col: scalars.get(key.format(m)) for col, key in per_mode.items()}}
        for m in modes
        if f"relerr_{m}_vs_seq" in scalars
    ]
    shown = {key.format(r["mode"]) for r in vs_f for key in per_mode.values()}
    errors = g.attrs.get("errors_vs_seq") or []
    shown |= {f"relerr_{r['mode']}_vs_seq_n{r['n']}" for r in errors}
    if vs_f:
        report.blocks.append(("p", "Σ token Fisher / N against the sequence Fisher F = mean(s²), over parameters:"))
        report.blocks.append(("table", [{k: float("nan") if v is None else v for k, v in r.items()} for r in vs_f]))
    rows = [
        {"quantity": k, "value": v} for k, v in scalars.items() if isinstance(v, int | float | str) and k not in shown
    ]
    report.numbers["tokens"] = {k: finite(v) for k, v in scalars.items()}
    if rows:
        report.blocks.append(("table", rows))
    if errors:
        report.blocks.append(("table", errors))
    mode = scalars.get("trace_mode")
    if mode and "entropy" in g:
        trace, entropy = g[f"trace_{mode}"][:], g["entropy"][:]
        valid = g["p_drawn"][:] > 0 if "p_drawn" in g else trace > 0
        if np.any(trace[valid] > 0):
            report.plots["token_trace.png"] = plot_token_trace(entropy[valid], trace[valid], mode)
            report.blocks.append(("img", "token_trace.png", "Token Fisher trace against token entropy"))


def update_check(report: Report, run: RunSource) -> None:
    """The update check's cells at one step and the precision/recall plot at the fewest steps."""
    if "update_check" not in run.refs:
        return
    report.blocks.append(("h2", "Update check"))
    if not run.has("update_check"):
        _skip(report, "Update check", "update_check")
        return
    summary = run.json("update_check", "summary.json")
    cells = summary.get("cells_at_one_step", [])
    report.numbers["update_check"] = summary
    if summary.get("degenerate"):
        report.blocks.append(("p", f"No optimizer steps: {summary['degenerate']}."))
        return
    if cells:
        lead = ("optimizer", "precision", "lr")
        report.blocks.append(("table", [{**{k: c.get(k, "") for k in lead}, **c} for c in cells]))
    grid = run.json("update_check", "grid.json")
    first = [r for r in grid if r.get("steps") == min((g.get("steps", 0) for g in grid), default=0)]
    predictors = sorted({m.group(1) for r in first for k in r if (m := re.fullmatch(r"bf16_(.+)_precision", k))})
    if first and predictors:
        report.plots["update_check.png"] = plot_update_check(first, predictors)
        report.blocks.append(("img", "update_check.png", "Update check: precision and recall against random"))
