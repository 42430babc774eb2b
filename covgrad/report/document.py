"""A rendered report as ordered blocks, and its markdown, HTML and headline forms.

No numbers are computed here: every value in a block was read from a store or computed by
:mod:`covgrad.report.sections`; :func:`findings` turns ``Report.numbers`` into sentences.
``blocks`` holds ``("h2", text)``, ``("p", text)``, ``("table", rows)`` (rows: a list of dicts) and
``("img", file_name, caption)``.
"""

from __future__ import annotations

import base64
import html
import math
from dataclasses import dataclass, field
from typing import Any

from covgrad.report.glossary import meaning
from covgrad.tables import to_markdown, uniform

FLOAT_FORMAT = ".4g"
# Tables wrap their cells to the page width, and a table still wider scrolls with the whole page: no
# element has its own scroll bar (no overflow other than visible), so no column is ever hidden.
STYLE = (
    "body{font-family:sans-serif;max-width:80em;margin:2em auto;padding:0 1em}"
    ".table{margin:0.5em 0}table{border-collapse:collapse}"
    "td,th{border:1px solid #bbb;padding:2px 6px;text-align:right;white-space:normal;overflow-wrap:anywhere}"
    "th{cursor:help;text-decoration:underline dotted}img{max-width:100%}"
    "dl.glossary dt{font-family:monospace;font-weight:bold}dl.glossary dd{margin:0 0 0.4em 2em}"
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
        """The headline as markdown (what ``covgrad report`` prints): the findings in words, the main table,
        the off-policy table, and one line each for the token Fisher and the update check when present."""
        words = self.numbers.get("findings") or []
        text = f"## {self.title}\n\n" + "".join(f"{w}\n\n" for w in words)
        text += to_markdown(self.headline, FLOAT_FORMAT) if self.headline else ""
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

    def names(self) -> list[str]:
        """Every column name and every ``quantity`` of the report's tables, in order of appearance."""
        seen: dict[str, None] = {}
        for block in self.blocks:
            if block[0] == "table" and block[1]:
                for row in uniform(block[1]):
                    seen |= dict.fromkeys(row)
                    if "quantity" in row:
                        seen[str(row["quantity"])] = None
        return list(seen)

    def html(self) -> str:
        """The whole report as one self-contained HTML page (PNGs embedded as base64 data URIs); every
        column header and quantity carries its glossary meaning as a tooltip, and the page ends with the
        glossary of the names it shows (footnotes; docs/reading.md has them all)."""
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
        terms = [(n, meaning(n)) for n in self.names()]
        body.append("<h2 id='glossary'>Reading the tables</h2><dl class='glossary'>")
        body += [f"<dt>{html.escape(n)}</dt><dd>{html.escape(m)}</dd>" for n, m in terms if m]
        body.append("</dl>")
        return (
            f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(self.title)}</title>"
            f"<style>{STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
        )


