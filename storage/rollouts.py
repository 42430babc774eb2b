"""The rollouts store (``rollouts.zarr``, arrays declared in :mod:`storage.schema`): creating its arrays,
writing batches of rows, and reading rows back as typed batches."""

from __future__ import annotations

from typing import Any

import numpy as np

from covgrad.batch import RolloutBatch
from covgrad.config import SamplerSection
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
