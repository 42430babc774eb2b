"""report stage: the run's numbers as markdown, self-contained HTML, PNG plots and Prefect artifacts.

``render_report(store, run_index)`` works from the stores alone (no model), so ``covgrad report RUN``
rebuilds it from a run index; the stage task calls it with an index made from its upstream refs.
Instances whose artifact is absent or incomplete are listed in ``Report.missing`` and their sections
are replaced by a note; everything else still renders. Optional stages (tokens, update_check) are read
only when the run has them.

Files in the report artifact: ``report.md`` (plots as relative PNG links), ``report.html`` (PNGs as
base64 data URIs), ``headline.md`` (the table the CLI prints), ``report.json`` (every number of the
headline and off-policy tables, unformatted) and one PNG per plot.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import fsspec
import numpy as np
from matplotlib.figure import Figure
from prefect import task

from covgrad.config import PipelineConfig
from covgrad.layout import ParamLayout
from covgrad.topk import overlap_table, spearman
from storage.artifacts import ArtifactRef, ArtifactStore
from storage.schema import STATS, TOKENS
from storage.tables import to_markdown, uniform
from tasks.common import StageResult, log, run_stage
from tasks.specs import ReportSpec, centerings

FLOAT_FORMAT = ".4g"
PNG_DPI = 110
Q_OFFPOLICY = 0.01
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


@dataclass
class Report:
    """A rendered report: ordered blocks, PNG plots by file name, numbers, and missing instances.

    ``blocks`` holds ``("h2", text)``, ``("p", text)``, ``("table", rows)`` (rows: list of dicts with
    the same keys) and ``("img", file_name, caption)``.
    """

    title: str
    blocks: list[tuple[Any, ...]] = field(default_factory=list)
    plots: dict[str, bytes] = field(default_factory=dict)
    headline: list[dict[str, Any]] = field(default_factory=list)
    numbers: dict[str, Any] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)

    def headline_markdown(self) -> str:
        """The headline as markdown (what ``covgrad run`` prints at the end): the main table, the
        off-policy table, and one line each for the token Fisher and the update check when present."""
        text = f"## {self.title}\n\n" + (to_markdown(self.headline, FLOAT_FORMAT) if self.headline else "")
        off = self.numbers.get("off_policy")
        if off:
            cols = (
                "sampler",
                "centering",
                "kl_per_token",
                "zero_mean_trace",
                "zero_mean_coord",
                "rel_diff_G",
                "max_abs_rho",
                "bound_violations",
                "overlap_1pct",
            )
            rows = [{c: float("nan") if r.get(c) is None else r[c] for c in cols} for r in off]
            text += "\n### Off-policy: policy vs sampler centering\n\n" + to_markdown(rows, FLOAT_FORMAT)
            for r in off:
                if r.get("finding"):
                    text += f"\n{r['sampler']}/{r['centering']}: {r['finding']}\n"
        tok = self.numbers.get("tokens")
        if tok:
            main = tok.get("main_mode", "exact")
            parts = [
                f"Σ f / N vs F rel. L2 {_num(tok.get(f'relerr_{main}_vs_seq')):.3g}, "
                f"Spearman {_num(tok.get(f'spearman_{main}_vs_seq')):.3g}"
            ]
            for label, key, expected in (
                ("top-k", "topk_vs_exact", None),
                ("Monte Carlo", "mc_vs_exact", "mc_expected_relerr"),
                ("probe", "probe_vs_exact", "probe_expected_relerr"),
            ):  # against exact only where exact ran
                if math.isfinite(_num(tok.get(key))):
                    note = f" (expected {_num(tok.get(expected)):.3g})" if expected else ""
                    parts.append(f"{label} vs exact rel. L2 {_num(tok.get(key)):.3g}{note}")
            parts.append(f"cross-term ratio {_num(tok.get('cross_term_ratio')):.3g}")
            text += f"\ntoken Fisher ({main}): {'; '.join(parts)}\n"
        upd = self.numbers.get("update_check", {}).get("cells_at_one_step")
        if upd:
            best = ", ".join(
                f"{c['optimizer']}/{c['precision']}/lr={c['lr']:g}: {c['frac_changed_bf16']:.2%} changed, best "
                f"{c['best_predictor']} J={c['best_jaccard']:.2f} (random {c['random_jaccard']:.3f})"
                for c in upd
                if c["precision"] == "bf16"
            )
            text += f"\nupdate check (1 step, bf16): {best}\n"
        if self.missing:
            text += f"\nmissing or incomplete: {', '.join(self.missing)}\n"
        return text

    def markdown(self) -> str:
        """The whole report as markdown; images link to the PNG files beside it."""
        parts = [f"# {self.title}\n"]
        for block in self.blocks:
            kind = block[0]
            if kind == "h2":
                parts.append(f"## {block[1]}\n")
            elif kind == "p":
                parts.append(f"{block[1]}\n")
            elif kind == "table":
                parts.append(to_markdown(block[1], FLOAT_FORMAT))
            else:
                parts.append(f"![{block[2]}]({block[1]})\n")
        return "\n".join(parts)

    def html(self) -> str:
        """The whole report as one self-contained HTML page (PNGs embedded as base64 data URIs)."""
        body = [f"<h1>{html.escape(self.title)}</h1>"]
        for block in self.blocks:
            kind = block[0]
            if kind == "h2":
                body.append(f"<h2>{html.escape(block[1])}</h2>")
            elif kind == "p":
                body.append(f"<p>{html.escape(block[1])}</p>")
            elif kind == "table":
                body.append(_html_table(block[1]))
            else:
                data = base64.b64encode(self.plots[block[1]]).decode()
                cap = html.escape(block[2])
                body.append(f'<figure><img alt="{cap}" src="data:image/png;base64,{data}"><figcaption>{cap}')
                body.append("</figcaption></figure>")
        style = (
            "body{font-family:sans-serif;max-width:60em;margin:2em auto}table{border-collapse:collapse}"
            "td,th{border:1px solid #bbb;padding:2px 8px;text-align:right}img{max-width:100%}"
        )
        return (
            f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(self.title)}</title>"
            f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
        )


def _cell(v: Any) -> str:
    return format(v, FLOAT_FORMAT) if isinstance(v, float) else str(v)


def _html_table(rows: list[dict[str, Any]]) -> str:
    rows = uniform(rows)
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(v))}</td>" for v in r.values()) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=PNG_DPI, bbox_inches="tight", metadata={"Software": None})
    return buf.getvalue()


# ----- plots: arrays in, PNG bytes out -----------------------------------------------------------------
def plot_fisher_vs_grad(F: np.ndarray, absG: np.ndarray, adv_rms: float) -> bytes:
    """Log-log hexbin density of |G_i| against F_i (both (P,); entries with F or |G| = 0 are left out)
    with the bound √mean(A²)·√F. When no entry has F, |G| > 0 (e.g. every advantage is 0), the
    histogram of F is drawn instead, with a note saying why."""
    keep = (F > 0) & (absG > 0)
    fig = Figure(figsize=(6, 4.5))
    ax = fig.add_subplot()
    if not keep.any():
        positive = F[F > 0]
        if positive.size:
            ax.hist(np.log10(positive), bins=50, color="C0")
        ax.set_xlabel("log10 Fisher F = mean(s²)")
        ax.set_ylabel("parameters")
        ax.set_title("|G| = 0 for every parameter: no reward signal (std(A) = 0)")
        return _png(fig)
    hb = ax.hexbin(F[keep], absG[keep], xscale="log", yscale="log", bins="log", gridsize=50, mincnt=1, cmap="viridis")
    fig.colorbar(hb, ax=ax, label="parameters per bin")
    x = np.geomspace(F[keep].min(), F[keep].max(), 100)
    ax.plot(x, adv_rms * np.sqrt(x), "r-", label="bound √mean(A²)·√F (= std(A)·√F when mean A = 0)")
    ax.set_xlabel("Fisher F = mean(s²)  [(log-prob / parameter unit)²]")
    ax.set_ylabel("|G| = |mean(A·s)|  [advantage × log-prob / parameter unit]")
    ax.set_title(f"F vs |G|: {int(keep.sum())} of {F.size} parameters with F, |G| > 0", fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
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
        ax.plot(q, [r["overlap"] for r in sel], "o" + style, color="C0", label=f"measured ({scope})")
        if scope == "global":
            ax.plot(q, [r["random"] for r in sel], "s:", color="C7", label="random baseline")
            ax.plot(q, [r["per_tensor_random"] for r in sel], "^-.", color="C1", label="per-tensor random baseline")
    ax.set_xscale("log")
    ax.set_xlabel("q (fraction of parameters kept)")
    ax.set_ylabel("overlap = |top-q |G| ∩ top-q F| / |top-q |G||")
    ax.set_ylim(0, 1.02)
    ax.set_title("Overlap of the top sets by |G| and by F")
    ax.legend(fontsize=8)
    return _png(fig)


def plot_tensor_shares(rows: list[dict[str, Any]]) -> bytes:
    """Each tensor's share of the global top-q set by F and by |G| beside its share of all parameters."""
    tensors = list(dict.fromkeys(r["tensor"] for r in rows))
    share = {(r["tensor"], r["metric"]): float(r["share"]) for r in rows}
    numel = {r["tensor"]: float(r["numel_share"]) for r in rows}
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
    ax.set_title("Which tensors hold the top parameters")
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
    """bf16 precision and recall of each predictor against the changed set, per optimizer cell."""
    cells = [f"{r['optimizer']}/{r['precision']}/lr={r['lr']:g}" for r in rows]
    x = np.arange(len(rows))
    width = 0.8 / max(len(predictors), 1)
    fig = Figure(figsize=(8, 4.5))
    axes = fig.subplots(1, 2, sharey=True)
    for ax, stat in zip(axes, ("precision", "recall"), strict=True):
        for j, p in enumerate(predictors):
            vals = [r.get(f"bf16_{p}_{stat}", float("nan")) for r in rows]
            ax.bar(
                x + (j - (len(predictors) - 1) / 2) * width, vals, width, label=p, color="C7" if p == "random" else None
            )
        ax.set_xticks(x, cells, rotation=30, ha="right", fontsize=7)
        ax.set_title(f"{stat} against the changed set (bf16)")
        ax.set_ylim(0, 1.02)
    axes[0].set_ylabel("fraction")
    axes[1].legend(fontsize=7)
    return _png(fig)


