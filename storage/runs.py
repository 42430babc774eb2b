"""Run indexes and watch records: where they live under a root, how they are written and read.

A run index (``{root}/runs/{run key}.json``, aliased by the config's name) says which artifact each
stage instance of a pipeline run used; a watch record (``{root}/watch/{name}.json``) lists the
checkpoints the ``covgrad-watch`` flow analysed under watch config ``name``.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from covgrad.config import PipelineConfig
from storage.artifacts import ArtifactRef, ArtifactStore, join_url, now


def write_run_index(store: ArtifactStore, cfg: PipelineConfig, key: str, refs: dict[str, ArtifactRef]) -> None:
    """Write ``{root}/runs/{key}.json`` and the friendly alias ``{root}/runs/{name}.json``."""
    record = {
        "run": key,
        "name": cfg.name,
        "written": now(),
        "config": cfg.model_dump(mode="json"),
        "artifacts": {n: {"stage": r.stage, "key": r.key} for n, r in refs.items()},
    }

    if store.local and not os.access(f"{store.base}/runs", os.W_OK) and _indexed(store, (key, cfg.name), record):
        return  # a read-only root whose index already says this: a fully cached run writes nothing
    text = json.dumps(record, indent=1, sort_keys=True)
    store.fs.makedirs(f"{store.base}/runs", exist_ok=True)
    for stem in (key, cfg.name):
        store.write_atomic(_index_path(store, stem), text)


def _indexed(store: ArtifactStore, stems: tuple[str, ...], record: dict[str, Any]) -> bool:
    """True when the run index of every stem exists, has ``record``'s config (but for ``root``: a copied
    root is the same run) and lists each of its artifacts."""
    config = {k: v for k, v in record["config"].items() if k != "root"}
    for stem in stems:
        try:
            index = _read_index(store, _index_path(store, stem))
        except (OSError, ValueError):
            return False
        listed, recorded = index["artifacts"], index.get("config")
        if not isinstance(recorded, dict) or {k: v for k, v in recorded.items() if k != "root"} != config:
            return False
        if any(listed.get(n) != a for n, a in record["artifacts"].items()):
            return False
    return True


def _index_path(store: ArtifactStore, run: str) -> str:
    return f"{store.base}/runs/{run}.json"


def run_index_url(store: ArtifactStore, run: str) -> str:
    """Where the run index of run key or name ``run`` is, as a path or URL under the store's root."""
    return join_url(store.root, "runs", f"{run}.json")


def read_run_index(store: ArtifactStore, run: str) -> dict[str, Any]:
    """The run index for a run key or name; FileNotFoundError listing the known runs otherwise."""

    path = _index_path(store, run)
    if not store.fs.exists(path):
        known = sorted(p.rsplit("/", 1)[-1].removesuffix(".json") for p in store.fs.glob(f"{store.base}/runs/*.json"))
        raise FileNotFoundError(f"no run {run!r} under {store.root}; known runs: {known}")
    return _read_index(store, path)


_warned: set[str] = set()


def _skip_damaged(err: ValueError) -> None:
    """Warn once per process (logger ``covgrad``) about a run index a listing skips."""
    if str(err) not in _warned:
        _warned.add(str(err))
        logging.getLogger("covgrad").warning("skipped: %s", err)


def _read_index(store: ArtifactStore, path: str) -> dict[str, Any]:
    """The run index at ``path``; ValueError naming it when it is not a JSON object with ``artifacts``."""
    try:
        with store.fs.open(path, "r") as f:
            index = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        index, why = None, f"not valid JSON ({err})"
    else:
        why = "not a run index (no 'artifacts' object)"
    if not isinstance(index, dict) or not isinstance(index.get("artifacts"), dict):
        raise ValueError(f"{path} is {why}; rerun `covgrad run` with that run's config to rewrite it, or delete it")
    return index


def referenced_keys(store: ArtifactStore) -> set[tuple[str, str]]:
    """(stage, key) of every artifact some run index refers to."""

    out: set[tuple[str, str]] = set()
    for path in store.fs.glob(f"{store.base}/runs/*.json"):
        for a in _read_index(store, path)["artifacts"].values():
            out.add((a["stage"], a["key"]))
    return out


def _watch_path(store: ArtifactStore, name: str) -> str:
    return f"{store.base}/watch/{name}.json"


def read_watch_record(store: ArtifactStore, name: str) -> dict[str, Any]:
    """The watch record ``{checkpoint name: {path, run, analysed, finding}}`` of watch config ``name``
    ({} when there is none)."""
    path = _watch_path(store, name)
    if not store.fs.exists(path):
        return {}
    with store.fs.open(path, "r") as f:
        return json.load(f)


def write_watch_record(store: ArtifactStore, name: str, record: dict[str, Any]) -> None:
    """Replace the watch record of watch config ``name``."""
    store.fs.makedirs(f"{store.base}/watch", exist_ok=True)
    store.write_atomic(_watch_path(store, name), json.dumps(record, indent=1, sort_keys=True))


def list_runs(store: ArtifactStore) -> list[dict[str, Any]]:
    """Every run under the root, newest first, one row per run key (the name alias is not a second
    run): ``name``, ``run`` (key), ``written``, ``stages`` (complete / all instances), ``headline`` (the
    report's overlap or degenerate finding, "" without a report) and ``report`` (the report artifact ref or
    None). A file that is not a run index is skipped with one warning naming it."""
    rows = []
    for path in store.fs.glob(f"{store.base}/runs/*.json"):
        try:
            index = _read_index(store, path)
        except ValueError as err:
            _skip_damaged(err)
            continue
        if path.rsplit("/", 1)[-1].removesuffix(".json") != index.get("run"):
            continue  # the name alias of a run listed under its key
        refs = {n: store.ref(a["stage"], a["key"]) for n, a in index["artifacts"].items()}
        complete = sum(store.is_complete(r) for r in refs.values())
        report = refs.get("report")
        rows.append(
            {
                "name": index.get("name", ""),
                "run": index["run"],
                "written": index.get("written", ""),
                "stages": f"{complete}/{len(refs)}",
                "headline": _headline(store, report) if report is not None and store.is_complete(report) else "",
                "report": report,
            }
        )
    return sorted(rows, key=lambda r: r["written"], reverse=True)


def _headline(store: ArtifactStore, ref: ArtifactRef) -> str:
    """The report's first finding about G (the overlap sentence, or why there is none)."""
    path = store.path(ref, "report.json")
    if not store.fs.exists(path):
        return ""
    numbers = json.loads(store.fs.cat_file(path)).get("numbers", {})
    words = [w for w in numbers.get("findings", []) if not w.startswith("Task:")]
    return words[0] if words else ""


def runs_of(store: ArtifactStore) -> dict[tuple[str, str], list[str]]:
    """(stage, key) -> the names of the runs whose index refers to that artifact (sorted); a file that is
    not a run index is skipped with one warning naming it."""
    out: dict[tuple[str, str], set[str]] = {}
    for path in store.fs.glob(f"{store.base}/runs/*.json"):
        try:
            index = _read_index(store, path)
        except ValueError as err:
            _skip_damaged(err)
            continue
        for a in index["artifacts"].values():
            out.setdefault((a["stage"], a["key"]), set()).add(str(index.get("name") or index.get("run")))
    return {k: sorted(v) for k, v in out.items()}
