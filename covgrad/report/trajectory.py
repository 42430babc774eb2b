"""The report's trajectories section: per trajectory (one per ``trajectory.grid`` cell, or the one
``trajectory``) the changed fraction per step and cumulative against step, the step-0 predictors' precision
against step, persistence, and a table of final numbers, read from each ``trajectory.zarr``
(tasks/trajectory.py); nothing recomputed beyond sums over the stored per-step arrays."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from covgrad.report.document import Report
from covgrad.report.plots import _png

STORE = "trajectory.zarr"
# The step-0 predictors, then an external run's in-run series as predictors (trajectory.inrun: the statistics
# of the latest folded step before a record, and of the first folded step).
PREDICTORS = ("F", "absG", "absrho", "drift", "smallw", "random", "tensor_random") + tuple(
    f"inrun_{at}_{m}" for at in ("latest", "first") for m in ("F", "absG", "absrho")
)
# The predictor panels: statistics against the baselines, and the in-run |G| where the run has a series.
PLOTTED = ("F", "absG", "drift", "smallw", "random", "inrun_latest_absG")
RULES = ("absorb", "bound", "drift_rule")
PERSIST_KS = (1, 2, 4, 8)


def instances(run: Any) -> list[str]:
    """The run's trajectory instances: ``trajectory`` or ``trajectory.<cell>``, in the plan's order."""
    return [n for n in run.refs if n == "trajectory" or n.startswith("trajectory.")]


def _label(name: str) -> str:
    return name.removeprefix("trajectory.") if name != "trajectory" else "trajectory"


def read(run: Any, name: str) -> dict[str, Any]:
    """The per-step arrays of one trajectory a section draws: ``step`` (K,), changed fractions ``frac_step``
    and ``frac_cum`` (K,), ``jaccard_prev`` (K,), ``persist_hist`` (count,) at the last step, the cumulative
    predictors' precision ``cum_{p}`` (K,) and the summary."""
    g = run.group(name, STORE)
    summary = dict(g.attrs["summary"])
    P = int(summary["P"])
    out: dict[str, Any] = {
        "summary": summary,
        "P": P,
        "step": np.asarray(g["step"][:]),
        "frac_step": np.asarray(g["n_changed_step"][:]) / P,
        "frac_cum": np.asarray(g["n_changed_cum"][:]) / P,
        "jaccard_prev": np.asarray(g["jaccard_prev"][:], dtype=np.float64),
        "persist_hist": np.asarray(g["persist_hist"][-1]),
        "reward": np.asarray(g["reward"][:], dtype=np.float64),
        "kl": np.asarray(g["kl"][:], dtype=np.float64),
    }
    for scope in ("step", "cum"):
        for p in PREDICTORS:
            key = f"{scope}_{p}_precision"
            if key in g:
                out[f"{scope}_{p}"] = np.asarray(g[key][:], dtype=np.float64)
        for rule in RULES:
            for stat in ("precision", "recall"):
                key = f"{scope}_{rule}_{stat}"
                if key in g:
                    out[f"{scope}_{rule}_{stat}"] = np.asarray(g[key][:], dtype=np.float64)
    if "dk" in g:
        out["k"] = np.asarray(g["k"][:])
        out["dk"] = np.asarray(g["dk"][:], dtype=np.float64)  # (k, window)
        out["independent"] = np.asarray(g["independent"][:], dtype=np.float64)
    return out


