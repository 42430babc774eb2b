"""The in-run statistics against step: a trainer's series (``InRunFolder``'s per-step files, opened by step with
``storage.notebook.open_inrun``) as a table and a plot, in a report of their own (:class:`Report`).

    from storage.notebook import open_inrun
    from covgrad.report.inrun import inrun_report

    report = inrun_report(open_inrun("run/inrun"))
    Path("inrun.html").write_text(report.html())

Nothing is recomputed beyond means over each step's stored (P,) vectors and its stored overlaps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from covgrad.report.document import Report
from covgrad.report.plots import _png

METRICS = ("F", "absG", "absrho")
LABELS = {"F": "F", "absG": "|G|", "absrho": "|ρ|"}


def _nanmean(x: np.ndarray) -> float:
    x = x[np.isfinite(x)]
    return float(x.mean()) if x.size else float("nan")


def series_rows(ds: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per folded step of a series (a Dataset of ``open_inrun``, or any mapping of its names to arrays):
    N, std(A), the means over the parameters of F, |G| and |ρ| (those the series wrote), the bound violations and
    each top set's overlap with the first folded step's and the previous one's."""
    steps = np.asarray(ds["step"])
    first, prev = np.asarray(ds["overlap_first"]), np.asarray(ds["overlap_prev"])  # (step, metric)
    rows = []
    for i, step in enumerate(steps):
        row: dict[str, Any] = {"step": int(step), "N": int(np.asarray(ds["N"])[i]), "std_A": float(ds["std_A"][i])}
        for name, label in (("F", "mean_F"), ("G", "mean_absG"), ("rho", "mean_absrho")):
            if name in ds:
                row[label] = _nanmean(np.abs(np.asarray(ds[name][i], dtype=np.float64)))
        row["bound_violations"] = int(np.asarray(ds["bound_violations"])[i])
        for j, m in enumerate(METRICS):
            row[f"overlap_first_{m}"] = float(first[i, j])
        row["overlap_prev_absG"] = float(prev[i, METRICS.index("absG")])
        rows.append(row)
    return rows


def plot_series(ds: Mapping[str, Any]) -> bytes:
    """Left: each top-q set's overlap with the first folded step's (solid) and the previous step's (dashed)
    against step. Right: the means over the parameters of F and |G| against step (log y)."""
    steps = np.asarray(ds["step"])
    first, prev = np.asarray(ds["overlap_first"]), np.asarray(ds["overlap_prev"])
    fig = Figure(figsize=(8, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    for j, m in enumerate(METRICS):
        left.plot(steps, first[:, j], "-o", color=f"C{j}", ms=3, lw=1.2, label=f"{LABELS[m]}: vs first step")
        left.plot(steps, prev[:, j], "--", color=f"C{j}", lw=0.9, label=f"{LABELS[m]}: vs previous step")
    left.set_ylim(0, 1.02)
    left.set_xlabel("step")
    left.set_ylabel(f"overlap of the top-q sets (q = {getattr(ds, 'attrs', {}).get('q')})")
    left.legend(fontsize=7)
    rows = series_rows(ds)
    for j, (key, label) in enumerate((("mean_F", "mean F"), ("mean_absG", "mean |G|"))):
        if key in rows[0]:
            y = np.asarray([r[key] for r in rows])
            right.plot(steps, np.where(y > 0, y, np.nan), "-o", color=f"C{j}", ms=3, lw=1.2, label=label)
    right.set_yscale("log")
    right.set_xlabel("step")
    right.set_ylabel("mean over the parameters")
    right.legend(fontsize=7)
    return _png(fig)


def inrun_report(ds: Any, title: str = "In-run statistics") -> Report:
    """A :class:`Report` of a series (``open_inrun``'s Dataset): a paragraph, the per-step table and the plot
    (``inrun.png``); ``report.numbers["inrun"]`` holds the table's rows.

    Raises:
        ValueError: when the series has no folded step.
    """
    rows = series_rows(ds)
    if not rows:
        raise ValueError("the in-run series has no folded step")
    attrs = getattr(ds, "attrs", {})
    report = Report(title)
    report.blocks.append(("h2", "Statistics against step"))
    report.blocks.append(
        (
            "p",
            f"{len(rows)} folded steps (every_n = {attrs.get('every_n')}, q = {attrs.get('q')}): each step's F, G "
            "and ρ are its own batch's, at the weights that generated it. overlap_first_*: the step's top-q set "
            "against the first folded step's; overlap_prev_absG: the |G| set against the previous folded step's.",
        )
    )
    report.blocks.append(("table", rows))
    report.plots["inrun.png"] = plot_series(ds)
    report.blocks.append(("img", "inrun.png", "top-q overlaps and mean F, |G| against step"))
    report.numbers["inrun"] = rows
    return report
