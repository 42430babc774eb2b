"""Run indexes: which artifact each stage instance of a pipeline run used, by run key or name."""

from __future__ import annotations

import json
from typing import Any

from covgrad.config import PipelineConfig
from storage.artifacts import ArtifactRef, ArtifactStore, now


def write_run_index(store: ArtifactStore, cfg: PipelineConfig, key: str, refs: dict[str, ArtifactRef]) -> None:
    """Write ``{root}/runs/{key}.json`` and the friendly alias ``{root}/runs/{name}.json``."""
    record = {
        "run": key,
        "name": cfg.name,
        "written": now(),
        "config": cfg.model_dump(mode="json"),
        "artifacts": {n: {"stage": r.stage, "key": r.key} for n, r in refs.items()},
    }

    text = json.dumps(record, indent=1, sort_keys=True).encode()
    store.fs.makedirs(f"{store.base}/runs", exist_ok=True)
    for stem in (key, cfg.name):
        store.fs.pipe_file(f"{store.base}/runs/{stem}.json", text)


def read_run_index(store: ArtifactStore, run: str) -> dict[str, Any]:
    """The run index for a run key or name; FileNotFoundError listing the known runs otherwise."""

    path = f"{store.base}/runs/{run}.json"
    if not store.fs.exists(path):
        known = sorted(p.rsplit("/", 1)[-1].removesuffix(".json") for p in store.fs.glob(f"{store.base}/runs/*.json"))
        raise FileNotFoundError(f"no run {run!r} under {store.root}; known runs: {known}")
    with store.fs.open(path, "r") as f:
        return json.load(f)


def referenced_keys(store: ArtifactStore) -> set[tuple[str, str]]:
    """(stage, key) of every artifact some run index refers to."""

    out: set[tuple[str, str]] = set()
    for path in store.fs.glob(f"{store.base}/runs/*.json"):
        with store.fs.open(path, "r") as f:
            for a in json.load(f)["artifacts"].values():
                out.add((a["stage"], a["key"]))
    return out