def dk_rows(data: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per trajectory and window length k: the mean over windows of d_k (net change of the stored weights
    over k steps), of the independent-sets value, and their ratio."""
    rows = []
    for name, d in data.items():
        if "dk" not in d:
            continue
        for i, k in enumerate(d["k"]):
            dk, ind = _nanmean(d["dk"][i]), _nanmean(d["independent"][i])
            if math.isfinite(dk):
                rows.append({"cell": _label(name), "k": int(k), "d_k": dk, "independent": ind, "ratio": dk / ind})
    return rows


def plot_dk(data: dict[str, dict[str, Any]]) -> bytes:
    """Mean d_k against k (solid) beside the independent-sets curve (dashed), one colour per trajectory."""
    fig = Figure(figsize=(5.5, 4.2), layout="constrained")
    ax = fig.subplots()
    for i, (name, d) in enumerate(data.items()):
        if "dk" not in d:
            continue
        dk = np.asarray([_nanmean(r) for r in d["dk"]])
        ind = np.asarray([_nanmean(r) for r in d["independent"]])
        ax.plot(d["k"], dk, "-o", color=f"C{i % 10}", label=_label(name), lw=1.2, ms=3)
        ax.plot(d["k"], ind, "--", color=f"C{i % 10}", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("k (steps)")
    ax.set_ylabel("fraction changed over k steps (mean over windows)")
    ax.set_title("d_k (solid) and independent per-step sets (dashed)", fontsize=10)
    ax.legend(fontsize=7)
    return _png(fig)


def _nanmean(x: np.ndarray) -> float:
    x = x[np.isfinite(x)]
    return float(x.mean()) if x.size else float("nan")


def final_row(name: str, d: dict[str, Any]) -> dict[str, Any]:
    """One trajectory's final numbers: the cell, changed fractions, persistence and the predictors'
    precision (= recall: each ranked set has the true set's size) on the cumulative set at the last step."""
    s, K, hist = d["summary"], len(d["step"]), d["persist_hist"]
    row: dict[str, Any] = {
        "cell": _label(name),
        "regime": s.get("regime", "rl"),
        "optimizer": s.get("optimizer", "external" if "external" in s else None),
        "precision": s.get("precision"),
        "lr": s.get("lr"),
        "steps": K,
        "frac_step_first": float(d["frac_step"][0]),
        "frac_step_mean": float(d["frac_step"].mean()),
        "frac_cum_final": float(d["frac_cum"][-1]),
        "jaccard_prev_mean": _nanmean(d["jaccard_prev"][1:]),
    }
    k10 = max(1, math.ceil(K / 10))
    row[f"frac_ge_{k10}_of_{K}"] = int(hist[k10:].sum()) / d["P"]
    for p in PREDICTORS:
        if f"cum_{p}" in d:
            row[f"cum_{p}"] = float(d[f"cum_{p}"][-1])
    if "cum_absorb_recall" in d:
        row["cum_absorb_P/R"] = f"{d['cum_absorb_precision'][-1]:.3f} / {d['cum_absorb_recall'][-1]:.3f}"
    row["reward_first"] = float(d["reward"][0])
    row["reward_last10"] = _nanmean(d["reward"][-10:])
    row["kl_last"] = float(d["kl"][-1])
    return row


def plot_changed(data: dict[str, dict[str, Any]]) -> bytes:
    """Per-step and cumulative changed fraction against step, one line per trajectory (log y)."""
    fig = Figure(figsize=(8, 4.2), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    for i, (name, d) in enumerate(data.items()):
        style = "-" if d["summary"].get("precision") != "fp32" else "--"
        for ax, key in zip(axes, ("frac_step", "frac_cum"), strict=True):
            y = np.where(d[key] > 0, d[key], np.nan)
            ax.plot(d["step"], y, style, color=f"C{i % 10}", label=_label(name), lw=1.2)
    titles = ("changed in the step (w_t ≠ w_{t−1})", "changed since the start (w_t ≠ w_0)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(title, fontsize=10)
    axes[0].set_ylabel("fraction of parameters")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(data), 4), fontsize=7)
    return _png(fig)


def plot_predictors(data: dict[str, dict[str, Any]]) -> bytes:
    """The step-0 predictors' precision (= recall) on the cumulative changed set against step, one panel
    per trajectory: F, |G|, smallest |w| against random."""
    n = len(data)
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(3.2 * cols, 2.6 * rows + 0.6), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, cols, sharey=True, squeeze=False)).reshape(-1)
    for ax, (name, d) in zip(axes, data.items(), strict=False):
        for j, p in enumerate(PLOTTED):
            if f"cum_{p}" in d:
                ax.plot(d["step"], d[f"cum_{p}"], color=f"C{j}", label=p, lw=1.2, ls=":" if p == "random" else "-")
        ax.set_title(_label(name), fontsize=9)
        ax.set_ylim(0, 1)
        ax.set_xlabel("step", fontsize=8)
    for ax in axes[n:]:
        ax.set_visible(False)
    axes[0].set_ylabel("precision = recall, cumulative")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=len(PLOTTED), fontsize=8)
    return _png(fig)


