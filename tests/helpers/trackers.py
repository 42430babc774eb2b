"""What every tracker test expects to read back: the report's headline scalars at step 0 and the external
trajectory's per-step series, by the tag covgrad logs them under (after ``covgrad/``)."""

from typing import Any

import numpy as np
import xarray as xr


def headline_tags(n: dict[str, Any]) -> dict[str, float]:
    """Tag -> value of the headline scalars, from ``report.json``'s numbers ``n``."""
    iv = n["intervals"]
    row = next(r for r in n["overlap"] if r["scope"] == "global" and r["q"] == 0.01)
    return {
        "overlap_1pct": row["overlap"],
        "overlap_1pct_lo": iv["overlap"]["0.01"][0],
        "overlap_1pct_hi": iv["overlap"]["0.01"][1],
        "overlap_1pct_random": row["random"],
        "overlap_1pct_per_tensor_random": row["per_tensor_random"],
        "spearman_F_absG": n["spearman_F_absG"],
        "spearman_F_absG_lo": iv["spearman_F_absG"][0],
        "max_abs_rho": n["max_abs_rho"],
        "max_abs_rho_lo": iv["max_abs_rho"][0],
        "max_abs_rho_hi": iv["max_abs_rho"][1],
        "bound_violations": n["bound_violations"],
        "zero_mean_trace": n["zero_mean_trace"],
        "zero_mean_trace_null_hi": iv["null_band_trace"][1],
        "zero_mean_coord": n["zero_mean_coord"],
        "zero_mean_coord_null_lo": iv["null_band_coord"][0],
        "zero_mean_coord_null_hi": iv["null_band_coord"][1],
        "zero_mean_coord_z": iv["z_coord"],
    }


def trajectory_tags(ds: xr.Dataset) -> dict[str, np.ndarray]:
    """Tag (after ``covgrad/trajectory/``) -> (K,) values at the trajectory's recorded steps."""
    P = int(ds.attrs["summary"]["P"])
    return {
        "frac_changed_step": ds.n_changed_step.values / P,
        "frac_changed_cum": ds.n_changed_cum.values / P,
        "lr": ds.lr.values,
        "kl": ds.kl.values,
        "mismatch_rollout_corr_k3_kl": ds.mismatch_rollout_corr_k3_kl.values,
        "cum_F_precision": ds.cum_F_precision.values,
        "cum_drift_rule_precision": ds.cum_drift_rule_precision.values,
        "cum_drift_rule_recall": ds.cum_drift_rule_recall.values,
        "step_absG_precision": ds.step_absG_precision.values,
    }
