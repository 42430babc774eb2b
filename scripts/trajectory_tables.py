"""Markdown tables of every finished trajectory under an artifact root (docs/trajectory.md's tables).

    python scripts/trajectory_tables.py /tmp/smol51root [--steps 1 4 16 32 64 100]

One row per trajectory artifact (``{root}/trajectory/<key>/`` with a completion marker), labelled by its
regime, optimizer, precision and lr: the per-step changed fraction d_1 (all steps and after the warmup),
d_k against independent per-step sets, persistence, the step-0 predictors' precision (= recall) on the
cumulative changed set at the given steps, the drift and absorption rules' precision / recall, per kind of
tensor, within |w_0| deciles, and the absorption threshold: the fraction of parameters whose half bf16 gap
h(w_0) is at most the learning rate (an Adam step moves a coordinate by about lr).
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import numpy as np
import xarray as xr

PREDICTORS = ("F", "absG", "absrho", "drift", "smallw", "random", "tensor_random")
KS = (2, 4, 8, 16, 32)


def runs(root: Path) -> list[tuple[str, xr.Dataset, Path]]:
    """(label, Dataset, artifact dir) of every complete trajectory, ordered by regime, precision and lr."""
    out = []
    for d in sorted((root / "trajectory").glob("*/")):
        if not (d / "_COMPLETE.json").exists():
            continue
        s = json.loads((d / "summary.json").read_text())
        label = f"{s.get('regime', 'rl')}-{s.get('optimizer')}-{s.get('precision')}-{s.get('lr'):g}"
        out.append((label, xr.open_zarr(d / "trajectory.zarr"), d))
    return sorted(out, key=lambda r: (r[1].attrs["summary"].get("regime", ""), r[0]))


def table(rows: list[dict]) -> str:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def half_gap(bits: np.ndarray) -> np.ndarray:
    """Half the gap to the nearer bf16 neighbour of each bf16 value (bits (P,) uint16), float64."""
    mag = (bits & 0x7FFF).astype(np.uint32)

    def val(m: np.ndarray) -> np.ndarray:
        return (m.astype(np.uint32) << 16).view(np.float32).astype(np.float64)

    up = val(mag + 1) - val(mag)
    down = np.where(mag > 0, val(mag) - val(np.maximum(mag, 1) - 1), up)
    return np.minimum(up, down) / 2


def summary_rows(items: list[tuple[str, xr.Dataset, Path]]) -> list[dict]:
    rows = []
    for label, ds, d in items:
        s = ds.attrs["summary"]
        P, K = int(s["P"]), int(ds.sizes["step"])
        d1 = ds.n_changed_step.values / P
        hist = ds.persist_hist.values[-1]
        row = {
            "cell": label,
            "steps": K,
            "d_1 mean": float(d1.mean()),
            "d_1 after step 50": float(d1[50:].mean()) if K > 50 else float("nan"),
            "cumulative": float(ds.n_changed_cum.values[-1] / P),
            "Jaccard consecutive": float(np.nanmean(ds.jaccard_prev.values[1:])),
            "changed in >= 10% of steps": float(hist[max(1, K // 10) :].sum() / P),
            "changed in >= 50% of steps": float(hist[max(1, K // 2) :].sum() / P),
            "reward first": float(ds.reward.values[0]),
            "reward last 10": float(np.nanmean(ds.reward.values[-10:])),
            "KL last": float(ds.kl.values[-1]),
        }
        if (d / "deltas" / "start.npy").exists() and s.get("lr"):
            start = np.load(d / "deltas" / "start.npy")
            if start.dtype == np.uint16:
                row["h(w_0) <= lr"] = float(np.mean(half_gap(start) <= float(s["lr"])))
        rows.append(row)
    return rows


def dk_rows(items: list[tuple[str, xr.Dataset, Path]]) -> list[dict]:
    rows = []
    for label, ds, _ in items:
        if "dk" not in ds:
            continue
        ks = ds.k.values.tolist()
        row: dict = {"cell": label, "d_1": float(np.nanmean(ds.dk.values[ks.index(1)]))}
        for k in KS:
            if k in ks:
                dk, ind = np.nanmean(ds.dk.values[ks.index(k)]), np.nanmean(ds.independent.values[ks.index(k)])
                row[f"d_{k} (indep.)"] = f"{dk:.4g} ({ind:.4g})"
        k = max(x for x in KS if x in ks and not np.all(np.isnan(ds.dk.values[ks.index(x)])))
        row[f"ratio d_{k}"] = float(
            np.nanmean(ds.dk.values[ks.index(k)]) / np.nanmean(ds.independent.values[ks.index(k)])
        )
        rows.append(row)
    return rows


def predictor_rows(items: list[tuple[str, xr.Dataset, Path]], steps: list[int]) -> list[dict]:
    rows = []
    for label, ds, _ in items:
        K = int(ds.sizes["step"])
        for t in [t for t in steps if t <= K]:
            row: dict = {
                "cell": label,
                "step": t,
                "changed": float(ds.n_changed_cum.values[t - 1] / ds.attrs["summary"]["P"]),
            }
            for p in PREDICTORS:
                key = f"cum_{p}_precision"
                if key in ds:
                    row[p] = float(ds[key].values[t - 1])
            for rule in ("drift_rule", "absorb"):
                if f"cum_{rule}_precision" in ds:
                    pr, rc = ds[f"cum_{rule}_precision"].values[t - 1], ds[f"cum_{rule}_recall"].values[t - 1]
                    row[f"{rule} rule P / R"] = f"{pr:.3f} / {rc:.3f}"
            rows.append(row)
    return rows


def step_predictor_rows(items: list[tuple[str, xr.Dataset, Path]], after: int) -> list[dict]:
    """Each predictor's precision (= recall) on the per-step changed sets, mean over the steps after ``after``."""
    rows = []
    for label, ds, _ in items:
        K = int(ds.sizes["step"])
        if after >= K:
            continue
        row: dict = {"cell": label, "steps": f"{after + 1}-{K}"}
        for p in PREDICTORS:
            if f"step_{p}_precision" in ds:
                row[p] = float(np.nanmean(ds[f"step_{p}_precision"].values[after:]))
        for rule in ("drift_rule", "absorb"):
            if f"step_{rule}_precision" in ds:
                pr = np.nanmean(ds[f"step_{rule}_precision"].values[after:])
                rc = np.nanmean(ds[f"step_{rule}_recall"].values[after:])
                row[f"{rule} rule P / R"] = f"{pr:.3f} / {rc:.3f}"
        rows.append(row)
    return rows


