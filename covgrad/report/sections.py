"""The report's sections, each read from the stores of one run: headline, off-policy, token Fisher,
update check.

Every point estimate shown was computed and stored by the stage that owns it (stats, masks, offpolicy,
tokens, update_check); a section selects, labels and plots. The intervals and null bands are computed
here from the main scores store (``covgrad.report.uncertainty``: a prompt-group bootstrap over the
per-sample score rows), and the task's reward summary from the analysed rollouts. The findings in
words (``covgrad.report.document.findings``) open the report.

Instances whose artifact is absent or incomplete are listed in ``Report.missing`` and their
sections are replaced by a note; everything else still renders. Optional stages (tokens,
update_check) are read only when the run has them.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

import numpy as np

from covgrad.config import PipelineConfig
from covgrad.moments.stats import COORD_CAP
from covgrad.report.document import Report, cell, findings, finite
from covgrad.report.plots import (
    plot_fisher_vs_grad,
    plot_overlap,
    plot_rho,
    plot_tensor_shares,
    plot_token_trace,
    plot_update_check,
    plot_update_steps,
    plot_zero_mean,
)
from covgrad.report.regimes import regimes as regimes_section
from covgrad.report.trajectory import trajectories as trajectories_section
from covgrad.report.uncertainty import LEVEL, METHOD, group_bootstrap, interval, null_band

STATS = "stats.zarr"
TOKENS = "tokens.zarr"
SCORES = "scores.zarr"
MASKS = "masks.zarr"
ROLLOUTS = "rollouts.zarr"
N_BOOT = 200  # bootstrap replicates of the intervals (fewer at large P: uncertainty.REPLICATE_BUDGET)
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
    """Read access to the complete artifacts of one run, by instance name (``storage.stores.reports.RunArtifacts``)."""

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
    if report.missing:
        report.blocks.append(("p", f"Missing or incomplete artifacts: {', '.join(report.missing)}."))
    task(report, run, cfg, main)
    headline(report, run, cfg, main)
    intervals(report, run, main)
    off_policy(report, run)
    tokens(report, run)
    update_check(report, run)
    words = findings(report.numbers)
    top = [("h2", "Findings"), *(("p", w) for w in words)] if words else []
    report.blocks[:0] = top
    report.numbers["findings"] = words
    regimes_section(report, run)
    trajectories_section(report, run)
    return report


def task(report: Report, run: RunSource, cfg: PipelineConfig, main: str) -> None:
    """The task in one table: model, parameter selection, N, groups, sampling settings, reward summary,
    advantage mode and centering (from the config and the analysed rollouts)."""
    sampler, centering = main.split(".")[1:3]
    spec = cfg.rollouts.samplers[sampler]
    rows: list[dict[str, Any]] = [
        {"quantity": "model", "value": model_label(cfg.model_dump(mode="json"))},
        {"quantity": "selection", "value": ", ".join(cfg.model.params) if cfg.model.params else "every trainable"},
        {"quantity": "task", "value": cfg.task.kind if cfg.task.kind != "jsonl" else str(cfg.task.path)},
        {"quantity": "sampler", "value": sampler},
        {"quantity": "centering", "value": centering},
        {"quantity": "group_size", "value": spec.group_size},
        {"quantity": "T", "value": spec.max_new_tokens},
        {"quantity": "temperature", "value": spec.temperature},
        {"quantity": "top_p", "value": spec.top_p},
        {"quantity": "top_k", "value": spec.top_k},
        {"quantity": "advantage", "value": cfg.rollouts.advantage},
    ]
    info: dict[str, Any] = {
        "sampler": sampler,
        "centering": centering,
        "group_size": spec.group_size,
        "T": spec.max_new_tokens,
        "temperature": spec.temperature,
        "advantage": cfg.rollouts.advantage,
        "selection": cfg.model.params,
    }
    name = f"rollouts.{sampler}"
    if run.has(name):
        ro = run.group(name, ROLLOUTS)
        reward, group = ro["reward"][:], ro["group"][:]
        labels, idx = np.unique(group, return_inverse=True)
        spread = np.zeros(len(labels))
        np.maximum.at(spread, idx, reward)
        low = np.full(len(labels), np.inf)
        np.minimum.at(low, idx, reward)
        varied = int(np.count_nonzero(spread > low))
        info |= {"N": int(reward.size), "groups": len(labels), "mean_reward": float(np.mean(reward))}
        info["groups_with_reward_variance"] = varied
        rows[3:3] = [
            {"quantity": "N", "value": int(reward.size)},
            {"quantity": "groups", "value": len(labels)},
            {"quantity": "mean_reward", "value": float(np.mean(reward))},
            {"quantity": "groups_with_reward_variance", "value": f"{varied}/{len(labels)}"},
        ]
    report.numbers["task"] = info
    report.blocks.append(("h2", "Task"))
    report.blocks.append(("table", rows))


def intervals(report: Report, run: RunSource, main: str) -> None:
    """95% intervals of the overlap at each q, Spearman and max |ρ| (prompt-group bootstrap over the main
    scores store's per-sample rows) and the null bands of the zero-mean statistics."""
    scores = "scores." + main.split(".", 1)[1]
    if report.numbers.get("degenerate") or not run.has(scores) or "max_abs_rho" not in report.numbers:
        return
    sc = run.group(scores, SCORES)
    overlap = [r for r in report.numbers.get("overlap", []) if r["scope"] == "global"]
    qs = [r["q"] for r in overlap]
    out: dict[str, Any] = {"level": LEVEL}
    if "scores" in sc:
        rows = sc["scores"]
        boot = group_bootstrap(
            lambda a, b: rows[:, a:b], sc["advantage"][:], sc["group"][:], rows.shape[1], qs, n_boot=N_BOOT
        )
        out |= {"method": METHOD, "n_boot": boot["n_boot"]}
        if boot["n_boot"]:
            est, G = report.numbers, boot["groups"]
            out["groups"] = G
            out["max_abs_rho"] = interval(est["max_abs_rho"], boot["max_abs_rho"], 0.0, 1.0, groups=G, fisher_z=True)
            if "spearman_F_absG" in est:
                rank = est["spearman_F_absG"]
                out["spearman_F_absG"] = interval(rank, boot["spearman"], -1.0, 1.0, groups=G, fisher_z=True)
            out["overlap"] = {
                r["q"]: interval(r["overlap"], boot["overlap"][:, i], 0.0, 1.0, groups=G) for i, r in enumerate(overlap)
            }
        tests = boot["zero_mean"] or {}
        out["zero_mean_test"] = bool(tests)
        for k, test in tests.items():
            out[f"z_{k}"] = test.z
        bands = {k: tests[k].band if k in tests else None for k in ("trace", "coord")}
    else:
        out["method"] = "none: the scores store kept only moment state (two parity halves), too few to resample"
        bands = {"trace": None, "coord": None}
    for k, band in bands.items():
        out[f"null_band_{k}"] = band if band is not None else null_band(1.0)
    report.numbers["intervals"] = out
    table = [
        {"quantity": k, "value": report.numbers.get(k), "lo": v[0], "hi": v[1]}
        for k, v in out.items()
        if k in ("max_abs_rho", "spearman_F_absG")
    ]
    table += [
        {"quantity": f"overlap(q={q:g})", "value": r["overlap"], "lo": out["overlap"][q][0], "hi": out["overlap"][q][1]}
        for q, r in zip(qs, overlap, strict=True)
        if q in out.get("overlap", {})
    ]
    table += [
        {"quantity": f"zero_mean_{k}", "value": report.numbers.get(f"zero_mean_{k}"), "lo": b[0], "hi": b[1]}
        for k in ("trace", "coord")
        if (b := out.get(f"null_band_{k}"))
    ]
    report.blocks.append(("h2", "Uncertainty"))
    text = (
        f"Intervals: {out['method']}"
        + (f", {out['n_boot']} replicates of {out['groups']} groups" if out.get("n_boot") else "")
        + ". lo/hi of the overlap, Spearman and max |ρ| rows: where the statistic of a rerun with fresh seeds "
        "falls, 95% (finite-N bias not removed; see docs/reading.md). lo/hi of the zero_mean rows: the 95% band "
        "of the statistic when E[s | prompt] = 0 ("
        + (
            "the one-sided cross-fit test between the even and the odd prompt groups: up to the statistic less "
            "its cross term between the halves plus 1.645 times that term's standard error from the rows of each "
            f"half; inside exactly when z ≤ 1.645, here z = {out['z_trace']:.2f} (trace) and {out['z_coord']:.2f} "
            f"(coord, each coordinate's N·m_i²/Var_i counted up to {COORD_CAP:g} in the cross term)"
            if out.get("zero_mean_test")
            else "χ²₁, the widest: no score rows of both even and odd prompt groups"
        )
        + ")."
    )
    report.blocks.append(("p", text))
    if table:
        report.blocks.append(("table", table))


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
        png = plot_fisher_vs_grad(st["F"], st["G"], float(s["adv_rms"]), None if finding else _cuts(run, st))
        if png is not None:
            report.plots["fisher_vs_grad.png"] = png
        png = None if finding else plot_rho(st["rho"])
        if png is not None:
            report.plots["rho.png"] = png
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
        ("fisher_vs_grad.png", "F against |G| per parameter: the bound, iso-ratio lines and the top-1% thresholds"),
        ("rho.png", "Distribution of |ρ|: how close the parameters come to the bound"),
        ("overlap.png", "Overlap against q with the random and per-tensor baselines"),
        ("tensor_shares.png", "Each tensor's share of the top set by F and by |G|"),
    ):
        if file in report.plots:
            report.blocks.append(("img", file, caption))


