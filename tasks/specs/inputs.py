"""The content digests of the user files a stage reads (task files, reward sources, model directories, imported
rollouts, an external run's checkpoints), which the specs' ``inputs`` hold so that a changed file changes the key;
the planner digests a delta trace's folder whole."""

from __future__ import annotations

import hashlib
import json
import sys
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


def module_origin(name: str) -> str | None:
    """The file module ``name`` (dotted) would be imported from, found as the import system finds it (``sys.modules``,
    then each ``sys.meta_path`` finder, package by package) but without importing it or its parent packages, whose
    ``__init__`` code ``importlib.util.find_spec`` would run; None when it is not found or has no file."""
    spec, path = None, None
    parts = name.split(".")
    for i in range(len(parts)):
        full = ".".join(parts[: i + 1])
        module = sys.modules.get(full)
        spec = getattr(module, "__spec__", None) if module is not None else None
        if spec is None and i and path is None:  # a parent that is not a package has no submodules
            return None
        for finder in [] if spec is not None else sys.meta_path:
            find = getattr(finder, "find_spec", None)
            try:
                spec = find(full, path) if find is not None else None
            except (ImportError, ValueError):
                spec = None
            if spec is not None:
                break
        if spec is None:
            return None
        path = spec.submodule_search_locations
    return getattr(spec, "origin", None)


def task_inputs(t: TaskSection) -> dict[str, str]:
    """Content digests of a JSONL task's prompt file and of its reward function's source file (found without
    importing anything: a plan runs no reward code)."""
    if t.kind != "jsonl":
        return {}
    out = {"task": input_digest(t.path) if t.path else "absent"}
    module = (t.reward or "").partition(":")[0]
    origin = module_origin(module) if module else None
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
    """The digest of an external run's checkpoint series: its steps and each checkpoint's content digest (a
    Trainer checkpoint's with its trainer_state.json; ``"invalid"`` when ``path`` is no series: the stage names
    the problem)."""
    from storage.stores.external import checkpoint_series  # only for an external run

    try:
        series = checkpoint_series(path)
    except ValueError:
        return "invalid"
    listing = json.dumps([[t, input_digest(d, model=True)] for t, d in series.checkpoints])
    return hashlib.sha256(listing.encode()).hexdigest()
