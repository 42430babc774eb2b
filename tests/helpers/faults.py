"""Fault-test helpers: the overrides of the fault runs, a run of a whole stage chain, and digests of every array of a
root."""

from pathlib import Path

from tests.helpers.pipeline import NO_OPTIONAL, run_planned, status_of

OVERRIDES = NO_OPTIONAL


def run_chain(cfg) -> dict[str, str]:
    """Every planned stage through its task function, in order, then the run index; instance →
    computed/cached."""
    from storage.artifacts import ArtifactStore
    from storage.runs import write_run_index
    from tasks.specs import plan

    results = run_planned(cfg)
    write_run_index(ArtifactStore(cfg.root), cfg, plan(cfg).run_key, {n: r.ref for n, r in results.items()})
    return status_of(results)


def digests(directory: Path) -> dict[str, bytes]:
    """Every data file of an artifact (not the bookkeeping files, not zarr.json with its timestamps)."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and not p.name.startswith("_") and p.name != "zarr.json" and p.suffix != ".html"
    }