def _cuts(run: RunSource, st: Any, block: int = 1 << 22) -> tuple[float, float, float] | None:
    """(q, smallest F in the global top-q set by F, smallest |G| in the one by |G|) at the masks' q
    nearest 1%, read in blocks from the masks and stats stores; None without masks."""
    if not run.has("masks"):
        return None
    mk = run.group("masks", MASKS)
    if "F_global" not in mk:
        return None
    qs = mk["q"][:]
    i = int(np.argmin(np.abs(np.log(qs / 0.01))))
    cut = []
    for metric, values in (("F_global", st["F"]), ("absG_global", st["G"])):
        low = np.inf
        for j in range(0, values.shape[0], block):
            sel = mk[metric][i, j : j + block]
            if sel.any():
                low = min(low, float(np.abs(values[j : j + block][sel]).min()))
        cut.append(low)
    return float(qs[i]), cut[0], cut[1]


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
    nulls = null_tests(rows)
    report.numbers["null_test"] = [{k: finite(v) for k, v in n.items()} for n in nulls]
    report.blocks.extend(("p", null_line(n)) for n in nulls)
    report.plots["zero_mean.png"] = plot_zero_mean(rows)
    report.blocks.append(("img", "zero_mean.png", "Zero-mean statistics under policy and sampler centering"))