def decile_predictor_rows(items: list[tuple[str, xr.Dataset, Path]]) -> list[dict]:
    """Within each |w_0| decile that changed by the last step, each decile predictor's precision on the
    cumulative set there (k = the decile's changed count)."""
    rows = []
    for label, ds, _ in items:
        names = [p for p in PREDICTORS if f"decile_cum_{p}_precision" in ds]
        for dec in range(ds.sizes.get("decile", 0)):
            values = {p: float(ds[f"decile_cum_{p}_precision"].values[-1, dec]) for p in names}
            if all(np.isnan(v) for v in values.values()):
                continue
            rows.append({"cell": label, "decile": dec, **values})
    return rows


def cost_rows(items: list[tuple[str, xr.Dataset, Path]]) -> list[dict]:
    """The stage's seconds and peak resident memory (from its completion marker) and the code it ran."""
    rows = []
    for label, _, d in items:
        marker = json.loads((d / "_COMPLETE.json").read_text())
        rows.append(
            {
                "cell": label,
                "seconds": float(marker.get("seconds", float("nan"))),
                "peak GiB": float(marker.get("peak_rss_bytes", float("nan"))) / 2**30,
                "commit": str(marker.get("environment", {}).get("git_commit", ""))[:7],
            }
        )
    return rows