def count(n: int) -> str:
    """A parameter count in words: 3.5M, 224.7k, 950."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


def _ci(iv: Any, fmt: str) -> str:
    """`` (95% CI lo–hi)`` of an interval pair, or nothing when there is none (or it is NaN)."""
    if not iv or not all(isinstance(v, int | float) and math.isfinite(v) for v in iv):
        return ""
    return f" (95% CI {format(iv[0], fmt)}–{format(iv[1], fmt)})"


def _pct(v: float) -> str:
    """A fraction as a percentage with two significant digits (0.0006 -> 0.06%, 0.61 -> 61%)."""
    return f"{v * 100:.2g}%" if v * 100 < 10 else f"{v * 100:.0f}%"


def findings(numbers: dict[str, Any]) -> list[str]:
    """The run's findings as sentences, from ``Report.numbers`` (the stores' values and intervals): the
    task, then either the degenerate condition or the overlap at the q nearest 1% against both
    baselines, Spearman, the bound in sample and in the cross-fit with max |ρ|, the zero-mean test
    against its null band, the token Fisher's error against F with its interval, and each off-policy
    finding."""
    out = []
    t = numbers.get("task", {})
    if t.get("N") is not None:
        var = t.get("groups_with_reward_variance")
        out.append(
            f"Task: {t['N']} samples in {t['groups']} prompt groups of {t['group_size']} from sampler "
            f"{t['sampler']} (at most {t['T']} new tokens, temperature {t['temperature']:g}); mean reward "
            f"{t['mean_reward']:.3g}, {var} of {t['groups']} groups with reward variance; advantage {t['advantage']}, "
            f"{t['centering']} centering; {count(int(numbers.get('P', 0)))} parameters "
            f"({', '.join(t['selection']) if t.get('selection') else 'every trainable one'})."
        )
    off = numbers.get("off_policy", [])
    off_words = [f"{r['sampler']}/{r['centering']}: {r['finding']}." for r in off if r.get("finding")]
    if numbers.get("degenerate"):
        return [*out, f"finding: {numbers['degenerate']}", *off_words]
    iv = numbers.get("intervals", {})
    overlap = [r for r in numbers.get("overlap", []) if r["scope"] == "global"]
    if overlap:
        r = min(overlap, key=lambda r: abs(math.log(r["q"] / 0.01)))
        ptr, rnd = r["per_tensor_random"], r["random"]
        q = _pct(r["q"])
        out.append(
            f"The top {q} of parameters by |G| shares {_pct(r['overlap'])}"
            f"{_ci(iv.get('overlap', {}).get(r['q']), '.0%')} with the top {q} by F: "
            f"{r['overlap'] / ptr:.3g}× the per-tensor random baseline ({ptr:.3g}) and "
            f"{r['overlap'] / rnd:.3g}× random ({rnd:.3g})."
        )
    if numbers.get("spearman_F_absG") is not None:
        rho_s = numbers["spearman_F_absG"]
        out.append(f"Spearman(F, |G|) = {rho_s:.3g}{_ci(iv.get('spearman_F_absG'), '.3g')} over all parameters.")
    if numbers.get("bound_violations") is not None:
        P = count(int(numbers["P"]))
        cross = [numbers.get(f"crossfit_frac_exceed_{d}") for d in ("even_F_odd_G", "odd_F_even_G")]
        if numbers.get("crossfit_undefined"):
            where = numbers["crossfit_undefined"]
        else:
            where = f"{' and '.join(_pct(num(c)) for c in cross)} in the two cross-fit directions"
        out.append(
            f"{numbers['bound_violations']} of {P} parameters exceed the bound |Cov| ≤ std(A)·√Fvar in sample, "
            f"{where}; max |ρ| = {num(numbers.get('max_abs_rho')):.3g}{_ci(iv.get('max_abs_rho'), '.3g')}."
        )
    for k, label in (("trace", "N·‖m‖² / tr Var(s)"), ("coord", "mean_i N·m_i² / Var_i")):
        v, band = numbers.get(f"zero_mean_{k}"), iv.get(f"null_band_{k}")
        if v is None or not band or not math.isfinite(num(v)):
            continue
        inside = band[0] <= v <= band[1]
        z = iv.get(f"z_{k}")
        zt = f" (cross-fit z = {z:.2f})" if z is not None and math.isfinite(num(z)) else ""
        verdict = "consistent with E[s] = 0" if inside else "evidence against E[s] = 0 at the 5% level"
        if not inside and k == "coord":
            verdict += (
                ", weak alone: this test leans upward where many coordinates are carried by events the sample lacks "
                "(LM-head rows of tokens never drawn), the trace test does not (docs/reading.md)"
            )
        side = "inside" if inside else "outside"
        band_text = f"{band[0]:.3g}–{band[1]:.3g}"
        out.append(f"Zero-mean test: {label} = {v:.3g}, {side} its 95% band {band_text}{zt}: {verdict}.")
    tok = numbers.get("tokens") or {}
    mode = tok.get("main_mode")
    if mode and tok.get(f"relerr_{mode}_vs_seq") is not None:
        ci = _ci((tok.get(f"relerr_{mode}_vs_seq_lo"), tok.get(f"relerr_{mode}_vs_seq_hi")), ".3g")
        out.append(
            f"Token Fisher ({mode}, {tok.get('N')} samples): Σ f / N differs from F = mean(s²) by relative L2 "
            f"{tok[f'relerr_{mode}_vs_seq']:.3g}{ci}."
        )
    return out + off_words


def summary_lines(numbers: dict[str, Any], missing: list[str]) -> list[str]:
    """The run's key numbers in a few terminal lines (``report.json``'s ``numbers`` in; the full tables
    are in ``headline.md`` and ``report.html``): the findings in words (``findings``), the global overlap
    per q against the per-tensor random and the random baseline, and the missing instances."""
    lines = list(numbers.get("findings") or findings(numbers))
    overlap = [r for r in numbers.get("overlap", []) if r["scope"] == "global"]
    if overlap:
        lines.append(
            "overlap(q) vs per-tensor random, random: "
            + ", ".join(
                f"{r['q']:g}: {cell(r['overlap'])} vs {cell(r['per_tensor_random'])}, {cell(r['random'])}"
                for r in overlap
            )
        )
    if missing:
        lines.append(f"missing or incomplete: {', '.join(missing)}")
    return lines


def _tip(name: str) -> str:
    """`` title="…"`` with the glossary meaning of ``name`` (escaped), or nothing."""
    m = meaning(name)
    return f' title="{html.escape(m)}"' if m else ""


def html_table(rows: list[dict[str, Any]]) -> str:
    """An HTML table of ``rows`` whose cells wrap to the page width (no inner scroll box); headers and
    ``quantity`` cells carry their glossary meaning as a tooltip."""
    rows = uniform(rows)
    head = "".join(f"<th{_tip(str(c))}>{html.escape(str(c))}</th>" for c in rows[0])
    body = "".join(
        "<tr>"
        + "".join(f"<td{_tip(str(v)) if k == 'quantity' else ''}>{html.escape(cell(v))}</td>" for k, v in r.items())
        + "</tr>"
        for r in rows
    )
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
