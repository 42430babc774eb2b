"""The content digests of the user files a stage reads (task files, reward sources, model directories, imported
rollouts, an external run's checkpoints), which the specs' ``inputs`` hold so that a changed file changes the key."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

from covgrad.config import RegimeSection, SamplerSection, TaskSection
from storage.digests import input_digest


def sampler_inputs(s: SamplerSection, mu: bool) -> dict[str, str]:
    """Content digests of the files sampler ``s``'s rollouts read (another model directory, imported rollouts)
    and, with ``mu`` (sampler-centred scores), μ's model directory."""
    out = {}
    if s.model not in ("policy", "stale"):
        out["model"] = input_digest(s.model, model=True)
    if s.import_path is not None:
        out["import_path"] = input_digest(s.import_path)
    if mu and s.mu_model is not None:
        out["mu_model"] = input_digest(s.mu_model, model=True)
    return out


def task_inputs(t: TaskSection) -> dict[str, str]:
    """Content digests of a JSONL task's prompt file and of its reward function's source file."""
    if t.kind != "jsonl":
        return {}
    out = {"task": input_digest(t.path) if t.path else "absent"}
    module = (t.reward or "").partition(":")[0]
    try:
        found = importlib.util.find_spec(module) if module else None
    except (ImportError, ValueError):
        found = None
    origin = getattr(found, "origin", None)
    out["reward"] = input_digest(origin) if origin and Path(origin).is_file() else "absent"
    return out


def regime_inputs(r: RegimeSection) -> dict[str, str]:
    """Content digests of the teacher and reference model directories a regime reads."""
    return {
        role: input_digest(path, model=True)
        for role, path in (("teacher", r.teacher), ("reference", r.reference))
        if path is not None and path not in ("policy", "stale", "trained")
    }


def series_digest(path: str) -> str:
    """The digest of an external run's checkpoint series: its steps and each checkpoint's content digest
    (``"invalid"`` when ``path`` is no series: the stage names the problem)."""
    from storage.stores.trajectory import checkpoint_series  # torch: imported only for an external run

    try:
        series = checkpoint_series(path)
    except ValueError:
        return "invalid"
    listing = json.dumps([[t, input_digest(d, model=True)] for t, d in series])
    return hashlib.sha256(listing.encode()).hexdigest()
