"""A run's artifacts as the report reads them, and the report's files as they are written.

``RunArtifacts`` opens the complete artifacts of one run index by instance name (the
``covgrad.report.sections.RunSource`` protocol); ``write_report`` writes a rendered report's files into
one directory of any fsspec file system; ``report_numbers``, ``report_url`` and ``rebuilt_report_dir`` say
where a report's files are.
"""

from __future__ import annotations

import csv
import json
from typing import Any

import fsspec

from covgrad.report import Report
from covgrad.report.document import finite
from storage.artifacts import ArtifactRef, ArtifactStore, join_url


class RunArtifacts:
    """The artifacts of one run index (instance name -> {stage, key}), opened on demand."""

    def __init__(self, store: ArtifactStore, index: dict[str, Any]) -> None:
        self.store = store
        self.refs = {n: store.ref(a["stage"], a["key"]) for n, a in index["artifacts"].items()}
        self.missing = [n for n, r in self.refs.items() if n != "report" and not store.is_complete(r)]

    def has(self, instance: str) -> bool:
        """True when the run has ``instance`` and its artifact is complete."""
        return instance in self.refs and instance not in self.missing

    def group(self, instance: str, name: str) -> Any:
        """The zarr group ``name`` of ``instance``, read-only."""
        return self.store.open_group(self.refs[instance], name, mode="r")

    def json(self, instance: str, name: str) -> Any:
        """The JSON file ``name`` of ``instance``."""
        return self.store.read_json(self.refs[instance], name)

    def csv(self, instance: str, name: str) -> list[dict[str, str]]:
        """The rows of the CSV file ``name`` of ``instance``."""
        with self.store.fs.open(self.store.path(self.refs[instance], name), "r") as f:
            return list(csv.DictReader(f))


def write_report(fs: fsspec.AbstractFileSystem, directory: str, report: Report) -> list[str]:
    """Write the report's files into ``directory`` of ``fs`` and delete PNGs there that this report
    does not have (left by an earlier render); returns the written paths."""
    fs.makedirs(directory, exist_ok=True)
    for stale in fs.glob(f"{directory.rstrip('/')}/*.png"):
        if stale.rsplit("/", 1)[-1] not in report.plots:
            fs.rm(stale)
    files: dict[str, bytes] = {
        "report.md": report.markdown().encode(),
        "report.html": report.html().encode(),
        "headline.md": report.headline_markdown().encode(),
        "report.json": json.dumps(
            {"numbers": report.numbers, "missing": report.missing}, indent=1, default=finite
        ).encode(),
        **report.plots,
    }
    paths = []
    for name, data in files.items():
        path = f"{directory.rstrip('/')}/{name}"
        fs.pipe_file(path, data)
        paths.append(path)
    return paths


def report_numbers(store: ArtifactStore, ref: ArtifactRef) -> dict[str, Any] | None:
    """``report.json`` of report artifact ``ref`` (``numbers`` and ``missing``), or None when absent."""
    path = store.path(ref, "report.json")
    return json.loads(store.fs.cat_file(path)) if store.fs.exists(path) else None


def report_url(store: ArtifactStore, ref: ArtifactRef, name: str = "report.html") -> str:
    """Path or URL (under the store's root) of file ``name`` of report artifact ``ref``."""
    return join_url(store.root, ref.stage, ref.key, name)


def rebuilt_report_dir(store: ArtifactStore, run: str) -> str:
    """The one report location of run ``run`` (its name): ``{root}/_reports/{run}``, where ``covgrad run``
    copies the report stage's files and ``covgrad report RUN`` writes a report rebuilt from the stores."""
    return join_url(store.root, "_reports", run)


def publish_report(store: ArtifactStore, ref: ArtifactRef, run: str) -> str:
    """Copy the files of report artifact ``ref`` to the run's report location (``rebuilt_report_dir``),
    replacing what an earlier render left there; returns the path or URL of its ``report.html``."""
    src = store.path(ref)
    dst = f"{store.base}/_reports/{run}"
    store.fs.makedirs(dst, exist_ok=True)
    names = {p.rsplit("/", 1)[-1] for p in store.fs.ls(src, detail=False)}
    files = {n for n in names if n.endswith((".md", ".html", ".json", ".png")) and not n.startswith((".", "_"))}
    for stale in store.fs.ls(dst, detail=False):
        if stale.rsplit("/", 1)[-1] not in files:
            store.fs.rm(stale)
    for n in sorted(files):
        store.fs.pipe_file(f"{dst}/{n}", store.fs.cat_file(f"{src}/{n}"))
    return join_url(rebuilt_report_dir(store, run), "report.html")