NULL_K3_KL = 1e-9
"""k3-KL per token (nats) below which a sampler's μ is the policy's p to float rounding: the null test."""


def null_tests(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The zero-mismatch null tests of an off-policy table: one per sampler with both centerings whose
    k3-KL is below :data:`NULL_K3_KL` (an fp32 copy of the policy, rollouts imported with μ ≡ p): its k3-KL,
    the zero-mean statistic under each centering, ``rel_diff_stats`` and ``sampler_weights``."""
    by = {(r["sampler"], r["centering"]): r for r in rows}
    out = []
    for (sampler, centering), r in by.items():
        policy = by.get((sampler, "policy"))
        if centering == "sampler" and policy is not None and float(r["k3_kl"]) < NULL_K3_KL:
            out.append(
                {
                    "sampler": sampler,
                    "k3_kl": float(r["k3_kl"]),
                    "zero_mean_trace_sampler": float(r["zero_mean_trace"]),
                    "zero_mean_trace_policy": float(policy["zero_mean_trace"]),
                    "rel_diff_stats": float(r.get("rel_diff_stats", float("nan"))),
                    "sampler_weights": str(r.get("sampler_weights", "unknown")),
                }
            )
    return out


def null_line(n: dict[str, Any]) -> str:
    """One sentence of the report for a null test of :func:`null_tests`."""
    weights = {"policy": "; bitwise the policy's weights", "other": "; not the policy's weights, bit for bit"}
    return (
        f"Null test, sampler {n['sampler']} (μ ≡ p: k3-KL {n['k3_kl']:.2g} per token"
        f"{weights.get(n.get('sampler_weights', 'unknown'), '')}): zero-mean statistic "
        f"N·|m|²/tr Var(s) {n['zero_mean_trace_sampler']:.3g} sampler-centred, {n['zero_mean_trace_policy']:.3g} "
        "policy-centred (≈ 1 when E[s] = 0); sampler- vs policy-centred m, F, Fvar, G, Cov differ by at most "
        f"{n['rel_diff_stats']:.2g} relative (L2)."
    )


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
    per_mode = {"rel_L2_vs_F": "relerr_{}_vs_seq", "lo": "relerr_{}_vs_seq_lo", "hi": "relerr_{}_vs_seq_hi"}
    per_mode |= {"spearman_vs_F": "spearman_{}_vs_seq", "expected_relerr": "{}_expected_relerr"}
    vs_f = [
        {"mode": m, "N": scalars.get("N"), **{col: scalars.get(key.format(m)) for col, key in per_mode.items()}}
        for m in modes
        if f"relerr_{m}_vs_seq" in scalars
    ]
    shown = {key.format(r["mode"]) for r in vs_f for key in per_mode.values()}
    errors = g.attrs.get("errors_vs_seq") or []
    shown |= {f"relerr_{r['mode']}_vs_seq_n{r['n']}" for r in errors}
    if vs_f:
        report.blocks.append(
            (
                "p",
                "Σ token Fisher / N against the sequence Fisher F = mean(s²), over parameters; lo/hi: the 95% "
                "interval of rel_L2_vs_F (delete-one-batch jackknife over the study's batches of samples, t "
                "quantile; where a rerun with fresh seeds falls, finite-N bias not removed):",
            )
        )
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
    if len({r.get("steps") for r in grid}) > 1 or len({r.get("lr") for r in grid}) > 1:
        report.plots["update_steps.png"] = plot_update_steps(grid)
        report.blocks.append(("img", "update_steps.png", "Fraction of parameters changed against steps, per lr"))