# ----- reading the stores -------------------------------------------------------------------------------
def _num(v: Any) -> float:
    """A stored scalar as a float for formatting: NaN when absent (None)."""
    return float("nan") if v is None else float(v)


def _finite(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _model_label(config: dict[str, Any]) -> str:
    model = config.get("model", {})
    if model.get("path"):
        return str(model["path"])
    demo = model.get("demo", {})
    return f"demo Llama (hidden {demo.get('hidden_size')}, {demo.get('num_layers')} layer(s))"


def _read_csv(fs: fsspec.AbstractFileSystem, path: str) -> list[dict[str, str]]:
    with fs.open(path, "r") as f:
        return list(csv.DictReader(f))


class _Run:
    """The complete artifacts of one run index, opened on demand."""

    def __init__(self, store: ArtifactStore, index: dict[str, Any]) -> None:
        self.store = store
        self.refs = {n: store.ref(a["stage"], a["key"]) for n, a in index["artifacts"].items()}
        self.missing = [n for n, r in self.refs.items() if n != "report" and not store.is_complete(r)]

    def has(self, instance: str) -> bool:
        return instance in self.refs and instance not in self.missing

    def group(self, instance: str, name: str) -> Any:
        return self.store.open_group(self.refs[instance], name, mode="r")

    def json(self, instance: str, name: str) -> Any:
        return self.store.read_json(self.refs[instance], name)

    def file(self, instance: str, name: str) -> str:
        return self.store.path(self.refs[instance], name)


def _skip(report: Report, what: str, instance: str) -> None:
    report.blocks.append(("p", f"{what}: skipped, {instance} is missing or incomplete in this run."))


def render_report(store: ArtifactStore, run_index: dict[str, Any]) -> Report:
    """Build the report of one run from its stores alone.

    Args:
        store: the artifact root the run lives under.
        run_index: a run index (``storage.runs.read_run_index``): ``name``, ``config`` (the pipeline
            config as JSON) and ``artifacts`` (instance name -> {stage, key}).

    Returns:
        The rendered :class:`Report`; instances that are absent or incomplete are in ``missing`` and
        their sections hold a note instead of numbers.
    """
    cfg = PipelineConfig.model_validate(run_index["config"])
    run = _Run(store, run_index)
    report = Report(title=f"covgrad report: {run_index.get('name', cfg.name)}", missing=list(run.missing))
    main = f"stats.{cfg.rollouts.analyse}.{centerings(cfg.rollouts.samplers[cfg.rollouts.analyse])[-1]}"
    report.numbers["main_stats"] = main
    report.blocks.append(("p", f"Model: {_model_label(run_index['config'])}. Main statistics: {main}."))
    if report.missing:
        report.blocks.append(("p", f"Missing or incomplete artifacts: {', '.join(report.missing)}."))
    _headline(report, run, cfg, main)
    _off_policy(report, run)
    _tokens(report, run)
    _update_check(report, run)
    return report


def _headline(report: Report, run: _Run, cfg: PipelineConfig, main: str) -> None:
    report.blocks.append(("h2", "Headline"))
    rows: list[dict[str, Any]] = [
        {"quantity": "model", "value": _model_label(cfg.model_dump(mode="json")), "note": cfg.name}
    ]
    finding = None
    if run.has(main):
        st = run.group(main, STATS)
        s = st.attrs["scalars"]
        finding = st.attrs.get("degenerate")
        F, G = st["F"][:], st["G"][:]
        adv_rms = math.sqrt(s["std_A"] ** 2 + s["mean_A"] ** 2)
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
        if np.any((F > 0) & (G != 0)):
            report.plots["fisher_vs_grad.png"] = plot_fisher_vs_grad(F, np.abs(G), adv_rms)
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
                note = f"random {_cell(r['random'])}, per-tensor random {_cell(r['per_tensor_random'])}"
                rows.append({"quantity": f"overlap(q={r['q']:g})", "value": r["overlap"], "note": note})
        report.plots["overlap.png"] = plot_overlap(overlap)
        shares = _read_csv(run.store.fs, run.file("masks", "tensors.csv"))
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
    for name, caption in (
        ("fisher_vs_grad.png", "F against |G| per parameter, with the bound line"),
        ("overlap.png", "Overlap against q with the random and per-tensor baselines"),
        ("tensor_shares.png", "Each tensor's share of the top set by F and by |G|"),
    ):
        if name in report.plots:
            report.blocks.append(("img", name, caption))


def _off_policy(report: Report, run: _Run) -> None:
    report.blocks.append(("h2", "Off-policy: policy vs sampler centering"))
    instances = sorted(n for n in run.refs if n.startswith("stats."))
    rows: list[dict[str, Any]] = []
    grads: dict[tuple[str, str], np.ndarray] = {}
    for inst in instances:
        _, sampler, centering = inst.split(".")
        if not run.has(inst):
            _skip(report, f"Off-policy row {sampler}/{centering}", inst)
            continue
        st = run.group(inst, STATS)
        s = st.attrs["scalars"]
        F, G = st["F"][:], st["G"][:]
        grads[(sampler, centering)] = G
        layout = ParamLayout.from_records(st.attrs["tensors"])
        finding = st.attrs.get("degenerate")
        ov = [] if finding else overlap_table(F, np.abs(G), layout, [Q_OFFPOLICY])
        ov = [r for r in ov if r["scope"] == "global"]
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
                "overlap_1pct": float(ov[0]["overlap"]) if ov else float("nan"),
                "finding": finding or "",
            }
        )
    kl = {r["sampler"]: r["kl_per_token"] for r in rows if r["centering"] == "sampler"}
    for r in rows:
        r["kl_per_token"] = kl.get(r["sampler"], 0.0)  # a property of the rollouts; 0 on-policy (μ = p)
        pair = (grads.get((r["sampler"], "sampler")), grads.get((r["sampler"], "policy")))
        if pair[0] is not None and pair[1] is not None and np.linalg.norm(pair[0]) > 0:
            r["rel_diff_G"] = float(np.linalg.norm(pair[0] - pair[1]) / np.linalg.norm(pair[0]))
    report.numbers["off_policy"] = [{k: _finite(v) for k, v in r.items()} for r in rows]
    if not rows:
        return
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