def plot_persistence(data: dict[str, dict[str, Any]]) -> bytes:
    """Persistence: Jaccard of consecutive steps' changed sets against step, and the fraction of parameters
    changed in at least k of the K steps against k, one line per trajectory."""
    fig = Figure(figsize=(8, 4.2), layout="constrained")
    axes = fig.subplots(1, 2)
    for i, (name, d) in enumerate(data.items()):
        style = "-" if d["summary"].get("precision") != "fp32" else "--"
        axes[0].plot(d["step"][1:], d["jaccard_prev"][1:], style, color=f"C{i % 10}", label=_label(name), lw=1)
        hist = d["persist_hist"]
        ge = hist[::-1].cumsum()[::-1] / d["P"]  # ge[k] = fraction changed in >= k steps
        k = np.arange(1, len(ge))
        axes[1].plot(k, np.where(ge[1:] > 0, ge[1:], np.nan), style, color=f"C{i % 10}", lw=1.2)
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("Jaccard(changed_t, changed_{t−1})")
    axes[0].set_ylim(0, 1)
    axes[1].set_xlabel("k (steps)")
    axes[1].set_ylabel("fraction changed in ≥ k steps")
    axes[1].set_yscale("log")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(data), 4), fontsize=7)
    return _png(fig)


def trajectories(report: Report, run: Any) -> None:
    """The trajectories section (only when the run has trajectories)."""
    names = instances(run)
    if not names:
        return
    report.blocks.append(("h2", "Trajectories"))
    present = [n for n in names if run.has(n)]
    absent = [n for n in names if n not in present]
    if absent:
        report.blocks.append(("p", f"Trajectories: skipped {', '.join(absent)} (missing or incomplete)."))
    if not present:
        return
    data = {n: read(run, n) for n in present}
    rows = [final_row(n, d) for n, d in data.items()]
    report.numbers["trajectories"] = rows
    report.blocks.append(
        (
            "p",
            "Each trajectory steps one regime's loss from the policy; 'changed' is exact inequality in the "
            "stored dtype. Predictors are step-0 top-k sets (k = the changed count, so precision = recall) on the "
            "cumulative changed set at the last step; frac_ge_k_of_K is the fraction changed in at least k of the "
            "K steps.",
        )
    )
    report.blocks.append(("table", rows))
    report.plots["trajectory_changed.png"] = plot_changed(data)
    report.blocks.append(("img", "trajectory_changed.png", "Changed fraction per step and cumulative, against step"))
    report.plots["trajectory_predictors.png"] = plot_predictors(data)
    report.blocks.append(("img", "trajectory_predictors.png", "Step-0 predictors' precision against step"))
    report.plots["trajectory_persistence.png"] = plot_persistence(data)
    report.blocks.append(("img", "trajectory_persistence.png", "Persistence of the changed sets"))
    dk = dk_rows(data)
    if dk:
        report.numbers["trajectory_dk"] = dk
        report.blocks.append(("h2", "Which parameters a run changes"))
        report.blocks.append(
            (
                "p",
                "d_k: the fraction of parameters whose stored value differs between steps t and t + k, averaged "
                "over the windows t; independent: 1 − Π(1 − d_1) over the window, what per-step sets of the same "
                "sizes drawn independently would give. A ratio far below 1 means the same parameters change step "
                "after step. The drift predictor and rule follow from G, F and the bf16 gap at step 0 "
                "(docs/trajectory.md).",
            )
        )
        report.blocks.append(("table", dk))
        report.plots["trajectory_dk.png"] = plot_dk(data)
        report.blocks.append(("img", "trajectory_dk.png", "d_k against k beside independent per-step sets"))