def kind_rows(items: list[tuple[str, xr.Dataset, Path]]) -> list[dict]:
    rows = []
    for label, ds, _ in items:
        if "dk_kind" not in ds:
            continue
        ks = ds.k.values.tolist()
        k = max(x for x in KS if x in ks and not np.all(np.isnan(ds.dk.values[ks.index(x)])))
        for j, kind in enumerate(ds.kind_name.values.tolist()):
            d1 = np.nanmean(ds.dk_kind.values[ks.index(1), :, j])
            dk, ind = (
                np.nanmean(ds.dk_kind.values[ks.index(k), :, j]),
                np.nanmean(ds.independent_kind.values[ks.index(k), :, j]),
            )
            rows.append(
                {
                    "cell": label,
                    "kind": kind,
                    "d_1": float(d1),
                    f"d_{k}": float(dk),
                    "ratio": float(dk / ind),
                    "Jaccard": float(np.nanmean(ds.jaccard_kind.values[1:, j])),
                }
            )
    return rows


def decile_rows(items: list[tuple[str, xr.Dataset, Path]]) -> list[dict]:
    rows = []
    for label, ds, _ in items:
        if "dk_decile" not in ds:
            continue
        ks = ds.k.values.tolist()
        row: dict = {"cell": label}
        for dec in range(ds.sizes["decile"]):
            row[f"d{dec}"] = float(np.nanmean(ds.dk_decile.values[ks.index(1), :, dec]))
        rows.append(row)
    return rows


def zero_rows(items: list[tuple[str, xr.Dataset, Path]], steps: list[int]) -> list[dict]:
    """The weights whose bf16 value is exactly 0 at step 0 (a quantized checkpoint's grid puts some there; a bf16
    zero moves at any update) against the rest: their share of P, and at each given step the per-step changed
    fraction d_1, the zeros' share of that step's set, d_1 and the cumulative changed fraction among the nonzero
    weights (from the stored bit-packed step sets)."""
    import zarr

    rows = []
    for label, _, d in items:
        start_path = d / "deltas" / "start.npy"
        if not start_path.exists():
            continue
        start = np.load(start_path)
        if start.dtype != np.uint16:
            continue
        P = start.size
        zero = (start & 0x7FFF) == 0
        nonzero = ~zero
        packed = zarr.open_group(str(d / "trajectory.zarr"), mode="r")["changed"]
        cum = np.zeros(P, dtype=bool)
        row: dict = {"cell": label, "zero at step 0": float(zero.mean())}
        for t in range(1, max(steps) + 1):
            if t > packed.shape[0]:
                break
            step = np.unpackbits(packed[t - 1], count=P).view(np.bool_)
            cum |= step
            if t in steps:
                moved = max(int(step.sum()), 1)
                row[f"d_1 / zero share / d_1 nonzero / cum nonzero @{t}"] = (
                    f"{step.mean():.3%} / {(step & zero).sum() / moved:.3f} / "
                    f"{(step & nonzero).sum() / nonzero.sum():.3%} / {(cum & nonzero).sum() / nonzero.sum():.3%}"
                )
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 4, 16, 32, 64, 100])
    ap.add_argument("--after", type=int, default=50, help="per-step predictor means over the steps after this one")
    args = ap.parse_args()
    warnings.simplefilter("ignore", RuntimeWarning)  # means over empty windows print as nan
    items = runs(args.root)
    if not items:
        raise SystemExit(f"no finished trajectory under {args.root}/trajectory; run the config first")
    for title, rows in (
        ("Changed fractions and persistence", summary_rows(items)),
        ("d_k against independent per-step sets (mean over windows)", dk_rows(items)),
        (
            "Step-0 predictors on the cumulative changed set (precision = recall; rules P / R)",
            predictor_rows(items, args.steps),
        ),
        (
            "Step-0 predictors on the per-step changed sets after the warmup (precision = recall; rules P / R)",
            step_predictor_rows(items, args.after),
        ),
        ("Within |w_0| deciles: precision on the cumulative set at the last step", decile_predictor_rows(items)),
        ("By kind of tensor", kind_rows(items)),
        ("d_1 within |w_0| deciles (d0 = smallest |w_0|)", decile_rows(items)),
        ("Weights exactly zero at step 0 against the rest", zero_rows(items, args.steps)),
        ("Stage cost", cost_rows(items)),
    ):
        if rows:
            print(f"### {title}\n\n{table(rows)}\n")


if __name__ == "__main__":
    main()
