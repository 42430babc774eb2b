"""The report's plots: arrays and row tables read from the stores in, PNG bytes out.

Every function draws one figure and computes nothing the stores do not already hold, beyond binning
for a density plot (:func:`log_histogram`, which reads (P,) arrays in blocks: a hexbin over all P
points held 19 GiB at P = 134.5M).
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure

PNG_DPI = 110
READ_BLOCK = 1 << 22  # entries per read of a (P,) array: 32 MiB of float64


class LogHistogram(NamedTuple):
    """Counts (bins,) * d of entries in log-spaced bins, the d edge arrays (bins + 1,) in the arrays'
    units, the entries counted and the arrays' length P."""

    counts: np.ndarray
    edges: list[np.ndarray]
    n: int
    P: int


def _png(fig: Figure) -> bytes:
    """The figure as PNG bytes (no timestamp or software tag, so equal figures give equal bytes)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=PNG_DPI, bbox_inches="tight", metadata={"Software": None})
    return buf.getvalue()


def log_histogram(arrays: Sequence[Any], bins: int = 60, block: int = READ_BLOCK) -> LogHistogram | None:
    """Counts of the entries i with |a_i| > 0 in every one of d (P,) arrays, in ``bins`` log10-spaced
    bins per array spanning the counted entries' own range, read ``block`` entries at a time (two
    passes: the range, then the counts), so memory holds a few blocks whatever P. NaN is not counted.
    None when no entry counts."""
    P = arrays[0].shape[0]

    def logs() -> Iterator[list[np.ndarray]]:
        for j in range(0, P, block):
            cols = [np.abs(np.asarray(a[j : j + block], dtype=np.float64)) for a in arrays]
            keep = np.logical_and.reduce([c > 0 for c in cols])
            yield [np.log10(c[keep]) for c in cols]

    lo, hi, n = np.full(len(arrays), np.inf), np.full(len(arrays), -np.inf), 0
    for cols in logs():
        if cols[0].size:
            n += cols[0].size
            lo = np.minimum(lo, [c.min() for c in cols])
            hi = np.maximum(hi, [c.max() for c in cols])
    if n == 0:
        return None
    edges = [np.linspace(a, b if b > a else a + 1, bins + 1) for a, b in zip(lo, hi, strict=True)]
    counts = np.zeros((bins,) * len(arrays), dtype=np.int64)
    for cols in logs():
        counts += np.histogramdd(np.stack(cols, axis=1), bins=edges)[0].astype(np.int64)
    return LogHistogram(counts, [10.0**e for e in edges], n, P)


def plot_fisher_vs_grad(F: Any, G: Any, adv_rms: float, cuts: tuple[float, float, float] | None = None) -> bytes | None:
    """Log-log density of |G_i| against F_i over every parameter with F, |G| > 0 (F and G: (P,) arrays
    that slice to numpy, e.g. the stats store's, read in blocks by :func:`log_histogram`) with the bound
    √mean(A²)·√F, the iso-ratio lines at 10% and 1% of the bound, and, with ``cuts`` = (q, F cut, |G| cut),
    the thresholds of the top-q sets by F (vertical) and by |G| (horizontal); None when no parameter has
    F, |G| > 0 (e.g. every advantage is 0)."""
    h = log_histogram([F, G])
    if h is None:
        return None
    fe, ge = h.edges
    fig = Figure(figsize=(6, 4.5))
    ax = fig.add_subplot()
    mesh = ax.pcolormesh(fe, ge, np.ma.masked_equal(h.counts.T, 0), norm=LogNorm(), cmap="viridis")
    ax.set_xscale("log")
    ax.set_yscale("log")
    fig.colorbar(mesh, ax=ax, label="parameters per bin")
    x = np.geomspace(fe[0], fe[-1], 100)
    ax.plot(x, adv_rms * np.sqrt(x), "r-", label="bound √mean(A²)·√F (= std(A)·√F when mean A = 0)")
    for frac, style in ((0.1, "--"), (0.01, ":")):
        ax.plot(x, frac * adv_rms * np.sqrt(x), "r" + style, lw=0.8, label=f"iso-ratio |G| = {frac:g} × bound")
    if cuts is not None:
        q, f_cut, g_cut = cuts
        ax.axvline(f_cut, color="k", ls="--", lw=0.8, label=f"top {q:.2%} by F: F ≥ {f_cut:.3g}")
        ax.axhline(g_cut, color="k", ls="-.", lw=0.8, label=f"top {q:.2%} by |G|: |G| ≥ {g_cut:.3g}")
    ax.set_ylim(ge[0], ge[-1])
    ax.set_xlabel("Fisher F = mean(s²)  [(log-prob / parameter unit)²]")
    ax.set_ylabel("|G| = |mean(A·s)|  [advantage × log-prob / parameter unit]")
    ax.set_title(f"F vs |G|: {h.n} of {h.P} parameters with F, |G| > 0", fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), fontsize=8)  # below the axes, clear of the data
    return _png(fig)


def plot_overlap(rows: list[dict[str, Any]]) -> bytes:
    """overlap(q) of top-q by |G| and by F, global and per-tensor scope, beside both baselines."""
    fig = Figure(figsize=(6, 4.5))
    ax = fig.add_subplot()
    for scope, style in (("global", "-"), ("per_tensor", "--")):
        sel = sorted((r for r in rows if r["scope"] == scope), key=lambda r: r["q"])
        if not sel:
            continue
        q = [r["q"] for r in sel]
        ax.plot(q, [r["overlap"] for r in sel], "o" + style, color="C0", label=f"measured overlap, {scope} top sets")
        if scope == "global":
            ax.plot(q, [r["random"] for r in sel], "s:", color="C7", label="baseline: random positions (= q)")
            ax.plot(
                q,
                [r["per_tensor_random"] for r in sel],
                "^-.",
                color="C1",
                label="baseline: per-tensor random (each tensor's share kept, positions random)",
            )
    ax.set_xscale("log")
    ax.set_xlabel("q (fraction of parameters kept)")
    ax.set_ylabel("overlap = |top-q |G| ∩ top-q F| / |top-q |G||")
    ax.set_ylim(0, 1.02)
    ax.set_title("Overlap of the top sets by |G| and by F")
    ax.legend(fontsize=8)
    return _png(fig)


LAYER_AGGREGATE = 24  # more tensors than this: the shares plot sums them per layer


def layer_of(name: str) -> str:
    """The layer a tensor belongs to (``layers.3``), or its own name outside numbered layers."""
    m = re.search(r"(?:^|\.)(layers|h|blocks|layer)\.(\d+)\.", name)
    return f"{m.group(1)}.{m.group(2)}" if m else name.removeprefix("model.")


def plot_tensor_shares(rows: list[dict[str, Any]]) -> bytes:
    """Each tensor's share of the global top-q set by F and by |G| beside its share of all parameters;
    summed per layer (``layer_of``) when there are more than ``LAYER_AGGREGATE`` tensors."""
    names = list(dict.fromkeys(r["tensor"] for r in rows))
    key = layer_of if len(names) > LAYER_AGGREGATE else (lambda n: n)
    tensors = list(dict.fromkeys(key(n) for n in names))
    share: dict[tuple[str, str], float] = {}
    for r in rows:
        k = (key(r["tensor"]), r["metric"])
        share[k] = share.get(k, 0.0) + float(r["share"])
    numel: dict[str, float] = {}
    for n in names:
        numel[key(n)] = numel.get(key(n), 0.0) + next(float(r["numel_share"]) for r in rows if r["tensor"] == n)
    q = float(rows[0]["q"])
    y = np.arange(len(tensors))
    fig = Figure(figsize=(7, 1.2 + 0.32 * len(tensors)))
    ax = fig.add_subplot()
    ax.barh(y - 0.27, [share.get((t, "F"), 0.0) for t in tensors], 0.27, label=f"top-{q:g} by F")
    ax.barh(y, [share.get((t, "absG"), 0.0) for t in tensors], 0.27, label=f"top-{q:g} by |G|")
    ax.barh(y + 0.27, [numel[t] for t in tensors], 0.27, color="C7", label="share of all parameters")
    ax.set_yticks(y, [t.removeprefix("model.") for t in tensors], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("share of the set (fraction)")
    ax.set_title("Which " + ("layers" if len(names) > LAYER_AGGREGATE else "tensors") + " hold the top parameters")
    ax.legend(fontsize=8)
    return _png(fig)


def plot_zero_mean(rows: list[dict[str, Any]]) -> bytes:
    """Zero-mean statistics (trace and per-coordinate) per sampler, policy vs sampler centering."""
    labels = [f"{r['sampler']}\n{r['centering']}" for r in rows]
    x = np.arange(len(rows))
    fig = Figure(figsize=(6, 4.5))
    ax = fig.add_subplot()
    ax.bar(x - 0.2, [r["zero_mean_trace"] for r in rows], 0.4, label="N·‖m‖² / tr Var(s)")
    ax.bar(x + 0.2, [r["zero_mean_coord"] for r in rows], 0.4, label="mean_i N·m_i² / Var_i")
    ax.axhline(1.0, color="k", ls=":", label="≈ 1 when E[s] = 0")
    ax.set_yscale("log")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_xlabel("sampler / centering")
    ax.set_ylabel("statistic (dimensionless)")
    ax.set_title("Zero-mean test of the score: policy vs sampler centering")
    ax.legend(fontsize=8)
    return _png(fig)


def plot_mismatch_sweep(rows: list[dict[str, Any]], title: str) -> bytes:
    """A mismatch sweep (off-policy table rows, both centerings of each sampler): the zero-mean statistic
    N·‖m‖²/tr Var(s) against k3-KL per token under each centering, and rel_diff_G against k3-KL. k3-KL below
    1e-8 (a sampler that is the policy to float rounding) is drawn at 1e-8."""
    floor = 1e-8
    fig = Figure(figsize=(11, 4.5))
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for centering, marker in (("policy", "o"), ("sampler", "x")):
        sel = [r for r in rows if r["centering"] == centering]
        k3 = [max(float(r["k3_kl"]), floor) for r in sel]
        left.scatter(k3, [r["zero_mean_trace"] for r in sel], marker=marker, label=f"{centering}-centred")
        if centering == "policy":
            for r, x in zip(sel, k3, strict=True):
                left.annotate(
                    r["sampler"], (x, r["zero_mean_trace"]), fontsize=7, xytext=(3, 3), textcoords="offset points"
                )
    left.axhline(1.0, color="k", ls=":", label="≈ 1 when E[s] = 0")
    off = [r for r in rows if r["centering"] == "sampler" and np.isfinite(r["rel_diff_G"])]
    right.scatter([max(float(r["k3_kl"]), floor) for r in off], [max(float(r["rel_diff_G"]), floor) for r in off])
    for r in off:
        right.annotate(r["sampler"], (max(float(r["k3_kl"]), floor), max(float(r["rel_diff_G"]), floor)), fontsize=7)
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("k3-KL per token (nats; sampler vs policy)")
    left.set_ylabel("zero-mean statistic N·‖m‖² / tr Var(s)")
    left.legend(fontsize=8)
    right.set_ylabel("rel_diff_G = ‖G_sampler − G_policy‖ / ‖G_sampler‖")
    fig.suptitle(title)
    return _png(fig)


def plot_token_trace(entropy: np.ndarray, trace: np.ndarray, mode: str) -> bytes:
    """Per-position token Fisher trace against the policy's entropy at that position (both (n,); only
    positions with a positive trace are drawn, on a log axis)."""
    fig = Figure(figsize=(6, 4.5))
    ax = fig.add_subplot()
    keep = trace > 0
    ax.scatter(entropy[keep], trace[keep], s=8, alpha=0.6)
    ax.set_yscale("log")
    ax.set_xlabel("token entropy H(p_t)  [nats]")
    ax.set_ylabel(f"token Fisher trace Σ_i f_t,i  ({mode})")
    ax.set_title(f"Token Fisher trace against entropy ({int(keep.sum())} response positions)")
    return _png(fig)


def plot_update_check(rows: list[dict[str, Any]], predictors: list[str]) -> bytes:
    """bf16 precision and recall of each predictor against the changed set, per optimizer cell.

    One panel per statistic, stacked, so each gets the full width; cell labels are three short lines
    (optimizer, precision, lr) and the legend sits below the panels, clear of the bars.
    """
    cells = [f"{r['optimizer']}\n{r['precision']}\nlr={r['lr']:g}" for r in rows]
    x = np.arange(len(rows))
    width = 0.8 / max(len(predictors), 1)
    fig = Figure(figsize=(max(6.0, 0.75 * len(rows) + 1.5), 7.0), layout="constrained")
    axes = fig.subplots(2, 1, sharex=True)
    for ax, stat in zip(axes, ("precision", "recall"), strict=True):
        for j, p in enumerate(predictors):
            vals = [r.get(f"bf16_{p}_{stat}", float("nan")) for r in rows]
            ax.bar(
                x + (j - (len(predictors) - 1) / 2) * width, vals, width, label=p, color="C7" if p == "random" else None
            )
        ax.set_title(f"{stat} against the set whose bf16 value changed, at the fewest steps", fontsize=10)
        ax.set_ylabel(f"{stat} (fraction)")
        ax.set_ylim(0, 1.02)
    axes[1].set_xticks(x, cells, fontsize=7)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(predictors), 6), fontsize=8)
    return _png(fig)


def plot_rho(rho: Any, bins: int = 50, block: int = READ_BLOCK) -> bytes | None:
    """Histogram and CDF of |ρ_i| = |Cov_i| / (std(A)·√Fvar_i) over the parameters with finite ρ (``rho``:
    a (P,) array read in blocks): how close each parameter comes to the bound (|ρ| = 1 is on it). None
    when no ρ is finite."""
    edges = np.linspace(0.0, 1.0, bins + 1)
    counts = np.zeros(bins, dtype=np.int64)
    P = rho.shape[0]
    for j in range(0, P, block):
        r = np.abs(np.asarray(rho[j : j + block], dtype=np.float64))
        counts += np.histogram(r[np.isfinite(r)], bins=edges)[0]
    n = int(counts.sum())
    if n == 0:
        return None
    fig = Figure(figsize=(6, 4.0))
    ax = fig.add_subplot()
    ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge", color="C0", label="parameters per bin")
    ax.set_yscale("log")
    ax.set_xlabel("|ρ| = |Cov| / (std(A)·√Fvar)  (1 = on the bound)")
    ax.set_ylabel("parameters per bin")
    cdf = ax.twinx()
    cdf.plot(edges[1:], np.cumsum(counts) / n, "k-", label="CDF (fraction with |ρ| ≤ x)")
    cdf.set_ylim(0, 1.02)
    cdf.set_ylabel("fraction of parameters with |ρ| ≤ x")
    ax.set_title(f"|ρ| over {n} of {P} parameters (finite ρ)", fontsize=10)
    handles = ax.get_legend_handles_labels()[0] + cdf.get_legend_handles_labels()[0]
    labels = ax.get_legend_handles_labels()[1] + cdf.get_legend_handles_labels()[1]
    ax.legend(handles, labels, loc="center right", fontsize=8)
    return _png(fig)


def plot_update_steps(rows: list[dict[str, Any]]) -> bytes:
    """Fraction of parameters changed (bf16 and |Δ| > atol) against optimizer steps, one line per
    (optimizer, precision, lr) cell of the update-check grid."""
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    cells = sorted({(r["optimizer"], r["precision"], float(r["lr"])) for r in rows})
    for ax, metric, title in (
        (axes[0], "frac_changed_bf16", "bf16 value changed"),
        (axes[1], "frac_changed_abs", "|Δ| > atol (in the cell's precision)"),
    ):
        for i, (opt, prec, lr) in enumerate(cells):
            sel = sorted(
                (r for r in rows if (r["optimizer"], r["precision"], float(r["lr"])) == (opt, prec, lr)),
                key=lambda r: r["steps"],
            )
            style = "-" if prec == "bf16" else "--"
            ax.plot(
                [r["steps"] for r in sel],
                [r[metric] for r in sel],
                "o" + style,
                color=f"C{i % 10}",
                label=f"{opt} {prec} lr={lr:g}",
            )
        ax.set_xlabel("optimizer steps")
        ax.set_title(title, fontsize=10)
        steps = [r["steps"] for r in rows]
        if max(steps) >= 8 * min(steps):
            ax.set_xscale("log")
        ticks = sorted(set(steps))
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
    axes[0].set_ylabel("fraction of parameters changed")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(cells), 4), fontsize=7)
    return _png(fig)
