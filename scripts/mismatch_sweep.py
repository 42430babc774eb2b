"""The mismatch sweep's table and plot (docs/formats.md) from a finished run's off-policy table.

    python scripts/mismatch_sweep.py ROOT RUN OUT.png [TITLE]

prints the rows sorted by k3-KL (markdown, the columns docs/formats.md shows) and writes the plot of
``covgrad.report.plots.plot_mismatch_sweep`` to OUT.png.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from covgrad.report.plots import plot_mismatch_sweep
from covgrad.tables import to_markdown
from storage.artifacts import ArtifactStore
from storage.runs import read_run_index

COLUMNS = (
    "sampler",
    "centering",
    "k3_kl",
    "rollout_probs_diff_mean",
    "rollout_probs_diff_max",
    "chi2_token",
    "kl_per_token",
    "rel_diff_G",
    "rel_diff_stats",
    "zero_mean_trace",
    "max_abs_rho",
    "bound_violations",
)


def main(root: str, run: str, out: str, title: str | None = None) -> None:
    store = ArtifactStore(root)
    ref = read_run_index(store, run)["artifacts"]["offpolicy"]
    rows = json.loads(store.fs.cat_file(store.path(store.ref("offpolicy", ref["key"]), "offpolicy.json")))
    rows.sort(key=lambda r: (r["k3_kl"], r["sampler"], r["centering"]))
    Path(out).write_bytes(plot_mismatch_sweep(rows, title or f"Mismatch sweep: {run}"))
    print(to_markdown([{c: float("nan") if r[c] is None else r[c] for c in COLUMNS} for r in rows], ".3g"))


if __name__ == "__main__":
    main(*sys.argv[1:])