def _tokens(report: Report, run: _Run) -> None:
    if "tokens" not in run.refs:
        return
    report.blocks.append(("h2", "Token Fisher"))
    if not run.has("tokens"):
        _skip(report, "Token Fisher", "tokens")
        return
    g = run.group("tokens", TOKENS)
    scalars = g.attrs.get("scalars", {})
    modes = list(g.attrs.get("modes", []))
    vs_f = [
        {
            "mode": m,
            "N": scalars.get("N"),
            "rel_L2_vs_F": scalars.get(f"relerr_{m}_vs_seq"),
            "spearman_vs_F": scalars.get(f"spearman_{m}_vs_seq"),
            "expected_relerr": scalars.get(f"{m}_expected_relerr"),
        }
        for m in modes
        if f"relerr_{m}_vs_seq" in scalars
    ]
    if vs_f:
        report.blocks.append(("p", "Σ token Fisher / N against the sequence Fisher F = mean(s²), over parameters:"))
        report.blocks.append(("table", [{k: float("nan") if v is None else v for k, v in r.items()} for r in vs_f]))
    rows = [{"quantity": k, "value": v} for k, v in scalars.items() if isinstance(v, int | float | str)]
    report.numbers["tokens"] = {k: _finite(v) for k, v in scalars.items()}
    if rows:
        report.blocks.append(("table", rows))
    errors = g.attrs.get("errors_vs_seq") or []
    if errors:
        report.blocks.append(("table", errors))
    traced = [m for m in [g.attrs.get("main_mode"), "exact", *modes] if m and f"trace_{m}" in g]
    if traced and "entropy" in g:
        mode = traced[0]
        trace, entropy = g[f"trace_{mode}"][:], g["entropy"][:]
        valid = g["p_drawn"][:] > 0 if "p_drawn" in g else trace > 0
        if not np.any(trace[valid] > 0):
            return
        if int(valid.sum()) >= 2:
            rho = spearman(entropy[valid], trace[valid])
            report.numbers["tokens"]["spearman_trace_entropy"] = _finite(rho)
            report.blocks.append(("p", f"Spearman(per-position trace ({mode}), entropy) = {rho:.3g}"))
        report.plots["token_trace.png"] = plot_token_trace(entropy[valid], trace[valid], mode)
        report.blocks.append(("img", "token_trace.png", "Token Fisher trace against token entropy"))


