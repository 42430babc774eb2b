"""A rendered report as ordered blocks, and its markdown, HTML and headline forms.

No numbers are computed here: every value in a block was read from a store by
:mod:`covgrad.report.sections`. ``blocks`` holds ``("h2", text)``, ``("p", text)``, ``("table", rows)``
(rows: a list of dicts) and ``("img", file_name, caption)``.
"""

from __future__ import annotations

import base64
import html
import math
from dataclasses import dataclass, field
from typing import Any

from covgrad.tables import to_markdown, uniform

FLOAT_FORMAT = ".4g"
# Wide tables scroll inside their own box instead of being cut at the page's right edge.
STYLE = (
    "body{font-family:sans-serif;max-width:60em;margin:2em auto}"
    ".table{overflow-x:auto;max-width:100%;margin:0.5em 0}table{border-collapse:collapse}"
    "td,th{border:1px solid #bbb;padding:2px 8px;text-align:right;white-space:nowrap}img{max-width:100%}"
)
OFF_POLICY_HEADLINE = (
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


def cell(v: Any) -> str:
    """One table cell as text: floats with ``FLOAT_FORMAT``, everything else with ``str``."""
    return format(v, FLOAT_FORMAT) if isinstance(v, float) else str(v)


def num(v: Any) -> float:
    """A stored scalar as a float for formatting: NaN when absent (None)."""
    return float("nan") if v is None else float(v)


def finite(v: Any) -> Any:
    """``v`` with a non-finite float replaced by None (JSON has no NaN)."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


@dataclass
class Report:
    """A rendered report: ordered blocks, PNG plots by file name, numbers, and missing instances."""

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
            rows = [{c: float("nan") if r.get(c) is None else r[c] for c in OFF_POLICY_HEADLINE} for r in off]
            text += "\n### Off-policy: policy vs sampler centering\n\n" + to_markdown(rows, FLOAT_FORMAT)
            for r in off:
                if r.get("finding"):
                    text += f"\n{r['sampler']}/{r['centering']}: {r['finding']}\n"
        tok = self.numbers.get("tokens")
        if tok:
            text += f"\n{_token_line(tok)}\n"
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
                body.append(html_table(block[1]))
            else:
                data = base64.b64encode(self.plots[block[1]]).decode()
                cap = html.escape(block[2])
                body.append(f'<figure><img alt="{cap}" src="data:image/png;base64,{data}"><figcaption>{cap}')
                body.append("</figcaption></figure>")
        return (
            f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(self.title)}</title>"
            f"<style>{STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
        )


def summary_lines(numbers: dict[str, Any], missing: list[str]) -> list[str]:
    """The run's key numbers in a few terminal lines (``report.json``'s ``numbers`` in; the full tables
    are in ``headline.md`` and ``report.html``): findings in words, the main scalars, the global overlap
    per q against its random baseline, and the missing instances."""
    lines = []
    if numbers.get("degenerate"):
        lines.append(f"finding: {numbers['degenerate']}")
    keys = ("N", "P", "std_A", "max_abs_rho", "bound_violations", "spearman_F_absG")
    main = [f"{k} {cell(numbers[k])}" for k in keys if numbers.get(k) is not None]
    if main:
        lines.append(f"{numbers.get('main_stats', 'main')}: {', '.join(main)}")
    overlap = [r for r in numbers.get("overlap", []) if r["scope"] == "global"]
    if overlap:
        lines.append(
            "overlap(q) vs random: "
            + ", ".join(f"{r['q']:g}: {cell(r['overlap'])} vs {cell(r['random'])}" for r in overlap)
        )
    if numbers.get("crossfit_undefined"):
        lines.append(numbers["crossfit_undefined"])
    lines += [
        f"{r['sampler']}/{r['centering']}: {r['finding']}" for r in numbers.get("off_policy", []) if r.get("finding")
    ]
    if missing:
        lines.append(f"missing or incomplete: {', '.join(missing)}")
    return lines


def html_table(rows: list[dict[str, Any]]) -> str:
    """An HTML table of ``rows`` inside a box that scrolls sideways when the table is wider than the page."""
    rows = uniform(rows)
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell(v))}</td>" for v in r.values()) + "</tr>" for r in rows)
    return f'<div class="table"><table><tr>{head}</tr>{body}</table></div>'


def _token_line(tok: dict[str, Any]) -> str:
    """The token Fisher's one headline line: Σ f / N against F, each estimator against exact, cross term."""
    main = tok.get("main_mode", "exact")
    parts = [
        f"Σ f / N vs F rel. L2 {num(tok.get(f'relerr_{main}_vs_seq')):.3g}, "
        f"Spearman {num(tok.get(f'spearman_{main}_vs_seq')):.3g}"
    ]
    for label, key, expected in (
        ("top-k", "topk_vs_exact", None),
        ("Monte Carlo", "mc_vs_exact", "mc_expected_relerr"),
        ("probe", "probe_vs_exact", "probe_expected_relerr"),
    ):  # against exact only where exact ran
        if math.isfinite(num(tok.get(key))):
            note = f" (expected {num(tok.get(expected)):.3g})" if expected else ""
            parts.append(f"{label} vs exact rel. L2 {num(tok.get(key)):.3g}{note}")
    parts.append(f"cross-term ratio {num(tok.get('cross_term_ratio')):.3g}")
    return f"token Fisher ({main}): {'; '.join(parts)}"
