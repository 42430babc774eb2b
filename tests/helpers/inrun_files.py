"""Reading and comparing the step files of in-run folds (``step_{t:06d}.npz`` and ``.json``) in tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np


def step_files(out: Path, step: int = 0) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A step's npz members in order (as loaded) and its JSON summary without ``seconds``."""
    with np.load(out / f"step_{step:06d}.npz") as f:
        arrays = {name: f[name] for name in f.files}
    summary = json.loads((out / f"step_{step:06d}.json").read_text())
    summary.pop("seconds")
    return arrays, summary


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Same dtype, shape and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and np.asarray(a).tobytes() == np.asarray(b).tobytes()


def assert_same_files(got_out: Path, want_out: Path, step: int = 0) -> None:
    """Two folds' files of a step: the same npz members (names, order, bytes) and JSON summary."""
    (ga, gs), (wa, ws) = step_files(got_out, step), step_files(want_out, step)
    assert list(ga) == list(wa) and gs == ws
    assert all(same_bytes(ga[k], wa[k]) for k in wa), [k for k in wa if not same_bytes(ga[k], wa[k])]