def _update_check(report: Report, run: _Run) -> None:
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


# ----- writing --------------------------------------------------------------------------------------------
def write_report(fs: fsspec.AbstractFileSystem, directory: str, report: Report) -> list[str]:
    """Write the report's files into ``directory`` of ``fs`` and delete PNGs there that this report
    does not have (left by an earlier render); returns the written paths."""
    fs.makedirs(directory, exist_ok=True)
    for stale in fs.glob(f"{directory.rstrip('/')}/*.png"):
        if stale.rsplit("/", 1)[-1] not in report.plots:
            fs.rm(stale)
    files: dict[str, bytes] = {
        "report.md": report.markdown().encode(),
        "report.html": report.html().encode(),
        "headline.md": report.headline_markdown().encode(),
        "report.json": json.dumps(
            {"numbers": report.numbers, "missing": report.missing}, indent=1, default=_finite
        ).encode(),
        **report.plots,
    }
    paths = []
    for name, data in files.items():
        path = f"{directory.rstrip('/')}/{name}"
        fs.pipe_file(path, data)
        paths.append(path)
    return paths


def artifact_key(text: str) -> str:
    """A valid Prefect artifact key (lowercase letters, digits, dashes) made from ``text``."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", text.lower())).strip("-")


def publish(report: Report, name: str) -> None:
    """Prefect artifacts (the report's markdown without images, the headline table); only inside a
    flow or task run, where Prefect records them."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact
    from prefect.context import FlowRunContext, TaskRunContext

    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        return
    text = "\n".join(line for line in report.markdown().splitlines() if not line.startswith("!["))
    create_markdown_artifact(key=artifact_key(f"covgrad-report-{name}"), markdown=text, description="covgrad report")
    table = [{k: _cell(v) for k, v in r.items()} for r in report.headline]
    create_table_artifact(key=artifact_key(f"covgrad-headline-{name}"), table=table, description="covgrad headline")


def _compute(store: ArtifactStore, ref: ArtifactRef, spec: ReportSpec, upstream: dict[str, ArtifactRef]) -> None:
    index = {
        "name": spec.name,
        "config": spec.config,
        "artifacts": {n: {"stage": r.stage, "key": r.key} for n, r in upstream.items()},
    }
    report = render_report(store, index)
    write_report(store.fs, store.path(ref), report)
    publish(report, spec.name)
    log.info("report: %d plot(s), missing %s", len(report.plots), report.missing or "nothing")


@task(name="report")
def report_task(ref: ArtifactRef, spec: ReportSpec, upstream: dict[str, ArtifactRef]) -> StageResult:
    """Render the run's report from every upstream artifact (``upstream``: by instance name)."""
    return run_stage(ref, spec, lambda store, r: _compute(store, r, spec, upstream))
