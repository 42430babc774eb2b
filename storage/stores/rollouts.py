"""The rollouts store (``rollouts.zarr``, arrays declared in :mod:`storage.schema`): creating its arrays,
writing batches of rows, and reading rows back as typed batches."""

from __future__ import annotations

from typing import Any

import numpy as np

from covgrad.config import SamplerSection
from covgrad.rollouts import RolloutBatch
from storage.schema import ROLLOUTS as STORE
from storage.schema import create, var


def read_batch(ro: Any, lo: int, hi: int, trim: bool = True) -> RolloutBatch:
    """Rollouts [lo, hi) of the open rollouts group ``ro`` as a :class:`RolloutBatch` on the CPU.
    ``trim`` drops the columns past the batch's longest row; ``False`` keeps the store's padded width."""
    return RolloutBatch.from_arrays(
        ro["tokens"][lo:hi],
        ro["prompt_len"][lo:hi],
        ro["response_len"][lo:hi],
        ro["response_mask"][lo:hi],
        ro["advantage"][lo:hi],
        ro["group"][lo:hi],
        trim=trim,
    )


# every rollouts store holds these (storage/schema.py); μ arrays as ``store_mu`` says; advantage at the end
BASE_ARRAYS = (
    "tokens",
    "response_mask",
    "prompt_len",
    "response_len",
    "group",
    "prompt_index",
    "sample_index",
    "reward",
    "sampler_logp",
    "prompt",
    "response",
)


def dataset_attrs(mu_known: bool, rewarded: bool) -> dict[str, bool]:
    """The attrs that mark a dataset of responses: ``mu_known: false`` (μ unknown, ``sampler_logp`` NaN) and
    ``rewards: false`` (``reward`` and ``advantage`` NaN); sampled rollouts get neither (their attrs stay as
    they were)."""
    return {k: False for k, v in (("mu_known", mu_known), ("rewards", rewarded)) if not v}


def mu_known(ro: Any) -> bool:
    """False when the open rollouts group ``ro`` is a dataset whose μ is unknown (:func:`dataset_attrs`)."""
    return bool(ro.attrs.get("mu_known", True))


def require_mu(ro: Any, what: str) -> None:
    """ValueError naming ``what`` (the reader) when the open rollouts group ``ro`` is a dataset whose μ is
    unknown (:func:`mu_known`), so that it has no sampler log-probs or sampler centering."""
    if not mu_known(ro):
        raise ValueError(
            f"{what}: the rollouts of sampler {ro.attrs['sampler']!r} are a dataset of responses whose μ is unknown "
            "(format responses), so they have no sampler log-probs and no sampler centering"
        )


def create_rollout_arrays(g: Any, N: int, width: int, T: int, V: int, rows: int, s: SamplerSection) -> None:
    """Create the arrays of a rollouts store of N samples: token rows of ``width``, T response positions, V
    vocabulary entries, chunks of ``rows`` samples, and the μ arrays ``s.store_mu`` asks for."""
    shapes = {"sample": N, "token": width, "position": T, "vocab": V, "k": s.mu_topk}
    mu = {"full": ("mu_logp",), "topk": ("mu_topk_ids", "mu_topk_logp", "mu_tail")}.get(s.store_mu, ())
    for name in (*BASE_ARRAYS, *mu):
        create(g, STORE, name, [shapes[d] for d in var(STORE, name).dims], rows=rows)


def write_rollout_rows(g: Any, lo: int, out: dict[str, Any], width: int) -> None:
    """Write one batch of rows starting at sample ``lo`` (arrays padded to the store's width)."""
    n = len(out["prompt_len"])
    for name, value in out.items():
        v = value.numpy() if hasattr(value, "numpy") else np.asarray(value)  # a CPU tensor or an array
        if name in ("tokens", "response_mask"):
            padded = np.zeros((n, width), dtype=v.dtype)
            padded[:, : v.shape[1]] = v
            v = padded
        g[name][lo : lo + n] = v
